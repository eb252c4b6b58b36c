// CPU: paged attention for decode (one query per sequence) and varlen causal
// prefill over the paged KV cache.
//
// Both are "a set of query rows of one sequence and one kv head, row r seeing
// keys 0..pos[r]", run by attend_rows() flash-attention style: keys are
// walked in tiles of kKeyTile tokens shared by all rows (the GQA group's
// heads, and for prefill a tile of query tokens), with an online (running
// max / sum) softmax per row. Tasks are
// (sequence, kv head[, query tile]) spread with at::parallel_for, or run on
// the calling thread when the whole call is too small to pay for waking the
// pool. Scratch memory is per thread and only ever grows, so the steady-state
// decode loop allocates nothing.
//
// The per-tile steps (score, exponentiate, accumulate) have a portable
// version, which reads a float copy of each tile, and an AVX2 one (simd.h),
// picked once per call, which reads the cache rows in place when there are
// few rows (decode) and a float copy otherwise.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;

constexpr int64_t kKeyTile = 32;    // keys scored per step
constexpr int64_t kQueryTile = 16;  // prefill query tokens per task

template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int32_t* block_row;  // this sequence's block table row
  int64_t block_size;
  int64_t token_stride;  // kv_heads * head_dim
  int64_t kv_head;
  int64_t head_dim;

  // off[j] = element offset of token t0 + j's head row, for j < n. Walks the
  // block table instead of dividing per token: a 64-bit division costs about
  // as much as converting the token's row.
  void offsets(int64_t t0, int64_t n, int64_t* off) const {
    int64_t block = t0 / block_size;
    int64_t slot = t0 % block_size;
    for (int64_t j = 0; j < n; ++j) {
      off[j] = (block_row[block] * block_size + slot) * token_stride + kv_head * head_dim;
      if (++slot == block_size) {
        slot = 0;
        ++block;
      }
    }
  }
};

template <typename T>
struct Row {
  const T* q;
  T* out;
  int64_t pos;  // last visible key; < 0 means no keys (zero output)
};

// Float scratch for up to `max_rows` rows: q, acc [rows][D]; k, v [kKeyTile][D];
// scores [kKeyTile]; running max / sum [rows]. Views into a thread_local
// buffer that grows to the largest shape seen and is then reused.
struct Workspace {
  float *q, *acc, *k, *v, *s, *m, *l;
  Workspace(int64_t max_rows, int64_t d) {
    thread_local std::vector<float> buf;
    const size_t need =
        static_cast<size_t>(2 * max_rows * d + 2 * kKeyTile * d + kKeyTile + 2 * max_rows);
    if (buf.size() < need) {
      buf.resize(need);
    }
    q = buf.data();
    acc = q + max_rows * d;
    k = acc + max_rows * d;
    v = k + kKeyTile * d;
    s = v + kKeyTile * d;
    m = s + kKeyTile;
    l = m + max_rows;
  }
};

// The calling thread's row descriptors, grown like the workspace.
template <typename T>
Row<T>* thread_rows(int64_t n) {
  thread_local std::vector<Row<T>> rows;
  if (rows.size() < static_cast<size_t>(n)) {
    rows.resize(n);
  }
  return rows.data();
}


// ---- tile steps --------------------------------------------------------------------
// A tile's key and value rows are passed as pointers to D elements of S: a
// float copy of the tile, or (AVX2 only) the cache rows themselves, S = T.

// Converts the tile's rows to float into kt / vt ([nk][D] each) and points
// kr / vr at the copies.
template <typename T>
void convert_tile(float* kt, float* vt, const T* const* k, const T* const* v, int64_t nk,
                  int64_t D, const float** kr, const float** vr) {
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t i = 0; i < D; ++i) {
      kt[j * D + i] = to_f(k[j][i]);
      vt[j * D + i] = to_f(v[j][i]);
    }
    kr[j] = kt + j * D;
    vr[j] = vt + j * D;
  }
}

