// CPU: a decoder layer's two halves, each one op, so a decode step pays the
// Python interpreter and the dispatcher twice per layer instead of about ten
// times, and keeps its intermediates in C++.
//
//   attention_block: residual += hidden; hidden = rms_norm(residual);
//                    qkv = hidden W_qkv^T (+ b); rotary(q, k); write k, v to
//                    the paged cache; out = attention(q) W_o^T (+ b), the
//                    attention within `sliding_window` keys if that is > 0
//   mlp_block:       residual += hidden; hidden = rms_norm(residual);
//                    out = silu_and_mul(hidden W_gate_up^T (+ b)) W_down^T (+ b)
//
// Each step is the same kernel the unfused ops run (called directly, not
// through the dispatcher), so the results equal the unfused layer bit for bit.
// The plain reference is that composition (worker/ops/reference.py). A
// tensor-parallel rank passes no bias for its row-parallel projection (o, down)
// and adds it after the all-reduce. A weight comes as a dense [N, K] tensor
// (qtype -1) or as GGML blocks with their type, as for quant_linear.
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/record_function.h>

#include "../mixed_rows.h"
#include "../ops.h"
#include "decoder_block.h"
#include "quant_blocks.h"

namespace shardlm {
namespace {

// A scope the profiler shows as a child of the block (bench/model_bench.py
// splits a decode step by these names); costs a flag test when not profiling.
#define SHARDLM_SCOPE(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{})

// Output features of a weight as linear_into takes it: a dense [N, K] tensor
// (qtype -1), blocks of which a row holds 8 weight rows in the grouped
// layouts, or a Mixed weight, whose header says.
int64_t out_features(const at::Tensor& weight, int64_t qtype) {
  if (qtype == mixed::kType) {
    return mixed::total_rows(weight.const_data_ptr<uint8_t>(), weight.numel());
  }
  return weight.size(0) * (qtype < 0 ? 1 : cpu::quant::rows_per_blocks_row(qtype));
}

}  // namespace

void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                 const std::optional<at::Tensor>& bias) {
  SHARDLM_SCOPE("shardlm::linear");
  if (qtype >= 0) {
    quant_linear_cpu(out, x, weight, qtype, bias);
  } else if (x.size(0) <= skinny_max_rows(x.scalar_type())) {
    skinny_linear_cpu(out, x, weight, bias);
  } else if (bias.has_value()) {
    at::addmm_out(out, *bias, x, weight.t());
  } else {
    at::mm_out(out, x, weight.t());
  }
}

bool reuse_rows(at::Tensor& buffer, const at::Tensor& like, int64_t rows, int64_t cols) {
  if (buffer.defined() && buffer.size(0) == rows && buffer.size(1) == cols &&
      buffer.scalar_type() == like.scalar_type()) {
    return false;
  }
  buffer = at::empty({rows, cols}, like.options());
  return true;
}

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
                          double scale, int64_t sliding_window) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim;
  const int64_t kv_size = num_kv_heads * head_dim;
  fused_add_rms_norm_cpu(hidden, residual, norm_weight, eps);
  if (reuse_rows(s.qkv, hidden, tokens, q_size + 2 * kv_size)) {
    s.q = s.qkv.narrow(1, 0, q_size);
    s.k = s.qkv.narrow(1, q_size, kv_size);
    s.v = s.qkv.narrow(1, q_size + kv_size, kv_size);
    s.q3 = s.q.view({tokens, num_heads, head_dim});
    s.k3 = s.k.view({tokens, num_kv_heads, head_dim});
    s.v3 = s.v.view({tokens, num_kv_heads, head_dim});
  }
  linear_into(s.qkv, hidden, qkv_weight, qkv_type, qkv_bias);
  if (reuse_rows(s.attn, hidden, tokens, q_size)) {
    s.attn3 = s.attn.view({tokens, num_heads, head_dim});
  }
  {
    SHARDLM_SCOPE("shardlm::attention");
    rotary_embedding_cpu(positions, s.q, s.k, head_dim, cos_sin_cache);
    reshape_and_cache_cpu(s.k3, s.v3, key_cache, value_cache, slot_mapping);
    if (is_decode) {
      paged_attention_decode_cpu(s.attn3, s.q3, key_cache, value_cache, block_tables, seq_lens,
                                 scale, max_seq_len, sliding_window);
    } else {
      paged_attention_prefill_cpu(s.attn3, s.q3, key_cache, value_cache, block_tables,
                                  query_start_loc, seq_lens, scale, max_query_len, max_seq_len,
                                  sliding_window);
    }
  }
  linear_into(out, s.attn, o_weight, o_type, o_bias);
}

void attention_block_cpu(at::Tensor& out, at::Tensor& hidden, at::Tensor& residual,
                         const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_weight,
                         int64_t qkv_type, const std::optional<at::Tensor>& qkv_bias,
                         const at::Tensor& o_weight, int64_t o_type,
                         const std::optional<at::Tensor>& o_bias, const at::Tensor& positions,
                         const at::Tensor& cos_sin_cache, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, bool is_decode,
                         int64_t max_query_len, int64_t max_seq_len, double scale,
                         int64_t sliding_window) {
  BlockScratch s;
  attention_block_into(s, out, hidden, residual, norm_weight, eps, qkv_weight, qkv_type, qkv_bias,
                       o_weight, o_type, o_bias, positions, cos_sin_cache, num_heads, num_kv_heads,
                       head_dim, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                       query_start_loc, is_decode, max_query_len, max_seq_len, scale,
                       sliding_window);
}

void mlp_block_into(BlockScratch& s, at::Tensor& out, at::Tensor& hidden, at::Tensor& residual,
                    const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_weight,
                    int64_t gate_up_type, const std::optional<at::Tensor>& gate_up_bias,
                    const at::Tensor& down_weight, int64_t down_type,
                    const std::optional<at::Tensor>& down_bias) {
  const int64_t tokens = hidden.size(0);
  fused_add_rms_norm_cpu(hidden, residual, norm_weight, eps);
  const int64_t both = out_features(gate_up_weight, gate_up_type);
  reuse_rows(s.gate_up, hidden, tokens, both);
  linear_into(s.gate_up, hidden, gate_up_weight, gate_up_type, gate_up_bias);
  reuse_rows(s.act, hidden, tokens, both / 2);
  silu_and_mul_cpu(s.act, s.gate_up);
  linear_into(out, s.act, down_weight, down_type, down_bias);
}

void mlp_block_cpu(at::Tensor& out, at::Tensor& hidden, at::Tensor& residual,
                   const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_weight,
                   int64_t gate_up_type, const std::optional<at::Tensor>& gate_up_bias,
                   const at::Tensor& down_weight, int64_t down_type,
                   const std::optional<at::Tensor>& down_bias) {
  BlockScratch s;
  mlp_block_into(s, out, hidden, residual, norm_weight, eps, gate_up_weight, gate_up_type,
                 gate_up_bias, down_weight, down_type, down_bias);
}

}  // namespace shardlm
