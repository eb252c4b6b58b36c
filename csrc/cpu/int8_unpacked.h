// The int8 kernels' path for many input rows (a prefill, a large batch): a
// pair of groups (16 rows; on AVX2 one or two groups of 8) is unpacked once
// into a thread's buffer, each block's 8 steps of quant bytes with its scales
// and offsets, and every pass of input rows reads that buffer instead of unpacking the block
// again. The direct kernels (int8_linear.cpp, int8_halves.h) unpack every
// block once per pass of 4 or 6 rows, which for the 3-bit, 2-bit and table
// layouts costs as much as their dot products. The sums here are the direct
// kernels' float operations in the same order on the same integer dot
// products, so a row's result does not depend on which path took it.
#pragma once

#include <cstdint>
#include <vector>

#include "int8_halves.h"
#include "int8_linear.h"
#include "simd.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::int8::unpacked {

// One block of a pair of groups: step k's quant bytes meet the input's word k;
// a per-half layout has a scale and an offset per half, a per-block one
// (the nibble layouts) its d in scale[0] and its m in offset[0]. Plain
// arrays, read and written unaligned: the buffer's vector promises no more
// than 16-byte alignment.
struct Block {
  uint8_t bytes[8][64];
  float scale[2][16], offset[2][16];
  // The AVX2 per-half kernels' integer scales (int8_halves.h's
  // half_multipliers_avx2), group g's at multipliers[h][16 g]; their d in
  // scale[0].
  int16_t multipliers[2][32];
};

SHARDLM_AVX512 inline __m512i load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
SHARDLM_AVX512 inline void store(uint8_t* p, __m512i v) { _mm512_storeu_si512(p, v); }
SHARDLM_AVX512 inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// A thread's buffer of one pair's blocks, grown to the largest K seen.
inline Block* buffer(int64_t blocks) {
  thread_local std::vector<Block> blocks_of_pair;
  if (static_cast<int64_t>(blocks_of_pair.size()) < blocks) blocks_of_pair.resize(blocks);
  return blocks_of_pair.data();
}

// R input rows from m0 against a pair's unpacked blocks: acc[16 r + l]. kPerHalf
// follows int8_halves.h's pair_vnni (a dot product per half, each scaled with
// its offset against the half's input sum), otherwise int8_linear.cpp's
// (even and odd chains added, scaled once, the offset against the block's sum).
template <int R, bool kPerHalf>
SHARDLM_AVX512_VNNI void rows_vnni(float* acc, const Block* u, int64_t blocks, const Int8Rows& x,
                                   int64_t m0) {
  __m512 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * quant::kBlock + 8 * s;
        const __m512i first = _mm512_set1_epi32(input_word(xq));
        const __m512i second = _mm512_set1_epi32(input_word(xq + 4));
        if constexpr (kPerHalf) {
          __m512i& chain = dot[r][s / 2];
          chain = _mm512_dpbusd_epi32(chain, load_bytes(u[b].bytes[2 * s]), first);
          chain = _mm512_dpbusd_epi32(chain, load_bytes(u[b].bytes[2 * s + 1]), second);
        } else {
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], load_bytes(u[b].bytes[2 * s]), first);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], load_bytes(u[b].bytes[2 * s + 1]), second);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      if constexpr (kPerHalf) {
        for (int h = 0; h < 2; ++h) {
          sum[r] = _mm512_fmadd_ps(
              _mm512_mul_ps(_mm512_loadu_ps(u[b].scale[h]), _mm512_set1_ps(x.scale[i])),
              _mm512_cvtepi32_ps(dot[r][h]), sum[r]);
          off[r] = _mm512_fmadd_ps(_mm512_loadu_ps(u[b].offset[h]),
                                   _mm512_set1_ps(-x.sum16[2 * i + h]), off[r]);
        }
      } else {
        sum[r] = _mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_loadu_ps(u[b].scale[0]), _mm512_set1_ps(x.scale[i])),
            _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1])), sum[r]);
        off[r] = _mm512_fmadd_ps(_mm512_loadu_ps(u[b].offset[0]), _mm512_set1_ps(x.sum32[i]),
                                 off[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(sum[r], off[r]));
}

// A per-half layout's pair (w and w + next) unpacked into u, as pair_vnni
// unpacks it.
template <class P>
SHARDLM_AVX512_VNNI void unpack_halves(Block* u, const uint8_t* w, int64_t next, int64_t blocks) {
  namespace q6 = q6kx8::layout;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = q6::words_of<P>(w, b);
    grouped::prefetch_span(w, q6::stream_begin<P>(w, b), q + P::kBlockBytes, next);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512i first, second;
      halves::step_pair_avx512<P>(q, next, s, first, second);
      store(u[b].bytes[2 * s], first);
      store(u[b].bytes[2 * s + 1], second);
    }
    const uint8_t* sp = q6::super_of<P>(w, b);
    for (int h = 0; h < 2; ++h) {
      __m512 scale, offset;
      halves::half_scales_avx512<P>(sp, next, b, h, scale, offset);
      store(u[b].scale[h], scale);
      store(u[b].offset[h], offset);
    }
  }
}

