// panel_int16.h: the rounding of input rows and weight panels to 14-bit
// integer pairs, and the register tiles that multiply them.
#include "panel_int16.h"

// First, so that its silencing of GCC 12's AVX-512 header warnings applies (simd.h).
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_utils.h"
#include "quant_blocks.h"

namespace shardlm::cpu::panel16 {
namespace {

// Word pairs per block.
constexpr int64_t kPairs = kBlock / 2;

inline int32_t word_of(int32_t even, int32_t odd) {
  return static_cast<int32_t>((static_cast<uint32_t>(odd) << 16) |
                              (static_cast<uint32_t>(even) & 0xffffu));
}

inline int32_t low_of(int32_t word) { return static_cast<int16_t>(word & 0xffff); }
inline int32_t high_of(int32_t word) { return word >> 16; }

// The reciprocal of a step and the step itself for `levels`, as the kernels
// and the reference compute them: float divisions, 0 for all zeros.
inline float inverse_of(float amax, int32_t levels) {
  return amax > 0.f ? static_cast<float>(levels) / amax : 0.f;
}
inline float step_of(float amax, int32_t levels) { return amax / static_cast<float>(levels); }

// ---- rounding ------------------------------------------------------------------------
// An input block of kBlock elements at v into its kPairs words.

void round_row_block_scalar(int32_t* words, float& scale, const float* v) {
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inverse = inverse_of(amax, kInputLevels);
  for (int64_t i = 0; i < kPairs; ++i) {
    words[i] = word_of(static_cast<int32_t>(std::nearbyint(v[2 * i] * inverse)),
                       static_cast<int32_t>(std::nearbyint(v[2 * i + 1] * inverse)));
  }
  scale = step_of(amax, kInputLevels);
}

#if SHARDLM_HAVE_AVX2
// vpmovdw keeps each lane's low 16 bits, so 16 rounded elements become the 8
// words of their pairs in memory order (element 2i low, 2i + 1 high).
SHARDLM_AVX512 inline void round_row_block_avx512(int32_t* words, float& scale, const float* v) {
  __m512 x[4];
  __m512 amax = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm512_loadu_ps(v + 16 * j);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x[j]));
  }
  const float top = _mm512_reduce_max_ps(amax);
  const __m512 inverse = _mm512_set1_ps(inverse_of(top, kInputLevels));
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x[j], inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8 * j), _mm512_cvtepi32_epi16(q));
  }
  scale = step_of(top, kInputLevels);
}

// round_rows, every block of every row in one AVX-512 function (no call and
// no vzeroupper a block).
SHARDLM_AVX512 void round_rows_avx512(int32_t* words, float* scales, const float* x, int64_t rows,
                                      int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      round_row_block_avx512(words + r * (k / 2) + b * kPairs, scales[b * rows + r],
                             x + r * k + b * kBlock);
    }
  }
}

// Eight lanes' rounded elements 2i (even) and 2i + 1 (odd) as their words.
SHARDLM_AVX2 inline __m256i pair_words_avx2(__m256i even, __m256i odd) {
  return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xffff)),
                         _mm256_slli_epi32(odd, 16));
}

// Eight lanes of a panel (`lanes` apart) over all k rows.
SHARDLM_AVX2 void round_panel_lanes_avx2(int32_t* words, float* scales, const float* panel,
                                         int64_t lanes, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(panel + i * lanes)));
  }
  const __m256 positive = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
  const __m256 levels = _mm256_set1_ps(static_cast<float>(kWeightLevels));
  const __m256 inverse = _mm256_and_ps(positive, _mm256_div_ps(levels, amax));
  for (int64_t i = 0; i < k / 2; ++i) {
    const __m256 even_rows = _mm256_loadu_ps(panel + 2 * i * lanes);
    const __m256 odd_rows = _mm256_loadu_ps(panel + (2 * i + 1) * lanes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + i * lanes),
                        pair_words_avx2(_mm256_cvtps_epi32(_mm256_mul_ps(even_rows, inverse)),
                                        _mm256_cvtps_epi32(_mm256_mul_ps(odd_rows, inverse))));
  }
  _mm256_storeu_ps(scales, _mm256_div_ps(amax, levels));
}
#endif

#if SHARDLM_HAVE_AVX2
// The largest of 32 quant bytes' magnitudes (|-128| read as 128).
SHARDLM_AVX2 inline int largest_quant(const uint8_t* q) {
  const __m256i a = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  __m128i m = _mm_max_epu8(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 2));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 1));
  return _mm_cvtsi128_si32(m) & 0xff;
}
#endif

void round_panel_lanes_scalar(int32_t* words, float* scales, const float* panel, int64_t lanes,
                              int64_t k, int64_t width) {
  for (int64_t l = 0; l < width; ++l) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(panel[i * lanes + l]));
    const float inverse = inverse_of(amax, kWeightLevels);
    for (int64_t i = 0; i < k / 2; ++i) {
      words[i * lanes + l] =
          word_of(static_cast<int32_t>(std::nearbyint(panel[2 * i * lanes + l] * inverse)),
                  static_cast<int32_t>(std::nearbyint(panel[(2 * i + 1) * lanes + l] * inverse)));
    }
    scales[l] = step_of(amax, kWeightLevels);
  }
}

