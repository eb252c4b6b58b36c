// CPU: skinny_linear, out[M, N] = input[M, K] @ weight[N, K]^T (+ bias) for
// the few rows of a decode step.
//
// With M of 1 to a few rows a linear layer is a matrix-vector product: every
// weight is read once and used for M multiply-adds, so its speed is memory
// bandwidth. The BLAS path torch takes for float32 runs such a product on one
// thread (about half of what two cores can stream here), and bfloat16 is
// converted in chunks. This kernel splits the output features over all
// threads, streams each block of 4 weight rows (contiguous in memory) once,
// and multiplies it with 2 input rows at a time held in float registers (8
// lanes with AVX2, 16 with AVX-512); later pairs of input rows find the block
// in cache.
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;

constexpr int64_t kRowBlock = 4;   // weight rows (output features) per step
constexpr int64_t kInputPair = 2;  // input rows per pass over a weight block

// Input rows converted to float once per call; grows only (no allocation in a
// steady decode loop).
float* input_as_float(const void* input, at::ScalarType type, int64_t count) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  SHARDLM_DISPATCH_FLOAT_TYPES(type, "skinny_linear", [&] {
    const auto* src = static_cast<const scalar_t*>(input);
    for (int64_t i = 0; i < count; ++i) buffer[i] = to_f(src[i]);
  });
  return buffer.data();
}

// bfloat16 weights on the SIMD paths are widened a vector at a time without a
// shuffle: in each 32-bit lane of a load, `<< 16` yields the even element as a
// float and `& 0xffff0000` the odd one. The input rows are laid out to match
// once per call: per chunk of 2 L (L = 8 lanes for AVX2, 16 for AVX-512), the
// L even then the L odd features (the tail past the last whole chunk keeps the
// plain layout, read from `x`).
float* input_deinterleaved(const float* x, int64_t rows, int64_t k, int64_t lanes) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < rows * k) buffer.resize(rows * k);
  const int64_t chunk = 2 * lanes;
  const int64_t whole = k / chunk * chunk;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * k;
    float* dst = buffer.data() + r * k;
    for (int64_t c = 0; c < whole; c += chunk) {
      for (int64_t i = 0; i < lanes; ++i) {
        dst[c + i] = src[c + 2 * i];
        dst[c + lanes + i] = src[c + 2 * i + 1];
      }
    }
  }
  return buffer.data();
}

// Portable path: one output at a time, eight partial sums.
template <typename T>
void rows_scalar(T* out, const float* x, const T* w, const T* bias, int64_t m_rows, int64_t n0,
                 int64_t n1, int64_t k, int64_t n) {
  for (int64_t j = n0; j < n1; ++j) {
    const T* wr = w + j * k;
    const float b = bias != nullptr ? to_f(bias[j]) : 0.f;
    for (int64_t m = 0; m < m_rows; ++m) {
      out[m * n + j] = from_f<T>(cpu::dot_f(x + m * k, wr, k) + b);
    }
  }
}

#if SHARDLM_HAVE_AVX2
// The end of a 4-row block on every SIMD path: adds the products of k's tail
// [from, k) with the plain input rows to the vector sums sa / sb, then writes
// the 4 outputs of input row m0 (and of m0 + 1 when `two`) with their bias.
template <typename T>
void finish_block(T* out, float* sa, float* sb, const float* x, const T* const* rows,
                  const T* bias, int64_t m0, int64_t j, int64_t from, int64_t k, int64_t n,
                  bool two) {
  const float* xa = x + m0 * k;
  const float* xb = two ? xa + k : xa;
  for (int r = 0; r < 4; ++r) {
    for (int64_t t = from; t < k; ++t) {
      sa[r] += xa[t] * to_f(rows[r][t]);
      sb[r] += xb[t] * to_f(rows[r][t]);
    }
    const float b = bias != nullptr ? to_f(bias[j + r]) : 0.f;
    out[m0 * n + j + r] = from_f<T>(sa[r] + b);
    if (two) out[(m0 + 1) * n + j + r] = from_f<T>(sb[r] + b);
  }
}

