// Input validation of the linear ops (skinny_linear, quant_linear), shared by
// the CPU and CUDA implementations like the rest of checks.cpp.
#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "check_helpers.h"
#include "mixed_rows.h"
#include "ops.h"

namespace shardlm {

using checks::check_float;
using checks::check_same_device;

LinearDims check_skinny_linear(const at::Tensor& out, const at::Tensor& input,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "skinny_linear";
  check_float(weight, "weight", op);
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2, op,
              ": input must be [M, K] and weight [N, K], got ", input.sizes(), " and ",
              weight.sizes());
  const LinearDims d{input.size(0), weight.size(0), weight.size(1)};
  TORCH_CHECK(input.size(1) == d.k, op, ": input has ", input.size(1),
              " features but weight expects ", d.k);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == d.m && out.size(1) == d.n, op,
              ": out must have shape [", d.m, ", ", d.n, "], got ", out.sizes());
  for (const at::Tensor* t : {&input, &out}) {
    TORCH_CHECK(t->scalar_type() == weight.scalar_type(), op, ": input, weight and out must "
                "share a dtype, got ", t->scalar_type(), " and ", weight.scalar_type());
  }
  TORCH_CHECK(input.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), op,
              ": input, weight and out must be contiguous");
  check_same_device(weight, input, "input", op);
  check_same_device(weight, out, "out", op);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == d.n && bias->is_contiguous(), op,
                ": bias must be a contiguous [", d.n, "] tensor, got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), op, ": bias dtype ",
                bias->scalar_type(), " != weight dtype ", weight.scalar_type());
    check_same_device(weight, *bias, "bias", op);
  }
  return d;
}

namespace {
// Bytes of a block of `qtype`, and its weights, in *block_bytes and
// *weights_per_block; false for a type quant_linear does not read. The grouped
// layouts' blocks span 8 rows (cpu/quant_blocks.h).
bool block_geometry(int64_t qtype, int64_t* block_bytes, int64_t* weights_per_block) {
  *weights_per_block = 32;
  switch (qtype) {
    case 2: *block_bytes = 18; return true;  // Q4_0
    case 3: *block_bytes = 20; return true;  // Q4_1
    case 8: *block_bytes = 34; return true;  // Q8_0
    case 100: *block_bytes = 160; return true;  // Q4x8
    case 101: *block_bytes = 1184, *weights_per_block = 256; return true;  // Q4Kx8
    case 102: *block_bytes = 1680, *weights_per_block = 256; return true;  // Q6Kx8
    case 103: *block_bytes = 176; return true;  // Q5x8
    case 104: *block_bytes = 1440, *weights_per_block = 256; return true;  // Q5Kx8
    case 105: *block_bytes = 144; return true;  // Q40x8
    case 107: *block_bytes = 192; return true;  // Q51x8
    case 108: *block_bytes = 1104, *weights_per_block = 256; return true;  // IQ4x8
    case 109: *block_bytes = 144; return true;  // IQ4NLx8
    case 110: *block_bytes = 912, *weights_per_block = 256; return true;  // Q3Kx8
    case 111: *block_bytes = 672, *weights_per_block = 256; return true;  // Q2Kx8
    case 112:  // IQ3XXSx8
    case 113: *block_bytes = 1104, *weights_per_block = 256; return true;  // IQ3Sx8
    case 114:  // IQ2XXSx8
    case 115:  // IQ1Sx8
    case 116:  // IQ2XSx8
    case 117:  // IQ2Sx8
    case 118: *block_bytes = 912, *weights_per_block = 256; return true;  // IQ1Mx8
    default: return false;
  }
}

constexpr const char* kTypeNames = "Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4x8 = 100, Q4Kx8 = 101, "
                                   "Q6Kx8 = 102, Q5x8 = 103, Q5Kx8 = 104, Q40x8 = 105, Mixed = 106, "
                                   "Q51x8 = 107, IQ4x8 = 108, IQ4NLx8 = 109, Q3Kx8 = 110, "
                                   "Q2Kx8 = 111, IQ3XXSx8 = 112, IQ3Sx8 = 113, IQ2XXSx8 = 114, "
                                   "IQ1Sx8 = 115, IQ2XSx8 = 116, IQ2Sx8 = 117, IQ1Mx8 = 118";

// N and K of a Mixed blocks tensor (mixed_rows.h), every part checked.
std::pair<int64_t, int64_t> check_mixed(const at::Tensor& blocks, const char* op) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(0) == 1 &&
                  blocks.is_contiguous(), op,
              ": Mixed blocks must be a contiguous uint8 [1, bytes] tensor, got ",
              blocks.scalar_type(), " ", blocks.sizes());
  std::vector<mixed::Part> parts;
  int64_t k = 0;
  TORCH_CHECK(mixed::parse(blocks.const_data_ptr<uint8_t>(), blocks.numel(), parts, k), op,
              ": the Mixed blocks' header is malformed");
  int64_t n = 0;
  for (const mixed::Part& p : parts) {
    int64_t block_bytes = 0, weights_per_block = 0;
    TORCH_CHECK(block_geometry(p.qtype, &block_bytes, &weights_per_block), op,
                ": a Mixed part has block type ", p.qtype, " (", kTypeNames, " but not Mixed)");
    const int64_t rows_per_row = p.qtype >= 100 ? 8 : 1;
    TORCH_CHECK(p.rows % rows_per_row == 0 && p.bytes % (p.rows / rows_per_row) == 0 &&
                    p.bytes / (p.rows / rows_per_row) ==
                        k / weights_per_block * block_bytes &&
                    k % weights_per_block == 0, op,
                ": a Mixed part of type ", p.qtype, " with ", p.rows, " rows and ", p.bytes,
                " bytes does not hold ", k, "-wide rows");
    n += p.rows;
  }
  return {n, k};
}