// Portable steps; with float rows they do exactly what the kernel did before
// it had an AVX2 path.
struct Portable {
  // s[j] = q . k[j] for j < nk.
  static void scores(float* s, const float* q, const float* const* k, int64_t nk, int64_t D) {
    for (int64_t j = 0; j < nk; ++j) s[j] = cpu::dot_f(q, k[j], D);
  }
  // s[j] = exp(s[j] - m); returns the sum.
  static float exp(float* s, int64_t n, float m) {
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    return sum;
  }
  // acc = alpha * acc + sum_j p[j] * v[j].
  static void accumulate(float* acc, float alpha, const float* p, const float* const* v,
                         int64_t nk, int64_t D) {
    for (int64_t i = 0; i < D; ++i) acc[i] *= alpha;
    for (int64_t j = 0; j < nk; ++j) cpu::axpy_f(acc, p[j], v[j], D);
  }
};

#if SHARDLM_HAVE_AVX2
// Same maths with 8-wide FMAs, so float32 sums round differently (well within
// the tolerance), and avx2::exp8 instead of std::exp. Rows of bf16 / fp16 are
// converted as they are read.
namespace avx2 = cpu::avx2;

template <typename T>
SHARDLM_AVX2 void convert_tile_avx2(float* kt, float* vt, const T* const* k, const T* const* v,
                                    int64_t nk, int64_t D, const float** kr, const float** vr) {
  for (int64_t j = 0; j < nk; ++j) {
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
      avx2::store8(kt + j * D + i, avx2::load8(k[j] + i));
      avx2::store8(vt + j * D + i, avx2::load8(v[j] + i));
    }
    for (; i < D; ++i) {
      kt[j * D + i] = to_f(k[j][i]);
      vt[j * D + i] = to_f(v[j][i]);
    }
    kr[j] = kt + j * D;
    vr[j] = vt + j * D;
  }
}

// Eight keys at a time: eight independent FMA chains keep the FMA units busy
// (one dot product alone is a single latency-bound chain), and q is loaded
// once per eight keys.
template <typename S>
SHARDLM_AVX2 void scores_avx2(float* s, const float* q, const S* const* k, int64_t nk,
                              int64_t D) {
  const int64_t D8 = D & ~int64_t{7};
  int64_t j = 0;
  for (; j + 8 <= nk; j += 8) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D8; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, avx2::load8(k[j + u] + i), a[u]);
    }
    _mm_storeu_ps(s + j, avx2::hsum4(a[0], a[1], a[2], a[3]));
    _mm_storeu_ps(s + j + 4, avx2::hsum4(a[4], a[5], a[6], a[7]));
    for (int64_t i = D8; i < D; ++i) {
      for (int u = 0; u < 8; ++u) s[j + u] += q[i] * to_f(k[j + u][i]);
    }
  }
  for (; j < nk; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < D8; i += 8) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), avx2::load8(k[j] + i), a);
    }
    float dot = avx2::hsum(a);
    for (int64_t i = D8; i < D; ++i) dot += q[i] * to_f(k[j][i]);
    s[j] = dot;
  }
}

SHARDLM_AVX2 float exp_avx2(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (j < n) {
    // Pad the tail with -inf: exp(-inf) = 0 adds nothing to the sum.
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -std::numeric_limits<float>::infinity());
    std::copy(s + j, s + n, tail);
    const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv));
    _mm256_store_ps(tail, p);
    std::copy(tail, tail + (n - j), s + j);
    sum = _mm256_add_ps(sum, p);
  }
  return avx2::hsum(sum);
}

// Columns [c, c + 8*NV) of one row's accumulator, kept in NV registers
// across all nk keys.
template <int NV, typename S>
SHARDLM_AVX2 inline void accumulate_cols(float* acc, float alpha, const float* p,
                                         const S* const* v, int64_t nk, int64_t c) {
  __m256 a[NV];
  const __m256 al = _mm256_set1_ps(alpha);
  for (int u = 0; u < NV; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8 * u), al);
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int u = 0; u < NV; ++u) a[u] = _mm256_fmadd_ps(pj, avx2::load8(v[j] + c + 8 * u), a[u]);
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + c + 8 * u, a[u]);
}

