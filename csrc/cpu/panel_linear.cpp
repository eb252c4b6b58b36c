// panel_linear.h: group unpacking (Q4x8 in q4x8.cpp, Q8_0 here, eight rows
// transposed into lanes) and the register-tiled multiply of the panels.
#include "panel_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_utils.h"
#include "panel_int16.h"
#include "q4x8.h"
#include "q6kx8.h"
#include "quant_blocks.h"

namespace shardlm::cpu::panel {
namespace {

using namespace cpu::quant;

// Input rows per register tile: 12 accumulators of 8 lanes, the panel's row
// and a broadcast fill 14 of AVX2's 16 vector registers.
constexpr int64_t kTileRows = 12;

// ---- Q8_0 rows 8g .. 8g+7 into a panel ---------------------------------------------

void unpack_q8_0_scalar(float* panel, const uint8_t* rows, int64_t row_bytes, int64_t k,
                        int64_t stride) {
  for (int64_t r = 0; r < kGroupRows; ++r) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* p = rows + r * row_bytes + b * block_bytes(kQ8_0);
      const float d = half_at(p);
      for (int64_t i = 0; i < kBlock; ++i) {
        panel[(b * kBlock + i) * stride + r] = d * static_cast<int8_t>(p[2 + i]);
      }
    }
  }
}

#if SHARDLM_HAVE_AVX2
// Eight rows' block b at a time (quant::q8_0_columns8), stored as panel rows.
SHARDLM_AVX2 void unpack_q8_0_avx2(float* panel, const uint8_t* rows, int64_t row_bytes,
                                   int64_t k, int64_t stride) {
  const int64_t bytes = block_bytes(kQ8_0);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* p = rows + b * bytes;
    const __m256 d = q8_0_scales8(p, row_bytes);
    for (int s = 0; s < 4; ++s) {
      __m256 v[8];
      q8_0_columns8(v, p, row_bytes, s, d);
      float* o = panel + (b * kBlock + 8 * s) * stride;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + j * stride, v[j]);
    }
  }
}
#endif

// Group g of the weight into lanes 0..7 of a panel whose rows are `stride`
// floats apart (unpack_panel in q4x8.h).
void unpack(float* panel, int64_t qtype, const uint8_t* w, int64_t g, int64_t k, int64_t stride,
            bool avx2) {
  const int64_t blocks_row_bytes = k / kBlock * block_bytes(qtype);
  const uint8_t* group = w + g * (grouped(qtype) ? 1 : kGroupRows) * blocks_row_bytes;
  if (half_scaled(qtype)) return q6kx8::unpack_panel(panel, qtype, group, k, stride, avx2);
  if (grouped(qtype)) return q4x8::unpack_panel(panel, qtype, group, k, stride, avx2);
#if SHARDLM_HAVE_AVX2
  if (avx2) return unpack_q8_0_avx2(panel, group, blocks_row_bytes, k, stride);
#endif
  unpack_q8_0_scalar(panel, group, blocks_row_bytes, k, stride);
}

// ---- the register tile ------------------------------------------------------------

// acc[r * 8 + l] = sum_i panel[8 i + l] * xt[i * R + r] (xt: R input rows
// interleaved, [K][R]).
template <int R>
void tile_scalar(float* acc, const float* panel, const float* xt, int64_t k) {
  for (int64_t j = 0; j < R * kGroupRows; ++j) acc[j] = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    for (int r = 0; r < R; ++r) {
      for (int64_t l = 0; l < kGroupRows; ++l) {
        acc[r * kGroupRows + l] += panel[i * kGroupRows + l] * xt[i * R + r];
      }
    }
  }
}

