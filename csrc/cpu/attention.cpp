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

// A row's result depends only on its query, the keys it sees and their
// positions: never on the other rows, sequences or threads of the call. A
// speculative verify step computes a sequence's rows on the prefill path and
// must give each the bits a decode step would give it (greedy output identical
// with and without drafts), and a sequence must decode the same alone or in a
// batch. So a row's keys are cut at absolute positions into slices (below),
// each attended in
// tiles that start at multiples of kKeyTile (attend_rows), into a float partial
// with its log-sum-exp, and merge_row() combines a row's slices in order
// (flash-decoding). A call whose rows all see keys of one slice only has
// nothing to merge, and one slice merged alone is its partial unchanged, so it
// takes the direct paths below and gets the same bits.
//
// A task attends all of one sequence's rows (every head of each new token:
// whole token rows, one contiguous read per token, the cache read once) to a
// run of its consecutive slices, one after the other, asking for the next
// slice's first tile while it finishes the one before. A sequence's slices
// are cut into as many runs as there are threads, of about equal numbers of
// keys, and the threads take runs from a shared counter, longest first, so
// that runs of unequal length (a context's last slice is partial) and
// sequences of unequal length spread evenly: one sequence of 4,100 keys on two
// threads is two runs of 2,048 and 2,052 keys, as flash-decoding's even split
// would cut it; one of 300 is runs of 128 and 172.
// Slices are kShortSliceKeys keys up to key kShortKeys, kSliceKeys after:
// short contexts then still cut into runs for every thread, long ones into few
// slices (each slice starts with a tile that was not asked for ahead).
constexpr int64_t kShortSliceKeys = 128;
constexpr int64_t kShortKeys = 1024;
constexpr int64_t kSliceKeys = 512;
constexpr int64_t kShortSlices = kShortKeys / kShortSliceKeys;

inline int64_t slice_of(int64_t key) {
  return key < kShortKeys ? key / kShortSliceKeys : kShortSlices + (key - kShortKeys) / kSliceKeys;
}
inline int64_t slice_first_key(int64_t c) {
  return c < kShortSlices ? c * kShortSliceKeys : kShortKeys + (c - kShortSlices) * kSliceKeys;
}

// Query rows of sequence b: its new tokens (query_start_loc; nullptr: one a
// sequence, decode).
inline int64_t new_tokens(const int32_t* qsl, int64_t b) {
  return qsl != nullptr ? qsl[b + 1] - qsl[b] : 1;
}

// Sequence b's keys (its rows' together), first_key .. last_key, and the
// absolute slices they lie in, first .. last.
struct SliceSpan {
  int64_t first_key, last_key, first, last;
  SliceSpan(const int32_t* qsl, const int32_t* seq_lens, int64_t b, int64_t window)
      : first_key(std::max<int64_t>(
            0, window_first_key(seq_lens[b] - new_tokens(qsl, b), window))),
        last_key(seq_lens[b] - 1),
        first(slice_of(first_key)),
        last(slice_of(std::max(last_key, first_key))) {}
  int64_t count() const { return last - first + 1; }
  int64_t keys_of(int64_t c) const {  // keys of slice c the rows see
    return std::max<int64_t>(0, std::min(slice_first_key(c + 1) - 1, last_key) -
                                    std::max(slice_first_key(c), first_key) + 1);
  }
};

// Whether some sequence's rows see keys of more than one slice.
bool spans_slices(const AttnDims& d, const int32_t* qsl, const int32_t* seq_lens) {
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    if (SliceSpan(qsl, seq_lens, b, d.sliding_window).count() > 1) return true;
  }
  return false;
}

