// int8-activation kernels (int8_linear.h) for the nibble layouts
// (nibble_layouts.h: Q4x8, Q40x8, Q4Kx8, Q5x8, Q5Kx8, Q51x8) and the table
// layouts among them (IQ4x8, IQ4NLx8, IQ3XXSx8, IQ3Sx8): portable, AVX2 and
// AVX-512 VNNI, and the unpacking of a pair of groups for the many-rows path
// (int8_unpacked.h). Only int8_linear.cpp includes it; its opening comment
// has how the kernels compute.
#pragma once

#include <cstdint>

#include "grouped.h"
#include "int8_common.h"
#include "int8_halves.h"
#include "int8_linear.h"
#include "int8_unpacked.h"
#include "nibble_layouts.h"
#include "quant_blocks.h"
#include "simd.h"

namespace shardlm::cpu::int8::nibbles {

using grouped::kGroupRows;
using quant::kBlock;
namespace nib = q4x8::nibble;

// The table layouts (L::kTable: IQ4_XS, IQ4_NL, IQ3_XXS, IQ3_S) multiply their
// table's values as int8 (int8_common.h: Int8Table). Row r's quant e of block
// b as the kernels multiply it: the quant, or its table value times the
// table's factor.
template <class L>
int32_t int_quant(const uint8_t* w, int64_t b, int64_t r, int64_t e) {
  if constexpr (L::kTable) {
    const uint32_t word = nib::word_at(L::quants(w, b) + 4 * (8 * (e / 8) + r));
    const uint32_t index = (word >> (4 * (e % 8))) & 0x0f;
    return TableOf<L>::type::kBytes.values[index];
  } else {
    return static_cast<int32_t>(nib::quant_of<L>(w, b, r, e));
  }
}

// Block b's scale of row r as the kernels apply it (a table layout's divided
// by its table's factor).
template <class L>
float int_scale(const uint8_t* w, int64_t b, int64_t r) {
  return L::d(w, b, r) / kValueFactor<L>;
}

// Each kernel takes its layout as a tag (a value of the layout type), so that
// the per-half kernels (int8_halves.h) are overloads of the same names.
template <class L>
void rows_scalar(L, float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x, int64_t m0,
                 int64_t rows, int64_t k) {
  portable_rows(acc, stride, x, m0, rows, k / kBlock,
                [&](int64_t i, int64_t b, int64_t r, const int8_t* xq) {
    int32_t dot = 0;
    for (int64_t e = 0; e < kBlock; ++e) dot += int_quant<L>(w, b, r, e) * xq[position(e)];
    return int_scale<L>(w, b, r) * x.scale[i] * static_cast<float>(dot) +
           L::m(w, b, r) * x.sum32[i];
  });
}

#if SHARDLM_HAVE_AVX2
// Nibble word s of block b as even and odd quant bytes, 8 rows.
template <class L>
SHARDLM_AVX2 inline void nibble_bytes_avx2(const uint8_t* w, int64_t b, int s, __m256i& even,
                                           __m256i& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::quants(w, b) + 32 * s));
  if constexpr (L::kFive) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::highs(w, b)));
    return grouped::joined_bytes_avx2(grouped::join_avx2(v, h, s, 0x10), 0x1f1f1f1f, even, odd);
  }
  const __m256i mask = _mm256_set1_epi32(0x0f0f0f0f);
  even = _mm256_and_si256(v, mask);
  odd = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
}

// Step s of block b as the AVX2 kernels multiply it: its even and odd quant
// bytes, a table layout's looked up as its signed values.
template <class L>
SHARDLM_AVX2 inline void step_avx2(const uint8_t* w, int64_t b, int s, __m256i& even,
                                   __m256i& odd) {
  nibble_bytes_avx2<L>(w, b, s, even, odd);
  if constexpr (L::kTable) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(TableOf<L>::type::kBytes.values)));
    even = _mm256_shuffle_epi8(table, even);
    odd = _mm256_shuffle_epi8(table, odd);
  }
}

// Block b's d (a table layout's divided by its factor) and m, 8 rows.
template <class L>
SHARDLM_AVX2 inline void block_scales_avx2(const uint8_t* w, int64_t b, __m256& d, __m256& m) {
  nib::scales_avx2<L>(w, b, d, m);
  if constexpr (L::kTable) d = _mm256_mul_ps(d, _mm256_set1_ps(1.f / kValueFactor<L>));
}

template <int R, class L>
SHARDLM_AVX2 void rows_avx2(L, float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x,
                            int64_t m0, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m256 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b);
    __m256i dot[R][2];  // two chains (step_dot_avx2)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m256i even, odd;
      step_avx2<L>(w, b, s, even, odd);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        step_dot_avx2<L::kTable>(dot[r], even, odd, xq);
      }
    }
    __m256 d, m;
    block_scales_avx2<L>(w, b, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = scaled_block_avx2(sum[r], d, x.scale[i], dot[r]);
      off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum32[i]), off[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * stride, _mm256_add_ps(sum[r], off[r]));
}

