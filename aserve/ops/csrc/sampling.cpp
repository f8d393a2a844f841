// Sampling, torch.ops.aserve.sample_inverse_cdf: softmax and inverse-CDF draw in one pass per row.
//
// token[r] = the first v with sum_{i<=v} exp(x[r,i] - max) > u[r] * sum_i exp(x[r,i] - max): what
// softmax -> cumsum -> searchsorted computes, without writing the vocabulary-wide probabilities and their
// running sums (two [rows, vocab] tensors a step). One pass sums, a second walks to the draw's chunk.
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
#include <limits>
#include <type_traits>

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

template <typename T>
void sample_inverse_cdf_row(const T* x, int64_t n, float u, int64_t* token) {
  fVec peak(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) peak = at::vec::maximum(peak, load_as_float(x + i));
  float top = at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return at::vec::maximum(a, b); }, peak);
  for (; i < n; ++i) top = std::max(top, static_cast<float>(x[i]));
  const fVec shift(top);
  fVec sums(0.f);
  for (i = 0; i + fVec::size() <= n; i += fVec::size()) sums = sums + (load_as_float(x + i) - shift).exp();
  float total = reduce_sum(sums);
  for (; i < n; ++i) total += std::exp(static_cast<float>(x[i]) - top);
  const float target = u * total;
  float running = 0.f;
  for (i = 0; i + fVec::size() <= n; i += fVec::size()) {
    const fVec e = (load_as_float(x + i) - shift).exp();
    const float chunk = reduce_sum(e);
    if (running + chunk > target) {  // the draw lands in this chunk: walk it
      float lanes[fVec::size()];
      e.store(lanes);
      float walked = running;
      for (int j = 0; j < fVec::size(); ++j) {
        walked += lanes[j];
        if (walked > target) { *token = i + j; return; }
      }
    }  // (summed lane by lane, the chunk fell just short: go on)
    running += chunk;
  }
  for (; i < n; ++i) {
    running += std::exp(static_cast<float>(x[i]) - top);
    if (running > target) { *token = i; return; }
  }
  // Rounding left the draw past the end (u * total at the very top): the last token with any mass.
  for (i = n - 1; i > 0 && !(static_cast<float>(x[i]) - top > -std::numeric_limits<float>::infinity()); --i) {}
  *token = i;
}

template <typename T> void sample_rows(const at::Tensor& logits, const float* u, int64_t* out) {
  const T* x = logits.data_ptr<T>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sample_inverse_cdf_row(x + r * stride, n, u[r], out + r);
  });
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
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("sample_inverse_cdf", &sample_inverse_cdf);
}
