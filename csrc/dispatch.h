// Type dispatch over exactly the dtypes the ops accept. ATen's
// AT_DISPATCH_FLOATING_TYPES_AND2 would also instantiate every kernel for
// double, which validation rejects anyway: dead code that costs build time.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#define SHARDLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                       \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

// The KV cache's dtype, which may differ from the query's: the same three
// types bound to `cache_t` (not scalar_t), so it nests inside
// SHARDLM_DISPATCH_FLOAT_TYPES and the kernels see both types.
#define SHARDLM_DISPATCH_CACHE_TYPES(TYPE, NAME, ...)                                   \
  [&] {                                                                                 \
    switch (TYPE) {                                                                     \
      case at::ScalarType::Float: {                                                     \
        using cache_t = float;                                                          \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::Half: {                                                      \
        using cache_t = c10::Half;                                                      \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      case at::ScalarType::BFloat16: {                                                  \
        using cache_t = c10::BFloat16;                                                  \
        return __VA_ARGS__();                                                           \
      }                                                                                 \
      default:                                                                          \
        TORCH_CHECK(false, NAME, ": cache dtype ", TYPE, " is not supported");          \
    }                                                                                   \
  }()
