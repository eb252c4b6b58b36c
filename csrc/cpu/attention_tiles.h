// The tile machinery of the CPU paged attention (attention.cpp): a set of query
// rows of one sequence and one kv head, row r seeing keys first[r]..pos[r]
// (first > 0 under a sliding window), run by attend_rows() flash-attention
// style over tiles of kKeyTile keys shared by all rows, with an online
// (running max / sum) softmax per row. The per-tile steps have a portable
// version (below) and an AVX2 one, picked once per call; where the CPU has
// AVX-512VL the AVX2 one takes the rows a block at a time (attention_rows.h;
// row by row, attention_avx2.h, elsewhere and for head sizes that are not a
// multiple of 8), and
// full query tiles of a prefill take blocked AVX-512 steps (attention_blocks.h).
//
// Queries and outputs are of type T, the cache of type C, which may differ
// (e.g. float32 queries over a bfloat16 cache): cache rows are converted to
// float as they are read (or per tile into the workspace), never as a whole.
// With C == T the code is exactly the single-dtype kernel.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_avx2.h"
#include "attention_blocks.h"
#include "attention_rows.h"
#include "cpu_utils.h"

namespace shardlm::cpu::attn {

using cpu::from_f;
using cpu::to_f;

// Asks for the cache line at p into L2 (a tile's K and V rows may not fit in
// L1 beside the tile being read): a hint, harmless past the end of anything.
inline void prefetch_to_l2(const void* p) {
#if SHARDLM_HAVE_AVX2
  cpu::avx2::prefetch_line_l2(p);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

constexpr int64_t kKeyTile = 32;    // keys scored per step
constexpr int64_t kQueryTile = 16;  // prefill query tokens per task

template <typename C>
struct PagedKV {
  const C* k;
  const C* v;
  const int32_t* block_row;  // this sequence's block table row
  int64_t block_size;
  int64_t token_stride;  // kv_heads * head_dim
  int64_t head_dim;

  // off[j] = element offset of token t0 + j's row (all kv heads), for j < n.
  // Walks the block table instead of dividing per token: a 64-bit division
  // costs about as much as converting the token's row.
  void offsets(int64_t t0, int64_t n, int64_t* off) const {
    int64_t block = t0 / block_size;
    int64_t slot = t0 % block_size;
    for (int64_t j = 0; j < n; ++j) {
      off[j] = (block_row[block] * block_size + slot) * token_stride;
      if (++slot == block_size) {
        slot = 0;
        ++block;
      }
    }
  }

  // Asks for the cache lines of kv heads [g0, g1) of the K and V token rows
  // at off[0..n).
  // Inlined where it is called: inside a block's accumulation (attention_rows.h)
  // a call would make the compiler keep the accumulators in memory.
  __attribute__((always_inline)) void prefetch(const int64_t* off, int64_t n, int64_t g0,
                                               int64_t g1) const {
    const int64_t bytes = (g1 - g0) * head_dim * static_cast<int64_t>(sizeof(C));
    for (int64_t j = 0; j < n; ++j) {
      const char* k_row = reinterpret_cast<const char*>(k + off[j] + g0 * head_dim);
      const char* v_row = reinterpret_cast<const char*>(v + off[j] + g0 * head_dim);
      // Every 64 bytes, and the last byte: a row that starts inside a cache
      // line ends inside one more.
      for (int64_t b = 0; b < bytes; b += 64) {
        prefetch_to_l2(k_row + b);
        prefetch_to_l2(v_row + b);
      }
      prefetch_to_l2(k_row + bytes - 1);
      prefetch_to_l2(v_row + bytes - 1);
    }
  }
};

// The next tile's rows of kv head g (n of them at off; 0: nothing to ask
// for), asked for into L2 a share at a time while this tile's rows of g are
// computed. share(i, m) asks for share i of m; a block of rows
// (attention_rows.h) calls next(i) for share s0 + i of `shares`. A plain type,
// not a caller's lambda, so that the blocks are compiled once a cache type
// (with every caller's lambda: 150 copies, 575 KB of code), and inlined:
// through a function pointer, the calls made the compiler keep a block's
// accumulators in memory, 1.5-2x slower.
template <typename C>
struct NextTile {
  const PagedKV<C>* kv;
  const int64_t* off;
  int64_t n;
  int64_t g;
  int64_t s0;
  int64_t shares;
  __attribute__((always_inline)) void share(int64_t i, int64_t m) const {
    if (n == 0) return;
    const int64_t a = i * n / m;
    kv->prefetch(off + a, (i + 1) * n / m - a, g, g + 1);
  }
  __attribute__((always_inline)) void operator()(int64_t i) const { share(s0 + i, shares); }
};

// One query row. Its output is normalized (softmax-weighted mean of the
// values it sees) and of type O: T, or float for a partial result over a
// slice of the keys, whose log-sum-exp of scores then goes to *lse so that
// slices can be merged (merge_row in attention.cpp).
template <typename T, typename O = T>
struct Row {
  const T* q;
  O* out;
  int64_t pos;      // last visible key; < 0 means no keys (zero output)
  int64_t first;    // first visible key (0 without a sliding window)
  int64_t kv_head;  // the K and V head it reads (GQA: shared by its group)
  float* lse = nullptr;
};

// Float scratch for up to `max_rows` rows: q, acc [rows][D]; k, v [kKeyTile][D];
// scores [kKeyTile]; running max / sum [rows]; for the blocked steps the
// tile's keys transposed, kt [D][kKeyTile], and every row's scores, sb
// [rows][kKeyTile]. Views into a thread_local buffer that grows to the largest
// shape seen and is then reused.
struct Workspace {
  float *q, *acc, *k, *v, *s, *m, *l, *kt, *sb;
  Workspace(int64_t max_rows, int64_t d) {
    thread_local std::vector<float> buf;
    const size_t need = static_cast<size_t>(2 * max_rows * d + 3 * kKeyTile * d + kKeyTile +
                                            2 * max_rows + max_rows * kKeyTile);
    if (buf.size() < need) {
      buf.resize(need);
    }
    q = buf.data();
    acc = q + max_rows * d;
    k = acc + max_rows * d;
    v = k + kKeyTile * d;
    s = v + kKeyTile * d;
    m = s + kKeyTile;
    l = m + max_rows;
    kt = l + max_rows;
    sb = kt + kKeyTile * d;
  }
};

// The calling thread's row descriptors, grown like the workspace.
template <typename T, typename O = T>
Row<T, O>* thread_rows(int64_t n) {
  thread_local std::vector<Row<T, O>> rows;
  if (rows.size() < static_cast<size_t>(n)) {
    rows.resize(n);
  }
  return rows.data();
}


// ---- tile steps --------------------------------------------------------------------
// A tile's key and value rows are passed as pointers to D elements of S: a
// float copy of the tile, or (AVX2 only) the cache rows themselves, S = C.

// Converts the tile's rows to float into kt / vt ([nk][D] each) and points
// kr / vr at the copies.
template <typename T>
void convert_tile(float* kt, float* vt, const T* const* k, const T* const* v, int64_t nk,
                  int64_t D, const float** kr, const float** vr) {
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t i = 0; i < D; ++i) {
      kt[j * D + i] = to_f(k[j][i]);
      vt[j * D + i] = to_f(v[j][i]);
    }
    kr[j] = kt + j * D;
    vr[j] = vt + j * D;
  }
}

