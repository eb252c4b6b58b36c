// int8-activation kernels for the grouped layouts (int8_linear.h). A nibble
// word (quant_blocks.h) holds 8 quants of one row per 32-bit lane; masking
// its low nibbles gives the even quants as 4 bytes and shifting it by 4 the
// odd ones, and the input's matching 4 bytes are one broadcast word
// (Int8Rows' order), so one int8 dot product (VNNI's vpdpbusd: unsigned
// quants times signed inputs, summed in 4s into int32) covers 4 quants of 16
// rows. The AVX2 kernels do the same with vpmaddubsw (pairs into int16: at
// most 2 * 63 * 128, no saturation) and vpmaddwd. Per block the integer sum
// is scaled once: d * dx * sum(q xq) + m * dx * sum(xq). The table layouts
// look their nibbles up as int8 values first (below), and the layouts with a
// scale per half block have their own kernel (int8_halves.h). The input's
// rounding is int8_rows.cpp's.
#include "int8_linear.h"

// First, so that its silencing of GCC 12's AVX-512 header warnings applies (simd.h).
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu_utils.h"
#include "grouped.h"
#include "int8_halves.h"
#include "int8_unpacked.h"
#include "nibble_layouts.h"
#include "q6k_layout.h"
#include "quant_blocks.h"

namespace shardlm::cpu::int8 {
namespace {

using grouped::kGroupRows;
using quant::kBlock;
namespace nib = q4x8::nibble;
namespace q6 = q6kx8::layout;

static_assert(kHalf == q6::kHalf,
              "Int8Rows' half-block sums are the per-half layouts' scale spans");

// ---- 4- and 5-bit layouts and the tables (nibble_layouts.h) -------------------------

// A table layout's Int8Table (void for the others).
template <class L, bool = L::kTable>
struct TableOf {
  using type = void;
};
template <class L>
struct TableOf<L, true> {
  using type = Int8Table<L::kValues>;
};

// The table layouts (L::kTable: IQ4_XS, IQ4_NL, IQ3_XXS, IQ3_S) multiply their
// table's values as int8 (int8_halves.h: Int8Table). Row r's quant e of block
// b as the kernels multiply it: the quant, or its table value times the
// table's factor.
template <class L>
int32_t int_quant(const uint8_t* w, int64_t b, int64_t r, int64_t e) {
  if constexpr (L::kTable) {
    const uint32_t word = nib::word_at(L::quants(w, b) + 4 * (8 * (e / 8) + r));
    const uint32_t index = (word >> (4 * (e % 8))) & 0x0f;
    return TableOf<L>::type::kBytes.values[index];
  } else {
    return static_cast<int32_t>(nib::quant_of<L>(w, b, r, e));
  }
}

// Block b's scale of row r as the kernels apply it (a table layout's divided
// by its table's factor).
template <class L>
float int_scale(const uint8_t* w, int64_t b, int64_t r) {
  if constexpr (L::kTable) return L::d(w, b, r) / TableOf<L>::type::kFactor;
  return L::d(w, b, r);
}

// Each kernel takes its layout as a tag (a value of the layout type), so that
// the per-half kernels (int8_halves.h) are overloads of the same names.
template <class L>
void rows_scalar(L, float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x, int64_t m0,
                 int64_t rows, int64_t k) {
  portable_rows(acc, stride, x, m0, rows, k / kBlock,
                [&](int64_t i, int64_t b, int64_t r, const int8_t* xq) {
    int32_t dot = 0;
    for (int64_t e = 0; e < kBlock; ++e) dot += int_quant<L>(w, b, r, e) * xq[position(e)];
    return int_scale<L>(w, b, r) * x.scale[i] * static_cast<float>(dot) +
           L::m(w, b, r) * x.sum32[i];
  });
}

#if SHARDLM_HAVE_AVX2
// Nibble word s of block b as even and odd quant bytes, 8 rows.
template <class L>
SHARDLM_AVX2 inline void nibble_bytes_avx2(const uint8_t* w, int64_t b, int s, __m256i& even,
                                           __m256i& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::quants(w, b) + 32 * s));
  if constexpr (L::kFive) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::highs(w, b)));
    return grouped::joined_bytes_avx2(grouped::join_avx2(v, h, s, 0x10), 0x1f1f1f1f, even, odd);
  }
  const __m256i mask = _mm256_set1_epi32(0x0f0f0f0f);
  even = _mm256_and_si256(v, mask);
  odd = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
}

