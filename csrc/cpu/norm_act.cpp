// CPU: rms_norm, fused_add_rms_norm, silu_and_mul, gelu_tanh_and_mul.
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

// Each op has a portable row function and, on x86, an AVX2 one that does the
// same float operations in the same order on 8 elements at a time (and hands
// the last n % 8 elements to the portable one), so both paths give the same
// bits; the one exception is the exp inside SiLU (see avx2::exp8).

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

// HF: hidden = residual + hidden in the model dtype; the *rounded* sum is
// what gets normalised and becomes the next residual.
template <typename T>
inline void add_row(T* x, T* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = from_f<T>(to_f(x[i]) + to_f(h[i]));
}

// HF LlamaMLP: act_fn(gate) * up with both ops in the model dtype, i.e. the
// SiLU result is rounded before the multiply.
template <typename T>
inline void silu_row(T* o, const T* gate, const T* up, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_f(gate[i]);
    const T act = from_f<T>(g / (1.0f + std::exp(-g)));
    o[i] = from_f<T>(to_f(act) * to_f(up[i]));
  }
}

// Gemma's act_fn, gelu(g, approximate="tanh") = 0.5 g (1 + tanh(u)) with
// u = sqrt(2/pi) (g + 0.044715 g^3), taken as g / (1 + exp(-2u)) (the same
// function, since 0.5 (1 + tanh(u)) = sigmoid(2u)): one exp like SiLU, so the
// AVX2 path reuses exp8, and no overflow: exp(-2u) = inf gives g / inf = -0.
// Rounded to the dtype before the multiply, as HF's MLP does.
constexpr float kGeluBeta2 = 2.f * 0.7978845608028654f;  // 2 sqrt(2/pi)
constexpr float kGeluKappa = 0.044715f;

template <typename T>
inline void gelu_tanh_row(T* o, const T* gate, const T* up, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_f(gate[i]);
    const float u2 = kGeluBeta2 * (g + kGeluKappa * g * g * g);
    const T act = from_f<T>(g / (1.0f + std::exp(-u2)));
    o[i] = from_f<T>(to_f(act) * to_f(up[i]));
  }
}

#if SHARDLM_HAVE_AVX2
namespace avx2 = cpu::avx2;

// Same lanes and order as cpu::sum_squares: 8 partial sums (multiply, then
// add: no FMA), then the tail, then the 8 partials one after another.
template <typename T>
SHARDLM_AVX2 float sum_squares_avx2(const T* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = avx2::load8(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float s = 0.f;
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    s += v * v;
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  for (int j = 0; j < 8; ++j) s += part[j];
  return s;
}

template <typename T>
SHARDLM_AVX2 void normalize_row_avx2(T* dst, const T* src, const T* w, int64_t n,
                                     float inv_rms) {
  const __m256 inv = _mm256_set1_ps(inv_rms);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = avx2::round_to<T>(_mm256_mul_ps(avx2::load8(src + i), inv));
    avx2::store8(dst + i, _mm256_mul_ps(avx2::load8(w + i), y));
  }
  normalize_row(dst + i, src + i, w + i, n - i, inv_rms);
}

template <typename T>
SHARDLM_AVX2 void add_row_avx2(T* x, T* h, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    avx2::store8(h + i, _mm256_add_ps(avx2::load8(x + i), avx2::load8(h + i)));
  }
  add_row(x + i, h + i, n - i);
}

template <typename T>
SHARDLM_AVX2 void silu_row_avx2(T* o, const T* gate, const T* up, int64_t d) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 g = avx2::load8(gate + i);
    const __m256 e = avx2::exp8(_mm256_xor_ps(g, sign));  // exp(-g)
    const __m256 act = avx2::round_to<T>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    avx2::store8(o + i, _mm256_mul_ps(act, avx2::load8(up + i)));
  }
  silu_row(o + i, gate + i, up + i, d - i);
}

