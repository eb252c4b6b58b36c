// CUDA registrations; this file is only compiled when the extension is built
// with CUDA, so a CPU-only build simply has no CUDA kernels for these ops.
#include <torch/library.h>

#include "../ops.h"

TORCH_LIBRARY_IMPL(shardlm, CUDA, m) {
  m.impl("rms_norm", &shardlm::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &shardlm::fused_add_rms_norm_cuda);
  m.impl("rotary_embedding", &shardlm::rotary_embedding_cuda);
  m.impl("silu_and_mul", &shardlm::silu_and_mul_cuda);
  m.impl("gelu_tanh_and_mul", &shardlm::gelu_tanh_and_mul_cuda);
  m.impl("reshape_and_cache", &shardlm::reshape_and_cache_cuda);
  m.impl("paged_attention_decode", &shardlm::paged_attention_decode_cuda);
  m.impl("paged_attention_prefill", &shardlm::paged_attention_prefill_cuda);
}
