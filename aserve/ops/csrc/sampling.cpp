// Sampling, torch.ops.aserve.sample_inverse_cdf: softmax and inverse-CDF draw in one pass per row; the check
// before it, count_nonfinite_rows; greedy rows' argmax_rows; and greedy_rows, both in one pass.
//
// token[r] = the first v with sum_{i<=v} exp(x[r,i] - max) > u[r] * sum_i exp(x[r,i] - max): what
// softmax -> cumsum -> searchsorted computes, without writing the vocabulary-wide probabilities and their
// running sums (two [rows, vocab] tensors a step): the row's max, its exps and their sum, then the walk to the draw.
// The logits are read in their own dtype (a bf16 model's need no fp32 copy): widening is exact, so the draw is
// the same as from fp32 logits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

template <typename T> inline fVec load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
    fVec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// Two passes over the row and one over part of it: the max (two running maxima, the plain max instruction: rows
// with NaN never get here, the sampler sets them aside first); each exp(x - max), at::vec's inline exp_u20 (within
// 20 ulp), stored in `e` and summed; then the walk over e in blocks of 16 vectors, one horizontal sum a block,
// element by element only in the block where the draw lands. (Three passes with Sleef's exp twice and a horizontal
// sum every vector took 821 us a step at 64 rows of the bench model's 49152 logits.)
template <typename T>
void sample_inverse_cdf_row(const T* x, int64_t n, float u, int64_t* token, float* e) {
  constexpr int W = fVec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t whole = n / W * W;
  fVec p0(neg_inf), p1(neg_inf);
  int64_t i = 0;
  for (; i + 2 * W <= whole; i += 2 * W) {
    p0 = max_of(p0, load_as_float(x + i));
    p1 = max_of(p1, load_as_float(x + i + W));
  }
  for (; i < whole; i += W) p0 = max_of(p0, load_as_float(x + i));
  float lanes[W];
  max_of(p0, p1).store(lanes);
  float top = neg_inf;
  for (int j = 0; j < W; ++j) top = std::max(top, lanes[j]);
  for (i = whole; i < n; ++i) top = std::max(top, static_cast<float>(x[i]));
  const fVec shift(top);
  fVec s0(0.f), s1(0.f);
  for (i = 0; i + 2 * W <= whole; i += 2 * W) {
    const fVec e0 = (load_as_float(x + i) - shift).exp_u20(), e1 = (load_as_float(x + i + W) - shift).exp_u20();
    e0.store(e + i);
    e1.store(e + i + W);
    s0 = s0 + e0;
    s1 = s1 + e1;
  }
  for (; i < whole; i += W) {
    const fVec e0 = (load_as_float(x + i) - shift).exp_u20();
    e0.store(e + i);
    s0 = s0 + e0;
  }
  float total = reduce_sum(s0 + s1);
  for (i = whole; i < n; ++i) total += (e[i] = std::exp(static_cast<float>(x[i]) - top));
  const float target = u * total;
  constexpr int64_t kBlock = 16 * W;
  float running = 0.f;
  for (i = 0; i < n; i += kBlock) {
    const int64_t stop = std::min(n, i + kBlock), vec_stop = i + (stop - i) / W * W;
    fVec b(0.f);
    for (int64_t j = i; j < vec_stop; j += W) b = b + fVec::loadu(e + j);
    float block = reduce_sum(b);
    for (int64_t j = vec_stop; j < stop; ++j) block += e[j];
    if (block > 0.f && running + block > target) {  // the draw lands in this block: walk it
      float walked = running;
      for (int64_t j = i; j < stop; ++j) {
        walked += e[j];
        if (walked > target && e[j] > 0.f) { *token = j; return; }  // never a token without mass
      }
    }  // (summed element by element, the block fell just short: go on)
    running += block;
  }
  // Rounding left the draw past the end (u * total at the very top): the last token with any mass.
  for (i = n - 1; i > 0 && !(static_cast<float>(x[i]) - top > neg_inf); --i) {}
  *token = i;
}

