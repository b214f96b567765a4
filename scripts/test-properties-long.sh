#!/usr/bin/env bash
# The longer randomized run of the property tests, outside CI: ROUNDS runs (default 20) of every
# Hypothesis test on the 'random' profile (a new seed each run, no example database), stopping at
# the first failure, whose reproduction hypothesis prints (@reproduce_failure and the steps).
# CI runs the same tests on the derandomized 'ci' profile (conftest.py).
#   bash scripts/test-properties-long.sh [ROUNDS] [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-20}"; shift || true
FILES=$(grep -rl --include="test_*.py" "from hypothesis" tests server_shim/tests | sort)
export LLM_BACKOFF_HYPOTHESIS_PROFILE=random
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS"
  # shellcheck disable=SC2086
  "$ROOT/.venv/bin/pytest" -q -p no:cacheprovider -x $FILES "$@"
done
