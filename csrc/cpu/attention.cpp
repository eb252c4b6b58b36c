// CPU: paged attention for decode (one query per sequence) and varlen causal
// prefill over the paged KV cache.
//
// Both are "a set of query rows of one sequence and one kv head, row r seeing
// keys 0..pos[r]", run by attend_rows() flash-attention style: keys are
// walked in tiles of kKeyTile tokens, each tile is converted to float once and
// shared by all rows (the GQA group's heads, and for prefill a tile of query
// tokens), with an online (running max / sum) softmax per row. Tasks are
// (sequence, kv head[, query tile]) spread with at::parallel_for; each task
// chunk allocates one workspace that all its tasks reuse.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../dispatch.h"
#include "../ops.h"
#include "cpu_utils.h"

namespace shardlm {
namespace {

using cpu::from_f;
using cpu::to_f;

constexpr int64_t kKeyTile = 64;    // keys converted and scored per step
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

  int64_t offset(int64_t t) const {
    const int64_t block = block_row[t / block_size];
    return (block * block_size + t % block_size) * token_stride + kv_head * head_dim;
  }
};

template <typename T>
struct Row {
  const T* q;
  T* out;
  int64_t pos;  // last visible key; < 0 means no keys (zero output)
};

// Float scratch for up to `max_rows` rows: q, acc [rows][D]; k, v [kKeyTile][D];
// scores [kKeyTile]; running max / sum [rows].
struct Workspace {
  std::vector<float> buf;
  float *q, *acc, *k, *v, *s, *m, *l;
  Workspace(int64_t max_rows, int64_t d)
      : buf(static_cast<size_t>(2 * max_rows * d + 2 * kKeyTile * d + kKeyTile + 2 * max_rows)) {
    q = buf.data();
    acc = q + max_rows * d;
    k = acc + max_rows * d;
    v = k + kKeyTile * d;
    s = v + kKeyTile * d;
    m = s + kKeyTile;
    l = m + max_rows;
  }
};

template <typename T>
void attend_rows(const Row<T>* rows, int64_t n, const PagedKV<T>& kv, float scale,
                 Workspace& ws) {
  const int64_t D = kv.head_dim;
  int64_t last = -1;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < D; ++i) ws.q[r * D + i] = to_f(rows[r].q[i]) * scale;
    std::fill(ws.acc + r * D, ws.acc + (r + 1) * D, 0.f);
    ws.m[r] = -std::numeric_limits<float>::infinity();
    ws.l[r] = 0.f;
    last = std::max(last, rows[r].pos);
  }
  for (int64_t k0 = 0; k0 <= last; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, last + 1 - k0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t off = kv.offset(k0 + j);
      for (int64_t i = 0; i < D; ++i) {
        ws.k[j * D + i] = to_f(kv.k[off + i]);
        ws.v[j * D + i] = to_f(kv.v[off + i]);
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const int64_t visible = std::min(nk, rows[r].pos - k0 + 1);  // causal mask
      if (visible <= 0) continue;
      const float* qr = ws.q + r * D;
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        ws.s[j] = cpu::dot_f(qr, ws.k + j * D, D);
        tile_max = std::max(tile_max, ws.s[j]);
      }
      // visible > 0 makes m_new finite, so exp(-inf - m_new) = 0 on the
      // first tile and no NaN can appear.
      const float m_new = std::max(ws.m[r], tile_max);
      const float alpha = std::exp(ws.m[r] - m_new);
      float* acc = ws.acc + r * D;
      for (int64_t i = 0; i < D; ++i) acc[i] *= alpha;
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) {
        const float p = std::exp(ws.s[j] - m_new);
        sum += p;
        cpu::axpy_f(acc, p, ws.v + j * D, D);
      }
      ws.l[r] = ws.l[r] * alpha + sum;
      ws.m[r] = m_new;
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = ws.l[r] > 0.f ? 1.f / ws.l[r] : 0.f;  // no keys -> zeros
    for (int64_t i = 0; i < D; ++i) rows[r].out[i] = from_f<T>(ws.acc[r * D + i] * inv);
  }
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
  // Task = (sequence, kv head): the group's query heads share each key tile.
  at::parallel_for(0, d.num_seqs * d.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Workspace ws(group, D);
    std::vector<Row<T>> rows(group);
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
      attend_rows(rows.data(), group, kv, scale, ws);
    }
  });
}

template <typename T>
void prefill_impl(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables,
                  const int32_t* qsl, const int32_t* seq_lens, float scale, const AttnDims& d) {
  const int64_t group = d.num_heads / d.num_kv_heads;
  const int64_t D = d.head_dim;
  // tile_start[b] = index of sequence b's first query tile (prefix sums).
  std::vector<int64_t> tile_start(d.num_seqs + 1, 0);
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    tile_start[b + 1] = tile_start[b] + (q_len + kQueryTile - 1) / kQueryTile;
  }
  // Task = (query tile, kv head): kQueryTile tokens x the group's heads.
  const int64_t tasks = tile_start[d.num_seqs] * d.num_kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Workspace ws(kQueryTile * group, D);
    std::vector<Row<T>> rows(kQueryTile * group);
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
      attend_rows(rows.data(), n, kv, scale, ws);
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
