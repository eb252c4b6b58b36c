// What the kernels of the 8-row grouped layouts (quant_blocks.h: Q4x8, Q5x8,
// Q4Kx8 and Q5Kx8 in q4x8.cpp, Q6Kx8 in q6kx8.cpp) share: the loop of the
// matrix-vector product over groups (threads split them, AVX-512 takes them in pairs), the
// loop that dequantizes rows group by group through a panel, and the loads
// that join two neighbouring groups in one 512-bit register.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_utils.h"
#include "quant_blocks.h"
#include "simd.h"
#include "subnormal.h"

namespace shardlm::cpu::grouped {

using quant::kGroupRows;

// The most input rows one pass of a matrix-vector kernel takes: each unpacked
// vector of quants feeds that many input rows.
constexpr int64_t kMaxRows = 4;

// 2^-4j, the factor that undoes nibble j's place in its 32-bit lane when the
// kernels mask it in place (1 for the top one, which they shift down instead).
constexpr float kNibbleScale[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f,
                                   0x1p-24f, 1.f};
// 2^-2j, the same for 2-bit quants (Q2Kx8: quant j of a shifted word at bit 2j).
constexpr float kTwoBitScale[8] = {1.f, 0x1p-2f, 0x1p-4f, 0x1p-6f, 0x1p-8f, 0x1p-10f,
                                   0x1p-12f, 0x1p-14f};

// The input rows (`count` floats, a multiple of 8) as the SIMD kernels read
// them: element 8s + j scaled by scale[j] (kNibbleScale, to meet quant j
// masked in place, q * 2^4j; kTwoBitScale for 2-bit quants); a thread-local
// buffer valid until the next call on this thread. Multiplying by a power of
// two rounds exactly as ldexp does (short of inputs below 2^-100 going
// subnormal). Only the SIMD kernels read it, so it is AVX2 code: it runs on
// the calling thread before the threads split the groups, and the scalar loop
// took 2.7% of a default-model decode step there.
inline float* prescale_buffer(int64_t count) {
  thread_local std::vector<float> scaled;
  if (static_cast<int64_t>(scaled.size()) < count) scaled.resize(count);
  return scaled.data();
}

#if SHARDLM_HAVE_AVX2
SHARDLM_AVX2 inline const float* prescaled(const float* x, int64_t count,
                                           const float* scale = kNibbleScale) {
  float* out = prescale_buffer(count);
  const __m256 factors = _mm256_loadu_ps(scale);
  for (int64_t i = 0; i < count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), factors));
  }
  return out;
}

// prescaled() for the kernels that read quants as subnormals (subnormal.h),
// `rows` rows of k inputs, element 8s + j scaled by scale[j]
// (kSubnormalNibbleScale, or kSubnormalTwoBitScale for 2-bit quants);
// nullptr where an input reaches kSubnormalInputLimit (or is not finite), or a
// row's largest one is below kSubnormalRowFloor but not 0, which the
// converting kernels take instead.
SHARDLM_AVX2 inline const float* prescaled_subnormal(
    const float* x, int64_t rows, int64_t k, const float* scale = kSubnormalNibbleScale) {
  float* out = prescale_buffer(rows * k);
  const __m256 factors = _mm256_loadu_ps(scale);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 limit = _mm256_set1_ps(kSubnormalInputLimit);
  const __m256 floor = _mm256_set1_ps(kSubnormalRowFloor);
  for (int64_t r = 0; r < rows; ++r) {
    __m256 fits = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = r * k; i < (r + 1) * k; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 size = _mm256_and_ps(v, magnitude);
      fits = _mm256_and_ps(fits, _mm256_cmp_ps(size, limit, _CMP_LT_OQ));
      largest = _mm256_max_ps(largest, size);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(v, factors));
    }
    const int big = _mm256_movemask_ps(_mm256_cmp_ps(largest, floor, _CMP_GE_OQ));
    const int zero = _mm256_movemask_ps(_mm256_cmp_ps(largest, _mm256_setzero_ps(), _CMP_EQ_OQ));
    if (_mm256_movemask_ps(fits) != 0xff || (big == 0 && zero != 0xff)) return nullptr;
  }
  return out;
}
#else
inline const float* prescaled(const float* x, int64_t count, const float* scale = kNibbleScale) {
  float* out = prescale_buffer(count);
  for (int64_t i = 0; i < count; ++i) out[i] = x[i] * scale[i % 8];
  return out;
}
#endif

