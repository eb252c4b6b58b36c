// AVX2 (and AVX-512F) building blocks for the CPU kernels, compiled without
// -mavx2.
//
// The extension must load on any x86-64 CPU (and build on other
// architectures), so the translation units are compiled for the baseline ISA
// and only the functions marked SHARDLM_AVX2 use AVX2 / FMA / F16C through
// GCC's and Clang's per-function `target` attribute. Callers pick the AVX2
// path at run time with cpu::use_avx2() (cpu_utils.h); every kernel keeps its
// portable scalar loop as the fallback and for the tails.
//
// A SHARDLM_AVX2 function can only be inlined into another SHARDLM_AVX2 (or
// SHARDLM_AVX512) function, so the kernels dispatch once per row or per tile,
// never per element. SHARDLM_AVX512 functions, taken where cpu::use_avx512(),
// follow the same rules.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define SHARDLM_HAVE_AVX2 1
// GCC 12's AVX-512 headers start some intrinsics from an undefined register
// and warn about it where they are inlined (GCC bug 105593, fixed in 13); the
// warnings are silenced for the header's own lines only, and only in files
// where this is the header's first inclusion (quant_linear.cpp's ATen headers
// include it earlier, so its AVX-512 code still prints them).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define SHARDLM_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512F (cpu::use_avx512()); every AVX-512F CPU also has AVX2, FMA and F16C.
#define SHARDLM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
// AVX-512F with VL: 256-bit code given 32 vector registers instead of 16
// (the attention's blocks of rows, attention_rows.h).
#define SHARDLM_AVX512_VL __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))
// AVX-512 with VNNI and BW (cpu::use_avx512_vnni()): the int8 dot products.
#define SHARDLM_AVX512_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
#else
#define SHARDLM_HAVE_AVX2 0
#endif

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::avx2 {

// ---- prefetch ----------------------------------------------------------------------
// A decode step streams each weight once. The hardware prefetcher alone keeps
// too few lines in flight for the kernels to overlap their arithmetic with the
// reads, so the streaming kernels also ask for the line this many bytes ahead
// of the one they read, into L2 (prefetcht1), not L1. A look-ahead into L1
// left each core near 11 GB/s of weights while a plain read gets 25-28 GB/s a
// core here, most likely because a prefetch that misses holds one of L1's few
// miss buffers until memory answers; L2 keeps many more misses in flight, and
// a line the kernel reaches from L2 costs a few cycles, which the out-of-order
// core hides. Measured on a 2-core AMD EPYC (Zen 4), in-process
// batch-1 decode, the look-ahead alternated in one process (2026-11-29): 6 KiB
// into L1 against 12 KiB into L2, ~1B Q4_K_M 38.7 -> 44.0-46.7 tok/s, ~1B Q4_0
// 39.1 -> 46.3, ~1B Q5_K_M 32.9 -> 38.6, the default model (Q4_1) dequantized to
// float32 75 -> 116; its own file 315 -> 324 (a third of it fits in L3). The
// int8-activation kernels, which had looked 6 KiB ahead into L2, gain 3-5% from
// 12 KiB; 8-16 KiB are within noise of each other, 24 KiB and more fall off.
// A build may set another (-DSHARDLM_PREFETCH_BYTES=...) to time one host's own.
#ifndef SHARDLM_PREFETCH_BYTES
#define SHARDLM_PREFETCH_BYTES 12288
#endif
constexpr int64_t kPrefetchBytes = SHARDLM_PREFETCH_BYTES;

// Asks for the cache line at p into L2; a hint, so an address past the end of
// the weights is harmless. Written as the instruction itself: GCC 12 dropped
// _mm_prefetch from some of the kernels it was inlined into (the AVX-512 Q4x8
// and Q4Kx8 ones, which then streamed at half the bandwidth).
inline void prefetch_line_l2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

// The line kPrefetchBytes past p.
inline void prefetch_ahead(const void* p) {
  prefetch_line_l2(static_cast<const char*>(p) + kPrefetchBytes);
}

// ---- 8 lanes of T <-> 8 floats ------------------------------------------------------
// Conversions round to nearest even exactly like c10::BFloat16 / c10::Half, so
// vector and scalar code produce the same bits.

SHARDLM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

SHARDLM_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the upper half of a float32.
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

SHARDLM_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

SHARDLM_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// Rounds to bfloat16 like c10::round_to_nearest_even (bits + 0x7fff + lsb,
// NaN -> 0x7fc0); the result sits in the upper 16 bits of each lane.
SHARDLM_AVX2 inline __m256i bf16_round_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}