// ---- the register tiles --------------------------------------------------------------
// Each takes R tile rows (row r's words at xw + r * k / 2, its scales
// `stride` apart) against lanes
// of a panel (`lanes` apart) and writes acc[r * lanes + l].

// The portable loop takes every row of the tile and every lane of the panel.
void tile_scalar(float* acc, const int32_t* pw, const float* ps, int64_t lanes,
                 const int32_t* xw, const float* xs, int64_t rows, int64_t k) {
  const int64_t stride = rows;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < lanes; ++l) {
      float total = 0.f;
      for (int64_t b = 0; b < k / kBlock; ++b) {
        int32_t dot = 0;
        for (int64_t i = b * kPairs; i < (b + 1) * kPairs; ++i) {
          const int32_t w = pw[i * lanes + l];
          const int32_t x = xw[r * (k / 2) + i];
          dot += low_of(w) * low_of(x) + high_of(w) * high_of(x);
        }
        total += static_cast<float>(dot) * xs[b * stride + r];
      }
      acc[r * lanes + l] = total * ps[l];
    }
  }
}

#if SHARDLM_HAVE_AVX2
// Eight lanes: vpmaddwd's pair sums (at most 2 * 8191 * 4095, no saturation) added up.
template <int R>
SHARDLM_AVX2 void tile_avx2(float* acc, const int32_t* pw, const float* ps, int64_t lanes,
                            const int32_t* xw, const float* xs, int64_t stride, int64_t k) {
  __m256 c[R];
  for (int r = 0; r < R; ++r) c[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256i d[R];
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    for (int64_t i = b * kPairs; i < (b + 1) * kPairs; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + i * lanes));
      for (int r = 0; r < R; ++r) {
        d[r] = _mm256_add_epi32(d[r],
                                _mm256_madd_epi16(w, _mm256_set1_epi32(xw[r * (k / 2) + i])));
      }
    }
    for (int r = 0; r < R; ++r) {
      c[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_set1_ps(xs[b * stride + r]), c[r]);
    }
  }
  const __m256 s = _mm256_loadu_ps(ps);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * lanes, _mm256_mul_ps(c[r], s));
}

// acc += the pair sums of w and x, in place. Written as the instruction: GCC
// 12 copies the accumulators of _mm512_dpwssd_epi32 around every use in the
// tile below (18 register moves for its 12 dot products a step).
SHARDLM_AVX512_VNNI inline void dot_pairs(__m512i& acc, __m512i w, __m512i x) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

// V vectors of 16 lanes: R x V integer sums for a block and as many float
// totals, 24 + 24 of the 32 registers at R = 6, V = 2 with the V weight
// vectors and a broadcast; each broadcast input pair feeds V vpdpwssd.
template <int R, int V>
SHARDLM_AVX512_VNNI void tile_vnni(float* acc, const int32_t* pw, const float* ps, int64_t lanes,
                                   const int32_t* xw, const float* xs, int64_t stride, int64_t k) {
  // Fully unrolled, so the sums and totals live in registers, not on the stack.
  __m512 c[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) c[r][v] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m512i d[R][V];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) d[r][v] = _mm512_setzero_si512();
    }
    const int32_t* wp = pw + b * kPairs * lanes;
    const int32_t* xp = xw + b * kPairs;
    const int64_t half = k / 2;
    for (int64_t i = 0; i < kPairs; ++i) {
      __m512i w[V];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(wp + i * lanes + 16 * v);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(xp[r * half + i]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) dot_pairs(d[r][v], w[v], x);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(xs[b * stride + r]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        c[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][v]), sx, c[r][v]);
      }
    }
  }
  __m512 s[V];
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) s[v] = _mm512_loadu_ps(ps + 16 * v);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      _mm512_storeu_ps(acc + r * lanes + 16 * v, _mm512_mul_ps(c[r][v], s[v]));
    }
  }
}

using TileFn = void (*)(float*, const int32_t*, const float*, int64_t, const int32_t*, const float*,
                        int64_t, int64_t);

// Rows per call of each kernel, and the kernels by row count.
constexpr int64_t kAvx2Rows = 6;
constexpr int64_t kWideRows = 6;    // tile_vnni<R, 2>
constexpr int64_t kNarrowRows = 12;  // tile_vnni<R, 1>

constexpr TileFn kAvx2Tiles[kAvx2Rows] = {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                          tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};
constexpr TileFn kWideTiles[kWideRows] = {tile_vnni<1, 2>, tile_vnni<2, 2>, tile_vnni<3, 2>,
                                          tile_vnni<4, 2>, tile_vnni<5, 2>, tile_vnni<6, 2>};
