// The int8 mode's many-rows path on AMX (Intel Xeon from Sapphire Rapids on):
// 16 input rows against a pair of groups unpacked as int8_unpacked.h unpacks
// them, each block's integer dot products in one tile instruction instead of
// 128 VNNI ones, for the layouts with one scale a block. The unpacked block's
// bytes are already an AMX B tile (step j's 64 bytes: 16 features x the 4
// quants meeting the input's word j), and the rounded input rows an A tile as
// they lie (16 rows, K bytes apart), so nothing is rearranged; the tile's
// int32 sums are VNNI's exactly (integer sums), and they are scaled with
// rows_vnni's float operations in its order: a row's result is the same, bit
// for bit, on either path.
#pragma once

#include <cstdint>

#include "int8_linear.h"
#include "int8_unpacked.h"

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::int8::amx {

// Input rows one call takes: a tile's 16 rows.
constexpr int64_t kRows = 16;

// acc[16 r + l] for input rows m0 .. m0 + 15 against the pair's `blocks`
// unpacked blocks of a layout with one scale a block (the nibble and table
// layouts; the per-half ones stay on VNNI: their two tiles and two scalings
// a block ran at 0.80-0.89x of the VNNI kernel, 4096 x 2048 at 64 and 512
// rows, the sums held in registers as here). Only where cpu::use_amx_int8().
void rows(float* acc, const unpacked::Block* u, int64_t blocks, const Int8Rows& x, int64_t m0);

}  // namespace shardlm::cpu::int8::amx
#endif