// (N, K) of a weight held as GGML blocks of one type: a uint8 [rows, bytes per row] tensor of
// whole blocks, a row holding 8 weight rows in the grouped layouts (types from 100 on).
std::pair<int64_t, int64_t> blocks_dims(const at::Tensor& blocks, int64_t qtype,
                                        int64_t block_bytes, int64_t weights_per_block,
                                        const char* op) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, op,
              ": blocks must be a uint8 [N, bytes per row] tensor, got ", blocks.scalar_type(),
              " ", blocks.sizes());
  TORCH_CHECK(blocks.size(1) % block_bytes == 0, op, ": a row of ", blocks.size(1),
              " bytes is not a whole number of ", block_bytes, "-byte blocks");
  return {blocks.size(0) * (qtype >= 100 ? 8 : 1),
          blocks.size(1) / block_bytes * weights_per_block};
}

}  // namespace

LinearDims check_quant_linear(const at::Tensor& out, const at::Tensor& input,
                              const at::Tensor& blocks, int64_t qtype,
                              const std::optional<at::Tensor>& bias) {
  const char* op = "quant_linear";
  int64_t block_bytes = 0, weights_per_block = 32;
  TORCH_CHECK(qtype == mixed::kType || block_geometry(qtype, &block_bytes, &weights_per_block),
              op, ": block type ", qtype, " is not supported (", kTypeNames, ")");
  check_float(input, "input", op);
  TORCH_CHECK(input.dim() == 2, op, ": input must be [M, K], got ", input.sizes());
  LinearDims d{};
  if (qtype == mixed::kType) {
    TORCH_CHECK(blocks.device().is_cpu(), op, ": Mixed blocks are read on CPU only");
    const auto [n, k] = check_mixed(blocks, op);
    d = {input.size(0), n, k};
  } else {
    const auto [n, k] = blocks_dims(blocks, qtype, block_bytes, weights_per_block, op);
    d = {input.size(0), n, k};
  }
  TORCH_CHECK(input.size(1) == d.k, op, ": input has ", input.size(1),
              " features but the blocks hold ", d.k);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == d.m && out.size(1) == d.n, op,
              ": out must have shape [", d.m, ", ", d.n, "], got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": input and out must share a "
              "dtype, got ", input.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(input.is_contiguous() && blocks.is_contiguous() && out.is_contiguous(), op,
              ": input, blocks and out must be contiguous");
  TORCH_CHECK(input.device().is_cpu(), op, ": runs on CPU only; dequantize the weights for ",
              input.device());
  check_same_device(input, blocks, "blocks", op);
  check_same_device(input, out, "out", op);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == d.n && bias->is_contiguous(), op,
                ": bias must be a contiguous [", d.n, "] tensor, got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == input.scalar_type(), op, ": bias dtype ",
                bias->scalar_type(), " != input dtype ", input.scalar_type());
    check_same_device(input, *bias, "bias", op);
  }
  return d;
}

QuantRowsDims check_quant_rows(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype,
                               const at::Tensor& ids) {
  const char* op = "quant_rows";
  int64_t block_bytes = 0, weights_per_block = 32;
  TORCH_CHECK(block_geometry(qtype, &block_bytes, &weights_per_block), op, ": block type ",
              qtype, " is not supported (", kTypeNames, " but not Mixed)");
  const auto [n, k] = blocks_dims(blocks, qtype, block_bytes, weights_per_block, op);
  const QuantRowsDims d{ids.numel(), n, k};
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": ids must be an int64 [count] tensor, got ", ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == d.count &&
                  out.size(1) == d.k,
              op, ": out must be a float32 [", d.count, ", ", d.k, "] tensor, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(blocks.is_contiguous() && ids.is_contiguous() && out.is_contiguous(), op,
              ": blocks, ids and out must be contiguous");
  TORCH_CHECK(blocks.device().is_cpu(), op, ": runs on CPU only");
  check_same_device(blocks, ids, "ids", op);
  check_same_device(blocks, out, "out", op);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < d.count; ++i) {
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < d.n, op, ": id ", id[i], " is out of range for ",
                      d.n, " rows");
  }
  return d;
}

}  // namespace shardlm
