// Small helpers shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "simd.h"

namespace shardlm::cpu {

// The widest instruction set the CPU kernels use, decided once per process:
// what the CPU and OS support, capped by SHARDLM_CPU_SIMD ("portable" or "0"
// forces the portable loops, "avx2" caps at AVX2, "avx512" or unset takes the
// best), so each path can be tested and timed on one machine.
enum class SimdLevel { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline SimdLevel simd_level() {
  static const SimdLevel level = [] {
#if SHARDLM_HAVE_AVX2
    SimdLevel cap = SimdLevel::kAvx512;
    if (const char* env = std::getenv("SHARDLM_CPU_SIMD")) {
      if (std::strcmp(env, "0") == 0 || std::strcmp(env, "portable") == 0) {
        cap = SimdLevel::kPortable;
      } else if (std::strcmp(env, "avx2") == 0) {
        cap = SimdLevel::kAvx2;
      }
    }
    __builtin_cpu_init();
    SimdLevel best = SimdLevel::kPortable;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      best = __builtin_cpu_supports("avx512f") ? SimdLevel::kAvx512 : SimdLevel::kAvx2;
    }
    return std::min(cap, best);
#else
    return SimdLevel::kPortable;
#endif
  }();
  return level;
}

// Whether to take the AVX2 paths (simd.h).
inline bool use_avx2() { return simd_level() >= SimdLevel::kAvx2; }

// Whether to take the AVX-512F paths (also AVX2, FMA and F16C).
inline bool use_avx512() { return simd_level() >= SimdLevel::kAvx512; }

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// Rounds a float to the storage dtype; the identity for float.
template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}

// Eight independent partial sums: lets the compiler vectorise a float
// reduction without -ffast-math and keeps rounding error growth low.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float v = to_f(x[i + j]);
      acc[j] += v * v;
    }
  }
  float s = 0.f;
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    s += v * v;
  }
  for (int j = 0; j < 8; ++j) {
    s += acc[j];
  }
  return s;
}

// dot(q, k) with q already converted to float.
template <typename T>
inline float dot_f(const float* q, const T* k, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += q[i + j] * to_f(k[i + j]);
    }
  }
  float s = 0.f;
  for (; i < n; ++i) {
    s += q[i] * to_f(k[i]);
  }
  for (int j = 0; j < 8; ++j) {
    s += acc[j];
  }
  return s;
}

// acc += p * v, v converted to float.
template <typename T>
inline void axpy_f(float* acc, float p, const T* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc[i] += p * to_f(v[i]);
  }
}

// parallel_for grain size so that each task touches roughly `work` elements.
inline int64_t grain_for(int64_t per_item, int64_t work = 32768) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, per_item));
}

}  // namespace shardlm::cpu
