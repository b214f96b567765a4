#!/usr/bin/env bash
# The shim's declared lower bounds, proven: a venv (.venv-shim-floors) with every runtime
# dependency of server_shim/pyproject.toml and of its `lab` extra (which the lab's tests
# need) at the oldest version its bound allows (as
# `pip index versions` lists them), then the shim's tests that use those libraries on it, on
# whichever HTTP path the start-up capability check picks there (docs/shim.md, "Serving paths"),
# and the HTTP layer's end-to-end tests again on the public path.
#
#   bash scripts/test-shim-floors.sh [pytest args]     (default: the tests below)
#
# What the floors prove is that those versions work, so the run is every test that reaches a
# floor-pinned library through one of the ways the shim uses it, not the whole suite:
#   serve/, http/  serving on uvicorn (httptools' fast path here; h11's public path in the
#                  second run), the Starlette app and the operations listener, the relay's
#                  upstream client (httptools) and the aiohttp session beside it (readiness
#                  probes, engine-metrics scrapes, /tokenize),
#                  /metrics (prometheus-client), settings from flags, variables and --config
#                  files (pydantic, pydantic-settings), tenants files (pydantic)
#   sim/           the simulator: Starlette, uvicorn, pydantic, prometheus-client
#   lab/test_calibrate.py, lab/test_calibrate_config.py
#                  calibrate: aiohttp's client and its failures, matplotlib's PNG, the file
#                  `serve --config` reads back
#   test_docs_reference.py, test_deploy_files.py
#                  the settings' fields as pydantic describes them; the deploy files' settings
# Left to the newest versions, where `main` runs them: decide/ (pure; the tenants model's
# parsing is serve/test_tenants.py's), fleet/ (nginx, HAProxy, Redis and Prometheus in front of
# and beside the same serving, metrics and quota code), the lab's other tools and the docs'
# examples, which reach those libraries only through the code above. Checked with coverage
# (subprocesses included): of every line of the nine libraries that the whole shim suite ran at
# the floors (the demo and the soak aside, as the floors run left them then), this set runs all but
# one of h11's, its keep-alive rule for an HTTP/1.0 message, which the public-path run below
# reaches with serve/test_hostile_wire.py's HTTP/1.0 request. Of the shim's own modules that
# import them, the lines left out make no call into them that other lines do not make (the
# adaptive limit's gauge, a settings validator's error, a class map's parse error), and
# lab/soak.py, which the floors never ran, is the only module left out whole.
#
# LLM_BACKOFF_INSTALL_ONLY=1 only installs; LLM_BACKOFF_XDIST=N spreads each run over N workers;
# LLM_BACKOFF_FLOORS_PART=suite|public runs only the tests above or only the HTTP layer's
# end-to-end tests on the public path (default: both), so CI can run them in different lanes.
#
# Test tools and the SDK come at their newest allowed versions: only the shim's own
# runtime dependencies are held at their floors.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV_FLOORS="${VENV_FLOORS:-$ROOT/.venv-shim-floors}"
source "$ROOT/scripts/venv-install.sh"

# The install is reused while pyproject.toml files are unchanged (a stamp beside it).
STAMP="$VENV_FLOORS/.llm-backoff-floors"
WANT="$(cat pyproject.toml server_shim/pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
venv_install "$VENV_FLOORS" packaging

# One constraint per runtime dependency: name==the oldest released version its specifier allows.
CONSTRAINTS="$VENV_FLOORS/floors.txt"
"$VENV_FLOORS/bin/python" - "$ROOT/server_shim/pyproject.toml" "$CONSTRAINTS" <<'EOF'
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

pyproject, out = sys.argv[1], sys.argv[2]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
deps = project["dependencies"] + project["optional-dependencies"]["lab"]
lines = []
for text in deps:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate():
        continue
    if not req.specifier:  # the SDK, installed from this checkout
        continue
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", req.name],
        capture_output=True, text=True, check=True,
    ).stdout
    available = listing.split("Available versions:", 1)[1].splitlines()[0]
    versions = sorted(Version(v.strip()) for v in available.split(",") if v.strip())
    allowed = [v for v in versions if not v.is_prerelease and req.specifier.contains(v)]
    if not allowed:
        sys.exit(f"no released version of {req.name} satisfies {req.specifier}")
    lines.append(f"{req.name}=={allowed[0]}")
    print(f"floor: {req.name}=={allowed[0]}  ({text})")
# Wheels built against numpy 1.x (matplotlib 3.8.0) cannot import under numpy 2.
lines.append("numpy<2")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
EOF

echo "== installing $VENV_FLOORS (the shim's runtime dependencies at their floors)"
venv_install "$VENV_FLOORS" -c "$CONSTRAINTS" \
  -e "$ROOT[test,redis]" -e "$ROOT/server_shim[redis,lab]"
"$VENV_FLOORS/bin/python" - <<'EOF'
from importlib.metadata import version

names = ["uvicorn", "starlette", "httptools", "h11", "aiohttp", "prometheus-client", "pydantic",
         "pydantic-settings", "matplotlib"]
print("installed:", ", ".join(f"{n} {version(n)}" for n in names))
from llm_backoff_shim.http.capability import fast_path_problem

problem = fast_path_problem()
print("serving path:", "fast" if problem is None else f"public (fast path unavailable: {problem})")
EOF
echo "$WANT" >"$STAMP"
fi
[ -z "${LLM_BACKOFF_INSTALL_ONLY:-}" ] || exit 0
XDIST=(); [ -z "${LLM_BACKOFF_XDIST:-}" ] || XDIST=(-n "$LLM_BACKOFF_XDIST")

PART="${LLM_BACKOFF_FLOORS_PART:-both}"
WHOLE=""
if [ "$#" -eq 0 ]; then
  WHOLE=1
  T=server_shim/tests
  set -- $T/serve $T/http $T/sim $T/lab/test_calibrate.py $T/lab/test_calibrate_config.py \
    $T/test_docs_reference.py $T/test_deploy_files.py
fi
if [ "$PART" != public ]; then
  echo "== pytest: the shim's tests that use its dependencies, at their floors"
  "$VENV_FLOORS/bin/pytest" -q -p no:cacheprovider --durations=5 "${XDIST[@]}" "$@"
fi
if [ -n "$WHOLE" ] && [ "$PART" != suite ]; then
  # The fallback on the oldest uvicorn too: the end-to-end tests of the HTTP layer (serve/, http/),
  # where the two paths differ, on the public path. The ones above it (lab/, decide/) reach the
  # shim through either path alike; they run on the public path at the newest versions.
  echo "== pytest: the shim's HTTP-layer end-to-end tests on the public HTTP path (floors)"
  "$VENV_FLOORS/bin/pytest" -q -p no:cacheprovider "${XDIST[@]}" --shim-http-path=public \
    $(bash scripts/http-e2e-files.sh)
fi
