// The matrix-vector kernels of decode for weights kept in the file's own
// blocks, one weight row at a time: Q4_0, Q4_1 (rows that do not fill groups
// of 8; the rest are regrouped, q4x8.cpp) and Q8_0, on AVX-512, AVX2 or
// portably. quant_linear.cpp picks the path and prepares the input.
#pragma once

#include <cstdint>

namespace shardlm::cpu::block_gemv {

// The input as float32 with its 32-element block sums (quant_linear.cpp's
// prepare_input makes them in thread-local buffers).
struct Activations {
  const float* x;         // [M, K]
  const float* xs;        // [M, K / 32]
  const float* nibble_x;  // x in the AVX2 4-bit order (quants_avx2), or null
};

// Whether the 4-bit AVX2 path runs (it reads Activations::nibble_x).
bool nibble_order(int64_t qtype);

// x in that order (quants_avx2): a thread-local buffer valid until the next
// call on this thread.
const float* to_nibble_order(const float* x, int64_t count);

// out[m, n] = x @ W^T (+ bias), threads splitting the output rows; qtype is
// kQ4_0, kQ4_1 or kQ8_0.
template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const Activations& a, const T* bias,
          int64_t m, int64_t n, int64_t k);

}  // namespace shardlm::cpu::block_gemv
