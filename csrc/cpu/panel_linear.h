// The panel path of quant_linear for batched decode and prefills:
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias), accumulated in float32.
//
// With more than a few input rows the product is bound by arithmetic, not by
// the bytes of the weights. So each group of 8 weight rows is unpacked once
// into a float panel ([K][8], lane = output feature; exactly the reference's
// dequantized values), and the panel is multiplied with tiles of up to 12
// input rows held in registers: one load and up to twelve FMAs per 8 weights,
// the unpacking paid once per group per pass of input rows. With AVX-512 four
// groups are unpacked side by side ([K][32]) and a tile of up to 12 rows holds
// 32 features in two vectors per row.
#pragma once

#include <cstdint>

namespace shardlm::cpu::panel {

// The panel path takes Q8_0 from kMinRows input rows, the grouped layouts from
// kGroupedMinRows (or from the int16 precision's panel16::kMinRows, where it
// rounds). Below, the matrix-vector kernels win: Q8_0's about even at 12 rows
// on SmolLM2's shapes (bench.quant_bench); the grouped layouts' exact ones,
// since they read their quants as subnormals and look ahead into L2, up to
// about 48 (2026-11-29, 2 threads, GFLOP/s matrix-vector / panel at 16, 32 and
// 64 rows: SmolLM2's Q4x8 gate/up 186-188 / 138-139, 191-193 / 169-171,
// 194 / 193-194; the ~1B Q4_K_M file's Q4Kx8 16384 x 2048 199-201 / 157-158,
// 197-202 / 186-187, 199-201 / 205-206; its Q6Kx8 head 185-186 / 146-150,
// 186 / 178-180, 185-186 / 200-201).
// Above, it beats torch's GEMM on dequantized tiles, which prefills of more
// than 256 rows took until 2026-11-28: at 512 rows 162-209 against 136-196
// GFLOP/s on SmolLM2's and Llama-3.2-1B's matrices (K of 512 to 8192), ahead
// on all but the down projections of K = 1536 (within 3% at 512 rows, 5-15%
// behind from 1024 rows).
// Longer inputs go through in chunks of at most kMaxRows rows, which bounds
// the transposed copy of the input a chunk makes (512 rows measured 0-7%
// ahead of 256 and even with 1024 on 1,024-row products).
constexpr int64_t kMinRows = 16;
constexpr int64_t kGroupedMinRows = 48;
constexpr int64_t kMaxRows = 512;

// Whether the panel path takes m input rows against this [n, k] weight: a
// grouped layout (Q4x8 and the other 8-row ones), or Q8_0 with whole groups of
// 8 rows.
bool takes(int64_t qtype, int64_t m, int64_t n, int64_t k);

// out (row-major [m, n]) from the blocks at `w` of type `qtype` (see takes);
// x is float32 [m, k].
template <typename T>
void linear(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias, int64_t m,
            int64_t n, int64_t k);

}  // namespace shardlm::cpu::panel
