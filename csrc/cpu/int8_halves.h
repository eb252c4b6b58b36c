// int8-activation kernels (int8_linear.h) for the layouts with a scale per half
// block (q6k_layout.h): Q6Kx8 (6-bit quants), Q3Kx8 (3-bit), Q2Kx8 (2-bit,
// with a minimum per half) and the IQ2 / IQ1 grids' (Q3Kx8's bytes, each 3-bit
// quant an index into a table: int8_common.h's Int8Table, the table layouts' int8
// values, which int8_nibbles.h's IQ4 and IQ3 kernels read too). A block of 8
// rows unpacks into 8 vectors of quant bytes, step k holding 4 quants a lane
// that meet the input's word k (bytes 4k .. 4k + 3 of the block in Int8Rows'
// order for the layout: InputOrder), so steps 0-3 cover half 0 and steps 4-7
// half 1; the kernel sums each half's integer dot products apart and scales
// them once:
//   scale_h * dx * sum(q xq) - offset_h * dx * sum_h(xq),
// with scale_h = d * sc_h, and offset_h = kOffset * scale_h (Q6K: 32, Q3K: 4),
// Q2K's dmin * mn_h, or for a grid's biased values on VNNI 128 * scale_h. The
// AVX2 kernels instead multiply each pair of products by sc_h in vpmaddwd,
// so a block's halves make one integer sum, scaled once by d * dx; a table's
// signed values there have no offset.
//
// Unpacking. Q6Kx8: nibble words joined with their high bits (grouped.h), even
// and odd quants, the nibble order. Q3Kx8 and Q2Kx8: a half's 2-bit word holds
// quant u at bits 2u, so (word >> 2t) & 0x03 in each byte is quants t, t + 4,
// t + 8, t + 12: the two-bit order. Q3Kx8's third bits (one word a row, quant u
// of half h at bit 16h + 2 (u % 8) + 1 - u / 8: the exact kernels' placement)
// of those four quants sit at 16h + 2t + {1, 9, 0, 8}; one shift brings the
// first two to bit 2 of bytes 0 and 1, another the last two to bytes 2 and 3.
#pragma once

#include <cstdint>
#include <cstring>

#include "grouped.h"
#include "int8_common.h"
#include "int8_linear.h"
#include "q6k_layout.h"
#include "quant_blocks.h"
#include "simd.h"

