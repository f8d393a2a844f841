// The per-row kernels of a decoder layer: RMSNorm (torch.ops.aserve.rms_norm, and add_rms_norm with the
// residual add fused in), rotary embedding (rotary_embedding) and SiLU-and-mul (silu_and_mul).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

// ---- RMSNorm ---------------------------------------------------------------------------------------------
// out = weight * T(x / rms(x)), the normalisation in fp32 and the product rounded once, as the torch path does.
// With `residual` (a decoder layer's running sum): first residual = T(x + residual), in place, and that sum is
// what is normalised, so a residual add and the norm after it are one kernel.
// Two passes a row, straight from and to T: the sum of squares (after the residual add, whose rounded sum is
// stored and squared), then the scaled, rounded, weighted output. Same operations in the same order as
// widening the row to fp32 first, so the results are those of the torch path's fp32 arithmetic.
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, T* residual, int64_t rs, const at::Tensor& weight,
                   double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  using bVec = at::vec::Vectorized<T>;
  constexpr int64_t step = bVec::size();  // fp32: one fVec; 16-bit types: two
  auto widen2 = [](const T* p, fVec& lo, fVec& hi) {
    if constexpr (std::is_same_v<T, float>) {
      lo = fVec::loadu(p);
    } else {
      std::tie(lo, hi) = at::vec::convert_to_float<T>(bVec::loadu(p));
    }
  };
  auto round2 = [](fVec& lo, fVec& hi, T* store) {  // through T (stored when `store`), and back
    if constexpr (std::is_same_v<T, float>) {
      if (store) lo.store(store);
    } else {
      const bVec b = narrow_pair<T>(lo, hi);
      if (store) b.store(store);
      std::tie(lo, hi) = at::vec::convert_to_float<T>(b);
    }
  };
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // the weights widened as they are read (no scratch to allocate)
      const T* src = x_ptr + r * xs;
      T* res = residual != nullptr ? residual + r * rs : nullptr;
      fVec acc(0.f), lo, hi, rlo, rhi;
      int64_t i = 0;
      for (; i + step <= dim; i += step) {
        widen2(src + i, lo, hi);
        if (res != nullptr) {
          widen2(res + i, rlo, rhi);
          lo = lo + rlo;
          if constexpr (!std::is_same_v<T, float>) hi = hi + rhi;
          round2(lo, hi, res + i);
        }
        acc = at::vec::fmadd(lo, lo, acc);
        if constexpr (!std::is_same_v<T, float>) acc = at::vec::fmadd(hi, hi, acc);
      }
      float total = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
      for (int64_t j = i; j < dim; ++j) {
        float v = static_cast<float>(src[j]);
        if (res != nullptr) {
          res[j] = static_cast<T>(v + static_cast<float>(res[j]));
          v = static_cast<float>(res[j]);
        }
        total += v * v;
      }
      if (res != nullptr) src = res;
      const float inv = 1.f / std::sqrt(total / static_cast<float>(dim) + static_cast<float>(eps));
      const fVec inv_v(inv);
      T* o = o_ptr + r * os;
      for (i = 0; i + step <= dim; i += step) {
        widen2(src + i, lo, hi);
        lo = lo * inv_v;
        if constexpr (!std::is_same_v<T, float>) hi = hi * inv_v;
        round2(lo, hi, nullptr);
        fVec wlo, whi;
        widen2(w_ptr + i, wlo, whi);
        lo = lo * wlo;
        if constexpr (std::is_same_v<T, float>) {
          lo.store(o + i);
        } else {
          hi = hi * whi;
          narrow_pair<T>(lo, hi).store(o + i);
        }
      }
      for (; i < dim; ++i)
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(static_cast<float>(src[i]) * inv)) *
                              static_cast<float>(w_ptr[i]));
    }
  });
}

void check_norm_args(const char* name, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, dim] with unit inner stride");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be a contiguous [dim] vector of x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              name, ": unsupported dtype ", x.scalar_type());
}

template <typename T>
void rms_norm_typed(at::Tensor& out, const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  rms_norm_impl<T>(out, x, residual ? residual->data_ptr<T>() : nullptr, residual ? residual->stride(0) : 0, weight,
                   eps);
}