// Portable steps; with float rows they do exactly what the kernel did before
// it had an AVX2 path.
struct Portable {
  // max_j s[j], n > 0.
  static float max(const float* s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    return m;
  }
  // s[j] = q . k[j] for j < nk.
  static void scores(float* s, const float* q, const float* const* k, int64_t nk, int64_t D) {
    for (int64_t j = 0; j < nk; ++j) s[j] = cpu::dot_f(q, k[j], D);
  }
  // s[j] = exp(s[j] - m); returns the sum.
  static float exp(float* s, int64_t n, float m) {
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    return sum;
  }
  // acc = alpha * acc + sum_j p[j] * v[j].
  static void accumulate(float* acc, float alpha, const float* p, const float* const* v,
                         int64_t nk, int64_t D) {
    for (int64_t i = 0; i < D; ++i) acc[i] *= alpha;
    for (int64_t j = 0; j < nk; ++j) cpu::axpy_f(acc, p[j], v[j], D);
  }
};

// One tile for every row that sees part of it: scores, online softmax
// update, accumulation. Ops is Portable or Avx2; S is float or C. Row r sees
// tile keys [lo, hi): the causal mask cuts the end, a sliding window the start
// (rows of a prefill tile have different windows), so both are just offsets
// into the tile's row pointers. each_row(i, m) is called m times, i = 0..m-1,
// spread over the rows' work: the caller's prefetches ride on it.
template <typename Ops, typename T, typename O, typename S, typename Each>
void attend_tile(const Row<T, O>* rows, int64_t r0, int64_t r1, int64_t k0, int64_t nk,
                 const S* const* kr, const S* const* vr, int64_t D, const Workspace& ws,
                 const Each& each_row) {
  for (int64_t r = r0; r < r1; ++r) {
    // Two calls a row (before its scores, before its accumulation).
    const int64_t share = 2 * (r - r0);
    const int64_t shares = 2 * (r1 - r0);
    each_row(share, shares);
    const int64_t lo = std::max<int64_t>(0, rows[r].first - k0);
    const int64_t visible = std::min(nk, rows[r].pos - k0 + 1) - lo;
    if (visible <= 0) {
      each_row(share + 1, shares);
      continue;
    }
    Ops::scores(ws.s, ws.q + r * D, kr + lo, visible, D);
    // visible > 0 makes m_new finite, so exp(-inf - m_new) = 0 on the
    // first tile and no NaN can appear. Once the running max settles, most
    // tiles leave it as it is: alpha is then exactly exp(0) = 1, not worth a call.
    const float m_new = std::max(ws.m[r], Ops::max(ws.s, visible));
    const float alpha = m_new == ws.m[r] ? 1.f : std::exp(ws.m[r] - m_new);
    const float sum = Ops::exp(ws.s, visible, m_new);  // scores -> probabilities
    each_row(share + 1, shares);
    Ops::accumulate(ws.acc + r * D, alpha, ws.s, vr + lo, visible, D);
    ws.l[r] = ws.l[r] * alpha + sum;
    ws.m[r] = m_new;
  }
}

