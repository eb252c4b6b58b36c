// The one-row matrix-vector kernels (block_gemv.h). Each block is unpacked to
// floats in registers and multiplied with the float32 input, accumulating in
// float32; a block contributes d * sum_i(q_i x_i) + m * sum_i(x_i), with x's
// block sums computed once per call (Activations::xs).
#include "block_gemv.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_utils.h"
#include "q8_0_scaled.h"
#include "quant_blocks.h"

namespace shardlm::cpu::block_gemv {
namespace {

using cpu::from_f;
using cpu::to_f;
using namespace cpu::quant;

// Input rows per pass over a weight row; more rows than this take passes. With
// AVX-512's 32 registers the two accumulator sets of row_avx512 fit 8 rows, so
// 5 to 8 rows (a decode batch, a step verifying drafts against the output head)
// convert each block once instead of twice.
constexpr int64_t kRowGroup = 4;
constexpr int64_t kRowGroupAvx512 = 8;

// ---- portable ---------------------------------------------------------------------

// acc[r] = dot(W row, input row m0 + r) for r < rows.
template <int64_t kType>
void row_scalar(float* acc, const uint8_t* w, const Activations& a, int64_t m0, int64_t rows,
                int64_t k) {
  const int64_t blocks = k / kBlock;
  const int64_t bytes = block_bytes(kType);
  float q[kBlock];
  for (int64_t r = 0; r < rows; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const Block blk = block_at<kType>(w + b * bytes);
    quants_scalar<kType>(blk, q);
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = a.x + (m0 + r) * k + b * kBlock;
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < kBlock; i += 8) {
        for (int j = 0; j < 8; ++j) part[j] += q[i + j] * x[i + j];
      }
      float s = 0.f;
      for (float p : part) s += p;
      acc[r] += blk.d * s + blk.m * a.xs[(m0 + r) * blocks + b];
    }
  }
}

#if SHARDLM_HAVE_AVX2
// ---- AVX2: a block is four vectors of 8 quants --------------------------------------

template <int64_t kType>
SHARDLM_AVX2 inline void quants_avx2(const uint8_t* qs, __m256 q[4]) {
  if constexpr (kType == kQ8_0) {
    // Eight quants per 64-bit load: the widening takes its operand from memory.
    for (int g = 0; g < 4; ++g) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g));
      q[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    }
  } else {
    // Without shuffles: lane l of group g takes nibble l of bytes 4g..4g+3, so
    // the quants come in nibble order (byte 4g's low and high nibble, byte
    // 4g+1's, ...) and are multiplied with the input in that order
    // (Activations::nibble_x).
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int g = 0; g < 4; ++g) {
      int32_t word;
      std::memcpy(&word, qs + 4 * g, sizeof word);
      const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
      q[g] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    }
  }
}

// block_at with the float16 scale and offset widened together by one F16C
// conversion, not in software.
template <int64_t kType>
SHARDLM_AVX2 inline Block block_f16c(const uint8_t* p) {
  int32_t header;
  std::memcpy(&header, p, sizeof header);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(header));
  const float d = _mm_cvtss_f32(dm);
  if constexpr (kType == kQ4_0) return {d, -8.f * d, p + 2};
  if constexpr (kType == kQ4_1) return {d, _mm_cvtss_f32(_mm_movehdup_ps(dm)), p + 4};
  return {d, 0.f, p + 2};  // kQ8_0
}

// One block unpacked for every input row of a pass (block_row_avx2).
struct BlockAvx2 {
  __m256 q[4];
  __m256 d;
  float m;
};

template <int64_t kType>
SHARDLM_AVX2 inline BlockAvx2 unpack_block_avx2(const uint8_t* w, int64_t b) {
  const Block blk = block_f16c<kType>(w + b * block_bytes(kType));
  BlockAvx2 out;
  quants_avx2<kType>(blk.qs, out.q);
  out.d = _mm256_set1_ps(blk.d);
  out.m = blk.m;
  return out;
}

// Adds the block's products with one input row's block x (and, but for Q8_0,
// whose m is 0, the offset times that block's input sum xs[i]) to vacc / macc.
template <int64_t kType>
SHARDLM_AVX2 inline void block_row_avx2(const BlockAvx2& blk, const float* x, const float* xs,
                                        int64_t i, __m256& vacc, float& macc) {
  using namespace cpu::avx2;
  const __m256 t01 = _mm256_fmadd_ps(blk.q[1], load8(x + 8), _mm256_mul_ps(blk.q[0], load8(x)));
  const __m256 t23 =
      _mm256_fmadd_ps(blk.q[3], load8(x + 24), _mm256_mul_ps(blk.q[2], load8(x + 16)));
  vacc = _mm256_fmadd_ps(blk.d, _mm256_add_ps(t01, t23), vacc);
  if constexpr (kType != kQ8_0) macc += blk.m * xs[i];
}

