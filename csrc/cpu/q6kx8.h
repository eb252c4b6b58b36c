// The Q6Kx8 and Q3Kx8 kernels (q6kx8.cpp; layouts in quant_blocks.h): GGML's
// Q6_K and Q3_K regrouped 8 rows side by side, `qtype` picking the layout. The same three entry points as q4x8.h: the
// matrix-vector product of decode (AVX-512, AVX2 or portable), a group
// unpacked to a float panel (panel_linear.cpp) and rows dequantized for the
// tiled GEMM (quant_linear.cpp), each equal to the GGML reference's values.
#pragma once

#include <cstdint>

namespace shardlm::cpu::q6kx8 {

// out[m, n] = x @ W^T (+ bias), threads splitting the groups of 8 rows.
template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias, int64_t m,
          int64_t n, int64_t k);

// The group at `w` (8 rows of K) as float32 into lanes 0..7 of `panel`
// (weight i of row r at stride * i + r).
void unpack_panel(float* panel, int64_t qtype, const uint8_t* w, int64_t k, int64_t stride,
                  bool avx2);

// Rows [n0, n1) (multiples of 8) as float32 into `dst` ([n1 - n0, K]).
void dequantize_rows(float* dst, int64_t qtype, const uint8_t* w, int64_t n0, int64_t n1,
                     int64_t k);

}  // namespace shardlm::cpu::q6kx8