template <typename T> void sample_rows(const at::Tensor& logits, const float* u, int64_t* out) {
  const T* x = logits.data_ptr<T>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> e;  // the row's exps, walked after they are summed
    e.resize(n);
    for (int64_t r = begin; r < end; ++r) sample_inverse_cdf_row(x + r * stride, n, u[r], out + r, e.data());
  });
}

// Whether a row is all finite: x * 0 is 0 for every finite x and NaN for NaN and the infinities, so one pass of
// multiply-adds, no comparisons, sums to 0 exactly when the row is.
template <typename T>
bool row_is_finite(const T* x, int64_t n) {
  constexpr int W = fVec::size();
  const fVec zero(0.f);
  fVec a0(0.f), a1(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    a0 = at::vec::fmadd(load_as_float(x + i), zero, a0);
    a1 = at::vec::fmadd(load_as_float(x + i + W), zero, a1);
  }
  float sum = reduce_sum(a0 + a1);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * 0.f;
  return sum == 0.f;
}

// `scan` called with the logits' data as fp32, bf16 or fp16 (the dtypes a model's logits come in).
template <typename Scan>
void with_logits(const at::Tensor& logits, const char* op, Scan&& scan) {
  switch (logits.scalar_type()) {
    case at::kFloat: return scan(logits.data_ptr<float>());
    case at::kBFloat16: return scan(logits.data_ptr<c10::BFloat16>());
    case at::kHalf: return scan(logits.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, op, ": unsupported dtype ", logits.scalar_type());
  }
}

// torch.ops.aserve.count_nonfinite_rows: how many rows hold a NaN or an infinity. The sampler asks this first and
// runs its exact check (NaN, +inf, all -inf) only where it is not 0: torch's amax over the logits, that check, took
// ~120 us a step at one row of the bench model's 49152 bf16 logits in the engine (8 us timed alone), this ~5.
int64_t count_nonfinite_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "count_nonfinite_rows: logits must be [rows, vocab] with unit inner stride");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  std::vector<char> finite(rows);
  auto scan = [&](auto* x) {
    parallel_for(0, rows, 2, [&](int64_t begin, int64_t end) {  // a lone row on this thread, no fork
      for (int64_t r = begin; r < end; ++r) finite[r] = row_is_finite(x + r * stride, n);
    });
  };
  with_logits(logits, "count_nonfinite_rows", scan);
  return rows - std::count(finite.begin(), finite.end(), 1);
}

// The first index of the row's largest value, as torch.argmax gives it, in one pass: each lane of four
// interleaved sets of vectors (independent chains: a compare and blend is ~10 cycles of latency through at::vec)
// keeps its largest value and where it first saw it (indices as floats, exact below 2^24), then the best of all
// lanes, ties to the lower index. torch's argmax over one row of the bench model's 49152 bf16 logits took
// ~165 us (fp32: ~30). A row with a NaN or an infinity (its x * 0 sum is not 0) is looked at again for
// torch's rule: the first NaN, if any (argmax_row); argmax_scan leaves that to its caller, and says whether it saw
// anything not finite.
template <typename T>
int64_t argmax_scan(const T* x, int64_t n, bool& all_finite) {
  constexpr int W = fVec::size(), kSets = 4;
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  bool finite = true;
  if (n >= kSets * W) {
    alignas(64) float lane_index[kSets * W];
    for (int j = 0; j < kSets * W; ++j) lane_index[j] = static_cast<float>(j);
    fVec top[kSets], where[kSets], here[kSets], checks[kSets];
    const fVec step(static_cast<float>(kSets * W)), zero(0.f);
    for (int k = 0; k < kSets; ++k) {
      top[k] = load_as_float(x + k * W);
      where[k] = here[k] = fVec::loadu(lane_index + k * W);
      checks[k] = top[k] * zero;
    }
    for (i = kSets * W; i + kSets * W <= n; i += kSets * W) {
      for (int k = 0; k < kSets; ++k) {
        here[k] = here[k] + step;
        const fVec v = load_as_float(x + i + k * W);
        const fVec larger = v > top[k];
        top[k] = fVec::blendv(top[k], v, larger);
        where[k] = fVec::blendv(where[k], here[k], larger);
        checks[k] = at::vec::fmadd(v, zero, checks[k]);
      }
    }
    alignas(64) float tops[W], wheres[W];
    at = n;
    for (int k = 0; k < kSets; ++k) {
      top[k].store(tops);
      where[k].store(wheres);
      for (int j = 0; j < W; ++j) {
        const auto w = static_cast<int64_t>(wheres[j]);
        if (tops[j] > best || (tops[j] == best && w < at)) best = tops[j], at = w;
      }
    }
    if (at == n) at = 0;  // every lane -inf: the first
    finite = reduce_sum((checks[0] + checks[1]) + (checks[2] + checks[3])) == 0.f;
  }
  for (; i < n; ++i) {  // the tail (or a short row), in order: a later equal value never wins
    const float v = static_cast<float>(x[i]);
    finite = finite && v * 0.f == 0.f;
    if (v > best || i == 0) best = v, at = i;
  }
  all_finite = finite;
  return at;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  bool finite;
  const int64_t at = argmax_scan(x, n, finite);
  if (!finite) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  return at;
}

