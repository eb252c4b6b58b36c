// The Q4x8 kernels (q4x8.cpp): the matrix-vector product of decode (one group
// of 8 weight rows, quant_blocks.h, or with AVX-512 two groups, against up to
// 4 input rows at a time, on AVX-512, AVX2 or portably), and a group's rows unpacked to floats for the panel and
// tiled paths of more input rows (panel_linear.cpp, quant_linear.cpp).
#pragma once

#include <cstdint>

namespace shardlm::cpu::q4x8 {

// The input rows (`count` floats, rows of K, a multiple of 32) as group_dot
// reads them: for the AVX2 kernel pre-scaled (see q4x8.cpp) into a
// thread-local buffer valid until the next call on this thread, for the
// portable one as they are.
const float* prepare(const float* x, int64_t count, bool avx2);

// The most input rows one rows_dot call takes.
constexpr int64_t kMaxRows = 4;

// acc[8 i + r] = dot(row 8g + r of the group at `w` (K / 32 group-blocks),
// input row i) for i < rows (1 .. kMaxRows): input row i is xp + i * x_stride
// in prepare(..., avx2)'s form, its 32-element block sums xs + i * xs_stride.
// The quants are unpacked once for all the rows.
void rows_dot(float* acc, const uint8_t* w, const float* xp, int64_t x_stride, const float* xs,
              int64_t xs_stride, int64_t rows, int64_t k, bool avx2);

// The group at `w` (8 rows of K) as float32 in `panel` (weight i of row r at
// stride * i + r: [K][8] for a stride of 8, lanes 0..7 of [K][stride] when
// groups are unpacked side by side), d * q + m exactly as the reference
// computes it; the operand of the batched kernel (panel_linear.cpp).
void unpack_panel(float* panel, const uint8_t* w, int64_t k, int64_t stride, bool avx2);

// out[m, n] = x @ W^T (+ bias) by rows_dot (with AVX-512, on pairs of groups),
// threads splitting the groups; xs
// holds x's 32-element block sums.
template <typename T>
void gemv(T* out, const uint8_t* w, const float* x, const float* xs, const T* bias, int64_t m,
          int64_t n, int64_t k);

// Rows [n0, n1) (multiples of 8) as float32 into `dst` ([n1 - n0, K]),
// d * q + m exactly as the reference computes it.
void dequantize_rows(float* dst, const uint8_t* w, int64_t n0, int64_t n1, int64_t k);

}  // namespace shardlm::cpu::q4x8