#if SHARDLM_HAVE_AVX2
// attend_tile with the AVX2 steps, a block of rows at a time (attention_rows.h;
// CPUs with AVX-512VL, D a multiple of 8): consecutive rows that see the same
// keys of the tile (a GQA group's heads of one token) share each key and value
// load.
template <typename T, typename O, typename S, typename C>
void attend_tile_rows(const Row<T, O>* rows, int64_t r0, int64_t r1, int64_t k0, int64_t nk,
                      const S* const* kr, const S* const* vr, int64_t D, const Workspace& ws,
                      NextTile<C> next) {
  const auto seen = [&](int64_t r, int64_t& lo) {
    lo = std::max<int64_t>(0, rows[r].first - k0);
    return std::min(nk, rows[r].pos - k0 + 1) - lo;
  };
  for (int64_t r = r0, e = r0; r < r1; r = e) {
    int64_t lo = 0;
    const int64_t visible = seen(r, lo);
    int64_t lo_e = 0;
    for (e = r + 1; e < r1 && e - r < rows::kMaxRows && seen(e, lo_e) == visible && lo_e == lo; ++e) {
    }
    // The block's share of the prefetches: two parts a row, as attend_tile
    // asks for them, from part 2 (r - r0) of the run's on.
    next.s0 = 2 * (r - r0);
    if (visible <= 0) {
      for (int64_t i = 0; i < 2 * (e - r); ++i) next(i);
      continue;
    }
    const rows::Block block{ws.q + r * D, ws.acc + r * D, ws.m + r, ws.l + r,
                            ws.sb + (r - r0) * kKeyTile, kKeyTile, D};
    rows::tile_of(e - r, block, kr + lo, vr + lo, visible, next);
  }
}

static_assert(blocks::kKeys == kKeyTile);