#if SHARDLM_HAVE_AVX2
template <int R>
SHARDLM_AVX2 void tile_avx2(float* acc, const float* panel, const float* xt, int64_t k) {
  // Fully unrolled, so the accumulators live in registers, not on the stack.
  __m256 c[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w = _mm256_loadu_ps(panel + i * kGroupRows);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      c[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xt + i * R + r), c[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * kGroupRows, c[r]);
}

// The AVX-512 tile: V vectors of 16 lanes per panel row (2 V groups side by
// side, panel [K][16 V]), R x V accumulators; 12 x 2 of them, the panel row
// and a broadcast fill 27 of the 32 registers, and each broadcast input
// feeds V FMAs.
template <int R, int V>
SHARDLM_AVX512 void tile_avx512(float* acc, const float* panel, const float* xt, int64_t k) {
  __m512 c[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) c[r][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(panel + (i * V + v) * 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(xt[i * R + r]);
      for (int v = 0; v < V; ++v) c[r][v] = _mm512_fmadd_ps(w[v], x, c[r][v]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (r * V + v) * 16, c[r][v]);
  }
}
#endif

template <int R>
void tile(float* acc, const float* panel, const float* xt, int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (avx2) return tile_avx2<R>(acc, panel, xt, k);
#endif
  (void)avx2;
  tile_scalar<R>(acc, panel, xt, k);
}

using TileFn = void (*)(float*, const float*, const float*, int64_t, bool);
constexpr TileFn kTiles[kTileRows] = {tile<1>, tile<2>, tile<3>, tile<4>,  tile<5>,  tile<6>,
                                      tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

#if SHARDLM_HAVE_AVX2
using WideTileFn = void (*)(float*, const float*, const float*, int64_t);
template <int V>
constexpr WideTileFn kWideTiles[kTileRows] = {
    tile_avx512<1, V>, tile_avx512<2, V>, tile_avx512<3, V>,  tile_avx512<4, V>,
    tile_avx512<5, V>, tile_avx512<6, V>, tile_avx512<7, V>,  tile_avx512<8, V>,
    tile_avx512<9, V>, tile_avx512<10, V>, tile_avx512<11, V>, tile_avx512<12, V>};
#endif

// acc[r * 8 * groups + l] for the `rows` input rows of xt against a panel of
// `groups` groups side by side (1, or with AVX-512 2 or 4).
void multiply(float* acc, const float* panel, int64_t groups, const float* xt, int64_t rows,
              int64_t k, bool avx2) {
#if SHARDLM_HAVE_AVX2
  if (groups == 4) return kWideTiles<2>[rows - 1](acc, panel, xt, k);
  if (groups == 2) return kWideTiles<1>[rows - 1](acc, panel, xt, k);
#endif
  kTiles[rows - 1](acc, panel, xt, k, avx2);
}

// Input rows [begin, begin + rows) of one tile: interleaved ([K][rows]) for
// the exact product, or rounded to integer pairs for the int16 one
// (panel_int16.h).
struct Tile {
  int64_t begin, rows;
  const float* xt;
  const int32_t* words;
  const float* scales;
};

// The input split into tiles of near-equal size (32 rows: 10, 11, 11, not
// 12, 12, 8, so every tile keeps enough FMA chains in flight), interleaved or
// rounded into thread-local buffers by the threads together.
std::vector<Tile> tiles_of(const float* x, int64_t m, int64_t k, bool rounded) {
  thread_local std::vector<float> buffer;
  thread_local std::vector<int32_t> words;
  thread_local std::vector<float> scales;
  if (rounded) {
    if (static_cast<int64_t>(words.size()) < m * k / 2) words.resize(m * k / 2);
    if (static_cast<int64_t>(scales.size()) < m * k / panel16::kBlock) {
      scales.resize(m * k / panel16::kBlock);
    }
  } else if (static_cast<int64_t>(buffer.size()) < m * k) {
    buffer.resize(m * k);
  }
  // The pool's threads see their own thread_locals.
  float* base = buffer.data();
  int32_t* word_base = words.data();
  float* scale_base = scales.data();
  const int64_t count = (m + kTileRows - 1) / kTileRows;
  std::vector<Tile> out;
  int64_t begin = 0;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t rows = (m - begin) / (count - t);
    out.push_back({begin, rows, base + begin * k, word_base + begin * k / 2,
                   scale_base + begin * k / panel16::kBlock});
    begin += rows;
  }
  if (rounded) {
    // Whole tiles a thread: each writes its own stretch of words and scales.
    at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = out[t].begin;
        panel16::round_rows(word_base + r0 * k / 2, scale_base + r0 * k / panel16::kBlock,
                            x + r0 * k, out[t].rows, k);
      }
    });
    return out;
  }
  at::parallel_for(0, k, 256, [&](int64_t i0, int64_t i1) {
    for (const Tile& t : out) {
      float* xt = base + t.begin * k;
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t r = 0; r < t.rows; ++r) xt[i * t.rows + r] = x[(t.begin + r) * k + i];
      }
    }
  });
  return out;
}

