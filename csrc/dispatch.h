// Type dispatch over exactly the dtypes the ops accept. ATen's
// AT_DISPATCH_FLOATING_TYPES_AND2 would also instantiate every kernel for
// double, which validation rejects anyway: dead code that costs build time.
#pragma once

#include <ATen/Dispatch.h>

#define SHARDLM_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                       \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