// attend_tile over blocks of rows (attention_blocks.h), AVX-512, float key and
// value rows, D a multiple of 16. A row's keys outside [lo, hi) score -inf, so
// they weigh 0; a row that sees none of the tile is left as it was.
template <typename T, typename O, typename Each>
void attend_tile_blocks(const Row<T, O>* rows, int64_t r0, int64_t r1, int64_t k0, int64_t nk,
                        const float* const* kr, const float* const* vr, int64_t D,
                        const Workspace& ws, const Each& each_row) {
  using blocks::kBlockRows;
  blocks::transpose_keys(ws.kt, kr, nk, D);
  const int64_t calls = 2 * ((r1 - r0 + kBlockRows - 1) / kBlockRows);
  for (int64_t b0 = r0, call = 0; b0 < r1; b0 += kBlockRows, call += 2) {
    const int64_t n = std::min(kBlockRows, r1 - b0);
    each_row(call, calls);
    blocks::scores_of(n, ws.sb, ws.q + b0 * D, ws.kt, D);
    float alpha[kBlockRows];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = b0 + i;
      float* s = ws.sb + i * kKeyTile;
      const int64_t lo = std::max<int64_t>(0, rows[r].first - k0);
      const int64_t hi = std::min(nk, rows[r].pos - k0 + 1);
      if (hi <= lo) {
        std::fill(s, s + kKeyTile, 0.f);
        alpha[i] = 1.f;
        continue;
      }
      std::fill(s, s + lo, -std::numeric_limits<float>::infinity());
      std::fill(s + hi, s + kKeyTile, -std::numeric_limits<float>::infinity());
      // As in attend_tile: hi > lo makes m_new finite, so exp gives no NaN.
      const float m_new = std::max(ws.m[r], Avx2::max(s + lo, hi - lo));
      alpha[i] = m_new == ws.m[r] ? 1.f : std::exp(ws.m[r] - m_new);
      const float sum = blocks::exp_scores(s, m_new);
      ws.l[r] = ws.l[r] * alpha[i] + sum;
      ws.m[r] = m_new;
    }
    each_row(call + 1, calls);
    blocks::accumulate_of(n, ws.acc + b0 * D, alpha, ws.sb, vr, nk, D);
  }
}
#endif

// Up to this many rows of one kv head, the AVX2 path reads bf16 / fp16 rows
// straight from the cache, converting as it goes; more rows (prefill) share
// one float copy of the tile. float32 rows are always read in place.
constexpr int64_t kMaxDirectRows = 8;


