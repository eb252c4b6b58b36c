// quant_linear's Mixed weights on CPU (mixed_linear.cpp, layout in mixed_rows.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace shardlm::cpu {

// out [m, N] = input @ W^T (+ bias) for a checked Mixed weight W.
void mixed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                  const std::optional<at::Tensor>& bias, int64_t m);

}  // namespace shardlm::cpu