// Every input row alternates two sets of accumulators between even and odd
// blocks, so consecutive blocks do not wait on one FMA chain. The sets are kept
// for 3 and 4 rows too (8 accumulators, 4 quants, the scale and two partial sums
// still fit AVX2's 16 registers): a row's sums then run in one order however
// many rows the call has, so a sequence decoded alone or in a batch gets the
// same bits. The accumulators are named values, not arrays: GCC 12 kept arrays
// of two rows or more on the stack and stored every one of them on every block.
template <int64_t kType, int kRows>
SHARDLM_AVX2 void row_avx2(float* acc, const uint8_t* w, const Activations& a, int64_t m0,
                           int64_t k) {
  static_assert(kRows >= 1 && kRows <= 4);
  const int64_t blocks = k / kBlock;
  const float* xbase = (kType == kQ8_0 ? a.x : a.nibble_x) + m0 * k;
  const float* xs = kType == kQ8_0 ? nullptr : a.xs + m0 * blocks;
  __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;  // even blocks
  __m256 o0 = e0, o1 = e0, o2 = e0, o3 = e0;                    // odd blocks
  float me0 = 0.f, me1 = 0.f, me2 = 0.f, me3 = 0.f, mo0 = 0.f, mo1 = 0.f, mo2 = 0.f, mo3 = 0.f;
  // Block b into the set (v*, m*) for every row.
#define SHARDLM_BLOCK_ROWS(v, m, b)                                                          \
  {                                                                                          \
    const BlockAvx2 blk = unpack_block_avx2<kType>(w, b);                                    \
    const float* xb = xbase + (b) * kBlock;                                                  \
    block_row_avx2<kType>(blk, xb, xs, b, v##0, m##0);                                       \
    if constexpr (kRows > 1) block_row_avx2<kType>(blk, xb + k, xs, blocks + (b), v##1, m##1); \
    if constexpr (kRows > 2) {                                                               \
      block_row_avx2<kType>(blk, xb + 2 * k, xs, 2 * blocks + (b), v##2, m##2);              \
    }                                                                                        \
    if constexpr (kRows > 3) {                                                               \
      block_row_avx2<kType>(blk, xb + 3 * k, xs, 3 * blocks + (b), v##3, m##3);              \
    }                                                                                        \
  }
  int64_t b = 0;
  const int64_t bytes = block_bytes(kType);
  for (; b + 2 <= blocks; b += 2) {
    cpu::avx2::prefetch_ahead(w + b * bytes);  // two blocks: about a line
    SHARDLM_BLOCK_ROWS(e, me, b)
    SHARDLM_BLOCK_ROWS(o, mo, b + 1)
  }
  if (b < blocks) SHARDLM_BLOCK_ROWS(e, me, b)
#undef SHARDLM_BLOCK_ROWS
  const __m256 v[4] = {_mm256_add_ps(e0, o0), _mm256_add_ps(e1, o1), _mm256_add_ps(e2, o2),
                       _mm256_add_ps(e3, o3)};
  const float m[4] = {me0 + mo0, me1 + mo1, me2 + mo2, me3 + mo3};
  for (int r = 0; r < kRows; ++r) acc[r] = cpu::avx2::hsum(v[r]) + m[r];
}

// ---- AVX-512F: a block is two vectors of 16 quants -----------------------------------

template <int64_t kType>
SHARDLM_AVX512 inline void quants_avx512(const uint8_t* qs, __m512 q[2]) {
  if constexpr (kType == kQ8_0) {
    q[0] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    q[1] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  }
}

template <int64_t kType, int kRows>
SHARDLM_AVX512 inline void block_avx512(__m512* vacc, float* macc, const uint8_t* w,
                                        const Activations& a, int64_t m0, int64_t b, int64_t k) {
  const Block blk = block_f16c<kType>(w + b * block_bytes(kType));
  __m512 q[2];
  quants_avx512<kType>(blk.qs, q);
  const __m512 d = _mm512_set1_ps(blk.d);
  [[maybe_unused]] const int64_t blocks = k / kBlock;
  for (int r = 0; r < kRows; ++r) {
    const float* x = a.x + (m0 + r) * k + b * kBlock;
    const __m512 t = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16),
                                     _mm512_mul_ps(q[0], _mm512_loadu_ps(x)));
    vacc[r] = _mm512_fmadd_ps(d, t, vacc[r]);
    if constexpr (kType != kQ8_0) macc[r] += blk.m * a.xs[(m0 + r) * blocks + b];
  }
}

// As row_avx2, with 32 registers: two accumulator sets for any number of rows.
template <int64_t kType, int kRows>
SHARDLM_AVX512 void row_avx512(float* acc, const uint8_t* w, const Activations& a, int64_t m0,
                               int64_t k) {
  const int64_t blocks = k / kBlock;
  __m512 vacc[2][kRows];
  float macc[2][kRows];
  for (int s = 0; s < 2; ++s) {
    for (int r = 0; r < kRows; ++r) {
      vacc[s][r] = _mm512_setzero_ps();
      macc[s][r] = 0.f;
    }
  }
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    block_avx512<kType, kRows>(vacc[0], macc[0], w, a, m0, b, k);
    block_avx512<kType, kRows>(vacc[1], macc[1], w, a, m0, b + 1, k);
  }
  if (b < blocks) block_avx512<kType, kRows>(vacc[0], macc[0], w, a, m0, b, k);
  for (int r = 0; r < kRows; ++r) {
    acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(vacc[0][r], vacc[1][r])) + macc[0][r] +
             macc[1][r];
  }
}

