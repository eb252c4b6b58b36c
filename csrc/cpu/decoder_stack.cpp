// CPU: every decoder layer of a single-rank model in one call.
//
// A decode step of a small model is mostly short kernels; calling two fused
// ops per layer from Python still costs an interpreter round trip and a boxed
// dispatcher call with some 25 arguments each time, while the other threads
// of the pool wait (about a tenth of a SmolLM2-135M step). DecoderStack holds
// the layers' weights from load on and runs attention_block and mlp_block for
// each layer in a C++ loop: the same kernels on the same inputs, so the
// result equals the per-layer fused ops bit for bit. The plain reference is
// that loop in Python (worker/ops/reference.py, decoder_stack).
//
// Only a single rank uses it: with tensor parallelism the partial sums of the
// row-parallel projections are all-reduced between the two halves of a layer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "decoder_block.h"

namespace shardlm {
namespace {

// A linear weight as the fused blocks take it: dense (qtype -1) or GGML blocks.
struct Linear {
  at::Tensor weight;
  int64_t qtype;
  std::optional<at::Tensor> bias;
  int64_t out_features;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  int64_t sliding_window;  // per layer: Gemma-style models mix windowed and global layers
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double scale)
      : eps_(eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        scale_(scale) {}

  // Appends the next layer. `*_out` is each projection's output width (a
  // blocks weight's rows are not its output features); `sliding_window` is
  // the layer's attention window (0: none).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, int64_t qkv_type,
                 std::optional<at::Tensor> qkv_bias, at::Tensor o, int64_t o_type,
                 std::optional<at::Tensor> o_bias, int64_t o_out, at::Tensor gate_up,
                 int64_t gate_up_type, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
                 int64_t down_type, std::optional<at::Tensor> down_bias, int64_t down_out,
                 int64_t sliding_window) {
    TORCH_CHECK(sliding_window >= 0, "DecoderStack.add_layer: sliding_window must be >= 0 "
                "(0: no window), got ", sliding_window);
    layers_.push_back({std::move(input_norm), std::move(post_norm),
                       {std::move(qkv), qkv_type, std::move(qkv_bias), -1},
                       {std::move(o), o_type, std::move(o_bias), o_out},
                       {std::move(gate_up), gate_up_type, std::move(gate_up_bias), -1},
                       {std::move(down), down_type, std::move(down_bias), down_out},
                       sliding_window});
  }

  // The model's final norm and output head (no bias), which `logits` applies after the
  // layers; `out_features` is the head's vocabulary rows.
  void set_head(at::Tensor norm_weight, double eps, at::Tensor weight, int64_t qtype,
                int64_t out_features) {
    head_ = Head{std::move(norm_weight), eps, {std::move(weight), qtype, std::nullopt,
                                               out_features}};
  }

  // forward, then the final norm and the head over rows logits_indices of the result (every
  // row of a decode step): logits [rows, vocab] in hidden's dtype. The same ops the model's
  // Python runs after forward, without the interpreter between the last layer and the head
  // (a tenth of a millisecond a step, with the caches cold from the layers' weights).
  at::Tensor logits(
      at::Tensor hidden, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
      std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
      const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& query_start_loc, bool is_decode, int64_t max_query_len,
      int64_t max_seq_len, const at::Tensor& logits_indices) {
    TORCH_CHECK(head_.has_value(), "DecoderStack.logits: no head set (set_head)");
    auto [last, residual] = forward(std::move(hidden), positions, cos_sin_cache,
                                    std::move(key_caches), std::move(value_caches), slot_mapping,
                                    block_tables, seq_lens, query_start_loc, is_decode,
                                    max_query_len, max_seq_len);
    fused_add_rms_norm_cpu(last, residual, head_->norm, head_->eps);
    if (!is_decode) last = last.index_select(0, logits_indices);
    at::Tensor out = at::empty({last.size(0), head_->linear.out_features}, last.options());
    linear_into(out, last, head_->linear.weight, head_->linear.qtype, std::nullopt);
    return out;
  }

  // (hidden, residual) after every layer, for the embeddings `hidden` [T, H];
  // layer i reads and writes key_caches[i] / value_caches[i].
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor hidden, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
      std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
      const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& query_start_loc, bool is_decode, int64_t max_query_len,
      int64_t max_seq_len) {
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "DecoderStack.forward: one key and one value cache per layer (",
                layers_.size(), "), got ", key_caches.size(), " and ", value_caches.size());
    TORCH_CHECK(hidden.dim() == 2, "DecoderStack.forward: hidden must be [tokens, hidden]");
    // The first layer's residual is hidden + 0, exactly as the unfused model's.
    at::Tensor residual = at::zeros_like(hidden);
    const int64_t tokens = hidden.size(0);
    // Every layer writes its attention half into `attn` and its MLP half into `mlp` (its own
    // input, read only before), and shares the intermediates: allocating them per layer cost
    // about 5 µs a layer in allocator and tensor bookkeeping, a tenth of a small model's step.
    BlockScratch scratch;
    at::Tensor attn, mlp;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      reuse_rows(attn, hidden, tokens, l.o.out_features);
      attention_block_into(scratch, attn, hidden, residual, l.input_norm, eps_, l.qkv.weight,
                           l.qkv.qtype, l.qkv.bias, l.o.weight, l.o.qtype, l.o.bias, positions,
                           cos_sin_cache, num_heads_, num_kv_heads_, head_dim_, key_caches[i],
                           value_caches[i], slot_mapping, block_tables, seq_lens,
                           query_start_loc, is_decode, max_query_len, max_seq_len, scale_,
                           l.sliding_window);
      reuse_rows(mlp, hidden, tokens, l.down.out_features);
      mlp_block_into(scratch, mlp, attn, residual, l.post_norm, eps_, l.gate_up.weight,
                     l.gate_up.qtype, l.gate_up.bias, l.down.weight, l.down.qtype, l.down.bias);
      hidden = mlp;
    }
    return {hidden, residual};
  }

 private:
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::vector<Layer> layers_;
  struct Head {
    at::Tensor norm;
    double eps;
    Linear linear;
  };
  std::optional<Head> head_;
};

}  // namespace
}  // namespace shardlm

TORCH_LIBRARY_FRAGMENT(shardlm, m) {
  m.class_<shardlm::DecoderStack>("DecoderStack")
      .def(torch::init<double, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &shardlm::DecoderStack::add_layer)
      .def("set_head", &shardlm::DecoderStack::set_head)
      .def("forward", &shardlm::DecoderStack::forward)
      .def("logits", &shardlm::DecoderStack::logits);
}
