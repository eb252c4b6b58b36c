"""The GGUF files users download, made from one with llama.cpp's own `llama-quantize`.

    python -m bench.quantize                          # the default model as Q4_K_M, Q6_K, Q8_0
    python -m bench.quantize --model F.gguf --types Q4_K_M,Q5_K_M
    python -m bench.quantize --shape llama-3.2-1b     # a ~1B random-weight file, Q4_0 and Q4_K_M
    python -m bench.run --model .bench/models/SmolLM2-135M-Instruct.Q4_K_M.gguf

`make llama-quantize` builds the tool from the same llama.cpp source as `make llama-server`
(scripts/build_llama_server.sh). A file that is not float already is re-quantized with
`--allow-requantize` (the default model ships as Q4_1), as a user re-quantizing a download
would. Files land in .bench/models (git-ignored) and are made once; the tool's log says which
tensors fell back to another type (rows that are no whole number of 256-weight blocks take
Q5_0 for Q4_K and Q8_0 for Q6_K). Prints each file's path and its tensor types.

The 1- to 3-bit i-quant types (IQ3_XXS, IQ2_*, IQ1_*) refuse to run without an importance matrix
(`llama-imatrix`'s per-column sums of squared activations over a calibration text). For those,
`uniform_imatrix` writes one in which every column weighs the same, which is what llama-quantize
assumes for the other types: the files are for timing and for comparing ShardLM's kernels with
llama.cpp's on the same bytes, not for the quality a real calibration would give.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf

from bench import llama_server
from bench.random_gguf import RANDOM_SHAPES, write_random_llama
from bench.serve_process import REPO

BUILD_HINT = "make llama-quantize"
OUT = REPO / ".bench" / "models"
DEFAULT_TYPES = ("Q4_K_M", "Q6_K", "Q8_0")
SHAPE_TYPES = ("Q4_0", "Q4_K_M")  # --shape: the issue's ~1B figures


def binary() -> Path | None:
    """$LLAMA_QUANTIZE, else the one `make llama-quantize` built, else PATH."""
    return llama_server.built_tool("llama-quantize", "LLAMA_QUANTIZE")


#: llama-quantize types that need an importance matrix (for some or all of their tensors).
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")


def uniform_imatrix(model: Path, out: Path) -> Path:
    """An importance matrix of ones for every matrix of `model`, in llama.cpp's legacy imatrix
    format: an int32 count, then per tensor its name (int32 length, bytes), the calls (int32, 1),
    the values (int32 count, float32 each: one per input column)."""
    entries = [(t.name.encode(), int(t.shape[0])) for t in gguf.GGUFReader(model).tensors
               if len(t.shape) == 2]
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, columns in entries:
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, columns))
            f.write(struct.pack(f"<{columns}f", *([1.0] * columns)))
    return out


def quantized(model: Path, qtype: str, exe: Path, threads: int) -> Path:
    """`model` as `qtype` (a llama-quantize type name), made unless already there."""
    stem = model.name.removesuffix(".gguf").rsplit(".", 1)[0]
    out = OUT / f"{stem}.{qtype}.gguf"
    if out.is_file():
        return out
    OUT.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    imatrix = []
    if qtype in NEEDS_IMATRIX:
        imatrix = ["--imatrix", str(uniform_imatrix(model, OUT / f"{stem}.uniform.imatrix"))]
    done = subprocess.run([str(exe), "--allow-requantize", *imatrix, str(model), str(partial),
                           qtype, str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{done.stderr[-2000:]}")
    partial.rename(out)
    return out


def tensor_types(path: Path) -> str:
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)
    return ", ".join(f"{n} x {name}" for name, n in counts.most_common())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="GGUF file; default: SmolLM2")
    source.add_argument("--shape", choices=RANDOM_SHAPES,
                        help="instead of a file: this shape with random weights and the default "
                        "model's tokenizer (bench/random_gguf.py), written once as float16")
    parser.add_argument("--types", help="llama-quantize type names, comma-separated (default: "
                        f"{','.join(DEFAULT_TYPES)}; with --shape {','.join(SHAPE_TYPES)})")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    exe = binary()
    if exe is None:
        print(f"no llama-quantize (build it: {BUILD_HINT})", file=sys.stderr)
        return 1
    from shardlm_server.gateway.serve.default_model import default_model_path

    types = args.types or ",".join(SHAPE_TYPES if args.shape else DEFAULT_TYPES)
    if args.shape:
        args.model = OUT / f"{args.shape}-random.F16.gguf"
        if not args.model.is_file():
            OUT.mkdir(parents=True, exist_ok=True)
            print(f"writing {args.model} (random weights) ...", flush=True)
            write_random_llama(args.model, args.shape, default_model_path())
    elif args.model is None:
        args.model = default_model_path()
    for qtype in types.split(","):
        path = quantized(args.model, qtype.strip(), exe, args.threads)
        print(f"{path}  ({path.stat().st_size / 1e6:,.0f} MB; matrices: {tensor_types(path)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
