// CUDA paged attention, decode (one query token per sequence).
//
// Grid (head, seq, partition): each block handles up to kPartition cached
// tokens of one (sequence, head). A sequence that fits in one partition is
// written straight to `out`; longer ones write a normalised partial result
// plus (max logit, exp-sum) per partition to float32 workspaces, and a second
// kernel merges the partitions with the usual max/sum rescaling.
//
// Sliding window (W > 0): a sequence of ctx tokens attends to its last
// span = min(ctx, W) keys only, so the partitions tile [ctx - span, ctx)
// instead of [0, ctx), and the grid and workspaces are sized by the longest
// span rather than the longest context.
//
// The cache may hold another dtype (C) than the query and output (T): its
// rows are converted to float as they are loaded, the vector width is C's.
//
// head_dim is a runtime value (<= kMaxHeadDim). It is cut into chunks of VEC
// elements (16-byte loads when head_dim and the cache are suitably aligned,
// scalar loads otherwise), so any head_dim works and the common ones
// (64/80/96/128/256) get vector loads.
#include <ATen/ops/empty.h>

#include "../dispatch.h"
#include "../ops.h"
#include "cuda_utils.cuh"

namespace shardlm {
namespace cuda {
namespace {

constexpr int kPartition = 512;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPartitions = 8192;  // 4M tokens of context
// Value-phase reduction buffer: groups * head_dim floats, where
// groups * chunks <= kThreads (or groups == 1), so <= max(kThreads * VEC, kMaxHeadDim).
constexpr int kRedFloats = kThreads * 8 > kMaxHeadDim ? kThreads * 8 : kMaxHeadDim;

struct DecodeArgs {
  const int* block_tables;
  const int* context_lens;
  int64_t q_row_stride, q_head_stride;
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_partitions;
  int window;  // 0: none
  float scale;
};

// Keys a sequence of ctx tokens attends to (its last ones).
__device__ __forceinline__ int attended_span(int ctx, int window) {
  return window > 0 ? min(ctx, window) : ctx;
}

__device__ __forceinline__ int num_partitions(int span, int max_partitions) {
  return min((span + kPartition - 1) / kPartition, max_partitions);
}

template <typename T, typename C, int VEC>
__global__ void __launch_bounds__(kThreads)
    decode_partition_kernel(T* __restrict__ out, float* __restrict__ tmp_out,
                            float* __restrict__ max_logits, float* __restrict__ exp_sums,
                            const T* __restrict__ q, const C* __restrict__ k_cache,
                            const C* __restrict__ v_cache, DecodeArgs a) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float logits[kPartition];
  __shared__ float red[kRedFloats];
  __shared__ float scratch[32];

  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int D = a.head_dim;
  const int ctx = a.context_lens[b];
  const int64_t row = static_cast<int64_t>(b) * a.num_heads + h;  // out is [B, H, D]

  if (ctx <= 0) {  // padding row: zeros, written once
    if (part == 0) {
      for (int d = tid; d < D; d += kThreads) out[row * D + d] = from_f<T>(0.f);
    }
    return;
  }
  const int span = attended_span(ctx, a.window);
  const int start = ctx - span + part * kPartition;  // this partition's first key
  const int nparts = num_partitions(span, a.max_partitions);
  if (part >= nparts) {
    return;  // the grid is sized for the longest sequence
  }
  const int n = min(kPartition, ctx - start);
  const int kv_head = h / (a.num_heads / a.num_kv_heads);
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  auto token_offset = [&](int t) {
    const int64_t block = table[t / a.block_size];
    return (block * a.block_size + t % a.block_size) * token_stride +
           static_cast<int64_t>(kv_head) * D;
  };

  // Scaled query in shared memory, reused for every token.
  const T* qp = q + b * a.q_row_stride + h * a.q_head_stride;
  for (int d = tid; d < D; d += kThreads) q_s[d] = to_f(qp[d]) * a.scale;
  __syncthreads();

