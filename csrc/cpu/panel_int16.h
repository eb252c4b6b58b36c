// The panel path (panel_linear.h) with 14-bit integer operands, the int16
// activation precision (cpu::ActivationPrecision::kInt16): for products of
// kMinRows input rows or more, each 32-element block of an input row and of a
// weight row (as dequantized into the panel) is rounded to integers of at most
// kLevels in magnitude with one float scale, s = max|v| / kLevels and
// q = round(v / s) (to nearest even), and the kernels take integer dot
// products of the pairs (AVX-512 VNNI's vpdpwssd: two int16 products a 32-bit
// lane, twice the multiply-adds of a float32 FMA; AVX2's vpmaddwd; portable).
// A block's integer sum is exact and scaled once: sw * sx * sum(qw qx). The
// rounding error of either operand is at most 1 / 16382 of its block's largest
// magnitude, 64 times finer than the int8 mode's, so prefills keep the exact
// engine's top-1 choices where the int8 mode does not. Decode steps of fewer
// rows stay exact. worker/ops/reference.py computes the same product.
#pragma once

#include <cstdint>

namespace shardlm::cpu::panel16 {

// Input rows from which the int16 precision rounds. Below, rounding each
// weight panel costs more than the faster dot products save (2 threads,
// SmolLM2's and Llama-3.2-1B's matrices: 3-7% slower than the exact panel at
// 16 rows, 13-18% faster at 32, 35-50% at 128), so those products stay exact.
constexpr int64_t kMinRows = 32;

// 32 products of magnitude at most kLevels^2 sum within int32:
// 32 * 8191^2 = 2,146,959,392 < 2^31.
constexpr int32_t kLevels = 8191;

// Rounds blocks [first, last) of `rows` input rows (row-major x [rows, k])
// into a tile: words [k / 2][rows] (the int16 pair of elements 2i, 2i + 1 of
// row r at words[i * rows + r]) and scales [k / 32][rows].
void round_rows(int32_t* words, float* scales, const float* x, int64_t rows, int64_t k,
                int64_t first, int64_t last);

// Rounds a float panel [k][lanes] (lanes a multiple of 8) into words
// [k / 2][lanes] (lane l's pair of rows 2i, 2i + 1 at words[i * lanes + l])
// and scales [k / 32][lanes].
void round_panel(int32_t* words, float* scales, const float* panel, int64_t lanes, int64_t k);

// acc[r * lanes + l] = sum over blocks of the scaled integer dot products of
// panel lane l and tile row r, for the `rows` rows of a tile rounded by
// round_rows (1 to 12).
void multiply(float* acc, const int32_t* panel_words, const float* panel_scales, int64_t lanes,
              const int32_t* tile_words, const float* tile_scales, int64_t rows, int64_t k);

}  // namespace shardlm::cpu::panel16
