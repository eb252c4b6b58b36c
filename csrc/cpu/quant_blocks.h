// GGML block formats that the quantized linear kernel (quant_linear.cpp) reads
// as they are stored in a GGUF file: 32 weights per block, a float16 scale d
// and, for Q4_1, a float16 offset m, then the quants.
//
//   Q4_0 (type 2):  d, 16 bytes of nibbles   w = d * (q - 8)
//   Q4_1 (type 3):  d, m, 16 bytes           w = d * q + m
//   Q8_0 (type 8):  d, 32 int8               w = d * q
//
// In the 4-bit types byte i holds weight i in its low nibble and weight i + 16
// in its high nibble. Every format is read as w = d * q + m with q an integer
// (m = -8 d for Q4_0, 0 for Q8_0), so one kernel serves all three.
#pragma once

// First, so that its silencing of GCC 12's AVX-512 header warnings applies.
#include "simd.h"

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace shardlm::cpu::quant {

constexpr int64_t kBlock = 32;  // weights per block

// Q4x8 (id 100, ShardLM's own, not a GGML type) holds Q4_0 / Q4_1 weights
// regrouped at load for the matrix-vector kernel: 8 weight rows side by side,
// so one vector instruction works on 8 rows (one output feature per lane) and
// the scales need no horizontal sums. Per group of 8 rows and block b of 32
// weights, 160 bytes:
//   d[8], m[8]  float16, row r's scale and offset (Q4_0: m = -8 d, exact)
//   q[4][8]     uint32: q[s][r] holds row r's quants 8s .. 8s+7, quant 8s+j
//               in bits 4j .. 4j+3
// so w[8g + r][32b + 8s + j] = d[r] * q + m[r]. The tensor is uint8
// [N / 8, K / 32 * 160]; worker/quant.py converts to and from it.
//
// Q4Kx8 (id 101, ShardLM's own) holds GGML's Q4_K weights regrouped the same
// way. Q4_K keeps 256 weights as 8 sub-blocks of 32 with 6-bit scales and
// mins under a float16 d and dmin: w = d * sc[s] * q - dmin * mn[s]. Per group
// of 8 rows and super-block of 256 weights, 1184 bytes:
//   d[8], dmin[8]   float16, row r's super-block scales
//   sc[8][8]        uint8: sc[s][r], row r's scale of sub-block s
//   mn[8][8]        uint8: mn[s][r], row r's min of sub-block s
//   q[8][4][8]      uint32: sub-block s's quant words, as a Q4x8 block's
// so sub-block s reads as a Q4x8 block with d = d[r] * sc[s][r] and
// m = -(dmin[r] * mn[s][r]), float16 times a 6-bit integer: exact in float32,
// as GGML computes them. The tensor is uint8 [N / 8, K / 256 * 1184].
//
// Q6Kx8 (id 102) holds GGML's Q6_K: 256 weights as 16 halves of 16 with int8
// scales under a float16 d, 6-bit quants: w = d * sc[h] * (q - 32). Per group
// of 8 rows and super-block, 1680 bytes (Q6_K's 6.5625 bits a weight):
//   d[8]            float16
//   sc[16][8]       int8: sc[h][r], row r's scale of weights 16h .. 16h+15
//   per block b of 32 weights (8 of them), 192 bytes:
//     q[4][8]       uint32: the quants' low nibbles, as a Q4x8 block's words
//     hq[2][8]      uint32: hq[u][r] holds the high two bits of row r's quant
//                   8s + j (s = 2u + t) in bits 4j + 2t .. 4j + 2t + 1
// (q6kx8.cpp). The tensor is uint8 [N / 8, K / 256 * 1680].
//
// Q5x8 (id 103) holds GGML's Q5_0 (w = d * (q - 16), q in 0..31) and Q5Kx8
// (id 104) its Q5_K (Q4_K's scales and mins over 5-bit quants): a quant is its
// low nibble, in a Q4x8 block's words, plus a high bit. Per 32-weight block the
// 8 rows' high bits are 8 uint32 words h[r], quant 8s + j's bit at bit 4j + s,
// so that h << (4 - s) puts the bits of nibble word s's quants just above
// their nibbles (q4x8.cpp). Per group of 8 rows:
//   Q5x8, per block of 32 weights, 176 bytes (Q5_0's 5.5 bits a weight):
//     d[8] float16, h[8] uint32, q[4][8] uint32 (m = -16 d, exact)
//   Q5Kx8, per super-block of 256, 1440 bytes (5.625 bits, Q5_K's 5.5):
//     a Q4Kx8 header (160 bytes), then per block h[8], q[4][8] (160 bytes)
//
// Q40x8 (id 105) holds GGML's Q4_0 (w = d * (q - 8)) at its own 4.5 bits a
// weight: per group of 8 rows and block of 32 weights, 144 bytes:
//     d[8] float16, q[4][8] uint32 (Q4x8's words; m = -8 d, exact)
//
// Q51x8 (id 107) holds GGML's Q5_1 (w = d * q + m, q in 0..31) at its own 6
// bits a weight: per group of 8 rows and block of 32 weights, 192 bytes:
//     d[8] float16, m[8] float16, h[8] uint32, q[4][8] uint32 (Q5x8's words)
//
// IQ4x8 (id 108) holds GGML's IQ4_XS (w = d * (ls - 32) * kv[q], kv a fixed
// table of 16 int8 values, ls a 6-bit scale per 32 weights) at 4.3125 bits a
// weight (IQ4_XS's 4.25): per group of 8 rows and super-block of 256, 1104 bytes:
//     d[8] float16, sc[8][8] int8 (ls - 32, block-major), then per block
//     q[4][8] uint32 (Q4x8's words, each nibble an index into kv)
//
// IQ3XXSx8 and IQ3Sx8 (ids 112, 113) hold GGML's IQ3_XXS and IQ3_S (each
// weight a point of a fixed grid, signed, times an odd scale per 32 weights)
// in IQ4x8's bytes, sc the odd scale and each nibble an index into the type's
// own table of 16 values (nibble_layouts.h): 4.3125 bits a weight (the files'
// 3.0625 and 3.4375)
//
// IQ2XXSx8, IQ1Sx8, IQ2XSx8, IQ2Sx8 and IQ1Mx8 (ids 114-118) hold GGML's
// IQ2_XXS, IQ1_S (an odd scale per 32 weights, repeated for each half), IQ2_XS,
// IQ2_S and IQ1_M (one per 16) in Q3Kx8's bytes, sc the odd scale and each
// 3-bit quant an index into the type's table of at most 8 values: 3.5625 bits
// a weight (the files' 2.0625, 1.5625, 2.3125, 2.5625 and 1.75)
//
// Q3Kx8 (id 110) holds GGML's Q3_K (w = d * (sc - 32) * (q - 4), q in 0..7, a
// 6-bit scale per 16 weights) at 3.5625 bits a weight (Q3_K's 3.4375): per
// group of 8 rows and super-block of 256, 912 bytes: d[8] float16, sc[16][8]
// int8 (sc - 32), then per block q[2][8] uint32 (each quant's low two bits,
// as Q2Kx8's words) and t[8] uint32 (row r's third bits: quant 16h + u of the
// block at bit 16h + 2 (u % 8) + 1 - u / 8)
//
// Q2Kx8 (id 111) holds GGML's Q2_K (w = d * sc * q - dmin * mn, q in 0..3, a
// 4-bit scale and minimum per 16 weights) at Q2_K's own 2.625 bits a weight:
// per group of 8 rows and super-block of 256, 672 bytes: d[8] float16,
// dmin[8] float16, (sc | mn << 4)[16][8] uint8, then per block q[2][8] uint32
// (word h of row r holds quants 16h .. 16h+15 of the block, quant t in bits
// 2t, 2t+1)
//
// IQ4NLx8 (id 109) holds GGML's IQ4_NL (w = d * kv[q], 32 weights a block) at
// its own 4.5 bits a weight, in Q40x8's bytes: per group of 8 rows and block
// of 32 weights, 144 bytes: d[8] float16, q[4][8] uint32 (indices into kv)
enum QType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4x8 = 100, kQ4Kx8 = 101, kQ6Kx8 = 102, kQ5x8 = 103,
  kQ5Kx8 = 104, kQ40x8 = 105, kQ51x8 = 107,  // 106: a Mixed weight (mixed_rows.h)
  kIQ4x8 = 108, kIQ4NLx8 = 109, kQ3Kx8 = 110, kQ2Kx8 = 111, kIQ3XXSx8 = 112, kIQ3Sx8 = 113,
  kIQ2XXSx8 = 114, kIQ1Sx8 = 115, kIQ2XSx8 = 116, kIQ2Sx8 = 117, kIQ1Mx8 = 118
};

