// CPU: one token per row of logits, drawn as worker/sampling.py's truncations
// define (temperature, then top-k, top-p and min-p), with one uniform number a
// row (the inverse of the survivors' cumulative distribution).
//
// The device path in Python races every token against exponential noise over
// a fully sorted vocabulary: two passes of the random generator and a sort of
// 49,152 floats a row, 1 to 6 ms a row on CPU, as much as a whole decode step
// of the default model. Here a row costs a few passes over its logits:
//   x = logits / T; e = exp(x - max x), vectorized;
//   top-k, top-p: only the tokens within a few nats of the top x are ranked
//     (ties by index, as a stable sort orders them), as many as the cut
//     needs, by partitions around the cut rather than a sort; every other
//     token ranks after them and is dropped;
//   min-p: e >= min_p (e of the top token is 1);
//   the draw: the survivors in index order, the first whose running mass
//     passes u times their total.
// The plain reference (worker/ops/reference.py, sample_rows) sorts the whole
// row and searches the cumulative sums; the two choose the same token except
// where u lands within rounding of a boundary between two tokens' masses.
// A row with temperature 0 is greedy: the first largest logit (the first NaN
// if any, as torch.argmax).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "../ops.h"
#include "cpu_utils.h"
#include "simd.h"

namespace shardlm {
namespace {

// The first largest value (the first NaN if any, as torch.argmax).
int64_t first_max(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(v[i])) return i;
    if (v[i] > v[best]) best = i;
  }
  return best;
}

#if SHARDLM_HAVE_AVX2
// first_max with the maximum and the NaN test 8 lanes at a time.
SHARDLM_AVX2 int64_t first_max_avx2(const float* v, int64_t n) {
  if (n < 8) return first_max(v, n);
  __m256 top = _mm256_loadu_ps(v);
  __m256 nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, x);
  }
  if (_mm256_movemask_ps(nan) != 0) return first_max(v, n);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) {
    if (std::isnan(v[i])) return first_max(v, n);
    m = std::max(m, v[i]);
  }
  return std::find(v, v + n, m) - v;
}

// e[i] = exp(x[i] - top) for the whole vectors of 8; returns where it stopped.
SHARDLM_AVX2 int64_t exp_shifted_avx2(float* e, const float* x, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(e + i, cpu::avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift)));
  }
  return i;
}
#endif

int64_t greedy_choice(const float* v, int64_t n) {
#if SHARDLM_HAVE_AVX2
  if (cpu::use_avx2()) return first_max_avx2(v, n);
#endif
  return first_max(v, n);
}

// e[i] = exp(x[i] - top), vectorized where the CPU allows.
void exp_shifted(float* e, const float* x, int64_t n, float top) {
  int64_t i = 0;
#if SHARDLM_HAVE_AVX2
  if (cpu::use_avx2()) i = exp_shifted_avx2(e, x, n, top);
#endif
  for (; i < n; ++i) e[i] = std::exp(x[i] - top);
}

