// CPU: the sampling penalties applied in place, one pass over each row of
// logits (worker/sampling.py, apply_penalties, is the reference):
//   repetition r (Hugging Face): a seen token's logit l becomes l / r if l > 0,
//     else l * r;
//   frequency f and presence p (OpenAI): l - f * count - p * (count > 0), with
//     count the times the token was generated.
// On CPU the torch version stacks every row's history into [rows, vocab]
// tensors and makes half a dozen temporaries of that size a step: 9-18 ms at
// 32 rows of the default model's vocabulary (a seventh to a quarter of a
// decode step), against 0.6-1.3 ms here.
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "../ops.h"

namespace shardlm {
namespace {

void check_penalize_rows(const at::Tensor& logits, const std::vector<at::Tensor>& seen,
                         const std::vector<at::Tensor>& counts, const at::Tensor& repetition,
                         const at::Tensor& frequency, const at::Tensor& presence) {
  constexpr const char* op = "penalize_rows";
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              op, ": logits must be a contiguous float32 [rows, vocab] tensor, got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(static_cast<int64_t>(seen.size()) == rows &&
                  static_cast<int64_t>(counts.size()) == rows,
              op, ": one seen and one counts tensor per row (", rows, "), got ", seen.size(),
              " and ", counts.size());
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor& s = seen[r];
    const at::Tensor& c = counts[r];
    // An empty history: the row has no penalties.
    TORCH_CHECK(s.numel() == 0 || (s.dim() == 1 && s.size(0) == vocab &&
                                   s.scalar_type() == at::kBool && s.is_contiguous()),
                op, ": seen[", r, "] must be empty or a contiguous bool [", vocab, "] tensor");
    TORCH_CHECK(c.numel() == 0 || (c.dim() == 1 && c.size(0) == vocab &&
                                   c.scalar_type() == at::kInt && c.is_contiguous()),
                op, ": counts[", r, "] must be empty or a contiguous int32 [", vocab, "] tensor");
    TORCH_CHECK(s.device() == logits.device() && c.device() == logits.device(), op,
                ": row ", r, "'s history is not on the logits' device");
  }
  for (const auto& [t, name] : {std::pair{&repetition, "repetition"},
                                std::pair{&frequency, "frequency"},
                                std::pair{&presence, "presence"}}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat &&
                    t->is_contiguous() && t->device() == logits.device(),
                op, ": ", name, " must be a contiguous float32 [", rows, "] tensor on the ",
                "logits' device");
  }
}

}  // namespace

void penalize_rows_cpu(at::Tensor& logits, const std::vector<at::Tensor>& seen,
                       const std::vector<at::Tensor>& counts, const at::Tensor& repetition,
                       const at::Tensor& frequency, const at::Tensor& presence) {
  check_penalize_rows(logits, seen, counts, repetition, frequency, presence);
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  float* l = logits.data_ptr<float>();
  const float* rep = repetition.const_data_ptr<float>();
  const float* freq = frequency.const_data_ptr<float>();
  const float* pres = presence.const_data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = l + r * vocab;
      if (rep[r] != 1.f && seen[r].numel() > 0) {
        const bool* s = seen[r].const_data_ptr<bool>();
        const float penalty = rep[r];
        for (int64_t i = 0; i < vocab; ++i) {
          const float v = row[i];
          row[i] = s[i] ? (v > 0.f ? v / penalty : v * penalty) : v;
        }
      }
      if ((freq[r] != 0.f || pres[r] != 0.f) && counts[r].numel() > 0) {
        const int32_t* c = counts[r].const_data_ptr<int32_t>();
        const float f = freq[r], p = pres[r];
        for (int64_t i = 0; i < vocab; ++i) {
          // As the reference: (l - f * count) - p * (count > 0), each product rounded.
          const float by_count = f * static_cast<float>(c[i]);
          const float by_presence = p * (c[i] > 0 ? 1.f : 0.f);
          row[i] = (row[i] - by_count) - by_presence;
        }
      }
    }
  });
}

}  // namespace shardlm
