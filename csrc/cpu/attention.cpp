// CPU: paged attention for decode (one query per sequence) and varlen causal
// prefill over the paged KV cache.
//
// Both are "a set of query rows of one sequence and one kv head, row r seeing
// keys 0..pos[r]", run by attend_rows() flash-attention style: keys are
// walked in tiles of kKeyTile tokens shared by all rows (the GQA group's
// heads, and for prefill a tile of query tokens), with an online (running
// max / sum) softmax per row. Tasks are
// (sequence, kv head[, query tile]) spread with at::parallel_for, or run on
// the calling thread when the whole call is too small to pay for waking the
// pool. Scratch memory is per thread and only ever grows, so the steady-state
// decode loop allocates nothing.
//
// The per-tile steps (score, exponentiate, accumulate) have a portable
// version, which reads a float copy of each tile, and an AVX2 one (simd.h),
// picked once per call, which reads the cache rows in place when there are
// few rows (decode) and a float copy otherwise.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../ops.h"
#include "attention_tiles.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using namespace cpu::attn;

// Below this much work (query rows x keys they see x head_dim) a call runs on
// the calling thread: waking the pool costs more than it saves there. 2^15 is
// one sequence of ~57 tokens with 9 heads of 64, about where two spinning
// threads start to win (bench/ops_cpu_bench.py: attn_decode, --threads 1 / 2).
constexpr int64_t kMinParallelWork = 1 << 15;

// at::parallel_for grain: everything in one chunk for a small call, else one
// task per chunk (tasks differ in length, so small chunks balance better).
int64_t attention_grain(int64_t tasks, int64_t work) {
  return work < kMinParallelWork ? std::max<int64_t>(tasks, 1) : 1;
}

template <typename T>
void decode_impl(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables,
                 const int32_t* ctx_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const bool simd = cpu::use_avx2();
  int64_t keys = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) keys += ctx_lens[b];
  // Task = (sequence, kv head): the group's query heads share each key tile.
  // With fewer of those than two per thread (one sequence, few kv heads: 3
  // tasks split 2 to 1 over two threads) each query head is a task instead.
  const int64_t per_task =
      d.num_seqs * d.num_kv_heads < 2 * at::get_num_threads() ? 1 : group;
  const int64_t tasks_per_seq = d.num_heads / per_task;
  const int64_t tasks = d.num_seqs * tasks_per_seq;
  at::parallel_for(0, tasks, attention_grain(tasks, keys * d.num_heads * D),
                   [&](int64_t begin, int64_t end) {
    const Workspace ws(per_task, D);
    Row<T>* rows = thread_rows<T>(per_task);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq;
      const int64_t h0 = task % tasks_per_seq * per_task;
      for (int64_t i = 0; i < per_task; ++i) {
        const int64_t h = h0 + i;
        rows[i] = {q + b * d.q_row_stride + h * d.q_head_stride,
                   out + (b * d.num_heads + h) * D, ctx_lens[b] - 1};
      }
      const PagedKV<T> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, h0 / group, D};
      attend_rows(rows, per_task, kv, scale, ws, simd);
    }
  });
}

template <typename T>
void prefill_impl(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables,
                  const int32_t* qsl, const int32_t* seq_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const bool simd = cpu::use_avx2();
  // tile_start[b] = index of sequence b's first query tile (prefix sums), in
  // a reusable buffer of the calling thread. A named reference, because the
  // workers must read this thread's copy, not their own thread_local one.
  thread_local std::vector<int64_t> tile_start_buf;
  std::vector<int64_t>& tile_start = tile_start_buf;
  tile_start.assign(d.num_seqs + 1, 0);
  int64_t work = 0;  // query tokens x keys they see (about half of q_len x seq_len)
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    tile_start[b + 1] = tile_start[b] + (q_len + kQueryTile - 1) / kQueryTile;
    work += q_len * (seq_lens[b] - q_len / 2);
  }
  // Task = (query tile, kv head): kQueryTile tokens x the group's heads.
  const int64_t tasks = tile_start[d.num_seqs] * d.num_kv_heads;
  at::parallel_for(0, tasks, attention_grain(tasks, work * d.num_heads * D),
                   [&](int64_t begin, int64_t end) {
    const Workspace ws(kQueryTile * group, D);
    Row<T>* rows = thread_rows<T>(kQueryTile * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / d.num_kv_heads;
      const int64_t g = task % d.num_kv_heads;
      // Owning sequence: last b with tile_start[b] <= tile (skips empty ones).
      const int64_t b =
          std::upper_bound(tile_start.begin(), tile_start.end(), tile) - tile_start.begin() - 1;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t t0 = (tile - tile_start[b]) * kQueryTile;
      const int64_t nt = std::min(kQueryTile, q_len - t0);
      // Causal: new token i sits at absolute position seq_len - q_len + i.
      const int64_t first_pos = seq_lens[b] - q_len;
      int64_t n = 0;
      for (int64_t t = t0; t < t0 + nt; ++t) {
        const int64_t tok = qsl[b] + t;
        for (int64_t i = 0; i < group; ++i) {
          const int64_t h = g * group + i;
          rows[n++] = {q + tok * d.q_row_stride + h * d.q_head_stride,
                       out + (tok * d.num_heads + h) * D, first_pos + t};
        }
      }
      const PagedKV<T> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, g, D};
      attend_rows(rows, n, kv, scale, ws, simd);
    }
  });
}

}  // namespace

void paged_attention_decode_cpu(at::Tensor& out, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                double scale, int64_t max_context_len) {
  const AttnDims d = check_paged_decode(out, query, key_cache, value_cache, block_tables,
                                        context_lens, max_context_len);
  if (out.numel() == 0) {
    return;
  }
  // The index tensors are host memory here: checked in place, no copy.
  const int32_t* ctx = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  check_paged_decode_indices(d, tables, ctx, max_context_len);
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_decode", [&] {
    decode_impl(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                tables, ctx, static_cast<float>(scale), d);
  });
}

void paged_attention_prefill_cpu(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t max_query_len, int64_t max_seq_len) {
  const AttnDims d = check_paged_prefill(out, query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, max_query_len, max_seq_len);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  check_paged_prefill_indices(d, tables, qsl, lens, max_query_len, max_seq_len);
  if (out.numel() == 0) {
    return;
  }
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
    prefill_impl(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                 key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                 tables, qsl, lens, static_cast<float>(scale), d);
  });
}

}  // namespace shardlm
