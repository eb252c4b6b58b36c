"""The default model re-quantized by llama.cpp's own `llama-quantize` (bench/quantize.py) into
the files users download: every matrix of a type the kernels read (or that recode.py re-encodes
exactly) stays packed on CPU, and the packed model's logits equal the dequantized one's up to
summation order. Skipped unless `make llama-quantize` has run (the
kernels' own tests, tests/worker/ops/test_kquant.py, need no file)."""

from __future__ import annotations

import pytest
import torch

from bench import quantize
from shardlm_server.gateway.serve.default_model import default_model_path
from shardlm_server.worker.engine import Engine, PrefillItem
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(quantize.binary() is None,
                                reason=f"no llama-quantize (build it: {quantize.BUILD_HINT})")

CACHE = CacheConfig(block_size=16, num_blocks=32)


def _linears(engine: Engine):
    for layer in engine.model.layers:
        yield from (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    yield engine.model.lm_head


# A file type -> the layouts its matrices take (SmolLM2's 576-wide rows fill no 256-weight
# super-blocks, so llama-quantize falls back to 32-weight types for most of them: Q5_1 for Q5_K,
# IQ4_NL for IQ4_XS and, but for the 1,536-wide down projections, the i-quants below 4 bits).
LAYOUTS = {"Q4_K_M": {"Q4Kx8", "Q5x8", "Q6Kx8", "Q8_0"},
           "Q6_K": {"Q6Kx8", "Q8_0"},
           "Q5_K_M": {"Q51x8", "Q5Kx8", "Q6Kx8", "Q8_0", "Mixed"},
           "Q3_K_S": {"Q40x8", "Q3Kx8", "Q8_0"},
           "IQ4_NL": {"IQ4NLx8", "Q5Kx8", "Q8_0"},
           "IQ4_XS": {"IQ4x8", "IQ4NLx8", "Q5Kx8", "Q8_0"},
           "IQ3_S": {"IQ3Sx8", "IQ4NLx8", "Q8_0"},
           # made with a uniform importance matrix (bench/quantize.py); Q4_0 attn_v beside IQ4_NL
           # q and k, Q2_K where a down projection falls back
           "IQ2_XXS": {"IQ2XXSx8", "IQ4NLx8", "Mixed", "Q2Kx8", "Q8_0"},
           "IQ2_XS": {"IQ2XSx8", "IQ4NLx8", "Mixed", "Q2Kx8", "Q8_0"},
           "IQ2_M": {"IQ2Sx8", "IQ3Sx8", "IQ4NLx8", "Q8_0"},
           "IQ1_S": {"IQ1Sx8", "IQ4NLx8", "Mixed", "Q2Kx8", "Q8_0"},
           "IQ1_M": {"IQ1Mx8", "IQ4NLx8", "Mixed", "Q2Kx8", "Q8_0"}}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_a_llama_quantize_file_stays_packed_and_equals_its_dequantized_model(qtype):
    path = quantize.quantized(default_model_path(), qtype, quantize.binary(), threads=2)
    packed = Engine.load(path, dtype="float32", cache_config=CACHE)
    layouts = {lin.weight.qtype if isinstance(lin.weight, QuantizedWeight) else "dense"
               for lin in _linears(packed)}
    assert layouts == LAYOUTS[qtype]
    assert isinstance(packed.model.embed.weight, QuantizedWeight)
    dense = Engine.load(path, dtype="float32", cache_config=CACHE, quantize="none")
    ids = list(range(100, 164))
    logits = [engine.prefill([PrefillItem(0, ids, 0, list(range(8)))], taps=["logits"])
              .taps["logits"][0] for engine in (packed, dense)]
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=1e-3)
    assert logits[0].argmax() == logits[1].argmax()
