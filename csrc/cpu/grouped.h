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

namespace shardlm::cpu::grouped {

using quant::kGroupRows;

// The most input rows one pass of a matrix-vector kernel takes: each unpacked
// vector of quants feeds that many input rows.
constexpr int64_t kMaxRows = 4;

// 2^-4j, the factor that undoes nibble j's place in its 32-bit lane when the
// kernels mask it in place (1 for the top one, which they shift down instead).
constexpr float kNibbleScale[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f,
                                   0x1p-24f, 1.f};

#if SHARDLM_HAVE_AVX2
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
// input rows m0 + i, i < rows (at most kMaxRows); later input rows find the
// groups' weights in cache.
template <typename T, class Dot>
void gemv(T* out, const T* bias, int64_t m, int64_t n, int64_t group_bytes, const Dot& dot) {
  const int64_t groups = n / kGroupRows;
  const int64_t span = cpu::use_avx512() ? 2 : 1;  // an odd last group goes alone
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (span * group_bytes));
  at::parallel_for(0, (groups + span - 1) / span, grain, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * 2 * kGroupRows];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t g = unit * span;
      const int64_t width = std::min(span, groups - g) * kGroupRows;
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - m0);
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
