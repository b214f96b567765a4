#!/usr/bin/env bash
# The SDK suite (tests/sdk) at the lowest versions pyproject.toml allows, beside the newest that
# scripts/test.sh runs:
#   .venv-floor2: openai 2.0.0 on httpx 0.25.1   (tests/sdk -m "not openai3")
#   .venv-floor3: openai 3.0.0 on httpx2 2.7.0   (tests/sdk)
# both with anthropic 2.0.0. A venv is reused while its pins and pyproject.toml are unchanged.
# Usage: bash scripts/test-sdk-floors.sh [pytest args]
# LLM_BACKOFF_INSTALL_ONLY=1 only installs; LLM_BACKOFF_XDIST=N spreads each run over N workers.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/venv-install.sh"

FLOOR2=(openai==2.0.0 httpx==0.25.1 anthropic==2.0.0)
FLOOR3=(openai==3.0.0 httpx2==2.7.0 anthropic==2.0.0)

floor_venv() {  # floor_venv DIR PIN...: create or reuse DIR with the package and the pins installed
  local venv="$1"; shift
  local stamp="$venv/.llm-backoff-floor"
  local want; want="$* $(sha256sum pyproject.toml | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "== installing $venv ($*)"
    venv_install "$venv" -e "$ROOT[test]" "$@"
    echo "$want" > "$stamp"
  fi
  "$venv/bin/python" -c 'import importlib.metadata as m; print("  ", ", ".join(f"{d} {m.version(d)}" for d in ("openai", "httpx", "httpx2", "anthropic")))'
}

floor_venv "$ROOT/.venv-floor2" "${FLOOR2[@]}"
floor_venv "$ROOT/.venv-floor3" "${FLOOR3[@]}"
[ -z "${LLM_BACKOFF_INSTALL_ONLY:-}" ] || exit 0
XDIST=(); [ -z "${LLM_BACKOFF_XDIST:-}" ] || XDIST=(-n "$LLM_BACKOFF_XDIST")

echo "== pytest tests/sdk (lowest openai 2.x)"
"$ROOT/.venv-floor2/bin/pytest" -q -p no:cacheprovider "${XDIST[@]}" tests/sdk -m "not openai3" "$@"
echo "== pytest tests/sdk (lowest openai 3.x)"
"$ROOT/.venv-floor3/bin/pytest" -q -p no:cacheprovider "${XDIST[@]}" tests/sdk "$@"