namespace shardlm::cpu::int8::halves {

namespace q6 = q6kx8::layout;
using grouped::kGroupRows;
using quant::kBlock;

// Whether a layout's halves have an offset to take off (Q6K's and Q3K's kOffset
// * scale, Q2K's minimum) on AVX2: a table's signed values have none.
template <class P>
constexpr bool kHasOffset = P::kMins || P::kOffset != 0;

// Stands for a per-half layout P (q6::Q6K, Q3K, Q2K, IQ2Halves, IQ1Halves)
// among int8_linear.cpp's layouts: its kernels are overloads on this tag.
template <class P>
struct Layout {
  static constexpr bool kTable = P::kTable, kOffsets = kHasOffset<P>;
  static int64_t group_bytes(int64_t k) {
    return k / (kBlock * quant::kSuperBlocks) * P::kSuperBytes;
  }
};

template <class T>
constexpr bool is_layout = false;
template <class P>
constexpr bool is_layout<Layout<P>> = true;

template <class P>
constexpr InputOrder kOrder = P::kTwoBit ? InputOrder::kTwoBit : InputOrder::kNibble;

// What a quant's integer stands for: itself, or for a table layout (a 3-bit
// index) its table's value times kValueFactor (int8_common.h), which the
// scales are divided by.
template <class P>
int32_t int_value(int quant) {
  if constexpr (P::kTable) return TableOf<P>::type::kBytes.values[quant];
  return quant;
}

template <class P>
void rows_scalar(Layout<P>, float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x,
                 int64_t m0, int64_t rows, int64_t k) {
  portable_rows(acc, stride, x, m0, rows, k / kBlock,
                [&](int64_t i, int64_t b, int64_t r, const int8_t* xq) {
    float total = 0.f;
    for (int64_t h = 0; h < 2; ++h) {
      int32_t dot = 0;
      for (int64_t e = kHalf * h; e < kHalf * (h + 1); ++e) {
        dot += int_value<P>(q6::quant_of<P>(w, b, r, e)) * xq[position(e, kOrder<P>)];
      }
      const float scale = q6::scale_of<P>(w, b, h, r) / kValueFactor<P>;
      const float offset = P::kMins ? q6::min_of<P>(w, b, h, r) : P::kOffset * scale;
      total += scale * x.scale[i] * static_cast<float>(dot) + offset * -x.sum16[2 * i + h];
    }
    return total;
  });
}

#if SHARDLM_HAVE_AVX2
// v shifted right by s bits (left by -s where s < 0); the kernels' loops are
// unrolled, so s is a constant there and the shift an immediate one.
SHARDLM_AVX2 inline __m256i shift_avx2(__m256i v, int s) {
  return s >= 0 ? _mm256_srli_epi32(v, s) : _mm256_slli_epi32(v, -s);
}

SHARDLM_AVX512 inline __m512i shift_avx512(__m512i v, int s) {
  return s >= 0 ? _mm512_srli_epi32(v, s) : _mm512_slli_epi32(v, -s);
}

constexpr int32_t kLowBits = 0x03030303;
constexpr int32_t kFirstTwo = 0x00000404;  // bit 2 of bytes 0 and 1
constexpr int32_t kLastTwo = 0x04040000;   // bit 2 of bytes 2 and 3

// Step K's bytes of a two-bit layout from its half's 2-bit word (and, Q3K,
// the row's third-bit word).
template <class P>
SHARDLM_AVX2 inline __m256i two_bit_step_avx2(int k, __m256i half_word,
                                              [[maybe_unused]] __m256i third) {
  const int h = k / 4, t = k % 4;
  const __m256i low =
      _mm256_and_si256(_mm256_srli_epi32(half_word, 2 * t), _mm256_set1_epi32(kLowBits));
  if constexpr (!P::kThirdBit) {
    return low;
  } else {
    const __m256i first = _mm256_and_si256(shift_avx2(third, 16 * h + 2 * t - 1),
                                           _mm256_set1_epi32(kFirstTwo));
    const __m256i last = _mm256_and_si256(shift_avx2(third, 16 * h + 2 * t - 18),
                                          _mm256_set1_epi32(kLastTwo));
    return _mm256_or_si256(low, _mm256_or_si256(first, last));
  }
}

template <class P>
SHARDLM_AVX512 inline __m512i two_bit_step_avx512(int k, __m512i half_word,
                                                  [[maybe_unused]] __m512i third) {
  const int h = k / 4, t = k % 4;
  const __m512i low = _mm512_srli_epi32(half_word, 2 * t);
  if constexpr (!P::kThirdBit) {
    return _mm512_and_si512(low, _mm512_set1_epi32(kLowBits));
  } else {
    // 0xCA: the first operand's bits select the second's, its clear ones the third's.
    const __m512i third_bits = _mm512_ternarylogic_epi32(
        _mm512_set1_epi32(kFirstTwo), shift_avx512(third, 16 * h + 2 * t - 1),
        shift_avx512(third, 16 * h + 2 * t - 18), 0xCA);
    // low's two bits of each byte, third_bits' bit 2: (kLowBits ? low : third_bits) & 0x07.
    return _mm512_and_si512(
        _mm512_ternarylogic_epi32(_mm512_set1_epi32(kLowBits), low, third_bits, 0xCA),
        _mm512_set1_epi32(0x07070707));
  }
}

SHARDLM_AVX2 inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Steps 2s and 2s + 1 of block q's quant bytes (q6::words_of), 8 rows (AVX2)
// or two groups' 16 (AVX-512: q's group in the low half, the one `next` bytes
// on in the high half). Made a pair at a time, beside the pair's dot products,
// as the nibble kernels do: 8 vectors made at once cost the Q6Kx8 kernel 2%.
template <class P>
SHARDLM_AVX2 inline void step_pair_avx2(const uint8_t* q, int s, __m256i& first,
                                        __m256i& second) {
  if constexpr (P::kTwoBit) {
    const __m256i half_word = load256(q + 32 * (s / 2));
    const __m256i third = P::kThirdBit ? load256(q + 64) : _mm256_setzero_si256();
    first = two_bit_step_avx2<P>(2 * s, half_word, third);
    second = two_bit_step_avx2<P>(2 * s + 1, half_word, third);
    if constexpr (P::kTable) {  // the indices' values, signed (see rows_avx2)
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(TableOf<P>::type::kBytes.values)));
      first = _mm256_shuffle_epi8(table, first);
      second = _mm256_shuffle_epi8(table, second);
    }
  } else {
    const grouped::Joined256 joined =
        grouped::join_avx2(load256(q + 32 * s), load256(q + 128 + 32 * (s / 2)), 2 * (s % 2),
                           0x30);
    grouped::joined_bytes_avx2(joined, 0x3f3f3f3f, first, second);
  }
}

