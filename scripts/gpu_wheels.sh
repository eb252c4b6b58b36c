#!/usr/bin/env bash
# Download the wheels that scripts/gpu_wheels.txt lists into .whl/ (git-ignored), for the GPU
# machine's Python 3.12 on x86-64 Linux, so they can travel with a device call that has no
# network. Run it where pip reaches a package registry:
#
#   scripts/gpu_wheels.sh [DIR]     (default: .whl; PYTHON picks the interpreter whose pip runs)
#
# --no-deps: each needed package is listed by name, so nothing else is fetched. The platforms run
# up to manylinux_2_34 (the GPU image's glibc is newer): llguidance ships only a 2_31 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mapfile -t REQUIREMENTS < <(grep -vE '^[[:space:]]*(#|$)' scripts/gpu_wheels.txt | awk '{print $1}')
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # a stale version beside the pinned one would stop the install there
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${REQUIREMENTS[@]}"
echo "wheels for the GPU machine in $DEST/ (carry it: the device call's carry names $DEST):"
ls -1 "$DEST"
du -sh "$DEST"