#if SHARDLM_HAVE_AVX2
// A nibble word v (quant j in bits 4j .. 4j+3) joined with its quants' high
// bits h, laid out so that h << (4 - shift) puts quant j's high bits at 4j + 4
// on (the 5-bit layouts: one bit, shift s; Q6Kx8: two bits, shift 2 (s % 2)).
// `even` holds the even quants' nibbles with their high bits just above, `odd`
// the odd quants', `top` quant 7 whole, shifted down (masked in place it would
// read as negative); top_mask is the high bits' mask at bit 4 (0x10, 0x30).
struct Joined256 {
  __m256i even, odd, top;
};

SHARDLM_AVX2 inline Joined256 join_avx2(__m256i v, __m256i h, int shift, int top_mask) {
  const __m256i up = _mm256_slli_epi32(h, 4 - shift), nibbles = _mm256_set1_epi32(0x0F0F0F0F);
  return {_mm256_or_si256(_mm256_and_si256(nibbles, v), _mm256_andnot_si256(nibbles, up)),
          _mm256_or_si256(_mm256_andnot_si256(nibbles, v), _mm256_and_si256(nibbles, up)),
          _mm256_or_si256(_mm256_srli_epi32(v, 28), _mm256_and_si256(_mm256_srli_epi32(h, 24 + shift),
                                                                     _mm256_set1_epi32(top_mask)))};
}

// Quant j (0..7) of a joined word in place, q * 2^4j (quant 7 shifted down);
// `field` masks a whole quant (0x1f: 5 bits, 0x3f: 6).
SHARDLM_AVX2 inline __m256i joined_quant_avx2(const Joined256& q, int j, int field) {
  if (j == 7) return q.top;
  return _mm256_and_si256(j % 2 ? q.odd : q.even, _mm256_set1_epi32(field << (4 * j)));
}

// Quant j of a joined word as the float32 subnormal it is once masked where
// it lies in the low 22 bits (subnormal.h): in place for j < 5, from the word
// shifted down by kSubnormalHighShift for 5 and 6 (at bits 0 and 4), quant 7
// from `top` as it is.
SHARDLM_AVX2 inline __m256 joined_subnormal_avx2(const Joined256& q, int j, int field) {
  if (j == 7) return _mm256_castsi256_ps(q.top);
  const __m256i word = j % 2 ? q.odd : q.even;
  return _mm256_castsi256_ps(
      j < 5 ? _mm256_and_si256(word, _mm256_set1_epi32(field << (4 * j)))
            : _mm256_and_si256(_mm256_srli_epi32(word, kSubnormalHighShift),
                               _mm256_set1_epi32(field << (4 * (j - 5)))));
}

// The values that nibble j (bits 4j..4j+3) of each lane of v indexes in a
// table of 16 (value_tables.h): two 8-entry permutes (each reads the index's
// low 3 bits) and a blend on its bit 3.
SHARDLM_AVX2 inline __m256 table_avx2(const float* values, __m256i v, int j) {
  const __m256i index = _mm256_srli_epi32(v, 4 * j);
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(values), index);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(values + 8), index);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28 - 4 * j)));
}

// table_avx2 on 16 lanes: one 16-entry permute reads the index's low 4 bits.
SHARDLM_AVX512 inline __m512 table_avx512(const float* values, __m512i v, int j) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * j), _mm512_loadu_ps(values));
}

// The values that the 3-bit index at bits 2j of each lane of v picks from a
// table of 8 entries repeated to 16 (value_tables.h): one 8-entry permute
// reads the index's 3 bits; the 16-entry one (AVX-512) also reads the bit
// above, which the repeated table makes moot.
SHARDLM_AVX2 inline __m256 table3_avx2(const float* values, __m256i v, int j) {
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(values), _mm256_srli_epi32(v, 2 * j));
}

