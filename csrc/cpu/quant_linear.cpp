// CPU: quant_linear, out[M, N] = input[M, K] @ W[N, K]^T (+ bias) with W kept
// in GGML blocks (quant_blocks.h), never expanded to a dense copy.
//
// Decode (a few input rows) is a matrix-vector product whose speed is the
// bytes it reads, so a 4-bit weight costs about a sixth of its bfloat16 twin.
// Threads split the output rows; each block is unpacked to floats in
// registers and multiplied with the float32 input, accumulating in float32:
// the activations are never rounded. Each block contributes
//     d * sum_i(q_i x_i) + m * sum_i(x_i),
// the block sums of x computed once per call, so the inner loop is integer to
// float conversions and FMAs, no dequantization arithmetic.
//
// 4-bit weights are regrouped at load into Q4x8 (quant_blocks.h: 8 rows side
// by side; q4x8.cpp), where a vector lane is an output feature: fewer
// instructions per weight than the one-row kernels, which remain for weights
// kept as the file stores them.
//
// With int8 activations (the opt-in fast mode, int8_linear.h) the grouped
// layouts take integer dot products for every number of input rows.
//
// Batches and prefills (many rows) are compute bound. From 16 to 256 rows,
// Q4x8 weights and Q8_0 ones whose rows fill groups of 8 take the panel path
// (panel_linear.h); past that, and for other weights, tiles of rows are
// dequantized to a float buffer once and multiplied with every input row by
// torch's GEMM.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <vector>

#include "../dispatch.h"
#include "../mixed_rows.h"
#include "mixed_linear.h"
#include "../ops.h"
#include "cpu_utils.h"
#include "int8_linear.h"
#include "panel_linear.h"
#include "quant_blocks.h"
#include "q4x8.h"
#include "q6kx8.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;
using namespace cpu::quant;

// Input rows per pass over a weight row; more rows than this take passes.
constexpr int64_t kRowGroup = 4;
// Where the panel path does not run (panel_linear.h), more input rows than
// this take the tiled GEMM path. The Q4x8 and Q8_0 matrix-vector kernels
// unpack a block once for several input rows, so they stay ahead of
// dequantizing tiles through decode batches (bench.quant_bench); the one-row
// 4-bit kernels (weights whose rows do not fill groups of 8) hand over sooner.
constexpr int64_t gemv_max_rows(int64_t qtype) {
  return grouped(qtype) || qtype == kQ8_0 ? 64 : 8;
}

// The input as float32 and its per-block sums; thread-local, grows only.
struct Activations {
  const float* x;         // [M, K]
  const float* xs;        // [M, K / 32]
  const float* nibble_x;  // x in the AVX2 4-bit order (quants_avx2), or null
};

// Whether the 4-bit AVX2 path runs (it reads Activations::nibble_x).
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

// The paths of quant_linear_typed; only the matrix-vector kernels read the
// block sums and the nibble order.
enum class Path { kInt8, kPanel, kTiled, kGemv };

Activations prepare_input(const at::Tensor& input, int64_t qtype, int64_t m, int64_t k,
                          Path path) {
  thread_local std::vector<float> converted, sums;
  const float* x = nullptr;
  if (input.scalar_type() == at::kFloat) {
    x = input.const_data_ptr<float>();
  } else {
    if (static_cast<int64_t>(converted.size()) < m * k) converted.resize(m * k);
    SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quant_linear", [&] {
      const auto* src = input.const_data_ptr<scalar_t>();
      for (int64_t i = 0; i < m * k; ++i) converted[i] = to_f(src[i]);
    });
    x = converted.data();
  }
  // Only the matrix-vector kernels read sums (q6kx8.cpp makes its own 16-element ones).
  if (path != Path::kGemv || qtype == kQ6Kx8) return {x, nullptr, nullptr};
  const int64_t blocks = k / kBlock;
  if (static_cast<int64_t>(sums.size()) < m * blocks) sums.resize(m * blocks);
  for (int64_t i = 0; i < m * blocks; ++i) {
    float s = 0.f;
    for (int64_t t = 0; t < kBlock; ++t) s += x[i * kBlock + t];
    sums[i] = s;
  }
  return {x, sums.data(), nibble_order(qtype) ? to_nibble_order(x, m * k) : nullptr};
}

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

