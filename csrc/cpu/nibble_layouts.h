// The layouts the Q4x8 kernels (q4x8.cpp, and the int8-activation ones of
// int8_linear.cpp) read, each as a type the kernels are templates over: where
// block b (32 weights) of a group of 8 rows keeps its quant words, its high
// bits (5-bit layouts) and its scales; the unpacking of one word of quants to
// 8 or 16 rows' quant j in place (or, for a table layout, to the values its
// nibbles index); and the block's scales as vectors.
#pragma once

#include <cstdint>
#include <cstring>

#include "grouped.h"
#include "quant_blocks.h"
#include "value_tables.h"
#include "simd.h"
#include "subnormal.h"

namespace shardlm::cpu::q4x8::nibble {

using quant::half_at;
using quant::kBlock;
using quant::kGroupBlockBytes;
using quant::kQ40GroupBlockBytes;
using quant::kQ5GroupBlockBytes;
using quant::kIQ4SuperGroupBytes;
using quant::kQ51GroupBlockBytes;
using quant::kQ5SuperGroupBytes;
using quant::kSuperBlocks;
using quant::kSuperGroupBytes;

// Where block b (32 weights) of a group's 8 rows keeps its 128 bytes of quant
// words (and for the 5-bit layouts its 32 bytes of high bits), and its scale d
// and offset m per row (w = d q + m), for each layout. stream_begin: where
// block b's stretch of the group's bytes begins (the kernels look ahead over
// it; its end is quants + 128). kImpliedOffset: for layouts that store no
// offset, m = kImpliedOffset * d (0: m is stored).
//
// Q4x8 (Q4_1, `--quantize int4`), Q40x8 (Q4_0), Q5x8 (Q5_0) and Q51x8 (Q5_1),
// per block of 32 weights and group of 8 rows: the rows' float16 scales d[8],
// their offsets m[8] unless implied (Q4_0's m = -8 d, Q5_0's -16 d, exact in float32), for
// 5-bit quants the high-bit words h[8], then the quant words q[4][8].
// kOff is an int: a float template parameter is C++20, and torch up to 2.13
// builds extensions as C++17 (tests/test_cxx_standard.py).
template <int64_t kT, bool kF, int kOff>
struct BlockLayout {
  static constexpr int64_t kType = kT;
  static constexpr bool kSuper = false, kFive = kF, kTable = false;
  static constexpr float kImpliedOffset = static_cast<float>(kOff);
  static constexpr int64_t kScaleBytes = kOff != 0 ? 16 : 32;
  static constexpr int64_t kLead = kScaleBytes + (kF ? 32 : 0);
  static constexpr int64_t kBytes = kLead + 128;
  static int64_t group_bytes(int64_t k) { return k / kBlock * kBytes; }
  static const uint8_t* header(const uint8_t* w, int64_t b) { return w + b * kBytes; }
  static const uint8_t* highs(const uint8_t* w, int64_t b) {
    return kF ? header(w, b) + kScaleBytes : nullptr;
  }
  static const uint8_t* quants(const uint8_t* w, int64_t b) { return header(w, b) + kLead; }
  static const uint8_t* stream_begin(const uint8_t* w, int64_t b) { return header(w, b); }
  static float d(const uint8_t* w, int64_t b, int64_t r) { return half_at(header(w, b) + 2 * r); }
  static float m(const uint8_t* w, int64_t b, int64_t r) {
    if constexpr (kOff != 0) return kImpliedOffset * d(w, b, r);
    return half_at(header(w, b) + 16 + 2 * r);
  }
};
using Q4x8Layout = BlockLayout<quant::kQ4x8, false, 0>;
using Q40x8Layout = BlockLayout<quant::kQ40x8, false, -8>;
using Q5x8Layout = BlockLayout<quant::kQ5x8, true, -16>;
using Q51x8Layout = BlockLayout<quant::kQ51x8, true, 0>;
static_assert(Q4x8Layout::kBytes == kGroupBlockBytes && Q40x8Layout::kBytes == kQ40GroupBlockBytes &&
              Q5x8Layout::kBytes == kQ5GroupBlockBytes && Q51x8Layout::kBytes == kQ51GroupBlockBytes);

// Q4_K and Q5_K: a 160-byte header per super-block of 256 weights (d, dmin,
// then 6-bit scales and mins), d = d_super * scale, m = -(dmin_super * min),
// each a float16 times a 6-bit integer, so exact in float32, as GGML computes
// them; then per block (high bits and) quant words.
template <int64_t kT, bool kF>
struct SuperLayout {
  static constexpr int64_t kType = kT;
  static constexpr bool kSuper = true, kFive = kF, kTable = false;
  static constexpr float kImpliedOffset = 0.f;
  static constexpr int64_t kBlockBytes = kF ? 160 : 128;
  static constexpr int64_t kBytes = 160 + kSuperBlocks * kBlockBytes;
  static int64_t group_bytes(int64_t k) { return k / (kBlock * kSuperBlocks) * kBytes; }
  static const uint8_t* super(const uint8_t* w, int64_t b) { return w + b / kSuperBlocks * kBytes; }
  static const uint8_t* highs(const uint8_t* w, int64_t b) {
    return super(w, b) + 160 + kBlockBytes * (b % kSuperBlocks);
  }
  static const uint8_t* quants(const uint8_t* w, int64_t b) { return highs(w, b) + (kF ? 32 : 0); }
  // The super-block's header is read with its first block.
  static const uint8_t* stream_begin(const uint8_t* w, int64_t b) {
    return b % kSuperBlocks == 0 ? super(w, b) : highs(w, b);
  }
  static float d(const uint8_t* w, int64_t b, int64_t r) {
    const uint8_t* h = super(w, b);
    return half_at(h + 2 * r) * static_cast<float>(h[32 + 8 * (b % kSuperBlocks) + r]);
  }
  static float m(const uint8_t* w, int64_t b, int64_t r) {
    const uint8_t* h = super(w, b);
    return -(half_at(h + 16 + 2 * r) * static_cast<float>(h[96 + 8 * (b % kSuperBlocks) + r]));
  }
};
using Q4Kx8Layout = SuperLayout<quant::kQ4Kx8, false>;
using Q5Kx8Layout = SuperLayout<quant::kQ5Kx8, true>;
static_assert(Q4Kx8Layout::kBytes == kSuperGroupBytes && Q5Kx8Layout::kBytes == kQ5SuperGroupBytes);

// IQ4_XS: an 80-byte header per super-block of 256 weights (d[8] float16, then
// the 6-bit scales less 32 as int8 sc[8][8], block-major), then per block the
// quant words, each nibble an index into kIQ4Values: w = d * sc * kv[q], no
// offset. d * sc * kv has at most 11 + 5 + 7 significant bits, so GGML's
// (d * sc) * kv is exact in float32, and so is each of the kernels' products.
// IQ3_XXS and IQ3_S have the same bytes, with sc their sub-block's odd scale
// (1..31) and kValues their table: d * sc is exact, and so is its product
// with a value (at most 6 significant bits), which GGML rounds once as well.
// A table layout (kTable) reads its quants through the table, against inputs
// that are not pre-scaled, and never as subnormals.
template <int64_t kT, const float* kV>
struct SuperTableLayout {
  static constexpr int64_t kType = kT;
  static constexpr const float* kValues = kV;
  static constexpr bool kSuper = true, kFive = false, kTable = true;
  static constexpr float kImpliedOffset = 0.f;
  static constexpr int64_t kHeaderBytes = 80;
  static constexpr int64_t kBytes = kHeaderBytes + kSuperBlocks * 128;
  static int64_t group_bytes(int64_t k) { return k / (kBlock * kSuperBlocks) * kBytes; }
  static const uint8_t* super(const uint8_t* w, int64_t b) { return w + b / kSuperBlocks * kBytes; }
  static const uint8_t* highs(const uint8_t*, int64_t) { return nullptr; }
  static const uint8_t* quants(const uint8_t* w, int64_t b) {
    return super(w, b) + kHeaderBytes + 128 * (b % kSuperBlocks);
  }
  static const uint8_t* stream_begin(const uint8_t* w, int64_t b) {
    return b % kSuperBlocks == 0 ? super(w, b) : quants(w, b);
  }
  static const uint8_t* scales(const uint8_t* w, int64_t b) {
    return super(w, b) + 16 + 8 * (b % kSuperBlocks);
  }
  static float d(const uint8_t* w, int64_t b, int64_t r) {
    return half_at(super(w, b) + 2 * r) * static_cast<float>(static_cast<int8_t>(scales(w, b)[r]));
  }
  static float m(const uint8_t*, int64_t, int64_t) { return 0.f; }
};
using IQ4x8Layout = SuperTableLayout<quant::kIQ4x8, kIQ4Values>;
using IQ3XXSx8Layout = SuperTableLayout<quant::kIQ3XXSx8, kIQ3XXSValues>;
using IQ3Sx8Layout = SuperTableLayout<quant::kIQ3Sx8, kIQ3SValues>;
static_assert(IQ4x8Layout::kBytes == kIQ4SuperGroupBytes);

// IQ4_NL: Q40x8's bytes (d[8] float16, then the quant words per block of 32),
// each nibble an index into kIQ4Values: w = d * kv[q], no offset.
struct IQ4NLx8Layout {
  static constexpr int64_t kType = quant::kIQ4NLx8;
  static constexpr const float* kValues = kIQ4Values;
  static constexpr bool kSuper = false, kFive = false, kTable = true;
  static constexpr float kImpliedOffset = 0.f;
  static constexpr int64_t kBytes = 16 + 128;
  static int64_t group_bytes(int64_t k) { return k / kBlock * kBytes; }
  static const uint8_t* header(const uint8_t* w, int64_t b) { return w + b * kBytes; }
  static const uint8_t* highs(const uint8_t*, int64_t) { return nullptr; }
  static const uint8_t* quants(const uint8_t* w, int64_t b) { return header(w, b) + 16; }
  static const uint8_t* stream_begin(const uint8_t* w, int64_t b) { return header(w, b); }
  static float d(const uint8_t* w, int64_t b, int64_t r) { return half_at(header(w, b) + 2 * r); }
  static float m(const uint8_t*, int64_t, int64_t) { return 0.f; }
};
static_assert(IQ4NLx8Layout::kBytes == kQ40GroupBlockBytes);

inline uint32_t word_at(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Row r's quant i (0..31) of block b.
template <class L>
inline float quant_of(const uint8_t* w, int64_t b, int64_t r, int64_t i) {
  uint32_t q = (word_at(L::quants(w, b) + 4 * (8 * (i / 8) + r)) >> (4 * (i % 8))) & 0x0f;
  if constexpr (L::kTable) return L::kValues[q];
  if constexpr (L::kFive) q |= ((word_at(L::highs(w, b) + 4 * r) >> (4 * (i % 8) + i / 8)) & 1) << 4;
  return static_cast<float>(q);
}

#if SHARDLM_HAVE_AVX2
// Nibble word s of a block for 8 rows (v), for the 5-bit layouts joined with
// the rows' high bits (h: quant 8s + j's at bit 4j + s, quant_blocks.h) so
// that each quant can be masked in place (quant_avx2). A 4-bit word's joined
// form is the word itself as even and odd words and quant 7 shifted down as
// the top, what the subnormal kernels read (quant_float_avx2).
struct Words256 {
  __m256i lo;
  grouped::Joined256 joined;
};

template <class L>
SHARDLM_AVX2 inline Words256 words_avx2(__m256i v, __m256i h, int s) {
  if constexpr (!L::kFive) return {v, {v, v, _mm256_srli_epi32(v, 28)}};
  return {v, grouped::join_avx2(v, h, s, 0x10)};
}

// Quant j (0..7) of the word in place, q * 2^4j; the top one shifted down
// (masked in place it would read as negative).
template <class L>
SHARDLM_AVX2 inline __m256i quant_avx2(const Words256& q, int j) {
  if constexpr (L::kFive) return grouped::joined_quant_avx2(q.joined, j, 0x1f);
  return j < 7 ? _mm256_and_si256(q.lo, _mm256_set1_epi32(0x0f << (4 * j)))
               : _mm256_srli_epi32(q.lo, 28);
}

// The quants of a word as the kernels multiply them: converted to float
// (quant_avx2), or with kSub read as subnormals from the joined words
// (grouped::joined_subnormal_avx2; a 4-bit word is its own even and odd
// words, with quant 7 shifted down as its top).
template <class L, bool kSub>
SHARDLM_AVX2 inline __m256 quant_float_avx2(const Words256& q, int j) {
  if constexpr (L::kTable) return grouped::table_avx2(L::kValues, q.lo, j);
  if constexpr (kSub) return grouped::joined_subnormal_avx2(q.joined, j, L::kFive ? 0x1f : 0x0f);
  return _mm256_cvtepi32_ps(quant_avx2<L>(q, j));
}

template <class L>
SHARDLM_AVX2 inline __m256i highs_avx2(const uint8_t* w, int64_t b) {
  if constexpr (!L::kFive) return _mm256_setzero_si256();
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::highs(w, b)));
}

