// CPU: rotary_embedding (neox / rotate_half layout) and reshape_and_cache
// (which converts k / v to the cache's dtype where the two differ).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <type_traits>

#include "../dispatch.h"
#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;

// Rotates one head in place. In float32 this is bit-identical to HF's
// `q * cos + rotate_half(q) * sin`: the same two products and one sum per
// element (the build passes -ffp-contract=off so no FMA fuses them).
template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(x[i]);
    const float x2 = to_f(x[i + half]);
    x[i] = from_f<T>(x1 * cos[i] - x2 * sin[i]);
    x[i + half] = from_f<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

#if SHARDLM_HAVE_AVX2
// The same two products and one difference / sum per element, 8 at a time:
// bit-identical to rotate_head (intrinsics are never contracted into FMAs).
template <typename T>
SHARDLM_AVX2 void rotate_head_avx2(T* x, const float* cos, const float* sin, int64_t half) {
  namespace avx2 = cpu::avx2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = avx2::load8(x + i);
    const __m256 x2 = avx2::load8(x + i + half);
    const __m256 c = _mm256_loadu_ps(cos + i);
    const __m256 s = _mm256_loadu_ps(sin + i);
    avx2::store8(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
    avx2::store8(x + i + half, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
  }
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]);
    const float x2 = to_f(x[i + half]);
    x[i] = from_f<T>(x1 * cos[i] - x2 * sin[i]);
    x[i + half] = from_f<T>(x2 * cos[i] + x1 * sin[i]);
  }
}
#endif

template <typename T>
void rotary_impl(const int64_t* positions, T* q, T* k, const float* cache, const RopeDims& d) {
  const int64_t half = d.rot_dim / 2;
  const int64_t per_token = (d.q_heads + d.k_heads) * d.rot_dim;
  [[maybe_unused]] const bool simd = cpu::use_avx2();
  at::parallel_for(0, d.num_tokens, cpu::grain_for(per_token), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + positions[t] * d.rot_dim;
      const float* sin = cos + half;
      // One dispatch per head: a head is at least 8 elements wide in practice.
      const auto rotate = [&](T* x) {
#if SHARDLM_HAVE_AVX2
        if (simd) return rotate_head_avx2(x, cos, sin, half);
#endif
        rotate_head(x, cos, sin, half);
      };
      for (int64_t h = 0; h < d.q_heads; ++h) rotate(q + t * d.q_row_stride + h * d.q_head_stride);
      for (int64_t h = 0; h < d.k_heads; ++h) rotate(k + t * d.k_row_stride + h * d.k_head_stride);
    }
  });
}

// dst = src rounded to C (round to nearest even, as torch's .to()).
template <typename T, typename C>
inline void convert_row(C* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f<C>(to_f(src[i]));
}

#if SHARDLM_HAVE_AVX2
// Same rounding 8 at a time (simd.h's conversions match c10's bit for bit).
template <typename T, typename C>
SHARDLM_AVX2 void convert_row_avx2(C* dst, const T* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) cpu::avx2::store8(dst + i, cpu::avx2::load8(src + i));
  convert_row(dst + i, src + i, n - i);
}
#endif

// Copies one head row of key / value into the cache: a memcpy where the
// dtypes agree, else a conversion.
template <typename T, typename C>
inline void cache_row(C* dst, const T* src, int64_t n, [[maybe_unused]] bool simd) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  } else {
#if SHARDLM_HAVE_AVX2
    if (simd) return convert_row_avx2(dst, src, n);
#endif
    convert_row(dst, src, n);
  }
}

template <typename T, typename C>
void reshape_and_cache_impl(const T* key, const T* value, C* key_cache, C* value_cache,
                            const int64_t* slots, const CacheWriteDims& d) {
  const int64_t row = d.kv_heads * d.head_dim;  // one token's entry in the cache
  const bool simd = cpu::use_avx2();
  at::parallel_for(0, d.num_tokens, cpu::grain_for(row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) {
        continue;  // padding token: nothing to cache
      }
      // slot = block * block_size + offset, and the cache is
      // [num_blocks, block_size, ...] contiguous, so the slot is the row index.
      C* kdst = key_cache + slot * row;
      C* vdst = value_cache + slot * row;
      for (int64_t h = 0; h < d.kv_heads; ++h) {
        cache_row(kdst + h * d.head_dim, key + t * d.k_row_stride + h * d.k_head_stride,
                  d.head_dim, simd);
        cache_row(vdst + h * d.head_dim, value + t * d.v_row_stride + h * d.v_head_stride,
                  d.head_dim, simd);
      }
    }
  });
}

// Index checks run before any write so a bad call leaves the tensors untouched.
void check_positions(const int64_t* positions, const RopeDims& d) {
  for (int64_t t = 0; t < d.num_tokens; ++t) {
    TORCH_CHECK(positions[t] >= 0 && positions[t] < d.max_position,
                "rotary_embedding: position ", positions[t], " of token ", t,
                " is outside cos_sin_cache [0, ", d.max_position, ")");
  }
}

void check_slots(const int64_t* slots, const CacheWriteDims& d) {
  const int64_t num_slots = d.num_blocks * d.block_size;
  for (int64_t t = 0; t < d.num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "reshape_and_cache: slot ", slots[t],
                " of token ", t, " is outside [-1, ", num_slots, ") (-1 marks padding)");
  }
}

}  // namespace

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                          int64_t head_size, const at::Tensor& cos_sin_cache) {
  const RopeDims d = check_rotary(positions, query, key, head_size, cos_sin_cache);
  if (d.num_tokens == 0) {
    return;
  }
  check_positions(positions.const_data_ptr<int64_t>(), d);
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    rotary_impl(positions.const_data_ptr<int64_t>(), query.data_ptr<scalar_t>(),
                key.data_ptr<scalar_t>(), cos_sin_cache.const_data_ptr<float>(), d);
  });
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const CacheWriteDims d =
      check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  if (d.num_tokens == 0 || d.kv_heads == 0 || d.head_dim == 0) {
    return;
  }
  check_slots(slot_mapping.const_data_ptr<int64_t>(), d);
  SHARDLM_DISPATCH_FLOAT_TYPES(key.scalar_type(), "reshape_and_cache", [&] {
    using T = scalar_t;
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "reshape_and_cache", [&] {
      reshape_and_cache_impl(key.const_data_ptr<T>(), value.const_data_ptr<T>(),
                             key_cache.data_ptr<cache_t>(), value_cache.data_ptr<cache_t>(),
                             slot_mapping.const_data_ptr<int64_t>(), d);
    });
  });
}

}  // namespace shardlm
