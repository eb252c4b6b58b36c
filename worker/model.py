"""The decoder-only transformer every supported family shares (Llama, Mistral, Qwen2, Qwen3,
Gemma 3, Phi-3); what a family adds is a ModelConfig flag (worker/config.py, worker/families/).

Weights are loaded shard by shard through `layers`; the forward pass runs on a packed batch of
tokens (no padding) and writes into / reads from the paged KV cache through `attention`.
Intermediate tensors can be captured by name ("debug taps") for checking a checkpoint against a
reference; when no taps are requested the capture costs one `is None` test per site.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardlm_server.worker import ops
from shardlm_server.worker.attention import AttentionMetadata, PagedAttention
from shardlm_server.worker.checkpoint import CheckpointReader
from shardlm_server.worker.config import ModelConfig
from shardlm_server.worker.layers import (
    ColumnParallelLinear,
    Parallel,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardlm_server.worker.quant import read_linear
from shardlm_server.worker.rope import cos_sin_cache

Taps = dict[str, torch.Tensor]

TAP_KINDS = ("input_norm", "q", "k", "v", "attn_output", "mlp_output")


def tap_names(num_layers: int) -> list[str]:
    """Every tap a request may ask for: per layer `layers.{i}.{kind}`, and `logits`."""
    return [f"layers.{i}.{kind}" for i in range(num_layers) for kind in TAP_KINDS] + ["logits"]


def read_norm(reader: CheckpointReader, name: str, size: int, offset: float) -> torch.Tensor:
    """An RMS norm's weight plus `offset` (1 for Gemma's (1 + w) norms), added in float32."""
    weight = reader.read(name, (size,))
    return weight if not offset else (weight.float() + offset).to(weight.dtype)


class DecoderLayer:
    def __init__(
        self, cfg: ModelConfig, parallel: Parallel, reader: CheckpointReader, index: int
    ) -> None:
        prefix = f"model.layers.{index}"
        self.index = index
        self.eps = cfg.rms_norm_eps
        self.parallel = parallel
        self.num_heads = parallel.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = parallel.split(cfg.num_kv_heads, "num_key_value_heads")
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        hidden = cfg.hidden_size
        def norm(name: str, size: int) -> torch.Tensor:
            return read_norm(reader, f"{prefix}.{name}.weight", size, cfg.norm_weight_offset)

        self.input_norm = norm("input_layernorm", hidden)
        # The norm before the MLP; Gemma's sandwich norms also normalize each half's output before
        # it joins the residual (its post_attention_layernorm is such an output norm).
        self.post_attn_norm = self.post_mlp_norm = None
        if cfg.sandwich_norms:
            self.post_attn_norm = norm("post_attention_layernorm", hidden)
            self.post_norm = norm("pre_feedforward_layernorm", hidden)
            self.post_mlp_norm = norm("post_feedforward_layernorm", hidden)
        else:
            self.post_norm = norm("post_attention_layernorm", hidden)
        self.act = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_and_mul
        self.qkv = ColumnParallelLinear.load(
            reader,
            parallel,
            [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            hidden,
            cfg.qkv_bias,
        )
        self.o_proj = RowParallelLinear.load(
            reader, parallel, f"{prefix}.self_attn.o_proj", hidden, cfg.q_size, cfg.o_bias
        )
        self.gate_up = ColumnParallelLinear.load(
            reader,
            parallel,
            [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"],
            [cfg.intermediate_size, cfg.intermediate_size],
            hidden,
            cfg.mlp_bias,
        )
        self.down = RowParallelLinear.load(
            reader, parallel, f"{prefix}.mlp.down_proj", hidden, cfg.intermediate_size, cfg.mlp_bias
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                                   sliding_window=cfg.window(index))
        if cfg.attention_scale is not None:
            self.attn.scale = cfg.attention_scale
        # Per-head norms (Qwen3, Gemma 3): one weight over a head's features, the same on every rank.
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = norm("self_attn.q_norm", cfg.head_dim)
            self.k_norm = norm("self_attn.k_norm", cfg.head_dim)

    def forward_blocks(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` as two fused CPU ops (ops.attention_block, ops.mlp_block): the same
        kernels, without a Python and dispatcher round trip for each of them."""
        if residual is None:  # the first layer: residual = hidden + 0, exactly
            residual = torch.zeros_like(hidden)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        hidden = self.o_proj.reduce(ops.attention_block(
            hidden, residual, self.input_norm, self.eps, self.qkv.weight, self.qkv.bias,
            self.o_proj.weight, self.o_proj.fused_bias, heads, cos_sin, kv[0], kv[1], meta,
            self.attn.scale, self.attn.sliding_window))
        hidden = self.down.reduce(ops.mlp_block(
            hidden, residual, self.post_norm, self.eps, self.gate_up.weight, self.gate_up.bias,
            self.down.weight, self.down.fused_bias))
        return hidden, residual

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        taps: Taps | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            ops.fused_add_rms_norm(hidden, residual, self.input_norm, self.eps)
        if taps is not None:
            self._tap(taps, "input_norm", hidden)
        qkv = self.qkv(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self._head_norm(q, self.q_norm, self.num_heads)
            k = self._head_norm(k, self.k_norm, self.num_kv_heads)
        ops.rotary_embedding(meta.positions, q, k, self.head_dim, cos_sin)
        if taps is not None:
            self._tap(taps, "q", q, gather=True)
            self._tap(taps, "k", k, gather=True)
            self._tap(taps, "v", v, gather=True)
        attn = self.attn(q, k, v, kv[0], kv[1], meta)
        hidden = self.o_proj(attn)
        if taps is not None:
            self._tap(taps, "attn_output", hidden)
        if self.post_attn_norm is not None:
            hidden = ops.rms_norm(hidden, self.post_attn_norm, self.eps)
        ops.fused_add_rms_norm(hidden, residual, self.post_norm, self.eps)
        hidden = self.down(self.act(self.gate_up(hidden)))
        if taps is not None:
            self._tap(taps, "mlp_output", hidden)
        if self.post_mlp_norm is not None:
            hidden = ops.rms_norm(hidden, self.post_mlp_norm, self.eps)
        return hidden, residual

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """RMS norm over each head's features of [tokens, heads * head_dim], into a fresh tensor
        (`x` is a view into the fused qkv output, not contiguous)."""
        rows = x.reshape(-1, heads, self.head_dim).contiguous()
        ops.rms_norm(rows, weight, self.eps, out=rows)
        return rows.view(x.shape[0], heads * self.head_dim)

    def _tap(self, taps: Taps, kind: str, value: torch.Tensor, gather: bool = False) -> None:
        name = f"layers.{self.index}.{kind}"
        if name not in taps:
            return
        value = value.contiguous()
        if gather and self.parallel.world_size > 1:
            value = self.parallel.comm.all_gather(value)  # heads are split over ranks
        taps[name] = value.float().cpu()


class TransformerModel:
    """The decoder for one tensor-parallel rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: Parallel,
        reader: CheckpointReader,
        device: torch.device,
        progress: Callable[[float, str], None] = lambda _f, _m: None,
    ) -> None:
        self.cfg = cfg
        self.parallel = parallel
        self.device = device
        self.embed = VocabParallelEmbedding.load(
            reader, parallel, "model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size
        )
        # Gemma's sqrt(hidden) scale, rounded to the serving dtype as transformers rounds it;
        # made once here, not on every forward pass.
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=reader.dtype, device=device)
                            if cfg.embed_scale != 1.0 else None)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_layers):
            self.layers.append(DecoderLayer(cfg, parallel, reader, i))
            progress((i + 1) / (cfg.num_layers + 1), f"loaded layer {i + 1}/{cfg.num_layers}")
        self.norm = read_norm(reader, "model.norm.weight", cfg.hidden_size, cfg.norm_weight_offset)
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        # A packed table is shared with a tied head as is: one copy of its blocks.
        head = self.embed.tied_head() if tied else None
        if head is None:
            head = read_linear(
                reader,
                "model.embed_tokens.weight" if tied else "lm_head.weight",
                (cfg.vocab_size, cfg.hidden_size),
                shard_dim=0,
                rank=parallel.rank,
                world_size=parallel.world_size,
                dense=self.embed.weight if tied else None,
            )
        self.lm_head = ParallelLMHead(head, parallel)
        # A tied checkpoint may still carry a copy of lm_head; it is the same tensor, not unknown.
        reader.check_all_consumed(optional=lambda n: tied and n == "lm_head.weight")
        # On CPU each layer runs as two fused ops (DecoderLayer.forward_blocks) unless debug taps
        # are asked for. A single CPU rank runs all of them in one call; tensor parallelism
        # reduces partial sums between a layer's two halves, so its ranks call them layer by layer.
        # The fused CPU ops have no per-head q/k norms, sandwich norms, other activations or
        # per-layer rope: such models (Qwen3, Gemma 3) run op by op.
        # One cos/sin cache per distinct rope (Gemma 3's windowed layers have their own base).
        caches: dict[str, torch.Tensor] = {}
        self.layer_cos_sin: list[torch.Tensor] = []
        for i in range(cfg.num_layers):
            theta, scaling = cfg.rope_of(i)
            key = repr((theta, sorted((scaling or {}).items())))
            if key not in caches:
                # rotary_dim < head_dim (Phi-4-mini): the kernels turn only the table's dims.
                caches[key] = cos_sin_cache(
                    cfg.rotary_dim, cfg.max_position_embeddings, theta, scaling).to(device)
            self.layer_cos_sin.append(caches[key])
        self.cos_sin = self.layer_cos_sin[0]
        self.fused_cpu = (device.type == "cpu" and not cfg.qk_norm and not cfg.sandwich_norms
                          and cfg.hidden_act == "silu" and len(caches) == 1)
        self.stack = (self._decoder_stack() if self.fused_cpu and parallel.world_size == 1
                      else None)
        progress(1.0, "weights loaded")

    def _decoder_stack(self) -> ops.DecoderStack:
        first = self.layers[0]
        stack = ops.DecoderStack(first.eps, (first.num_heads, first.num_kv_heads, first.head_dim),
                                 first.attn.scale)
        for layer in self.layers:
            stack.add_layer(layer.input_norm, layer.post_norm, layer.qkv.weight, layer.qkv.bias,
                            layer.o_proj.weight, layer.o_proj.fused_bias, layer.gate_up.weight,
                            layer.gate_up.bias, layer.down.weight, layer.down.fused_bias,
                            layer.attn.sliding_window)
        stack.set_head(self.norm, self.cfg.rms_norm_eps, self.lm_head.weight)
        return stack

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.cfg.num_kv_heads // self.parallel.world_size

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        taps: Taps | None = None,
    ) -> torch.Tensor:
        """Logits (float32) for each sequence's last token: [B, vocab]."""
        hidden = self.embed(input_ids)
        if self.embed_scale is not None:
            hidden.mul_(self.embed_scale)  # the lookup's output is a fresh tensor
        fused = self.fused_cpu and taps is None
        if fused and self.stack is not None:  # the layers, final norm and head in one call
            logits = self.stack.logits(hidden, self.cos_sin, kv_caches, meta).float()
        else:
            logits = self._layers_and_head(hidden, meta, kv_caches, fused, taps)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if taps is not None and "logits" in taps:
            taps["logits"] = logits.cpu()
        return logits

    def _layers_and_head(self, hidden: torch.Tensor, meta: AttentionMetadata,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]], fused: bool,
                         taps: Taps | None) -> torch.Tensor:
        """`forward`'s logits one layer at a time (tensor parallelism, debug taps, and the
        layers the fused blocks do not cover)."""
        residual: torch.Tensor | None = None
        for layer, kv, cos_sin in zip(self.layers, kv_caches, self.layer_cos_sin, strict=True):
            if fused:
                hidden, residual = layer.forward_blocks(hidden, residual, cos_sin, kv, meta)
            else:
                hidden, residual = layer.forward(hidden, residual, cos_sin, kv, meta, taps)
        assert residual is not None
        ops.fused_add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        # A decode step's rows are its sequences' last tokens: nothing to select.
        last = hidden if meta.is_decode else hidden.index_select(0, meta.logits_indices)
        return self.lm_head(last).float()