// The row's argmax, or -1 where nothing can be sampled from it (a NaN or +inf, or every value -inf: the sampler's
// unusable_rows), in the one pass argmax takes where every value is finite.
template <typename T>
int64_t greedy_row(const T* x, int64_t n) {
  bool finite;
  const int64_t at = argmax_scan(x, n, finite);
  if (finite) return at;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) return -1;
  }
  return static_cast<float>(x[at]) == -std::numeric_limits<float>::infinity() ? -1 : at;
}

// One index per row: row(x, n) for each row x of the logits (argmax_row, greedy_row), a few rows to a thread.
template <class Row>
at::Tensor index_per_row(const at::Tensor& logits, const char* op, const Row& row) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              op, ": logits must be [rows, vocab > 0] with unit inner stride");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 24), op, ": rows of at most 2^24 values");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  auto scan = [&](auto* x) {
    parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {  // a few rows on one thread, no fork
      for (int64_t r = begin; r < end; ++r) out[r] = row(x + r * stride, n);
    });
  };
  with_logits(logits, op, scan);
  return tokens;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  return index_per_row(logits, "argmax_rows", [](const auto* x, int64_t n) { return argmax_row(x, n); });
}

// torch.ops.aserve.greedy_rows: each row's argmax, -1 for a row nothing can be sampled from. A batch of greedy rows
// that read their logits as they are takes this alone, where it took count_nonfinite_rows and then argmax_rows,
// each a pass over the logits and a call from Python: at batch 1 the two took ~27 us of a GPTQ step of the bench
// model (AMD EPYC Zen 5), their logits and code cold after the weights streamed through the caches.
at::Tensor greedy_rows(const at::Tensor& logits) {
  return index_per_row(logits, "greedy_rows", [](const auto* x, int64_t n) { return greedy_row(x, n); });
}

// torch.ops.aserve.filter_rows: top-k, top-p and min-p over whole rows, without sorting them. Sorting 64 rows of 32000
// logits to find where each running sum reaches top_p took ~90-110 ms on 2 cores, more than a batch-64 decode step;
// the sampler's top-k tiers settle peaked rows from their top 1025 logits, but a flat row (high temperature, weak or
// random weights) keeps more than that and sorted its whole row. Here each rule is a cut on the row's values, found
// by a radix select: the k-th largest value (counting), and the value where the mass of the values above it stays
// below top_p of the top-k mass while its own reaches it (weighing each by its exp).

// fp32 bits as a key that orders as the values do (negatives flipped whole, positives their sign bit set).
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}

// One row's scratch, kept by each thread from call to call.
struct FilterScratch {
  std::vector<float> e;  // exp(x - max)
  std::vector<uint32_t> keys;
  std::vector<int32_t> candidates;
  std::vector<double> hist;
};

