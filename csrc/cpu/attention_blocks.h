// AVX-512 steps of the CPU prefill attention over blocks of query rows
// (attention_tiles.h: attend_tile_blocks). The per-row steps there score one
// query against a tile's keys with a dot product per key and reload every key
// and value row for every query row: one load per FMA, and a horizontal sum
// per key. Here a tile's keys are transposed once ([D][kKeys], key in the
// lane), so kBlockRows query rows are scored together, each broadcast query
// element feeding two FMAs and each key vector four rows; and the values are
// accumulated into kBlockRows rows at once, each value vector feeding four
// rows. The sums run in another order than the per-row steps', so the results
// differ from theirs in the last bits: only full query tiles of a prefill take
// this path (attention.cpp), never a decode step or a verify step, whose
// results must equal plain decoding's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::attn::blocks {

constexpr int64_t kKeys = 32;      // keys a tile (attention_tiles.h: kKeyTile)
constexpr int64_t kBlockRows = 4;  // query rows a block

// kt[d * kKeys + j] = k[j][d] for j < nk, 0 for the tile's missing keys (D a
// multiple of 8), in 8 x 8 transposes.
SHARDLM_AVX512 inline void transpose_keys(float* kt, const float* const* k, int64_t nk,
                                          int64_t D) {
  for (int64_t j0 = 0; j0 < kKeys; j0 += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 v[8];
      for (int64_t u = 0; u < 8; ++u) {
        v[u] = j0 + u < nk ? _mm256_loadu_ps(k[j0 + u] + d0) : _mm256_setzero_ps();
      }
      cpu::avx2::transpose8(v);
      for (int64_t u = 0; u < 8; ++u) _mm256_storeu_ps(kt + (d0 + u) * kKeys + j0, v[u]);
    }
  }
}

// s[r * kKeys + j] = q[r * D + d] . kt[d][j] summed over d, for R rows.
template <int R>
SHARDLM_AVX512 void scores(float* s, const float* q, const float* kt, int64_t D) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeys);
    const __m512 k1 = _mm512_loadu_ps(kt + d * kKeys + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
      a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kKeys, a[r][0]);
    _mm512_storeu_ps(s + r * kKeys + 16, a[r][1]);
  }
}

// acc[r * D + c] = alpha[r] * acc[r * D + c] + sum_j p[r * kKeys + j] v[j][c]
// for R rows and columns [c0, c0 + 16 NV).
template <int R, int NV>
SHARDLM_AVX512 void accumulate_cols(float* acc, const float* alpha, const float* p,
                                    const float* const* v, int64_t nk, int64_t D, int64_t c0) {
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int u = 0; u < NV; ++u) {
      a[r][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c0 + 16 * u), al);
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 w[NV];
    for (int u = 0; u < NV; ++u) w[u] = _mm512_loadu_ps(v[j] + c0 + 16 * u);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(p[r * kKeys + j]);
      for (int u = 0; u < NV; ++u) a[r][u] = _mm512_fmadd_ps(x, w[u], a[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + r * D + c0 + 16 * u, a[r][u]);
  }
}

// All D columns (a multiple of 16), 64 at a time.
template <int R>
SHARDLM_AVX512 void accumulate(float* acc, const float* alpha, const float* p,
                               const float* const* v, int64_t nk, int64_t D) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) accumulate_cols<R, 4>(acc, alpha, p, v, nk, D, c);
  for (; c < D; c += 16) accumulate_cols<R, 1>(acc, alpha, p, v, nk, D, c);
}

// s[j] = e^(s[j] - m) for a tile's kKeys scores, and their sum: the bits of
// exp_avx2 (attention_avx2.h) in half the instructions, its four 8-lane
// quarters added in its order.
SHARDLM_AVX512 inline float exp_scores(float* s, float m) {
  static_assert(kKeys == 32);
  const __m512 mv = _mm512_set1_ps(m);
  const __m512 p0 = cpu::avx512::exp16(_mm512_sub_ps(_mm512_loadu_ps(s), mv));
  const __m512 p1 = cpu::avx512::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16), mv));
  _mm512_storeu_ps(s, p0);
  _mm512_storeu_ps(s + 16, p1);
  using cpu::avx512::upper8;
  const __m256 first = _mm256_add_ps(_mm512_castps512_ps256(p0), upper8(p0));
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(first, _mm512_castps512_ps256(p1)), upper8(p1));
  return cpu::avx2::hsum(sum);
}

// The two steps for a block of `rows` (1 .. kBlockRows) rows.
inline void scores_of(int64_t rows, float* s, const float* q, const float* kt, int64_t D) {
  switch (rows) {
    case 1: return scores<1>(s, q, kt, D);
    case 2: return scores<2>(s, q, kt, D);
    case 3: return scores<3>(s, q, kt, D);
    default: return scores<4>(s, q, kt, D);
  }
}

inline void accumulate_of(int64_t rows, float* acc, const float* alpha, const float* p,
                          const float* const* v, int64_t nk, int64_t D) {
  switch (rows) {
    case 1: return accumulate<1>(acc, alpha, p, v, nk, D);
    case 2: return accumulate<2>(acc, alpha, p, v, nk, D);
    case 3: return accumulate<3>(acc, alpha, p, v, nk, D);
    default: return accumulate<4>(acc, alpha, p, v, nk, D);
  }
}

}  // namespace shardlm::cpu::attn::blocks
#endif  // SHARDLM_HAVE_AVX2
