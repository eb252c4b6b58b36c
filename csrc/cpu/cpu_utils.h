// Small helpers shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace shardlm::cpu {

// Whether the CPU and OS support the AVX2 paths (simd.h): AVX2, FMA and F16C.
// Probed once per process.
inline bool cpu_has_avx2() {
  static const bool supported = [] {
#if SHARDLM_HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return supported;
}

// The process-wide switch that set_cpu_simd() (ops.cpp, called from Python
// with the worker's EngineOptions) flips: false forces the portable loops, to
// test or time them. On by default.
inline std::atomic<bool>& simd_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// Whether to take the AVX2 paths: supported and not switched off. Read once per
// kernel call, so a switch takes effect from the next call on.
inline bool use_avx2() {
  return simd_allowed().load(std::memory_order_relaxed) && cpu_has_avx2();
}

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
