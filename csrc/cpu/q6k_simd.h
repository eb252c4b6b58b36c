// How the kernels of q6kx8.cpp read a block of the Q6Kx8 family (q6k_layout.h:
// Q6Kx8, Q3Kx8, Q2Kx8 and the per-16 table layouts) in registers: the rows'
// scales and minimums, the quant words joined with their high bits, and each
// quant as the float the FMAs multiply; 8 rows a vector (AVX2) or two
// neighbouring groups' 16 (AVX-512F, the group at s and the one `next` bytes on).
#pragma once

#include <cstdint>

#include "grouped.h"
#include "q6k_layout.h"
#include "simd.h"
#include "subnormal.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::q6kx8::layout {

// The factors of block b's two halves, one row a lane: d * sc (d as the
// caller gives it, once per super-block) and Q2Kx8's dmin * mn (exact: a
// float16 times 4 bits); both halves' scale bytes come in one load a group.
struct HalfFactors256 {
  __m256 scale[2], mins[2];
};

// Q2Kx8's scale (low) or minimum (high) nibbles of 16 bytes, as bytes.
SHARDLM_AVX2 inline __m128i scale_nibbles(__m128i bytes, bool high) {
  return _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0f));
}

template <class P>
SHARDLM_AVX2 inline __m256 half_factor8(__m128i bytes, __m256 d, bool high) {
  const __m256i v = P::kMins ? _mm256_cvtepu8_epi32(scale_nibbles(bytes, high))
                             : _mm256_cvtepi8_epi32(bytes);
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
}

template <class P>
SHARDLM_AVX2 inline HalfFactors256 half_factors8(const uint8_t* s, int64_t b, __m256 d,
                                                 __m256 dmin) {
  const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + scales_at<P>(b, 0)));
  const __m128i bytes[2] = {both, _mm_srli_si128(both, 8)};
  HalfFactors256 f;
  for (int h = 0; h < 2; ++h) {
    f.scale[h] = half_factor8<P>(bytes[h], d, false);
    f.mins[h] = P::kMins ? half_factor8<P>(bytes[h], dmin, true) : _mm256_setzero_ps();
  }
  return f;
}

// The super-block's d (kSub: times 2^kSubnormalShift) and Q2Kx8's dmin.
template <class P, bool kSub>
SHARDLM_AVX2 inline void super_factors8(const uint8_t* s, __m256& d, __m256& dmin) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  if constexpr (kSub) d = _mm256_mul_ps(d, _mm256_set1_ps(kSubnormalBlockScale));
  if constexpr (P::kMins) {
    dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
  }
}

// Nibble word s of a block (v) joined with its high bits (high word s / 2,
// quant 8s + j's two at 4j + 2 (s % 2)): quant j in place is
// grouped::joined_quant_avx2(.., j, 0x3f).
// Q3Kx8's nibbles are whole quants: the word is its own even and odd words,
// quant 7 shifted down its top. Q2Kx8's word s / 2 holds quants 16 (s / 2) ..
// on, two bits each: for odd s shifted down by 16, so that quant 8s + j is
// at bits 2j (every quant in the low 16 bits; `top` is not read).
// Q3Kx8's words are Q2Kx8's with a third bit a quant: its row's word of third
// bits shifted so that quant j's lands at 2j + 2, just above its low two,
// then one select joins the even quants' (their low bits at 0 and 1 mod 4,
// their third at 2 mod 4) and one the odd quants' (2 and 3, then 0 mod 4).
constexpr int kEvenLowBits = 0x33333333, kOddLowBits = static_cast<int>(0xCCCCCCCCu);

SHARDLM_AVX2 inline __m256i third_bits_avx2(const uint8_t* q, int s) {
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64));
  return s / 2 == 0 ? _mm256_slli_epi32(t, 1 + s % 2) : _mm256_srli_epi32(t, 15 - s % 2);
}

SHARDLM_AVX512 inline __m512i third_bits_avx512(const uint8_t* q, int s, int64_t next) {
  const __m512i t = grouped::load_pair(q + 64, next);
  return s / 2 == 0 ? _mm512_slli_epi32(t, 1 + s % 2) : _mm512_srli_epi32(t, 15 - s % 2);
}

template <class P>
SHARDLM_AVX2 inline grouped::Joined256 words_avx2(const uint8_t* q, int s) {
  if constexpr (P::kTwoBit) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (s / 2)));
    if (s % 2) v = _mm256_srli_epi32(v, 16);
    if constexpr (!P::kThirdBit) return {v, v, v};
    const __m256i third = third_bits_avx2(q, s);
    const __m256i even = _mm256_set1_epi32(kEvenLowBits), odd = _mm256_set1_epi32(kOddLowBits);
    return {_mm256_or_si256(_mm256_and_si256(even, v), _mm256_andnot_si256(even, third)),
            _mm256_or_si256(_mm256_and_si256(odd, v), _mm256_andnot_si256(odd, third)), v};
  }
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * s));
  if constexpr (!P::kHighWords) return {v, v, _mm256_srli_epi32(v, 28)};
  return grouped::join_avx2(
      v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 + 32 * (s / 2))),
      2 * (s % 2), 0x30);
}