// Rows may read different kv heads (a decode task over all of a sequence's
// heads), in runs of equal kv_head: each tile is then read as whole token
// rows, one contiguous stretch of memory per token, and a run's rows reuse
// its head's part while it is in L1. `blocked`: runs of at least
// blocks::kBlockRows rows take attend_tile_blocks where the CPU has AVX-512
// and D is a multiple of 16 (a full query tile of a prefill; attention.cpp).
// `ahead_to`: the last key worth asking for ahead (the next slice's, when the
// caller attends consecutive slices; by default the rows' own last key).
template <typename T, typename O, typename C>
void attend_rows(const Row<T, O>* rows, int64_t n, const PagedKV<C>& kv, float scale,
                 const Workspace& ws, [[maybe_unused]] bool simd, bool blocked = false,
                 int64_t ahead_to = -1) {
  const int64_t D = kv.head_dim;
#if SHARDLM_HAVE_AVX2
  blocked = blocked && simd && cpu::use_avx512() && D % 16 == 0;
  // The AVX2 per-row steps in blocks of rows (attention_rows.h).
  const bool blocks_of_rows = simd && D % 8 == 0 && rows::use_blocks();
#endif
  int64_t last = -1;
  int64_t first = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < D; ++i) ws.q[r * D + i] = to_f(rows[r].q[i]) * scale;
    std::fill(ws.acc + r * D, ws.acc + (r + 1) * D, 0.f);
    ws.m[r] = -std::numeric_limits<float>::infinity();
    ws.l[r] = 0.f;
    if (rows[r].pos >= 0) {
      last = std::max(last, rows[r].pos);
      first = std::min(first, rows[r].first);
    }
  }
  // Keys before every row's window are never read: the tiles start at the
  // multiple of kKeyTile at or before the earliest first key, so a row's tiles
  // are the same whatever other rows share the call (attention.cpp).
  // Token-row offsets of the tile and of the next one, computed once each:
  // the next tile's, found for its prefetch, are the tile's on the next pass.
  int64_t offsets[2][kKeyTile];
  int64_t* off = offsets[0];
  int64_t* ahead = offsets[1];
  const C* kc[kKeyTile];  // a kv head's rows of the tile in the cache
  const C* vc[kKeyTile];
  const float* kf[kKeyTile];  // ... or in the float copy
  const float* vf[kKeyTile];
  const int64_t k_begin = last >= 0 ? first - first % kKeyTile : 0;
  if (k_begin <= last) kv.offsets(k_begin, std::min(kKeyTile, last + 1 - k_begin), off);
  for (int64_t k0 = k_begin; k0 <= last; k0 += kKeyTile, std::swap(off, ahead)) {
    const int64_t nk = std::min(kKeyTile, last + 1 - k0);
    // Blocks lie anywhere in the pool, which the hardware prefetchers cannot
    // follow: each kv head's rows of the next tile are asked for while this
    // tile's rows of that head are computed (spread out, not in one burst
    // that would overflow the queue of misses in flight).
    const int64_t ahead_last = std::max(last, ahead_to);
    const bool prefetch = k0 + kKeyTile <= ahead_last;
    int64_t na = 0;
    if (prefetch) {
      na = std::min(kKeyTile, ahead_last + 1 - k0 - kKeyTile);
      kv.offsets(k0 + kKeyTile, na, ahead);
    }
    for (int64_t r0 = 0, r1 = 0; r0 < n; r0 = r1) {
      const int64_t g = rows[r0].kv_head;
      while (r1 < n && rows[r1].kv_head == g) ++r1;
      // Call i of m asks for its share of the next tile's rows of head g.
      const NextTile<C> next{&kv, ahead, na, g, 0, 2 * (r1 - r0)};  // na: 0 without prefetch
      const auto each_row = [&](int64_t i, int64_t m) { next.share(i, m); };
      for (int64_t j = 0; j < nk; ++j) {
        kc[j] = kv.k + off[j] + g * D;
        vc[j] = kv.v + off[j] + g * D;
      }
#if SHARDLM_HAVE_AVX2
      if (blocked && r1 - r0 >= blocks::kBlockRows) {
        if constexpr (std::is_same_v<C, float>) {
          attend_tile_blocks(rows, r0, r1, k0, nk, kc, vc, D, ws, each_row);
        } else {
          convert_tile_avx2(ws.k, ws.v, kc, vc, nk, D, kf, vf);
          attend_tile_blocks(rows, r0, r1, k0, nk, kf, vf, D, ws, each_row);
        }
        continue;
      }
      if (simd && (std::is_same_v<C, float> || r1 - r0 <= kMaxDirectRows)) {
        if (blocks_of_rows) {
          attend_tile_rows(rows, r0, r1, k0, nk, kc, vc, D, ws, next);
        } else {
          attend_tile<Avx2>(rows, r0, r1, k0, nk, kc, vc, D, ws, each_row);
        }
        continue;
      }
      if (simd) {
        convert_tile_avx2(ws.k, ws.v, kc, vc, nk, D, kf, vf);
        if (blocks_of_rows) {
          attend_tile_rows(rows, r0, r1, k0, nk, kf, vf, D, ws, next);
        } else {
          attend_tile<Avx2>(rows, r0, r1, k0, nk, kf, vf, D, ws, each_row);
        }
        continue;
      }
#endif
      convert_tile(ws.k, ws.v, kc, vc, nk, D, kf, vf);
      attend_tile<Portable>(rows, r0, r1, k0, nk, kf, vf, D, ws, each_row);
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = ws.l[r] > 0.f ? 1.f / ws.l[r] : 0.f;  // no keys -> zeros
    for (int64_t i = 0; i < D; ++i) rows[r].out[i] = from_f<O>(ws.acc[r * D + i] * inv);
    if (rows[r].lse != nullptr) {
      *rows[r].lse = ws.l[r] > 0.f ? ws.m[r] + std::log(ws.l[r])
                                   : -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace shardlm::cpu::attn