// Adds block b's products with input rows m0.. to vacc / macc.
template <int64_t kType, int kRows>
SHARDLM_AVX2 inline void block_avx2(__m256* vacc, float* macc, const uint8_t* w,
                                    const Activations& a, int64_t m0, int64_t b, int64_t k) {
  using namespace cpu::avx2;
  const Block blk = block_f16c<kType>(w + b * block_bytes(kType));
  __m256 q[4];
  quants_avx2<kType>(blk.qs, q);
  const __m256 d = _mm256_set1_ps(blk.d);
  [[maybe_unused]] const int64_t blocks = k / kBlock;
  const float* xbase = kType == kQ8_0 ? a.x : a.nibble_x;
  for (int r = 0; r < kRows; ++r) {
    const float* x = xbase + (m0 + r) * k + b * kBlock;
    const __m256 t01 = _mm256_fmadd_ps(q[1], load8(x + 8), _mm256_mul_ps(q[0], load8(x)));
    const __m256 t23 = _mm256_fmadd_ps(q[3], load8(x + 24), _mm256_mul_ps(q[2], load8(x + 16)));
    vacc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(t01, t23), vacc[r]);
    if constexpr (kType != kQ8_0) macc[r] += blk.m * a.xs[(m0 + r) * blocks + b];  // Q8_0: m = 0
  }
}

// One or two input rows alternate two sets of accumulators between even and
// odd blocks, so consecutive blocks do not wait on one FMA chain; more rows
// are independent chains already.
template <int64_t kType, int kRows>
SHARDLM_AVX2 void row_avx2(float* acc, const uint8_t* w, const Activations& a, int64_t m0,
                           int64_t k) {
  using namespace cpu::avx2;
  constexpr int kSets = kRows <= 2 ? 2 : 1;
  const int64_t blocks = k / kBlock;
  __m256 vacc[kSets][kRows];
  float macc[kSets][kRows];
  for (int s = 0; s < kSets; ++s) {
    for (int r = 0; r < kRows; ++r) {
      vacc[s][r] = _mm256_setzero_ps();
      macc[s][r] = 0.f;
    }
  }
  int64_t b = 0;
  const int64_t bytes = block_bytes(kType);
  for (; b + kSets <= blocks; b += kSets) {
    cpu::avx2::prefetch_ahead(w + b * bytes);  // kSets blocks: about a line
    for (int s = 0; s < kSets; ++s) block_avx2<kType, kRows>(vacc[s], macc[s], w, a, m0, b + s, k);
  }
  for (; b < blocks; ++b) block_avx2<kType, kRows>(vacc[0], macc[0], w, a, m0, b, k);
  for (int r = 0; r < kRows; ++r) {
    __m256 v = vacc[0][r];
    float m = macc[0][r];
    for (int s = 1; s < kSets; ++s) {
      v = _mm256_add_ps(v, vacc[s][r]);
      m += macc[s][r];
    }
    acc[r] = hsum(v) + m;
  }
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

// Q8_0 against one input row (decode): four weight rows at a time share each block's input
// loads and loop, and skip the offset term (Q8_0 has none). SmolLM2's rows are 18 blocks, so
// the per-row setup and reduction are a real share of a row. Each row's sums run in the order
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
      cpu::avx2::prefetch_line(ahead + b * pace + line);
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

// acc[0..rows) for input rows m0.. on the path this process takes.
template <int64_t kType>
void row_dot(float* acc, const uint8_t* w, const Activations& a, int64_t m0, int64_t rows,
             int64_t k) {
#if SHARDLM_HAVE_AVX2
  if (cpu::use_avx512()) {
    switch (rows) {
      case 1: return row_avx512<kType, 1>(acc, w, a, m0, k);
      case 2: return row_avx512<kType, 2>(acc, w, a, m0, k);
      case 3: return row_avx512<kType, 3>(acc, w, a, m0, k);
      default: return row_avx512<kType, 4>(acc, w, a, m0, k);
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
#endif
  row_scalar<kType>(acc, w, a, m0, rows, k);
}

template <int64_t kType, typename T>
void gemv(T* out, const uint8_t* w, const Activations& a, const T* bias, int64_t m, int64_t n,
          int64_t k) {
  const int64_t row_bytes = k / kBlock * block_bytes(kType);
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float acc[kRowGroup];
#if SHARDLM_HAVE_AVX2
    if constexpr (kType == kQ8_0) {
      if (m == 1 && cpu::use_avx512()) {
        for (; begin + 4 <= end; begin += 4) {
          q8_0_rows4_avx512(acc, w + begin * row_bytes, row_bytes, a.x, k);
          for (int r = 0; r < 4; ++r) {
            const float b = bias != nullptr ? to_f(bias[begin + r]) : 0.f;
            out[begin + r] = from_f<T>(acc[r] + b);
          }
        }
      }
    }
#endif
    for (int64_t j = begin; j < end; ++j) {
      const float b = bias != nullptr ? to_f(bias[j]) : 0.f;
      for (int64_t m0 = 0; m0 < m; m0 += kRowGroup) {
        const int64_t rows = std::min(kRowGroup, m - m0);
        row_dot<kType>(acc, w + j * row_bytes, a, m0, rows, k);
        for (int64_t r = 0; r < rows; ++r) out[(m0 + r) * n + j] = from_f<T>(acc[r] + b);
      }
    }
  });
}

// W rows [n0, n1) as float32 into `dst` ([n1 - n0, K]), the reference's values exactly.
template <int64_t kType>
void dequantize_rows(float* dst, const uint8_t* w, int64_t n0, int64_t n1, int64_t k) {
  if constexpr (kType == kQ6Kx8) return cpu::q6kx8::dequantize_rows(dst, w, n0, n1, k);
  if constexpr (grouped(kType)) return cpu::q4x8::dequantize_rows(dst, kType, w, n0, n1, k);
  const int64_t blocks = k / kBlock;
  const int64_t row_bytes = blocks * block_bytes(kType);
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    float q[kBlock];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t b = 0; b < blocks; ++b) {
        const Block blk = block_at<kType>(w + j * row_bytes + b * block_bytes(kType));
        quants_scalar<kType>(blk, q);
        float* o = dst + (j - n0) * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) {
          // Q4_0 as d * (q - 8), like GGML, so the tile equals the reference.
          o[i] = kType == kQ4_0 ? blk.d * (q[i] - 8.f) : blk.d * q[i] + blk.m;
        }
      }
    }
  });
}

