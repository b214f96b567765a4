#!/usr/bin/env bash
# Install everything the tests need (venvs, redis-server) and run lint, types and tests:
#   1. ruff + mypy --strict over both packages
#   2. the whole suite on openai 3.x (httpx2)
#   3. the SDK suite again on openai 2.x (httpx), in a second venv
#   4. the shim's end-to-end tests again on its public HTTP path (docs/shim.md, "Serving paths")
#   5. the shim suite with its dependencies at their declared floors (scripts/test-shim-floors.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Redis for the shared-limit tests: a real server on loopback.
if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
REDIS_PORT="${LLM_BACKOFF_TEST_REDIS_PORT:-6399}"
REDIS_DIR="$(mktemp -d)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$REDIS_DIR" --daemonize yes --pidfile "$REDIS_DIR/redis.pid" >/dev/null
trap 'kill "$(cat "$REDIS_DIR/redis.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$REDIS_DIR"' EXIT
export LLM_BACKOFF_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"

echo "== installing .venv (openai 3.x)"
source scripts/setup-venv.sh
"$VENV/bin/python" -c 'import openai; print("openai", openai.__version__)'
# The light third-party clients of docs/integrations.md (tests/integrations, in the main run).
"$VENV/bin/python" -m pip install -q -e "$ROOT[integrations]" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

echo "== ruff"
"$VENV/bin/ruff" check .
echo "== mypy --strict"
"$VENV/bin/mypy"

echo "== pytest (openai 3.x)"
"$VENV/bin/pytest" -q -p no:cacheprovider "$@"

echo "== pytest: the shim's end-to-end tests on the public HTTP path"
"$VENV/bin/pytest" -q -p no:cacheprovider --shim-http-path=public \
  $(grep -rl --include="test_*.py" "make_shim\|shim_server\|run_soak" server_shim/tests)
bash scripts/test-shim-floors.sh

echo "== installing .venv-openai2 (openai 2.x on httpx)"
VENV2="$ROOT/.venv-openai2"
[ -x "$VENV2/bin/python" ] || python3 -m venv "$VENV2"
"$VENV2/bin/python" -m pip install -q -e "$ROOT[test,redis]" -e "$ROOT/server_shim" "openai>=2,<3" httpx \
  "instructor>=1.17" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$VENV2/bin/python" -c 'import openai; print("openai", openai.__version__)'
echo "== pytest tests/sdk (openai 2.x)"
"$VENV2/bin/pytest" -q -p no:cacheprovider tests/sdk -m "not openai3"
echo "== pytest tests/integrations (openai 2.x: instructor)"
"$VENV2/bin/pytest" -q -p no:cacheprovider tests/integrations -m integrations
bash scripts/test-sdk-floors.sh  # tests/sdk at the lowest openai 2.x and 3.x allowed