// The key c, among the values whose keys are >= floor, such that the weight of those above c (weight_above) is <
// target and that of those at or above c is >= target, where each value weighs weight(i) (1 to count, its exp to
// weigh); false where all of them together weigh less than target (rounding, at a top_p near 1: nothing is cut).
// Three digits of the key, 11, 11 and 10 bits: a histogram of the top 11 over the row (four of them, a value's
// index picking one, so that a run of values in one bucket does not wait on one sum), then only the values in its
// chosen bucket.
template <class Weight>
bool select_cut(const uint32_t* keys, int64_t n, uint32_t floor, double target, const Weight& weight,
                FilterScratch& s, uint32_t& cut, double& weight_above) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kMask[3] = {0x7FFu, 0x7FFu, 0x3FFu};
  constexpr int kSplit = 4;
  double above = 0.0;
  uint32_t prefix = 0;
  std::vector<int32_t>& cand = s.candidates;
  std::vector<double>& hist = s.hist;
  for (int level = 0; level < 3; ++level) {
    const int64_t buckets = kMask[level] + 1;
    const int shift = kShift[level];
    if (level == 0) {
      hist.assign(kSplit * buckets, 0.0);
      double* h = hist.data();
      int64_t i = 0;
      for (; i + kSplit <= n; i += kSplit)
        for (int j = 0; j < kSplit; ++j)
          if (keys[i + j] >= floor) h[j * buckets + (keys[i + j] >> shift)] += weight(i + j);
      for (; i < n; ++i)
        if (keys[i] >= floor) h[keys[i] >> shift] += weight(i);
    } else {
      hist.assign(buckets, 0.0);
      for (const int32_t i : cand) hist[(keys[i] >> shift) & kMask[level]] += weight(i);
    }
    const int split = level == 0 ? kSplit : 1;
    int64_t d = buckets - 1, lowest = -1;
    double above_lowest = 0.0;
    for (; d >= 0; --d) {
      double here = 0.0;
      for (int j = 0; j < split; ++j) here += hist[j * buckets + d];
      if (here > 0.0) {
        if (above + here >= target) break;
        lowest = d, above_lowest = above;
      }
      above += here;
    }
    if (d < 0) {  // the sums fell short of target: nothing is cut, or (summed anew) the bucket's last value
      if (level == 0) return false;
      d = lowest, above = above_lowest;
    }
    prefix |= static_cast<uint32_t>(d) << shift;
    const uint32_t high = ~((uint32_t{1} << shift) - 1);  // the bits decided so far
    if (level == 0) {
      cand.clear();
      for (int64_t i = 0; i < n; ++i)
        if (keys[i] >= floor && (keys[i] & high) == prefix) cand.push_back(static_cast<int32_t>(i));
    } else if (level == 1) {
      cand.erase(std::remove_if(cand.begin(), cand.end(), [&](int32_t i) { return (keys[i] & high) != prefix; }),
                 cand.end());
    }
  }
  cut = prefix, weight_above = above;
  return true;
}

// sum of e[i] over the keys above `cut` (all where cut is 0), in 16 running sums (so that the loop vectorizes). Each
// e[i] is multiplied by 1 or 0: GCC 12 for AVX2 CPUs (-march=haswell, znver3) vectorized `part[j] += keys > cut ? e :
// 0.f` into a loop that summed half of what it should (AVX-512 targets got it right).
inline double mass_above(const float* e, const uint32_t* keys, int64_t n, uint32_t cut) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += e[i + j] * static_cast<float>(keys[i + j] > cut);
  double total = 0.0;
  for (; i < n; ++i) total += keys[i] > cut ? e[i] : 0.f;
  for (int j = 0; j < 16; ++j) total += part[j];
  return total;
}