constexpr int64_t kGroupRows = 8;        // rows of a Q4x8 or Q4Kx8 group
constexpr int64_t kGroupBlockBytes = 160;  // one Q4x8 group-block
constexpr int64_t kSuperBlocks = 8;        // 32-weight blocks of a Q4_K super-block
constexpr int64_t kSuperGroupBytes = 1184;  // one Q4Kx8 group's super-block
constexpr int64_t kQ6SuperGroupBytes = 1680;  // one Q6Kx8 group's super-block
constexpr int64_t kQ5GroupBlockBytes = 176;   // one Q5x8 group-block
constexpr int64_t kQ5SuperGroupBytes = 1440;  // one Q5Kx8 group's super-block
constexpr int64_t kQ40GroupBlockBytes = 144;  // one Q40x8 group-block
constexpr int64_t kQ51GroupBlockBytes = 192;  // one Q51x8 group-block
constexpr int64_t kIQ4SuperGroupBytes = 1104;  // one IQ4x8 group's super-block
constexpr int64_t kQ3SuperGroupBytes = 912;    // one Q3Kx8 group's super-block
constexpr int64_t kQ2SuperGroupBytes = 672;    // one Q2Kx8 group's super-block

// Whether `qtype` is one of the layouts of IQ4x8's bytes read through a table
// of its own (IQ4x8 and the grid i-quants').
constexpr bool super_table(int64_t qtype) {
  return qtype == kIQ4x8 || qtype == kIQ3XXSx8 || qtype == kIQ3Sx8;
}

