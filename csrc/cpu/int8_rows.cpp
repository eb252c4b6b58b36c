// Rounding the input rows of the int8 fast mode (int8_linear.h): each block of
// 32 to int8 with its scale and sums, in the byte order the kernels read
// (position(), in the order the weight's kernels ask for). The AVX-512 and the
// scalar rounding give the same bytes.
#include "int8_linear.h"

// First, so that its silencing of GCC 12's AVX-512 header warnings applies (simd.h).
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_utils.h"
#include "quant_blocks.h"

namespace shardlm::cpu::int8 {
namespace {

using quant::kBlock;

// The scale both paths use: 127 / max|x| (0 for an all-zero block), so the
// scalar and the vector rounding give the same bytes.
inline float inverse_scale(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

void quantize_block_scalar(const float* x, int8_t* q, float* scale, float* sum32, float* sum16,
                           InputOrder order) {
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = inverse_scale(amax), dx = amax / 127.f;
  int32_t sums[2] = {0, 0};
  for (int64_t i = 0; i < kBlock; ++i) {
    const auto v = static_cast<int32_t>(std::nearbyint(x[i] * inv));  // to nearest even
    q[position(i, order)] = static_cast<int8_t>(v);
    sums[i / kHalf] += v;
  }
  *scale = dx;
  *sum32 = dx * static_cast<float>(sums[0] + sums[1]);
  sum16[0] = dx * static_cast<float>(sums[0]);
  sum16[1] = dx * static_cast<float>(sums[1]);
}

#if SHARDLM_HAVE_AVX2
SHARDLM_AVX512 void quantize_block_avx512(const float* x, int8_t* q, float* scale, float* sum32,
                                          float* sum16, InputOrder order) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(inverse_scale(amax));
  const float dx = amax / 127.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // to nearest even (MXCSR)
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
  // Natural order to Int8Rows' order (position()): the nibble order 8 bytes at
  // a time, 0 2 4 6 1 3 5 7; the two-bit one 16 at a time, a 4 x 4 transpose.
  const __m256i nibble = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0,
                                          2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m256i two_bit = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i bytes =
      _mm256_set_m128i(_mm512_cvtsepi32_epi8(qb), _mm512_cvtsepi32_epi8(qa));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_shuffle_epi8(bytes, order == InputOrder::kTwoBit ? two_bit : nibble));
  *scale = dx;
  *sum32 = dx * static_cast<float>(sa + sb);
  sum16[0] = dx * static_cast<float>(sa);
  sum16[1] = dx * static_cast<float>(sb);
}
#endif

}  // namespace

Int8Rows quantize_rows(const float* x, int64_t m, int64_t k, InputOrder order) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, sum32, sum16;
  const int64_t blocks = m * k / kBlock;
  if (static_cast<int64_t>(q.size()) < m * k) q.resize(m * k);
  if (static_cast<int64_t>(scale.size()) < blocks) {
    scale.resize(blocks);
    sum32.resize(blocks);
    sum16.resize(2 * blocks);
  }
  const bool avx512 = cpu::use_avx512();
  int8_t* qp = q.data();
  float *sp = scale.data(), *s32 = sum32.data(), *s16 = sum16.data();
  at::parallel_for(0, blocks, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
#if SHARDLM_HAVE_AVX2
      if (avx512) {
        quantize_block_avx512(x + b * kBlock, qp + b * kBlock, sp + b, s32 + b, s16 + 2 * b,
                              order);
        continue;
      }
#endif
      quantize_block_scalar(x + b * kBlock, qp + b * kBlock, sp + b, s32 + b, s16 + 2 * b, order);
    }
  });
  (void)avx512;
  return {qp, sp, s32, s16};
}

}  // namespace shardlm::cpu::int8
