// "Mixed" weights (quant_linear's block type 106): row-stacked parts of
// different block types, as llama-quantize's mixes make them (a Q4_K_M file's
// fused q/k/v with a Q6_K attn_v, its gate/up), each kept packed in its own
// type. The uint8 [1, bytes] blocks tensor holds a header of int64 words
// (count, K, then per part its type id, rows and bytes), then each part's
// blocks; the header and every part start on a 64-byte boundary
// (worker/quant.py: mixed_rows writes it). quant_linear runs each part into
// its columns of the output; checks.cpp validates the header.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace shardlm::mixed {

constexpr int64_t kType = 106;
constexpr int64_t kAlign = 64;
constexpr int64_t kMaxParts = 64;

struct Part {
  int64_t qtype, rows, bytes, offset, first_row;  // offset: bytes from the tensor's start
};

inline int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The parts of a `size`-byte Mixed tensor and its K; false (parts unspecified)
// when the header does not fit, has no part or too many, or a part has no rows,
// no bytes or does not fit. Each part's own block layout is for the caller to check.
inline bool parse(const uint8_t* data, int64_t size, std::vector<Part>& parts, int64_t& k) {
  auto word = [&](int64_t i) {
    int64_t v;
    std::memcpy(&v, data + 8 * i, sizeof v);
    return v;
  };
  if (size < 16) return false;
  const int64_t count = word(0);
  k = word(1);
  if (count < 1 || count > kMaxParts || k < 1 || 8 * (2 + 3 * count) > size) return false;
  parts.clear();
  int64_t offset = aligned(8 * (2 + 3 * count)), row = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Part p{word(2 + 3 * i), word(3 + 3 * i), word(4 + 3 * i), offset, row};
    if (p.rows < 1 || p.bytes < 1 || p.bytes > size - offset) return false;
    parts.push_back(p);
    offset += aligned(p.bytes);
    row += p.rows;
  }
  return true;
}

// The rows of a Mixed weight, 0 when its header is malformed (quant_linear's
// checks then say why).
inline int64_t total_rows(const uint8_t* data, int64_t size) {
  std::vector<Part> parts;
  int64_t k = 0;
  if (!parse(data, size, parts, k)) return 0;
  return parts.back().first_row + parts.back().rows;
}

}  // namespace shardlm::mixed
