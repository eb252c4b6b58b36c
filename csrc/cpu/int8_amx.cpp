// AMX detection (cpu_utils.h) and the int8 mode's AMX rows (int8_amx.h).
#include "int8_amx.h"

// First, so that its silencing of GCC 12's AVX-512 header warnings applies (simd.h).
#include "simd.h"

#include "cpu_utils.h"

#if SHARDLM_HAVE_AVX2
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace shardlm::cpu {

bool cpu_has_amx_int8() {
  static const bool has = [] {
#if SHARDLM_HAVE_AVX2 && defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    // The OS saves the tile state (XCR0 bits 17 and 18; xgetbv needs OSXSAVE)...
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    // ... and lets this process use it (Linux asks each process to request
    // the tile data state, feature 18, before its first tile instruction).
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
    return false;
#endif
  }();
  return has;
}

}  // namespace shardlm::cpu

#if SHARDLM_HAVE_AVX2
namespace shardlm::cpu::int8::amx {
namespace {

#define SHARDLM_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

// Tile numbers, as macros: the tile intrinsics paste them into the
// instruction's text. C: 16 rows (inputs) of 16 int32 (features); A: 16 rows
// of a block's 32 input bytes; B: 8 rows (steps) of 64 bytes (16 features x
// the 4 quants meeting the input's word).
#define SHARDLM_TILE_C 0
#define SHARDLM_TILE_A 1
#define SHARDLM_TILE_B 2

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  c.rows[SHARDLM_TILE_C] = 16, c.bytes_per_row[SHARDLM_TILE_C] = 64;
  c.rows[SHARDLM_TILE_A] = 16, c.bytes_per_row[SHARDLM_TILE_A] = quant::kBlock;
  c.rows[SHARDLM_TILE_B] = quant::kBlock / 4, c.bytes_per_row[SHARDLM_TILE_B] = 64;
  return c;
}

// Block b's integer sums, dot[r][l] for input row r and feature l.
SHARDLM_AMX inline void tile_sums(int32_t (*dot)[16], const unpacked::Block& u, const int8_t* a,
                                  int64_t k) {
  _tile_zero(SHARDLM_TILE_C);
  _tile_loadd(SHARDLM_TILE_A, a, k);
  _tile_loadd(SHARDLM_TILE_B, u.bytes[0], 64);
  _tile_dpbsud(SHARDLM_TILE_C, SHARDLM_TILE_A, SHARDLM_TILE_B);
  _tile_stored(SHARDLM_TILE_C, dot, 64);
}

// Block b's stored sums scaled into the 16 rows' sums, held in registers
// through the blocks: sum += d * dx * dot, as rows_vnni scales its chains.
SHARDLM_AMX inline void scale_block(__m512 (&sum)[16], const int32_t (*dot)[16],
                                    const unpacked::Block& u, const float* dx, int64_t blocks) {
  const __m512 d = _mm512_loadu_ps(u.scale[0]);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512 products = _mm512_cvtepi32_ps(_mm512_loadu_si512(dot[r]));
    sum[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks])), products, sum[r]);
  }
}

SHARDLM_AMX void rows_amx(float* acc, const unpacked::Block* u, int64_t blocks,
                          const Int8Rows& x, int64_t m0) {
  static const TileConfig config = make_config();
  // Set on every call: another library on this thread (oneDNN) may have
  // loaded tiles of other shapes since.
  _tile_loadconfig(&config);
  const int64_t k = blocks * quant::kBlock;
  __m512 sum[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) sum[r] = _mm512_setzero_ps();
  // Two blocks' sums: block b's tiles run while block b - 1's are scaled, so
  // the scaling never waits for the tile store it reads.
  alignas(64) int32_t dot[2][16][16];
  const int8_t* a = x.q + m0 * k;
  const float* dx = x.scale + m0 * blocks;  // row r's block b at r * blocks + b
  for (int64_t b = 0; b < blocks; ++b) {
    tile_sums(dot[b & 1], u[b], a + b * quant::kBlock, k);
    if (b > 0) scale_block(sum, dot[(b - 1) & 1], u[b - 1], dx + b - 1, blocks);
  }
  scale_block(sum, dot[(blocks - 1) & 1], u[blocks - 1], dx + blocks - 1, blocks);
  _tile_release();
  // The offsets, m * sum32 over the blocks, each row in a chain of its own
  // (rows_vnni's off) with the sums parked in acc meanwhile, then added once,
  // as rows_vnni adds them.
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(acc + 16 * r, sum[r]);
  __m512 off[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) off[r] = _mm512_setzero_ps();
  const float* sums = x.sum32 + m0 * blocks;  // row r's block b at r * blocks + b
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 m = _mm512_loadu_ps(u[b].offset[0]);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * blocks + b]), off[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    _mm512_storeu_ps(acc + 16 * r, _mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), off[r]));
  }
}

}  // namespace

void rows(float* acc, const unpacked::Block* u, int64_t blocks, const Int8Rows& x, int64_t m0) {
  rows_amx(acc, u, blocks, x, m0);
}

}  // namespace shardlm::cpu::int8::amx
#endif