SHARDLM_AVX2 inline __m256i load_bytes256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
SHARDLM_AVX2 inline void store(uint8_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}
SHARDLM_AVX2 inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// The AVX2 kernels' path for many rows (without VNNI, or an odd last group
// beside VNNI's pairs): group g (0 or 1) of the unpacked blocks, its 8 rows'
// bytes at bytes[k][32 g], against R input rows from m0: acc[r * stride + l].
// The operations and their order are the direct kernels' (rows_avx2 in
// int8_nibbles.h and int8_halves.h): a table layout's bytes are its signed
// values; a per-half layout's halves make one integer sum, each pair of
// products times its half's multiplier, scaled once by d, with its halves'
// offsets (kOffsets) taken off apart.
template <int R, bool kPerHalf, bool kTable, bool kOffsets>
SHARDLM_AVX2 void rows_avx2(float* acc, int64_t stride, const Block* u, int g, int64_t blocks,
                            const Int8Rows& x, int64_t m0) {
  __m256 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[R][2];  // two chains, as the direct kernels
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i first = load_bytes256(u[b].bytes[2 * s] + 32 * g);
      const __m256i second = load_bytes256(u[b].bytes[2 * s + 1] + 32 * g);
      const __m256i multipliers =
          kPerHalf ? load_bytes256(reinterpret_cast<const uint8_t*>(u[b].multipliers[s / 2] +
                                                                    16 * g))
                   : _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * quant::kBlock + 8 * s;
        if constexpr (kPerHalf) {
          halves::scaled_step_dot<kTable>(dot[r], first, second, xq, multipliers);
        } else {
          step_dot_avx2<kTable>(dot[r], first, second, xq);
        }
      }
    }
    const __m256 d = _mm256_loadu_ps(u[b].scale[0] + 8 * g);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = scaled_block_avx2(sum[r], d, x.scale[i], dot[r]);
      if constexpr (kPerHalf && kOffsets) {
        for (int h = 0; h < 2; ++h) {
          off[r] = _mm256_fmadd_ps(_mm256_loadu_ps(u[b].offset[h] + 8 * g),
                                   _mm256_set1_ps(-x.sum16[2 * i + h]), off[r]);
        }
      } else if constexpr (!kPerHalf) {
        off[r] = _mm256_fmadd_ps(_mm256_loadu_ps(u[b].offset[0] + 8 * g),
                                 _mm256_set1_ps(x.sum32[i]), off[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * stride, _mm256_add_ps(sum[r], off[r]));
}

// A per-half layout's `groups` groups (w, and w + next) unpacked into u for
// rows_avx2, as the direct AVX2 kernel unpacks them.
template <class P>
SHARDLM_AVX2 void unpack_halves_avx2(Block* u, const uint8_t* w, int64_t next, int groups,
                                     int64_t blocks) {
  namespace q6 = q6kx8::layout;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * next;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* q = q6::words_of<P>(wg, b);
      grouped::prefetch_span(wg, q6::stream_begin<P>(wg, b), q + P::kBlockBytes, 0);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m256i first, second;
        halves::step_pair_avx2<P>(q, s, first, second);
        store(u[b].bytes[2 * s] + 32 * g, first);
        store(u[b].bytes[2 * s + 1] + 32 * g, second);
      }
      const uint8_t* sp = q6::super_of<P>(wg, b);
      __m256 d, offset[2];
      halves::block_scales_avx2<P>(sp, b, d, offset);
      store(u[b].scale[0] + 8 * g, d);
      for (int h = 0; h < 2; ++h) {
        store(reinterpret_cast<uint8_t*>(u[b].multipliers[h] + 16 * g),
              halves::half_multipliers_avx2<P>(sp, b, h));
        if constexpr (halves::kHasOffset<P>) store(u[b].offset[h] + 8 * g, offset[h]);
      }
    }
  }
}

}  // namespace shardlm::cpu::int8::unpacked

namespace shardlm::cpu::int8::halves {
// The many-rows path's unpacking of a per-half layout's pair (an overload
// beside the nibble layouts', int8_nibbles.h).
template <class P>
void unpack_pair(Layout<P>, unpacked::Block* u, const uint8_t* w, int64_t next, int64_t blocks) {
  unpacked::unpack_halves<P>(u, w, next, blocks);
}
template <class P>
void unpack_avx2(Layout<P>, unpacked::Block* u, const uint8_t* w, int64_t next, int groups,
                 int64_t blocks) {
  unpacked::unpack_halves_avx2<P>(u, w, next, groups, blocks);
}
}  // namespace shardlm::cpu::int8::halves
#endif
