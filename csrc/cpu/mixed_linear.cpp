// quant_linear on a Mixed weight (mixed_rows.h; its header already checked by
// check_quant_linear): each part, in its own block type, into its columns of
// `out`. One input row's columns are contiguous and are written in place;
// more rows go through a buffer of the part's width.
#include "mixed_linear.h"

#include <ATen/ops/empty.h>

#include <vector>

#include "../mixed_rows.h"
#include "../ops.h"
#include "quant_blocks.h"

namespace shardlm::cpu {

using quant::rows_per_blocks_row;

void mixed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& blocks,
                  const std::optional<at::Tensor>& bias, int64_t m) {
  std::vector<mixed::Part> parts;
  int64_t k = 0;
  mixed::parse(blocks.const_data_ptr<uint8_t>(), blocks.numel(), parts, k);
  for (const mixed::Part& p : parts) {
    const int64_t rows_per_row = rows_per_blocks_row(p.qtype);
    const at::Tensor part = blocks.narrow(1, p.offset, p.bytes)
                                .view({p.rows / rows_per_row, p.bytes / (p.rows / rows_per_row)});
    const std::optional<at::Tensor> part_bias =
        bias.has_value() ? std::optional<at::Tensor>(bias->narrow(0, p.first_row, p.rows))
                         : std::nullopt;
    at::Tensor columns = out.narrow(1, p.first_row, p.rows);
    if (m == 1) {
      quant_linear_cpu(columns, input, part, p.qtype, part_bias);
    } else {
      at::Tensor buffer = at::empty({m, p.rows}, out.options());
      quant_linear_cpu(buffer, input, part, p.qtype, part_bias);
      columns.copy_(buffer);
    }
  }
}

}  // namespace shardlm::cpu
