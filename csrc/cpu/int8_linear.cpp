// int8-activation kernels for the grouped layouts (int8_linear.h). A nibble
// word (quant_blocks.h) holds 8 quants of one row per 32-bit lane; masking
// its low nibbles gives the even quants as 4 bytes and shifting it by 4 the
// odd ones, and the input's matching 4 bytes are one broadcast word
// (Int8Rows' order), so one int8 dot product (VNNI's vpdpbusd: unsigned
// quants times signed inputs, summed in 4s into int32) covers 4 quants of 16
// rows. The AVX2 kernels do the same with vpmaddubsw (pairs into int16: at
// most 2 * 63 * 128, no saturation) and vpmaddwd. Per block the integer sum
// is scaled once: d * dx * sum(q xq) + m * dx * sum(xq). The table layouts
// look their nibbles up as int8 values first. Those kernels are in
// int8_nibbles.h; the layouts with a scale per half block have theirs in
// int8_halves.h, many input rows take int8_unpacked.h's path, and this file
// picks among them. The input's rounding is int8_rows.cpp's.
#include "int8_linear.h"

// First, so that its silencing of GCC 12's AVX-512 header warnings applies (simd.h).
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_utils.h"
#include "grouped.h"
#include "int8_amx.h"
#include "int8_halves.h"
#include "int8_nibbles.h"
#include "int8_unpacked.h"
#include "nibble_layouts.h"
#include "q6k_layout.h"
#include "quant_blocks.h"

namespace shardlm::cpu::int8 {
namespace {

using nibbles::rows_scalar;
#if SHARDLM_HAVE_AVX2
using nibbles::pair_vnni;
using nibbles::rows_avx2;
using nibbles::unpack_avx2;
using nibbles::unpack_pair;
#endif

using grouped::kGroupRows;
using quant::kBlock;
namespace nib = q4x8::nibble;
namespace q6 = q6kx8::layout;

static_assert(kHalf == q6::kHalf,
              "Int8Rows' half-block sums are the per-half layouts' scale spans");

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

// The same for the AVX2 kernels (one group of 8 rows a buffer). Their dot
// products cost more than VNNI's (a vpmaddubsw, a vpmaddwd and an add per 4
// quants a lane), so the buffer's stores and loads pay later, and on the
// layouts whose unpacking is a mask and a shift (plain nibbles, Q2K) never
// (SIMD capped at AVX2 on the AMD EPYC of the README's tables, 4096 x 2048,
// 2 threads, GOP/s direct -> unpacked, before the per-half kernels' integer
// scales: 256 rows IQ2XXSx8 129 -> 170, Q6Kx8 156 -> 183, IQ4x8 192 -> 205,
// Q5x8 215 -> 236, but Q4x8 266 -> 243, Q2Kx8 197 -> 184; 8 rows every layout
// slower; 16 rows the per-half ones faster, IQ2XXSx8 131 -> 152, the table and
// 5-bit nibble ones from 64. bench.int8_layers --simd avx2 has the figures now).
template <class L>
constexpr int64_t kUnpackRowsAvx2 = [] {
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  if constexpr (kPerHalf<L>) {
    return std::is_same_v<L, Layout<Q2K>> ? kNever : int64_t{16};
  } else {
    return L::kFive || L::kTable ? int64_t{64} : kNever;
  }
}();

// Whether the AVX2 many-rows kernel takes offsets off (int8_unpacked.h): every
// nibble layout's m, a per-half layout's where it has them.
template <class L>
constexpr bool kOffsets = [] {
  if constexpr (kPerHalf<L>) return L::kOffsets;
  return true;
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
  // With AMX, many rows of a layout with one scale a block go 16 a pass (a
  // tile's rows; int8_amx.h), a last pass of fewer through the VNNI kernels.
  const bool on_amx = !kPerHalf<L> && m >= kUnpackRows<L> && cpu::use_amx_int8();
  const auto dot = [&](float* acc, int64_t g, int64_t width, int64_t m0, int64_t rows) {
    const uint8_t* wg = w + g * group_bytes;
#if SHARDLM_HAVE_AVX2
    if (width == 2 * kGroupRows && vnni) {
      if (m >= kUnpackRows<L>) {
        // Many rows: the pair is unpacked once (at its first pass: each thread
        // takes a pair's passes in order, m0 = 0 first) for all of them.
        unpacked::Block* u = unpacked::buffer(k / kBlock);
        if (m0 == 0) unpack_pair(L{}, u, wg, group_bytes, k / kBlock);
        if (on_amx && rows == amx::kRows) {
          return amx::rows(acc, u, k / kBlock, x, m0);
        }
        for (int64_t i = 0; i < rows; i += kPassRows<L>) {
          with_rows<kPassRows<L>>(std::min(kPassRows<L>, rows - i), [&](auto r) {
            unpacked::rows_vnni<decltype(r)::value, kPerHalf<L>>(acc + i * width, u, k / kBlock,
                                                                 x, m0 + i);
          });
        }
        return;
      }
      return with_rows<kPassRows<L>>(rows, [&](auto r) {
        pair_vnni<decltype(r)::value>(L{}, acc, wg, group_bytes, x, m0, k);
      });
    }
    if (avx2 && m >= kUnpackRowsAvx2<L>) {
      // Many rows without VNNI (or VNNI's odd last group): each group unpacked
      // once, at the first pass, as above.
      unpacked::Block* u = unpacked::buffer(k / kBlock);
      const int groups = static_cast<int>(width / kGroupRows);
      if (m0 == 0) unpack_avx2(L{}, u, wg, group_bytes, groups, k / kBlock);
      for (int g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < rows; i += grouped::kMaxRows) {
          with_rows<grouped::kMaxRows>(std::min(grouped::kMaxRows, rows - i), [&](auto r) {
            unpacked::rows_avx2<decltype(r)::value, kPerHalf<L>, L::kTable, kOffsets<L>>(
                acc + g * kGroupRows + i * width, width, u, g, k / kBlock, x, m0 + i);
          });
        }
      }
      return;
    }
#endif
    (void)vnni;
    for (int64_t half = 0; half < width / kGroupRows; ++half) {
      group_dot<L>(acc + half * kGroupRows, width, wg + half * group_bytes, x, m0, rows, k, avx2);
    }
  };
#if SHARDLM_HAVE_AVX2
  if (on_amx) return grouped::gemv<amx::kRows>(out, bias, m, n, group_bytes, dot);
#endif
  grouped::gemv<kPassRows<L>>(out, bias, m, n, group_bytes, dot);
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