// Tiles of about 4 MiB of float weights: dequantizing costs O(N K), the GEMM O(M N K).
template <int64_t kType>
void tiled_gemm(at::Tensor& out, const Activations& a, const uint8_t* w,
                const std::optional<at::Tensor>& bias, int64_t m, int64_t n, int64_t k) {
  const int64_t tile = std::max<int64_t>(16, (1 << 20) / k) / kGroupRows * kGroupRows;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < tile * k) buffer.resize(tile * k);
  const at::Tensor x = at::from_blob(const_cast<float*>(a.x), {m, k}, at::kFloat);
  const bool direct = out.scalar_type() == at::kFloat;
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    dequantize_rows<kType>(buffer.data(), w, n0, n0 + rows, k);
    const at::Tensor wt = at::from_blob(buffer.data(), {rows, k}, at::kFloat);
    at::Tensor dst = out.narrow(1, n0, rows);
    at::Tensor y = direct ? dst : at::empty({m, rows}, x.options());
    at::mm_out(y, x, wt.t());
    if (bias.has_value()) y.add_(bias->narrow(0, n0, rows).to(at::kFloat));
    if (!direct) dst.copy_(y);
  }
}

template <int64_t kType>
void quant_linear_typed(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, int64_t m, int64_t n, int64_t k) {
  const Path path =
      cpu::activation_precision() == cpu::ActivationPrecision::kInt8 && cpu::int8::takes(kType)
          ? Path::kInt8
      : cpu::panel::takes(kType, m, n) ? Path::kPanel
      : m > gemv_max_rows(kType)       ? Path::kTiled
                                       : Path::kGemv;
  const Activations a = prepare_input(input, kType, m, k, path);
  const auto* w = blocks.const_data_ptr<uint8_t>();
  SHARDLM_DISPATCH_FLOAT_TYPES(out.scalar_type(), "quant_linear", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    if (path == Path::kInt8) {
      cpu::int8::linear(o, kType, w, cpu::int8::quantize_rows(a.x, m, k), b, m, n, k);
    } else if (path == Path::kPanel) {
      cpu::panel::linear(o, kType, w, a.x, b, m, n, k);
    } else if (path == Path::kTiled) {
      tiled_gemm<kType>(out, a, w, bias, m, n, k);
    } else {
      if constexpr (kType == kQ6Kx8) {
        cpu::q6kx8::gemv(o, w, a.x, b, m, n, k);
      } else if constexpr (grouped(kType)) {
        cpu::q4x8::gemv(o, kType, w, a.x, a.xs, b, m, n, k);
      } else {
        gemv<kType>(o, w, a, b, m, n, k);
      }
    }
  });
}

}  // namespace

void quant_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                      int64_t qtype, const std::optional<at::Tensor>& bias) {
  const LinearDims d = check_quant_linear(out, input, blocks, qtype, bias);
  if (d.m == 0 || d.n == 0) {
    return;
  }
  if (qtype == mixed::kType) {
    return cpu::mixed_linear(out, input, blocks, bias, d.m);
  }
  switch (qtype) {
    case kQ4_0: return quant_linear_typed<kQ4_0>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4_1: return quant_linear_typed<kQ4_1>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4x8: return quant_linear_typed<kQ4x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4Kx8: return quant_linear_typed<kQ4Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ6Kx8: return quant_linear_typed<kQ6Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ5x8: return quant_linear_typed<kQ5x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ40x8: return quant_linear_typed<kQ40x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ5Kx8: return quant_linear_typed<kQ5Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    default: return quant_linear_typed<kQ8_0>(out, input, blocks, bias, d.m, d.n, d.k);
  }
}

}  // namespace shardlm
