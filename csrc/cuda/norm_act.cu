// CUDA: rms_norm, fused_add_rms_norm, silu_and_mul, gelu_tanh_and_mul.
// Rounding mirrors the CPU kernels (and HF) exactly; only the order of the
// float32 sum of squares differs.

#include "../dispatch.h"
#include "../ops.h"
#include "cuda_utils.cuh"

namespace shardlm {
namespace cuda {
namespace {

// One block per row; each thread owns chunks c = tid, tid + blockDim, ... of
// VEC elements and uses the *same* chunks in both passes, so the fused
// variant can re-read its own residual writes without extra barriers.
// kAdd=false: dst = rmsnorm(src).  kAdd=true: src += dst (rounded), then
// dst = rmsnorm(src), i.e. src is the residual and dst the input.
// No __restrict__: rms_norm may be called in place (dst == src).
template <typename T, int VEC, bool kAdd>
__global__ void rms_norm_kernel(T* dst, T* src, const T* weight, int64_t n, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  T* d = dst + row * n;
  T* s = src + row * n;
  const int64_t chunks = n / VEC;
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float x[VEC];
    load_f<T, VEC>(s + c * VEC, x);
    if constexpr (kAdd) {
      float in[VEC];
      load_f<T, VEC>(d + c * VEC, in);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        x[i] = to_f(from_f<T>(x[i] + in[i]));  // HF adds in the model dtype
      }
      store_f<T, VEC>(s + c * VEC, x);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      acc += x[i] * x[i];
    }
  }
  const float total = block_reduce<false>(acc, scratch);
  // Exact 1 / sqrt (both IEEE-rounded without fast math), as the CPU kernel and
  // the reference compute it: rsqrtf is off by up to 2 ulp, enough to flip a
  // token in the float32 GPU-vs-CPU engine comparison, which is token for token.
  const float inv_rms = 1.f / sqrtf(total / static_cast<float>(n) + eps);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float x[VEC], w[VEC];
    load_f<T, VEC>(s + c * VEC, x);
    load_f<T, VEC>(weight + c * VEC, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      // Round the normalised value to the dtype before scaling (HF order).
      x[i] = w[i] * to_f(from_f<T>(x[i] * inv_rms));
    }
    store_f<T, VEC>(d + c * VEC, x);
  }
}

// The gated activations, on float: silu(g), and gelu(g, approximate="tanh")
// as g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3), the CPU kernel's
// form (0.5 (1 + tanh(u)) = sigmoid(2u)). expf, not __expf: no fast-math
// approximations in this build.
struct Silu {
  static __device__ __forceinline__ float act(float g) { return g / (1.0f + expf(-g)); }
};

struct GeluTanh {
  static __device__ __forceinline__ float act(float g) {
    const float u2 = 2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + expf(-u2));
  }
};

template <typename Act, typename T, int VEC>
__global__ void act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ in, int64_t d) {
  const int64_t row = blockIdx.x;
  const T* gate = in + row * 2 * d;
  const T* up = gate + d;
  T* o = out + row * d;
  for (int64_t c = threadIdx.x; c < d / VEC; c += blockDim.x) {
    float g[VEC], u[VEC];
    load_f<T, VEC>(gate + c * VEC, g);
    load_f<T, VEC>(up + c * VEC, u);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      // The activation is rounded to the dtype before the multiply (HF's MLP).
      const float act = to_f(from_f<T>(Act::act(g[i])));
      g[i] = act * u[i];
    }
    store_f<T, VEC>(o + c * VEC, g);
  }
}

template <typename T, bool kAdd>
void launch_rms_norm(T* dst, T* src, const T* w, int64_t rows, int64_t n, float eps,
                     cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vec = n % V == 0 && is_aligned(dst, 16) && is_aligned(src, 16) && is_aligned(w, 16);
  const int64_t chunks = vec ? n / V : n;
  const dim3 grid(static_cast<unsigned>(rows));
  const int threads = threads_for(chunks, 1024);
  if (vec) {
    rms_norm_kernel<T, V, kAdd><<<grid, threads, 0, stream>>>(dst, src, w, n, eps);
  } else {
    rms_norm_kernel<T, 1, kAdd><<<grid, threads, 0, stream>>>(dst, src, w, n, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                   double eps) {
  const int64_t n = check_rms_norm(out, "out", input, "input", weight, "rms_norm");
  if (input.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    // src is only read when kAdd == false; the cast lets both variants share
    // one kernel signature.
    cuda::launch_rms_norm<scalar_t, false>(
        out.data_ptr<scalar_t>(), const_cast<scalar_t*>(input.const_data_ptr<scalar_t>()),
        weight.const_data_ptr<scalar_t>(), input.numel() / n, n, static_cast<float>(eps),
        stream);
  });
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  const int64_t n =
      check_rms_norm(input, "input", residual, "residual", weight, "fused_add_rms_norm");
  if (input.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    cuda::launch_rms_norm<scalar_t, true>(
        input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
        weight.const_data_ptr<scalar_t>(), input.numel() / n, n, static_cast<float>(eps),
        stream);
  });
}

namespace cuda {
namespace {
template <typename Act>
void act_and_mul(at::Tensor& out, const at::Tensor& input, const char* op) {
  const int64_t d = check_act_and_mul(out, input, op);
  if (out.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = out.numel() / d;
  // (a literal name: the dispatch macro wants a constant expression)
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "act_and_mul", [&] {
    using T = scalar_t;
    constexpr int V = kVec16<T>;
    T* o = out.data_ptr<T>();
    const T* in = input.const_data_ptr<T>();
    // Rows start at multiples of d (out) and 2d (input), so d % V == 0
    // plus aligned base pointers keeps every vector access aligned.
    const bool vec = d % V == 0 && is_aligned(o, 16) && is_aligned(in, 16);
    const int threads = threads_for(vec ? d / V : d, 1024);
    const dim3 grid(static_cast<unsigned>(rows));
    if (vec) {
      act_and_mul_kernel<Act, T, V><<<grid, threads, 0, stream>>>(o, in, d);
    } else {
      act_and_mul_kernel<Act, T, 1><<<grid, threads, 0, stream>>>(o, in, d);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
}  // namespace
}  // namespace cuda

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  cuda::act_and_mul<cuda::Silu>(out, input, "silu_and_mul");
}

void gelu_tanh_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  cuda::act_and_mul<cuda::GeluTanh>(out, input, "gelu_tanh_and_mul");
}

}  // namespace shardlm
