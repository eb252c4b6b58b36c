// CUDA: rotary_embedding (neox / rotate_half layout) and reshape_and_cache
// (which converts k / v to the cache's dtype where the two differ).

#include "../dispatch.h"
#include "../ops.h"
#include "cuda_utils.cuh"

#include <type_traits>

namespace shardlm {
namespace cuda {
namespace {

// One block per token; threads stride over (head, i) pairs of q then k.
// The __f*_rn intrinsics are never contracted into FMAs, so in float32 the
// result is bit-identical to HF's `q * cos + rotate_half(q) * sin`.
// Positions outside the cache are skipped (memory safety; the CPU op raises).
template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, T* q, T* k,
                              const float* __restrict__ cache, RopeDims d) {
  const int64_t t = blockIdx.x;
  const int64_t pos = positions[t];
  if (pos < 0 || pos >= d.max_position) {
    return;
  }
  const int half = static_cast<int>(d.rot_dim / 2);
  const float* cos = cache + pos * d.rot_dim;
  const float* sin = cos + half;
  const int total = static_cast<int>((d.q_heads + d.k_heads) * half);
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int head = idx / half;
    const int i = idx % half;
    T* x = head < d.q_heads ? q + t * d.q_row_stride + head * d.q_head_stride
                            : k + t * d.k_row_stride + (head - d.q_heads) * d.k_head_stride;
    const float x1 = to_f(x[i]);
    const float x2 = to_f(x[i + half]);
    const float c = cos[i];
    const float s = sin[i];
    x[i] = from_f<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    x[i + half] = from_f<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

// One block per token; copies kv_heads * head_dim elements of key and value
// into slot_mapping[t], converted from T to the cache's C (a plain copy when
// they agree). Negative (padding) or out-of-range slots write nothing.
template <typename T, typename C, int VEC>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         C* __restrict__ key_cache, C* __restrict__ value_cache,
                                         const int64_t* __restrict__ slots, CacheWriteDims d) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= d.num_blocks * d.block_size) {
    return;
  }
  const int chunks_per_head = static_cast<int>(d.head_dim / VEC);
  const int total = static_cast<int>(d.kv_heads) * chunks_per_head;
  // The cache is [num_blocks, block_size, kv_heads, head_dim] contiguous, so
  // slot (= block * block_size + offset) indexes token rows directly.
  const int64_t row = slot * d.kv_heads * d.head_dim;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int h = idx / chunks_per_head;
    const int e = (idx % chunks_per_head) * VEC;
    const int64_t dst = row + h * d.head_dim + e;
    const T* ksrc = key + t * d.k_row_stride + h * d.k_head_stride + e;
    const T* vsrc = value + t * d.v_row_stride + h * d.v_head_stride + e;
    if constexpr (std::is_same_v<T, C>) {
      using P = Packed<T, VEC>;
      *reinterpret_cast<P*>(key_cache + dst) = *reinterpret_cast<const P*>(ksrc);
      *reinterpret_cast<P*>(value_cache + dst) = *reinterpret_cast<const P*>(vsrc);
    } else {
      float f[VEC];
      load_f<T, VEC>(ksrc, f);
      store_f<C, VEC>(key_cache + dst, f);
      load_f<T, VEC>(vsrc, f);
      store_f<C, VEC>(value_cache + dst, f);
    }
  }
}

}  // namespace
}  // namespace cuda

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           int64_t head_size, const at::Tensor& cos_sin_cache) {
  const RopeDims d = check_rotary(positions, query, key, head_size, cos_sin_cache);
  if (d.num_tokens == 0 || d.q_heads + d.k_heads == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(query.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = cuda::threads_for((d.q_heads + d.k_heads) * (d.rot_dim / 2), 256);
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    cuda::rotary_kernel<scalar_t>
        <<<static_cast<unsigned>(d.num_tokens), threads, 0, stream>>>(
            positions.const_data_ptr<int64_t>(), query.data_ptr<scalar_t>(),
            key.data_ptr<scalar_t>(), cos_sin_cache.const_data_ptr<float>(), d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache,
                            const at::Tensor& slot_mapping) {
  const CacheWriteDims d =
      check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  if (d.num_tokens == 0 || d.kv_heads == 0 || d.head_dim == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(key.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  SHARDLM_DISPATCH_FLOAT_TYPES(key.scalar_type(), "reshape_and_cache", [&] {
    using T = scalar_t;
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "reshape_and_cache", [&] {
      using C = cache_t;
      // The vector covers 16 bytes of the wider of T and C (of both when they agree).
      constexpr int V = cuda::kVec16<T> < cuda::kVec16<C> ? cuda::kVec16<T> : cuda::kVec16<C>;
      const T* k = key.const_data_ptr<T>();
      const T* v = value.const_data_ptr<T>();
      C* kc = key_cache.data_ptr<C>();
      C* vc = value_cache.data_ptr<C>();
      // Every vector access starts at base + (multiple of V) elements when
      // all strides and head_dim are multiples of V.
      const bool vec = d.head_dim % V == 0 && d.k_row_stride % V == 0 &&
                       d.k_head_stride % V == 0 && d.v_row_stride % V == 0 &&
                       d.v_head_stride % V == 0 && cuda::is_aligned(k, sizeof(T) * V) &&
                       cuda::is_aligned(v, sizeof(T) * V) && cuda::is_aligned(kc, sizeof(C) * V) &&
                       cuda::is_aligned(vc, sizeof(C) * V);
      const int64_t items = d.kv_heads * (vec ? d.head_dim / V : d.head_dim);
      const int threads = cuda::threads_for(items, 256);
      const auto* slots = slot_mapping.const_data_ptr<int64_t>();
      const dim3 grid(static_cast<unsigned>(d.num_tokens));
      if (vec) {
        cuda::reshape_and_cache_kernel<T, C, V>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, slots, d);
      } else {
        cuda::reshape_and_cache_kernel<T, C, 1>
            <<<grid, threads, 0, stream>>>(k, v, kc, vc, slots, d);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace shardlm
