// The per-row tile steps of the CPU paged attention (attention_tiles.h:
// attend_tile_rows), taken a block of rows at a time: the rows of a GQA group
// (or a verify step's tokens) that see the same keys of a tile read each key
// and value vector once for the whole block, instead of once a row.
//
// A row's bits never depend on the block it is computed in. Each score is one
// chain of FMAs over the head's 8-float chunks, in order, then hsum4's lanes;
// each accumulator lane is alpha * acc, then one FMA a key, in key order; the
// maximum and the exponentials are the row's own (attention_avx2.h). So a
// decode step, a verify step's rows and a lone head all get the same bits for
// the same query, keys and positions (attention_slices.h), at any block size.
//
// Why: the per-row steps spent ~25 cycles a key and head on a Zen 4 core where
// their 16 FMAs need 8 (2026-12-07, SmolLM2's 9 heads over 3 kv heads, every
// size of context, the cache in L2 or L3): each FMA read its operand from L1,
// the key and value rows once per head of the group. A block shares each load
// among its rows, so the FMAs, not the loads, set the pace. The blocks are
// compiled with AVX-512VL, whose 32 vector registers hold the accumulators of
// up to 4 rows (kMaxRows), and taken where the CPU has it: with AVX2's 16
// registers, blocks of 2 rows were 4-15% slower than row by row (2026-12-07).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_avx2.h"
#include "cpu_utils.h"
#include "simd.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::attn::rows {

namespace avx2 = cpu::avx2;

// Rows a block at most.
constexpr int kMaxRows = 4;
// Keys scored a pass (a multiple of 4: hsum4 turns 4 chains into 4 scores):
// 8 for one or two rows, whose 4 keys alone would leave the FMA units waiting
// on too few chains; 4 for more rows, whose chains then fill the registers.
template <int NR>
constexpr int keys_a_pass() {
  return NR <= 2 ? 8 : 4;
}

// A block of NR rows of the same keys: q, acc rows D apart; m, l one a row
// (running max and sum); s s_stride floats a row (scores, then probabilities).
struct Block {
  const float* q;
  float* acc;
  float* m;
  float* l;
  float* s;
  int64_t s_stride;
  int64_t D;
};

// Spreads n calls of piece(i) over `steps` ticks, about evenly, without a
// division: tick() makes the calls due by then, i counting on from `next`.
struct Spread {
  int64_t steps, n, next, credit = 0;
  template <typename Piece>
  SHARDLM_AVX2 __attribute__((always_inline)) void tick(const Piece& piece) {
    for (credit += n; credit >= steps; credit -= steps) piece(next++);
  }
};