template <class P>
SHARDLM_AVX512_VNNI inline void step_pair_avx512(const uint8_t* q, int64_t next, int s,
                                                 __m512i& first, __m512i& second) {
  if constexpr (P::kTwoBit) {
    const __m512i half_word = grouped::load_pair(q + 32 * (s / 2), next);
    const __m512i third = P::kThirdBit ? grouped::load_pair(q + 64, next) : _mm512_setzero_si512();
    first = two_bit_step_avx512<P>(2 * s, half_word, third);
    second = two_bit_step_avx512<P>(2 * s + 1, half_word, third);
    if constexpr (P::kTable) {  // the indices' values + 128, unsigned (see pair_vnni)
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(TableOf<P>::type::kBytes.biased)));
      first = _mm512_shuffle_epi8(table, first);
      second = _mm512_shuffle_epi8(table, second);
    }
  } else {
    const grouped::Joined512 joined = grouped::join_avx512(
        grouped::load_pair(q + 32 * s, next), grouped::load_pair(q + 128 + 32 * (s / 2), next),
        2 * (s % 2), 0x30);
    grouped::joined_bytes_avx512(joined, 0x3f3f3f3f, first, second);
  }
}

// Half h's scales d * sc and offsets (kOffset * scale, or Q2K's dmin * mn) of
// two groups' 16 rows (sp: the super-block; the second group's `next` bytes on).
template <class P>
SHARDLM_AVX512 inline void half_scales_avx512(const uint8_t* sp, int64_t next, int64_t b, int h,
                                              __m512& scale, __m512& offset) {
  const __m512 d = grouped::halves_pair(sp, next);
  const uint8_t* at = sp + q6::scales_at<P>(b, h);
  const __m128i sc =
      _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)),
                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + next)));
  if constexpr (P::kMins) {
    const __m512i bytes = _mm512_cvtepu8_epi32(sc);
    scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f))));
    offset = _mm512_mul_ps(grouped::halves_pair(sp + 16, next),
                           _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)));
  } else {
    scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    if constexpr (P::kTable) scale = _mm512_mul_ps(scale, _mm512_set1_ps(1.f / kValueFactor<P>));
    // A table layout's bytes are value + 128 (step_pair_avx512): 128 * sum(xq) comes back off.
    offset = _mm512_mul_ps(
        scale, _mm512_set1_ps(P::kTable ? 128.f : static_cast<float>(P::kOffset)));
  }
}

// Half h's integer scales of block b, 8 rows, for the AVX2 kernels (sc, or
// Q2K's low nibble), as 32-bit lanes.
template <class P>
SHARDLM_AVX2 inline __m256i half_scale_ints_avx2(const uint8_t* sp, int64_t b, int h) {
  const __m128i sc =
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + q6::scales_at<P>(b, h)));
  if constexpr (P::kMins) {
    return _mm256_and_si256(_mm256_cvtepu8_epi32(sc), _mm256_set1_epi32(0x0f));
  }
  return _mm256_cvtepi8_epi32(sc);
}

// Those scales in both int16 halves of each lane: vpmaddwd's multiplier, so
// that the AVX2 kernels sum a block's two halves in one integer sum (at most
// 32 * 127 * 127 * 128 a lane) and scale it once by d. Made where a step needs
// it, not held through the block: the Q3K kernel has no register to spare.
template <class P>
SHARDLM_AVX2 inline __m256i half_multipliers_avx2(const uint8_t* sp, int64_t b, int h) {
  const __m256i scale = half_scale_ints_avx2<P>(sp, b, h);
  return _mm256_blend_epi16(scale, _mm256_slli_epi32(scale, 16), 0xAA);
}

// Block b's d of 8 rows (a table's divided by its factor) and each half's
// offset where it has one (kHasOffset: kOffset * d * sc, Q2K's dmin * mn).
template <class P>
SHARDLM_AVX2 inline void block_scales_avx2(const uint8_t* sp, int64_t b, __m256& d,
                                           __m256 offset[2]) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
  if constexpr (P::kTable) d = _mm256_mul_ps(d, _mm256_set1_ps(1.f / kValueFactor<P>));
  for (int h = 0; h < 2; ++h) {
    if constexpr (P::kMins) {
      const __m128i sc =
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + q6::scales_at<P>(b, h)));
      const __m256 dmin =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
      offset[h] = _mm256_mul_ps(
          dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(sc), 4)));
    } else if constexpr (kHasOffset<P>) {
      offset[h] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(static_cast<float>(P::kOffset))),
                                _mm256_cvtepi32_ps(half_scale_ints_avx2<P>(sp, b, h)));
    }
  }
}

