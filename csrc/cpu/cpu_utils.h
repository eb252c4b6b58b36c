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

// The instruction sets the CPU kernels use, widest last.
enum class SimdLevel { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest level the CPU and OS support (AVX2 needs FMA and F16C too).
// Probed once per process.
inline SimdLevel cpu_simd_support() {
  static const SimdLevel best = [] {
#if SHARDLM_HAVE_AVX2
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c"))) {
      return SimdLevel::kPortable;
    }
    return __builtin_cpu_supports("avx512f") ? SimdLevel::kAvx512 : SimdLevel::kAvx2;
#else
    return SimdLevel::kPortable;
#endif
  }();
  return best;
}

// The process-wide cap that set_cpu_simd() (ops.cpp, called from Python with
// the worker's EngineOptions, or by tests to force a path) sets; the widest
// level by default.
inline std::atomic<int>& simd_cap() {
  static std::atomic<int> cap{static_cast<int>(SimdLevel::kAvx512)};
  return cap;
}

// The level the kernels take now: supported and not capped. Read once per
// kernel call, so a new cap takes effect from the next call on.
inline SimdLevel simd_level() {
  return static_cast<SimdLevel>(std::min(simd_cap().load(std::memory_order_relaxed),
                                         static_cast<int>(cpu_simd_support())));
}

// Whether to take the AVX2 paths (simd.h).
inline bool use_avx2() { return simd_level() >= SimdLevel::kAvx2; }

// Whether to take the AVX-512F paths (also AVX2, FMA and F16C).
inline bool use_avx512() { return simd_level() >= SimdLevel::kAvx512; }

// Whether the CPU has AVX-512 VNNI (int8 dot products into int32), which the
// AVX-512 kernels of int8 activations need; without it they take the AVX2
// ones. Probed once per process.
inline bool cpu_has_avx512_vnni() {
  static const bool has = [] {
#if SHARDLM_HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
    return false;
#endif
  }();
  return has;
}

// Whether the CPU has AVX-512VL (AVX-512 instructions on 256-bit vectors, with
// 32 registers), which the attention's blocks of rows are compiled for
// (attention_rows.h). Probed once per process.
inline bool cpu_has_avx512_vl() {
  static const bool has = [] {
#if SHARDLM_HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
  }();
  return has;
}

// Whether the VNNI paths may run where the CPU has them (set_cpu_vnni, ops.cpp;
// 1 by default): 0 makes a CPU with VNNI take the paths of an AVX-512 CPU
// without it, to test and time them.
inline std::atomic<int>& vnni_setting() {
  static std::atomic<int> allowed{1};
  return allowed;
}

inline bool use_avx512_vnni() {
  return use_avx512() && cpu_has_avx512_vnni() &&
         vnni_setting().load(std::memory_order_relaxed) != 0;
}

// Whether the CPU and the OS let this process use AMX int8 tiles (Intel Xeon
// from Sapphire Rapids on): the CPU's AMX-TILE and AMX-INT8, the OS's tile
// state in XCR0, and Linux's per-process permission for it, asked for here
// (arch_prctl; a kernel before 5.16 has no such call and no AMX). Probed once
// per process (int8_amx.cpp).
bool cpu_has_amx_int8();

// Whether the AMX path of the int8 mode may run where the CPU has it
// (set_cpu_amx, ops.cpp; 1 by default): 0 keeps such a CPU on the VNNI
// kernels, to test and time them against it.
inline std::atomic<int>& amx_setting() {
  static std::atomic<int> allowed{1};
  return allowed;
}

inline bool use_amx_int8() {
  return use_avx512_vnni() && amx_setting().load(std::memory_order_relaxed) != 0 &&
         cpu_has_amx_int8();
}

// How quant_linear treats its input: exact (float32, the default), rounded to
// int8 per block of 32 for the 8-row grouped weight layouts (int8_linear.h),
// or, with the weights too, to 14-bit integers per block of 32 in the panel
// path (panel_int16.h). Process-wide, like simd_cap(): set_activation_precision()
// (ops.cpp) sets it from the worker's EngineOptions; read once per call.
enum class ActivationPrecision { kExact = 0, kInt8 = 1, kInt16 = 2 };

inline std::atomic<int>& activation_precision_setting() {
  static std::atomic<int> setting{static_cast<int>(ActivationPrecision::kExact)};
  return setting;
}

inline ActivationPrecision activation_precision() {
  return static_cast<ActivationPrecision>(
      activation_precision_setting().load(std::memory_order_relaxed));
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