// Whether `qtype` is one of the layouts of Q3Kx8's bytes read through a table
// (the IQ2 and IQ1 grid i-quants: 3-bit indices, a scale per 16 weights).
constexpr bool table_halves(int64_t qtype) {
  return qtype == kIQ2XXSx8 || qtype == kIQ1Sx8 || qtype == kIQ2XSx8 || qtype == kIQ2Sx8 ||
         qtype == kIQ1Mx8;
}

// Whether `qtype` is one of the 8-row grouped layouts (q4x8.h, q6kx8.h).
constexpr bool grouped(int64_t qtype) {
  return qtype == kQ4x8 || qtype == kQ4Kx8 || qtype == kQ6Kx8 || qtype == kQ5x8 ||
         qtype == kQ5Kx8 || qtype == kQ40x8 || qtype == kQ51x8 || super_table(qtype) ||
         qtype == kIQ4NLx8 || qtype == kQ3Kx8 || qtype == kQ2Kx8 || table_halves(qtype);
}

// Whether `qtype` is one of the layouts with a scale per 16 weights, which the
// kernels of q6kx8.cpp read (Q6Kx8, Q3Kx8, Q2Kx8, the per-16 table layouts);
// the other grouped ones are q4x8.cpp's.
constexpr bool half_scaled(int64_t qtype) {
  return qtype == kQ6Kx8 || qtype == kQ3Kx8 || qtype == kQ2Kx8 || table_halves(qtype);
}

// Bytes of one block of `qtype` (for Q4x8: of one group-block of 8 rows; for
// Q4Kx8 the same per 32 weights, an eighth of a super-block), or 0 when the
// kernel does not read that type.
inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4x8: return kGroupBlockBytes;
    case kQ4Kx8: return kSuperGroupBytes / kSuperBlocks;
    case kQ6Kx8: return kQ6SuperGroupBytes / kSuperBlocks;
    case kQ5x8: return kQ5GroupBlockBytes;
    case kQ5Kx8: return kQ5SuperGroupBytes / kSuperBlocks;
    case kQ40x8: return kQ40GroupBlockBytes;
    case kQ51x8: return kQ51GroupBlockBytes;
    case kIQ4x8:
    case kIQ3XXSx8:
    case kIQ3Sx8: return kIQ4SuperGroupBytes / kSuperBlocks;
    case kIQ4NLx8: return kQ40GroupBlockBytes;
    case kQ3Kx8:
    case kIQ2XXSx8:
    case kIQ1Sx8:
    case kIQ2XSx8:
    case kIQ2Sx8:
    case kIQ1Mx8: return kQ3SuperGroupBytes / kSuperBlocks;
    case kQ2Kx8: return kQ2SuperGroupBytes / kSuperBlocks;
    default: return 0;
  }
}

// Weight rows per row of the blocks tensor.
inline int64_t rows_per_blocks_row(int64_t qtype) { return grouped(qtype) ? kGroupRows : 1; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A block's scale, offset and quants: w[i] = d * q[i] + m.
struct Block {
  float d, m;
  const uint8_t* qs;
};

template <int64_t kType>
inline Block block_at(const uint8_t* p) {
  const float d = half_at(p);
  if constexpr (kType == kQ4_0) return {d, -8.f * d, p + 2};
  if constexpr (kType == kQ4_1) return {d, half_at(p + 2), p + 4};
  return {d, 0.f, p + 2};  // kQ8_0
}

// The block's integer quants q[0..31] as floats, in weight order.
template <int64_t kType>
inline void quants_scalar(const Block& b, float* q) {
  if constexpr (kType == kQ8_0) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(static_cast<int8_t>(b.qs[i]));
  } else {
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<float>(b.qs[i] & 0x0f);
      q[i + 16] = static_cast<float>(b.qs[i] >> 4);
    }
  }
}

#if SHARDLM_HAVE_AVX2
// Eight Q8_0 rows side by side (their block b's bytes at p, p + row_bytes,
// ...), as the panel paths read them: the rows' scales d as one vector, and
// weights 8 s .. 8 s + 7 of the block transposed, v[j] = d * q[8 s + j] of
// the 8 rows (d q is exact in float32, as in the reference).
SHARDLM_AVX2 inline __m256 q8_0_scales8(const uint8_t* p, int64_t row_bytes) {
  uint16_t halves[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&halves[r], p + r * row_bytes, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
}

SHARDLM_AVX2 inline void q8_0_columns8(__m256 v[8], const uint8_t* p, int64_t row_bytes, int s,
                                       __m256 d) {
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const __m128i q =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + r * row_bytes + 2 + 8 * s));
    v[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  }
  avx2::transpose8(v);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) v[j] = _mm256_mul_ps(v[j], d);
}
#endif

}  // namespace shardlm::cpu::quant
