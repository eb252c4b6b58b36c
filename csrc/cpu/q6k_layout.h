// Where GGML's Q6_K regrouped as Q6Kx8 (quant_blocks.h) keeps each part of a
// group's super-block: the kernels of q6kx8.cpp (float inputs) and of
// int8_linear.cpp (int8 inputs) both read it through these.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

namespace shardlm::cpu::q6kx8::layout {

using quant::half_at;
using quant::kBlock;
using quant::kQ6SuperGroupBytes;
using quant::kSuperBlocks;

constexpr int64_t kHalf = 16;          // weights per scale
constexpr int64_t kHeaderBytes = 144;  // d[8] float16, sc[16][8] int8
constexpr int64_t kBlockBytes = 192;   // nibble words (128), high-bit words (64)

inline const uint8_t* super_of(const uint8_t* w, int64_t b) {
  return w + b / kSuperBlocks * kQ6SuperGroupBytes;
}

// Block b's nibble words; its high-bit words follow 128 bytes on.
inline const uint8_t* words_of(const uint8_t* w, int64_t b) {
  return super_of(w, b) + kHeaderBytes + kBlockBytes * (b % kSuperBlocks);
}

// Where block b's stretch of the group's bytes begins: the super-block's
// header is read with its first block (the stretch ends at words_of + kBlockBytes).
inline const uint8_t* stream_begin(const uint8_t* w, int64_t b) {
  return b % kSuperBlocks == 0 ? super_of(w, b) : words_of(w, b);
}

// Byte offset, in the super-block, of the 8 rows' int8 scales of half h of block b.
inline int64_t scales_at(int64_t b, int64_t h) { return 16 + 8 * (2 * (b % kSuperBlocks) + h); }

inline float scale_of(const uint8_t* w, int64_t b, int64_t h, int64_t r) {
  const uint8_t* s = super_of(w, b);
  return half_at(s + 2 * r) * static_cast<float>(static_cast<int8_t>(s[scales_at(b, h) + r]));
}

inline uint32_t word_at(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Row r's quant i (0..31) of block b, 0..63.
inline int quant_of(const uint8_t* w, int64_t b, int64_t r, int64_t i) {
  const uint8_t* q = words_of(w, b);
  const uint32_t lo = (word_at(q + 4 * (8 * (i / 8) + r)) >> (4 * (i % 8))) & 0x0f;
  const uint32_t hi =
      (word_at(q + 128 + 4 * (8 * (i / kHalf) + r)) >> (4 * (i % 8) + 2 * ((i / 8) % 2))) & 3;
  return static_cast<int>(lo | (hi << 4));
}

}  // namespace shardlm::cpu::q6kx8::layout