at::Tensor rms_norm_any(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_typed<float>(out, x, residual, weight, eps); break;
    case at::kBFloat16: rms_norm_typed<c10::BFloat16>(out, x, residual, weight, eps); break;
    default: rms_norm_typed<c10::Half>(out, x, residual, weight, eps); break;
  }
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm_args("add_rms_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be x's shape and dtype, with unit inner stride");
  return rms_norm_any(x, &residual, weight, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", x, weight);
  return rms_norm_any(x, nullptr, weight, eps);
}

// ---- LayerNorm after a residual add (an encoder's post-norm), in place -------------------------------------
// x = LayerNorm(T(x + residual)): the sum rounded to T as the torch path's add rounds it, its mean and then its
// variance over the row in fp32 (two passes over the row kept in fp32 scratch, so no cancellation), and
// (sum - mean) * rstd * weight + bias rounded once. One read of x and of residual and one write of x, against
// an add then torch's layer_norm: three reads and two writes of rows that no longer fit the caches.
template <typename T>
void add_layer_norm_impl(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, const at::Tensor& bias,
                         double eps) {
  using bVec = at::vec::Vectorized<T>;
  constexpr int64_t W = fVec::size(), step = bVec::size();  // fp32: one fVec a step; 16-bit types: two
  const int64_t rows = x.size(0), dim = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  T* x_ptr = x.data_ptr<T>();
  const T* r_ptr = residual.data_ptr<T>();
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(dim), b(dim), sum(dim);
    load_row(weight.data_ptr<T>(), w.data(), dim);
    load_row(bias.data_ptr<T>(), b.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      T* row = x_ptr + r * xs;
      const T* res = r_ptr + r * rs;
      fVec acc(0.f);
      float total = 0.f;
      int64_t i = 0;
      for (; i + step <= dim; i += step) {  // the sum, rounded to T and widened back, kept in fp32 scratch
        if constexpr (std::is_same_v<T, float>) {
          const fVec v = fVec::loadu(row + i) + fVec::loadu(res + i);
          v.store(sum.data() + i);
          acc = acc + v;
        } else {
          auto [xlo, xhi] = at::vec::convert_to_float<T>(bVec::loadu(row + i));
          auto [rlo, rhi] = at::vec::convert_to_float<T>(bVec::loadu(res + i));
          auto [lo, hi] = at::vec::convert_to_float<T>(narrow_pair<T>(xlo + rlo, xhi + rhi));
          lo.store(sum.data() + i);
          hi.store(sum.data() + i + W);
          acc = acc + lo + hi;
        }
      }
      for (; i < dim; ++i) {
        sum[i] = static_cast<float>(static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(res[i])));
        total += sum[i];
      }
      const float mean = (total + reduce_sum(acc)) / static_cast<float>(dim);
      const fVec mean_v(mean);
      acc = fVec(0.f);
      total = 0.f;
      for (i = 0; i + W <= dim; i += W) {
        const fVec d = fVec::loadu(sum.data() + i) - mean_v;
        acc = at::vec::fmadd(d, d, acc);
      }
      for (; i < dim; ++i) total += (sum[i] - mean) * (sum[i] - mean);
      const float rstd = 1.f / std::sqrt((total + reduce_sum(acc)) / static_cast<float>(dim) + static_cast<float>(eps));
      const fVec rstd_v(rstd);
      auto normed = [&](int64_t at) {
        return at::vec::fmadd((fVec::loadu(sum.data() + at) - mean_v) * rstd_v, fVec::loadu(w.data() + at),
                              fVec::loadu(b.data() + at));
      };
      for (i = 0; i + step <= dim; i += step) {
        if constexpr (std::is_same_v<T, float>) {
          normed(i).store(row + i);
        } else {
          narrow_pair<T>(normed(i), normed(i + W)).store(row + i);
        }
      }
      for (; i < dim; ++i) row[i] = static_cast<T>((sum[i] - mean) * rstd * w[i] + b[i]);
    }
  });
}

void add_layer_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, const at::Tensor& bias,
                    double eps) {
  check_norm_args("add_layer_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_layer_norm: residual must be x's shape and dtype, with unit inner stride");
  TORCH_CHECK(bias.sizes() == weight.sizes() && bias.is_contiguous() && bias.scalar_type() == x.scalar_type(),
              "add_layer_norm: bias must be a contiguous [dim] vector of x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return add_layer_norm_impl<float>(x, residual, weight, bias, eps);
    case at::kBFloat16: return add_layer_norm_impl<c10::BFloat16>(x, residual, weight, bias, eps);
    default: return add_layer_norm_impl<c10::Half>(x, residual, weight, bias, eps);
  }
}

