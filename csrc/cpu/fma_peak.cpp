// The CPU's float32 FMA throughput, measured: what bench/roofline.py reads a
// compute-bound kernel (prefill) against, as the read bandwidth is the limit
// decode is read against. Every thread runs independent chains of FMAs on
// registers (12, more than latency times ports on current x86 cores), on the
// widest SIMD path the kernels take.
#include "fma_peak.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>

#include "cpu_utils.h"
#include "simd.h"

namespace shardlm::cpu {
namespace {

constexpr int kChains = 12;

// Returns a value that depends on every chain, so none is optimized away.
float chains_portable(int64_t iterations) {
  float a[kChains];
  for (int j = 0; j < kChains; ++j) a[j] = 1.f + 0.01f * j;
  volatile float factor = 0.9999999f;  // read every round: the rounds cannot be folded
  for (int64_t i = 0; i < iterations; ++i) {
    const float m = factor;
    for (int j = 0; j < kChains; ++j) a[j] = a[j] * m + 1e-7f;
  }
  float sum = 0.f;
  for (float v : a) sum += v;
  return sum;
}

#if SHARDLM_HAVE_AVX2
SHARDLM_AVX2 float chains_avx2(int64_t iterations) {
  __m256 a[kChains];
  for (int j = 0; j < kChains; ++j) a[j] = _mm256_set1_ps(1.f + 0.01f * j);
  const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
    for (int j = 0; j < kChains; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
  }
  __m256 sum = a[0];
  for (int j = 1; j < kChains; ++j) sum = _mm256_add_ps(sum, a[j]);
  return avx2::hsum(sum);
}

SHARDLM_AVX512 float chains_avx512(int64_t iterations) {
  __m512 a[kChains];
  for (int j = 0; j < kChains; ++j) a[j] = _mm512_set1_ps(1.f + 0.01f * j);
  const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
    for (int j = 0; j < kChains; ++j) a[j] = _mm512_fmadd_ps(a[j], m, c);
  }
  __m512 sum = a[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, a[j]);
  return _mm512_reduce_add_ps(sum);
}
#endif

}  // namespace

double fma_peak_flops(int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  int64_t lanes = 1;
#if SHARDLM_HAVE_AVX2
  lanes = use_avx512() ? 16 : use_avx2() ? 8 : 1;
#endif
  std::atomic<float> sink{0.f};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float v = 0.f;
#if SHARDLM_HAVE_AVX2
      if (lanes == 16) {
        v = chains_avx512(iterations);
      } else if (lanes == 8) {
        v = chains_avx2(iterations);
      } else {
        v = chains_portable(iterations);
      }
#else
      v = chains_portable(iterations);
#endif
      sink.store(v, std::memory_order_relaxed);
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  (void)sink.load();
  return 2.0 * kChains * lanes * static_cast<double>(iterations) * static_cast<double>(threads) /
         seconds;
}

}  // namespace shardlm::cpu
