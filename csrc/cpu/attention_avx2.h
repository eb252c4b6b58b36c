// The AVX2 per-row steps of the CPU paged attention's tiles (attention_tiles.h:
// attend_tile with Ops = Avx2): scores of one query row against a tile's
// keys, the tile's largest score, the exponentials and their sum, and the
// accumulation of the weighted values. The tiles take them row by row on CPUs
// without AVX-512VL and for head sizes that are not a multiple of 8; the
// others go through attention_rows.h's blocks, which use max_avx2 and exp_avx2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_utils.h"
#include "simd.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::attn {

using cpu::to_f;

// Same maths with 8-wide FMAs, so float32 sums round differently (well within
// the tolerance), and avx2::exp8 instead of std::exp. Rows of bf16 / fp16 are
// converted as they are read.
namespace avx2 = cpu::avx2;

template <typename T>
SHARDLM_AVX2 void convert_tile_avx2(float* kt, float* vt, const T* const* k, const T* const* v,
                                    int64_t nk, int64_t D, const float** kr, const float** vr) {
  for (int64_t j = 0; j < nk; ++j) {
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
      avx2::store8(kt + j * D + i, avx2::load8(k[j] + i));
      avx2::store8(vt + j * D + i, avx2::load8(v[j] + i));
    }
    for (; i < D; ++i) {
      kt[j * D + i] = to_f(k[j][i]);
      vt[j * D + i] = to_f(v[j][i]);
    }
    kr[j] = kt + j * D;
    vr[j] = vt + j * D;
  }
}

// Eight keys at a time: eight independent FMA chains keep the FMA units busy
// (one dot product alone is a single latency-bound chain), and q is loaded
// once per eight keys.
template <typename S>
SHARDLM_AVX2 void scores_avx2(float* s, const float* q, const S* const* k, int64_t nk,
                              int64_t D) {
  const int64_t D8 = D & ~int64_t{7};
  int64_t j = 0;
  for (; j + 8 <= nk; j += 8) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D8; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, avx2::load8(k[j + u] + i), a[u]);
    }
    _mm_storeu_ps(s + j, avx2::hsum4(a[0], a[1], a[2], a[3]));
    _mm_storeu_ps(s + j + 4, avx2::hsum4(a[4], a[5], a[6], a[7]));
    for (int64_t i = D8; i < D; ++i) {
      for (int u = 0; u < 8; ++u) s[j + u] += q[i] * to_f(k[j + u][i]);
    }
  }
  for (; j < nk; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < D8; i += 8) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), avx2::load8(k[j] + i), a);
    }
    float dot = avx2::hsum(a);
    for (int64_t i = D8; i < D; ++i) dot += q[i] * to_f(k[j][i]);
    s[j] = dot;
  }
}

// A tile's largest score, eight lanes at a time: one serial chain of maxes
// (three cycles a score) was a twentieth of the decode attention's time.
SHARDLM_AVX2 inline float max_avx2(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float top = _mm_cvtss_f32(h);
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

SHARDLM_AVX2 inline float exp_avx2(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (j < n) {
    // Pad the tail with -inf: exp(-inf) = 0 adds nothing to the sum.
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -std::numeric_limits<float>::infinity());
    std::copy(s + j, s + n, tail);
    const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv));
    _mm256_store_ps(tail, p);
    std::copy(tail, tail + (n - j), s + j);
    sum = _mm256_add_ps(sum, p);
  }
  return avx2::hsum(sum);
}

// Columns [c, c + 8*NV) of one row's accumulator, kept in NV registers
// across all nk keys.
template <int NV, typename S>
SHARDLM_AVX2 inline void accumulate_cols(float* acc, float alpha, const float* p,
                                         const S* const* v, int64_t nk, int64_t c) {
  __m256 a[NV];
  const __m256 al = _mm256_set1_ps(alpha);
  for (int u = 0; u < NV; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8 * u), al);
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int u = 0; u < NV; ++u) a[u] = _mm256_fmadd_ps(pj, avx2::load8(v[j] + c + 8 * u), a[u]);
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + c + 8 * u, a[u]);
}

template <typename S>
SHARDLM_AVX2 void accumulate_avx2(float* acc, float alpha, const float* p, const S* const* v,
                                  int64_t nk, int64_t D) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) accumulate_cols<8>(acc, alpha, p, v, nk, c);
  for (; c + 32 <= D; c += 32) accumulate_cols<4>(acc, alpha, p, v, nk, c);
  for (; c + 8 <= D; c += 8) accumulate_cols<1>(acc, alpha, p, v, nk, c);
  for (; c < D; ++c) {
    float a = acc[c] * alpha;
    for (int64_t j = 0; j < nk; ++j) a += p[j] * to_f(v[j][c]);
    acc[c] = a;
  }
}

struct Avx2 {
  static float max(const float* s, int64_t n) { return max_avx2(s, n); }
  template <typename S>
  static void scores(float* s, const float* q, const S* const* k, int64_t nk, int64_t D) {
    scores_avx2(s, q, k, nk, D);
  }
  static float exp(float* s, int64_t n, float m) { return exp_avx2(s, n, m); }
  template <typename S>
  static void accumulate(float* acc, float alpha, const float* p, const S* const* v,
                         int64_t nk, int64_t D) {
    accumulate_avx2(acc, alpha, p, v, nk, D);
  }
};

}  // namespace shardlm::cpu::attn
#endif  // SHARDLM_HAVE_AVX2