template <class P>
SHARDLM_AVX512 inline grouped::Joined512 words_avx512(const uint8_t* q, int s, int64_t next) {
  if constexpr (P::kTwoBit) {
    __m512i v = grouped::load_pair(q + 32 * (s / 2), next);
    if (s % 2) v = _mm512_srli_epi32(v, 16);
    if constexpr (!P::kThirdBit) return {v, v, v};
    const __m512i third = third_bits_avx512(q, s, next);
    // 0xCA: the first operand's bits select the second's, its clear ones the third's.
    return {_mm512_ternarylogic_epi32(_mm512_set1_epi32(kEvenLowBits), v, third, 0xCA),
            _mm512_ternarylogic_epi32(_mm512_set1_epi32(kOddLowBits), v, third, 0xCA), v};
  }
  const __m512i v = grouped::load_pair(q + 32 * s, next);
  if constexpr (!P::kHighWords) return {v, v, _mm512_srli_epi32(v, 28)};
  return grouped::join_avx512(v, grouped::load_pair(q + 128 + 32 * (s / 2), next), 2 * (s % 2),
                              0x30);
}

// Quant j of a joined word as the kernels multiply it: converted (q * 2^4j,
// quant 7 shifted down; Q2Kx8 and Q3Kx8: q * 2^2j), or with kSub read as a
// subnormal (subnormal.h; Q2Kx8's and Q3Kx8's quants all lie in the low 17 bits), or
// for a table layout the value its 3-bit quant indexes.
template <class P, bool kSub>
SHARDLM_AVX2 inline __m256 quant_avx2(const grouped::Joined256& q, int j) {
  if constexpr (P::kTable) return grouped::table3_avx2(P::kValues, j % 2 ? q.odd : q.even, j);
  if constexpr (P::kTwoBit) {
    const __m256i in_place = _mm256_and_si256(j % 2 ? q.odd : q.even,
                                              _mm256_set1_epi32(P::kField << (2 * j)));
    return kSub ? _mm256_castsi256_ps(in_place) : _mm256_cvtepi32_ps(in_place);
  }
  if constexpr (kSub) return grouped::joined_subnormal_avx2(q, j, P::kField);
  return _mm256_cvtepi32_ps(grouped::joined_quant_avx2(q, j, P::kField));
}

template <class P, bool kSub>
SHARDLM_AVX512 inline __m512 quant_avx512(const grouped::Joined512& q, int j) {
  if constexpr (P::kTable) return grouped::table3_avx512(P::kValues, j % 2 ? q.odd : q.even, j);
  if constexpr (P::kTwoBit) {
    const __m512i in_place = _mm512_and_si512(j % 2 ? q.odd : q.even,
                                              _mm512_set1_epi32(P::kField << (2 * j)));
    return kSub ? _mm512_castsi512_ps(in_place) : _mm512_cvtepi32_ps(in_place);
  }
  if constexpr (kSub) return grouped::joined_subnormal_avx512(q, j, P::kField);
  return _mm512_cvtepi32_ps(grouped::joined_quant_avx512(q, j, P::kField));
}

// half_factors8 and super_factors8 for the groups at s and s + next.
struct HalfFactors512 {
  __m512 scale[2], mins[2];
};

template <class P>
SHARDLM_AVX512 inline __m512 half_factor_pair(__m128i bytes, __m512 d, bool high) {
  const __m512i v = P::kMins ? _mm512_cvtepu8_epi32(scale_nibbles(bytes, high))
                             : _mm512_cvtepi8_epi32(bytes);
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
}

template <class P>
SHARDLM_AVX512 inline HalfFactors512 half_factors_pair(const uint8_t* s, int64_t next, int64_t b,
                                                       __m512 d, __m512 dmin) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + scales_at<P>(b, 0)));
  const __m128i hi =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + next + scales_at<P>(b, 0)));
  const __m128i bytes[2] = {_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi)};
  HalfFactors512 f;
  for (int h = 0; h < 2; ++h) {
    f.scale[h] = half_factor_pair<P>(bytes[h], d, false);
    f.mins[h] = P::kMins ? half_factor_pair<P>(bytes[h], dmin, true) : _mm512_setzero_ps();
  }
  return f;
}

template <class P, bool kSub>
SHARDLM_AVX512 inline void super_factors_pair(const uint8_t* s, int64_t next, __m512& d,
                                              __m512& dmin) {
  d = grouped::halves_pair(s, next);
  if constexpr (kSub) d = _mm512_mul_ps(d, _mm512_set1_ps(kSubnormalBlockScale));
  if constexpr (P::kMins) dmin = grouped::halves_pair(s + 16, next);
}

// What quants 8s .. 8s+7 of block b stand for before their half's scale, one
// row a lane: the quant less the offset, or a table layout's value.
template <class P>
SHARDLM_AVX2 inline void quant_values(const uint8_t* q, int s, __m256 out[8]) {
  const grouped::Joined256 words = words_avx2<P>(q, s);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if constexpr (P::kTable) {
      out[j] = quant_avx2<P, false>(words, j);
    } else if constexpr (P::kTwoBit) {
      out[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(
          _mm256_and_si256(_mm256_srli_epi32(j % 2 ? words.odd : words.even, 2 * j),
                           _mm256_set1_epi32(P::kField)),
          _mm256_set1_epi32(P::kOffset)));
    } else {
      out[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(
          _mm256_srli_epi32(grouped::joined_quant_avx2(words, j, P::kField), j < 7 ? 4 * j : 0),
          _mm256_set1_epi32(P::kOffset)));
    }
  }
}

}  // namespace shardlm::cpu::q6kx8::layout
#endif
