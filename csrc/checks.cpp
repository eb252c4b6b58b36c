// Input validation shared by the CPU and CUDA implementations, so that both
// reject exactly the same inputs with the same messages. check_* of the op
// name checks metadata (shapes, strides, dtypes, devices). The paged
// attention index checks (context / query / sequence lengths, block-table
// entries) read the index tensors' data: the CPU ops pass their own pointers,
// the CUDA launchers a host copy made before launch (skipped while a CUDA
// graph is being captured; see copy_indices_to_host in cuda/cuda_utils.cuh).
// rotary_embedding's positions and reshape_and_cache's slots are checked by
// the CPU ops only; their CUDA kernels skip out-of-range entries instead, so
// a bad index there writes nothing rather than raising. The linear ops'
// checks are in checks_linear.cpp.
#include "ops.h"

#include <c10/util/Exception.h>

#include "check_helpers.h"

namespace shardlm {

using checks::check_float;
using checks::check_same_device;

namespace {

void check_index(const at::Tensor& t, const char* name, at::ScalarType want, int64_t dim,
                 const char* op) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// [num_blocks, block_size, kv_heads, head_dim] key/value caches of one float
// dtype, which need not be the key's / query's (`ref`): the ops convert.
void check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& ref, const char* op) {
  TORCH_CHECK(key_cache.dim() == 4, op,
              ": key_cache must be [num_blocks, block_size, kv_heads, head_dim], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op,
              ": value_cache shape ", value_cache.sizes(), " != key_cache shape ",
              key_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  check_float(key_cache, "key_cache", op);
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), op,
              ": value_cache dtype ", value_cache.scalar_type(), " != key_cache dtype ",
              key_cache.scalar_type());
  check_same_device(ref, key_cache, "key_cache", op);
  check_same_device(ref, value_cache, "value_cache", op);
}

// Common part of the two attention ops: query/out [N, H, D], caches, tables.
AttnDims check_attention_common(const at::Tensor& out, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, int64_t num_seqs,
                                int64_t sliding_window, const char* op) {
  check_float(query, "query", op);
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0: no window), got ",
              sliding_window);
  TORCH_CHECK(query.dim() == 3, op, ": query must be [tokens, num_heads, head_dim], got ",
              query.sizes());
  TORCH_CHECK(query.size(2) == 0 || query.stride(2) == 1, op,
              ": query's last dimension must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out shape ", out.sizes(),
              " != query shape ", query.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out dtype ", out.scalar_type(),
              " != query dtype ", query.scalar_type());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_same_device(query, out, "out", op);
  check_caches(key_cache, value_cache, query, op);
  check_index(block_tables, "block_tables", at::kInt, 2, op);
  check_same_device(query, block_tables, "block_tables", op);
  TORCH_CHECK(block_tables.size(0) == num_seqs, op, ": block_tables has ",
              block_tables.size(0), " rows but there are ", num_seqs, " sequences");

  AttnDims d{};
  d.num_seqs = num_seqs;
  d.num_tokens = query.size(0);
  d.num_heads = query.size(1);
  d.head_dim = query.size(2);
  d.num_blocks = key_cache.size(0);
  d.block_size = key_cache.size(1);
  d.num_kv_heads = key_cache.size(2);
  d.max_blocks_per_seq = block_tables.size(1);
  d.q_row_stride = query.stride(0);
  d.q_head_stride = query.stride(1);
  d.sliding_window = sliding_window;
  TORCH_CHECK(key_cache.size(3) == d.head_dim, op, ": cache head_dim ", key_cache.size(3),
              " != query head_dim ", d.head_dim);
  TORCH_CHECK(d.head_dim > 0, op, ": head_dim must be positive");
  TORCH_CHECK(d.block_size > 0, op, ": block_size must be positive");
  TORCH_CHECK(d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads == 0, op, ": num_heads (",
              d.num_heads, ") must be a multiple of num_kv_heads (", d.num_kv_heads, ")");
  return d;
}

// Block-table entries the kernels read for tokens first..len-1 must point
// inside the cache; the table must have columns for all `len` tokens.
void check_block_row(const int32_t* row, int64_t first, int64_t len, const AttnDims& d,
                     int64_t seq, const char* op) {
  const int64_t needed = (len + d.block_size - 1) / d.block_size;
  TORCH_CHECK(needed <= d.max_blocks_per_seq, op, ": sequence ", seq, " needs ", needed,
              " blocks for ", len, " tokens but block_tables has ", d.max_blocks_per_seq,
              " columns");
  for (int64_t i = first / d.block_size; i < needed; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < d.num_blocks, op, ": block_tables[", seq, "][", i,
                "] = ", row[i], " is outside [0, ", d.num_blocks, ")");
  }
}

}  // namespace