// ---- rotary embedding (rotate-half convention), in place ---------------------------------------------------
// x[t, h, :rotary_dim] = x * cos + rotate_half(x) * sin with cos/sin rows [max_pos, rotary_dim] taken at
// positions[t]; features past rotary_dim (partial rotary) are left as they are.
// One head's row, rotated in place: cos/sin already fp32 (c, s); v and out are scratch rows.
template <typename T>
inline void rotate_row(T* x, const float* c, const float* s, float* v, float* out, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  if constexpr (!std::is_same_v<T, float>) {
    constexpr int64_t W = fVec::size(), step = 2 * W;  // a 16-bit vector's lanes
    // in registers, no scratch: both halves' vectors read before either is written. 512 tokens' 9 + 3 heads of 64
    // in bf16, timed alone (Xeon with AMX, 2 threads): 206 us through the scratch rows, 60 us so
    if (half % step == 0) {
      using bVec = at::vec::Vectorized<T>;
      for (int64_t i = 0; i < half; i += step) {
        auto [a0, a1] = at::vec::convert_to_float<T>(bVec::loadu(x + i));
        auto [b0, b1] = at::vec::convert_to_float<T>(bVec::loadu(x + i + half));
        narrow_pair<T>(a0 * fVec::loadu(c + i) - b0 * fVec::loadu(s + i),
                       a1 * fVec::loadu(c + i + W) - b1 * fVec::loadu(s + i + W)).store(x + i);
        narrow_pair<T>(b0 * fVec::loadu(c + i + half) + a0 * fVec::loadu(s + i + half),
                       b1 * fVec::loadu(c + i + half + W) + a1 * fVec::loadu(s + i + half + W)).store(x + i + half);
      }
      return;
    }
  }
  load_row(x, v, rotary_dim);
  int64_t i = 0;
  for (; i + fVec::size() <= half; i += fVec::size()) {
    const fVec x1 = fVec::loadu(v + i), x2 = fVec::loadu(v + i + half);
    (x1 * fVec::loadu(c + i) - x2 * fVec::loadu(s + i)).store(out + i);
    (x2 * fVec::loadu(c + i + half) + x1 * fVec::loadu(s + i + half)).store(out + i + half);
  }
  for (; i < half; ++i) {
    out[i] = v[i] * c[i] - v[i + half] * s[i];
    out[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
  }
  store_row(out, x, rotary_dim);
}

// q and k in one pass over the tokens (one parallel region, each token's cos/sin rows widened once for both).
template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const int64_t* positions, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t rotary_dim) {
  const int64_t tokens = q.size(0);
  T* const ptrs[2] = {q.data_ptr<T>(), k.data_ptr<T>()};
  const int64_t heads[2] = {q.size(1), k.size(1)};
  const int64_t s0[2] = {q.stride(0), k.stride(0)}, s1[2] = {q.stride(1), k.stride(1)};
  const T* c_ptr = cos.data_ptr<T>();
  const T* s_ptr = sin.data_ptr<T>();
  const int64_t cs = cos.stride(0);
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // kept from call to call: a decode step calls this once a layer
    scratch.resize(4 * rotary_dim);
    float *c = scratch.data(), *s = c + rotary_dim, *v = s + rotary_dim, *out = v + rotary_dim;
    for (int64_t t = begin; t < end; ++t) {
      load_row(c_ptr + positions[t] * cs, c, rotary_dim);
      load_row(s_ptr + positions[t] * cs, s, rotary_dim);
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads[which]; ++h)
          rotate_row(ptrs[which] + t * s0[which] + h * s1[which], c, s, v, out, rotary_dim);
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [tokens, heads, head_dim] with unit inner stride");
  TORCH_CHECK(cos.stride(1) == 1 && sin.stride(1) == 1 && cos.sizes() == sin.sizes() && cos.size(1) >= rotary_dim,
              "cos and sin must be [max_positions, >= rotary_dim] rows");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= q.size(2), "rotary_dim must be even and at most head_dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share a dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  switch (q.scalar_type()) {
    case at::kFloat: rotary_impl<float>(q, k, pos, cos, sin, rotary_dim); break;
    case at::kBFloat16: rotary_impl<c10::BFloat16>(q, k, pos, cos, sin, rotary_dim); break;
    case at::kHalf: rotary_impl<c10::Half>(q, k, pos, cos, sin, rotary_dim); break;
    default: TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", q.scalar_type());
  }
}

