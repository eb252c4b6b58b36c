// CPU: quant_linear, out[M, N] = input[M, K] @ W[N, K]^T (+ bias) with W kept
// in GGML blocks (quant_blocks.h), never expanded to a dense copy.
//
// Decode (a few input rows) is a matrix-vector product whose speed is the
// bytes it reads, so a 4-bit weight costs about a sixth of its bfloat16 twin.
// Threads split the output rows; each block is unpacked to floats in
// registers and multiplied with the float32 input, accumulating in float32:
// the activations are never rounded. Each block contributes
//     d * sum_i(q_i x_i) + m * sum_i(x_i),
// the block sums of x computed once per call (prepare_input), so the inner
// loop is integer to float conversions and FMAs, no dequantization arithmetic.
//
// 4-bit weights are regrouped at load into Q4x8 (quant_blocks.h: 8 rows side
// by side; q4x8.cpp), where a vector lane is an output feature: fewer
// instructions per weight than the one-row kernels (block_gemv.cpp), which
// remain for Q8_0 and for weights kept as the file stores them.
//
// With int8 activations (the opt-in fast mode, int8_linear.h) the grouped
// layouts take integer dot products for every number of input rows.
//
// Batches and prefills (many rows) are compute bound. From 16 rows on, the
// grouped layouts and Q8_0 weights whose rows fill groups of 8 take the panel
// path (panel_linear.h); other weights (the one-row layouts) past a few rows
// have tiles of rows dequantized to a float buffer once and multiplied with
// every input row by torch's GEMM.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <vector>

#include "../dispatch.h"
#include "../mixed_rows.h"
#include "mixed_linear.h"
#include "../ops.h"
#include "block_gemv.h"
#include "cpu_utils.h"
#include "int8_linear.h"
#include "panel_linear.h"
#include "quant_blocks.h"
#include "q4x8.h"
#include "q6kx8.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;
using namespace cpu::quant;
using cpu::block_gemv::Activations;

// Where the panel path does not run (panel_linear.h), more input rows than
// this take the tiled GEMM path. The Q4x8 and Q8_0 matrix-vector kernels
// unpack a block once for several input rows, so they stay ahead of
// dequantizing tiles through decode batches (bench.quant_bench); the one-row
// 4-bit kernels (weights whose rows do not fill groups of 8) hand over sooner.
constexpr int64_t gemv_max_rows(int64_t qtype) {
  return grouped(qtype) || qtype == kQ8_0 ? 64 : 8;
}

// The paths of quant_linear_typed; only the matrix-vector kernels read the
// block sums and the nibble order.
enum class Path { kInt8, kPanel, kTiled, kGemv };

Activations prepare_input(const at::Tensor& input, int64_t qtype, int64_t m, int64_t k,
                          Path path) {
  thread_local std::vector<float> converted, sums;
  const float* x = nullptr;
  if (input.scalar_type() == at::kFloat) {
    x = input.const_data_ptr<float>();
  } else {
    if (static_cast<int64_t>(converted.size()) < m * k) converted.resize(m * k);
    SHARDLM_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quant_linear", [&] {
      const auto* src = input.const_data_ptr<scalar_t>();
      for (int64_t i = 0; i < m * k; ++i) converted[i] = to_f(src[i]);
    });
    x = converted.data();
  }
  // Only the matrix-vector kernels read sums (q6kx8.cpp makes its own 16-element ones).
  if (path != Path::kGemv || half_scaled(qtype)) return {x, nullptr, nullptr};
  const int64_t blocks = k / kBlock;
  if (static_cast<int64_t>(sums.size()) < m * blocks) sums.resize(m * blocks);
  for (int64_t i = 0; i < m * blocks; ++i) {
    float s = 0.f;
    for (int64_t t = 0; t < kBlock; ++t) s += x[i * kBlock + t];
    sums[i] = s;
  }
  namespace bg = cpu::block_gemv;
  return {x, sums.data(), bg::nibble_order(qtype) ? bg::to_nibble_order(x, m * k) : nullptr};
}