// Sum of e[0, n) in four interleaved double chains (one chain waits on each add).
double sum(const float* e, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += e[i + j];
  }
  for (; i < n; ++i) s[0] += e[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Whether token a ranks before token b: larger x first, ties by index.
struct Before {
  const float* x;
  bool operator()(int64_t a, int64_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

// A row's scratch, per thread. A token is dropped by zeroing its e: it then
// has no mass to rank or draw.
struct Workspace {
  std::vector<float> x, e;
  std::vector<int64_t> ranked;
};

// Drops every token from the first, in rank order, for which stop(count,
// mass) holds of the tokens ranked before it (stop grows with both).
//
// Only the leaders are ranked: the tokens within `gap` nats of the top x, for
// the narrowest gap of 8, 16 and 32 nats (then every token) whose leaders
// already make stop hold; every other token ranks after them all and is
// dropped. Most rows are decided by a few hundred tokens, so the vocabulary is
// scanned, not sorted. The leaders are then selected by partitions, as
// std::nth_element, with the running count and mass of the part already kept:
// only the last few tokens around the cut are sorted.
template <class Stop>
void keep_first(Workspace& w, int64_t vocab, float top, const Stop& stop) {
  const float* x = w.x.data();
  float* e = w.e.data();
  std::vector<int64_t>& v = w.ranked;
  for (const float gap : {8.f, 16.f, 32.f, std::numeric_limits<float>::infinity()}) {
    const float floor = top - gap;
    v.clear();
    double mass = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (x[i] >= floor) {
        v.push_back(i);
        mass += e[i];
      }
    }
    if (!std::isinf(gap) && !stop(static_cast<int64_t>(v.size()), mass)) continue;
    for (int64_t i = 0; i < vocab; ++i) e[i] = x[i] >= floor ? e[i] : 0.f;
    break;
  }
  const Before before{x};
  size_t lo = 0, hi = v.size(), end = v.size();  // v[lo, hi): undecided; v[hi, end): dropped
  int64_t count = 0;
  double mass = 0.0;
  while (hi - lo > 32) {
    int64_t a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
    if (before(b, a)) std::swap(a, b);
    if (before(c, b)) std::swap(b, c);
    if (before(b, a)) std::swap(a, b);
    const int64_t pivot = b;  // the median of three
    const auto split = std::partition(v.begin() + lo, v.begin() + hi,
                                      [&](int64_t i) { return before(i, pivot); });
    const size_t mid = split - v.begin();  // v[lo, mid) rank before the pivot
    std::iter_swap(split, std::find(split, v.begin() + hi, pivot));
    double part = 0.0;
    for (size_t j = lo; j < mid; ++j) part += e[v[j]];
    const int64_t ahead = count + static_cast<int64_t>(mid - lo);
    if (stop(ahead, mass + part)) {
      hi = mid;  // the pivot and all after it are dropped; the cut is within v[lo, mid)
    } else {
      count = ahead + 1;
      mass += part + e[pivot];
      lo = mid + 1;
    }
  }
  std::sort(v.begin() + lo, v.begin() + hi, before);
  for (; lo < hi; ++lo) {
    if (stop(count, mass)) break;
    ++count;
    mass += e[v[lo]];
  }
  for (size_t j = lo; j < end; ++j) e[v[j]] = 0.f;
}

// Keeps the k tokens ranked first.
void top_k(Workspace& w, int64_t vocab, float top, int64_t k) {
  keep_first(w, vocab, top, [k](int64_t count, double) { return count >= k; });
}

// Drops each token whose mass ranked before it passes p times the total.
void top_p(Workspace& w, int64_t vocab, float top, double p) {
  const double target = p * sum(w.e.data(), vocab);
  keep_first(w, vocab, top, [target](int64_t, double mass) { return mass > target; });
}

// The first token (in order) whose running mass passes u times the total.
int64_t draw(const float* e, int64_t vocab, double u) {
  constexpr int64_t kStretch = 256;  // summed ahead, so the scan is one add a stretch
  const double target = u * sum(e, vocab);
  double running = 0.0;
  int64_t i = 0;
  for (; i + kStretch <= vocab; i += kStretch) {
    const double part = sum(e + i, kStretch);
    if (running + part > target) break;
    running += part;
  }
  int64_t last = -1;
  for (; i < vocab; ++i) {
    if (e[i] == 0.f) continue;
    running += e[i];
    last = i;
    if (running > target) return i;
  }
  // u * total rounded past the running sum: the last token with mass.
  if (last < 0) last = vocab - 1;
  while (last > 0 && e[last] == 0.f) --last;
  return last;
}

int64_t sample_row(Workspace& w, const float* logits, int64_t vocab, float temperature,
                   int64_t k, float p, float min_p, double u) {
  w.x.resize(vocab);
  w.e.resize(vocab);
  float* x = w.x.data();
  float* e = w.e.data();
  for (int64_t i = 0; i < vocab; ++i) x[i] = logits[i] / temperature;
  const int64_t first = greedy_choice(x, vocab);
  const float top = x[first];
  if (!std::isfinite(top)) return first;  // NaN, +inf, or every token masked
  exp_shifted(e, x, vocab, top);  // the top token's e is exp(0) = 1: it survives every cut
  if (k > 0 && k < vocab) top_k(w, vocab, top, k);
  if (p < 1.f) top_p(w, vocab, top, p);
  if (min_p > 0.f) {
    for (int64_t i = 0; i < vocab; ++i) e[i] = e[i] < min_p ? 0.f : e[i];
  }
  return draw(e, vocab, u);
}

void check_sample_rows(const at::Tensor& out, const at::Tensor& logits,
                       const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& uniform) {
  constexpr const char* op = "sample_rows";
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              op, ": logits must be a contiguous float32 [rows, vocab] tensor, got ",
              logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, op, ": logits must have a vocabulary");
  const int64_t rows = logits.size(0);
  auto column = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type && t.is_contiguous(),
                op, ": ", name, " must be a contiguous ", type, " [", rows, "] tensor, got ",
                t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " is on ", t.device(),
                " but logits are on ", logits.device());
  };
  column(out, at::kLong, "out");
  column(temperature, at::kFloat, "temperature");
  column(top_k, at::kLong, "top_k");
  column(top_p, at::kFloat, "top_p");
  column(min_p, at::kFloat, "min_p");
  column(uniform, at::kDouble, "uniform");
}

}  // namespace

void sample_rows_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature,
                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                     const at::Tensor& uniform) {
  check_sample_rows(out, logits, temperature, top_k, top_p, min_p, uniform);
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const float* l = logits.const_data_ptr<float>();
  const float* t = temperature.const_data_ptr<float>();
  const int64_t* k = top_k.const_data_ptr<int64_t>();
  const float* p = top_p.const_data_ptr<float>();
  const float* mp = min_p.const_data_ptr<float>();
  const double* u = uniform.const_data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local Workspace w;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = l + r * vocab;
      o[r] = t[r] > 0.f ? sample_row(w, row, vocab, t[r], k[r], p[r], mp[r], u[r])
                        : greedy_choice(row, vocab);
    }
  });
}

}  // namespace shardlm