// Q8_0 against one input row (decode), for the matrices that keep this file's order
// (q8_0_scaled.h takes the others): four weight rows at a time share each block's input
// loads and loop, and skip the offset term (Q8_0 has none). Each row's sums run in the order
// of row_avx512 (two sets, even and odd blocks), so a row's result does not depend on how many
// input rows the call has.
// Block b of one Q8_0 row against x's block b, added to acc. The accumulators of
// q8_0_rows4_avx512 are eight named values, not an array handed between functions:
// GCC kept such an array on the stack, so every block's sum went through a store and
// a reload (a store-forwarding wait on each chain); as values they stay in registers.
SHARDLM_AVX512 inline __m512 q8_0_block_avx512(__m512 acc, const uint8_t* row, const float* x,
                                               int64_t b) {
  const Block blk = block_f16c<kQ8_0>(row + b * block_bytes(kQ8_0));
  __m512 q[2];
  quants_avx512<kQ8_0>(blk.qs, q);
  const __m512 t = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + b * kBlock + 16),
                                   _mm512_mul_ps(q[0], _mm512_loadu_ps(x + b * kBlock)));
  return _mm512_fmadd_ps(_mm512_set1_ps(blk.d), t, acc);
}

SHARDLM_AVX512 void q8_0_rows4_avx512(float acc[4], const uint8_t* w, int64_t row_bytes,
                                      const float* x, int64_t k) {
  const int64_t blocks = k / kBlock;
  const uint8_t* w0 = w;
  const uint8_t* w1 = w + row_bytes;
  const uint8_t* w2 = w + 2 * row_bytes;
  const uint8_t* w3 = w + 3 * row_bytes;
  // Even blocks into e*, odd ones into o*, per row: row_avx512's two sets.
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  // The four rows are one contiguous stretch read as four short streams, too short for the
  // hardware prefetcher to pick up; so ask for the same stretch kPrefetchBytes ahead, at the
  // pace it is read (4 blocks of 34 bytes per block index).
  const char* ahead = reinterpret_cast<const char*>(w) + cpu::avx2::kPrefetchBytes;
  const int64_t pace = 4 * block_bytes(kQ8_0);
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    for (int64_t line = 0; line < 2 * pace; line += 64) {
      cpu::avx2::prefetch_line_l2(ahead + b * pace + line);
    }
    e0 = q8_0_block_avx512(e0, w0, x, b);
    e1 = q8_0_block_avx512(e1, w1, x, b);
    e2 = q8_0_block_avx512(e2, w2, x, b);
    e3 = q8_0_block_avx512(e3, w3, x, b);
    o0 = q8_0_block_avx512(o0, w0, x, b + 1);
    o1 = q8_0_block_avx512(o1, w1, x, b + 1);
    o2 = q8_0_block_avx512(o2, w2, x, b + 1);
    o3 = q8_0_block_avx512(o3, w3, x, b + 1);
  }
  if (b < blocks) {
    e0 = q8_0_block_avx512(e0, w0, x, b);
    e1 = q8_0_block_avx512(e1, w1, x, b);
    e2 = q8_0_block_avx512(e2, w2, x, b);
    e3 = q8_0_block_avx512(e3, w3, x, b);
  }
  acc[0] = _mm512_reduce_add_ps(_mm512_add_ps(e0, o0));
  acc[1] = _mm512_reduce_add_ps(_mm512_add_ps(e1, o1));
  acc[2] = _mm512_reduce_add_ps(_mm512_add_ps(e2, o2));
  acc[3] = _mm512_reduce_add_ps(_mm512_add_ps(e3, o3));
}
#endif

