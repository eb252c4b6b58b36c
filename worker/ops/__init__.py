"""ShardLM's compiled ops (``torch.ops.shardlm.*``) with typed Python wrappers.

Importing this package loads ``shardlm_server.worker._C`` (which registers the CPU and, when
built with CUDA, the CUDA kernels) and registers fake implementations so the
ops work under FakeTensor / ``torch.compile`` / ``torch.library.opcheck``
(:mod:`worker.ops.native`).

Set ``SHARDLM_OPS=reference`` to route every function to the plain-PyTorch
implementations in :mod:`worker.ops.reference` (slow; for debugging). In that
mode a missing ``shardlm_server.worker._C`` is tolerated.
"""

from __future__ import annotations

import math

import torch

from shardlm_server.worker.quant import QuantizedWeight

from . import reference
from .activations import (
    ACTIVATION_PRECISIONS,
    activation_precision,
    set_activation_precision,
)
from .blocks import DecoderStack, attention_block, mlp_block
from .cpu_paths import (
    SIMD_LEVELS,
    cpu_amx_active,
    cpu_simd_active,
    cpu_subnormal_quants_active,
    set_cpu_amx,
    set_cpu_simd,
    set_cpu_subnormal_quants,
    set_cpu_vnni,
)
from .native import CUDA_BUILT, USE_REFERENCE
from .native import library as _C
from .native import torch_ops as _ops

__all__ = [
    "ACTIVATION_PRECISIONS",
    "CUDA_BUILT",
    "DecoderStack",
    "SIMD_LEVELS",
    "SKINNY_MAX_ROWS",
    "USE_REFERENCE",
    "activation_precision",
    "attention_block",
    "compute_cos_sin_cache",
    "cpu_amx_active",
    "cpu_simd_active",
    "cpu_subnormal_quants_active",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "linear",
    "mlp_block",
    "paged_attention_decode",
    "paged_attention_prefill",
    "penalize_rows",
    "quant_linear",
    "quant_rows",
    "reshape_and_cache",
    "rms_norm",
    "rope_inv_freq",
    "rotary_embedding",
    "sample_rows",
    "set_activation_precision",
    "set_cpu_amx",
    "set_cpu_simd",
    "set_cpu_subnormal_quants",
    "set_cpu_vnni",
    "silu_and_mul",
    "skinny_linear",
]

