#!/usr/bin/env bash
# Create (or reuse) .venv with both distributions installed editable, plus test tools and the
# shim's `lab` extra (the plots of the demo and calibrate).
# Usage: source scripts/setup-venv.sh   (sets VENV)
# SDK_EXTRAS names the SDK's extras to install (default: test,redis).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# This machine's pip config names local mirrors that may not exist; its warnings about them are noise.
"$VENV/bin/python" -m pip install -q -e "$ROOT[${SDK_EXTRAS:-test,redis}]" -e "$ROOT/server_shim[redis,lab]" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
export VENV