// out[r * n + l] = acc[r * lanes + l] + bias[l] (bias may be null) for a
// tile's rows: 16 lanes a store with AVX-512 and float outputs (at 512 rows of
// K = 576 the scalar copy was 3.5% of an int16 prefill's time).
#if SHARDLM_HAVE_AVX2
SHARDLM_AVX512 void store_tile_avx512(float* out, int64_t n, const float* acc, int64_t rows,
                                      int64_t lanes, const float* bias) {
  for (int64_t l = 0; l < lanes; l += 16) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + l) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_storeu_ps(out + r * n + l, _mm512_add_ps(_mm512_loadu_ps(acc + r * lanes + l), b));
    }
  }
}
#endif

template <typename T>
void store_tile(T* out, int64_t n, const float* acc, int64_t rows, int64_t lanes, const T* bias,
                [[maybe_unused]] bool avx512) {
#if SHARDLM_HAVE_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (avx512 && lanes % 16 == 0) return store_tile_avx512(out, n, acc, rows, lanes, bias);
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < lanes; ++l) {
      out[r * n + l] = from_f<T>(acc[r * lanes + l] + (bias != nullptr ? to_f(bias[l]) : 0.f));
    }
  }
}

// The int16 words and scales of groups g .. g + width - 1 of a Q8_0 weight,
// side by side in `lanes` lanes, from the weight's bytes (the float panel and
// its rounding pass skipped: 6% of an int16 prefill of SmolLM2's Q6_K file,
// mostly Q8_0 matrices). AVX2 only; other CPUs unpack and round.
void round_q8_0_groups([[maybe_unused]] int32_t* words, [[maybe_unused]] float* scales,
                       [[maybe_unused]] const uint8_t* w, [[maybe_unused]] int64_t g,
                       [[maybe_unused]] int64_t width, [[maybe_unused]] int64_t k,
                       [[maybe_unused]] int64_t lanes) {
#if SHARDLM_HAVE_AVX2
  const int64_t row_bytes = k / kBlock * block_bytes(kQ8_0);
  for (int64_t i = 0; i < width; ++i) {
    panel16::round_q8_0_rows(words + i * kGroupRows, scales + i * kGroupRows,
                             w + (g + i) * kGroupRows * row_bytes, row_bytes, k, lanes);
  }
#endif
}