template <typename S>
SHARDLM_AVX2 void accumulate_avx2(float* acc, float alpha, const float* p, const S* const* v,
                                  int64_t nk, int64_t D) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) accumulate_cols<8>(acc, alpha, p, v, nk, c);
  for (; c + 32 <= D; c += 32) accumulate_cols<4>(acc, alpha, p, v, nk, c);
  for (; c + 8 <= D; c += 8) accumulate_cols<1>(acc, alpha, p, v, nk, c);
  for (; c < D; ++c) {
    float a = acc[c] * alpha;
    for (int64_t j = 0; j < nk; ++j) a += p[j] * to_f(v[j][c]);
    acc[c] = a;
  }
}

struct Avx2 {
  template <typename S>
  static void scores(float* s, const float* q, const S* const* k, int64_t nk, int64_t D) {
    scores_avx2(s, q, k, nk, D);
  }
  static float exp(float* s, int64_t n, float m) { return exp_avx2(s, n, m); }
  template <typename S>
  static void accumulate(float* acc, float alpha, const float* p, const S* const* v,
                         int64_t nk, int64_t D) {
    accumulate_avx2(acc, alpha, p, v, nk, D);
  }
};
#endif  // SHARDLM_HAVE_AVX2

// One tile for every row that sees part of it: scores, online softmax
// update, accumulation. Ops is Portable or Avx2; S is float or T.
template <typename Ops, typename T, typename S>
void attend_tile(const Row<T>* rows, int64_t n, int64_t k0, int64_t nk, const S* const* kr,
                 const S* const* vr, int64_t D, const Workspace& ws) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t visible = std::min(nk, rows[r].pos - k0 + 1);  // causal mask
    if (visible <= 0) continue;
    Ops::scores(ws.s, ws.q + r * D, kr, visible, D);
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, ws.s[j]);
    // visible > 0 makes m_new finite, so exp(-inf - m_new) = 0 on the
    // first tile and no NaN can appear.
    const float m_new = std::max(ws.m[r], tile_max);
    const float alpha = std::exp(ws.m[r] - m_new);
    const float sum = Ops::exp(ws.s, visible, m_new);  // scores -> probabilities
    Ops::accumulate(ws.acc + r * D, alpha, ws.s, vr, visible, D);
    ws.l[r] = ws.l[r] * alpha + sum;
    ws.m[r] = m_new;
  }
}

// Up to this many rows, the AVX2 path reads bf16 / fp16 rows straight from
// the cache, converting as it goes; more rows (prefill) share one float copy
// of the tile. float32 rows are always read in place.
constexpr int64_t kMaxDirectRows = 8;

template <typename T>
void attend_rows(const Row<T>* rows, int64_t n, const PagedKV<T>& kv, float scale,
                 const Workspace& ws, bool simd) {
  const int64_t D = kv.head_dim;
  int64_t last = -1;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < D; ++i) ws.q[r * D + i] = to_f(rows[r].q[i]) * scale;
    std::fill(ws.acc + r * D, ws.acc + (r + 1) * D, 0.f);
    ws.m[r] = -std::numeric_limits<float>::infinity();
    ws.l[r] = 0.f;
    last = std::max(last, rows[r].pos);
  }
  [[maybe_unused]] const bool direct = std::is_same_v<T, float> || n <= kMaxDirectRows;
  int64_t off[kKeyTile];
  const T* kc[kKeyTile];  // the tile's rows in the cache
  const T* vc[kKeyTile];
  const float* kf[kKeyTile];  // ... or in the float copy
  const float* vf[kKeyTile];
  for (int64_t k0 = 0; k0 <= last; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, last + 1 - k0);
    kv.offsets(k0, nk, off);
    for (int64_t j = 0; j < nk; ++j) {
      kc[j] = kv.k + off[j];
      vc[j] = kv.v + off[j];
    }
