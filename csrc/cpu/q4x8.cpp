// Q4x8 (quant_blocks.h): 8 weight rows side by side, so a vector lane is one
// output feature and the block scales need no horizontal sums.
//
// The AVX2 kernel reads 8 quants of 8 rows from one 32-byte load (uint32 lane
// r holds row r's quants 8s .. 8s+7, quant j in bits 4j .. 4j+3) and turns
// quant j into a float by masking it in place, without shifting it down: lane
// value q * 2^4j, exact in float32 (4 significant bits). The input is
// pre-scaled to match, element 8s + j by 2^-4j (a power of two: exact, short
// of inputs below 2^-100 going subnormal), so every product is still q * x,
// for one mask, one conversion and one FMA per 8 weights. The top quant
// (j = 7) is shifted down instead: masked in place it would read as negative.
// Where the CPU takes subnormal FMA inputs at full speed, the kernels skip
// the conversion: a quant masked in place is read as the subnormal float
// it already is, against inputs pre-scaled to match (subnormal.h), for the
// same sums bit for bit with one mask and one FMA per 8 weights.
//
// Q4Kx8, Q5x8 and Q5Kx8 (Q4_K, Q5_0 and Q5_K regrouped, quant_blocks.h) have
// the same quant words per block of 32 weights, the 5-bit ones with a word of
// high bits beside them that joins each quant before it is masked in place
// (nibble_layouts.h); only where a block's scale and offset come from differs,
// so every kernel here is a template over the layout and the arithmetic after
// the scales is the same. IQ4x8 and IQ4NLx8 (IQ4_XS, IQ4_NL) have Q4x8's words too, each nibble an
// index into a table of 16 values (nibble_layouts.h): its kernels look the
// values up (one 16-entry permute with AVX-512) and read the input as given,
// not pre-scaled. The grid i-quants IQ3_XXS and IQ3_S have IQ4x8's bytes,
// each with its own table.
#include "q4x8.h"

#include <algorithm>
#include <vector>

#include "cpu_utils.h"
#include "grouped.h"
#include "nibble_layouts.h"
#include "quant_blocks.h"
#include "simd.h"

namespace shardlm::cpu::q4x8 {
namespace {

using grouped::kMaxRows;
using grouped::kNibbleScale;
#if SHARDLM_HAVE_AVX2
using grouped::load_pair;
#endif
using quant::half_at;
using quant::kBlock;
using quant::kGroupRows;
using quant::kSuperBlocks;
using namespace nibble;

// Input rows one pass of the AVX-512 pair kernel takes (pair_avx512).
constexpr int64_t kPairRows = 8;

template <class L>
void group_scalar(float* acc, const uint8_t* w, const float* x, const float* xs, int64_t k) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < kGroupRows; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      float part = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) part += quant_of<L>(w, b, r, i) * xb[i];
      acc[r] += L::d(w, b, r) * part + L::m(w, b, r) * xs[b];
    }
  }
}

#if SHARDLM_HAVE_AVX2
// R input rows against one group: each unpacked vector of quants feeds R FMAs,
// so the unpacking is paid once per R rows (decode batches). Two chains per
// row (even and odd quants), one row as many, so a row's result does not
// depend on the rows beside it (until 2026-12-03 one row took a kernel of its
// own, with four chains and two sums of alternate blocks; on the Intel VM
// capped at AVX2, SmolLM2's matrices ran as fast either way).
template <class L, int R, bool kSub>
SHARDLM_AVX2 void rows_avx2(float* acc, const uint8_t* w, const float* xp, int64_t x_stride,
                            const float* xs, int64_t xs_stride, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block<L>(w, b);
    const uint8_t* qw = L::quants(w, b);
    const __m256i h = highs_avx2<L>(w, b);
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int s = 0; s < 4; ++s) {
      const Words256 words = words_avx2<L>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + 32 * s)), h, s);
      const float* x8 = xp + b * kBlock + 8 * s;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 q = quant_float_avx2<L, kSub>(words, j);
        for (int r = 0; r < R; ++r) {
          __m256& c = j % 2 == 0 ? even[r] : odd[r];
          c = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x8 + r * x_stride + j), c);
        }
      }
    }
    __m256 d, m;
    scales_avx2<L>(w, b, d, m);
    if constexpr (kSub) d = _mm256_mul_ps(d, _mm256_set1_ps(kSubnormalBlockScale));
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm256_fmadd_ps(d, _mm256_add_ps(even[r], odd[r]),
                               _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * xs_stride + b]), sum[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + kGroupRows * r, sum[r]);
}