// gelu_tanh_row's operations in its order (multiplies and adds, no FMA).
template <typename T>
SHARDLM_AVX2 void gelu_tanh_row_avx2(T* o, const T* gate, const T* up, int64_t d) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 beta2 = _mm256_set1_ps(-kGeluBeta2);  // negated: exp(-2u) directly
  const __m256 kappa = _mm256_set1_ps(kGeluKappa);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 g = avx2::load8(gate + i);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(kappa, g), g), g);
    const __m256 e = avx2::exp8(_mm256_mul_ps(beta2, _mm256_add_ps(g, g3)));
    const __m256 act = avx2::round_to<T>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    avx2::store8(o + i, _mm256_mul_ps(act, avx2::load8(up + i)));
  }
  gelu_tanh_row(o + i, gate + i, up + i, d - i);
}
#endif

template <typename T>
void rms_norm_impl(T* out, const T* in, const T* w, int64_t rows, int64_t n, float eps) {
  [[maybe_unused]] const bool simd = cpu::use_avx2();
  at::parallel_for(0, rows, cpu::grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * n;
      T* y = out + r * n;
      // out may alias input: the second pass reads x[i] before writing out[i].
#if SHARDLM_HAVE_AVX2
      if (simd) {
        normalize_row_avx2(y, x, w, n, inv_rms(sum_squares_avx2(x, n), n, eps));
        continue;
      }
#endif
      normalize_row(y, x, w, n, inv_rms(cpu::sum_squares(x, n), n, eps));
    }
  });
}

template <typename T>
void fused_add_rms_norm_impl(T* in, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  [[maybe_unused]] const bool simd = cpu::use_avx2();
  at::parallel_for(0, rows, cpu::grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = in + r * n;
      T* h = res + r * n;
#if SHARDLM_HAVE_AVX2
      if (simd) {
        add_row_avx2(x, h, n);
        normalize_row_avx2(x, h, w, n, inv_rms(sum_squares_avx2(h, n), n, eps));
        continue;
      }
#endif
      add_row(x, h, n);
      normalize_row(x, h, w, n, inv_rms(cpu::sum_squares(h, n), n, eps));
    }
  });
}

// One row function per activation: Silu / GeluTanh pick the portable and the
// AVX2 one.
struct Silu {
  template <typename T>
  static void row(T* o, const T* g, const T* u, int64_t d) { silu_row(o, g, u, d); }
#if SHARDLM_HAVE_AVX2
  template <typename T>
  static void row_avx2(T* o, const T* g, const T* u, int64_t d) { silu_row_avx2(o, g, u, d); }
#endif
};

struct GeluTanh {
  template <typename T>
  static void row(T* o, const T* g, const T* u, int64_t d) { gelu_tanh_row(o, g, u, d); }
#if SHARDLM_HAVE_AVX2
  template <typename T>
  static void row_avx2(T* o, const T* g, const T* u, int64_t d) {
    gelu_tanh_row_avx2(o, g, u, d);
  }
#endif
};

template <typename Act, typename T>
void act_and_mul_impl(T* out, const T* in, int64_t rows, int64_t d) {
  [[maybe_unused]] const bool simd = cpu::use_avx2();
  at::parallel_for(0, rows, cpu::grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * d;
#if SHARDLM_HAVE_AVX2
      if (simd) {
        Act::row_avx2(out + r * d, gate, gate + d, d);
        continue;
      }
#endif
      Act::row(out + r * d, gate, gate + d, d);
    }
  });
}

template <typename Act>
void act_and_mul_cpu(at::Tensor& out, const at::Tensor& input, const char* op) {
  const int64_t d = check_act_and_mul(out, input, op);
  if (out.numel() == 0) {
    return;
  }
  const int64_t rows = out.numel() / d;
  // (a literal name: the dispatch macro wants a constant expression)
  SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "act_and_mul", [&] {
    act_and_mul_impl<Act>(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), rows, d);
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
  act_and_mul_cpu<Silu>(out, input, "silu_and_mul");
}

void gelu_tanh_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cpu<GeluTanh>(out, input, "gelu_tanh_and_mul");
}

}  // namespace shardlm