SHARDLM_AVX512 inline __m512 table3_avx512(const float* values, __m512i v, int j) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 2 * j), _mm512_loadu_ps(values));
}

// The same on 16 rows, each join one ternary-logic op: 0xCA selects
// (a ? b : c), 0xF8 is a | (b & c).
struct Joined512 {
  __m512i even, odd, top;
};

SHARDLM_AVX512 inline Joined512 join_avx512(__m512i v, __m512i h, int shift, int top_mask) {
  const __m512i up = _mm512_slli_epi32(h, 4 - shift), nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  return {_mm512_ternarylogic_epi32(nibbles, v, up, 0xCA),
          _mm512_ternarylogic_epi32(nibbles, up, v, 0xCA),
          _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 28), _mm512_srli_epi32(h, 24 + shift),
                                    _mm512_set1_epi32(top_mask), 0xF8)};
}

SHARDLM_AVX512 inline __m512i joined_quant_avx512(const Joined512& q, int j, int field) {
  if (j == 7) return q.top;
  return _mm512_and_si512(j % 2 ? q.odd : q.even, _mm512_set1_epi32(field << (4 * j)));
}

SHARDLM_AVX512 inline __m512 joined_subnormal_avx512(const Joined512& q, int j, int field) {
  if (j == 7) return _mm512_castsi512_ps(q.top);
  const __m512i word = j % 2 ? q.odd : q.even;
  return _mm512_castsi512_ps(
      j < 5 ? _mm512_and_si512(word, _mm512_set1_epi32(field << (4 * j)))
            : _mm512_and_si512(_mm512_srli_epi32(word, kSubnormalHighShift),
                               _mm512_set1_epi32(field << (4 * (j - 5)))));
}

// A joined word's quants as bytes, the operands of int8 dot products
// (int8_linear.cpp): `even` holds quant 8s + 2i in byte i of each lane, `odd`
// quant 8s + 2i + 1; `bytes` masks a whole quant in every byte (0x1f1f1f1f:
// 5 bits, 0x3f3f3f3f: 6). An odd quant's high bits sit just above its nibble,
// in the next byte, so a shift by 4 brings both down; quant 7's lie past the
// word and come from `top`.
SHARDLM_AVX512 inline void joined_bytes_avx512(const Joined512& q, int bytes, __m512i& even,
                                               __m512i& odd) {
  const __m512i mask = _mm512_set1_epi32(bytes);
  even = _mm512_and_si512(q.even, mask);
  odd = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q.odd, 4), mask),
                        _mm512_slli_epi32(q.top, 24));
}

SHARDLM_AVX2 inline void joined_bytes_avx2(const Joined256& q, int bytes, __m256i& even,
                                           __m256i& odd) {
  const __m256i mask = _mm256_set1_epi32(bytes);
  even = _mm256_and_si256(q.even, mask);
  odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(q.odd, 4), mask),
                        _mm256_slli_epi32(q.top, 24));
}

// The look-ahead of a pair of groups read side by side (w: group g, w + next:
// g + 1; p: the line being read in g): kPrefetchBytes past p in both groups,
// except that past the end of g the first stream's look-ahead goes to the
// next pair's second group (g + 3), not to g + 1, which is being read already;
// the second stream's runs on into g + 2. Without that, every pair began with
// a cold stretch of g + 3 (a fifth slower streaming of 2048-wide weights).
SHARDLM_AVX2 inline void prefetch_pair(const uint8_t* w, const uint8_t* p, int64_t next) {
  const uint8_t* ahead = p + cpu::avx2::kPrefetchBytes;
  cpu::avx2::prefetch_line_l2(ahead >= w + next ? ahead + 2 * next : ahead);
  cpu::avx2::prefetch_line_l2(ahead + next);
}

// Every line of [begin, end) looked ahead, in one group (next == 0) or in a
// pair (prefetch_pair). The kernels pass each block's whole stretch of the
// group, its super-block's header included with its first block, so that the
// look-ahead misses no line of the stream.
SHARDLM_AVX2 inline void prefetch_span(const uint8_t* w, const uint8_t* begin, const uint8_t* end,
                                       int64_t next) {
  for (const uint8_t* p = begin; p < end; p += 64) {
    if (next) {
      prefetch_pair(w, p, next);
    } else {
      cpu::avx2::prefetch_ahead(p);
    }
  }
}

