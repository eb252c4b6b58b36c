// CUDA paged attention, varlen causal prefill (also handles continued
// prefill: new tokens attending to an already cached prefix).
//
// Grid (query tile, head, seq). A block of kWarps warps owns kBQ = kWarps *
// kRowsPerWarp consecutive query rows of one sequence and head, and walks the
// keys 0..(last row's position) in tiles of kBK = 32, read through the block
// table into shared memory (converted to float). Online softmax keeps a
// running max / sum per row, so no logits buffer of the sequence length is
// needed.
//   score phase: lane j of a warp scores key j of the tile against the warp's
//                rows (K rows padded by one float: conflict-free).
//   value phase: lane l accumulates output dims l, l+32, ... (<= 8 per lane,
//                hence head_dim <= 256) for the warp's rows.
// SIMT only (no tensor cores): simple and correct for any head_dim <= 256.
//
// Sliding window (W > 0): row r also masks keys below pos[r] - W + 1, and the
// key loop starts at the tile's first row's window (the earliest key any row
// of the tile sees) instead of key 0.
//
// The cache may hold another dtype (C) than the query and output (T): its
// rows are converted to float as they are loaded into shared memory.

#include "../dispatch.h"
#include "../ops.h"
#include "cuda_utils.cuh"

namespace shardlm {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;
constexpr int kBQ = kWarps * kRowsPerWarp;
constexpr int kBK = 32;  // == warp size: one key per lane in the score phase
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerLane = kMaxHeadDim / 32;

struct PrefillArgs {
  const int* block_tables;
  const int* query_start_loc;
  const int* seq_lens;
  int64_t q_row_stride, q_head_stride;
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int window;  // 0: none
  float scale;
};

inline size_t prefill_smem_bytes(int head_dim) {
  // q tile [kBQ][D] + k tile [kBK][D + 1] + v tile [kBK][D], all float.
  return sizeof(float) * (static_cast<size_t>(kBQ) * head_dim +
                          static_cast<size_t>(kBK) * (head_dim + 1) +
                          static_cast<size_t>(kBK) * head_dim);
}

template <typename T, typename C, int VEC>
__global__ void __launch_bounds__(kThreads)
    prefill_kernel(T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
                   const C* __restrict__ v_cache, PrefillArgs a) {
  extern __shared__ float smem[];
  const int D = a.head_dim;
  float* q_s = smem;                 // [kBQ][D], pre-scaled
  float* k_s = q_s + kBQ * D;        // [kBK][D + 1]
  float* v_s = k_s + kBK * (D + 1);  // [kBK][D]

  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int q_begin = a.query_start_loc[b];
  const int q_len = a.query_start_loc[b + 1] - q_begin;
  const int q0 = blockIdx.x * kBQ;  // first row of this tile within the sequence
  if (q0 >= q_len) {
    return;
  }
  const int rows = min(kBQ, q_len - q0);
  const int first_pos = a.seq_lens[b] - q_len;  // absolute position of row 0
  const int last_key = first_pos + q0 + rows - 1;
  // The tile's first row has the earliest window.
  const int first_key = a.window > 0 ? max(0, first_pos + q0 - a.window + 1) : 0;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kv_head = h / (a.num_heads / a.num_kv_heads);
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;

  for (int idx = tid; idx < kBQ * D; idx += kThreads) {
    const int r = idx / D;
    const T* qp = q + static_cast<int64_t>(q_begin + q0 + r) * a.q_row_stride +
                  static_cast<int64_t>(h) * a.q_head_stride;
    q_s[idx] = r < rows ? to_f(qp[idx % D]) * a.scale : 0.f;
  }

  // Per-row state of this warp's rows: keys lo..pos are visible. pos < 0
  // masks every key (rows past the end of the sequence).
  int pos[kRowsPerWarp], lo[kRowsPerWarp];
  float m_run[kRowsPerWarp], l_run[kRowsPerWarp], acc[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = warp * kRowsPerWarp + r;
    pos[r] = row < rows ? first_pos + q0 + row : -1;
    lo[r] = a.window > 0 ? pos[r] - a.window + 1 : 0;
    m_run[r] = -INFINITY;
    l_run[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[r][i] = 0.f;
  }

  const int chunks = D / VEC;
  for (int k0 = first_key; k0 <= last_key; k0 += kBK) {
    const int nk = min(kBK, last_key + 1 - k0);
    __syncthreads();  // previous tile consumed (first pass: q_s written)
    for (int idx = tid; idx < kBK * chunks; idx += kThreads) {
      const int j = idx / chunks;
      const int e0 = (idx % chunks) * VEC;
      float kf[VEC], vf[VEC];
      if (j < nk) {
        const int t = k0 + j;
        const int64_t block = table[t / a.block_size];
        const int64_t off = (block * a.block_size + t % a.block_size) * token_stride +
                            static_cast<int64_t>(kv_head) * D + e0;
        load_f<C, VEC>(k_cache + off, kf);
        load_f<C, VEC>(v_cache + off, vf);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.f;  // never NaN garbage
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        k_s[j * (D + 1) + e0 + e] = kf[e];
        v_s[j * D + e0 + e] = vf[e];
      }
    }
    __syncthreads();

    // Scores for key k0 + lane against the warp's rows.
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.f;
    const float* krow = k_s + lane * (D + 1);
    const float* qrow = q_s + warp * kRowsPerWarp * D;
    for (int dd = 0; dd < D; ++dd) {
      const float kv = krow[dd];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] += qrow[r * D + dd] * kv;
    }
    const int key = k0 + lane;
    float p[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const bool ok = lane < nk && key <= pos[r] && key >= lo[r];
      const float sc = ok ? s[r] : -INFINITY;
      const float m_new = fmaxf(m_run[r], warp_max(sc));
      // Rows with no visible key yet keep m = -inf; use 0 as the base so no
      // (-inf) - (-inf) NaN appears.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      p[r] = ok ? expf(sc - base) : 0.f;
      const float alpha = expf(m_run[r] - base);  // 0 while m_run == -inf
      l_run[r] = l_run[r] * alpha + warp_sum(p[r]);
      m_run[r] = m_new;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) acc[r][i] *= alpha;
    }

    // acc += P V: broadcast p of key j from lane j.
    for (int j = 0; j < nk; ++j) {
      float pj[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) pj[r] = __shfl_sync(kFullMask, p[r], j);
      const float* vrow = v_s + j * D;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int dd = lane + 32 * i;
        if (dd < D) {
          const float vv = vrow[dd];
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) acc[r][i] += pj[r] * vv;
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = warp * kRowsPerWarp + r;
    if (row >= rows) continue;
    const float inv = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;  // malformed rows -> 0
    T* op = out + (static_cast<int64_t>(q_begin + q0 + row) * a.num_heads + h) * D;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int dd = lane + 32 * i;
      if (dd < D) op[dd] = from_f<T>(acc[r][i] * inv);
    }
  }
}

