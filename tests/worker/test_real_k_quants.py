"""The default model re-quantized by llama.cpp's own `llama-quantize` (bench/quantize.py) into
the files users download: every matrix stays packed on CPU, and the packed model's logits equal
the dequantized one's up to summation order. Skipped unless `make llama-quantize` has run (the
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


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q6_K"])
def test_a_llama_quantize_file_stays_packed_and_equals_its_dequantized_model(qtype):
    path = quantize.quantized(default_model_path(), qtype, quantize.binary(), threads=2)
    packed = Engine.load(path, dtype="float32", cache_config=CACHE)
    assert all(isinstance(lin.weight, QuantizedWeight) for lin in _linears(packed))
    assert isinstance(packed.model.embed.weight, QuantizedWeight)
    dense = Engine.load(path, dtype="float32", cache_config=CACHE, quantize="none")
    ids = list(range(100, 164))
    logits = [engine.prefill([PrefillItem(0, ids, 0, list(range(8)))], taps=["logits"])
              .taps["logits"][0] for engine in (packed, dense)]
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=1e-3)
    assert logits[0].argmax() == logits[1].argmax()
