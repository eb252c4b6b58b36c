// Q8_0 matrix-vector kernels on AVX-512 in the scaled order (block_gemv.cpp
// calls them for the matrices scaled_order picks).
//
// A block's quants are scaled by its d before they meet any input row: d * q
// is exact (an 8-bit quant times a float16 scale needs at most 19 bits), so an
// input row costs two FMAs a block, where summing q * x and scaling the sum
// (block_gemv.cpp's order) costs three. Rows a step verifies against the output
// head, or a decode batch's, then cost the FMAs they need: SmolLM2's 576-wide
// matrices at 2 to 8 input rows 11-33% faster, one row as fast (README,
// *Speculative decoding*). One input row pays one multiply a block more, which
// SmolLM2's rows hide; longer rows, whose eight-row stretch outruns the
// prefetch distance, did not in the runs made (a ~1B shape's, 3-11% slower at
// one row, in runs about that noisy), so only matrices whose eight rows fit
// that distance take this order and the rest keep block_gemv.cpp's.
//
// Every input row sums in one order, however many rows a call has: each
// block's low and high 16 elements in their own accumulator, the two added at
// the end. So a sequence decoded alone, beside others, or in a step verifying
// its drafts gets the same bits.
#pragma once

#include <cstdint>

namespace shardlm::cpu::q8_0 {

// Weight rows one decode pass takes (weights_avx512).
constexpr int64_t kPassRows = 8;

// Whether a Q8_0 matrix of `row_bytes` a row takes these kernels on AVX-512.
bool scaled_order(int64_t row_bytes);

// acc[r] = dot(the weight row at w, input row r) for r < rows (1 to 8), the
// input rows x_stride floats apart, k elements each.
void rows_avx512(float* acc, const uint8_t* w, const float* x, int64_t x_stride, int64_t rows,
                 int64_t k);

// acc[i] = dot(weight row i, x) for the kPassRows rows from w, row_bytes apart.
void weights_avx512(float* acc, const uint8_t* w, int64_t row_bytes, const float* x, int64_t k);

}  // namespace shardlm::cpu::q8_0