// words_avx2 and quant_avx2 on 16 rows.
struct Words512 {
  __m512i lo;
  grouped::Joined512 joined;
};

template <class L>
SHARDLM_AVX512 inline Words512 words_avx512(__m512i v, __m512i h, int s) {
  if constexpr (!L::kFive) return {v, {v, v, _mm512_srli_epi32(v, 28)}};
  return {v, grouped::join_avx512(v, h, s, 0x10)};
}

template <class L>
SHARDLM_AVX512 inline __m512i quant_avx512(const Words512& q, int j) {
  if constexpr (L::kFive) return grouped::joined_quant_avx512(q.joined, j, 0x1f);
  return j < 7 ? _mm512_and_si512(q.lo, _mm512_set1_epi32(0x0f << (4 * j)))
               : _mm512_srli_epi32(q.lo, 28);
}

template <class L, bool kSub>
SHARDLM_AVX512 inline __m512 quant_float_avx512(const Words512& q, int j) {
  if constexpr (L::kTable) return grouped::table_avx512(L::kValues, q.lo, j);
  if constexpr (kSub) return grouped::joined_subnormal_avx512(q.joined, j, L::kFive ? 0x1f : 0x0f);
  return _mm512_cvtepi32_ps(quant_avx512<L>(q, j));
}

