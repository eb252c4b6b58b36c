// The scaled-order Q8_0 kernels (q8_0_scaled.h).
#include "q8_0_scaled.h"

#include <cstring>

#include "cpu_utils.h"
#include "quant_blocks.h"
#include "simd.h"

namespace shardlm::cpu::q8_0 {
namespace {

using quant::block_bytes;
using quant::kBlock;
using quant::kQ8_0;

bool fits_prefetch(int64_t row_bytes) {
  return kPassRows * row_bytes <= cpu::avx2::kPrefetchBytes;
}

#if SHARDLM_HAVE_AVX2
// The block at p as d * q: its 32 quants in two vectors of 16, each product exact.
SHARDLM_AVX512 inline void scaled_block(const uint8_t* p, __m512& lo, __m512& hi) {
  uint16_t half;
  std::memcpy(&half, p, sizeof half);
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(half));
  const auto* qs = reinterpret_cast<const __m128i*>(p + 2);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))), d);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))), d);
}

// Adds one scaled block times one input row's block xb to lo / hi.
SHARDLM_AVX512 inline void add_row(__m512& lo, __m512& hi, __m512 dq_lo, __m512 dq_hi,
                                   const float* xb) {
  lo = _mm512_fmadd_ps(dq_lo, _mm512_loadu_ps(xb), lo);
  hi = _mm512_fmadd_ps(dq_hi, _mm512_loadu_ps(xb + 16), hi);
}

// The accumulators of both kernels are sixteen named values, not arrays: GCC 12
// kept arrays of three rows or more on the stack and stored every one of them on
// every block, which cost more than the FMAs.
template <int kRows>
SHARDLM_AVX512 void rows_of(float* acc, const uint8_t* w, const float* x, int64_t x_stride,
                            int64_t k) {
  static_assert(kRows >= 1 && kRows <= 8);
  __m512 l0 = _mm512_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0, l6 = l0, l7 = l0;
  __m512 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0, h6 = l0, h7 = l0;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* block = w + b * block_bytes(kQ8_0);
    cpu::avx2::prefetch_ahead(block);
    __m512 dq_lo, dq_hi;
    scaled_block(block, dq_lo, dq_hi);
    const float* xb = x + b * kBlock;
    add_row(l0, h0, dq_lo, dq_hi, xb);
    if constexpr (kRows > 1) add_row(l1, h1, dq_lo, dq_hi, xb + x_stride);
    if constexpr (kRows > 2) add_row(l2, h2, dq_lo, dq_hi, xb + 2 * x_stride);
    if constexpr (kRows > 3) add_row(l3, h3, dq_lo, dq_hi, xb + 3 * x_stride);
    if constexpr (kRows > 4) add_row(l4, h4, dq_lo, dq_hi, xb + 4 * x_stride);
    if constexpr (kRows > 5) add_row(l5, h5, dq_lo, dq_hi, xb + 5 * x_stride);
    if constexpr (kRows > 6) add_row(l6, h6, dq_lo, dq_hi, xb + 6 * x_stride);
    if constexpr (kRows > 7) add_row(l7, h7, dq_lo, dq_hi, xb + 7 * x_stride);
  }
  const __m512 sums[8] = {_mm512_add_ps(l0, h0), _mm512_add_ps(l1, h1), _mm512_add_ps(l2, h2),
                          _mm512_add_ps(l3, h3), _mm512_add_ps(l4, h4), _mm512_add_ps(l5, h5),
                          _mm512_add_ps(l6, h6), _mm512_add_ps(l7, h7)};
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_reduce_add_ps(sums[r]);
}

// Eight weight rows against one input row, each summed as rows_of sums it: they
// share each block's input (loaded once) and the loop, since SmolLM2's rows are
// 18 blocks and a row's setup and reduction are a real share of it. The rows are
// one contiguous stretch read as eight short streams, too short for the hardware
// prefetcher to pick up, so the kernel asks for the same stretch kPrefetchBytes
// ahead at the pace it is read (scaled_order: the stretch fits that distance).
SHARDLM_AVX512 void weights_of(float* acc, const uint8_t* w, int64_t row_bytes, const float* x,
                               int64_t k) {
  __m512 l0 = _mm512_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0, l6 = l0, l7 = l0;
  __m512 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0, h6 = l0, h7 = l0;
  const char* ahead = reinterpret_cast<const char*>(w) + cpu::avx2::kPrefetchBytes;
  const int64_t pace = kPassRows * block_bytes(kQ8_0);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int64_t line = 0; line < pace; line += 64) {
      cpu::avx2::prefetch_line_l2(ahead + b * pace + line);
    }
    const __m512 x_lo = _mm512_loadu_ps(x + b * kBlock);
    const __m512 x_hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const uint8_t* wb = w + b * block_bytes(kQ8_0);
    __m512 dq_lo, dq_hi;
#define SHARDLM_Q8_0_ROW(i)                                 \
  scaled_block(wb + (i) * row_bytes, dq_lo, dq_hi);         \
  l##i = _mm512_fmadd_ps(dq_lo, x_lo, l##i);                \
  h##i = _mm512_fmadd_ps(dq_hi, x_hi, h##i);
    SHARDLM_Q8_0_ROW(0) SHARDLM_Q8_0_ROW(1) SHARDLM_Q8_0_ROW(2) SHARDLM_Q8_0_ROW(3)
    SHARDLM_Q8_0_ROW(4) SHARDLM_Q8_0_ROW(5) SHARDLM_Q8_0_ROW(6) SHARDLM_Q8_0_ROW(7)
#undef SHARDLM_Q8_0_ROW
  }
  const __m512 sums[8] = {_mm512_add_ps(l0, h0), _mm512_add_ps(l1, h1), _mm512_add_ps(l2, h2),
                          _mm512_add_ps(l3, h3), _mm512_add_ps(l4, h4), _mm512_add_ps(l5, h5),
                          _mm512_add_ps(l6, h6), _mm512_add_ps(l7, h7)};
  for (int r = 0; r < kPassRows; ++r) acc[r] = _mm512_reduce_add_ps(sums[r]);
}
#endif

}  // namespace

bool scaled_order(int64_t row_bytes) {
  return SHARDLM_HAVE_AVX2 && cpu::use_avx512() && fits_prefetch(row_bytes);
}

void rows_avx512(float* acc, const uint8_t* w, const float* x, int64_t x_stride, int64_t rows,
                 int64_t k) {
#if SHARDLM_HAVE_AVX2
  switch (rows) {
    case 1: return rows_of<1>(acc, w, x, x_stride, k);
    case 2: return rows_of<2>(acc, w, x, x_stride, k);
    case 3: return rows_of<3>(acc, w, x, x_stride, k);
    case 4: return rows_of<4>(acc, w, x, x_stride, k);
    case 5: return rows_of<5>(acc, w, x, x_stride, k);
    case 6: return rows_of<6>(acc, w, x, x_stride, k);
    case 7: return rows_of<7>(acc, w, x, x_stride, k);
    default: return rows_of<8>(acc, w, x, x_stride, k);
  }
#else
  (void)acc, (void)w, (void)x, (void)x_stride, (void)rows, (void)k;
#endif
}

void weights_avx512(float* acc, const uint8_t* w, int64_t row_bytes, const float* x, int64_t k) {
#if SHARDLM_HAVE_AVX2
  weights_of(acc, w, row_bytes, x, k);
#else
  (void)acc, (void)w, (void)row_bytes, (void)x, (void)k;
#endif
}

}  // namespace shardlm::cpu::q8_0