// 32 bytes at p (group g) in the low half, the same 32 bytes of group g + 1
// (`next` bytes on) in the high half.
SHARDLM_AVX512 inline __m512i load_pair(const uint8_t* p, int64_t next) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + next)), 1);
}

// The 8 float16 at p and the 8 at p + next as 16 floats.
SHARDLM_AVX512 inline __m512 halves_pair(const uint8_t* p, int64_t next) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + next)), 1));
}

SHARDLM_AVX2 inline void panel_to_rows_avx2(float* rows, const float* panel, int64_t k) {
  for (int64_t i = 0; i < k; i += 8) {  // k is a multiple of 32
    __m256 v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(panel + (i + j) * kGroupRows);
    cpu::avx2::transpose8(v);
    for (int r = 0; r < kGroupRows; ++r) _mm256_storeu_ps(rows + r * k + i, v[r]);
  }
}
#endif

// rows[r * k + i] = panel[8 i + r]: a panel back into 8 row-major rows.
inline void panel_to_rows(float* rows, const float* panel, int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) return panel_to_rows_avx2(rows, panel, k);
#endif
  (void)avx2;
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t r = 0; r < kGroupRows; ++r) rows[r * k + i] = panel[i * kGroupRows + r];
  }
}

// out[m, n] = x @ W^T (+ bias) for a weight of groups of `group_bytes` each.
// dot(acc, g, width, m0, rows) fills acc[i * width + l] with feature l of the
// `width` features from group g on (8, or 16 for a pair under AVX-512) for
// input rows m0 + i, i < rows (at most kRows, kMaxRows unless a kernel takes
// more); later input rows find the groups' weights in cache.
// `subnormal`: the kernels read quants as subnormals (subnormal.h), so each
// thread runs them with subnormal inputs honoured.
template <int64_t kRows = kMaxRows, typename T, class Dot>
void gemv(T* out, const T* bias, int64_t m, int64_t n, int64_t group_bytes, const Dot& dot,
          bool subnormal = false) {
  const int64_t groups = n / kGroupRows;
  const int64_t span = cpu::use_avx512() ? 2 : 1;  // an odd last group goes alone
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (span * group_bytes));
  at::parallel_for(0, (groups + span - 1) / span, grain, [&](int64_t begin, int64_t end) {
    const SubnormalInputs inputs(subnormal);
    float acc[kRows * 2 * kGroupRows];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t g = unit * span;
      const int64_t width = std::min(span, groups - g) * kGroupRows;
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int64_t rows = std::min(kRows, m - m0);
        dot(acc, g, width, m0, rows);
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t l = 0; l < width; ++l) {
            const int64_t j = g * kGroupRows + l;
            out[(m0 + i) * n + j] =
                from_f<T>(acc[i * width + l] + (bias != nullptr ? to_f(bias[j]) : 0.f));
          }
        }
      }
    }
  });
}

// Rows [n0, n1) (multiples of 8) as float32 into `dst` ([n1 - n0, K]): each
// group unpacked by unpack(panel, group, avx2) into a [K][8] panel, then
// turned back into rows.
template <class Unpack>
void dequantize_rows(float* dst, const uint8_t* w, int64_t n0, int64_t n1, int64_t k,
                     int64_t group_bytes, const Unpack& unpack) {
  const bool avx2 = cpu::use_avx2();
  at::parallel_for(n0 / kGroupRows, n1 / kGroupRows, 2, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> panel;
    if (static_cast<int64_t>(panel.size()) < k * kGroupRows) panel.resize(k * kGroupRows);
    for (int64_t g = begin; g < end; ++g) {
      unpack(panel.data(), w + g * group_bytes, avx2);
      panel_to_rows(dst + (g * kGroupRows - n0) * k, panel.data(), k, avx2);
    }
  });
}

}  // namespace shardlm::cpu::grouped
