// Q6Kx8 (quant_blocks.h): GGML's Q6_K, 8 weight rows side by side. A 6-bit
// quant is its low nibble, in a Q4x8 block's words, plus two high bits in two
// words per block; each half of a 32-weight block has its own scale d * sc
// (float16 times int8: exact in float32, as GGML computes it).
//
// The dot product of a half is d * sc * (sum(q x) - 32 sum(x)). As in q4x8.cpp
// each quant is masked in place, q * 2^4j, against inputs pre-scaled by 2^-4j
// (exact): the high bits of nibble word s's quants sit in high word s / 2 at
// bits 4j + 2 (s % 2), so one shift puts them just above their nibbles and
// two selects join them (as the 5-bit layouts do, nibble_layouts.h): one
// mask, one conversion and one FMA per 8 or 16 weights. The top quant (j = 7)
// is shifted down instead (masked in place it would read as negative). Where
// the CPU takes subnormal FMA inputs at full speed, the quants in the low 22
// bits skip the conversion (subnormal.h): the same sums, bit for bit.
//
// Q3Kx8 and Q2Kx8 (GGML's Q3_K and Q2_K, q6k_layout.h) keep the same halves:
// every kernel here is a template over the layouts. Q2Kx8 keeps the file's 2
// bits a quant, 16 to a word, one word a half: for each vector of 8 quants it
// shifts the word down by 16 or not, and each quant is masked in place at bit
// 2j against inputs pre-scaled by 2^-2j; it has no offset but a minimum per
// half, dmin * mn times the half's input sum taken off its total. Q3Kx8 has
// Q6Kx8's header and offset 4, and Q2Kx8's words with a word of third bits a
// row, which one shift and two selects join to them (q6k_simd.h).
// The IQ2 and IQ1 grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) have
// Q3Kx8's bytes, each 3-bit quant an index into a table of values that the
// kernels look up (grouped::table3_avx2) against inputs that are not pre-scaled.
#include "q6kx8.h"

#include <cstring>
#include <vector>

#include "cpu_utils.h"
#include "grouped.h"
#include "q6k_layout.h"
#include "q6k_simd.h"
#include "quant_blocks.h"
#include "simd.h"
#include "subnormal.h"

namespace shardlm::cpu::q6kx8 {
namespace {

using quant::kGroupRows;
using namespace layout;

// acc[r] = dot(row r, x) for one input row; xs16 holds x's 16-element sums.
template <class P>
void group_scalar(float* acc, const uint8_t* w, const float* x, const float* xs16, int64_t k) {
  for (int64_t r = 0; r < kGroupRows; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      for (int64_t h = 0; h < 2; ++h) {
        float part = 0.f;
        for (int64_t i = kHalf * h; i < kHalf * (h + 1); ++i) {
          part += value_of<P>(w, b, r, i) * x[b * kBlock + i];  // the offset taken off each
        }
        total += scale_of<P>(w, b, h, r) * part;
        if constexpr (P::kMins) total -= min_of<P>(w, b, h, r) * xs16[2 * b + h];
      }
    }
    acc[r] = total;
  }
}

// The inputs as the kernels read them, in thread-local buffers valid until the
// next call on this thread: pre-scaled for the quants in place (SIMD paths
// only: for the subnormal kernels where `subnormal` is set, which prepare
// clears if the inputs do not allow them), and the 16-element sums, which
// only an offset or a minimum reads (`with_sums`; a table layout's are not
// made, their buffer left as it was).
struct Inputs {
  const float* x;
  const float* sums;
  bool subnormal;
};

template <class P>
Inputs prepare(const float* x, int64_t m, int64_t k, bool simd, bool subnormal, bool with_sums) {
  const int64_t count = m * k;
  thread_local std::vector<float> sums;
  sums.resize(count / kHalf);
  for (int64_t i = 0; with_sums && i < count / kHalf; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kHalf; ++j) s += x[kHalf * i + j];
    sums[i] = s;
  }
#if SHARDLM_HAVE_AVX2
  if (simd && subnormal) {
    const float* factors = P::kTwoBit ? kSubnormalTwoBitScale : kSubnormalNibbleScale;
    if (const float* scaled = grouped::prescaled_subnormal(x, m, k, factors)) {
      return {scaled, sums.data(), true};
    }
  }
#endif
  const float* factors = P::kTwoBit ? grouped::kTwoBitScale : grouped::kNibbleScale;
  return {simd ? grouped::prescaled(x, count, factors) : x, sums.data(), false};
}