// Quant j, masked in place (q * 2^4j), times d * 2^-4j is q * d exactly (d is a
// float16, or for the K-quants a float16 times a 6-bit integer, far from
// float32's subnormals), so one FMA gives d * q + m rounded once, as the
// reference's float32 d * q + m (q * d needs at most 5 + 17 bits: exact).
template <class L>
SHARDLM_AVX2 void unpack_panel_avx2(float* panel, const uint8_t* w, int64_t k, int64_t stride) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 d, m;
    scales_avx2<L>(w, b, d, m);
    const uint8_t* qw = L::quants(w, b);
    const __m256i h = highs_avx2<L>(w, b);
    __m256 scale[8];
    for (int j = 0; j < 8; ++j) {
      scale[j] = L::kTable ? d : _mm256_mul_ps(d, _mm256_set1_ps(kNibbleScale[j]));
    }
    float* o = panel + b * kBlock * stride;
    for (int s = 0; s < 4; ++s) {
      const Words256 words = words_avx2<L>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + 32 * s)), h, s);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 q = quant_float_avx2<L, false>(words, j);
        _mm256_storeu_ps(o + (8 * s + j) * stride, _mm256_fmadd_ps(q, scale[j], m));
      }
    }
  }
}

// ---- AVX-512F: two neighbouring groups side by side, one of 16 features a lane ------

// rows_avx2 for the groups at w and w + next at once: acc[16 i + l] for input
// row i and lane l (g's 8 rows, then g + 1's). The quants are masked in place
// against the pre-scaled input as in the AVX2 kernels, each unpacked vector
// feeding R FMAs. Two chains per row, whatever the number of rows, so a row's
// result does not depend on the rows beside it (a speculative step's rows get
// the bits a decode step gives them): at one row the next block's chains,
// independent of these, fill the FMA units as well as four chains a row did
// (which rows past 2 could not hold in registers, so 1-2 rows and 3-8 rows
// summed in different orders until 2026-12-03; SmolLM2 decodes at 241 tok/s
// either way, 4 alternated rounds on the Intel Xeon VM). Up to kPairRows rows take one pass, so rows
// past 4 do not unpack the weights a second time (SmolLM2's and a 1B model's
// matrices, 2 threads: 5 rows 8-12% faster than a pass of 4 and one of 1, 6
// rows 1-4%, 8 rows 1-2%). A super-block's own factors are loaded with its
// first block, once for 8.
template <class L, int R, bool kSub>
SHARDLM_AVX512 void pair_avx512(float* acc, const uint8_t* w, int64_t next, const float* xp,
                                int64_t x_stride, const float* xs, int64_t xs_stride, int64_t k) {
  constexpr int kChains = 2;
  const int64_t blocks = k / kBlock;
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  SuperHalves512 super{_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    if (L::kSuper && b % kSuperBlocks == 0) super = super_halves_pair<L>(w, next, b);
    prefetch_block<L>(w, b, next);
    const uint8_t* qw = L::quants(w, b);
    const __m512i h = L::kFive ? load_pair(L::highs(w, b), next) : _mm512_setzero_si512();
    __m512 c[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kChains; ++i) c[r][i] = _mm512_setzero_ps();
    }
    for (int s = 0; s < 4; ++s) {
      const Words512 words = words_avx512<L>(load_pair(qw + 32 * s, next), h, s);
      const float* x8 = xp + b * kBlock + 8 * s;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512 q = quant_float_avx512<L, kSub>(words, j);
        for (int r = 0; r < R; ++r) {
          __m512& chain = c[r][(8 * s + j) % kChains];
          chain = _mm512_fmadd_ps(q, _mm512_set1_ps(x8[r * x_stride + j]), chain);
        }
      }
    }
    __m512 d, m;
    scales_pair<L>(w, next, b, super, d, m);
    if constexpr (kSub) d = _mm512_mul_ps(d, _mm512_set1_ps(kSubnormalBlockScale));
    for (int r = 0; r < R; ++r) {
      for (int width = kChains / 2; width > 0; width /= 2) {
        for (int i = 0; i < width; ++i) c[r][i] = _mm512_add_ps(c[r][i], c[r][i + width]);
      }
      sum[r] = _mm512_fmadd_ps(d, c[r][0],
                               _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * xs_stride + b]), sum[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 2 * kGroupRows * r, sum[r]);
}