// W rows [n0, n1) as float32 into `dst` ([n1 - n0, K]), the reference's values exactly.
template <int64_t kType>
void dequantize_rows(float* dst, const uint8_t* w, int64_t n0, int64_t n1, int64_t k) {
  if constexpr (half_scaled(kType)) return cpu::q6kx8::dequantize_rows(dst, kType, w, n0, n1, k);
  if constexpr (grouped(kType)) return cpu::q4x8::dequantize_rows(dst, kType, w, n0, n1, k);
  const int64_t blocks = k / kBlock;
  const int64_t row_bytes = blocks * block_bytes(kType);
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    float q[kBlock];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t b = 0; b < blocks; ++b) {
        const Block blk = block_at<kType>(w + j * row_bytes + b * block_bytes(kType));
        quants_scalar<kType>(blk, q);
        float* o = dst + (j - n0) * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) {
          // Q4_0 as d * (q - 8), like GGML, so the tile equals the reference.
          o[i] = kType == kQ4_0 ? blk.d * (q[i] - 8.f) : blk.d * q[i] + blk.m;
        }
      }
    }
  });
}

// Rows ids[0..count) of W as float32 into out ([count, K]): an embedding lookup,
// one row of a grouped layout taken from its whole dequantized group.
template <int64_t kType>
void rows_at(float* out, const uint8_t* w, const int64_t* ids, int64_t count, int64_t k) {
  // A decode step looks up a row or a few; a prefill spreads its ids over the threads (the
  // dequantize_rows calls inside run inline there).
  at::parallel_for(0, count, 32, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> group;
    for (int64_t i = begin; i < end; ++i) {
      if constexpr (grouped(kType)) {
        if (static_cast<int64_t>(group.size()) < kGroupRows * k) group.resize(kGroupRows * k);
        const int64_t first = ids[i] / kGroupRows * kGroupRows;
        dequantize_rows<kType>(group.data(), w, first, first + kGroupRows, k);
        std::copy_n(group.data() + (ids[i] - first) * k, k, out + i * k);
      } else {
        dequantize_rows<kType>(out + i * k, w, ids[i], ids[i] + 1, k);
      }
    }
  });
}

// Tiles of about 4 MiB of float weights: dequantizing costs O(N K), the GEMM O(M N K).
template <int64_t kType>
void tiled_gemm(at::Tensor& out, const Activations& a, const uint8_t* w,
                const std::optional<at::Tensor>& bias, int64_t m, int64_t n, int64_t k) {
  const int64_t tile = std::max<int64_t>(16, (1 << 20) / k) / kGroupRows * kGroupRows;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < tile * k) buffer.resize(tile * k);
  const at::Tensor x = at::from_blob(const_cast<float*>(a.x), {m, k}, at::kFloat);
  const bool direct = out.scalar_type() == at::kFloat;
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    dequantize_rows<kType>(buffer.data(), w, n0, n0 + rows, k);
    const at::Tensor wt = at::from_blob(buffer.data(), {rows, k}, at::kFloat);
    at::Tensor dst = out.narrow(1, n0, rows);
    at::Tensor y = direct ? dst : at::empty({m, rows}, x.options());
    at::mm_out(y, x, wt.t());
    if (bias.has_value()) y.add_(bias->narrow(0, n0, rows).to(at::kFloat));
    if (!direct) dst.copy_(y);
  }
}

template <int64_t kType>
void quant_linear_typed(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, int64_t m, int64_t n, int64_t k) {
  const Path path =
      cpu::activation_precision() == cpu::ActivationPrecision::kInt8 && cpu::int8::takes(kType)
          ? Path::kInt8
      : cpu::panel::takes(kType, m, n, k) ? Path::kPanel
      : m > gemv_max_rows(kType)       ? Path::kTiled
                                       : Path::kGemv;
  const Activations a = prepare_input(input, kType, m, k, path);
  const auto* w = blocks.const_data_ptr<uint8_t>();
  SHARDLM_DISPATCH_FLOAT_TYPES(out.scalar_type(), "quant_linear", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    if (path == Path::kInt8) {
      cpu::int8::linear(o, kType, w,
                        cpu::int8::quantize_rows(a.x, m, k, cpu::int8::input_order(kType)), b, m,
                        n, k);
    } else if (path == Path::kPanel) {
      cpu::panel::linear(o, kType, w, a.x, b, m, n, k);
    } else if (path == Path::kTiled) {
      tiled_gemm<kType>(out, a, w, bias, m, n, k);
    } else {
      if constexpr (half_scaled(kType)) {
        cpu::q6kx8::gemv(o, kType, w, a.x, b, m, n, k);
      } else if constexpr (grouped(kType)) {
        cpu::q4x8::gemv(o, kType, w, a.x, a.xs, b, m, n, k);
      } else {
        cpu::block_gemv::gemv(o, kType, w, a, b, m, n, k);
      }
    }
  });
}

}  // namespace

