// Where GGML's Q6_K regrouped as Q6Kx8, and its Q3_K as Q3Kx8 (quant_blocks.h),
// keep each part of a group's super-block: the kernels of q6kx8.cpp (float
// inputs, both layouts) and of int8_linear.cpp (int8 inputs, Q6Kx8) read them
// through these.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"
#include "value_tables.h"

namespace shardlm::cpu::q6kx8::layout {

using quant::half_at;
using quant::kBlock;
using quant::kQ6SuperGroupBytes;
using quant::kSuperBlocks;

constexpr int64_t kHalf = 16;          // weights per scale
constexpr int64_t kHeaderBytes = 144;  // d[8] float16, sc[16][8] int8

// The layouts: Q6Kx8 (6-bit quants: nibble words, then two high bits a quant
// in high-bit words; w = d * sc * (q - 32)), Q3Kx8 (GGML's Q3_K, 3-bit quants
// plus 4: their low two bits in 2-bit words, one word a half, then one word a
// row of third bits; w = d * sc * (q - 4)) and Q2Kx8 (GGML's Q2_K, 2-bit
// quants in 2-bit words; its header d, dmin, then each half's scale and
// minimum in one byte: w = d * sc * q - dmin * mn). kScalesAt: where, in the
// super-block, the halves' scale bytes begin.
struct Q6K {
  static constexpr bool kHighWords = true, kMins = false, kTable = false;
  static constexpr bool kTwoBit = false, kThirdBit = false;
  static constexpr int64_t kHeader = kHeaderBytes, kScalesAt = 16;
  static constexpr int kOffset = 32, kField = 0x3f;  // the quants' offset and their mask
  static constexpr int64_t kBlockBytes = 192;           // nibble words (128), high-bit words (64)
  static constexpr int64_t kSuperBytes = kQ6SuperGroupBytes;
};
struct Q3K {
  static constexpr bool kHighWords = false, kMins = false, kTable = false;
  static constexpr bool kTwoBit = true, kThirdBit = true;
  static constexpr int64_t kHeader = kHeaderBytes, kScalesAt = 16;
  static constexpr int kOffset = 4, kField = 0x07;
  static constexpr int64_t kBlockBytes = 96;  // 2-bit words (64), third-bit words (32)
  static constexpr int64_t kSuperBytes = quant::kQ3SuperGroupBytes;
};
struct Q2K {
  static constexpr bool kHighWords = false, kMins = true, kTable = false;
  static constexpr bool kTwoBit = true, kThirdBit = false;
  // d[8] and dmin[8] float16, then (sc | mn << 4)[16][8].
  static constexpr int64_t kHeader = 160, kScalesAt = 32;
  static constexpr int kOffset = 0, kField = 0x03;
  static constexpr int64_t kBlockBytes = 64;  // 2-bit words
  static constexpr int64_t kSuperBytes = quant::kQ2SuperGroupBytes;
};
// The IQ2 and IQ1 grid i-quants (GGML's IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and
// IQ1_M; worker/gridquant.py): Q3Kx8's bytes, sc the odd scale 2 ls + 1 (per
// 16 weights; IQ2_XXS's and IQ1_S's per 32, repeated for both halves), each
// 3-bit quant an index into the type's table (value_tables.h): w = d * sc *
// kv[q], read through the table against inputs that are not pre-scaled.
template <const float* kV>
struct TableHalves {
  static constexpr bool kHighWords = false, kMins = false, kTable = true;
  static constexpr bool kTwoBit = true, kThirdBit = true;
  static constexpr const float* kValues = kV;
  static constexpr int64_t kHeader = kHeaderBytes, kScalesAt = 16;
  static constexpr int kOffset = 0, kField = 0x07;
  static constexpr int64_t kBlockBytes = Q3K::kBlockBytes;
  static constexpr int64_t kSuperBytes = quant::kQ3SuperGroupBytes;
};
using IQ2Halves = TableHalves<kIQ2Values>;
using IQ1Halves = TableHalves<kIQ1Values>;
static_assert(Q6K::kHeader + kSuperBlocks * Q6K::kBlockBytes == Q6K::kSuperBytes &&
              Q3K::kHeader + kSuperBlocks * Q3K::kBlockBytes == Q3K::kSuperBytes &&
              Q2K::kHeader + kSuperBlocks * Q2K::kBlockBytes == Q2K::kSuperBytes);
constexpr int64_t kBlockBytes = Q6K::kBlockBytes;

template <class P = Q6K>
inline const uint8_t* super_of(const uint8_t* w, int64_t b) {
  return w + b / kSuperBlocks * P::kSuperBytes;
}

// Block b's nibble words; its high-bit words (Q6Kx8) follow 128 bytes on.
template <class P = Q6K>
inline const uint8_t* words_of(const uint8_t* w, int64_t b) {
  return super_of<P>(w, b) + P::kHeader + P::kBlockBytes * (b % kSuperBlocks);
}

// Where block b's stretch of the group's bytes begins: the super-block's
// header is read with its first block (the stretch ends at words_of + kBlockBytes).
template <class P = Q6K>
inline const uint8_t* stream_begin(const uint8_t* w, int64_t b) {
  return b % kSuperBlocks == 0 ? super_of<P>(w, b) : words_of<P>(w, b);
}

// Byte offset, in the super-block, of the 8 rows' int8 scales of half h of
// block b (Q2Kx8: their bytes sc | mn << 4).
template <class P = Q6K>
inline int64_t scales_at(int64_t b, int64_t h) {
  return P::kScalesAt + 8 * (2 * (b % kSuperBlocks) + h);
}

template <class P = Q6K>
inline float scale_of(const uint8_t* w, int64_t b, int64_t h, int64_t r) {
  const uint8_t* s = super_of<P>(w, b);
  const uint8_t scale = s[scales_at<P>(b, h) + r];
  return half_at(s + 2 * r) *
         static_cast<float>(P::kMins ? scale & 0x0f : static_cast<int8_t>(scale));
}

// Q2Kx8: half h's offset dmin * mn (dmin at byte 16 of the super-block), exact.
template <class P>
inline float min_of(const uint8_t* w, int64_t b, int64_t h, int64_t r) {
  const uint8_t* s = super_of<P>(w, b);
  return half_at(s + 16 + 2 * r) * static_cast<float>(s[scales_at<P>(b, h) + r] >> 4);
}

inline uint32_t word_at(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Row r's quant i (0..31) of block b, 0..63 (Q3Kx8: 0..7, Q2Kx8: 0..3, a
// table layout: the index, 0..7).
template <class P = Q6K>
inline int quant_of(const uint8_t* w, int64_t b, int64_t r, int64_t i) {
  const uint8_t* q = words_of<P>(w, b);
  if constexpr (P::kTwoBit) {
    int quant = static_cast<int>((word_at(q + 4 * (8 * (i / kHalf) + r)) >> (2 * (i % kHalf))) & 3);
    if constexpr (P::kThirdBit) {
      const int64_t u = i % kHalf, place = kHalf * (i / kHalf) + 2 * (u % 8) + 1 - u / 8;
      quant |= static_cast<int>((word_at(q + 64 + 4 * r) >> place) & 1) << 2;
    }
    return quant;
  }
  const uint32_t lo = (word_at(q + 4 * (8 * (i / 8) + r)) >> (4 * (i % 8))) & 0x0f;
  if constexpr (!P::kHighWords) return static_cast<int>(lo);
  const uint32_t hi =
      (word_at(q + 128 + 4 * (8 * (i / kHalf) + r)) >> (4 * (i % 8) + 2 * ((i / 8) % 2))) & 3;
  return static_cast<int>(lo | (hi << 4));
}

// What row r's quant i of block b stands for before its half's scale: the
// quant less the offset, or a table layout's value.
template <class P>
inline float value_of(const uint8_t* w, int64_t b, int64_t r, int64_t i) {
  if constexpr (P::kTable) return P::kValues[quant_of<P>(w, b, r, i)];
  return static_cast<float>(quant_of<P>(w, b, r, i) - P::kOffset);
}

}  // namespace shardlm::cpu::q6kx8::layout