int64_t check_rms_norm(const at::Tensor& dst, const char* dst_name, const at::Tensor& src,
                       const char* src_name, const at::Tensor& weight, const char* op) {
  check_float(src, src_name, op);
  TORCH_CHECK(src.dim() >= 1, op, ": ", src_name, " must be at least 1-D");
  TORCH_CHECK(dst.sizes() == src.sizes(), op, ": ", dst_name, " shape ", dst.sizes(), " != ",
              src_name, " shape ", src.sizes());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && weight.scalar_type() == src.scalar_type(),
              op, ": ", dst_name, ", ", src_name, " and weight must share one dtype, got ",
              dst.scalar_type(), ", ", src.scalar_type(), ", ", weight.scalar_type());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": ", dst_name, " and ", src_name,
              " must be contiguous");
  const int64_t hidden = src.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), op,
              ": weight must be a contiguous [", hidden, "] tensor, got ", weight.sizes());
  check_same_device(src, dst, dst_name, op);
  check_same_device(src, weight, "weight", op);
  return hidden;
}

int64_t check_act_and_mul(const at::Tensor& out, const at::Tensor& input, const char* op) {
  check_float(input, "input", op);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op,
              ": input's last dimension must be even ([..., 2*d]), got ", input.sizes());
  const int64_t d = input.size(-1) / 2;
  auto want = input.sizes().vec();
  want.back() = d;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(want), op, ": out must have shape ",
              at::IntArrayRef(want),
              ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": out dtype ", out.scalar_type(),
              " != input dtype ", input.scalar_type());
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(), op,
              ": input and out must be contiguous");
  check_same_device(input, out, "out", op);
  return d;
}

namespace {
// query/key for rotary: [T, heads*head_size] or [T, heads, head_size].
void rope_layout(const at::Tensor& t, const char* name, int64_t num_tokens, int64_t head_size,
                 int64_t& heads, int64_t& row_stride, int64_t& head_stride) {
  const char* op = "rotary_embedding";
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, op, ": ", name,
              " must be [tokens, heads*head_size] or [tokens, heads, head_size], got ",
              t.sizes());
  TORCH_CHECK(t.size(0) == num_tokens, op, ": ", name, " has ", t.size(0),
              " tokens but positions has ", num_tokens);
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, op, ": ", name,
              "'s last dimension must be contiguous");
  row_stride = t.stride(0);
  if (t.dim() == 2) {
    TORCH_CHECK(t.size(1) % head_size == 0, op, ": ", name, " width ", t.size(1),
                " is not a multiple of head_size ", head_size);
    heads = t.size(1) / head_size;
    head_stride = head_size;
  } else {
    TORCH_CHECK(t.size(2) == head_size, op, ": ", name, " head size ", t.size(2),
                " != head_size ", head_size);
    heads = t.size(1);
    head_stride = t.stride(1);
  }
}
}  // namespace

RopeDims check_rotary(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache) {
  const char* op = "rotary_embedding";
  check_index(positions, "positions", at::kLong, 1, op);
  check_float(query, "query", op);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), op, ": key dtype ", key.scalar_type(),
              " != query dtype ", query.scalar_type());
  TORCH_CHECK(head_size > 0, op, ": head_size must be positive");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.is_contiguous(),
              op, ": cos_sin_cache must be a contiguous float32 [max_position, rot_dim] tensor");
  check_same_device(query, positions, "positions", op);
  check_same_device(query, key, "key", op);
  check_same_device(query, cos_sin_cache, "cos_sin_cache", op);

  RopeDims d{};
  d.num_tokens = positions.size(0);
  d.head_size = head_size;
  d.rot_dim = cos_sin_cache.size(1);
  d.max_position = cos_sin_cache.size(0);
  TORCH_CHECK(d.rot_dim > 0 && d.rot_dim % 2 == 0 && d.rot_dim <= head_size, op,
              ": cos_sin_cache width (rot_dim) must be even and in (0, head_size], got ",
              d.rot_dim);
  rope_layout(query, "query", d.num_tokens, head_size, d.q_heads, d.q_row_stride,
              d.q_head_stride);
  rope_layout(key, "key", d.num_tokens, head_size, d.k_heads, d.k_row_stride, d.k_head_stride);
  return d;
}

