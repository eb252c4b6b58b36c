"""The fused CPU decoder blocks: a layer's attention half and MLP half as one op each
(csrc/cpu/decoder_block.cpp), and DecoderStack, every layer of a single rank in one call
(csrc/cpu/decoder_stack.cpp). Re-exported by the package; they obey the same SHARDLM_OPS switch
(worker.ops.native)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardlm_server.worker.quant import QuantizedWeight

from . import native, reference

if TYPE_CHECKING:
    from shardlm_server.worker.attention import AttentionMetadata


def _weight_args(weight: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, int]:
    """A linear weight as the fused ops take it: its tensor and GGML type (-1: dense)."""
    if isinstance(weight, QuantizedWeight):
        return weight.blocks, weight.ggml_type
    return weight, -1


def attention_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor | QuantizedWeight,
    qkv_bias: torch.Tensor | None,
    o_weight: torch.Tensor | QuantizedWeight,
    o_bias: torch.Tensor | None,
    heads: tuple[int, int, int],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """A decoder layer's attention half on CPU in one op: ``residual += hidden``, ``hidden =
    rms_norm(residual)`` (in place), then qkv, rotary, the cache write, paged attention
    (within ``sliding_window`` keys if that is > 0) and o_proj; returns o_proj's output
    [T, hidden]. ``heads`` is (num_heads, num_kv_heads, head_dim) of this rank. The caches may
    be of another dtype than hidden. Equals the unfused ops step for step."""
    if native.USE_REFERENCE:
        return reference.attention_block(hidden, residual, norm_weight, eps, qkv_weight,
                                         qkv_bias, o_weight, o_bias, heads, cos_sin_cache,
                                         k_cache, v_cache, meta, scale, sliding_window)
    out = hidden.new_empty((hidden.shape[0], o_weight.shape[0]))
    native.torch_ops.attention_block(
        out, hidden, residual, norm_weight, eps, *_weight_args(qkv_weight), qkv_bias,
        *_weight_args(o_weight), o_bias, meta.positions, cos_sin_cache, *heads, k_cache, v_cache,
        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.is_decode,
        meta.max_query_len, meta.max_seq_len, scale, sliding_window)
    return out


def _step_args(hidden: torch.Tensor, cos_sin_cache: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               meta: AttentionMetadata) -> tuple:
    """A step's arguments to the native DecoderStack's forward and logits."""
    return (hidden, meta.positions, cos_sin_cache, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, meta.is_decode, meta.max_query_len, meta.max_seq_len)


class DecoderStack:
    """Every decoder layer of a single-rank CPU model in one call (csrc/cpu/decoder_stack.cpp):
    each layer's attention_block then mlp_block in a C++ loop, without a Python and dispatcher
    round trip per layer. Weights are bound once by `add_layer`, in layer order, each layer
    with its own attention window (Gemma-style models interleave windowed and global
    layers)."""

    def __init__(self, eps: float, heads: tuple[int, int, int], scale: float) -> None:
        self.eps, self.heads, self.scale = eps, heads, scale
        self._layers: list[tuple] = []  # the reference's
        self._head: tuple | None = None  # the reference's (norm, eps, weight)
        self._native = (None if native.USE_REFERENCE
                        else torch.classes.shardlm.DecoderStack(eps, *heads, scale))

    def add_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor,
                  qkv: torch.Tensor | QuantizedWeight, qkv_bias: torch.Tensor | None,
                  o: torch.Tensor | QuantizedWeight, o_bias: torch.Tensor | None,
                  gate_up: torch.Tensor | QuantizedWeight, gate_up_bias: torch.Tensor | None,
                  down: torch.Tensor | QuantizedWeight, down_bias: torch.Tensor | None,
                  sliding_window: int = 0) -> None:
        """Appends the next layer; ``sliding_window`` > 0 limits its attention to that many
        keys (0: global attention)."""
        if self._native is None:
            self._layers.append((input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up,
                                 gate_up_bias, down, down_bias, sliding_window))
            return
        self._native.add_layer(input_norm, post_norm, *_weight_args(qkv), qkv_bias,
                               *_weight_args(o), o_bias, o.shape[0], *_weight_args(gate_up),
                               gate_up_bias, *_weight_args(down), down_bias, down.shape[0],
                               sliding_window)

    def set_head(self, norm: torch.Tensor, eps: float,
                 weight: torch.Tensor | QuantizedWeight) -> None:
        """The model's final rms norm and its output head (no bias), for `logits`."""
        self._head = (norm, eps, weight)
        if self._native is not None:
            self._native.set_head(norm, eps, *_weight_args(weight), weight.shape[0])

    def logits(self, hidden: torch.Tensor, cos_sin_cache: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               meta: AttentionMetadata) -> torch.Tensor:
        """`forward`, then the final norm and the head over the rows meta.logits_indices (a
        decode step: every row), in one call: logits [rows, vocab] in hidden's dtype."""
        if self._native is None:
            assert self._head is not None, "DecoderStack.logits: no head set (set_head)"
            norm, eps, weight = self._head
            last, residual = self.forward(hidden, cos_sin_cache, kv_caches, meta)
            reference.fused_add_rms_norm(last, residual, norm, eps)
            if not meta.is_decode:
                last = last.index_select(0, meta.logits_indices)
            return reference.linear_of(last, weight)
        return self._native.logits(*_step_args(hidden, cos_sin_cache, kv_caches, meta),
                                   meta.logits_indices)

    def forward(self, hidden: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every layer, for the embeddings `hidden` [T, H] (updated in
        place, as by the first layer's norm); layer i uses kv_caches[i]."""
        if self._native is None:
            return reference.decoder_stack(hidden, self._layers, self.eps, self.heads,
                                           self.scale, cos_sin_cache, kv_caches, meta)
        return self._native.forward(*_step_args(hidden, cos_sin_cache, kv_caches, meta))


def mlp_block(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor | QuantizedWeight,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor | QuantizedWeight,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """A decoder layer's MLP half on CPU in one op: add and norm in place as attention_block,
    then gate_up, silu_and_mul and down; returns down's output [T, hidden]."""
    if native.USE_REFERENCE:
        return reference.mlp_block(hidden, residual, norm_weight, eps, gate_up_weight,
                                   gate_up_bias, down_weight, down_bias)
    out = hidden.new_empty((hidden.shape[0], down_weight.shape[0]))
    native.torch_ops.mlp_block(out, hidden, residual, norm_weight, eps,
                               *_weight_args(gate_up_weight), gate_up_bias,
                               *_weight_args(down_weight), down_bias)
    return out