template <int R, class L>
SHARDLM_AVX2 void rows_avx2(L, float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x,
                            int64_t m0, int64_t k) {
  using Table = typename TableOf<L>::type;
  const int64_t blocks = k / kBlock;
  __m256 sum[R], off[R];
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b);
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int s = 0; s < 4; ++s) {
      __m256i even, odd;
      nibble_bytes_avx2<L>(w, b, s, even, odd);
      if constexpr (L::kTable) {
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(Table::kBytes.values)));
        const __m256i even_v = _mm256_shuffle_epi8(table, even);
        const __m256i odd_v = _mm256_shuffle_epi8(table, odd);
        const __m256i even_a = _mm256_abs_epi8(even_v), odd_a = _mm256_abs_epi8(odd_v);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
          dot[r] = signed_dot4_avx2(signed_dot4_avx2(dot[r], even_a, even_v, input_word(xq)), odd_a,
                                    odd_v, input_word(xq + 4));
        }
        continue;
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        dot[r] = dot4_avx2(dot4_avx2(dot[r], even, input_word(xq)), odd, input_word(xq + 4));
      }
    }
    __m256 d, m;
    nib::scales_avx2<L>(w, b, d, m);
    if constexpr (L::kTable) d = _mm256_mul_ps(d, _mm256_set1_ps(1.f / Table::kFactor));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.scale[i])),
                               _mm256_cvtepi32_ps(dot[r]), sum[r]);
      off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum32[i]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * stride, _mm256_add_ps(sum[r], off[r]));
}

// Nibble word s of block b of two groups (w and w + next; h: the block's high
// bits, 5-bit layouts) as even and odd quant bytes, 16 rows: a table layout's
// as its values + 128 (TableOf).
template <class L>
SHARDLM_AVX512_VNNI inline void step_pair_vnni(const uint8_t* w, int64_t next, int64_t b,
                                               __m512i h, int s, __m512i& even, __m512i& odd) {
  const __m512i v = grouped::load_pair(L::quants(w, b) + 32 * s, next);
  if constexpr (L::kFive) {
    grouped::joined_bytes_avx512(grouped::join_avx512(v, h, s, 0x10), 0x1f1f1f1f, even, odd);
  } else {
    const __m512i mask = _mm512_set1_epi32(0x0f0f0f0f);
    even = _mm512_and_si512(v, mask);
    odd = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
  }
  if constexpr (L::kTable) {
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(TableOf<L>::type::kBytes.biased)));
    even = _mm512_shuffle_epi8(table, even);
    odd = _mm512_shuffle_epi8(table, odd);
  }
}

// Block b's d and m of two groups, 16 rows (a table layout's d divided by its
// factor, and m the bias's share, -128 d: the sum of d dx (value + 128) xq
// less 128 d dx sum(xq)).
template <class L>
SHARDLM_AVX512_VNNI inline void scales_vnni(const uint8_t* w, int64_t next, int64_t b, __m512& d,
                                            __m512& m) {
  nib::scales_pair<L>(w, next, b, d, m);
  if constexpr (L::kTable) {
    d = _mm512_mul_ps(d, _mm512_set1_ps(1.f / TableOf<L>::type::kFactor));
    m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
  }
}

template <class L>
SHARDLM_AVX512_VNNI inline __m512i highs_vnni(const uint8_t* w, int64_t next, int64_t b) {
  return L::kFive ? grouped::load_pair(L::highs(w, b), next) : _mm512_setzero_si512();
}

// Two groups (w and w + next) at once, 16 rows a vector: acc[16 r + l]. Every
// loop over the rows is unrolled: where one indexes sum, off or dot by a loop
// variable, GCC keeps the whole array on the stack, a store and a reload per
// block on each chain (so also in the per-half kernel, int8_halves.h).
template <int R, class L>
SHARDLM_AVX512_VNNI void pair_vnni(L, float* acc, const uint8_t* w, int64_t next,
                                   const Int8Rows& x, int64_t m0, int64_t k) {
  const int64_t blocks = k / kBlock;
  __m512 sum[R], off[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b, next);
    const __m512i h = highs_vnni<L>(w, next, b);
    __m512i dot[R][2];  // even and odd quants: two chains
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int s = 0; s < 4; ++s) {
      __m512i even, odd;
      step_pair_vnni<L>(w, next, b, h, s, even, odd);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + ((m0 + r) * blocks + b) * kBlock + 8 * s;
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], even, _mm512_set1_epi32(input_word(xq)));
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], odd, _mm512_set1_epi32(input_word(xq + 4)));
      }
    }
    __m512 d, m;
    scales_vnni<L>(w, next, b, d, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * blocks + b;
      sum[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[i])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1])), sum[r]);
      off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum32[i]), off[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(sum[r], off[r]));
}

