#!/usr/bin/env bash
# Run the test suite; pytest's "no tests collected" (exit 5) counts as a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