SHARDLM_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_round_bits(v), 16);
  // Values are < 2^16, so the unsigned-saturating pack is a plain narrowing.
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

SHARDLM_AVX2 inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Rounds to T and back, i.e. float(T(v)) for every lane, without a store.
template <typename T>
SHARDLM_AVX2 inline __m256 round_to(__m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(bf16_round_bits(v));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

// ---- reductions ------------------------------------------------------------------

SHARDLM_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// {hsum(a), hsum(b), hsum(c), hsum(d)}
SHARDLM_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);  // per 128-bit lane: a01 a23 b01 b23
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per lane: a b c d (half sums)
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// ---- 8 x 8 transpose ---------------------------------------------------------------
// v[r][j] -> v[j][r]: eight rows of 8 floats into eight columns.
SHARDLM_AVX2 inline void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < 2; ++h) {
      const __m256 a = t[4 * i + h], b = t[4 * i + 2 + h];
      u[4 * i + 2 * h] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    v[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// ---- exp ---------------------------------------------------------------------------
// Cephes-style expf: x = n ln2 + r with ln2 split in two for an exact
// reduction, a degree-6 polynomial for e^r on |r| <= ln2/2, then scale by 2^n.
// Relative error about 2 ulp of float32 (std::exp is within 1), far below the
// tolerance of the float32 results and almost always invisible after a
// bf16 / fp16 rounding. Like std::exp: +inf past ln(FLT_MAX), gradual
// underflow to denormals and 0, NaN in, NaN out.
SHARDLM_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283935546875f);  // ~ln(FLT_MAX)
  const __m256 lo = _mm256_set1_ps(-104.0f);              // e^lo rounds to 0
  __m256 xc = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  // n = round(x / ln2), in [-150, 128]
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  xc = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  xc = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), xc);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(xc, xc), _mm256_add_ps(xc, _mm256_set1_ps(1.f)));
  // 2^n as 2^n1 * 2^n2 with n1 = floor(n/2): both halves are normal floats over
  // the whole range of n, and the two products round (or overflow) once.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
}

}  // namespace shardlm::cpu::avx2

namespace shardlm::cpu::avx512 {

// ---- 16 lanes of T -> 16 floats ------------------------------------------------------

SHARDLM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

SHARDLM_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SHARDLM_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// ---- e^x ------------------------------------------------------------------------

// avx2::exp8 in 16 lanes: each lane goes through exactly exp8's operations,
// so it gives exp8's bits.
SHARDLM_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.72283935546875f);
  const __m512 lo = _mm512_set1_ps(-104.0f);
  __m512 xc = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  xc = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  xc = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), xc);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(xc, xc), _mm512_add_ps(xc, _mm512_set1_ps(1.f)));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i n1 = _mm512_srai_epi32(ni, 1);
  const __m512i n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23)));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23)));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);  // NaN stays NaN
}

// ---- reductions ------------------------------------------------------------------

// Lanes 8 .. 15 (a whole-register shuffle: GCC's _mm512_extract* read an
// undefined operand and warn).
SHARDLM_AVX512 inline __m256 upper8(__m512 v) {
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
}

// The low 8 lanes plus the high 8.
SHARDLM_AVX512 inline __m256 fold8(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), upper8(v));
}

// {sum(a), sum(b), sum(c), sum(d)}
SHARDLM_AVX512 inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  return avx2::hsum4(fold8(a), fold8(b), fold8(c), fold8(d));
}

}  // namespace shardlm::cpu::avx512
#endif  // SHARDLM_HAVE_AVX2