void quant_rows_cpu(at::Tensor& out, const at::Tensor& blocks, int64_t qtype,
                    const at::Tensor& ids) {
  const QuantRowsDims d = check_quant_rows(out, blocks, qtype, ids);
  float* o = out.data_ptr<float>();
  const auto* w = blocks.const_data_ptr<uint8_t>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  switch (qtype) {
    case kQ4_0: return rows_at<kQ4_0>(o, w, id, d.count, d.k);
    case kQ4_1: return rows_at<kQ4_1>(o, w, id, d.count, d.k);
    case kQ4x8: return rows_at<kQ4x8>(o, w, id, d.count, d.k);
    case kQ4Kx8: return rows_at<kQ4Kx8>(o, w, id, d.count, d.k);
    case kQ6Kx8: return rows_at<kQ6Kx8>(o, w, id, d.count, d.k);
    case kQ5x8: return rows_at<kQ5x8>(o, w, id, d.count, d.k);
    case kQ40x8: return rows_at<kQ40x8>(o, w, id, d.count, d.k);
    case kQ5Kx8: return rows_at<kQ5Kx8>(o, w, id, d.count, d.k);
    case kQ51x8: return rows_at<kQ51x8>(o, w, id, d.count, d.k);
    case kIQ4x8: return rows_at<kIQ4x8>(o, w, id, d.count, d.k);
    case kIQ4NLx8: return rows_at<kIQ4NLx8>(o, w, id, d.count, d.k);
    case kQ3Kx8: return rows_at<kQ3Kx8>(o, w, id, d.count, d.k);
    case kQ2Kx8: return rows_at<kQ2Kx8>(o, w, id, d.count, d.k);
    case kIQ3XXSx8: return rows_at<kIQ3XXSx8>(o, w, id, d.count, d.k);
    case kIQ3Sx8: return rows_at<kIQ3Sx8>(o, w, id, d.count, d.k);
    case kIQ2XXSx8: return rows_at<kIQ2XXSx8>(o, w, id, d.count, d.k);
    case kIQ1Sx8: return rows_at<kIQ1Sx8>(o, w, id, d.count, d.k);
    case kIQ2XSx8: return rows_at<kIQ2XSx8>(o, w, id, d.count, d.k);
    case kIQ2Sx8: return rows_at<kIQ2Sx8>(o, w, id, d.count, d.k);
    case kIQ1Mx8: return rows_at<kIQ1Mx8>(o, w, id, d.count, d.k);
    default: return rows_at<kQ8_0>(o, w, id, d.count, d.k);
  }
}

void quant_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                      int64_t qtype, const std::optional<at::Tensor>& bias) {
  const LinearDims d = check_quant_linear(out, input, blocks, qtype, bias);
  if (d.m == 0 || d.n == 0) {
    return;
  }
  if (qtype == mixed::kType) {
    return cpu::mixed_linear(out, input, blocks, bias, d.m);
  }
  switch (qtype) {
    case kQ4_0: return quant_linear_typed<kQ4_0>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4_1: return quant_linear_typed<kQ4_1>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4x8: return quant_linear_typed<kQ4x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ4Kx8: return quant_linear_typed<kQ4Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ6Kx8: return quant_linear_typed<kQ6Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ5x8: return quant_linear_typed<kQ5x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ40x8: return quant_linear_typed<kQ40x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ5Kx8: return quant_linear_typed<kQ5Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ51x8: return quant_linear_typed<kQ51x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ4x8: return quant_linear_typed<kIQ4x8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ4NLx8: return quant_linear_typed<kIQ4NLx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ3Kx8: return quant_linear_typed<kQ3Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kQ2Kx8: return quant_linear_typed<kQ2Kx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ3XXSx8:
      return quant_linear_typed<kIQ3XXSx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ3Sx8: return quant_linear_typed<kIQ3Sx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ2XXSx8:
      return quant_linear_typed<kIQ2XXSx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ1Sx8: return quant_linear_typed<kIQ1Sx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ2XSx8: return quant_linear_typed<kIQ2XSx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ2Sx8: return quant_linear_typed<kIQ2Sx8>(out, input, blocks, bias, d.m, d.n, d.k);
    case kIQ1Mx8: return quant_linear_typed<kIQ1Mx8>(out, input, blocks, bias, d.m, d.n, d.k);
    default: return quant_linear_typed<kQ8_0>(out, input, blocks, bias, d.m, d.n, d.k);
  }
}

}  // namespace shardlm
