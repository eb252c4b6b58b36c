"""Models served with quantized weights kept packed (worker.quant): a GGUF file's Q8_0 / Q4_0 /
Q4_1 blocks, and `quantize="int8" | "int4"` on a safetensors checkpoint."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker import ops
from shardlm_server.worker.engine import DecodeItem, Engine, EngineOptions, PrefillItem, StopParams
from shardlm_server.worker.errors import InvalidRequestError
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.quant import BLOCK, QuantizedWeight, mixed_parts, quantize
from tests.gguf_files import GGUFSpec, T, write_gguf

BLOCKS = list(range(16))
CACHE = CacheConfig(block_size=16, num_blocks=64)


def _linears(engine: Engine):
    for layer in engine.model.layers:
        yield from (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    yield engine.model.lm_head


def _logits_and_tokens(engine: Engine, n: int = 12, prompt: int = 23
                       ) -> tuple[torch.Tensor, list[int]]:
    engine.reset()
    ids = torch.randint(3, engine.cfg.vocab_size, (prompt,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    out = engine.prefill([PrefillItem(0, ids, 0, BLOCKS, stop=StopParams(max_new_tokens=n))],
                         taps=["logits"])
    tokens = [out.tokens[0].token.token_id]
    for step in engine.decode([DecodeItem(0, BLOCKS, n)], n):
        tokens += [t.token.token_id for t in step.tokens]
    return out.taps["logits"][0], tokens


@pytest.fixture(scope="module", params=[("llama", T.Q4_0), ("qwen2", T.Q4_1)])
def gguf_path(request, tmp_path_factory):
    arch, qtype = request.param
    spec = GGUFSpec(arch, tied=arch == "qwen2", bias=arch == "qwen2", default_type=qtype,
                    types={"token_embd.weight": T.Q8_0})
    path = tmp_path_factory.mktemp(f"packed-{arch}") / "model.gguf"
    write_gguf(path, spec)
    return path, qtype, spec.tied


def test_gguf_blocks_stay_packed_and_match_the_dequantized_model(gguf_path):
    path, qtype, tied = gguf_path
    packed = Engine.load(path, dtype="float32", cache_config=CACHE)
    dense = Engine.load(path, dtype="float32", cache_config=CACHE, quantize="none")
    weights = [lin.weight for lin in _linears(packed)]

    def held_as(name: str, rows: int) -> str:  # 4-bit rows in whole groups of 8 are regrouped
        layouts = {"Q4_0": "Q40x8", "Q4_1": "Q4x8"}
        return layouts[name] if name in layouts and rows % 8 == 0 else name

    head = "Q8_0" if tied else qtype.name  # a tied head is the Q8_0 embedding
    assert [w.qtype for w in weights] == [held_as(qtype.name, w.shape[0]) for w in weights[:-1]] + [
        held_as(head, weights[-1].shape[0])]
    assert all(isinstance(lin.weight, torch.Tensor) for lin in _linears(dense))
    logits, tokens = _logits_and_tokens(packed)
    dense_logits, dense_tokens = _logits_and_tokens(dense)
    torch.testing.assert_close(logits, dense_logits, atol=1e-4, rtol=1e-4)
    assert tokens == dense_tokens


@pytest.mark.parametrize("scheme,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantize_at_load_equals_the_model_with_those_weights(llama_dir, scheme, qtype):
    quantized = Engine.load(llama_dir, dtype="float32", cache_config=CACHE, quantize=scheme)
    original = Engine.load(llama_dir, dtype="float32", cache_config=CACHE)
    original_logits, _ = _logits_and_tokens(original)
    # Weights whose input width is a whole number of blocks are packed (the tiny model's
    # intermediate size, 172, is not: its down projection stays dense).
    for lin in _linears(quantized):
        blockable = lin.weight.shape[1] % BLOCK == 0
        held = "Q4x8" if qtype == "Q4_1" and lin.weight.shape[0] % 8 == 0 else qtype
        assert (lin.weight.qtype if blockable else lin.weight.dtype) == (
            held if blockable else torch.float32)
    # The reference: the dense model with each weight's values replaced by their quantized ones
    # (in place: the model binds its weight tensors at load).
    for lin in _linears(original):
        if lin.weight.shape[1] % BLOCK == 0:
            lin.weight.copy_(quantize(lin.weight, scheme).dequantize())
    logits, tokens = _logits_and_tokens(quantized)
    reference_logits, reference_tokens = _logits_and_tokens(original)
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)
    assert tokens == reference_tokens
    # And near the unquantized model: int8 closely, int4 roughly (Gaussian random weights are
    # the hard case for 4 bits: each carries about 9% noise).
    cosine = torch.nn.functional.cosine_similarity(logits, original_logits, dim=0)
    assert cosine > (0.995 if scheme == "int8" else 0.8), cosine


def test_a_bfloat16_model_keeps_its_embedding_dense_and_its_head_packed(llama_dir):
    engine = Engine.load(llama_dir, dtype="bfloat16", cache_config=CACHE, quantize="int8")
    assert engine.model.embed.weight.dtype == torch.bfloat16
    assert isinstance(engine.model.lm_head.weight, QuantizedWeight)
    logits, _ = _logits_and_tokens(engine, n=2)
    assert torch.isfinite(logits).all()


def test_an_unknown_quantize_mode_is_an_invalid_request(llama_dir):
    with pytest.raises(InvalidRequestError, match="quantize must be one of"):
        Engine.load(llama_dir, dtype="float32", cache_config=CACHE, quantize="fp4")


@pytest.mark.parametrize("tied", [False, True])
def test_a_k_quant_file_stays_packed(tmp_path, tied):
    """A Q4_K_M-like file, as llama-quantize writes one: Q4_K matrices regrouped into Q4Kx8, Q6_K
    ones (some ffn_down, the output or tied embedding) into Q6Kx8, Q5_0 ones (its fallback for
    rows that are no whole number of 256-blocks) into Q5x8, or fused with a Q8_0 attn_v as Q8_0,
    a Q6_K attn_v beside Q4_K q and k held as a Mixed q/k/v, and a Q5_K one (Q5_K_M's) into
    Q5Kx8; logits equal the dequantized model's up to summation
    order, tokens exactly."""
    path = tmp_path / "model.gguf"
    types = {**{f"blk.0.{m}.weight": T.Q5_0 for m in ("attn_q", "attn_k", "attn_output",
                                                       "ffn_gate", "ffn_up")},
             "blk.0.attn_v.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q6_K,
             "blk.1.attn_v.weight": T.Q6_K,
             "blk.1.ffn_down.weight": T.Q5_K,
             "token_embd.weight": T.Q6_K if tied else T.Q4_K, "output.weight": T.Q6_K}
    write_gguf(path, GGUFSpec("llama", tied=tied, default_type=T.Q4_K, types=types))
    packed = Engine.load(path, dtype="float32", cache_config=CACHE)
    dense = Engine.load(path, dtype="float32", cache_config=CACHE, quantize="none")
    layers = packed.model.layers
    assert layers[0].qkv.weight.qtype == "Q8_0" and layers[0].o_proj.weight.qtype == "Q5x8"
    assert layers[0].gate_up.weight.qtype == "Q5x8"
    assert layers[1].qkv.weight.qtype == "Mixed" and layers[1].gate_up.weight.qtype == "Q4Kx8"
    assert [p.qtype for p in mixed_parts(layers[1].qkv.weight.blocks)] == ["Q4Kx8", "Q4Kx8",
                                                                          "Q6Kx8"]
    assert layers[0].down.weight.qtype == "Q6Kx8" and layers[1].down.weight.qtype == "Q5Kx8"
    assert packed.model.lm_head.weight.qtype == "Q6Kx8"
    assert packed.model.embed.weight.qtype == ("Q6Kx8" if tied else "Q4_K")
    logits, tokens = _logits_and_tokens(packed)
    dense_logits, dense_tokens = _logits_and_tokens(dense)
    torch.testing.assert_close(logits, dense_logits, atol=1e-4, rtol=1e-4)
    assert tokens == dense_tokens


@pytest.mark.parametrize("precision,bound", [("int8", 0.05), ("int16", 1e-3)])
def test_rounded_activations_stay_close_to_the_exact_model(gguf_path, precision, bound):
    """The opt-in precisions (EngineOptions.activation_precision) run the whole model with its
    4-bit linears on int8 inputs, or its 40-token prefill's linears on 14-bit integers: logits
    move, by little (int16 by far less), and the process returns to exact."""
    path, _, _ = gguf_path
    exact = Engine.load(path, dtype="float32", cache_config=CACHE)
    logits, tokens = _logits_and_tokens(exact, prompt=40)
    try:
        fast = Engine.load(path, dtype="float32", cache_config=CACHE,
                           options=EngineOptions(activation_precision=precision))
        fast_logits, fast_tokens = _logits_and_tokens(fast, prompt=40)
    finally:
        ops.set_activation_precision("exact")
    assert not torch.equal(fast_logits, logits)
    assert (fast_logits - logits).norm() / logits.norm() < bound
    assert len(fast_tokens) == 12
    if precision == "int16":
        assert fast_tokens == tokens
