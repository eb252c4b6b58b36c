// CPU: rms_norm, fused_add_rms_norm, silu_and_mul.
//
// Rounding follows Hugging Face's Llama modules step by step (see the
// comments below) so that low-precision results match the eager model, not
// merely "a" correct RMSNorm.
#include <ATen/Parallel.h>

#include <cmath>

#include "../dispatch.h"
#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;

// HF LlamaRMSNorm: y = (x.float() * rsqrt(mean(x^2) + eps)).to(dtype);
// out = weight * y, the product taken in the model dtype (i.e. rounded).
template <typename T>
inline void normalize_row(T* dst, const T* src, const T* w, int64_t n, float inv_rms) {
  for (int64_t i = 0; i < n; ++i) {
    const T y = from_f<T>(to_f(src[i]) * inv_rms);
    dst[i] = from_f<T>(to_f(w[i]) * to_f(y));
  }
}

inline float inv_rms(float sum_sq, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

template <typename T>
void rms_norm_impl(T* out, const T* in, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, cpu::grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * n;
      // out may alias input: the second pass reads x[i] before writing out[i].
      normalize_row(out + r * n, x, w, n, inv_rms(cpu::sum_squares(x, n), n, eps));
    }
  });
}

template <typename T>
void fused_add_rms_norm_impl(T* in, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, cpu::grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = in + r * n;
      T* h = res + r * n;
      // HF: hidden = residual + hidden in the model dtype, then normalise the
      // *rounded* sum (which also becomes the next residual).
      float acc = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const T s = from_f<T>(to_f(x[i]) + to_f(h[i]));
        h[i] = s;
        const float sf = to_f(s);
        acc += sf * sf;
      }
      normalize_row(x, h, w, n, inv_rms(acc, n, eps));
    }
  });
}

// HF LlamaMLP: act_fn(gate) * up with both ops in the model dtype, i.e. the
// SiLU result is rounded before the multiply.
template <typename T>
void silu_and_mul_impl(T* out, const T* in, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, cpu::grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * d;
      const T* up = gate + d;
      T* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float g = to_f(gate[i]);
        const T act = from_f<T>(g / (1.0f + std::exp(-g)));
        o[i] = from_f<T>(to_f(act) * to_f(up[i]));
      }
    }
  });
}

}  // namespace

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  double eps) {
  const int64_t n = check_rms_norm(out, "out", input, "input", weight, "rms_norm");
  if (input.numel() == 0) {
    return;
  }
  const int64_t rows = input.numel() / n;
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "rms_norm", [&] {
    rms_norm_impl(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                  weight.const_data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
  });
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double eps) {
  const int64_t n =
      check_rms_norm(input, "input", residual, "residual", weight, "fused_add_rms_norm");
  if (input.numel() == 0) {
    return;
  }
  const int64_t rows = input.numel() / n;
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_impl(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.const_data_ptr<scalar_t>(), rows, n,
                            static_cast<float>(eps));
  });
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  const int64_t d = check_silu_and_mul(out, input);
  if (out.numel() == 0) {
    return;
  }
  const int64_t rows = out.numel() / d;
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl(out.data_ptr<scalar_t>(),
                      input.const_data_ptr<scalar_t>(), rows, d);
  });
}

}  // namespace shardlm