// out = x with the tokens top-k, top-p and min-p drop set to -inf: those a stable sort's path drops (top-p over the
// top-k tokens' softmax, min-p against the top token's probability, the top token always kept; tokens of equal value
// in the order of their indices, so that top_k = 1 keeps argmax's token). A row with a NaN, or whose max is not
// finite, is copied as it is (the sampler sets such rows aside before filtering).
template <typename T>
void filter_row(const T* x, T* out, int64_t n, int64_t k, float top_p, float min_p, FilterScratch& s) {
  constexpr int W = fVec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t whole = n / W * W;
  s.e.resize(n), s.keys.resize(n), s.candidates.clear();
  float* e = s.e.data();
  uint32_t* keys = s.keys.data();
  for (int64_t i = 0; i < n; ++i) keys[i] = order_key(static_cast<float>(x[i]));
  uint32_t lows[16], highs[16];  // the keys' range, in 16 lanes: a NaN's lies outside -inf's and +inf's
  std::fill(lows, lows + 16, ~0u), std::fill(highs, highs + 16, 0u);
  int64_t i16 = 0;
  for (; i16 + 16 <= n; i16 += 16)
    for (int j = 0; j < 16; ++j)
      lows[j] = std::min(lows[j], keys[i16 + j]), highs[j] = std::max(highs[j], keys[i16 + j]);
  for (; i16 < n; ++i16) lows[0] = std::min(lows[0], keys[i16]), highs[0] = std::max(highs[0], keys[i16]);
  const uint32_t low = *std::min_element(lows, lows + 16), high = *std::max_element(highs, highs + 16);
  const uint32_t inf_key = order_key(std::numeric_limits<float>::infinity());
  if (high >= inf_key || low < order_key(neg_inf) || high == order_key(neg_inf)) {
    std::copy(x, x + n, out);  // a NaN, +inf, or nothing above -inf
    return;
  }
  float top;  // the key's value back
  {
    const uint32_t u = high & 0x80000000u ? high ^ 0x80000000u : ~high;
    std::memcpy(&top, &u, sizeof(top));
  }
  // The exps only where top-p or min-p weighs the tokens: a top-k-only row (a generation_config's top_k = 50) is two
  // passes of the row fewer.
  const bool by_mass = top_p < 1.f, by_min = min_p > 0.f;
  if (by_mass || by_min) {
    const fVec shift(top);
    for (int64_t i = 0; i < whole; i += W) (load_as_float(x + i) - shift).exp_u20().store(e + i);
    for (int64_t i = whole; i < n; ++i) e[i] = std::exp(static_cast<float>(x[i]) - top);
  }
  // cut: the lowest key kept; ties: how many tokens at the cut are kept, the first ones.
  uint32_t cut = 0;
  int64_t ties = n;
  int64_t at = -1;  // a token at the cut
  if (k < n) {
    double above = 0.0;
    select_cut(keys, n, 0, static_cast<double>(k), [](int64_t) { return 1.f; }, s, cut, above);  // k in [1, n)
    ties = k - static_cast<int64_t>(above);
    const auto at_cut = [&](int32_t i) { return keys[i] == cut; };
    at = *std::find_if(s.candidates.begin(), s.candidates.end(), at_cut);
  }
  uint32_t mass_cut;
  double above, target = 0.0;
  if (by_mass) {
    const double total = at < 0 ? mass_above(e, keys, n, 0)
                                : mass_above(e, keys, n, cut) + static_cast<double>(ties) * e[at];
    target = static_cast<double>(top_p) * total;
  }
  if (by_mass && select_cut(keys, n, cut, target, [e](int64_t i) { return e[i]; }, s, mass_cut, above)) {
    // tokens at the cut ranked j = 0, 1, ... (by index) are kept while above + j * their exp < target
    const auto at_cut = [&](int32_t i) { return keys[i] == mass_cut; };
    const int64_t at = *std::find_if(s.candidates.begin(), s.candidates.end(), at_cut);
    const auto kept = std::max<int64_t>(1, static_cast<int64_t>(std::ceil((target - above) / e[at])));
    ties = mass_cut > cut ? kept : std::min(ties, kept);
    cut = mass_cut;
  }
  // Written as bits: a keep-or-(-inf) choice the compiler vectorizes in any dtype.
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
  const T dropped_value = static_cast<T>(neg_inf);
  Bits dropped;
  std::memcpy(&dropped, &dropped_value, sizeof(dropped));
  const auto* xb = reinterpret_cast<const Bits*>(x);
  auto* ob = reinterpret_cast<Bits*>(out);
  if (by_min)
    for (int64_t i = 0; i < n; ++i) ob[i] = keys[i] > cut && e[i] >= min_p ? xb[i] : dropped;
  else
    for (int64_t i = 0; i < n; ++i) ob[i] = keys[i] > cut ? xb[i] : dropped;
  // the cut's own tokens, the first `ties` of them (in index order: the selects' candidates keep it)
  for (const int32_t i : s.candidates)
    if (keys[i] == cut && ties-- > 0 && (!by_min || e[i] >= min_p)) ob[i] = xb[i];
  const int64_t first = std::find(keys, keys + n, high) - keys;  // the token a stable sort ranks first
  ob[first] = xb[first];
}

