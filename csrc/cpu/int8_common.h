// What the int8-activation kernels (int8_linear.h) share: the input word
// against which 4 quant bytes a lane are multiplied, AVX2's 4-byte dot
// products, the table layouts' values as int8 (Int8Table) and the portable
// kernels' loop.
#pragma once

#include <cstdint>
#include <cstring>

#include "grouped.h"
#include "int8_linear.h"
#include "quant_blocks.h"
#include "simd.h"

namespace shardlm::cpu::int8 {

// The 4 input bytes at p as one word, to broadcast against 4 quant bytes a lane.
inline int32_t input_word(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

#if SHARDLM_HAVE_AVX2
// acc + 4-byte dot products of unsigned quants and signed inputs, AVX2
// (vpmaddubsw: pairs into int16, at most 2 * 63 * 128, no saturation).
SHARDLM_AVX2 inline __m256i dot4_avx2(__m256i acc, __m256i quants, int32_t inputs) {
  const __m256i pairs = _mm256_maddubs_epi16(quants, _mm256_set1_epi32(inputs));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
// The same with signed quants (|q| and q's signs apart; int8_linear.cpp's
// table layouts): |q| times the input with q's sign (psignb).
SHARDLM_AVX2 inline __m256i signed_dot4_avx2(__m256i acc, __m256i magnitudes, __m256i signs,
                                             int32_t inputs) {
  const __m256i pairs =
      _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(_mm256_set1_epi32(inputs), signs));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
// sum + d * dx * (dot[0] + dot[1]): a block's integer sum (its two chains)
// scaled once, as every AVX2 kernel ends a block.
SHARDLM_AVX2 inline __m256 scaled_block_avx2(__m256 sum, __m256 d, float dx,
                                             const __m256i (&dot)[2]) {
  return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)),
                         _mm256_cvtepi32_ps(_mm256_add_epi32(dot[0], dot[1])), sum);
}

// One step's two vectors of quant bytes (a table's signed values: kTable)
// against the input's 8 bytes at xq, into two chains (dot[0] the first
// vector's, dot[1] the second's: half the latency of one chain, which one row
// a pass waits on), which the AVX2 kernels add at the end of a block.
template <bool kTable>
SHARDLM_AVX2 inline void step_dot_avx2(__m256i (&dot)[2], __m256i first, __m256i second,
                                       const int8_t* xq) {
  if constexpr (kTable) {
    dot[0] = signed_dot4_avx2(dot[0], _mm256_abs_epi8(first), first, input_word(xq));
    dot[1] = signed_dot4_avx2(dot[1], _mm256_abs_epi8(second), second, input_word(xq + 4));
  } else {
    dot[0] = dot4_avx2(dot[0], first, input_word(xq));
    dot[1] = dot4_avx2(dot[1], second, input_word(xq + 4));
  }
}
#endif

// A table layout's values (value_tables.h) as the int8 its kernels multiply:
// each value times kFactor, the smallest power of two (up to 8) that makes
// every one an integer (IQ3_XXS's 15.5: 2; the IQ2 grid's 3.125: 8), with the
// block's scale divided by it (exact). VNNI multiplies unsigned bytes, so it
// takes value + 128 (`biased`) and takes 128 * sum(xq) back off through the
// offset term; AVX2's pairs into int16 would saturate on those, so it
// multiplies |value| by the input with the value's sign.
template <const float* kV>
struct Int8Table {
  static constexpr bool integral(float factor) {
    for (int i = 0; i < 16; ++i) {
      const float v = kV[i] * factor;
      if (v != static_cast<float>(static_cast<int>(v)) || v < -127.f || v > 127.f) return false;
    }
    return true;
  }
  static constexpr float kFactor = integral(1.f)   ? 1.f
                                   : integral(2.f) ? 2.f
                                   : integral(4.f) ? 4.f
                                                   : 8.f;
  static_assert(integral(kFactor), "a table whose values are not int8 times a power of two");
  struct Bytes {
    int8_t values[16];
    uint8_t biased[16];  // value + 128
  };
  static constexpr Bytes make() {
    Bytes t{};
    for (int i = 0; i < 16; ++i) {
      t.values[i] = static_cast<int8_t>(kV[i] * kFactor);
      t.biased[i] = static_cast<uint8_t>(t.values[i] + 128);
    }
    return t;
  }
  static constexpr Bytes kBytes = make();
};

// A table layout's Int8Table (void for the others), and the factor its
// quants' values are multiplied by (1 without a table).
template <class L, bool = L::kTable>
struct TableOf {
  using type = void;
};
template <class L>
struct TableOf<L, true> {
  using type = Int8Table<L::kValues>;
};

template <class L>
constexpr float kValueFactor = [] {
  if constexpr (L::kTable) return TableOf<L>::type::kFactor;
  return 1.f;
}();

// The portable kernels' loops: acc[i * stride + r] = the sum over the blocks b
// of term(i_b, b, r, xq) for input rows m0 + i (i < rows) and the group's rows
// r, where i_b indexes the input row's block b in Int8Rows' per-block arrays
// and xq points at its bytes.
template <class Term>
void portable_rows(float* acc, int64_t stride, const Int8Rows& x, int64_t m0, int64_t rows,
                   int64_t blocks, const Term& term) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = (m0 + i) * blocks;
    for (int64_t r = 0; r < grouped::kGroupRows; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        total += term(row + b, b, r, x.q + (row + b) * quant::kBlock);
      }
      acc[i * stride + r] = total;
    }
  }
}

}  // namespace shardlm::cpu::int8
