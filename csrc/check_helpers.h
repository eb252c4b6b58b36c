// The metadata checks every op's validation uses (checks.cpp,
// checks_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace shardlm::checks {

inline bool is_float_type(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

inline void check_float(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(is_float_type(t), op, ": ", name,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name,
                              const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the other tensors are on ", ref.device());
}

}  // namespace shardlm::checks
