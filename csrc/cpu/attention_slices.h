// The slices of the CPU paged attention's sliced calls (attention.cpp:
// attend_sliced): where a row's keys are cut, how the slices of a call are
// grouped into tasks for the threads, and how a row's slices are merged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm::cpu::attn {

// A row's result depends only on its query, the keys it sees and their
// positions: never on the other rows, sequences or threads of the call. A
// speculative verify step computes a sequence's rows on the prefill path and
// must give each the bits a decode step would give it (greedy output identical
// with and without drafts), and a sequence must decode the same alone or in a
// batch. So a row's keys are cut into slices at absolute positions (slice c
// always holds the same keys, below), each attended in tiles that start at
// multiples of kKeyTile (attend_rows) into a float partial with its
// log-sum-exp, and merge_row() combines a row's slices in order
// (flash-decoding). A call whose rows all see keys of one slice only has
// nothing to merge, and one slice merged alone is its partial unchanged, so it
// takes the direct paths below and gets the same bits.
//
// A task attends all of one sequence's rows (every head of each new token:
// whole token rows, one contiguous read per token, the cache read once) to a
// run of its consecutive slices, one after the other, asking for the next
// slice's first tile while it finishes the one before. A sequence's slices are
// cut into a run for each thread, of about equal numbers of keys, and the
// threads take runs from a shared counter, longest first, so that runs and
// sequences of unequal length spread evenly: one sequence of 4,100 keys on two
// threads is runs of 2,048 and 2,052 keys, one of 600 runs of 256 and 344.
// Where the runs are too few or too uneven for the threads (a short context:
// 300 keys are runs of 256 and 44), a run's rows are split over tasks too, by
// kv head or by query head.
//
// Slices are kShortSliceKeys keys up to key kShortKeys, kSliceKeys after:
// short contexts still cut into a run for every thread, long ones into few
// slices (each slice's partial costs its rows' setup and a share of the
// merge). 128-key short slices spread one short sequence more evenly but cost
// a batch of 8 sequences at 600 keys 10-15% of its attention (2026-12-03).
constexpr int64_t kShortSliceKeys = 256;
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
inline bool spans_slices(const AttnDims& d, const int32_t* qsl, const int32_t* seq_lens) {
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

// The tasks of one sliced call and where their partial rows go.
struct SlicePlan {
  // slice_start[b]: sequence b's first slice in the partial buffer;
  // row_start[c]: that slice's first partial row.
  std::vector<int64_t> slice_start, row_start;
  std::vector<SliceRun> runs;  // the tasks
  bool in_order = false;       // runs in contiguous shares a thread (else from a counter)
  int64_t per_unit = 0;        // rows of a new token a task takes: every head, a group's or one
  int64_t most_rows = 0;       // a task's rows at most
  int64_t work = 0;            // rows x keys x head_dim, about
};

// A tile's keys and values of every kv head past this many bytes do not stay
// in L1 while its rows are scored and accumulated (a float32 tile of SmolLM2's
// 3 kv heads is 48 KiB).
constexpr int64_t kL1TileBytes = 32 << 10;

// Fills `plan` (reused: its vectors only grow) for `threads` threads;
// `tile_bytes`: a tile's keys and values of every kv head.
inline void plan_slices(SlicePlan& plan, const AttnDims& d, const int32_t* qsl,
                        const int32_t* seq_lens, int64_t threads, int64_t tile_bytes) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t H = d.num_heads;
  const int64_t D = d.head_dim;
  std::vector<SliceRun>& runs = plan.runs;
  plan.slice_start.assign(d.num_seqs + 1, 0);
  plan.row_start.assign(1, 0);
  runs.clear();
  plan.work = 0;
  int64_t total_keys = 0;
  int64_t most_tokens = 0;
  // A batch of at least a sequence a thread whose tiles of every head would
  // not stay in L1: each sequence's slices are one run, its rows split by kv
  // head, as the unsliced calls split a batch (a batch of 8 at 600 keys, float32
  // cache, lost 11-14% of its attention with every head in a task). Otherwise
  // a run for each thread, every head of the sequence in it.
  const bool batch = d.num_seqs >= threads && tile_bytes > kL1TileBytes;
  const int64_t runs_per_seq = batch ? 1 : threads;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t tokens = new_tokens(qsl, b);
    const SliceSpan span(qsl, seq_lens, b, d.sliding_window);
    plan.slice_start[b + 1] = plan.slice_start[b] + span.count();
    for (int64_t c = 0; c < span.count(); ++c) {
      plan.row_start.push_back(plan.row_start.back() + tokens * H);
    }
    most_tokens = std::max(most_tokens, tokens);
    // Runs of about keys / runs_per_seq keys each, cut at slice boundaries.
    const int64_t keys = std::max<int64_t>(span.last_key - span.first_key + 1, 0);
    plan.work += keys * tokens * H * D;
    total_keys += keys;
    int64_t c = span.first;
    int64_t done = 0;  // keys of the slices before c
    for (int64_t r = 0; r < runs_per_seq && c <= span.last; ++r) {
      const int64_t end = (r + 1) * keys / runs_per_seq;  // where run r should end, about
      int64_t last = c;
      int64_t run_keys = span.keys_of(c);
      while (last < span.last && (r == runs_per_seq - 1 ||
                                  done + run_keys + span.keys_of(last + 1) / 2 <= end)) {
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
  const bool even = !batch && (n_runs >= 2 * threads ||
                               (n_runs >= threads && 4 * longest <= 5 * (total_keys / threads)));
  plan.per_unit = even                                             ? H
                  : batch || n_runs * d.num_kv_heads >= 2 * threads ? group
                                                                    : 1;
  if (plan.per_unit < H) {
    const int64_t units = H / plan.per_unit;
    runs.resize(n_runs * units);
    for (int64_t i = n_runs - 1; i >= 0; --i) {  // back to front: no run is read after its slot is written
      for (int64_t u = units - 1; u >= 0; --u) {
        runs[i * units + u] = runs[i];
        runs[i * units + u].unit = u;
      }
    }
  }
  plan.most_rows = most_tokens * plan.per_unit;
  // A batch's tasks stay in order, in contiguous shares for the threads: a
  // thread then attends every kv head of its sequences, whose token rows' lines
  // the hardware fetched with the first head's. Otherwise longest first, taken
  // from a shared counter.
  plan.in_order = batch;
  if (!batch) {
    std::stable_sort(runs.begin(), runs.end(),
                     [](const SliceRun& x, const SliceRun& y) { return x.keys > y.keys; });
  }
}

}  // namespace shardlm::cpu::attn
