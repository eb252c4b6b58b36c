// Quants read as float32 subnormals: a 4-, 5- or 6-bit quant masked in place in
// the low 22 bits of a 32-bit lane, with every other bit clear, is the bit
// pattern of the subnormal float q * 2^(p - 149) (p its bit position). An FMA takes it as
// it is, against an input pre-scaled by 2^(149 - p - kSubnormalShift) (a power
// of two: exact), and computes q * x * 2^-kSubnormalShift exactly before its
// one rounding, so the sums are those of the converted quants times 2^-shift,
// bit for bit, and the block scale times 2^shift restores them. That saves the
// conversion of every quant: one mask and one FMA per 8 or 16 weights in place
// of a mask, a conversion and an FMA, where the exact decode kernels are bound
// by the vector ops rather than the memory.
//
// Two conditions: the FMA must take subnormal inputs at full speed (AMD's cores
// do; some Intel cores take a microcode assist for each), which a short timing
// decides once per process, and the thread must not treat subnormal inputs as
// zero (MXCSR's DAZ bit, which -ffast-math builds and flush-denormal settings
// turn on), which SubnormalInputs clears around the kernels, with FTZ.
#pragma once

#include <atomic>
#include <cstdint>

#include "cpu_utils.h"
#include "simd.h"

namespace shardlm::cpu {

// Products land at q * x * 2^-kSubnormalShift: far from float32's subnormals
// and its overflow (the largest input factor is 2^85).
constexpr int kSubnormalShift = 64;
constexpr float kSubnormalBlockScale = 0x1p64f;  // 2^kSubnormalShift
// Inputs the subnormal kernels take (others take the converting ones): below
// kSubnormalInputLimit, and in rows whose largest input reaches
// kSubnormalRowFloor (or is 0), so the sums stay far above the subnormals and
// round as the converting kernels' sums do. A single product below 2^-62 (an
// input near 2^-66 beside larger ones) lands among the subnormals when it
// starts a chain and keeps an absolute precision of 2^-85 there, far below
// the ulp of the sum it joins.
constexpr float kSubnormalInputLimit = 0x1p40f;
constexpr float kSubnormalRowFloor = 0x1p-30f;

// The input factor of quant j of a word of 4-bit (or, joined with their high
// bits, 5- or 6-bit) quants, quant j in bits 4j on: quants 0-4 are masked in place
// (bits up to 21), quants 5 and 6 in the word shifted down by
// kSubnormalHighShift (in place they would reach the exponent), so at bits 0
// and 4, and quant 7 shifted down to bit 0 (as the converting kernels take
// it): 2^(149 - place - kSubnormalShift).
constexpr int kSubnormalHighShift = 20;
constexpr float kSubnormalNibbleScale[8] = {0x1p85f, 0x1p81f, 0x1p77f, 0x1p73f,
                                            0x1p69f, 0x1p85f, 0x1p81f, 0x1p85f};
// The same for 2-bit quants (Q2Kx8), quant j of a word at bit 2j, all in place.
constexpr float kSubnormalTwoBitScale[8] = {0x1p85f, 0x1p83f, 0x1p81f, 0x1p79f,
                                            0x1p77f, 0x1p75f, 0x1p73f, 0x1p71f};

// Whether the exact 4-, 5- and 6-bit kernels read quants as subnormals: 0 never, 1 always
// (where the CPU has AVX2; for tests), 2 where the probe finds them as fast as
// converted ones (the default). Process-wide; set_cpu_subnormal_quants()
// (ops.cpp) sets it.
enum class SubnormalQuants { kOff = 0, kOn = 1, kAuto = 2 };

inline std::atomic<int>& subnormal_quants_setting() {
  static std::atomic<int> setting{static_cast<int>(SubnormalQuants::kAuto)};
  return setting;
}

// The probe: FMAs on subnormal quants against FMAs on converted ones, timed on
// this core once per process (subnormal.cpp); true when the first take at most
// as long as the second (an assisted FMA is tens of times slower).
bool subnormal_fma_fast();

// Whether a kernel call takes the subnormal path: AVX2 or wider, and the
// setting (read once per call).
inline bool use_subnormal_quants() {
  if (!use_avx2()) return false;
  const int setting = subnormal_quants_setting().load(std::memory_order_relaxed);
  switch (static_cast<SubnormalQuants>(setting)) {
    case SubnormalQuants::kOff: return false;
    case SubnormalQuants::kOn: return true;
    default: return subnormal_fma_fast();
  }
}

// Clears MXCSR's DAZ and FTZ bits on this thread for its lifetime where
// `active` and either is set, so subnormal quants are read as what they are,
// and a chain's first product, if it is tiny enough to land among the
// subnormals after the scaling, is kept rather than flushed to zero.
class SubnormalInputs {
 public:
  explicit SubnormalInputs(bool active) {
#if SHARDLM_HAVE_AVX2
    if (active) {
      saved_ = _mm_getcsr();
      if (saved_ & kFlush) _mm_setcsr(saved_ & ~kFlush);
    }
#else
    (void)active;
#endif
  }
  ~SubnormalInputs() {
#if SHARDLM_HAVE_AVX2
    if (saved_ & kFlush) _mm_setcsr(saved_);
#endif
  }
  SubnormalInputs(const SubnormalInputs&) = delete;
  SubnormalInputs& operator=(const SubnormalInputs&) = delete;

 private:
  static constexpr unsigned kFlush = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_ = 0;
};

}  // namespace shardlm::cpu
