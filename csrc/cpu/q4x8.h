// The Q4x8 kernels (q4x8.cpp): the matrix-vector product of decode
// (one group of 8 weight rows, quant_blocks.h, against up to 4 input rows at a
// time, or with AVX-512 two groups against up to 8; on AVX-512, AVX2 or
// portably), and a
// group's rows unpacked to floats for the panel and tiled paths of more input
// rows (panel_linear.cpp, quant_linear.cpp). `qtype` is kQ4x8, kQ40x8, kQ4Kx8,
// kQ5x8, kQ51x8 or kQ5Kx8 (the layouts: nibble_layouts.h).
#pragma once

#include <cstdint>

namespace shardlm::cpu::q4x8 {

// The group at `w` (8 rows of K) as float32 in `panel` (weight i of row r at
// stride * i + r: [K][8] for a stride of 8, lanes 0..7 of [K][stride] when
// groups are unpacked side by side), d * q + m exactly as the reference
// computes it; the operand of the batched kernel (panel_linear.cpp).
void unpack_panel(float* panel, int64_t qtype, const uint8_t* w, int64_t k, int64_t stride,
                  bool avx2);

// out[m, n] = x @ W^T (+ bias), threads splitting the groups (with AVX-512
// taken in pairs); xs holds x's 32-element block sums.
template <typename T>
void gemv(T* out, int64_t qtype, const uint8_t* w, const float* x, const float* xs,
          const T* bias, int64_t m, int64_t n, int64_t k);

// Rows [n0, n1) (multiples of 8) as float32 into `dst` ([n1 - n0, K]),
// d * q + m exactly as the reference computes it.
void dequantize_rows(float* dst, int64_t qtype, const uint8_t* w, int64_t n0, int64_t n1,
                     int64_t k);

}  // namespace shardlm::cpu::q4x8