at::Tensor filter_rows(const at::Tensor& logits, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "filter_rows: logits must be [rows, vocab > 0] with unit inner stride");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "filter_rows: rows of fewer than 2^31 values");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  for (const at::Tensor* t : {&top_k, &top_p, &min_p})
    TORCH_CHECK(t->dim() == 1 && t->is_contiguous() && t->size(0) == rows, "filter_rows: one value a row");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat,
              "filter_rows: top_k int64, top_p and min_p fp32");
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float *p = top_p.data_ptr<float>(), *m = min_p.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(k[r] >= 1, "filter_rows: top_k must be at least 1");
  at::Tensor out = at::empty({rows, n}, logits.options());
  auto scan = [&](auto* x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    T* y = out.data_ptr<T>();
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      thread_local FilterScratch scratch;
      for (int64_t r = begin; r < end; ++r) filter_row(x + r * stride, y + r * n, n, k[r], p[r], m[r], scratch);
    });
  };
  with_logits(logits, "filter_rows", scan);
  return out;
}

// torch.ops.aserve.apply_penalties: repetition (prompt and output), frequency and presence (output) penalties, in
// place, at the tokens each row has seen. The torch path finds the distinct (row, token) pairs by sorting them all
// every step (64 rows of 2048-token prompts: ~150k pairs, 5.3 ms a step against 1.4 here); here each thread counts
// a row's output tokens in a vocabulary-sized array of its own, marks the prompt's, applies each seen token once and
// clears its mark, O(the row's tokens). The arithmetic is the torch path's, in fp32 and in its order (the logit
// divided or multiplied by the repetition penalty, then the frequency penalty times the count and the presence
// penalty subtracted), rounded once to the logits' dtype: the same bits.
template <typename T>
void penalize_row(T* x, const int64_t* prompt, int64_t prompt_len, const int64_t* output, int64_t output_len,
                  const float* penalty, int32_t* count) {
  for (int64_t i = 0; i < output_len; ++i) ++count[output[i]];
  for (int64_t i = 0; i < prompt_len; ++i)
    if (count[prompt[i]] == 0) count[prompt[i]] = -1;  // seen in the prompt only
  const float rep = penalty[0], frequency = penalty[1], presence = penalty[2];
  const auto apply = [&](int64_t t) {
    const int32_t c = count[t];
    if (c == 0) return;  // applied already (a repeated token)
    float v = static_cast<float>(x[t]);
    v = v > 0.f ? v / rep : v * rep;
    if (c > 0) {
      const float by_count = frequency * static_cast<float>(c);
      v = v - by_count;
      v = v - presence;
    }
    x[t] = static_cast<T>(v);
    count[t] = 0;
  };
  for (int64_t i = 0; i < output_len; ++i) apply(output[i]);
  for (int64_t i = 0; i < prompt_len; ++i) apply(prompt[i]);
}