template <typename T, typename C, int VEC>
void launch_prefill(T* out, const T* q, const C* kc, const C* vc, const PrefillArgs& a,
                    dim3 grid, size_t smem, cudaStream_t stream) {
  auto kernel = prefill_kernel<T, C, VEC>;
  if (smem > 48 * 1024) {
    // Large head_dim needs the opt-in shared memory carve-out.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  kernel<<<grid, kThreads, smem, stream>>>(out, q, kc, vc, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

void paged_attention_prefill_cuda(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  double scale, int64_t max_query_len, int64_t max_seq_len,
                                  int64_t sliding_window) {
  using namespace cuda;
  const AttnDims d = check_paged_prefill(out, query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, max_query_len, max_seq_len,
                                         sliding_window);
  TORCH_CHECK(d.head_dim <= kMaxHeadDim, "paged_attention_prefill: head_dim ", d.head_dim,
              " > ", kMaxHeadDim, " is not supported on CUDA");
  TORCH_CHECK(d.num_heads <= 65535 && d.num_seqs <= 65535,
              "paged_attention_prefill: at most 65535 heads and sequences per call on CUDA");
  const c10::cuda::CUDAGuard guard(query.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // The CPU op's data checks, on a host copy (none while capturing a graph).
  // They run before the early return below, as on CPU: a call with
  // max_query_len 0 but query rows is an error, not a no-op.
  if (const auto host = copy_indices_to_host({block_tables, query_start_loc, seq_lens})) {
    check_paged_prefill_indices(d, (*host)[0].const_data_ptr<int32_t>(),
                                (*host)[1].const_data_ptr<int32_t>(),
                                (*host)[2].const_data_ptr<int32_t>(), max_query_len,
                                max_seq_len);
  }
  if (out.numel() == 0 || max_query_len == 0) {
    return;
  }
  const size_t smem = prefill_smem_bytes(static_cast<int>(d.head_dim));
  int dev_limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&dev_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        query.get_device()));
  TORCH_CHECK(smem <= static_cast<size_t>(dev_limit), "paged_attention_prefill: head_dim ",
              d.head_dim, " needs ", smem, " bytes of shared memory; this GPU allows ",
              dev_limit);

  PrefillArgs a{};
  a.block_tables = block_tables.const_data_ptr<int>();
  a.query_start_loc = query_start_loc.const_data_ptr<int>();
  a.seq_lens = seq_lens.const_data_ptr<int>();
  a.q_row_stride = d.q_row_stride;
  a.q_head_stride = d.q_head_stride;
  a.num_heads = static_cast<int>(d.num_heads);
  a.num_kv_heads = static_cast<int>(d.num_kv_heads);
  a.head_dim = static_cast<int>(d.head_dim);
  a.block_size = static_cast<int>(d.block_size);
  a.max_blocks = static_cast<int>(d.max_blocks_per_seq);
  // Positions are int32, so a wider window is no window.
  a.window = sliding_window < INT32_MAX ? static_cast<int>(sliding_window) : 0;
  a.scale = static_cast<float>(scale);
  // max_query_len sizes the grid (every query length is <= it, checked above
  // outside graph capture); tiles past a sequence's length exit early.
  const dim3 grid(static_cast<unsigned>(ceil_div(max_query_len, kBQ)),
                  static_cast<unsigned>(d.num_heads), static_cast<unsigned>(d.num_seqs));

  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
    using T = scalar_t;
    T* o = out.data_ptr<T>();
    const T* q = query.const_data_ptr<T>();
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "paged_attention_prefill", [&] {
      using C = cache_t;
      constexpr int V = kVec16<C>;
      const C* kc = key_cache.const_data_ptr<C>();
      const C* vc = value_cache.const_data_ptr<C>();
      if (d.head_dim % V == 0 && is_aligned(kc, 16) && is_aligned(vc, 16)) {
        launch_prefill<T, C, V>(o, q, kc, vc, a, grid, smem, stream);
      } else {
        launch_prefill<T, C, 1>(o, q, kc, vc, a, grid, smem, stream);
      }
    });
  });
}

}  // namespace shardlm