// The sum of half h of block b's inputs, for the input row `row_start` elements on.
inline float input_sum(const Inputs& in, int64_t row_start, int64_t b, int64_t h) {
  return in.sums[(row_start + b * kBlock) / kHalf + h];
}

#if SHARDLM_HAVE_AVX2
// A half-block's sum less the offset (32; Q3Kx8: 4) times its inputs' sum,
// d * sc times it into the row's total; with kSub the sums are
// 2^-kSubnormalShift of the converted kernels', so the offset is too and the
// scale makes up for it (both exact: the same bits).
template <class P, bool kSub>
constexpr float kOffset = kSub ? P::kOffset / kSubnormalBlockScale : static_cast<float>(P::kOffset);

// R input rows (1 or 2) against one group: four chains per row, whatever the
// number of rows, so a row's result does not depend on the rows beside it (a
// speculative step's rows get a decode step's bits); a block's halves run one
// after the other, each half's chains added into the row's sum before the next
// starts, which keeps two rows' chains in AVX2's 16 registers (rows_dot takes
// more rows in passes of two). d (and dmin) are the super-block's, loaded with
// its first block (once for 8 blocks: 4-5% faster than loading them with
// every block).
template <class P, int R, bool kSub>
SHARDLM_AVX2 void rows_avx2(float* acc, const uint8_t* w, const Inputs& in, int64_t stride,
                            int64_t k) {
  static_assert(R <= 2, "8 chains a pass at most");
  constexpr int C = 4;
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  __m256 d = _mm256_setzero_ps(), dmin = d;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* sp = super_of<P>(w, b);
    if (b % kSuperBlocks == 0) super_factors8<P, kSub>(sp, d, dmin);
    const uint8_t* q = words_of<P>(w, b);
    grouped::prefetch_span(w, stream_begin<P>(w, b), q + P::kBlockBytes, 0);
    const HalfFactors256 f = half_factors8<P>(sp, b, d, dmin);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 c[R][C];
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < C; ++i) c[r][i] = _mm256_setzero_ps();
      }
