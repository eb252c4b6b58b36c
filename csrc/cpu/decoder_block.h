// CPU: the decoder layer halves of decoder_block.cpp with their intermediates
// kept by the caller, so DecoderStack allocates them (and their q/k/v views)
// once per forward instead of once per layer; the ops attention_block and
// mlp_block (ops.h) are these with a scratch of their own.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace shardlm {

// A layer's intermediates for one forward: the fused q/k/v product with its
// views, the attention's output, the MLP's gate/up product and activation.
// Empty until first used; re-made only when a layer needs another shape.
struct BlockScratch {
  at::Tensor qkv, q, k, v, q3, k3, v3;
  at::Tensor attn, attn3;
  at::Tensor gate_up, act;
};

// out = x W^T (+ bias), the kernel ops.linear picks for the same inputs; W is
// dense (qtype -1) or GGML blocks of type qtype (quant_linear).
void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                 const std::optional<at::Tensor>& bias);

// Makes `buffer` a [rows, cols] tensor of like's dtype and device unless it
// already is one; true when it made a new one.
bool reuse_rows(at::Tensor& buffer, const at::Tensor& like, int64_t rows, int64_t cols);

void attention_block_into(BlockScratch& s, at::Tensor& out, at::Tensor& hidden,
                          at::Tensor& residual, const at::Tensor& norm_weight, double eps,
                          const at::Tensor& qkv_weight, int64_t qkv_type,
                          const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                          int64_t o_type, const std::optional<at::Tensor>& o_bias,
                          const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          at::Tensor& key_cache, at::Tensor& value_cache,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          bool is_decode, int64_t max_query_len, int64_t max_seq_len,
                          double scale, int64_t sliding_window);

void mlp_block_into(BlockScratch& s, at::Tensor& out, at::Tensor& hidden, at::Tensor& residual,
                    const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_weight,
                    int64_t gate_up_type, const std::optional<at::Tensor>& gate_up_bias,
                    const at::Tensor& down_weight, int64_t down_type,
                    const std::optional<at::Tensor>& down_bias);

}  // namespace shardlm
