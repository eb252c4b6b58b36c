// The values the nibbles of the table layouts stand for (a weight is d * sc
// * value): IQ4_NL / IQ4_XS's GGML kvalues_iq4nl, and the grid i-quants'
// (worker/gridquant.py). Each weight of IQ3_XXS, IQ3_S and the IQ2 types is a
// signed grid value g times a scale, each of the IQ1 types' a grid value in
// -1..1 plus a delta of +-1/8; a nibble stands for that value over the power of
// two that GGML's scale carries (IQ3_XXS: g / 4, IQ2: g / 8), the positive
// ones first, then their negatives at index + 8 (IQ2: + 4; IQ1: g + 1/8 at
// g + 1, g - 1/8 at g + 4). The IQ2 and IQ1 tables hold 8 entries repeated to
// 16, so that a 3-bit index (the per-16 layouts') read with a stray fourth
// bit finds the same value. Unused entries are 0. The kernels look them up
// with grouped::table_avx2 / table_avx512 (nibbles) and table3_avx2 /
// table3_avx512 (3-bit indices).
#pragma once

namespace shardlm::cpu {

inline constexpr float kIQ4Values[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                         1.f,    13.f,   25.f,  38.f,  53.f,  69.f,  89.f,  113.f};
inline constexpr float kIQ3XXSValues[16] = {1.f,  3.f,  5.f,  7.f,  9.f,  11.f,  13.f,  15.5f,
                                            -1.f, -3.f, -5.f, -7.f, -9.f, -11.f, -13.f, -15.5f};
inline constexpr float kIQ3SValues[16] = {1.f,  3.f,  5.f,  7.f,  9.f,  11.f,  13.f,  15.f,
                                          -1.f, -3.f, -5.f, -7.f, -9.f, -11.f, -13.f, -15.f};
inline constexpr float kIQ2Values[16] = {1.f, 3.125f, 5.375f, 0.f, -1.f, -3.125f, -5.375f, 0.f,
                                         1.f, 3.125f, 5.375f, 0.f, -1.f, -3.125f, -5.375f, 0.f};
inline constexpr float kIQ1Values[16] = {
    -0.875f, 0.125f, 1.125f, -1.125f, -0.125f, 0.875f, 0.f, 0.f,
    -0.875f, 0.125f, 1.125f, -1.125f, -0.125f, 0.875f, 0.f, 0.f};

}  // namespace shardlm::cpu
