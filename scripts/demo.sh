#!/usr/bin/env bash
# The main job: install into .venv, then run the overload demo on the built-in simulator.
# No GPU, no network. Extra arguments go to `llm-backoff-shim demo` (e.g. --quick, --out DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-venv.sh"
exec "$VENV/bin/llm-backoff-shim" demo "$@"
