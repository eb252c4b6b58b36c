"""Files made by llama.cpp's own converter (convert_hf_to_gguf.py, kept by `make llama-quantize` in
.bench/converter from the llama.cpp it builds): a Llama 3 checkpoint with llama3 rope scaling,
converted to a float32 GGUF, serves what transformers serves from the checkpoint itself. This
is the check that the converter writes what the loader expects (for Llama 3.x: a rope_freqs.weight
tensor and no rope.scaling keys). Skipped where the converter was not kept.

The tests' tiny tokenizer is none the converter knows by its hash, so its pre-tokenizer kind is
named by hand ("llama-bpe"), and the converter's optional sentencepiece import is stubbed; the
weights and the configuration are converted as for any checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardlm_server.worker.engine import Engine
from shardlm_server.worker.kv_cache import CacheConfig
from tests.checkpoints import LLAMA, build_checkpoint, load_reference
from tests.worker.greedy_runs import greedy_tokens, last_logits, prompt, reference_greedy

CONVERTER = Path(__file__).resolve().parents[2] / ".bench" / "converter"
TABLE = list(range(32))  # 512 tokens

pytestmark = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's converter is kept by `make llama-quantize` (.bench/converter)")

_RUN = textwrap.dedent("""
    import importlib, runpy, sys
    converter, stub = sys.argv[1], sys.argv[2]
    sys.path[:0] = [stub, converter + "/gguf-py", converter]
    # The model classes: in conversion/ (newer converters) or in the script itself (older ones).
    try:
        classes = importlib.import_module("conversion.base")
    except ImportError:
        classes = importlib.import_module("convert_hf_to_gguf")
    for value in vars(classes).values():
        if isinstance(value, type) and hasattr(value, "get_vocab_base_pre"):
            value.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
    sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
    if classes.__name__ == "convert_hf_to_gguf":
        classes.main()
    else:
        runpy.run_path(converter + "/convert_hf_to_gguf.py", run_name="__main__")
""")


def convert(folder: Path, out: Path, stub: Path) -> Path:
    stub.mkdir(exist_ok=True)
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(CONVERTER), str(stub), str(folder), "--outfile",
         str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converter")
    folder = build_checkpoint(root / "hf", LLAMA, seed=3)
    return convert(folder, root / "model.gguf", root / "stub"), folder


def test_a_llama3_file_from_llama_cpps_converter_serves_as_its_checkpoint(converted):
    path, folder = converted
    engine = Engine.load(path, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    assert engine.cfg.rope_scaling["rope_type"] == "freq_factors"
    reference = load_reference(folder)
    ids = prompt(300, engine.cfg.vocab_size, 1)  # far past the original context of 64
    torch.testing.assert_close(*last_logits(engine, reference, ids, TABLE), atol=2e-4, rtol=0)
    engine.reset()
    assert greedy_tokens(engine, 0, ids, 24, TABLE) == reference_greedy(reference, ids, 24)