#if SHARDLM_HAVE_AVX2
    if (simd && direct) {
      attend_tile<Avx2>(rows, n, k0, nk, kc, vc, D, ws);
      continue;
    }
    if (simd) {
      convert_tile_avx2(ws.k, ws.v, kc, vc, nk, D, kf, vf);
      attend_tile<Avx2>(rows, n, k0, nk, kf, vf, D, ws);
      continue;
    }
#endif
    convert_tile(ws.k, ws.v, kc, vc, nk, D, kf, vf);
    attend_tile<Portable>(rows, n, k0, nk, kf, vf, D, ws);
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = ws.l[r] > 0.f ? 1.f / ws.l[r] : 0.f;  // no keys -> zeros
    for (int64_t i = 0; i < D; ++i) rows[r].out[i] = from_f<T>(ws.acc[r * D + i] * inv);
  }
}

// Below this much work (query rows x keys they see x head_dim) a call runs on
// the calling thread: waking the pool costs more than it saves there, and far
// more when the cores are shared. 2^18 is one sequence of ~340 tokens with 12
// heads of 64, about where two threads start to win.
constexpr int64_t kMinParallelWork = 1 << 18;

// at::parallel_for grain: everything in one chunk for a small call, else one
// task per chunk (tasks differ in length, so small chunks balance better).
int64_t attention_grain(int64_t tasks, int64_t work) {
  return work < kMinParallelWork ? std::max<int64_t>(tasks, 1) : 1;
}

// Block-table entries needed for `len` tokens must point inside the cache.
void check_block_row(const int32_t* row, int64_t len, const AttnDims& d, int64_t seq,
                     const char* op) {
  const int64_t needed = (len + d.block_size - 1) / d.block_size;
  TORCH_CHECK(needed <= d.max_blocks_per_seq, op, ": sequence ", seq, " needs ", needed,
              " blocks for ", len, " tokens but block_tables has ", d.max_blocks_per_seq,
              " columns");
  for (int64_t i = 0; i < needed; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < d.num_blocks, op, ": block_tables[", seq, "][", i,
                "] = ", row[i], " is outside [0, ", d.num_blocks, ")");
  }
}

template <typename T>
void decode_impl(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables,
                 const int32_t* ctx_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const bool simd = cpu::use_avx2();
  int64_t keys = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) keys += ctx_lens[b];
  const int64_t tasks = d.num_seqs * d.num_kv_heads;
  // Task = (sequence, kv head): the group's query heads share each key tile.
  at::parallel_for(0, tasks, attention_grain(tasks, keys * d.num_heads * D),
                   [&](int64_t begin, int64_t end) {
    const Workspace ws(group, D);
    Row<T>* rows = thread_rows<T>(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / d.num_kv_heads;
      const int64_t g = task % d.num_kv_heads;
      for (int64_t i = 0; i < group; ++i) {
        const int64_t h = g * group + i;
        rows[i] = {q + b * d.q_row_stride + h * d.q_head_stride,
                   out + (b * d.num_heads + h) * D, ctx_lens[b] - 1};
      }
      const PagedKV<T> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, g, D};
      attend_rows(rows, group, kv, scale, ws, simd);
    }
  });
}