// out[m][j..j+3] for input rows m0 and (when kTwo) m0+1.
template <typename T, bool kTwo>
SHARDLM_AVX2 void block_avx2(T* out, const float* x, const T* w, const T* bias, int64_t m0,
                             int64_t j, int64_t k, int64_t n) {
  constexpr bool two = kTwo;
  using namespace cpu::avx2;
  const T* w0 = w + j * k;
  const T* w1 = w0 + k;
  const T* w2 = w1 + k;
  const T* w3 = w2 + k;
  const float* xa = x + m0 * k;
  const float* xb = two ? xa + k : xa;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    if (i % (64 / sizeof(T)) == 0) {  // a line of each row
      prefetch_ahead(w0 + i);
      prefetch_ahead(w1 + i);
      prefetch_ahead(w2 + i);
      prefetch_ahead(w3 + i);
    }
    const __m256 va = load8(xa + i);
    const __m256 v0 = load8(w0 + i);
    const __m256 v1 = load8(w1 + i);
    const __m256 v2 = load8(w2 + i);
    const __m256 v3 = load8(w3 + i);
    a0 = _mm256_fmadd_ps(v0, va, a0);
    a1 = _mm256_fmadd_ps(v1, va, a1);
    a2 = _mm256_fmadd_ps(v2, va, a2);
    a3 = _mm256_fmadd_ps(v3, va, a3);
    if constexpr (kTwo) {
      const __m256 vb = load8(xb + i);
      b0 = _mm256_fmadd_ps(v0, vb, b0);
      b1 = _mm256_fmadd_ps(v1, vb, b1);
      b2 = _mm256_fmadd_ps(v2, vb, b2);
      b3 = _mm256_fmadd_ps(v3, vb, b3);
    }
  }
  alignas(16) float sa[4], sb[4];
  _mm_store_ps(sa, hsum4(a0, a1, a2, a3));
  _mm_store_ps(sb, hsum4(b0, b1, b2, b3));
  const T* rows[4] = {w0, w1, w2, w3};
  finish_block(out, sa, sb, x, rows, bias, m0, j, i, k, n, two);
}

// The bfloat16 twin of block_avx2 (see input_deinterleaved): `xp` holds the
// input rows de-interleaved, `x` the plain ones for the tail.
template <bool kTwo>
SHARDLM_AVX2 void block_bf16_avx2(c10::BFloat16* out, const float* x, const float* xp,
                                  const c10::BFloat16* w, const c10::BFloat16* bias, int64_t m0,
                                  int64_t j, int64_t k, int64_t n) {
  using namespace cpu::avx2;
  const c10::BFloat16* rows[4] = {w + j * k, w + (j + 1) * k, w + (j + 2) * k, w + (j + 3) * k};
  const float* pa = xp + m0 * k;
  const float* pb = kTwo ? pa + k : pa;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm256_setzero_ps();
  const int64_t k16 = k / 16 * 16;
  for (int64_t i = 0; i < k16; i += 16) {
    if (i % 32 == 0) {  // a line of each row
      for (const c10::BFloat16* row : rows) prefetch_ahead(row + i);
    }
    const __m256 ae = _mm256_loadu_ps(pa + i), ao = _mm256_loadu_ps(pa + i + 8);
    __m256 be = ae, bo = ao;
    if constexpr (kTwo) {
      be = _mm256_loadu_ps(pb + i);
      bo = _mm256_loadu_ps(pb + i + 8);
    }
    for (int r = 0; r < 4; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + i));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
      a[r] = _mm256_fmadd_ps(odd, ao, _mm256_fmadd_ps(even, ae, a[r]));
      if constexpr (kTwo) b[r] = _mm256_fmadd_ps(odd, bo, _mm256_fmadd_ps(even, be, b[r]));
    }
  }
  alignas(16) float sa[4], sb[4];
  _mm_store_ps(sa, hsum4(a[0], a[1], a[2], a[3]));
  _mm_store_ps(sb, hsum4(b[0], b[1], b[2], b[3]));
  finish_block(out, sa, sb, x, rows, bias, m0, j, k16, k, n, kTwo);
}

