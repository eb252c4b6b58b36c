#!/usr/bin/env bash
# buf lint (STANDARD + COMMENTS rules, proto/buf.yaml) with the buf binary from the buf-bin wheel.
set -euo pipefail
cd "$(dirname "$0")/../proto"
VENV=${VENV:-../.venv}
BUF="$VENV/bin/buf"
if [ ! -x "$BUF" ]; then
  echo "error: $BUF not found; run 'make install' (the test extras install buf-bin)" >&2
  exit 1
fi
"$BUF" lint
"$BUF" format --diff --exit-code
echo "buf lint: clean"