template <typename T>
void prefill_impl(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables,
                  const int32_t* qsl, const int32_t* seq_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  const bool simd = cpu::use_avx2();
  // tile_start[b] = index of sequence b's first query tile (prefix sums), in
  // a reusable buffer of the calling thread. A named reference, because the
  // workers must read this thread's copy, not their own thread_local one.
  thread_local std::vector<int64_t> tile_start_buf;
  std::vector<int64_t>& tile_start = tile_start_buf;
  tile_start.assign(d.num_seqs + 1, 0);
  int64_t work = 0;  // query tokens x keys they see (about half of q_len x seq_len)
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    tile_start[b + 1] = tile_start[b] + (q_len + kQueryTile - 1) / kQueryTile;
    work += q_len * (seq_lens[b] - q_len / 2);
  }
  // Task = (query tile, kv head): kQueryTile tokens x the group's heads.
  const int64_t tasks = tile_start[d.num_seqs] * d.num_kv_heads;
  at::parallel_for(0, tasks, attention_grain(tasks, work * d.num_heads * D),
                   [&](int64_t begin, int64_t end) {
    const Workspace ws(kQueryTile * group, D);
    Row<T>* rows = thread_rows<T>(kQueryTile * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / d.num_kv_heads;
      const int64_t g = task % d.num_kv_heads;
      // Owning sequence: last b with tile_start[b] <= tile (skips empty ones).
      const int64_t b =
          std::upper_bound(tile_start.begin(), tile_start.end(), tile) - tile_start.begin() - 1;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t t0 = (tile - tile_start[b]) * kQueryTile;
      const int64_t nt = std::min(kQueryTile, q_len - t0);
      // Causal: new token i sits at absolute position seq_len - q_len + i.
      const int64_t first_pos = seq_lens[b] - q_len;
      int64_t n = 0;
      for (int64_t t = t0; t < t0 + nt; ++t) {
        const int64_t tok = qsl[b] + t;
        for (int64_t i = 0; i < group; ++i) {
          const int64_t h = g * group + i;
          rows[n++] = {q + tok * d.q_row_stride + h * d.q_head_stride,
                       out + (tok * d.num_heads + h) * D, first_pos + t};
        }
      }
      const PagedKV<T> kv{kc, vc, tables + b * d.max_blocks_per_seq, d.block_size,
                          d.num_kv_heads * D, g, D};
      attend_rows(rows, n, kv, scale, ws, simd);
    }
  });
}

}  // namespace

void paged_attention_decode_cpu(at::Tensor& out, const at::Tensor& query,
                                const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                double scale, int64_t max_context_len) {
  const char* op = "paged_attention_decode";
  const AttnDims d = check_paged_decode(out, query, key_cache, value_cache, block_tables,
                                        context_lens, max_context_len);
  if (out.numel() == 0) {
    return;
  }
  const int32_t* ctx = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    // The CUDA kernel sizes its grid from max_context_len, so reject a wrong
    // value here where it is cheap to notice.
    TORCH_CHECK(ctx[b] >= 0 && ctx[b] <= max_context_len, op, ": context_lens[", b, "] = ",
                ctx[b], " is outside [0, max_context_len=", max_context_len, "]");
    check_block_row(tables + b * d.max_blocks_per_seq, ctx[b], d, b, op);
  }
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_decode", [&] {
    decode_impl(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                tables, ctx, static_cast<float>(scale), d);
  });
}

void paged_attention_prefill_cpu(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, int64_t max_query_len, int64_t max_seq_len) {
  const char* op = "paged_attention_prefill";
  const AttnDims d = check_paged_prefill(out, query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, max_query_len, max_seq_len);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[d.num_seqs] == d.num_tokens, op,
              ": query_start_loc must start at 0 and end at the number of query tokens (",
              d.num_tokens, "), got [", qsl[0], ", ..., ", qsl[d.num_seqs], "]");
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= max_query_len, op, ": query length ", q_len,
                " of sequence ", b, " is outside [0, max_query_len=", max_query_len, "]");
    TORCH_CHECK(lens[b] >= q_len && lens[b] <= max_seq_len, op, ": seq_lens[", b, "] = ",
                lens[b], " must be in [query length ", q_len, ", max_seq_len=", max_seq_len,
                "]");
    check_block_row(tables + b * d.max_blocks_per_seq, lens[b], d, b, op);
  }
  if (out.numel() == 0) {
    return;
  }
  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
    prefill_impl(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                 key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                 tables, qsl, lens, static_cast<float>(scale), d);
  });
}

}  // namespace shardlm