#pragma GCC unroll 2
      for (int s = 2 * h; s < 2 * h + 2; ++s) {
        const grouped::Joined256 words = words_avx2<P>(q, s);
        const float* x8 = in.x + b * kBlock + 8 * s;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256 v = quant_avx2<P, kSub>(words, j);
          for (int r = 0; r < R; ++r) {
            c[r][j % C] =
                _mm256_fmadd_ps(v, _mm256_broadcast_ss(x8 + r * stride + j), c[r][j % C]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m256 part = c[r][0];
        for (int i = 1; i < C; ++i) part = _mm256_add_ps(part, c[r][i]);
        if constexpr (P::kMins) {  // the sums of the inputs unscaled: the minimums as they are
          sum[r] = _mm256_fnmadd_ps(f.mins[h], _mm256_set1_ps(input_sum(in, r * stride, b, h)),
                                    _mm256_fmadd_ps(f.scale[h], part, sum[r]));
        } else {
          if constexpr (P::kOffset != 0) {
            part = _mm256_fnmadd_ps(_mm256_set1_ps(kOffset<P, kSub>),
                                    _mm256_set1_ps(input_sum(in, r * stride, b, h)), part);
          }
          sum[r] = _mm256_fmadd_ps(f.scale[h], part, sum[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + kGroupRows * r, sum[r]);
}

// ---- AVX-512F: the groups at w and w + next side by side, 16 rows a vector ---------

// Four chains per row for every number of rows, so a row's result does not
// depend on the rows beside it (a speculative step's rows get a decode step's
// bits). A block's two halves run one after the other, each half's chains
// added into the row's sum before the next half starts: the sums in the same
// order as with both halves' chains held to the block's end, in half the
// registers (4 rows x 4 chains).
template <class P, int R, bool kSub>
SHARDLM_AVX512 void pair_avx512(float* acc, const uint8_t* w, int64_t next, const Inputs& in,
                                int64_t stride, int64_t k) {
  constexpr int C = 4;
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps(), dmin = d;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* sp = super_of<P>(w, b);
    if (b % kSuperBlocks == 0) super_factors_pair<P, kSub>(sp, next, d, dmin);
    const uint8_t* q = words_of<P>(w, b);
    grouped::prefetch_span(w, stream_begin<P>(w, b), q + P::kBlockBytes, next);
    const HalfFactors512 f = half_factors_pair<P>(sp, next, b, d, dmin);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512 c[R][C];
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < C; ++i) c[r][i] = _mm512_setzero_ps();
      }
#pragma GCC unroll 2
      for (int s = 2 * h; s < 2 * h + 2; ++s) {
        const grouped::Joined512 words = words_avx512<P>(q, s, next);
        const float* x8 = in.x + b * kBlock + 8 * s;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512 v = quant_avx512<P, kSub>(words, j);
          for (int r = 0; r < R; ++r) {
            c[r][j % C] = _mm512_fmadd_ps(v, _mm512_set1_ps(x8[r * stride + j]), c[r][j % C]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512 part = c[r][0];
        for (int i = 1; i < C; ++i) part = _mm512_add_ps(part, c[r][i]);
        if constexpr (P::kMins) {
          sum[r] = _mm512_fnmadd_ps(f.mins[h], _mm512_set1_ps(input_sum(in, r * stride, b, h)),
                                    _mm512_fmadd_ps(f.scale[h], part, sum[r]));
        } else {
          if constexpr (P::kOffset != 0) {
            part = _mm512_fnmadd_ps(_mm512_set1_ps(kOffset<P, kSub>),
                                    _mm512_set1_ps(input_sum(in, r * stride, b, h)), part);
          }
          sum[r] = _mm512_fmadd_ps(f.scale[h], part, sum[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 2 * kGroupRows * r, sum[r]);
}

// (d * sc) * (q - offset), one rounding, as the reference computes it; for
// Q2Kx8 (d * sc) * q - dmin * mn, the product exact, so one rounding too; for
// a table layout (d * sc) * value, one rounding.
template <class P>
SHARDLM_AVX2 void unpack_panel_avx2(float* panel, const uint8_t* w, int64_t k, int64_t stride) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* sp = super_of<P>(w, b);
    __m256 d, dmin = _mm256_setzero_ps();
    super_factors8<P, false>(sp, d, dmin);
    const HalfFactors256 f = half_factors8<P>(sp, b, d, dmin);
    const __m256* scale = f.scale;
    const __m256* mins = f.mins;
    const uint8_t* q = words_of<P>(w, b);
    for (int s = 0; s < 4; ++s) {
      __m256 values[8];
      quant_values<P>(q, s, values);
      float* o = panel + (b * kBlock + 8 * s) * stride;
      for (int j = 0; j < 8; ++j) {
        const __m256 f = values[j];
        _mm256_storeu_ps(o + j * stride, P::kMins ? _mm256_fmsub_ps(scale[s / 2], f, mins[s / 2])
                                                  : _mm256_mul_ps(scale[s / 2], f));
      }
    }
  }
}
#endif

// Input rows `m0` on, as rows_dot (its passes) and pair_dot read them.
Inputs rows_from(const Inputs& in, int64_t m0, int64_t k) {
  return {in.x + m0 * k, in.sums + m0 * k / kHalf, in.subnormal};
}

template <class P, bool kSub>
void rows_dot(float* acc, const uint8_t* w, const Inputs& in, int64_t stride, int64_t rows,
              int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) {
    for (int64_t r = 0; r < rows; r += 2) {  // passes of two rows (and one)
      const Inputs part = rows_from(in, r, stride);
      if (rows - r >= 2) {
        rows_avx2<P, 2, kSub>(acc + kGroupRows * r, w, part, stride, k);
      } else {
        rows_avx2<P, 1, kSub>(acc + kGroupRows * r, w, part, stride, k);
      }
    }
    return;
  }
#endif
  (void)avx2;
  for (int64_t r = 0; r < rows; ++r) {
    group_scalar<P>(acc + kGroupRows * r, w, in.x + r * stride,
                 in.sums + r * stride / kHalf, k);
  }
}

#if SHARDLM_HAVE_AVX2
template <class P, bool kSub>
void pair_dot(float* acc, const uint8_t* w, int64_t next, const Inputs& in, int64_t stride,
              int64_t rows, int64_t k) {
  switch (rows) {
    case 1: return pair_avx512<P, 1, kSub>(acc, w, next, in, stride, k);
    case 2: return pair_avx512<P, 2, kSub>(acc, w, next, in, stride, k);
    case 3: return pair_avx512<P, 3, kSub>(acc, w, next, in, stride, k);
    default: return pair_avx512<P, 4, kSub>(acc, w, next, in, stride, k);
  }
}
#endif

template <class P, bool kSub, typename T>
void gemv_with(T* out, const uint8_t* w, const Inputs& in, const T* bias, int64_t m, int64_t n,
               int64_t k, bool avx2) {
  const int64_t group_bytes = k / (kBlock * kSuperBlocks) * P::kSuperBytes;
  grouped::gemv(out, bias, m, n, group_bytes,
                [&](float* acc, int64_t g, int64_t width, int64_t m0, int64_t rows) {
#if SHARDLM_HAVE_AVX2
    if (width == 2 * kGroupRows) {
      return pair_dot<P, kSub>(acc, w + g * group_bytes, group_bytes, rows_from(in, m0, k), k, rows,
                            k);
    }
#endif
    rows_dot<P, kSub>(acc, w + g * group_bytes, rows_from(in, m0, k), k, rows, k, avx2);
  }, kSub);
}

// Calls f with the layout of `qtype` (kQ6Kx8, kQ3Kx8, kQ2Kx8 or a per-16 table
// layout), a value of that layout's type.
template <class F>
decltype(auto) with_layout(int64_t qtype, const F& f) {
  switch (qtype) {
    case quant::kQ3Kx8: return f(Q3K{});
    case quant::kQ2Kx8: return f(Q2K{});
    case quant::kIQ2XXSx8:
    case quant::kIQ2XSx8:
    case quant::kIQ2Sx8: return f(IQ2Halves{});
    case quant::kIQ1Sx8:
    case quant::kIQ1Mx8: return f(IQ1Halves{});
    default: return f(Q6K{});
  }
}

template <class P, typename T>
void gemv_of(T* out, const uint8_t* w, const float* x, const T* bias, int64_t m, int64_t n,
             int64_t k) {
  const bool avx2 = cpu::use_avx2();
  if constexpr (P::kTable) {  // values looked up: the inputs as they are
    return gemv_with<P, false>(out, w, prepare<P>(x, m, k, false, false, false), bias, m, n, k,
                               avx2);
  } else {
    const Inputs in = prepare<P>(x, m, k, avx2, avx2 && cpu::use_subnormal_quants(), true);
    if (in.subnormal) return gemv_with<P, true>(out, w, in, bias, m, n, k, avx2);
    gemv_with<P, false>(out, w, in, bias, m, n, k, avx2);
  }
}

template <class P>
void unpack_panel_of(float* panel, const uint8_t* w, int64_t k, int64_t stride, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) return unpack_panel_avx2<P>(panel, w, k, stride);
#endif
  (void)avx2;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int64_t r = 0; r < kGroupRows; ++r) {
      for (int64_t i = 0; i < kBlock; ++i) {
        const float scaled = scale_of<P>(w, b, i / kHalf, r) * value_of<P>(w, b, r, i);
        panel[(b * kBlock + i) * stride + r] =
            P::kMins ? scaled - min_of<P>(w, b, i / kHalf, r) : scaled;
      }
    }
  }
}

}  // namespace

