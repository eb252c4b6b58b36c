#!/usr/bin/env bash
# Build llama.cpp's own HTTP server, `llama-server`, for the full-stack comparison of
# `python -m bench.run --model FILE.gguf` (bench/llama_server.py), and its `llama-quantize`, which
# makes the K-quant files (Q4_K_M, Q6_K, ...) users download from a GGUF file (bench/quantize.py).
# Optional: nothing else needs them.
#
#   scripts/build_llama_server.sh [DEST]     (default: .bench; the binaries land in DEST/bin)
#
# The source is the llama.cpp that llama-cpp-python vendors, fetched as that package's source
# distribution through pip (the version installed in PYTHON's environment when there is one, so
# the in-process and the server comparisons run the same llama.cpp), built with the machine's own
# SIMD (GGML_NATIVE) less its AMX int8 path, which segfaults on CPUs with AMX in this llama.cpp
# (bench/llamacpp.py says more; elsewhere the flag changes nothing), statically, without the web
# UI, TLS or curl. About 8 minutes on 2 cores.
# The same source's HF-to-GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its
# gguf-py) is kept in DEST/converter: tests/worker/test_llama_cpp_converter.py checks that files
# it writes load as their Hugging Face checkpoints do.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$(realpath -m "${1:-.bench}")
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
VERSION=$("$PYTHON" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)
SPEC="llama-cpp-python${VERSION:+==$VERSION}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "fetching the source of $SPEC"
"$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$WORK" "$SPEC" 2>&1 \
  | grep -v '^WARNING: Location' || true
ls "$WORK"/llama_cpp_python-*.tar.gz > /dev/null
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { echo "no llama.cpp server source in $SPEC" >&2; exit 1; }

echo "building llama-server and llama-quantize (${MAX_JOBS:-$(nproc)} jobs)"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8 \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$WORK/configure.log" 2>&1 \
  || { tail -30 "$WORK/configure.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server llama-quantize -j "${MAX_JOBS:-$(nproc)}" > "$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log" >&2; exit 1; }
mkdir -p "$DEST/bin"
for tool in llama-server llama-quantize; do
  install -m 755 "$WORK/build/bin/$tool" "$DEST/bin/$tool"
  echo "$SPEC" > "$DEST/bin/$tool.version"
done
rm -rf "$DEST/converter"
mkdir -p "$DEST/converter"
cp "$SRC/convert_hf_to_gguf.py" "$DEST/converter/"
cp -r "$SRC/gguf-py" "$DEST/converter/"
[ -d "$SRC/conversion" ] && cp -r "$SRC/conversion" "$DEST/converter/"
echo "$SPEC" > "$DEST/converter/version"
echo "built llama-server and llama-quantize in $DEST/bin from $SPEC (and kept its converter)"