// A nibble layout's pair unpacked for the many-rows path (int8_unpacked.h), as
// pair_vnni unpacks it.
template <class L>
SHARDLM_AVX512_VNNI void unpack_pair(L, unpacked::Block* u, const uint8_t* w, int64_t next,
                                     int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    nib::prefetch_block<L>(w, b, next);
    const __m512i h = highs_vnni<L>(w, next, b);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512i even, odd;
      step_pair_vnni<L>(w, next, b, h, s, even, odd);
      unpacked::store(u[b].bytes[2 * s], even);
      unpacked::store(u[b].bytes[2 * s + 1], odd);
    }
    __m512 d, m;
    scales_vnni<L>(w, next, b, d, m);
    unpacked::store(u[b].scale[0], d);
    unpacked::store(u[b].offset[0], m);
  }
}

template <class P>
void unpack_pair(halves::Layout<P>, unpacked::Block* u, const uint8_t* w, int64_t next, int64_t blocks) {
  unpacked::unpack_halves<P>(u, w, next, blocks);
}
#endif

// ---- Q6Kx8, Q3Kx8, Q2Kx8: a scale per half block (int8_halves.h) -------------------

using halves::Layout;
using q6::Q2K;
using q6::Q3K;
using q6::Q6K;

// ---- dispatch ----------------------------------------------------------------------

template <class F>
decltype(auto) with_layout(int64_t qtype, const F& f) {
  switch (qtype) {
    case quant::kQ4Kx8: return f(nib::Q4Kx8Layout{});
    case quant::kQ5x8: return f(nib::Q5x8Layout{});
    case quant::kQ40x8: return f(nib::Q40x8Layout{});
    case quant::kQ5Kx8: return f(nib::Q5Kx8Layout{});
    case quant::kQ51x8: return f(nib::Q51x8Layout{});
    case quant::kIQ4x8: return f(nib::IQ4x8Layout{});
    case quant::kIQ4NLx8: return f(nib::IQ4NLx8Layout{});
    case quant::kIQ3XXSx8: return f(nib::IQ3XXSx8Layout{});
    case quant::kIQ3Sx8: return f(nib::IQ3Sx8Layout{});
    case quant::kQ6Kx8: return f(Layout<Q6K>{});
    case quant::kQ3Kx8: return f(Layout<Q3K>{});
    case quant::kQ2Kx8: return f(Layout<Q2K>{});
    case quant::kIQ2XXSx8:
    case quant::kIQ2XSx8:
    case quant::kIQ2Sx8: return f(Layout<q6::IQ2Halves>{});
    case quant::kIQ1Sx8:
    case quant::kIQ1Mx8: return f(Layout<q6::IQ1Halves>{});
    default: return f(nib::Q4x8Layout{});
  }
}

// Input rows one pass of the AVX-512 kernels takes (grouped::gemv's kRows).
// The per-half kernels spend as much on each block's unpacking and on its two
// halves' scaling as on their dot products, and 6 rows share the unpacking; the
// nibble kernels, at the machine's vpdpbusd rate with 4 rows, gain nothing
// from more (2 threads, the 1B file's matrices at 512 rows, alternated: Q6Kx8
// 306-326 -> 351 GOP/s, Q4Kx8 419-479 either way). The AVX2 kernels (16
// registers) take at most 4 rows at a time of a pass.
template <class L>
constexpr bool kPerHalf = halves::is_layout<L>;
template <class L>
constexpr int64_t kPassRows = kPerHalf<L> ? 6 : grouped::kMaxRows;

// From how many input rows the AVX-512 kernels take a pair of groups unpacked
// once (int8_unpacked.h) instead of once a pass. A plain nibble layout's
// unpacking is a mask and a shift per 128 quants, which the buffer's stores
// and loads cost more than below 32 rows (the ~1B Q4_K_M file's matrices, 16
// rows: 420-487 against 490-515 GOP/s; 64 rows: 542-590 against 540-555);
// every other layout gains from its second pass on (Q3Kx8, 16 rows: 403-421
// against 346; 512 rows: 464-470 against 318-347).
template <class L>
constexpr int64_t kUnpackRows = [] {
  if constexpr (!kPerHalf<L>) {
    if constexpr (!L::kFive && !L::kTable) return int64_t{32};
  }
  return kPassRows<L> + 1;
}();

