// quant_linear with int8 activations, the opt-in fast mode
// (cpu::activation_precision(), cpu_utils.h) for the 8-row grouped weight
// layouts (quant_blocks.h): each 32-element block of an input row is rounded
// to int8 as GGML's Q8_0 rounds it, x = dx * xq with dx = max|x| / 127 and
// xq = round(x / dx) (to nearest even), and the kernels take integer dot
// products of quants and xq (AVX-512 VNNI, AVX2 or portable), so a block costs
// a few instructions where the exact kernels (q4x8.cpp, q6kx8.cpp) convert
// and multiply every weight as a float. The result is the dequantized weight
// times the rounded input, exactly (integer sums) up to the float summation
// order of the block terms: what worker/ops/reference.py computes.
#pragma once

#include <cstdint>

namespace shardlm::cpu::int8 {

// Input rows rounded to int8, in thread-local buffers valid until the next
// call on this thread. Within each block the bytes are in the order the
// kernels read them: byte 8s + 4p + i is element 8s + 2i + p, so a 32-bit
// word holds the inputs of one lane's even (p = 0) or odd (p = 1) quants of a
// nibble word (quant_blocks.h).
struct Int8Rows {
  const int8_t* q;     // [M, K] in that order
  const float* scale;  // [M, K / 32]: dx per block
  const float* sum32;  // [M, K / 32]: dx * sum(xq) per block
  const float* sum16;  // [M, K / 16]: dx * sum(xq) per half block
};

// Elements per sum16 entry: half a block, the span of a Q6_K scale.
constexpr int64_t kHalf = 16;

// The byte order of a block's rounded inputs, which follows how the weights'
// kernels unpack their quants (4 a 32-bit lane, meeting one input word):
// kNibble, nibble words' even and odd quants (the 4- to 6-bit layouts); kTwoBit,
// 2-bit words' quants t, t + 4, t + 8, t + 12 of each half block (Q3Kx8,
// Q2Kx8: int8_halves.h).
enum class InputOrder { kNibble, kTwoBit };

// Where element i of a block sits in that order.
constexpr int64_t position(int64_t i, InputOrder order = InputOrder::kNibble) {
  if (order == InputOrder::kTwoBit) {
    const int64_t u = i % kHalf;
    return kHalf * (i / kHalf) + 4 * (u % 4) + u / 4;
  }
  return 8 * (i / 8) + 4 * (i % 2) + (i % 8) / 2;
}

// Rounds x [m, k] (int8_rows.cpp), its bytes in `order`.
Int8Rows quantize_rows(const float* x, int64_t m, int64_t k,
                       InputOrder order = InputOrder::kNibble);

// Whether the fast mode covers weights of `qtype` (the grouped layouts), and
// the order their kernels read the input in.
bool takes(int64_t qtype);
InputOrder input_order(int64_t qtype);

// out[m, n] = x @ W^T (+ bias) for x as quantize_rows left it.
template <typename T>
void linear(T* out, int64_t qtype, const uint8_t* w, const Int8Rows& x, const T* bias, int64_t m,
            int64_t n, int64_t k);

}  // namespace shardlm::cpu::int8