// ---- AVX-512F: the AVX2 blocks with 16 lanes ---------------------------------------

template <typename T, bool kTwo>
SHARDLM_AVX512 void block_avx512(T* out, const float* x, const T* w, const T* bias, int64_t m0,
                                 int64_t j, int64_t k, int64_t n) {
  using namespace cpu::avx512;
  const T* rows[4] = {w + j * k, w + (j + 1) * k, w + (j + 2) * k, w + (j + 3) * k};
  const float* xa = x + m0 * k;
  const float* xb = kTwo ? xa + k : xa;
  __m512 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % (64 / sizeof(T)) == 0) {  // a line of each row
      for (const T* row : rows) cpu::avx2::prefetch_ahead(row + i);
    }
    const __m512 va = load16(xa + i);
    const __m512 vb = kTwo ? load16(xb + i) : va;
    for (int r = 0; r < 4; ++r) {
      const __m512 v = load16(rows[r] + i);
      a[r] = _mm512_fmadd_ps(v, va, a[r]);
      if constexpr (kTwo) b[r] = _mm512_fmadd_ps(v, vb, b[r]);
    }
  }
  alignas(16) float sa[4], sb[4];
  _mm_store_ps(sa, hsum4(a[0], a[1], a[2], a[3]));
  _mm_store_ps(sb, hsum4(b[0], b[1], b[2], b[3]));
  finish_block(out, sa, sb, x, rows, bias, m0, j, i, k, n, kTwo);
}

// The bfloat16 twin: a 64-byte load is 32 weights, even and odd ones against
// the input de-interleaved in chunks of 32 (input_deinterleaved, 16 lanes).
template <bool kTwo>
SHARDLM_AVX512 void block_bf16_avx512(c10::BFloat16* out, const float* x, const float* xp,
                                      const c10::BFloat16* w, const c10::BFloat16* bias,
                                      int64_t m0, int64_t j, int64_t k, int64_t n) {
  using namespace cpu::avx512;
  const c10::BFloat16* rows[4] = {w + j * k, w + (j + 1) * k, w + (j + 2) * k, w + (j + 3) * k};
  const float* pa = xp + m0 * k;
  const float* pb = kTwo ? pa + k : pa;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm512_setzero_ps();
  const int64_t k32 = k / 32 * 32;
  for (int64_t i = 0; i < k32; i += 32) {  // a line of each row per step
    for (const c10::BFloat16* row : rows) cpu::avx2::prefetch_ahead(row + i);
    const __m512 ae = _mm512_loadu_ps(pa + i), ao = _mm512_loadu_ps(pa + i + 16);
    __m512 be = ae, bo = ao;
    if constexpr (kTwo) {
      be = _mm512_loadu_ps(pb + i);
      bo = _mm512_loadu_ps(pb + i + 16);
    }
    for (int r = 0; r < 4; ++r) {
      const __m512i v = _mm512_loadu_si512(rows[r] + i);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, odd_mask));
      a[r] = _mm512_fmadd_ps(odd, ao, _mm512_fmadd_ps(even, ae, a[r]));
      if constexpr (kTwo) b[r] = _mm512_fmadd_ps(odd, bo, _mm512_fmadd_ps(even, be, b[r]));
    }
  }
  alignas(16) float sa[4], sb[4];
  _mm_store_ps(sa, hsum4(a[0], a[1], a[2], a[3]));
  _mm_store_ps(sb, hsum4(b[0], b[1], b[2], b[3]));
  finish_block(out, sa, sb, x, rows, bias, m0, j, k32, k, n, kTwo);
}