// s[r][j] = q_r . k[j] for j < nk. A tile's last keys past a multiple of 4
// are scored beside copies of its last key, and only theirs are kept.
template <int NR, int K, typename S, typename Piece>
SHARDLM_AVX2 __attribute__((always_inline)) inline void scores(const Block& b,
                                                               const S* const* k, int64_t nk,
                                                               const Piece& piece) {
  Spread spread{(nk + K - 1) / K, NR, 0};
  for (int64_t j = 0; j < nk; j += K) {
    spread.tick(piece);
    const S* kp[K];
    for (int u = 0; u < K; ++u) kp[u] = k[std::min<int64_t>(j + u, nk - 1)];
    __m256 a[NR][K];
    for (int r = 0; r < NR; ++r) {
      for (int u = 0; u < K; ++u) a[r][u] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < b.D; i += 8) {
      __m256 qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(b.q + r * b.D + i);
      for (int u = 0; u < K; ++u) {
        const __m256 kv = avx2::load8(kp[u] + i);
        for (int r = 0; r < NR; ++r) a[r][u] = _mm256_fmadd_ps(qv[r], kv, a[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      for (int u = 0; u < K; u += 4) {
        const __m128 four = avx2::hsum4(a[r][u], a[r][u + 1], a[r][u + 2], a[r][u + 3]);
        float* out = b.s + r * b.s_stride + j + u;
        if (j + u + 4 <= nk) {
          _mm_storeu_ps(out, four);
        } else if (j + u < nk) {
          alignas(16) float t[4];
          _mm_store_ps(t, four);
          std::copy(t, t + (nk - j - u), out);
        }
      }
    }
  }
}

// Columns [c, c + 8 * C8) of every row's accumulator: acc = alpha * acc, then
// acc += p[j] * v[j] for each key in order, each value chunk loaded once for
// the block.
template <int NR, int C8, typename S, typename Piece>
SHARDLM_AVX2 __attribute__((always_inline)) inline void accumulate_cols(
    const Block& b, const float* alpha, const S* const* v, int64_t nk, int64_t c,
    const Piece& piece) {
  __m256 a[NR][C8];
  for (int r = 0; r < NR; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int u = 0; u < C8; ++u) {
      a[r][u] = _mm256_mul_ps(_mm256_loadu_ps(b.acc + r * b.D + c + 8 * u), al);
    }
  }
  // The first pass over the columns carries the second half of the pieces.
  Spread spread{c == 0 ? (nk + 3) / 4 : 1, c == 0 ? NR : 0, NR};
  for (int64_t j = 0; j < nk; ++j) {
    if (j % 4 == 0) spread.tick(piece);
    __m256 p[NR];
    for (int r = 0; r < NR; ++r) p[r] = _mm256_broadcast_ss(b.s + r * b.s_stride + j);
    for (int u = 0; u < C8; ++u) {
      const __m256 vv = avx2::load8(v[j] + c + 8 * u);
      for (int r = 0; r < NR; ++r) a[r][u] = _mm256_fmadd_ps(p[r], vv, a[r][u]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int u = 0; u < C8; ++u) _mm256_storeu_ps(b.acc + r * b.D + c + 8 * u, a[r][u]);
  }
}

// Columns a pass for NR rows: as many as the registers hold beside a value
// chunk and the rows' probabilities.
template <int NR>
constexpr int chunks_a_pass() {
  return NR <= 3 ? 8 : 4;
}

// One tile for a block of NR rows that see keys k[0..nk) (and v): scores,
// the online softmax update, the accumulation. piece(i) is called for
// i = 0 .. 2 NR - 1, spread over the block's work (the first NR over the
// scores, the others over the accumulation): the caller's prefetches of the
// next tile ride on it a little at a time, two parts a row as the per-row
// steps have them. In bursts (a row's two parts at the start of the block's
// scores and after them) they made SmolLM2's decode attention at 1,000 keys,
// from memory, 20% slower (2026-12-07): most likely more misses asked for at
// once than a core keeps in flight.
template <int NR, typename S, typename Piece>
SHARDLM_AVX512_VL void tile(const Block& b, const S* const* k, const S* const* v, int64_t nk,
                            const Piece& piece) {
  scores<NR, keys_a_pass<NR>()>(b, k, nk, piece);
  float alpha[NR];
  for (int r = 0; r < NR; ++r) {
    float* s = b.s + r * b.s_stride;
    // nk > 0 makes m_new finite, so exp(-inf - m_new) = 0 on the first tile
    // and no NaN can appear; a max that did not move gives alpha exactly 1.
    const float m_new = std::max(b.m[r], max_avx2(s, nk));
    alpha[r] = m_new == b.m[r] ? 1.f : std::exp(b.m[r] - m_new);
    const float sum = exp_avx2(s, nk, m_new);
    b.l[r] = b.l[r] * alpha[r] + sum;
    b.m[r] = m_new;
  }
  constexpr int C8 = chunks_a_pass<NR>();
  int64_t c = 0;
  for (; c + 8 * C8 <= b.D; c += 8 * C8) accumulate_cols<NR, C8>(b, alpha, v, nk, c, piece);
  for (; c < b.D; c += 8) accumulate_cols<NR, 1>(b, alpha, v, nk, c, piece);
}

// tile() for a block of n rows, 1 .. kMaxRows.
template <typename S, typename Piece>
void tile_of(int64_t n, const Block& b, const S* const* k, const S* const* v, int64_t nk,
             const Piece& piece) {
  switch (n) {
    case 1: return tile<1>(b, k, v, nk, piece);
    case 2: return tile<2>(b, k, v, nk, piece);
    case 3: return tile<3>(b, k, v, nk, piece);
    default: return tile<4>(b, k, v, nk, piece);
  }
}

// Whether the CPU takes the blocks: AVX-512 with VL, and not capped below it.
inline bool use_blocks() { return cpu::use_avx512() && cpu::cpu_has_avx512_vl(); }

}  // namespace shardlm::cpu::attn::rows
#endif  // SHARDLM_HAVE_AVX2