// Calls kernel(std::integral_constant<int, R>) for R = rows (1 .. kMax).
template <int64_t kMax, class K>
void with_rows(int64_t rows, const K& kernel) {
  static_assert(kMax == 4 || kMax == 6);
  switch (rows) {
    case 1: return kernel(std::integral_constant<int, 1>{});
    case 2: return kernel(std::integral_constant<int, 2>{});
    case 3: return kernel(std::integral_constant<int, 3>{});
  }
  if constexpr (kMax == 6) {
    if (rows == 4) return kernel(std::integral_constant<int, 4>{});
    if (rows == 5) return kernel(std::integral_constant<int, 5>{});
  }
  return kernel(std::integral_constant<int, static_cast<int>(kMax)>{});
}

// One group (8 rows) against `rows` input rows from m0: acc[i * stride + r].
template <class L>
void group_dot(float* acc, int64_t stride, const uint8_t* w, const Int8Rows& x, int64_t m0,
               int64_t rows, int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) {
    for (int64_t i = 0; i < rows; i += grouped::kMaxRows) {
      with_rows<grouped::kMaxRows>(std::min(grouped::kMaxRows, rows - i), [&](auto r) {
        rows_avx2<decltype(r)::value>(L{}, acc + i * stride, stride, w, x, m0 + i, k);
      });
    }
    return;
  }
#endif
  (void)avx2;
  rows_scalar(L{}, acc, stride, w, x, m0, rows, k);
}

template <class L, typename T>
void linear_of(T* out, const uint8_t* w, const Int8Rows& x, const T* bias, int64_t m, int64_t n,
               int64_t k) {
  const int64_t group_bytes = L::group_bytes(k);
  const bool avx2 = cpu::use_avx2();
  const bool vnni = cpu::use_avx512_vnni();
  grouped::gemv<kPassRows<L>>(out, bias, m, n, group_bytes,
                [&](float* acc, int64_t g, int64_t width, int64_t m0, int64_t rows) {
    const uint8_t* wg = w + g * group_bytes;
#if SHARDLM_HAVE_AVX2
    if (width == 2 * kGroupRows && vnni) {
      if (m >= kUnpackRows<L>) {
        // Many rows: the pair is unpacked once (at its first pass: each thread
        // takes a pair's passes in order, m0 = 0 first) for all of them.
        unpacked::Block* u = unpacked::buffer(k / kBlock);
        if (m0 == 0) unpack_pair(L{}, u, wg, group_bytes, k / kBlock);
        return with_rows<kPassRows<L>>(rows, [&](auto r) {
          unpacked::rows_vnni<decltype(r)::value, kPerHalf<L>>(acc, u, k / kBlock, x, m0);
        });
      }
      return with_rows<kPassRows<L>>(rows, [&](auto r) {
        pair_vnni<decltype(r)::value>(L{}, acc, wg, group_bytes, x, m0, k);
      });
    }
#endif
    (void)vnni;
    for (int64_t half = 0; half < width / kGroupRows; ++half) {
      group_dot<L>(acc + half * kGroupRows, width, wg + half * group_bytes, x, m0, rows, k, avx2);
    }
  });
}

}  // namespace

bool takes(int64_t qtype) { return quant::grouped(qtype); }

InputOrder input_order(int64_t qtype) {
  return qtype == quant::kQ3Kx8 || qtype == quant::kQ2Kx8 || quant::table_halves(qtype)
             ? InputOrder::kTwoBit
             : InputOrder::kNibble;
}

template <typename T>
void linear(T* out, int64_t qtype, const uint8_t* w, const Int8Rows& x, const T* bias, int64_t m,
            int64_t n, int64_t k) {
  with_layout(qtype, [&](auto layout) {
    linear_of<decltype(layout)>(out, w, x, bias, m, n, k);
  });
}

template void linear<float>(float*, int64_t, const uint8_t*, const Int8Rows&, const float*,
                            int64_t, int64_t, int64_t);
template void linear<c10::BFloat16>(c10::BFloat16*, int64_t, const uint8_t*, const Int8Rows&,
                                    const c10::BFloat16*, int64_t, int64_t, int64_t);
template void linear<c10::Half>(c10::Half*, int64_t, const uint8_t*, const Int8Rows&,
                                const c10::Half*, int64_t, int64_t, int64_t);

}  // namespace shardlm::cpu::int8