constexpr TileFn kNarrowTiles[kNarrowRows] = {
    tile_vnni<1, 1>, tile_vnni<2, 1>,  tile_vnni<3, 1>,  tile_vnni<4, 1>,
    tile_vnni<5, 1>, tile_vnni<6, 1>,  tile_vnni<7, 1>,  tile_vnni<8, 1>,
    tile_vnni<9, 1>, tile_vnni<10, 1>, tile_vnni<11, 1>, tile_vnni<12, 1>};

// Runs `tiles` (kernels of 1..per rows) over `rows` rows in near-equal calls.
void over_rows(const TileFn* tiles, int64_t per, float* acc, const int32_t* pw, const float* ps,
               int64_t lanes, const int32_t* xw, const float* xs, int64_t rows, int64_t k) {
  const int64_t calls = (rows + per - 1) / per;
  for (int64_t c = 0, r0 = 0; c < calls; ++c) {
    const int64_t n = (rows - r0) / (calls - c);
    tiles[n - 1](acc + r0 * lanes, pw, ps, lanes, xw + r0 * (k / 2), xs + r0, rows, k);
    r0 += n;
  }
}
#endif

}  // namespace

void round_rows(int32_t* words, float* scales, const float* x, int64_t rows, int64_t k) {
#if SHARDLM_HAVE_AVX2
  if (cpu::use_avx512()) return round_rows_avx512(words, scales, x, rows, k);
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      round_row_block_scalar(words + r * (k / 2) + b * kPairs, scales[b * rows + r],
                             x + r * k + b * kBlock);
    }
  }
}

void round_panel(int32_t* words, float* scales, const float* panel, int64_t lanes, int64_t k) {
#if SHARDLM_HAVE_AVX2
  const bool avx2 = cpu::use_avx2();
#endif
  for (int64_t l = 0; l < lanes; l += 8) {
#if SHARDLM_HAVE_AVX2
    if (avx2) {
      round_panel_lanes_avx2(words + l, scales + l, panel + l, lanes, k);
      continue;
    }
#endif
    round_panel_lanes_scalar(words + l, scales + l, panel + l, lanes, k, 8);
  }
}

#if SHARDLM_HAVE_AVX2
SHARDLM_AVX2 void round_q8_0_rows(int32_t* words, float* scales, const uint8_t* rows,
                                  int64_t row_bytes, int64_t k, int64_t lanes) {
  const int64_t blocks = k / quant::kBlock;
  const int64_t bytes = quant::block_bytes(quant::kQ8_0);
  alignas(32) float largest[8];
  for (int r = 0; r < 8; ++r) {
    float m = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = rows + r * row_bytes + b * bytes;
      m = std::max(m, std::fabs(quant::half_at(p)) * static_cast<float>(largest_quant(p + 2)));
    }
    largest[r] = m;
  }
  const __m256 amax = _mm256_load_ps(largest);
  const __m256 positive = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
  const __m256 levels = _mm256_set1_ps(static_cast<float>(kWeightLevels));
  const __m256 inverse = _mm256_and_ps(positive, _mm256_div_ps(levels, amax));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = rows + b * bytes;
    const __m256 d = quant::q8_0_scales8(p, row_bytes);
    for (int s = 0; s < 4; ++s) {
      __m256 v[8];
      quant::q8_0_columns8(v, p, row_bytes, s, d);  // v[j]: d q of element 8 s + j
      int32_t* o = words + (b * quant::kBlock + 8 * s) / 2 * lanes;
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j / 2 * lanes),
                            pair_words_avx2(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse)),
                                            _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inverse))));
      }
    }
  }
  _mm256_storeu_ps(scales, _mm256_div_ps(amax, levels));
}
#endif

void multiply(float* acc, const int32_t* panel_words, const float* panel_scales, int64_t lanes,
              const int32_t* tile_words, const float* tile_scales, int64_t rows, int64_t k) {
#if SHARDLM_HAVE_AVX2
  if (cpu::use_avx512_vnni() && lanes % 16 == 0) {
    for (int64_t l = 0; l < lanes;) {
      const bool wide = lanes - l >= 32;
      over_rows(wide ? kWideTiles : kNarrowTiles, wide ? kWideRows : kNarrowRows, acc + l,
                panel_words + l, panel_scales + l, lanes, tile_words, tile_scales, rows, k);
      l += wide ? 32 : 16;
    }
    return;
  }
  if (cpu::use_avx2()) {
    for (int64_t l = 0; l < lanes; l += 8) {
      over_rows(kAvx2Tiles, kAvx2Rows, acc + l, panel_words + l, panel_scales + l, lanes,
                tile_words, tile_scales, rows, k);
    }
    return;
  }
#endif
  tile_scalar(acc, panel_words, panel_scales, lanes, tile_words, tile_scales, rows, k);
}

}  // namespace shardlm::cpu::panel16