// ---- block scales and prefetches, 8 rows (AVX2) or two groups' 16 (AVX-512) -------

SHARDLM_AVX2 inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

SHARDLM_AVX2 inline __m256 bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

SHARDLM_AVX2 inline __m256 signed_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Block b's 8 scales and 8 offsets, one row a lane.
template <class L>
SHARDLM_AVX2 inline void scales_avx2(const uint8_t* w, int64_t b, __m256& d, __m256& m) {
  if constexpr (L::kTable) {
    if constexpr (L::kSuper) {
      d = _mm256_mul_ps(halves8(L::super(w, b)), signed_bytes8(L::scales(w, b)));
    } else {
      d = halves8(L::header(w, b));
    }
    m = _mm256_setzero_ps();
  } else if constexpr (L::kSuper) {
    const uint8_t* h = L::super(w, b);
    const int64_t s = b % kSuperBlocks;
    d = _mm256_mul_ps(halves8(h), bytes8(h + 32 + 8 * s));
    m = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(halves8(h + 16), bytes8(h + 96 + 8 * s)));
  } else if constexpr (L::kImpliedOffset != 0.f) {
    d = halves8(L::header(w, b));
    m = _mm256_mul_ps(d, _mm256_set1_ps(L::kImpliedOffset));
  } else {
    d = halves8(L::header(w, b));
    m = halves8(L::header(w, b) + 16);
  }
}