// linear for at most kMaxRows input rows: each group of weight rows is
// unpacked (and, for the int16 precision, rounded) once and multiplied with
// every tile. The tiles' inputs (up to 4 MiB for 512 rows of K = 2048) come
// from L3 rather than L2, but the groups are unpacked once instead of once per
// pass of a few dozen rows, as until 2026-11-28: at 512 rows, 2 threads, the
// exact product of a 2048 x 8192 Q4Kx8 matrix rose from 165-168 to 217-218
// GFLOP/s, 8192 x 2048 from 188-196 to 219-220, SmolLM2's matrices by 0-15%
// (with chunks of 512 rows, not 256, another 0-7%).
// `rounded`: the int16 precision's integer product (panel_int16.h).
template <typename T>
void linear_rows(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias,
                 int64_t m, int64_t n, int64_t k, bool rounded) {
  const bool avx2 = cpu::use_avx2();
  const bool avx512 = cpu::use_avx512();
  // With AVX-512 four groups are unpacked side by side and multiplied
  // together (tile_avx512); the last one to three take panels of two and one.
  const int64_t span = avx512 ? 4 : 1;
  const int64_t groups = n / kGroupRows;
  // The int16 words of a Q8_0 panel come straight from its bytes (AVX2).
  const bool direct = rounded && qtype == kQ8_0 && avx2;
  const std::vector<Tile> tiles = tiles_of(x, m, k, rounded);
  at::parallel_for(0, (groups + span - 1) / span, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> panel;
    thread_local std::vector<int32_t> words;  // the panel rounded (int16 precision)
    thread_local std::vector<float> scales;
    if (static_cast<int64_t>(panel.size()) < k * kGroupRows * span) {
      panel.resize(k * kGroupRows * span);
    }
    if (rounded && static_cast<int64_t>(words.size()) < k / 2 * kGroupRows * span) {
      words.resize(k / 2 * kGroupRows * span);
      scales.resize(kGroupRows * span);
    }
    float acc[kTileRows * kGroupRows * 4];
    for (int64_t g = begin * span; g < std::min(groups, end * span);) {
      const int64_t left = std::min(groups, end * span) - g;
      const int64_t width = span == 1 ? 1 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const int64_t lanes = width * kGroupRows;
      if (direct) {
        round_q8_0_groups(words.data(), scales.data(), w, g, width, k, lanes);
      } else {
        for (int64_t i = 0; i < width; ++i) {
          unpack(panel.data() + i * kGroupRows, qtype, w, g + i, k, lanes, avx2);
        }
        if (rounded) panel16::round_panel(words.data(), scales.data(), panel.data(), lanes, k);
      }
      for (const Tile& t : tiles) {
        if (rounded) {
          panel16::multiply(acc, words.data(), scales.data(), lanes, t.words, t.scales, t.rows, k);
        } else {
          multiply(acc, panel.data(), width, t.xt, t.rows, k, avx2);
        }
        store_tile(out + t.begin * n + g * kGroupRows, n, acc, t.rows, lanes,
                   bias != nullptr ? bias + g * kGroupRows : nullptr, avx512);
      }
      g += width;
    }
  });
}

// Whether the int16 precision rounds a product of m rows over K = k here (panel_int16.h).
bool rounds_int16(int64_t m, int64_t k) {
  return cpu::activation_precision() == cpu::ActivationPrecision::kInt16 &&
         m >= panel16::kMinRows && panel16::takes(k);
}

}  // namespace

bool takes(int64_t qtype, int64_t m, int64_t n, int64_t k) {
  if (qtype == kQ8_0) return m >= kMinRows && n % kGroupRows == 0;
  return grouped(qtype) && (m >= kGroupedMinRows || rounds_int16(m, k));
}

template <typename T>
void linear(T* out, int64_t qtype, const uint8_t* w, const float* x, const T* bias, int64_t m,
            int64_t n, int64_t k) {
  // Equal chunks of at most kMaxRows rows (a long prompt's last one not left a few rows).
  const bool rounded = rounds_int16(m, k);
  const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;
  for (int64_t c = 0, r0 = 0; c < chunks; ++c) {
    const int64_t rows = (m - r0) / (chunks - c);
    linear_rows(out + r0 * n, qtype, w, x + r0 * k, bias, rows, n, k, rounded);
    r0 += rows;
  }
}

template void linear<float>(float*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                            int64_t, int64_t);
template void linear<c10::BFloat16>(c10::BFloat16*, int64_t, const uint8_t*, const float*,
                                    const c10::BFloat16*, int64_t, int64_t, int64_t);
template void linear<c10::Half>(c10::Half*, int64_t, const uint8_t*, const float*,
                                const c10::Half*, int64_t, int64_t, int64_t);

}  // namespace shardlm::cpu::panel