// acc + a step's 4-byte dot products against input word `inputs`, each pair
// of products times its half's multiplier (half_multipliers_avx2): |q| times
// the input with q's sign for a table's signed values, as signed_dot4_avx2.
template <bool kTable>
SHARDLM_AVX2 inline __m256i scaled_dot4(__m256i acc, __m256i quants, int32_t inputs,
                                        __m256i multipliers) {
  const __m256i x = _mm256_set1_epi32(inputs);
  const __m256i pairs =
      kTable ? _mm256_maddubs_epi16(_mm256_abs_epi8(quants), _mm256_sign_epi8(x, quants))
             : _mm256_maddubs_epi16(quants, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, multipliers));
}

// step_dot_avx2 (int8_common.h) with each pair of products times the step's
// half's multipliers.
template <bool kTable>
SHARDLM_AVX2 inline void scaled_step_dot(__m256i (&dot)[2], __m256i first, __m256i second,
                                         const int8_t* xq, __m256i multipliers) {
  dot[0] = scaled_dot4<kTable>(dot[0], first, input_word(xq), multipliers);
  dot[1] = scaled_dot4<kTable>(dot[1], second, input_word(xq + 4), multipliers);
}

// The AVX2 kernel: R input rows from m0 against one group. Each block's halves
// are summed in one integer sum (half_multipliers_avx2), scaled once by d
// dx, and the halves' offsets taken off against their input sums.
template <int R, class P>
SHARDLM_AVX2 void rows_avx2(Layout<P>, float* acc, int64_t stride, const uint8_t* w,
                            const Int8Rows& x, int64_t m0, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m256 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = q6::words_of<P>(w, b);
    const uint8_t* sp = q6::super_of<P>(w, b);
    grouped::prefetch_span(w, q6::stream_begin<P>(w, b), q + P::kBlockBytes, 0);
    __m256i dot[R][2];  // two chains (scaled_step_dot)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4  // constant s: immediate shifts, and the chains stay in registers
    for (int s = 0; s < 4; ++s) {
      __m256i first, second;
      step_pair_avx2<P>(q, s, first, second);
      const __m256i multipliers = half_multipliers_avx2<P>(sp, b, s / 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        scaled_step_dot<P::kTable>(dot[r], first, second, xq, multipliers);
      }
    }
    __m256 d, offset[2];
    block_scales_avx2<P>(sp, b, d, offset);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = scaled_block_avx2(sum[r], d, x.scale[i], dot[r]);
      if constexpr (kHasOffset<P>) {
        off[r] = _mm256_fmadd_ps(offset[0], _mm256_set1_ps(-x.sum16[2 * i]), off[r]);
        off[r] = _mm256_fmadd_ps(offset[1], _mm256_set1_ps(-x.sum16[2 * i + 1]), off[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * stride, _mm256_add_ps(sum[r], off[r]));
}

// Two groups (w and w + next) at once, 16 rows a vector: acc[16 r + l]. Every
// loop over the rows is unrolled (int8_nibbles.h's pair_vnni says why).
template <int R, class P>
SHARDLM_AVX512_VNNI void pair_vnni(Layout<P>, float* acc, const uint8_t* w, int64_t next,
                                   const Int8Rows& x, int64_t m0, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m512 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = q6::words_of<P>(w, b);
    grouped::prefetch_span(w, q6::stream_begin<P>(w, b), q + P::kBlockBytes, next);
    __m512i dot[R][2];  // per half
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4  // constant s: immediate shifts, and the chains stay in registers
    for (int s = 0; s < 4; ++s) {
      __m512i first, second;
      step_pair_avx512<P>(q, next, s, first, second);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        __m512i& chain = dot[r][s / 2];
        chain = _mm512_dpbusd_epi32(chain, first, _mm512_set1_epi32(input_word(xq)));
        chain = _mm512_dpbusd_epi32(chain, second, _mm512_set1_epi32(input_word(xq + 4)));
      }
    }
    const uint8_t* sp = q6::super_of<P>(w, b);
    for (int h = 0; h < 2; ++h) {
      __m512 scale, offset;
      half_scales_avx512<P>(sp, next, b, h, scale, offset);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * blocks + b;
        sum[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(x.scale[i])),
                                 _mm512_cvtepi32_ps(dot[r][h]), sum[r]);
        off[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(-x.sum16[2 * i + h]), off[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(sum[r], off[r]));
}
#endif

}  // namespace shardlm::cpu::int8::halves
