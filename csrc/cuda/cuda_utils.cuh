// Device helpers shared by the CUDA kernels: float conversion, vectorised
// loads/stores, warp and block reductions, launch boilerplate (including the
// host copy of index tensors that the launchers check before a launch).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

namespace shardlm::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v) {
  return static_cast<T>(v);  // round-to-nearest-even, like torch's .to(dtype)
}

// N consecutive elements moved as one 4/8/16-byte access. Only used on
// addresses the host verified to be aligned to sizeof(Packed) (see
// is_aligned below); N == 1 degenerates to a scalar access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* p, float (&out)[N]) {
  const Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[i] = to_f(pk.v[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_f(T* p, const float (&in)[N]) {
  Packed<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    pk.v[i] = from_f<T>(in[i]);
  }
  *reinterpret_cast<Packed<T, N>*>(p) = pk;
}

// Widest vector (in elements) for 16-byte accesses of T.
template <typename T>
constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(kFullMask, v, o);
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  }
  return v;
}

// Block-wide reduction. Every thread must call it (it synchronises); the
// block size must be a multiple of 32; `scratch` holds >= 32 floats. The
// trailing barrier makes it safe to call again with the same scratch, and
// also publishes any shared-memory writes made before the call.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) {
    scratch[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    const float ident = kMax ? -INFINITY : 0.f;
    float w = lane < num_warps ? scratch[lane] : ident;
    w = kMax ? warp_max(w) : warp_sum(w);
    if (lane == 0) {
      scratch[0] = w;
    }
  }
  __syncthreads();
  const float r = scratch[0];
  __syncthreads();
  return r;
}

inline int ceil_div(int64_t a, int64_t b) {
  return static_cast<int>((a + b - 1) / b);
}

// Threads per block for a row of `items` work items: a multiple of 32 in
// [32, max_threads].
inline int threads_for(int64_t items, int max_threads) {
  int64_t t = ((items + 31) / 32) * 32;
  if (t < 32) t = 32;
  if (t > max_threads) t = max_threads;
  return static_cast<int>(t);
}

// Host copies of small int32 index tensors (block tables, lengths), for the
// launchers' data checks (checks.cpp): the kernels trust these values, and a
// bad one reads outside the cache or silently drops work. The copies go into
// one pinned buffer, queued on the current stream after whatever wrote the
// indices, then one synchronisation: an eager call pays one small blocking
// device-to-host round trip. While the current stream is capturing a CUDA
// graph (worker/decode_runner.py captures decode steps) that synchronisation
// is not allowed, and the values seen at capture are not those a replay reads
// anyway, so this returns nullopt and the launcher skips the checks: graph
// replays run on index buffers the runner fills itself.
inline std::optional<std::vector<at::Tensor>> copy_indices_to_host(
    std::initializer_list<at::Tensor> tensors) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return std::nullopt;
  }
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    TORCH_INTERNAL_ASSERT(t.scalar_type() == at::kInt && t.is_contiguous());
    total += t.numel();
  }
  const at::Tensor host =
      at::empty({total}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  std::vector<at::Tensor> copies;
  copies.reserve(tensors.size());
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    at::Tensor part = host.narrow(0, offset, t.numel()).view(t.sizes());
    part.copy_(t, /*non_blocking=*/true);
    copies.push_back(std::move(part));
    offset += t.numel();
  }
  c10::cuda::getCurrentCUDAStream().synchronize();
  return copies;
}

}  // namespace shardlm::cuda
