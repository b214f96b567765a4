#!/usr/bin/env bash
# Create (or reuse) .venv with both distributions installed editable, plus test tools and the
# shim's `lab` extra (the plots of the demo and calibrate).
# Usage: source scripts/setup-venv.sh   (sets VENV)
# SDK_EXTRAS names the SDK's extras to install (default: test,redis).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
source "$ROOT/scripts/venv-install.sh"
venv_install "$VENV" -e "$ROOT[${SDK_EXTRAS:-test,redis}]" -e "$ROOT/server_shim[redis,lab]"
export VENV