  // Logits: `lpt` lanes (a power of two >= the chunk count, <= 32) share one
  // token, so a warp scores 32 / lpt tokens per step. The loop bound is
  // warp-uniform so every lane reaches the shuffles.
  const int chunks = D / VEC;
  int lpt = 1;
  while (lpt < chunks && lpt < 32) lpt <<= 1;
  const int tokens_per_step = 32 / lpt;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int sub = lane / lpt;
  const int sub_lane = lane % lpt;
  for (int base = warp * tokens_per_step; base < n; base += kWarps * tokens_per_step) {
    const int i = base + sub;
    float dot = 0.f;
    if (i < n) {
      const C* kp = k_cache + token_offset(start + i);
      for (int c = sub_lane; c < chunks; c += lpt) {
        float kf[VEC];
        load_f<C, VEC>(kp + c * VEC, kf);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dot += q_s[c * VEC + e] * kf[e];
      }
    }
    for (int o = lpt / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(kFullMask, dot, o);
    if (i < n && sub_lane == 0) logits[i] = dot;
  }
  __syncthreads();

  // Softmax over this partition (block_reduce's barriers publish logits[]).
  float m = -INFINITY;
  for (int i = tid; i < n; i += kThreads) m = fmaxf(m, logits[i]);
  m = block_reduce<true>(m, scratch);
  float sum = 0.f;
  for (int i = tid; i < n; i += kThreads) {
    const float p = expf(logits[i] - m);
    logits[i] = p;
    sum += p;
  }
  sum = block_reduce<false>(sum, scratch);

  // Values: work item w = (group g, chunk c); group g sums tokens g, g+groups, ...
  const int groups = max(1, kThreads / chunks);
  for (int w = tid; w < groups * chunks; w += kThreads) {
    const int c = w % chunks;
    const int g = w / chunks;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
    for (int i = g; i < n; i += groups) {
      float vf[VEC];
      load_f<C, VEC>(v_cache + token_offset(start + i) + c * VEC, vf);
      const float p = logits[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += p * vf[e];
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) red[g * D + c * VEC + e] = acc[e];
  }
  __syncthreads();

  const float inv = 1.f / sum;
  const bool direct = nparts == 1 || tmp_out == nullptr;
  const int64_t prow = row * a.max_partitions + part;
  for (int d = tid; d < D; d += kThreads) {
    float o = 0.f;
    for (int g = 0; g < groups; ++g) o += red[g * D + d];
    if (direct) {
      out[row * D + d] = from_f<T>(o * inv);
    } else {
      tmp_out[prow * D + d] = o * inv;
    }
  }
  if (!direct && tid == 0) {
    max_logits[prow] = m;
    exp_sums[prow] = sum;
  }
}

// Merges the partitions of one (sequence, head): weight_p = sum_p * exp(m_p - M).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    decode_reduce_kernel(T* __restrict__ out, const float* __restrict__ tmp_out,
                         const float* __restrict__ max_logits,
                         const float* __restrict__ exp_sums, DecodeArgs a) {
  extern __shared__ float weights[];  // [max_partitions]
  __shared__ float scratch[32];
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int D = a.head_dim;
  const int ctx = a.context_lens[b];
  const int nparts = ctx > 0 ? num_partitions(attended_span(ctx, a.window), a.max_partitions) : 0;
  if (nparts <= 1) {
    return;  // written directly by the partition kernel
  }
  const int64_t row = static_cast<int64_t>(b) * a.num_heads + h;
  const int64_t prow = row * a.max_partitions;
  float m = -INFINITY;
  for (int p = tid; p < nparts; p += kThreads) m = fmaxf(m, max_logits[prow + p]);
  m = block_reduce<true>(m, scratch);
  float total = 0.f;
  for (int p = tid; p < nparts; p += kThreads) {
    const float w = exp_sums[prow + p] * expf(max_logits[prow + p] - m);
    weights[p] = w;
    total += w;
  }
  total = block_reduce<false>(total, scratch);  // also publishes weights[]
  const float inv = 1.f / total;
  for (int d = tid; d < D; d += kThreads) {
    float o = 0.f;
    for (int p = 0; p < nparts; ++p) o += weights[p] * tmp_out[(prow + p) * D + d];
    out[row * D + d] = from_f<T>(o * inv);
  }
}

}  // namespace
}  // namespace cuda

void paged_attention_decode_cuda(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                 double scale, int64_t max_context_len, int64_t sliding_window) {
  using namespace cuda;
  const AttnDims d = check_paged_decode(out, query, key_cache, value_cache, block_tables,
                                        context_lens, max_context_len, sliding_window);
  TORCH_CHECK(d.head_dim <= kMaxHeadDim, "paged_attention_decode: head_dim ", d.head_dim,
              " > ", kMaxHeadDim, " is not supported on CUDA");
  TORCH_CHECK(d.num_heads <= 65535 && d.num_seqs <= 65535,
              "paged_attention_decode: at most 65535 heads and sequences per call on CUDA");
  if (out.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(query.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // The CPU op's data checks, on a host copy (none while capturing a graph).
  if (const auto host = copy_indices_to_host({block_tables, context_lens})) {
    check_paged_decode_indices(d, (*host)[0].const_data_ptr<int32_t>(),
                               (*host)[1].const_data_ptr<int32_t>(), max_context_len);
  }
  // max_context_len, or the window if that is shorter, sizes the grid (every
  // context is <= it, checked above outside graph capture). At least one
  // partition so that all-padding batches still get zeroed.
  const int64_t max_span =
      sliding_window > 0 ? std::min(max_context_len, sliding_window) : max_context_len;
  // The reducer keeps one weight per partition in (default, <= 48 KiB) shared memory.
  TORCH_CHECK(max_span <= static_cast<int64_t>(kMaxPartitions) * kPartition,
              "paged_attention_decode: max_context_len ", max_context_len,
              " exceeds the supported ", kMaxPartitions * kPartition, " tokens");
  const int max_parts = std::max(1, ceil_div(max_span, kPartition));
  const size_t reduce_smem = static_cast<size_t>(max_parts) * sizeof(float);

  DecodeArgs a{};
  a.block_tables = block_tables.const_data_ptr<int>();
  a.context_lens = context_lens.const_data_ptr<int>();
  a.q_row_stride = d.q_row_stride;
  a.q_head_stride = d.q_head_stride;
  a.num_heads = static_cast<int>(d.num_heads);
  a.num_kv_heads = static_cast<int>(d.num_kv_heads);
  a.head_dim = static_cast<int>(d.head_dim);
  a.block_size = static_cast<int>(d.block_size);
  a.max_blocks = static_cast<int>(d.max_blocks_per_seq);
  a.max_partitions = max_parts;
  // Contexts are int32, so a wider window is no window.
  a.window = sliding_window < INT32_MAX ? static_cast<int>(sliding_window) : 0;
  a.scale = static_cast<float>(scale);

  at::Tensor tmp_out, max_logits, exp_sums;  // workspaces, only for long contexts
  if (max_parts > 1) {
    const auto opts = query.options().dtype(at::kFloat);
    tmp_out = at::empty({d.num_seqs, d.num_heads, max_parts, d.head_dim}, opts);
    max_logits = at::empty({d.num_seqs, d.num_heads, max_parts}, opts);
    exp_sums = at::empty({d.num_seqs, d.num_heads, max_parts}, opts);
  }
  float* tmp_p = max_parts > 1 ? tmp_out.data_ptr<float>() : nullptr;
  float* ml_p = max_parts > 1 ? max_logits.data_ptr<float>() : nullptr;
  float* es_p = max_parts > 1 ? exp_sums.data_ptr<float>() : nullptr;
  const dim3 grid(static_cast<unsigned>(d.num_heads), static_cast<unsigned>(d.num_seqs),
                  static_cast<unsigned>(max_parts));

  SHARDLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention_decode", [&] {
    using T = scalar_t;
    T* o = out.data_ptr<T>();
    const T* q = query.const_data_ptr<T>();
    SHARDLM_DISPATCH_CACHE_TYPES(key_cache.scalar_type(), "paged_attention_decode", [&] {
      using C = cache_t;
      constexpr int V = kVec16<C>;
      const C* kc = key_cache.const_data_ptr<C>();
      const C* vc = value_cache.const_data_ptr<C>();
      // Token rows start at multiples of head_dim elements from the base.
      const bool vec = d.head_dim % V == 0 && is_aligned(kc, 16) && is_aligned(vc, 16);
      if (vec) {
        decode_partition_kernel<T, C, V>
            <<<grid, kThreads, 0, stream>>>(o, tmp_p, ml_p, es_p, q, kc, vc, a);
      } else {
        decode_partition_kernel<T, C, 1>
            <<<grid, kThreads, 0, stream>>>(o, tmp_p, ml_p, es_p, q, kc, vc, a);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (max_parts > 1) {
      const dim3 rgrid(static_cast<unsigned>(d.num_heads),
                       static_cast<unsigned>(d.num_seqs));
      decode_reduce_kernel<T><<<rgrid, kThreads, reduce_smem, stream>>>(o, tmp_p, ml_p, es_p, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace shardlm