// acc[0..rows) for input rows m0.. on the path this process takes; `scaled`: the matrix
// takes q8_0_scaled.h's order (decided once per call, gemv_typed).
template <int64_t kType>
void row_dot(float* acc, const uint8_t* w, const Activations& a, int64_t m0, int64_t rows,
             int64_t k, bool scaled) {
#if SHARDLM_HAVE_AVX2
  if constexpr (kType == kQ8_0) {
    if (scaled) return q8_0::rows_avx512(acc, w, a.x + m0 * k, k, rows, k);
  }
  if (cpu::use_avx512()) {
    switch (rows) {
      case 1: return row_avx512<kType, 1>(acc, w, a, m0, k);
      case 2: return row_avx512<kType, 2>(acc, w, a, m0, k);
      case 3: return row_avx512<kType, 3>(acc, w, a, m0, k);
      case 4: return row_avx512<kType, 4>(acc, w, a, m0, k);
      case 5: return row_avx512<kType, 5>(acc, w, a, m0, k);
      case 6: return row_avx512<kType, 6>(acc, w, a, m0, k);
      case 7: return row_avx512<kType, 7>(acc, w, a, m0, k);
      default: return row_avx512<kType, 8>(acc, w, a, m0, k);
    }
  }
  if (cpu::use_avx2()) {
    switch (rows) {
      case 1: return row_avx2<kType, 1>(acc, w, a, m0, k);
      case 2: return row_avx2<kType, 2>(acc, w, a, m0, k);
      case 3: return row_avx2<kType, 3>(acc, w, a, m0, k);
      default: return row_avx2<kType, 4>(acc, w, a, m0, k);
    }
  }
#else
  (void)scaled;
#endif
  row_scalar<kType>(acc, w, a, m0, rows, k);
}

template <int64_t kType, typename T>
void gemv_typed(T* out, const uint8_t* w, const Activations& a, const T* bias, int64_t m,
                int64_t n, int64_t k) {
  const int64_t row_bytes = k / kBlock * block_bytes(kType);
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
  const int64_t pass = cpu::use_avx512() ? kRowGroupAvx512 : kRowGroup;
  const bool scaled = kType == kQ8_0 && q8_0::scaled_order(row_bytes);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float acc[kRowGroupAvx512];
#if SHARDLM_HAVE_AVX2
    if constexpr (kType == kQ8_0) {
      if (m == 1 && cpu::use_avx512()) {
        const int64_t weight_rows = scaled ? q8_0::kPassRows : 4;
        for (; begin + weight_rows <= end; begin += weight_rows) {
          if (scaled) {
            q8_0::weights_avx512(acc, w + begin * row_bytes, row_bytes, a.x, k);
          } else {
            q8_0_rows4_avx512(acc, w + begin * row_bytes, row_bytes, a.x, k);
          }
          for (int64_t r = 0; r < weight_rows; ++r) {
            const float b = bias != nullptr ? to_f(bias[begin + r]) : 0.f;
            out[begin + r] = from_f<T>(acc[r] + b);
          }
        }
      }
    }
#endif
    for (int64_t j = begin; j < end; ++j) {
      const float b = bias != nullptr ? to_f(bias[j]) : 0.f;
      for (int64_t m0 = 0; m0 < m; m0 += pass) {
        const int64_t rows = std::min(pass, m - m0);
        row_dot<kType>(acc, w + j * row_bytes, a, m0, rows, k, scaled);
        for (int64_t r = 0; r < rows; ++r) out[(m0 + r) * n + j] = from_f<T>(acc[r] + b);
      }
    }
  });
}

}  // namespace

bool nibble_order(int64_t qtype) {
  return (qtype == kQ4_0 || qtype == kQ4_1) && cpu::use_avx2() && !cpu::use_avx512();
}

// Per block, lane l of group g (8 lanes) holds weight 4g + l / 2 + 16 (l % 2).
const float* to_nibble_order(const float* x, int64_t count) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  for (int64_t base = 0; base < count; base += kBlock) {
    for (int64_t lane = 0; lane < kBlock; ++lane) {
      const int64_t g = lane / 8, l = lane % 8;
      buffer[base + lane] = x[base + 4 * g + l / 2 + 16 * (l % 2)];
    }
  }
  return buffer.data();
}

template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const Activations& a, const T* bias,
          int64_t m, int64_t n, int64_t k) {
  switch (qtype) {
    case kQ4_0: return gemv_typed<kQ4_0>(out, w, a, bias, m, n, k);
    case kQ4_1: return gemv_typed<kQ4_1>(out, w, a, bias, m, n, k);
    default: return gemv_typed<kQ8_0>(out, w, a, bias, m, n, k);
  }
}

template void gemv<float>(float*, int64_t, const uint8_t*, const Activations&, const float*,
                          int64_t, int64_t, int64_t);
template void gemv<c10::BFloat16>(c10::BFloat16*, int64_t, const uint8_t*, const Activations&,
                                  const c10::BFloat16*, int64_t, int64_t, int64_t);
template void gemv<c10::Half>(c10::Half*, int64_t, const uint8_t*, const Activations&,
                              const c10::Half*, int64_t, int64_t, int64_t);

}  // namespace shardlm::cpu::block_gemv
