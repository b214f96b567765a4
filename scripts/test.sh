#!/usr/bin/env bash
# Install everything the tests need (venvs, redis-server) and run lint, types and every suite.
#
#   bash scripts/test.sh [pytest args for the main suite]
#
# What runs, each check once per thing it proves:
#   ruff + mypy --strict           both packages
#   main     the whole suite (SDK, shim, integrations) on openai 3.x, newest dependencies,
#            shims on the serving path the start-up check picks (the fast one)
#   public   the shim's HTTP-layer end-to-end tests (serve/, http/; scripts/http-e2e-files.sh) on
#            its public HTTP path (docs/shim.md, "Serving paths")
#   floors   the shim's runtime dependencies at their declared floors: the tests that reach them
#            on the fast path, and the HTTP-layer end-to-end tests on the public path
#            (scripts/test-shim-floors.sh, whose header says which and why)
#   openai2  the SDK suite and the instructor recipe on openai 2.x (httpx), in .venv-openai2
#   sdk-floors  the SDK suite at the lowest openai 2.x and 3.x allowed (scripts/test-sdk-floors.sh)
#
# The end-to-end tests that run a real server on loopback cover each behaviour once per serving
# path, not once per feature that touches it. The two paths differ below the proxy's ASGI
# interface only (parsing, framing, head and body limits, refusal from the head, keep-alive,
# pipelining, streaming writes, the disconnect signal): the tests of that layer, serve/ and
# http/, run on both paths. What sits above it reads the same on either path and runs once, on
# the fast path in `main`: decide/'s admission, shares and SLO; fleet/'s balancers, Redis quotas
# and Prometheus rules; the lab's soak, demo, loadgen and calibrate; the docs' examples. (The
# public path under disconnects, mixed outcomes and hostile input, which the soak also touches,
# is serve/test_proxy.py, test_hostile.py, test_hostile_wire.py and test_e2e_sim.py.)
#
# Most tests wait on loopback I/O, not the CPU, so each suite is spread over pytest-xdist
# workers and the suites run in two lanes at once; a lane's output goes to a log that is
# printed when it ends. The lanes start once the main venv is installed; the other venvs
# install meanwhile, and a step that needs one waits for it. The lanes end with the steps that
# mostly wait on their tests' timeouts (the floors' public run, the SDK floors: about a fifth of
# one core when they ran alone), on more workers than cores; the lanes carry about the same work.
# Property tests run on the derandomized ``ci`` Hypothesis profile
# (conftest.py): no saved example and no luck decides a run. The suite's time is printed last.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STARTED=$(date +%s)
LOGS="$(mktemp -d)"
export LLM_BACKOFF_HYPOTHESIS_PROFILE="${LLM_BACKOFF_HYPOTHESIS_PROFILE:-ci}"
# Bytecode caches are written (gitignored __pycache__/): the run starts hundreds of Python
# processes (xdist workers, child shims and engines, CLI runs) over the same sources, and with
# PYTHONDONTWRITEBYTECODE set each compiled the project's modules and rewrote every test
# module's asserts again, seconds of CPU per worker on a 2-core machine.
unset PYTHONDONTWRITEBYTECODE
elapsed() { echo "$(( $(date +%s) - STARTED )) s"; }

# Real servers from Debian's packages, on loopback: Redis for the shared limits; nginx,
# HAProxy and Prometheus for the fleet tests (several shims behind a load balancer). Each test
# starts its own instance with its own config on its own ports; the packages' services are not used.
missing=()
for pair in redis-server:redis-server nginx:nginx-light haproxy:haproxy prometheus:prometheus; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
REDIS_PORT="${LLM_BACKOFF_TEST_REDIS_PORT:-6399}"
REDIS_DIR="$(mktemp -d)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$REDIS_DIR" --daemonize yes --pidfile "$REDIS_DIR/redis.pid" >/dev/null
INSTALL_PIDS=()
cleanup() {
  [ "${#INSTALL_PIDS[@]}" -eq 0 ] || kill "${INSTALL_PIDS[@]}" 2>/dev/null || true
  kill "$(cat "$REDIS_DIR/redis.pid" 2>/dev/null)" 2>/dev/null || true
  rm -rf "$REDIS_DIR" "$LOGS"
}
trap cleanup EXIT
export LLM_BACKOFF_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"

source scripts/venv-install.sh

# -- installs: five venvs at once, with uv (scripts/venv-install.sh) -----------------------------
install_main() {
  # With the light third-party clients of docs/integrations.md (tests/integrations, in the main
  # run), in the same install.
  SDK_EXTRAS=test,redis,integrations source scripts/setup-venv.sh
  "$VENV/bin/python" -c 'import openai; print("openai", openai.__version__)'
}
install_openai2() {
  local venv="$ROOT/.venv-openai2"
  venv_install "$venv" -e "$ROOT[test,redis]" -e "$ROOT/server_shim" "openai>=2,<3" httpx "instructor>=1.17"
  "$venv/bin/python" -c 'import openai; print("openai", openai.__version__)'
}
# The main venv is all that lint and the first step of each lane need: they start once it is in,
# while the other venvs go on installing; a later step waits for its own venv's install
# (``installed``). An install's status and time land in a file when it ends.
echo "== installing .venv, .venv-openai2, .venv-shim-floors, .venv-floor2, .venv-floor3"
declare -A INSTALLS=(
  [main]="install_main"
  [openai2]="install_openai2"
  [shim-floors]="LLM_BACKOFF_INSTALL_ONLY=1 bash scripts/test-shim-floors.sh"
  [sdk-floors]="LLM_BACKOFF_INSTALL_ONLY=1 bash scripts/test-sdk-floors.sh"
)
install() {  # install NAME: run that install into its log, then write its status and time
  local name="$1" t0 status=0
  t0=$(date +%s)
  ( eval "${INSTALLS[$name]}" ) >"$LOGS/install-$name.log" 2>&1 || status=$?
  echo "$status $(( $(date +%s) - t0 ))" >"$LOGS/installed-$name.tmp"
  mv "$LOGS/installed-$name.tmp" "$LOGS/installed-$name"
}
installed() {  # installed NAME: wait for that install to end; succeed if it did
  local status seconds
  while [ ! -f "$LOGS/installed-$1" ]; do sleep 0.5; done
  read -r status seconds <"$LOGS/installed-$1"
  [ "$status" = 0 ]
}
INSTALL_PIDS=()
for name in "${!INSTALLS[@]}"; do
  install "$name" &
  INSTALL_PIDS+=("$!")
