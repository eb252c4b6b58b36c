// The panel path of quant_linear for batched decode and short prefills:
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias), accumulated in float32.
//
// With more than a few input rows the product is bound by arithmetic, not by
// the bytes of the weights. So each group of 8 weight rows is unpacked once
// into a float panel ([K][8], lane = output feature; exactly the reference's
// dequantized values), and the panel is multiplied with tiles of up to 12
// input rows held in registers: one load and up to twelve FMAs per 8 weights,
// the unpacking paid once per group instead of once per input row. With
// AVX-512 four groups are unpacked side by side ([K][32]) and a tile of up to
// 12 rows holds 32 features in two vectors per row.
#pragma once

#include <cstdint>

namespace shardlm::cpu::panel {

// The input rows the panel path runs for. Below, the matrix-vector kernels
// win (bench.quant_bench: about even at 12 rows on SmolLM2's shapes); above,
// torch's GEMM on dequantized tiles is as fast or faster (10% at 1024 rows of
// K = 1536), its dequantizing cost spread over enough rows.
constexpr int64_t kMinRows = 16;
constexpr int64_t kMaxRows = 256;

// Whether the panel path takes m input rows against this weight: Q4x8, or
// Q8_0 with whole groups of 8 rows.
bool takes(int64_t qtype, int64_t m, int64_t n);

// out (row-major [m, n]) from the blocks at `w` of type `qtype` (see takes);
// x is float32 [m, k].
template <typename T>
void linear(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias, int64_t m,
            int64_t n, int64_t k);

}  // namespace shardlm::cpu::panel