// One 4-row block of outputs for input rows m0 (and m0 + 1 when kTwo), on the
// AVX-512 kernels when kWide, else the AVX2 ones.
template <typename T, bool kWide, bool kTwo>
void block_simd(T* out, const float* x, const float* xp, const T* w, const T* bias, int64_t m0,
                int64_t j, int64_t k, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (kWide) return block_bf16_avx512<kTwo>(out, x, xp, w, bias, m0, j, k, n);
    return block_bf16_avx2<kTwo>(out, x, xp, w, bias, m0, j, k, n);
  } else {
    if constexpr (kWide) return block_avx512<T, kTwo>(out, x, w, bias, m0, j, k, n);
    return block_avx2<T, kTwo>(out, x, w, bias, m0, j, k, n);
  }
}

template <typename T, bool kWide>
void rows_simd(T* out, const float* x, const float* xp, const T* w, const T* bias,
               int64_t m_rows, int64_t n0, int64_t n1, int64_t k, int64_t n) {
  int64_t j = n0;
  for (; j + kRowBlock <= n1; j += kRowBlock) {
    int64_t m = 0;
    for (; m + kInputPair <= m_rows; m += kInputPair) {
      block_simd<T, kWide, true>(out, x, xp, w, bias, m, j, k, n);
    }
    if (m < m_rows) block_simd<T, kWide, false>(out, x, xp, w, bias, m, j, k, n);
  }
  rows_scalar(out, x, w, bias, m_rows, j, n1, k, n);  // fewer than 4 rows left
}
#endif

template <typename T>
void skinny_linear_impl(T* out, const float* x, const T* w, const T* bias, int64_t m_rows,
                        int64_t n, int64_t k) {
  const float* xp = nullptr;
#if SHARDLM_HAVE_AVX2
  const bool avx2 = cpu::use_avx2(), wide = cpu::use_avx512();
  if (std::is_same_v<T, c10::BFloat16> && avx2) {
    xp = input_deinterleaved(x, m_rows, k, wide ? 16 : 8);
  }
#endif
  // Tasks of whole 4-row blocks, each worth >= ~64 KiB of weights, so small
  // layers stay on the calling thread.
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  const int64_t block_bytes = kRowBlock * k * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, block_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kRowBlock;
    const int64_t n1 = std::min(n, end * kRowBlock);
#if SHARDLM_HAVE_AVX2
    if (wide) return rows_simd<T, true>(out, x, xp, w, bias, m_rows, n0, n1, k, n);
    if (avx2) return rows_simd<T, false>(out, x, xp, w, bias, m_rows, n0, n1, k, n);
#endif
    rows_scalar(out, x, w, bias, m_rows, n0, n1, k, n);
  });
}

}  // namespace

// Measured on AVX2 with bench/ops_cpu_bench.py --linear: a float32
// matrix-vector product runs on one thread in BLAS, so skinny_linear streams
// about 1.8x faster at one row and stays ahead to ~48 rows. Half precision
// GEMMs convert weights in chunks without native support, and skinny_linear
// was 5x faster even at 512 rows, so it takes every bfloat16 / float16 product.
int64_t skinny_max_rows(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 48;
    case at::kBFloat16:
    case at::kHalf: return std::numeric_limits<int64_t>::max();
    default: return 0;
  }
}

void skinny_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const LinearDims d = check_skinny_linear(out, input, weight, bias);
  if (d.m == 0 || d.n == 0) {
    return;
  }
  const float* x = input.scalar_type() == at::kFloat
                       ? input.const_data_ptr<float>()
                       : input_as_float(input.const_data_ptr(), input.scalar_type(), d.m * d.k);
  SHARDLM_DISPATCH_FLOAT_TYPES(weight.scalar_type(), "skinny_linear", [&] {
    skinny_linear_impl(out.data_ptr<scalar_t>(), x, weight.const_data_ptr<scalar_t>(),
                       bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr, d.m, d.n,
                       d.k);
  });
}

}  // namespace shardlm