done
if ! installed main; then
  cat "$LOGS/install-main.log"; echo "== installing main failed"; exit 1
fi
cat "$LOGS/install-main.log"
VENV="$ROOT/.venv"
echo "== installed .venv ($(elapsed)); the other venvs install on while lint and the lanes run"

HTTP_E2E_FILES=$(bash scripts/http-e2e-files.sh)
PYTEST=(-q -p no:cacheprovider --durations=5)

# -- the suites, in two lanes ------------------------------------------------------------------
step() {  # step NAME VENV CMD...: once install VENV is in, run one suite into its log; record its status and time
  local name="$1" venv="$2"; shift 2
  local t0 status=0
  if ! installed "$venv"; then
    { cat "$LOGS/install-$venv.log"; echo "== installing $venv failed"; } >"$LOGS/step-$name.log"
    echo "1 0" >"$LOGS/status-$name"
    return 0
  fi
  t0=$(date +%s)
  "$@" >"$LOGS/step-$name.log" 2>&1 || status=$?
  echo "$status $(( $(date +%s) - t0 ))" >"$LOGS/status-$name"
  return 0
}
lane_a() {  # each lane draws child servers' ports from its own block (conftest.py)
  export LLM_BACKOFF_TEST_PORT_LANE=0
  step main main "$VENV/bin/pytest" "${PYTEST[@]}" -n 4 "$@"
  step openai2 openai2 "$ROOT/.venv-openai2/bin/pytest" "${PYTEST[@]}" -n 2 tests/sdk -m "not openai3"
  step openai2-integrations openai2 "$ROOT/.venv-openai2/bin/pytest" "${PYTEST[@]}" tests/integrations -m integrations
  step sdk-floors sdk-floors env LLM_BACKOFF_XDIST=3 bash scripts/test-sdk-floors.sh --durations=5
}
lane_b() {
  export LLM_BACKOFF_TEST_PORT_LANE=1
  # shellcheck disable=SC2086
  step public main "$VENV/bin/pytest" "${PYTEST[@]}" -n 2 --shim-http-path=public $HTTP_E2E_FILES
  step shim-floors shim-floors env LLM_BACKOFF_XDIST=3 LLM_BACKOFF_FLOORS_PART=suite bash scripts/test-shim-floors.sh
  step shim-floors-public shim-floors env LLM_BACKOFF_XDIST=4 LLM_BACKOFF_FLOORS_PART=public bash scripts/test-shim-floors.sh
}
lint() {  # both run; either failing fails the step
  local status=0
  echo "== ruff"
  "$VENV/bin/ruff" check . || status=1
  echo "== mypy --strict"
  "$VENV/bin/mypy" || status=1
  return "$status"
}
# Lint and types (about ten seconds of one core) run beside the lanes; their output is printed
# first among the results, and either failing fails the run.
step lint main lint &
LINT=$!
echo "== pytest: two lanes (main, openai2, openai2-integrations, sdk-floors | public, shim-floors, shim-floors-public)"
lane_a "$@" &
LANE_A=$!
lane_b &
LANE_B=$!
wait "$LANE_A" "$LANE_B" "$LINT"

for name in openai2 shim-floors sdk-floors; do
  read -r status seconds <"$LOGS/installed-$name"
  echo "== installed $name (${seconds} s, exit $status)"
  cat "$LOGS/install-$name.log"
done

FAILED=()
for name in lint main public shim-floors shim-floors-public openai2 openai2-integrations sdk-floors; do
  read -r status seconds <"$LOGS/status-$name"
  if [ "$name" = lint ]; then echo "== ruff and mypy --strict (${seconds} s, exit $status)"; else echo "== pytest $name (${seconds} s, exit $status)"; fi
  cat "$LOGS/step-$name.log"
  [ "$status" = 0 ] || FAILED+=("$name")
done

echo "== the whole run took $(elapsed)"
# One closing line over every suite, from pytest's own summary lines.
"$VENV/bin/python" - "$LOGS" <<'PY'
import pathlib
import re
import sys

totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for log in sorted(pathlib.Path(sys.argv[1]).glob("step-*.log")):
    for line in log.read_text(errors="replace").splitlines():
        if re.search(r"\d+ (passed|failed)", line) and (" in " in line):
            for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
                totals["error" if word.startswith("error") else word] += int(count)
print(f"total: {totals['passed']} passed, {totals['failed'] + totals['error']} failed, "
      f"{totals['skipped']} skipped")
PY
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "== failed: ${FAILED[*]}"
  exit 1
fi