// Nibble word s of block b of two groups (w and w + next; h: the block's high
// bits, 5-bit layouts) as even and odd quant bytes, 16 rows: a table layout's
// as its values + 128 (TableOf).
template <class L>
SHARDLM_AVX512_VNNI inline void step_pair_vnni(const uint8_t* w, int64_t next, int64_t b,
                                               __m512i h, int s, __m512i& even, __m512i& odd) {
  const __m512i v = grouped::load_pair(L::quants(w, b) + 32 * s, next);
  if constexpr (L::kFive) {
    grouped::joined_bytes_avx512(grouped::join_avx512(v, h, s, 0x10), 0x1f1f1f1f, even, odd);
  } else {
    const __m512i mask = _mm512_set1_epi32(0x0f0f0f0f);
    even = _mm512_and_si512(v, mask);
    odd = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
  }
  if constexpr (L::kTable) {
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(TableOf<L>::type::kBytes.biased)));
    even = _mm512_shuffle_epi8(table, even);
    odd = _mm512_shuffle_epi8(table, odd);
  }
}

// Block b's d and m of two groups, 16 rows (a table layout's d divided by its
// factor, and m the bias's share, -128 d: the sum of d dx (value + 128) xq
// less 128 d dx sum(xq)).
template <class L>
SHARDLM_AVX512_VNNI inline void scales_vnni(const uint8_t* w, int64_t next, int64_t b, __m512& d,
                                            __m512& m) {
  nib::scales_pair<L>(w, next, b, d, m);
  if constexpr (L::kTable) {
    d = _mm512_mul_ps(d, _mm512_set1_ps(1.f / TableOf<L>::type::kFactor));
    m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
  }
}

template <class L>
SHARDLM_AVX512_VNNI inline __m512i highs_vnni(const uint8_t* w, int64_t next, int64_t b) {
  return L::kFive ? grouped::load_pair(L::highs(w, b), next) : _mm512_setzero_si512();
}

// Two groups (w and w + next) at once, 16 rows a vector: acc[16 r + l]. Every
// loop over the rows is unrolled: where one indexes sum, off or dot by a loop
// variable, GCC keeps the whole array on the stack, a store and a reload per
// block on each chain (so also in the per-half kernel, int8_halves.h).
template <int R, class L>
SHARDLM_AVX512_VNNI void pair_vnni(L, float* acc, const uint8_t* w, int64_t next,
                                   const Int8Rows& x, int64_t m0, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m512 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b, next);
    const __m512i h = highs_vnni<L>(w, next, b);
    __m512i dot[R][2];  // even and odd quants: two chains
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int s = 0; s < 4; ++s) {
      __m512i even, odd;
      step_pair_vnni<L>(w, next, b, h, s, even, odd);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], even, _mm512_set1_epi32(input_word(xq)));
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], odd, _mm512_set1_epi32(input_word(xq + 4)));
      }
    }
    __m512 d, m;
    scales_vnni<L>(w, next, b, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[i])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1])), sum[r]);
      off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum32[i]), off[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(sum[r], off[r]));
}

// A nibble layout's pair unpacked for the many-rows path (int8_unpacked.h), as
// pair_vnni unpacks it.
template <class L>
SHARDLM_AVX512_VNNI void unpack_pair(L, unpacked::Block* u, const uint8_t* w, int64_t next,
                                     int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b, next);
    const __m512i h = highs_vnni<L>(w, next, b);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512i even, odd;
      step_pair_vnni<L>(w, next, b, h, s, even, odd);
      unpacked::store(u[b].bytes[2 * s], even);
      unpacked::store(u[b].bytes[2 * s + 1], odd);
    }
    __m512 d, m;
    scales_vnni<L>(w, next, b, d, m);
    unpacked::store(u[b].scale[0], d);
    unpacked::store(u[b].offset[0], m);
  }
}

// A nibble layout's `groups` groups (w, and w + next) unpacked for the AVX2
// many-rows path (int8_unpacked.h's rows_avx2), as rows_avx2 above unpacks
// them (step_avx2, block_scales_avx2).
template <class L>
SHARDLM_AVX2 void unpack_avx2(L, unpacked::Block* u, const uint8_t* w, int64_t next, int groups,
                              int64_t blocks) {
  for (int g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * next;
    for (int64_t b = 0; b < blocks; ++b) {
      nib::prefetch_block<L>(wg, b);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m256i even, odd;
        step_avx2<L>(wg, b, s, even, odd);
        unpacked::store(u[b].bytes[2 * s] + 32 * g, even);
        unpacked::store(u[b].bytes[2 * s + 1] + 32 * g, odd);
      }
      __m256 d, m;
      block_scales_avx2<L>(wg, b, d, m);
      unpacked::store(u[b].scale[0] + 8 * g, d);
      unpacked::store(u[b].offset[0] + 8 * g, m);
    }
  }
}

#endif

}  // namespace shardlm::cpu::int8::nibbles
