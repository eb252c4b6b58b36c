// The CPU's measured float32 FMA peak (fma_peak.cpp), for the benchmark.
#pragma once

#include <cstdint>

namespace shardlm::cpu {

// FLOP/s of all intra-op threads each running `iterations` rounds of
// independent FMA chains on the widest SIMD path allowed (cpu_utils.h).
double fma_peak_flops(int64_t iterations);

}  // namespace shardlm::cpu