// ---- SiLU and mul ----------------------------------------------------------------------------------------
// [rows, 2 * d] (gate | up) -> T(T(silu(gate)) * up), the two roundings of the torch path.
// One pass per row, a vector at a time. 16-bit types take exp_u20 (about 20 ulp in fp32, far inside the bf16 or
// fp16 rounding that follows); fp32 keeps the 1-ulp exp of the torch path.
template <typename T> inline fVec silu(fVec g) {
  if constexpr (std::is_same_v<T, float>) {
    return g / (fVec(1.f) + g.neg().exp());
  } else {
    return g / (fVec(1.f) + g.neg().exp_u20());
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// 16 bf16 values as fp32 (exact: the bits moved up), and 16 rounded ones as their bits. vcvtneps2bf16 rounds to
// nearest even as the torch path's conversion does; it treats fp32 denormals as zero, which rounds the same way
// except that a result below 2^-126 (a SiLU of a gate under about -87) is 0 instead of a bf16 denormal.
inline fVec widen_bf16(const c10::BFloat16* p) { return load_bf16_as_float(p); }
inline __m256i as_bits(__m256bh x) { return reinterpret_cast<__m256i&>(x); }
inline fVec widen_bf16(__m256bh x) { return bf16_bits_to_float(as_bits(x)); }
#endif

// block 0: x = [gate | up]; block b: x alternates b gates and their b ups (int8's gated tiles), out in order.
template <typename T> void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x, int64_t block) {
  const int64_t rows = x.size(0), width = out.size(1), d = block > 0 ? block : width;
  const T* x_ptr = x.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < width; j += d) {
        const T* gate = x_ptr + r * xs + 2 * j;
        const T* up = gate + d;
        T* o = o_ptr + r * width + j;
        int64_t i = 0;
        if constexpr (std::is_same_v<T, float>) {
          for (; i + fVec::size() <= d; i += fVec::size())
            (silu<T>(fVec::loadu(gate + i)) * fVec::loadu(up + i)).store(o + i);
        } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the hardware's round-to-nearest-even, 16 lanes a step
            for (; i + 16 <= d; i += 16) {
              const fVec g = widen_bf16(gate + i), u = widen_bf16(up + i);
              const fVec s = widen_bf16(_mm512_cvtneps_pbh(silu<T>(g)));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), as_bits(_mm512_cvtneps_pbh(s * u)));
            }
          }
#endif
          using bVec = at::vec::Vectorized<T>;
          for (; i + bVec::size() <= d; i += bVec::size()) {
            auto [g0, g1] = at::vec::convert_to_float<T>(bVec::loadu(gate + i));
            auto [u0, u1] = at::vec::convert_to_float<T>(bVec::loadu(up + i));
            // silu rounded to T first, where the torch path stores it
            auto [s0, s1] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(silu<T>(g0), silu<T>(g1)));
            at::vec::convert_from_float<T>(s0 * u0, s1 * u1).store(o + i);
          }
        }
        for (; i < d; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float sg = static_cast<float>(static_cast<T>(g / (1.f + std::exp(-g))));
          o[i] = static_cast<T>(sg * static_cast<float>(up[i]));
        }
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [rows, 2 * d]");
  TORCH_CHECK(block >= 0 && (block == 0 || x.size(1) % (2 * block) == 0),
              "silu_and_mul: block must be 0 (x = gate | up) or divide d (x alternates blocks of gates and ups)");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: silu_and_mul_impl<float>(out, x, block); break;
    case at::kBFloat16: silu_and_mul_impl<c10::BFloat16>(out, x, block); break;
    case at::kHalf: silu_and_mul_impl<c10::Half>(out, x, block); break;
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("add_layer_norm(Tensor(a!) x, Tensor residual, Tensor weight, Tensor bias, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int rotary_dim) -> ()");
  m.def("silu_and_mul(Tensor x, int block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