// The lines of block b ahead of the one read (for AVX-512 pairs, next > 0,
// those of both groups: grouped::prefetch_pair).
template <class L>
SHARDLM_AVX2 inline void prefetch_block(const uint8_t* w, int64_t b, int64_t next = 0) {
  grouped::prefetch_span(w, L::stream_begin(w, b), L::quants(w, b) + 128, next);
}

// The 8 bytes at p and the 8 at p + next as 16 floats.
SHARDLM_AVX512 inline __m512 bytes_pair(const uint8_t* p, int64_t next) {
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + next));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
}

// The 8 signed bytes at p and the 8 at p + next as 16 floats.
SHARDLM_AVX512 inline __m512 signed_bytes_pair(const uint8_t* p, int64_t next) {
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + next));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi)));
}

// A super-block's float16 factors for the groups at w and w + next: d, and
// the K-quants' dmin negated (exact), which the kernels load once for its 8
// blocks; the 32-weight layouts have none (their scales come with each block).
struct SuperHalves512 {
  __m512 d, neg_dmin;
};

template <class L>
SHARDLM_AVX512 inline SuperHalves512 super_halves_pair(const uint8_t* w, int64_t next, int64_t b) {
  SuperHalves512 f{_mm512_setzero_ps(), _mm512_setzero_ps()};
  if constexpr (L::kSuper) {
    f.d = grouped::halves_pair(L::super(w, b), next);
    if constexpr (!L::kTable) {
      const __m512 dmin = grouped::halves_pair(L::super(w, b) + 16, next);
      f.neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), dmin);
    }
  }
  return f;
}

// scales_avx2 for block b of the groups at w and w + next, with their
// super-block's factors `f` (super_halves_pair).
template <class L>
SHARDLM_AVX512 inline void scales_pair(const uint8_t* w, int64_t next, int64_t b,
                                       const SuperHalves512& f, __m512& d, __m512& m) {
  if constexpr (L::kTable) {
    if constexpr (L::kSuper) {
      d = _mm512_mul_ps(f.d, signed_bytes_pair(L::scales(w, b), next));
    } else {
      d = grouped::halves_pair(L::header(w, b), next);
    }
    m = _mm512_setzero_ps();
  } else if constexpr (L::kSuper) {
    const uint8_t* h = L::super(w, b);
    const int64_t s = b % kSuperBlocks;
    d = _mm512_mul_ps(f.d, bytes_pair(h + 32 + 8 * s, next));
    m = _mm512_mul_ps(f.neg_dmin, bytes_pair(h + 96 + 8 * s, next));
  } else if constexpr (L::kImpliedOffset != 0.f) {
    d = grouped::halves_pair(L::header(w, b), next);
    m = _mm512_mul_ps(d, _mm512_set1_ps(L::kImpliedOffset));
  } else {
    d = grouped::halves_pair(L::header(w, b), next);
    m = grouped::halves_pair(L::header(w, b) + 16, next);
  }
}

template <class L>
SHARDLM_AVX512 inline void scales_pair(const uint8_t* w, int64_t next, int64_t b, __m512& d,
                                       __m512& m) {
  scales_pair<L>(w, next, b, super_halves_pair<L>(w, next, b), d, m);
}
#endif

}  // namespace shardlm::cpu::q4x8::nibble