template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias, int64_t m,
          int64_t n, int64_t k) {
  with_layout(qtype, [&](auto layout) { gemv_of<decltype(layout)>(out, w, x, bias, m, n, k); });
}

template void gemv<float>(float*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                          int64_t, int64_t);
template void gemv<c10::BFloat16>(c10::BFloat16*, int64_t, const uint8_t*, const float*,
                                  const c10::BFloat16*, int64_t, int64_t, int64_t);
template void gemv<c10::Half>(c10::Half*, int64_t, const uint8_t*, const float*, const c10::Half*,
                              int64_t, int64_t, int64_t);

void unpack_panel(float* panel, int64_t qtype, const uint8_t* w, int64_t k, int64_t stride,
                  bool avx2) {
  with_layout(qtype, [&](auto layout) {
    unpack_panel_of<decltype(layout)>(panel, w, k, stride, avx2);
  });
}

void dequantize_rows(float* dst, int64_t qtype, const uint8_t* w, int64_t n0, int64_t n1,
                     int64_t k) {
  with_layout(qtype, [&](auto layout) {
    using P = decltype(layout);
    grouped::dequantize_rows(dst, w, n0, n1, k, k / (kBlock * kSuperBlocks) * P::kSuperBytes,
                             [k](float* panel, const uint8_t* group, bool avx2) {
                               unpack_panel_of<P>(panel, group, k, kGroupRows, avx2);
                             });
  });
}

}  // namespace shardlm::cpu::q6kx8