// out = the softmax-weighted mean of one row over its slices: slice c's mean
// (partial + c * stride * D) weighted by its share exp(lse[c * stride]) of the
// total.
template <typename T>
void merge_row(T* out, const float* partial, const float* lse, int64_t slices, int64_t stride,
               int64_t D, float* acc) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < slices; ++c) top = std::max(top, lse[c * stride]);
  std::fill(acc, acc + D, 0.f);
  float total = 0.f;
  if (top > -std::numeric_limits<float>::infinity()) {
    for (int64_t c = 0; c < slices; ++c) {
      const float w = std::exp(lse[c * stride] - top);
      const float* p = partial + c * stride * D;
      for (int64_t i = 0; i < D; ++i) acc[i] += w * p[i];
      total += w;
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;  // no keys -> zeros
  for (int64_t i = 0; i < D; ++i) out[i] = from_f<T>(acc[i] * inv);
}

// Row j of a sliced sequence with `tokens` new tokens: rows go kv head by kv
// head (then token, then head of the group), so that a kv head's rows of a
// tile are one run in attend_rows and its keys are read once for all of them.
// t: the row's new token (0 .. tokens - 1), h: its query head.
struct SlicedRow {
  int64_t t, h;
  SlicedRow(int64_t j, int64_t tokens, int64_t group)
      : t(j / group % tokens), h(j / (tokens * group) * group + j % group) {}
};

// One task of the sliced call: sequence b's slices first .. last (absolute
// indices), `keys` keys in all, and of its rows those of unit `unit` (all of
// them, one kv head's or one query head's: attend_sliced's per_unit).
struct SliceRun {
  int64_t b, first, last, unit, keys;
};

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
  // slice_start[b]: sequence b's first slice in the partial buffer;
  // row_start[c]: that slice's first partial row. Buffers of the calling
  // thread, named so that the workers read this thread's copies.
  thread_local std::vector<int64_t> slice_start_buf;
  thread_local std::vector<int64_t> row_start_buf;
  thread_local std::vector<float> partial_buf;
  thread_local std::vector<SliceRun> run_buf;
  std::vector<int64_t>& slice_start = slice_start_buf;
  std::vector<int64_t>& row_start = row_start_buf;
  std::vector<SliceRun>& runs = run_buf;
  slice_start.assign(d.num_seqs + 1, 0);
  row_start.assign(1, 0);
  runs.clear();
  int64_t most_rows = 0;
  int64_t work = 0;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t tokens = new_tokens(qsl, b);
    const SliceSpan span(qsl, seq_lens, b, window);
    slice_start[b + 1] = slice_start[b] + span.count();
    for (int64_t c = 0; c < span.count(); ++c) row_start.push_back(row_start.back() + tokens * H);
    most_rows = std::max(most_rows, tokens * H);
    // Runs of about keys / threads keys each, cut at slice boundaries.
    const int64_t keys = span.last_key - span.first_key + 1;
    work += std::max<int64_t>(keys, 0) * tokens * H * D;
    total_keys += std::max<int64_t>(keys, 0);
    int64_t c = span.first;
    int64_t done = 0;  // keys of the slices before c
    for (int64_t r = 0; r < threads && c <= span.last; ++r) {
      const int64_t end = (r + 1) * keys / threads;  // where run r should end, about
      int64_t last = c;
      int64_t run_keys = span.keys_of(c);
      while (last < span.last &&
             (r == threads - 1 || done + run_keys + span.keys_of(last + 1) / 2 <= end)) {
        run_keys += span.keys_of(++last);
      }
      runs.push_back({b, c, last, 0, run_keys});
      done += run_keys;
      c = last + 1;
    }
  }
  // Too few runs, or runs too uneven, to keep every thread busy (a short
  // context, whose keys fill one slice or two): a run's rows are split over
  // tasks too, by kv head, or by query head where even those are too few.
  int64_t longest = 0;
  for (const SliceRun& run : runs) longest = std::max(longest, run.keys);
  const int64_t n_runs = static_cast<int64_t>(runs.size());
  const bool even = n_runs >= 2 * threads ||
                    (n_runs >= threads && 4 * longest <= 5 * (total_keys / threads));
  const int64_t per_unit = even                                    ? H
                           : n_runs * d.num_kv_heads >= 2 * threads ? group
                                                                    : 1;
  if (per_unit < H) {
    const int64_t units = H / per_unit;
    runs.resize(n_runs * units);
    for (int64_t i = n_runs - 1; i >= 0; --i) {
      for (int64_t u = units - 1; u >= 0; --u) {
        runs[i * units + u] = runs[i];
        runs[i * units + u].unit = u;
      }
    }
  }
  std::stable_sort(runs.begin(), runs.end(),
                   [](const SliceRun& x, const SliceRun& y) { return x.keys > y.keys; });
  const int64_t slices = slice_start[d.num_seqs];
  const int64_t rows_total = row_start[slices];
  std::vector<float>& partial = partial_buf;
  partial.resize(static_cast<size_t>(rows_total * (D + 1) + D));
  float* lse = partial.data() + rows_total * D;
  float* merged = lse + rows_total;  // one row's sum while merging
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(runs.size());
  const int64_t workers = work < kMinParallelWork ? 1 : std::min(threads, n_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const Workspace ws(most_rows, D);
    Row<T, float>* rows = thread_rows<T, float>(most_rows);
    for (int64_t i = next++; i < n_tasks; i = next++) {
      const SliceRun& run = runs[i];
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
    }
  });
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t tokens = new_tokens(qsl, b);
    const int64_t s0 = slice_start[b];
    const int64_t stride = tokens * H;  // rows a slice of b
    for (int64_t j = 0; j < stride; ++j) {
      const SlicedRow row(j, tokens, group);
      const int64_t tok = qsl != nullptr ? qsl[b] + row.t : b;
      merge_row(out + (tok * H + row.h) * D, partial.data() + (row_start[s0] + j) * D,
                lse + row_start[s0] + j, slice_start[b + 1] - s0, stride, D, merged);
    }
  }
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
