// Declarations shared by the schema registration (ops.cpp), the CPU kernels
// (cpu/*.cpp), the CUDA launchers (cuda/*.cu) and the input validation
// (checks.cpp). Validation lives in one place so that the CPU and CUDA
// implementations reject exactly the same inputs with the same messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace shardlm {

// ---------------------------------------------------------------------------
// Validation helpers (checks.cpp). The metadata checks return the sizes the
// kernels need, so the kernels never re-derive them differently from what was
// checked.
// ---------------------------------------------------------------------------

// rms_norm / fused_add_rms_norm: `dst` and `src` are [..., H] tensors of the
// same shape (names are used in messages); returns the hidden size H.
int64_t check_rms_norm(const at::Tensor& dst, const char* dst_name, const at::Tensor& src,
                       const char* src_name, const at::Tensor& weight, const char* op);

// silu_and_mul / gelu_tanh_and_mul (`op` names it in messages): returns d
// (input is [..., 2*d], out is [..., d]).
int64_t check_act_and_mul(const at::Tensor& out, const at::Tensor& input, const char* op);

// skinny_linear: out [M, N] = input [M, K] @ weight [N, K]^T (+ bias [N]).
struct LinearDims {
  int64_t m, n, k;
};
LinearDims check_skinny_linear(const at::Tensor& out, const at::Tensor& input,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// quant_linear: out [M, N] = input [M, K] @ W [N, K]^T (+ bias [N]) with W as
// `blocks`, uint8 [N, K / 32 * bytes per block] of GGML type `qtype`.
LinearDims check_quant_linear(const at::Tensor& out, const at::Tensor& input,
                              const at::Tensor& blocks, int64_t qtype,
                              const std::optional<at::Tensor>& bias);

// quant_rows: out [count, K] float32 = rows ids [count] (int64, each in [0, N))
// of W, blocks as for quant_linear (not Mixed).
struct QuantRowsDims {
  int64_t count, n, k;
};
QuantRowsDims check_quant_rows(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype,
                               const at::Tensor& ids);

struct RopeDims {
  int64_t num_tokens;
  int64_t q_heads, k_heads;
  int64_t head_size, rot_dim, max_position;
  int64_t q_row_stride, q_head_stride, k_row_stride, k_head_stride;
};
RopeDims check_rotary(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache);

// The caches' dtype may differ from the key's / query's (reshape_and_cache
// converts on write, the attention kernels on read); key and value caches
// share one dtype.
struct CacheWriteDims {
  int64_t num_tokens, kv_heads, head_dim, num_blocks, block_size;
  int64_t k_row_stride, k_head_stride, v_row_stride, v_head_stride;
};
CacheWriteDims check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping);

struct AttnDims {
  int64_t num_seqs;      // B
  int64_t num_tokens;    // rows of query (B for decode, total_q for prefill)
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t num_blocks, block_size, max_blocks_per_seq;
  int64_t q_row_stride, q_head_stride;  // query may be a strided view; out is contiguous
  // 0, or W: a query at position p sees keys p - W < j <= p only (W keys,
  // itself included; transformers' sliding-window mask).
  int64_t sliding_window;
};
// The first key a query at position `pos` sees under window `w` (0: none).
inline int64_t window_first_key(int64_t pos, int64_t w) {
  return w > 0 && pos - w + 1 > 0 ? pos - w + 1 : 0;
}
AttnDims check_paged_decode(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t max_context_len, int64_t sliding_window);
AttnDims check_paged_prefill(const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, int64_t max_query_len,
                             int64_t max_seq_len, int64_t sliding_window);
// Data checks of the paged attention index tensors, given as host pointers
// (contiguous int32, shapes already checked by the two functions above):
// lengths within the max_* the kernels are sized by, query_start_loc
// spanning exactly the query rows, and every block-table entry a sequence
// needs inside [0, num_blocks) and within the table's columns. With a
// sliding window only the blocks from the sequence's first visible key on
// are read, so only those entries are checked: blocks that slid out of every
// window may have been handed back (marked -1). The CPU ops
// pass the tensors' own data; the CUDA launchers a host copy.
void check_paged_decode_indices(const AttnDims& d, const int32_t* block_tables,
                                const int32_t* context_lens, int64_t max_context_len);
void check_paged_prefill_indices(const AttnDims& d, const int32_t* block_tables,
                                 const int32_t* query_start_loc, const int32_t* seq_lens,
                                 int64_t max_query_len, int64_t max_seq_len);

// ---------------------------------------------------------------------------
// CPU implementations (cpu/*.cpp)
// ---------------------------------------------------------------------------
void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double eps);
void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                          int64_t head_size, const at::Tensor& cos_sin_cache);
void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul_cpu(at::Tensor& out, const at::Tensor& input);
void skinny_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);
void quant_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                      int64_t qtype, const std::optional<at::Tensor>& bias);
void quant_rows_cpu(at::Tensor& out, const at::Tensor& blocks, int64_t qtype,
                    const at::Tensor& ids);
// The most input rows for which skinny_linear beats torch's GEMM on a dense
// weight of this dtype (0: never); the one source of that rule, read by
// Python through shardlm_server.worker._C.skinny_max_rows.
int64_t skinny_max_rows(at::ScalarType dtype);
// A decoder layer's halves (cpu/decoder_block.cpp); qtype -1 marks a dense weight.
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
                         int64_t sliding_window);
void mlp_block_cpu(at::Tensor& out, at::Tensor& hidden, at::Tensor& residual,
                   const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_weight,
                   int64_t gate_up_type, const std::optional<at::Tensor>& gate_up_bias,
                   const at::Tensor& down_weight, int64_t down_type,
                   const std::optional<at::Tensor>& down_bias);
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping);
void paged_attention_decode_cpu(at::Tensor& out, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                double scale, int64_t max_context_len, int64_t sliding_window);
void paged_attention_prefill_cpu(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window);
// out[r]: row r of logits sampled (cpu/sampling.cpp); temperature 0 is greedy.
void sample_rows_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniform);
// The sampling penalties, in place on float32 logits (cpu/penalties.cpp).
void penalize_rows_cpu(at::Tensor& logits, const std::vector<at::Tensor>& seen,
                       const std::vector<at::Tensor>& counts, const at::Tensor& repetition,
                       const at::Tensor& frequency, const at::Tensor& presence);

// ---------------------------------------------------------------------------
// CUDA implementations (cuda/*.cu); only compiled and registered when the
// extension is built with CUDA (SHARDLM_WITH_CUDA=1).
// ---------------------------------------------------------------------------
void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                   double eps);
void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                             double eps);
void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           int64_t head_size, const at::Tensor& cos_sin_cache);
void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul_cuda(at::Tensor& out, const at::Tensor& input);
void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache,
                            const at::Tensor& slot_mapping);
void paged_attention_decode_cuda(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                 double scale, int64_t max_context_len, int64_t sliding_window);
void paged_attention_prefill_cuda(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  double scale, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window);

}  // namespace shardlm
