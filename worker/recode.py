"""Block types whose 8-row layouts need rows in whole groups of 8, re-encoded exactly at load into
Q8_0 for rows that fill none (tensors only).

Each re-encoding keeps every weight bit for bit as GGML dequantizes it, at a little under twice
the file's bytes for those matrices instead of the seven to nine times that float32 takes:

- IQ4_NL (18 bytes per 32 weights: a float16 d, then 16 bytes of nibbles, weight i in the low
  nibble of byte i and i + 16 in its high one, each an index into a fixed table of 16 int8
  values): the same d, the table's values as the int8 quants.
- Q5_0 (kquant.q5_0_to_q8_0): the same d, q - 16 as the int8 quant.
"""

from __future__ import annotations

import torch

from shardlm_server.worker.iquant import IQ4_NL_BLOCK_BYTES, IQ4_VALUES, iq4_nibbles
from shardlm_server.worker.kquant import q5_0_to_q8_0


def iq4_nl_to_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL blocks [n, K / 32 * 18] as Q8_0 [n, K / 32 * 34]: the same weights exactly."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, IQ4_NL_BLOCK_BYTES)
    nibbles = iq4_nibbles(b[..., 2:]).squeeze(-2).long()
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles]
    return torch.cat((b[..., 0:2], values.view(torch.uint8)), dim=-1).reshape(n, -1).contiguous()


#: The types re-encoded at load where rows fill no group of 8: what into, and how.
RECODED = {"IQ4_NL": ("Q8_0", iq4_nl_to_q8_0), "Q5_0": ("Q8_0", q5_0_to_q8_0)}