template <class L, bool kSub>
void pair_dot(float* acc, const uint8_t* w, int64_t next, const float* xp, int64_t x_stride,
              const float* xs, int64_t xs_stride, int64_t rows, int64_t k) {
  switch (rows) {
    case 1: return pair_avx512<L, 1, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 2: return pair_avx512<L, 2, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 3: return pair_avx512<L, 3, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 4: return pair_avx512<L, 4, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 5: return pair_avx512<L, 5, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 6: return pair_avx512<L, 6, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    case 7: return pair_avx512<L, 7, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
    default: return pair_avx512<L, 8, kSub>(acc, w, next, xp, x_stride, xs, xs_stride, k);
  }
}
#endif

template <class L, bool kSub>
void rows_dot(float* acc, const uint8_t* w, const float* xp, int64_t x_stride, const float* xs,
              int64_t xs_stride, int64_t rows, int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) {
    switch (rows) {
      case 1: return rows_avx2<L, 1, kSub>(acc, w, xp, x_stride, xs, xs_stride, k);
      case 2: return rows_avx2<L, 2, kSub>(acc, w, xp, x_stride, xs, xs_stride, k);
      case 3: return rows_avx2<L, 3, kSub>(acc, w, xp, x_stride, xs, xs_stride, k);
      default: return rows_avx2<L, 4, kSub>(acc, w, xp, x_stride, xs, xs_stride, k);
    }
  }
#endif
  (void)avx2;
  for (int64_t r = 0; r < rows; ++r) {
    group_scalar<L>(acc + kGroupRows * r, w, xp + r * x_stride, xs + r * xs_stride, k);
  }
}

template <class L>
void unpack_panel_of(float* panel, const uint8_t* w, int64_t k, int64_t stride, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) return unpack_panel_avx2<L>(panel, w, k, stride);
#endif
  (void)avx2;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const float d = L::d(w, b, r), m = L::m(w, b, r);
      for (int64_t i = 0; i < kBlock; ++i) {
        panel[(b * kBlock + i) * stride + r] = d * quant_of<L>(w, b, r, i) + m;
      }
    }
  }
}

template <class L, bool kSub, typename T>
void gemv_with(T* out, const uint8_t* w, const float* xp, const float* xs, const T* bias,
               int64_t m, int64_t n, int64_t k, bool avx2) {
  const int64_t group_bytes = L::group_bytes(k);
  const int64_t blocks = k / kBlock;
  grouped::gemv<kPairRows>(out, bias, m, n, group_bytes,
                           [&](float* acc, int64_t g, int64_t width, int64_t m0, int64_t rows) {
#if SHARDLM_HAVE_AVX2
    if (width == 2 * kGroupRows) {
      return pair_dot<L, kSub>(acc, w + g * group_bytes, group_bytes, xp + m0 * k, k,
                               xs + m0 * blocks, blocks, rows, k);
    }
#endif
    // One group at a time (AVX2, portable, an odd last group): kMaxRows rows a pass.
    for (int64_t i = 0; i < rows; i += kMaxRows) {
      rows_dot<L, kSub>(acc + i * width, w + g * group_bytes, xp + (m0 + i) * k, k,
                        xs + (m0 + i) * blocks, blocks, std::min(kMaxRows, rows - i), k, avx2);
    }
  }, kSub);
}

