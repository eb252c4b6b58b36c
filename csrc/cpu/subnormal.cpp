// The probe behind subnormal_fma_fast() (subnormal.h): the same FMAs on 4-bit
// quants masked in place, once read as subnormals and once converted, by the
// kernels' own helpers (grouped.h), timed on the calling core; the faster of
// several alternated takes of each.
#include "subnormal.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "grouped.h"

namespace shardlm::cpu {
namespace {

constexpr int64_t kWords = 2048;  // 8 KB of nibble words: in L1, so the ops are timed
constexpr int kTakes = 5;

#if SHARDLM_HAVE_AVX2
// Eight chains over the words' 8 quants each; returns a value of all of them.
template <bool kSubnormal>
SHARDLM_AVX2 __attribute__((noinline)) float chains(const uint32_t* words, const float* x) {
  __m256 c[8];
  for (auto& v : c) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < kWords; i += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + i));
    const grouped::Joined256 joined{v, v, _mm256_srli_epi32(v, 28)};  // as a 4-bit word's
    for (int j = 0; j < 8; ++j) {
      const __m256 q =
          kSubnormal ? grouped::joined_subnormal_avx2(joined, j, 0x0f)
                     : _mm256_cvtepi32_ps(grouped::joined_quant_avx2(joined, j, 0x0f));
      c[j] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x + j), c[j]);
    }
  }
  __m256 sum = c[0];
  for (int j = 1; j < 8; ++j) sum = _mm256_add_ps(sum, c[j]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  return lanes[0] + lanes[7];
}

template <bool kSubnormal>
double seconds_of(const uint32_t* words, const float* x, volatile float& sink) {
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 8; ++round) sink = sink + chains<kSubnormal>(words, x);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool probe() {
  const SubnormalInputs inputs(true);
  std::vector<uint32_t> words(kWords);
  uint32_t state = 2463534242u;  // xorshift: any nibbles do
  for (auto& w : words) {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    w = state;
  }
  // Inputs scaled as the kernels scale them, so the products are normal there too.
  const float x[8] = {1.f, -0.5f, 0.25f, 2.f, -1.f, 0.75f, 1.5f, -2.f};
  float scaled[8];
  for (int j = 0; j < 8; ++j) scaled[j] = x[j] * kSubnormalNibbleScale[j];
  volatile float sink = 0.f;
  double subnormal = 1e30, converted = 1e30;
  for (int take = 0; take < kTakes; ++take) {
    subnormal = std::min(subnormal, seconds_of<true>(words.data(), scaled, sink));
    converted = std::min(converted, seconds_of<false>(words.data(), x, sink));
  }
  return subnormal <= converted;
}
#endif

}  // namespace

bool subnormal_fma_fast() {
#if SHARDLM_HAVE_AVX2
  static const bool fast = cpu_simd_support() >= SimdLevel::kAvx2 && probe();
  return fast;
#else
  return false;
#endif
}

}  // namespace shardlm::cpu