void apply_penalties(at::Tensor logits, const at::Tensor& rows, const at::Tensor& prompt_tokens,
                     const at::Tensor& prompt_lengths, const at::Tensor& output_tokens,
                     const at::Tensor& output_lengths, const at::Tensor& penalties) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_penalties: logits must be [rows, vocab] with unit "
              "inner stride");
  const int64_t n = rows.numel(), vocab = logits.size(1), stride = logits.stride(0);
  for (const at::Tensor* t : {&rows, &prompt_tokens, &prompt_lengths, &output_tokens, &output_lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "apply_penalties: rows, tokens and lengths must be contiguous int64 vectors");
  TORCH_CHECK(prompt_lengths.numel() == n && output_lengths.numel() == n, "apply_penalties: one length a row");
  TORCH_CHECK(penalties.scalar_type() == at::kFloat && penalties.is_contiguous() && penalties.dim() == 2 &&
                  penalties.size(0) == n && penalties.size(1) == 3,
              "apply_penalties: penalties must be contiguous fp32 [rows, 3] (repetition, frequency, presence)");
  TORCH_CHECK(vocab < (int64_t{1} << 31), "apply_penalties: a vocabulary of fewer than 2^31 tokens");
  const int64_t *row = rows.data_ptr<int64_t>(), *plen = prompt_lengths.data_ptr<int64_t>();
  const int64_t* olen = output_lengths.data_ptr<int64_t>();
  std::vector<int64_t> pstart(n + 1, 0), ostart(n + 1, 0);  // each row's first token in the flat lists
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0) && plen[r] >= 0 && olen[r] >= 0,
                "apply_penalties: a row or length out of range");
    pstart[r + 1] = pstart[r] + plen[r], ostart[r + 1] = ostart[r] + olen[r];
  }
  TORCH_CHECK(pstart[n] == prompt_tokens.numel() && ostart[n] == output_tokens.numel(),
              "apply_penalties: the lengths must add up to the token lists");
  const int64_t *prompt = prompt_tokens.data_ptr<int64_t>(), *output = output_tokens.data_ptr<int64_t>();
  for (const auto& [tokens, count] : {std::pair{prompt, pstart[n]}, std::pair{output, ostart[n]}})
    for (int64_t i = 0; i < count; ++i)
      TORCH_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "apply_penalties: token ", tokens[i], " outside the vocabulary");
  std::vector<char> listed(logits.size(0), 0);
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(!listed[row[r]]++, "apply_penalties: a row listed twice");
  const float* pen = penalties.data_ptr<float>();
  auto run = [&](auto* x) {
    parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<int32_t> count;  // all zero between rows
      if (static_cast<int64_t>(count.size()) < vocab) count.assign(vocab, 0);
      for (int64_t r = begin; r < end; ++r)
        penalize_row(x + row[r] * stride, prompt + pstart[r], plen[r], output + ostart[r], olen[r], pen + 3 * r,
                     count.data());
    });
  };
  with_logits(logits, "apply_penalties", run);
}

at::Tensor sample_inverse_cdf(const at::Tensor& logits, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "sample_inverse_cdf: logits must be [rows, vocab] with unit inner stride");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.is_contiguous() && uniforms.scalar_type() == at::kFloat &&
                  uniforms.size(0) == logits.size(0),
              "sample_inverse_cdf: uniforms must be a contiguous fp32 [rows] vector");
  at::Tensor tokens = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float* u = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat: sample_rows<float>(logits, u, out); break;
    case at::kBFloat16: sample_rows<c10::BFloat16>(logits, u, out); break;
    case at::kHalf: sample_rows<c10::Half>(logits, u, out); break;
    default: TORCH_CHECK(false, "sample_inverse_cdf: unsupported dtype ", logits.scalar_type());
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("sample_inverse_cdf(Tensor logits, Tensor uniforms) -> Tensor");
  m.def("count_nonfinite_rows(Tensor logits) -> int");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("greedy_rows(Tensor logits) -> Tensor");
  m.def("filter_rows(Tensor logits, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor");
  m.def("apply_penalties(Tensor(a!) logits, Tensor rows, Tensor prompt_tokens, Tensor prompt_lengths, "
        "Tensor output_tokens, Tensor output_lengths, Tensor penalties) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("sample_inverse_cdf", &sample_inverse_cdf);
  m.impl("count_nonfinite_rows", &count_nonfinite_rows);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("greedy_rows", &greedy_rows);
  m.impl("filter_rows", &filter_rows);
  m.impl("apply_penalties", &apply_penalties);
}