// The kernels read their quants as subnormals where that is faster
// (subnormal.h) and the inputs allow it, and convert them elsewhere.
template <class L, typename T>
void gemv_of(T* out, const uint8_t* w, const float* x, const float* xs, const T* bias, int64_t m,
             int64_t n, int64_t k) {
  const bool avx2 = cpu::use_avx2();
#if SHARDLM_HAVE_AVX2
  if (!L::kTable && avx2 && cpu::use_subnormal_quants()) {
    if (const float* xp = grouped::prescaled_subnormal(x, m, k)) {
      return gemv_with<L, true>(out, w, xp, xs, bias, m, n, k, avx2);
    }
  }
#endif
  const float* xp = avx2 && !L::kTable ? grouped::prescaled(x, m * k) : x;
  gemv_with<L, false>(out, w, xp, xs, bias, m, n, k, avx2);
}

template <class L>
void dequantize_rows_of(float* dst, const uint8_t* w, int64_t n0, int64_t n1, int64_t k) {
  grouped::dequantize_rows(dst, w, n0, n1, k, L::group_bytes(k),
                           [k](float* panel, const uint8_t* group, bool avx2) {
                             unpack_panel_of<L>(panel, group, k, kGroupRows, avx2);
                           });
}

}  // namespace

// Calls f with the layout of `qtype` (a value of that layout's type).
template <class F>
decltype(auto) with_layout(int64_t qtype, const F& f) {
  switch (qtype) {
    case quant::kQ4Kx8: return f(Q4Kx8Layout{});
    case quant::kQ5x8: return f(Q5x8Layout{});
    case quant::kQ40x8: return f(Q40x8Layout{});
    case quant::kQ5Kx8: return f(Q5Kx8Layout{});
    case quant::kQ51x8: return f(Q51x8Layout{});
    case quant::kIQ4x8: return f(IQ4x8Layout{});
    case quant::kIQ3XXSx8: return f(IQ3XXSx8Layout{});
    case quant::kIQ3Sx8: return f(IQ3Sx8Layout{});
    case quant::kIQ4NLx8: return f(IQ4NLx8Layout{});
    default: return f(Q4x8Layout{});
  }
}

template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const float* x, const float* xs,
          const T* bias, int64_t m, int64_t n, int64_t k) {
  with_layout(qtype, [&](auto layout) {
    gemv_of<decltype(layout)>(out, w, x, xs, bias, m, n, k);
  });
}

template void gemv<float>(float*, int64_t, const uint8_t*, const float*, const float*,
                          const float*, int64_t, int64_t, int64_t);
template void gemv<c10::BFloat16>(c10::BFloat16*, int64_t, const uint8_t*, const float*,
                                  const float*, const c10::BFloat16*, int64_t, int64_t, int64_t);
template void gemv<c10::Half>(c10::Half*, int64_t, const uint8_t*, const float*, const float*,
                              const c10::Half*, int64_t, int64_t, int64_t);

void unpack_panel(float* panel, int64_t qtype, const uint8_t* w, int64_t k, int64_t stride,
                  bool avx2) {
  with_layout(qtype, [&](auto layout) {
    unpack_panel_of<decltype(layout)>(panel, w, k, stride, avx2);
  });
}

void dequantize_rows(float* dst, int64_t qtype, const uint8_t* w, int64_t n0, int64_t n1,
                     int64_t k) {
  with_layout(qtype, [&](auto layout) {
    dequantize_rows_of<decltype(layout)>(dst, w, n0, n1, k);
  });
}

}  // namespace shardlm::cpu::q4x8