def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] (HF LlamaRMSNorm rounding); returns ``out``.

    ``out`` may be ``x`` itself for an in-place norm.
    """
    if USE_REFERENCE:
        return reference.rms_norm(x, weight, eps, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _ops.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual`` (rounded to dtype); ``x = rms_norm(residual)``."""
    if USE_REFERENCE:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    _ops.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style rotary embedding of ``q`` and ``k`` in place.

    positions: int64 [T]. q: [T, num_heads * head_size] or [T, num_heads, head_size],
    k likewise with num_kv_heads; both may be row-strided views (e.g. slices of a fused
    qkv tensor). cos_sin_cache: float32 [max_position, rot_dim] = [cos | sin], see
    :func:`compute_cos_sin_cache`; only the first rot_dim dims of each head rotate.
    """
    if USE_REFERENCE:
        return reference.rotary_embedding(positions, q, k, head_size, cos_sin_cache)
    _ops.rotary_embedding(positions, q, k, head_size, cos_sin_cache)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape [..., 2*d]; returns [..., d]."""
    if USE_REFERENCE:
        return reference.silu_and_mul(x, out=out)
    if out is None:
        out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    _ops.silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``x = [gate | up]`` of shape [..., 2*d];
    returns [..., d] (Gemma's MLP activation; rounded like :func:`silu_and_mul`)."""
    if USE_REFERENCE:
        return reference.gelu_tanh_and_mul(x, out=out)
    if out is None:
        out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    _ops.gelu_tanh_and_mul(out, x)
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on CPU (x [M, K], weight [N, K], bias [N], one dtype): weight
    blocks streamed once by every thread against a pair of input rows at a time, accumulated in
    float32. Built for the few rows of a decode step; CPU only; see :func:`linear`."""
    if USE_REFERENCE:
        return reference.skinny_linear(x, weight, bias, out=out)
    if out is None:
        out = x.new_empty((x.shape[0], weight.shape[0]))
    _ops.skinny_linear(out, x, weight, bias)
    return out


#: Most rows for which skinny_linear beats torch's CPU GEMM, per dtype; the rule lives with the
#: kernel (csrc/cpu/linear.cpp), which the fused CPU blocks apply too.
SKINNY_MAX_ROWS = (
    {dtype: _C.skinny_max_rows(str(dtype).removeprefix("torch."))
     for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    if _C is not None else {}
)


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` on CPU with W kept in GGML blocks (see :mod:`worker.quant`): x [M, K]
    float32 / bfloat16 / float16, the result in x's dtype, accumulated in float32 against the
    unrounded x (or, in the int8 fast mode, x rounded per block: ops.activations). Few rows
    unpack blocks in registers; many rows dequantize tiles of W for a GEMM. Equals
    ``x @ W.dequantize().T`` up to summation order."""
    if USE_REFERENCE:
        return reference.quant_linear(x, weight.blocks, weight.qtype, bias, out=out)
    if out is None:
        out = x.new_empty((x.shape[0], weight.shape[0]))
    _ops.quant_linear(out, x, weight.blocks, weight.ggml_type, bias)
    return out


def quant_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), K]: the rows `ids` (int64 [n], each in [0, N)) of W, equal bit for bit
    to those rows of ``W.dequantize()``; an embedding lookup that leaves the table packed. CPU,
    for W in a layout quant_linear reads (``QuantizedWeight.ggml_type``), Mixed excepted."""
    if USE_REFERENCE:
        return reference.quant_rows(weight, ids)
    out = torch.empty((ids.shape[0], weight.shape[1]), dtype=torch.float32)
    _ops.quant_rows(out, weight.blocks, weight.ggml_type, ids)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` for the model's layers: a QuantizedWeight takes quant_linear, decode-sized
    dense CPU batches take skinny_linear."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x.contiguous(), weight, bias)
    if (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS.get(x.dtype, 0)
            and x.is_contiguous()):
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's k/v [T, kv_heads, head_dim] to cache slot ``slot_mapping[t]``.

    Caches are [num_blocks, block_size, kv_heads, head_dim]; slot = block * block_size +
    offset; slot -1 marks a padding token and writes nothing. The caches (one dtype for both)
    may be float32, bfloat16 or float16 whatever k's dtype: values are rounded to it.
    """
    if USE_REFERENCE:
        return reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    _ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-query attention per sequence over the paged KV cache.

    q: [B, num_heads, head_dim]; block_tables: int32 [B, max_blocks]; context_lens:
    int32 [B] (tokens to attend to, the current one included; 0 = padding row, zero
    output). ``max_context_len`` must be >= every context length; pass the batch's real
    maximum, since it sizes the CUDA grid and its float32 split-context workspace.
    ``sliding_window`` W > 0: only the last W tokens are attended to (transformers'
    convention: a query at position p sees keys p - W < j <= p); blocks entirely before
    that are not read, so their block-table entries may be -1. The caches may be of another
    float dtype than q (read converted); the result has q's dtype.
    """
    if USE_REFERENCE:
        return reference.paged_attention_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len,
            sliding_window, out=out
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _ops.paged_attention_decode(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len,
        sliding_window
    )
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of packed new tokens over the paged KV cache.

    q: [total_q, num_heads, head_dim] for B sequences; query_start_loc: int32 [B+1];
    seq_lens: int32 [B] = cached prefix + new tokens (already written to the cache).
    Query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys
    0..position, or with ``sliding_window`` W > 0 only position - W < j <= position.
    ``max_query_len`` / ``max_seq_len`` must bound the real values. The caches may be of
    another float dtype than q (read converted); the result has q's dtype.
    """
    if USE_REFERENCE:
        return reference.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            max_query_len,
            max_seq_len,
            sliding_window,
            out=out,
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _ops.paged_attention_prefill(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        max_seq_len,
        sliding_window,
    )
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token id per row of float32 logits [B, V] on CPU (int64 [B]): row r divided by
    temperature[r], truncated by top_k[r] (0: off), top_p[r] (1: off) and min_p[r] (0: off) as
    worker/sampling.py defines them, then drawn with the uniform number uniform[r] (float64, in
    [0, 1)) from the survivors' distribution in token order; temperature 0 takes the first largest
    logit."""
    if USE_REFERENCE:
        return reference.sample_rows(logits, temperature, top_k, top_p, min_p, uniform)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _ops.sample_rows(out, logits, temperature, top_k, top_p, min_p, uniform)
    return out


def penalize_rows(logits: torch.Tensor, seen: list[torch.Tensor], counts: list[torch.Tensor],
                  repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor) -> torch.Tensor:
    """The sampling penalties in place on float32 logits [B, V] on CPU, returned: row r's seen
    tokens (bool [V]) by repetition[r] (a positive logit divided, else multiplied), then
    ``- frequency[r] * counts[r] - presence[r] * (counts[r] > 0)`` (int32 [V]); a row whose seen
    and counts are empty tensors is left as it is."""
    if USE_REFERENCE:
        return reference.penalize_rows(logits, seen, counts, repetition, frequency, presence)
    _ops.penalize_rows(logits, seen, counts, repetition, frequency, presence)
    return logits


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """float32 [head_dim / 2]: the rotary inverse frequencies of the default, linear and llama3
    kinds."""
    # Same float32 arithmetic as transformers' _compute_default_rope_parameters.
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim)
    )
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # positions interpolated: every frequency divided by the factor
        return inv_freq / rope_scaling["factor"]
    if rope_type != "llama3":  # config.py refuses any other type at load; this guards callers
        raise ValueError(f"rope_scaling type {rope_type!r} is not one of default, linear, llama3")
    # transformers' _compute_llama3_parameters, operation for operation.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """float32 [max_position, head_dim] = [cos | sin] of position * inv_freq.

    Matches HF's rotary embedding (default rope and ``rope_type="llama3"``): HF's
    ``cos(cat(freqs, freqs))`` repeats the same half, so storing each half once is
    equivalent. Compute on the model's ``device`` to reproduce HF bit for bit.
    """
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling).to(device)
    positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().contiguous()
