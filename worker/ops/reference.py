"""Plain-PyTorch reference implementations of ShardLM's compiled ops.

Written for clarity, not speed: they define what the kernels in ``csrc/``
must compute and are what ``SHARDLM_OPS=reference`` routes to. Signatures
match the public functions in :mod:`worker.ops`. Rounding follows the
Hugging Face Llama/Qwen2 modules where the ops stand in for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import activations


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round, then scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    result = weight * h.to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual = x + residual (in the model dtype); x = rms_norm(residual)."""
    residual.copy_(x + residual)
    x.copy_(rms_norm(residual, weight, eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> None:
    # View [T, heads*head_size] as [T, heads, head_size]; writes go to x's storage.
    heads = x.unflatten(-1, (-1, head_size)) if x.dim() == 2 else x
    rot_dim = cos.shape[-1]
    part = heads[..., :rot_dim]
    xf = part.float()
    half = rot_dim // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)  # HF rotate_half
    part.copy_((xf * cos + rotated * sin).to(x.dtype))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style (rotate_half) rotary embedding of q and k in place, in float32."""
    half = cos_sin_cache.shape[1] // 2
    cache = cos_sin_cache[positions]  # [T, rot_dim]
    cos = torch.cat((cache[:, :half], cache[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cache[:, half:], cache[:, half:]), dim=-1)[:, None, :]
    _rotate(q, cos, sin, head_size)
    _rotate(k, cos, sin, head_size)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up], both ops in x's dtype like HF's MLP."""
    d = x.shape[-1] // 2
    result = F.silu(x[..., :d]) * x[..., d:]
    if out is None:
        return result
    out.copy_(result)
    return out


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up], both ops in x's dtype like
    Gemma's MLP."""
    d = x.shape[-1] // 2
    result = F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
    if out is None:
        return result
    out.copy_(result)
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    result = torch.nn.functional.linear(x, weight, bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter token t's k/v to cache[slot // block_size, slot % block_size]; slot -1 skips.
    The cache's dtype may differ from k's: values are rounded to it (as by ``.to()``)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache[slots // block_size, slots % block_size] = k[valid].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[valid].to(v_cache.dtype)


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = k_cache.shape[1]
    blocks = block_row[: (length + block_size - 1) // block_size].long()
    keys = k_cache[blocks].flatten(0, 1)[:length]
    values = v_cache[blocks].flatten(0, 1)[:length]
    return keys, values


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal GQA attention in float32 (the cache, of any dtype, converted to float32): query n
    sees keys 0..q_pos[n], or with a sliding window W only q_pos[n] - W < j <= q_pos[n]
    (transformers' sliding-window mask). q: [n, H, D]; the result is in q's dtype."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    key_pos = torch.arange(keys.shape[0], device=q.device)
    hidden = key_pos[None, :] > q_pos[:, None]
    if sliding_window > 0:
        hidden |= key_pos[None, :] <= q_pos[:, None] - sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)


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
    """Each sequence's single query attends to its first context_lens[b] cached tokens (the
    last sliding_window of them if that is > 0)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        ctx = int(context_lens[b])
        if ctx == 0:
            out[b] = 0  # padding row
            continue
        keys, values = _gather_kv(k_cache, v_cache, block_tables[b], ctx)
        last = torch.tensor([ctx - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], keys, values, scale, last, sliding_window)[0]
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
    """Varlen causal attention: the new queries are the last q_len tokens of each sequence;
    with sliding_window W > 0 each sees its last W positions only."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end == start:
            continue
        seq_len = int(seq_lens[b])
        keys, values = _gather_kv(k_cache, v_cache, block_tables[b], seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        out[start:end] = _attend(q[start:end], keys, values, scale, q_pos, sliding_window)
    return out


def quant_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: str,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T + bias with W the float32 dequantized blocks, in float32, rounded once to x's
    dtype; x rounded to int8 first where the fast mode covers W, or x and W to integers
    where the int16 precision's panel path takes the product (ops.activations)."""
    from shardlm_server.worker.quant import dequantize_blocks, mixed_parts

    if qtype == "Mixed":  # each part as its own type (rounding the input where that type does)
        parts, row = [], 0
        for part in mixed_parts(blocks):
            part_bias = bias[row:row + part.shape[0]] if bias is not None else None
            parts.append(quant_linear(x, part.blocks, part.qtype, part_bias))
            row += part.shape[0]
        result = torch.cat(parts, dim=1)
        return out.copy_(result) if out is not None else result
    w = dequantize_blocks(blocks, qtype)
    inputs = activations.round_to_int8(x) if activations.rounds_input(qtype) else x.float()
    if activations.rounds_panel(qtype, x.numel() // max(x.shape[-1], 1), *w.shape):
        inputs, w = activations.round_to_int16(x, w)
    result = torch.nn.functional.linear(
        inputs, w, bias.float() if bias is not None else None).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def quant_rows(weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a QuantizedWeight as float32: its dequantized table's rows (quant.dequantize_rows
    reads only those rows' blocks, or their whole groups in the 8-row layouts)."""
    from shardlm_server.worker.quant import dequantize_rows

    return dequantize_rows(weight, ids)


def linear_of(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for a dense W or a QuantizedWeight (then quant_linear's reference)."""
    from shardlm_server.worker.quant import QuantizedWeight

    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight.blocks, weight.qtype, bias)
    return F.linear(x, weight, bias)


def attention_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight,
    qkv_bias: torch.Tensor | None,
    o_weight,
    o_bias: torch.Tensor | None,
    heads: tuple[int, int, int],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decoder layer's attention half: add and norm, qkv, rotary, cache write, attention
    (within sliding_window keys if > 0), o_proj; `hidden` and `residual` are updated in place
    as by fused_add_rms_norm."""
    num_heads, num_kv_heads, head_dim = heads
    tokens = hidden.shape[0]
    fused_add_rms_norm(hidden, residual, norm_weight, eps)
    qkv = linear_of(hidden, qkv_weight, qkv_bias)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.clone(), k.clone()
    rotary_embedding(meta.positions, q, k, head_dim, cos_sin_cache)
    reshape_and_cache(k.view(tokens, num_kv_heads, head_dim), v.reshape(tokens, num_kv_heads,
                      head_dim), k_cache, v_cache, meta.slot_mapping)
    q3 = q.view(tokens, num_heads, head_dim)
    if meta.is_decode:
        attn = paged_attention_decode(q3, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      scale, meta.max_seq_len, sliding_window)
    else:
        attn = paged_attention_prefill(q3, k_cache, v_cache, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens, scale,
                                       meta.max_query_len, meta.max_seq_len, sliding_window)
    result = linear_of(attn.reshape(tokens, q_size), o_weight, o_bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def mlp_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight,
    gate_up_bias: torch.Tensor | None,
    down_weight,
    down_bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decoder layer's MLP half: add and norm, gate_up, silu_and_mul, down."""
    fused_add_rms_norm(hidden, residual, norm_weight, eps)
    result = linear_of(silu_and_mul(linear_of(hidden, gate_up_weight, gate_up_bias)), down_weight,
                     down_bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def decoder_stack(
    hidden: torch.Tensor,
    layers: list[tuple],
    eps: float,
    heads: tuple[int, int, int],
    scale: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's attention_block then mlp_block; `layers` holds each layer's (input_norm,
    post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias[,
    sliding_window]) (no window when the last is left out). Returns (hidden, residual) after
    the last layer."""
    residual = torch.zeros_like(hidden)
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        (input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down,
         down_bias) = layer[:10]
        window = layer[10] if len(layer) > 10 else 0
        hidden = attention_block(hidden, residual, input_norm, eps, qkv, qkv_bias, o, o_bias,
                                 heads, cos_sin_cache, k_cache, v_cache, meta, scale, window)
        hidden = mlp_block(hidden, residual, post_norm, eps, gate_up, gate_up_bias, down,
                           down_bias)
    return hidden, residual


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The sampling kernel's definition, row by row: x = logits / T ranked by a stable
    descending sort (larger x first, ties by index); top-k keeps the first k; top-p drops a
    token when the kept mass ranked before it passes top_p times the kept total; min-p drops
    tokens below min_p times the top token's probability; the top token always stays. The
    survivors, in token order, are drawn by the first whose running mass passes uniform times
    their total. Temperature 0 is torch.argmax."""
    ids = []
    for r in range(logits.shape[0]):
        if float(temperature[r]) == 0.0:
            ids.append(int(logits[r].argmax()))
            continue
        x = logits[r].float() / temperature[r]
        ranked = torch.sort(x, descending=True, stable=True).indices
        e = torch.exp((x[ranked] - x[ranked[0]]).double())
        keep = torch.ones_like(e, dtype=torch.bool)
        k = int(top_k[r])
        if 0 < k < len(e):
            keep[k:] = False
        kept = torch.where(keep, e, torch.zeros_like(e))
        p = float(top_p[r])
        if p < 1.0:
            keep &= ~((kept.cumsum(0) - kept) > p * kept.sum())
        if float(min_p[r]) > 0.0:
            keep &= e >= float(min_p[r])
        keep[0] = True
        tokens, order = ranked[keep].sort()
        cumulative = e[keep][order].cumsum(0)
        pick = int(torch.searchsorted(cumulative, float(uniform[r]) * float(cumulative[-1]),
                                      right=True))
        ids.append(int(tokens[min(pick, len(tokens) - 1)]))
    return torch.tensor(ids, dtype=torch.int64)


def penalize_rows(logits: torch.Tensor, seen: list[torch.Tensor], counts: list[torch.Tensor],
                  repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor) -> torch.Tensor:
    """The penalty kernel's definition, in place, row by row (Hugging Face's repetition penalty,
    then OpenAI's frequency and presence penalties)."""
    for r in range(logits.shape[0]):
        row = logits[r]
        if float(repetition[r]) != 1.0 and seen[r].numel():
            row.copy_(torch.where(seen[r], torch.where(row > 0, row / repetition[r],
                                                       row * repetition[r]), row))
        if (float(frequency[r]) != 0.0 or float(presence[r]) != 0.0) and counts[r].numel():
            c = counts[r].float()
            row.copy_(row - frequency[r] * c - presence[r] * (c > 0).float())
    return logits
