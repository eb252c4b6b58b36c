// CPU: paged attention for decode (one query per sequence) and varlen causal
// prefill over the paged KV cache.
//
// Both are "a set of query rows of one sequence and one kv head, row r seeing
// keys first[r]..pos[r]" (first[r] = 0, or under a sliding window of W keys
// pos[r] - W + 1), run by attend_rows() flash-attention style: keys are
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
// few rows (decode) and a float copy otherwise. The cache may hold another
// dtype than the query (cache_t vs scalar_t); it is converted as it is read.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../ops.h"
#include "attention_slices.h"
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

// The query tile that prefill task slot i (of `tiles`) takes: 0, tiles - 1, 1,
// tiles - 2, ... A causal tile's cost grows with its position, and
// at::parallel_for hands each thread one contiguous run of slots, so in tile
// order the thread with the last half of a prompt did three quarters of the
// work (2 threads, a 512-token prompt: the other waited a third of the
// attention's time). Interleaved, each run holds cheap and dear tiles alike.
inline int64_t balanced_tile(int64_t i, int64_t tiles) {
  return i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
}

// Keys a query at `pos` attends to: pos + 1, or at most the window.
inline int64_t keys_seen(int64_t pos, int64_t window) {
  return pos + 1 - window_first_key(pos, window);
}

// The sliced call: row j of sequence b is its slices' partial rows j, merged.
template <typename T, typename C>
void attend_sliced(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables,
                   const int32_t* qsl, const int32_t* seq_lens, float scale,
                   const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t H = d.num_heads;
  const int64_t D = d.head_dim;
  const int64_t window = d.sliding_window;
  const bool simd = cpu::use_avx2();
  const int64_t threads = at::get_num_threads();
  // The calling thread's plan and partials, named so that the workers read
  // this thread's copies.
  thread_local SlicePlan plan_buf;
  thread_local std::vector<float> partial_buf;
  SlicePlan& plan = plan_buf;
  plan_slices(plan, d, qsl, seq_lens, threads,
              kKeyTile * d.num_kv_heads * D * static_cast<int64_t>(2 * sizeof(C)));
  const std::vector<int64_t>& slice_start = plan.slice_start;
  const std::vector<int64_t>& row_start = plan.row_start;
  const std::vector<SliceRun>& runs = plan.runs;
  const int64_t per_unit = plan.per_unit;
  const int64_t most_rows = plan.most_rows;
  const int64_t work = plan.work;
  const int64_t slices = slice_start[d.num_seqs];
  const int64_t rows_total = row_start[slices];
  std::vector<float>& partial = partial_buf;
  partial.resize(static_cast<size_t>(rows_total * (D + 1)));
  float* lse = partial.data() + rows_total * D;
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(runs.size());
  const int64_t workers = work < kMinParallelWork ? 1 : std::min(threads, n_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    const Workspace ws(most_rows, D);
    Row<T, float>* rows = thread_rows<T, float>(most_rows);
    const auto attend_run = [&](const SliceRun& run) {
      const int64_t b = run.b;
      const int64_t tokens = new_tokens(qsl, b);
      const int64_t first_pos = seq_lens[b] - tokens;
      const SliceSpan span(qsl, seq_lens, b, window);
      const PagedKV<C> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, D};
      const int64_t run_end = std::min(slice_first_key(run.last + 1) - 1, span.last_key);
      for (int64_t c = run.first; c <= run.last; ++c) {
        const int64_t lo = slice_first_key(c);
        const int64_t hi = slice_first_key(c + 1) - 1;
        const int64_t r0 = row_start[slice_start[b] + c - span.first];
        int64_t n = 0;
        for (int64_t j = 0; j < tokens * H; ++j) {
          const SlicedRow row(j, tokens, group);
          if (per_unit < H && row.h / per_unit != run.unit) continue;
          const int64_t tok = qsl != nullptr ? qsl[b] + row.t : b;
          const int64_t pos = first_pos + row.t;
          const int64_t first = std::max(lo, window_first_key(pos, window));
          const int64_t last = std::min(pos, hi);
          rows[n++] = {q + tok * d.q_row_stride + row.h * d.q_head_stride,
                       partial.data() + (r0 + j) * D, first <= last ? last : -1, first,
                       row.h / group, lse + r0 + j};
        }
        // The per-row steps: a verify step's runs (its few tokens x the
        // group's heads) are too short for the blocked ones to pay for their
        // transposes.
        attend_rows(rows, n, kv, scale, ws, simd, false, run_end);
      }
    };
    if (plan.in_order) {
      for (int64_t w = w0; w < w1; ++w) {
        for (int64_t i = w * n_tasks / workers; i < (w + 1) * n_tasks / workers; ++i) {
          attend_run(runs[i]);
        }
      }
    } else {
      for (int64_t i = next++; i < n_tasks; i = next++) attend_run(runs[i]);
    }
  });
  // The merge reads every partial once: split over the threads by sequence
  // when there is enough of it (a batch), on this thread otherwise.
  const int64_t merge_work = rows_total * D;
  at::parallel_for(0, d.num_seqs, merge_work < kMinParallelWork ? d.num_seqs : 1,
                   [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> merged;  // one row's sum while merging
    merged.resize(static_cast<size_t>(D));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tokens = new_tokens(qsl, b);
      const int64_t s0 = slice_start[b];
      const int64_t stride = tokens * H;  // rows a slice of b
      for (int64_t j = 0; j < stride; ++j) {
        const SlicedRow row(j, tokens, group);
        const int64_t tok = qsl != nullptr ? qsl[b] + row.t : b;
        merge_row(out + (tok * H + row.h) * D, partial.data() + (row_start[s0] + j) * D,
                  lse + row_start[s0] + j, slice_start[b + 1] - s0, stride, D, merged.data());
      }
    }
  });
}