CacheWriteDims check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_float(key, "key", op);
  TORCH_CHECK(key.dim() == 3, op, ": key must be [tokens, kv_heads, head_dim], got ",
              key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value shape ", value.sizes(),
              " != key shape ", key.sizes());
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value dtype ",
              value.scalar_type(), " != key dtype ", key.scalar_type());
  TORCH_CHECK(key.numel() == 0 || (key.stride(2) == 1 && value.stride(2) == 1), op,
              ": key and value must be contiguous in head_dim");
  check_same_device(key, value, "value", op);
  check_caches(key_cache, value_cache, key, op);
  check_index(slot_mapping, "slot_mapping", at::kLong, 1, op);
  check_same_device(key, slot_mapping, "slot_mapping", op);
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), op, ": slot_mapping has ",
              slot_mapping.size(0), " entries but key has ", key.size(0), " tokens");
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), op,
              ": cache [.., .., kv_heads, head_dim] = ", key_cache.sizes(),
              " does not match key ", key.sizes());

  CacheWriteDims d{};
  d.num_tokens = key.size(0);
  d.kv_heads = key.size(1);
  d.head_dim = key.size(2);
  d.num_blocks = key_cache.size(0);
  d.block_size = key_cache.size(1);
  d.k_row_stride = key.stride(0);
  d.k_head_stride = key.stride(1);
  d.v_row_stride = value.stride(0);
  d.v_head_stride = value.stride(1);
  return d;
}

AttnDims check_paged_decode(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t max_context_len, int64_t sliding_window) {
  const char* op = "paged_attention_decode";
  check_index(context_lens, "context_lens", at::kInt, 1, op);
  check_same_device(query, context_lens, "context_lens", op);
  TORCH_CHECK(query.dim() >= 1 && context_lens.size(0) == query.size(0), op,
              ": context_lens has ", context_lens.size(0), " entries but query has ",
              query.dim() >= 1 ? query.size(0) : 0, " sequences");
  TORCH_CHECK(max_context_len >= 0, op, ": max_context_len must be >= 0");
  return check_attention_common(out, query, key_cache, value_cache, block_tables,
                                context_lens.size(0), sliding_window, op);
}

AttnDims check_paged_prefill(const at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, int64_t max_query_len,
                             int64_t max_seq_len, int64_t sliding_window) {
  const char* op = "paged_attention_prefill";
  check_index(seq_lens, "seq_lens", at::kInt, 1, op);
  check_index(query_start_loc, "query_start_loc", at::kInt, 1, op);
  check_same_device(query, seq_lens, "seq_lens", op);
  check_same_device(query, query_start_loc, "query_start_loc", op);
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, op,
              ": query_start_loc must have num_seqs + 1 = ", seq_lens.size(0) + 1,
              " entries, got ", query_start_loc.size(0));
  TORCH_CHECK(max_query_len >= 0 && max_seq_len >= 0, op,
              ": max_query_len and max_seq_len must be >= 0");
  return check_attention_common(out, query, key_cache, value_cache, block_tables,
                                seq_lens.size(0), sliding_window, op);
}

void check_paged_decode_indices(const AttnDims& d, const int32_t* block_tables,
                                const int32_t* context_lens, int64_t max_context_len) {
  const char* op = "paged_attention_decode";
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    // The CUDA kernel sizes its grid from max_context_len: a longer context
    // would silently attend to its first max_context_len tokens only.
    TORCH_CHECK(context_lens[b] >= 0 && context_lens[b] <= max_context_len, op,
                ": context_lens[", b, "] = ", context_lens[b],
                " is outside [0, max_context_len=", max_context_len, "]");
    // The one query sits at position context_lens[b] - 1.
    const int64_t first = window_first_key(context_lens[b] - 1, d.sliding_window);
    check_block_row(block_tables + b * d.max_blocks_per_seq, first, context_lens[b], d, b, op);
  }
}

void check_paged_prefill_indices(const AttnDims& d, const int32_t* block_tables,
                                 const int32_t* query_start_loc, const int32_t* seq_lens,
                                 int64_t max_query_len, int64_t max_seq_len) {
  const char* op = "paged_attention_prefill";
  const int32_t* qsl = query_start_loc;
  TORCH_CHECK(qsl[0] == 0 && qsl[d.num_seqs] == d.num_tokens, op,
              ": query_start_loc must start at 0 and end at the number of query tokens (",
              d.num_tokens, "), got [", qsl[0], ", ..., ", qsl[d.num_seqs], "]");
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    // With the two ends fixed, non-negative lengths keep every row inside
    // query. The CUDA grid is sized by max_query_len, so a longer sequence
    // would leave its last rows unwritten.
    const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= max_query_len, op, ": query length ", q_len,
                " of sequence ", b, " is outside [0, max_query_len=", max_query_len, "]");
    TORCH_CHECK(seq_lens[b] >= q_len && seq_lens[b] <= max_seq_len, op, ": seq_lens[", b,
                "] = ", seq_lens[b], " must be in [query length ", q_len,
                ", max_seq_len=", max_seq_len, "]");
    // The first new token (position seq_len - q_len) sees the earliest key.
    const int64_t first = window_first_key(seq_lens[b] - q_len, d.sliding_window);
    check_block_row(block_tables + b * d.max_blocks_per_seq, first, seq_lens[b], d, b, op);
  }
}

}  // namespace shardlm
