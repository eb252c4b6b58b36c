// The panel path (panel_linear.h) with 14-bit integer operands, the int16
// activation precision (cpu::ActivationPrecision::kInt16): for products of
// kMinRows input rows or more whose K is a multiple of kBlock, each
// kBlock-element block of an input row is rounded to integers of at most
// kInputLevels in magnitude with one float scale, s = max|v| / kInputLevels and
// q = round(v / s) (to nearest even), and each weight row (as dequantized into
// the panel) likewise over its whole K, to at most kWeightLevels; the kernels
// take integer dot products of the pairs (AVX-512 VNNI's vpdpwssd: two int16
// products a 32-bit lane, twice the multiply-adds of a float32 FMA; AVX2's
// vpmaddwd; portable). A block's integer sum is exact and scaled once by its
// input scale, the row's total once by the weight row's scale.
//
// The input's rounding error is at most 1 / 16382 of its block's largest
// magnitude, 64 times finer than the int8 mode's; the weight's at most 1 /
// 8190 of its row's, far below the error of the 4- to 8-bit quantization the
// weights come from. So prefills keep the exact engine's top-1 choices where
// the int8 mode does not. Decode steps of fewer rows stay exact.
// worker/ops/reference.py computes the same product.
//
// Blocks of 64 inputs and one weight scale a row (until 2026-11-28: blocks of
// 32 on both sides, each block's sum scaled by the product of two scales):
// the conversion and scaling of a block's sums was 19% of the vpdpwssd work,
// now 6%; the int16 products of SmolLM2's and Llama-3.2-1B's matrices ran 6-13%
// faster.
#pragma once

#include <cstdint>

#include "simd.h"

namespace shardlm::cpu::panel16 {

// Input rows from which the int16 precision rounds. Below, rounding each
// weight panel costs more than the faster dot products save (2 threads,
// SmolLM2's and Llama-3.2-1B's matrices: 3-7% slower than the exact panel at
// 16 rows, 13-18% faster at 32, 35-50% at 128), so those products stay exact.
constexpr int64_t kMinRows = 32;

// Inputs a block: one scale each, one integer sum each.
constexpr int64_t kBlock = 64;

// A block's 64 products of magnitude at most kInputLevels * kWeightLevels sum
// within int32: 64 * 8191 * 4095 = 2,146,697,280 < 2^31.
constexpr int32_t kInputLevels = 8191;
constexpr int32_t kWeightLevels = 4095;

// Whether the int16 precision can take a product over K inputs.
constexpr bool takes(int64_t k) { return k % kBlock == 0; }

// Rounds `rows` input rows (row-major x [rows, k]) into a tile: words
// [rows][k / 2] (the int16 pair of elements 2i, 2i + 1 of row r at
// words[r * k / 2 + i]) and scales [k / kBlock][rows].
void round_rows(int32_t* words, float* scales, const float* x, int64_t rows, int64_t k);

// Rounds a float panel [k][lanes] (lanes a multiple of 8; lane l one weight
// row) into words [k / 2][lanes] (lane l's pair of rows 2i, 2i + 1 at
// words[i * lanes + l]) and one scale a lane, scales [lanes].
void round_panel(int32_t* words, float* scales, const float* panel, int64_t lanes, int64_t k);

#if SHARDLM_HAVE_AVX2
// round_panel of the panel that 8 Q8_0 weight rows (row-major blocks,
// `row_bytes` apart) unpack into, into lanes 0..7 of words [k / 2][lanes] and
// scales[0..7], without the float panel: the same words and scales. A row's
// largest magnitude is its blocks' largest |d| max|q| (each d q is exact in
// float32), found from the quant bytes.
void round_q8_0_rows(int32_t* words, float* scales, const uint8_t* rows, int64_t row_bytes,
                     int64_t k, int64_t lanes);
#endif

// acc[r * lanes + l] = the scaled integer dot products of panel lane l and
// tile row r summed over the blocks, times the lane's scale, for the `rows`
// rows of a tile rounded by round_rows (1 to 12).
void multiply(float* acc, const int32_t* panel_words, const float* panel_scales, int64_t lanes,
              const int32_t* tile_words, const float* tile_scales, int64_t rows, int64_t k);

}  // namespace shardlm::cpu::panel16