template <typename T, typename C>
void decode_impl(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables,
                 const int32_t* ctx_lens, float scale, const AttnDims& d) {
  if (spans_slices(d, nullptr, ctx_lens)) {
    attend_sliced(out, q, kc, vc, tables, nullptr, ctx_lens, scale, d);
    return;
  }
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const int64_t window = d.sliding_window;
  const bool simd = cpu::use_avx2();
  int64_t keys = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) keys += keys_seen(ctx_lens[b] - 1, window);
  // Task = (sequence, kv head): the group's query heads share each key tile.
  // With fewer of those than two per thread (one sequence, few kv heads, a
  // context too short to slice: 3 tasks split 2 to 1 over two threads) each
  // query head is a task instead.
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
                   out + (b * d.num_heads + h) * D, ctx_lens[b] - 1,
                   window_first_key(ctx_lens[b] - 1, window), h / group};
      }
      const PagedKV<C> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, D};
      attend_rows(rows, per_task, kv, scale, ws, simd);
    }
  });
}

template <typename T, typename C>
void prefill_impl(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables,
                  const int32_t* qsl, const int32_t* seq_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const int64_t window = d.sliding_window;
  const bool simd = cpu::use_avx2();
  // tile_start[b] = index of sequence b's first query tile (prefix sums), in
  // a reusable buffer of the calling thread. A named reference, because the
  // workers must read this thread's copy, not their own thread_local one.
  thread_local std::vector<int64_t> tile_start_buf;
  std::vector<int64_t>& tile_start = tile_start_buf;
  tile_start.assign(d.num_seqs + 1, 0);
  int64_t work = 0;  // query tokens x keys they see (about)
  bool one_tile_each = true;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    one_tile_each &= q_len <= kQueryTile;
    tile_start[b + 1] = tile_start[b] + (q_len + kQueryTile - 1) / kQueryTile;
    // (the middle token's keys, as the window allows)
    work += q_len * keys_seen(seq_lens[b] - 1 - q_len / 2, window);
  }
  // Task = (query tile, kv head): kQueryTile tokens x the group's heads.
  const int64_t tiles = tile_start[d.num_seqs];
  const int64_t tasks = tiles * d.num_kv_heads;
  // At most a tile of tokens a sequence (a verify step, a short turn after a
  // cached prefix): each row as a decode step computes it (attend_sliced).
  if (one_tile_each && spans_slices(d, qsl, seq_lens)) {
    attend_sliced(out, q, kc, vc, tables, qsl, seq_lens, scale, d);
    return;
  }
  at::parallel_for(0, tasks, attention_grain(tasks, work * d.num_heads * D),
                   [&](int64_t begin, int64_t end) {
    const Workspace ws(kQueryTile * group, D);
    Row<T>* rows = thread_rows<T>(kQueryTile * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = balanced_tile(task / d.num_kv_heads, tiles);
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
                       out + (tok * d.num_heads + h) * D, first_pos + t,
                       window_first_key(first_pos + t, window), g};
        }
      }
      const PagedKV<C> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, D};
      // A full query tile takes the blocked AVX-512 steps; a shorter one (a
      // prompt's last tile) and every row of a call of one tile a sequence (a
      // verify step, whose rows must be computed as decode computes them) the
      // per-row steps.
      attend_rows(rows, n, kv, scale, ws, simd, nt == kQueryTile && !one_tile_each);
    }
  });
}

}  // namespace

void paged_attention_decode_cpu(at::Tensor& out, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                double scale, int64_t max_context_len, int64_t sliding_window) {
  const AttnDims d = check_paged_decode(out, query, key_cache, value_cache, block_tables,
                                        context_lens, max_context_len, sliding_window);
  if (out.numel() == 0) {
    return;
  }
  // The index tensors are host memory here: checked in place, no copy.
  const int32_t* ctx = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  check_paged_decode_indices(d, tables, ctx, max_context_len);
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_decode", [&] {
    using T = scalar_t;
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "paged_attention_decode", [&] {
      decode_impl(out.data_ptr<T>(), query.const_data_ptr<T>(),
                  key_cache.const_data_ptr<cache_t>(), value_cache.const_data_ptr<cache_t>(),
                  tables, ctx, static_cast<float>(scale), d);
    });
  });
}

void paged_attention_prefill_cpu(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t max_query_len, int64_t max_seq_len,
                                 int64_t sliding_window) {
  const AttnDims d = check_paged_prefill(out, query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, max_query_len, max_seq_len,
                                         sliding_window);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  check_paged_prefill_indices(d, tables, qsl, lens, max_query_len, max_seq_len);
  if (out.numel() == 0) {
    return;
  }
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
    using T = scalar_t;
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "paged_attention_prefill", [&] {
      prefill_impl(out.data_ptr<T>(), query.const_data_ptr<T>(),
                   key_cache.const_data_ptr<cache_t>(), value_cache.const_data_ptr<cache_t>(),
                   tables, qsl, lens, static_cast<float>(scale), d);
    });
  });
}

}  // namespace shardlm
