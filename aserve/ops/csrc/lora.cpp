// The batched LoRA delta of one linear layer, torch.ops.aserve.lora_delta: for every token t whose adapter sits in
// slot s (token_slot[t] = s; -1: the base model, skipped), in place,
//
//   y[t, off_i : off_i + size_i] += (x[t] @ a[s][:, i*R : (i+1)*R]) @ b[s][i*R : (i+1)*R, off_i : off_i + size_i]
//
// for each output slice i of a fused layer (q|k|v, gate|up; one slice otherwise). a: [S, in, M*R] (each slice's
// A^T side by side), b: [S, M*R, out] (scale * B^T, block-diagonal by slice: only each slice's own block is read),
// both in y's dtype. Tokens are grouped by slot and taken a block of kBlock at a time, so each slot's weights are
// read once per block and each token costs only its own adapter's rank (punica's SGMV, on the CPU): torch ops
// would multiply every token by every slot (then mask) or pay a call per slot per layer.
// Arithmetic is in fp32; the sum is added to y's value and rounded once to y's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

// Tokens of one slot computed together, and the vectors of h (shrink) or of output columns (expand) a pass keeps
// in registers: kBlock x vectors accumulators, plus the weights' vectors and a broadcast, within AVX-512's 32
// registers (AVX2's 16).
constexpr bool kWide = aserve_kernels::fVec::size() == 16;
constexpr int64_t kBlock = kWide ? 8 : 4;
constexpr int64_t kShrinkVecs = kWide ? 3 : 2;
constexpr int64_t kExpandVecs = kWide ? 3 : 2;

struct Block {
  int64_t slot;
  std::vector<int64_t> tokens;
};

std::vector<Block> blocks_by_slot(const int64_t* token_slot, int64_t num_tokens, int64_t num_slots) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < num_tokens; ++t) {
    int64_t s = token_slot[t];
    TORCH_CHECK(s < num_slots, "lora_delta: token ", t, " has slot ", s, " of ", num_slots);
    if (s >= 0) by_slot[s].push_back(t);
  }
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (size_t i = 0; i < by_slot[s].size(); i += kBlock) {
      size_t end = std::min(by_slot[s].size(), i + kBlock);
      blocks.push_back({s, std::vector<int64_t>(by_slot[s].begin() + i, by_slot[s].begin() + end)});
    }
  }
  return blocks;
}

// fVec::size() weights of type T as fp32 lanes (bf16: the bits shifted up; fp16: F16C).
template <typename T> inline fVec widen(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return fVec(bf16_bits_to_float(bits));
    } else {
      return fVec(_mm512_cvtph_ps(bits));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
    } else {
      return fVec(_mm256_cvtph_ps(bits));
    }
#else
    float tmp[fVec::size()];
    for (int64_t i = 0; i < fVec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
    return fVec::loadu(tmp);
#endif
  }
}

// The register-blocked step of both passes: acc[t][v] += scalar(t) * w[v] for the block's kBlock rows (the loops
// unrolled, so the accumulators stay in registers).
template <int64_t NV> inline void zero(fVec (&acc)[kBlock][NV]) {
  #pragma GCC unroll 8
  for (int64_t t = 0; t < kBlock; ++t)
    #pragma GCC unroll 8
    for (int64_t v = 0; v < NV; ++v) acc[t][v] = fVec(0.f);
}

template <int64_t NV>
inline void fma_rows(fVec (&acc)[kBlock][NV], const fVec (&w)[NV], const float* scalars, int64_t stride) {
  #pragma GCC unroll 8
  for (int64_t t = 0; t < kBlock; ++t) {
    const fVec s(scalars[t * stride]);
    #pragma GCC unroll 8
    for (int64_t v = 0; v < NV; ++v) acc[t][v] = at::vec::fmadd(s, w[v], acc[t][v]);
  }
}

// h[t, col0 : col0 + NV*V] = xs[t] @ a[:, col0 : ...] for the kBlock rows of xs (rows past the block are zeros).
template <typename T, int64_t NV>
inline void shrink_pass(const float* xs, int64_t in, const T* a, int64_t width, int64_t col0, float* h) {
  constexpr int64_t V = fVec::size();
  fVec acc[kBlock][NV];
  zero(acc);
  for (int64_t k = 0; k < in; ++k) {
    fVec w[NV];
    #pragma GCC unroll 8
    for (int64_t v = 0; v < NV; ++v) w[v] = widen(a + k * width + col0 + v * V);
    fma_rows(acc, w, xs + k, in);
  }
  #pragma GCC unroll 8
  for (int64_t t = 0; t < kBlock; ++t)
    #pragma GCC unroll 8
    for (int64_t v = 0; v < NV; ++v) acc[t][v].store(h + t * width + col0 + v * V);
}

template <typename T>
void lora_delta_kernel(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                       const int64_t* token_slot, const std::vector<int64_t>& sizes) {
  constexpr int64_t V = fVec::size();
  const int64_t num_tokens = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t num_slots = a.size(0), width = a.size(2), slices = static_cast<int64_t>(sizes.size());
  const int64_t rank = width / slices;
  TORCH_CHECK(width % V == 0, "lora_delta: the slot width (slices x rank) must be a multiple of ", V);
  const int64_t y_stride = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  std::vector<int64_t> offsets(slices, 0);
  for (int64_t i = 1; i < slices; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  const std::vector<Block> blocks = blocks_by_slot(token_slot, num_tokens, num_slots);

  parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(kBlock * in), h(kBlock * width), yrow(kExpandVecs * V), bt(rank * kExpandVecs * V);
    for (int64_t w = begin; w < end; ++w) {
      const Block& blk = blocks[w];
      const int64_t n = static_cast<int64_t>(blk.tokens.size());
      const T* as = ap + blk.slot * in * width;
      const T* bs = bp + blk.slot * width * out;
      std::fill(xs.begin(), xs.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) load_row(xp + blk.tokens[t] * in, xs.data() + t * in, in);
      // shrink, kShrinkVecs columns of h at a time
      int64_t col = 0;
      for (; col + kShrinkVecs * V <= width; col += kShrinkVecs * V) {
        shrink_pass<T, kShrinkVecs>(xs.data(), in, as, width, col, h.data());
      }
      if (width - col >= 2 * V && kShrinkVecs > 2) {
        shrink_pass<T, 2>(xs.data(), in, as, width, col, h.data());
        col += 2 * V;
      }
      for (; col < width; col += V) shrink_pass<T, 1>(xs.data(), in, as, width, col, h.data());
      // expand: each slice's own block of B, kExpandVecs vectors of output columns at a time, added to y
      for (int64_t i = 0; i < slices; ++i) {
        const T* bi = bs + i * rank * out + offsets[i];
        for (int64_t c = 0; c < sizes[i]; c += kExpandVecs * V) {
          const int64_t cols = std::min(kExpandVecs * V, sizes[i] - c);
          const bool whole = cols == kExpandVecs * V;
          fVec acc[kBlock][kExpandVecs];
          zero(acc);
          for (int64_t r = 0; r < rank; ++r) {
            fVec wv[kExpandVecs];
            if (whole) {
              #pragma GCC unroll 8
              for (int64_t v = 0; v < kExpandVecs; ++v) wv[v] = widen(bi + r * out + c + v * V);
            } else {  // the slice's last columns: through fp32 scratch, zero-padded
              std::fill(bt.begin(), bt.begin() + kExpandVecs * V, 0.f);
              load_row(bi + r * out + c, bt.data(), cols);
              #pragma GCC unroll 8
              for (int64_t v = 0; v < kExpandVecs; ++v) wv[v] = fVec::loadu(bt.data() + v * V);
            }
            fma_rows(acc, wv, h.data() + i * rank + r, width);
          }
          // Unrolled over the whole block (a short block skips its missing rows), so that every index into acc is
          // a constant: a loop to n kept acc in memory, each FMA of the rank loop loading and storing it.
          #pragma GCC unroll 8
          for (int64_t t = 0; t < kBlock; ++t) {
            if (t >= n) continue;
            T* yt = yp + blk.tokens[t] * y_stride + offsets[i] + c;
            load_row(yt, yrow.data(), cols);
            #pragma GCC unroll 8
            for (int64_t v = 0; v < kExpandVecs; ++v)
              (fVec::loadu(yrow.data() + v * V) + acc[t][v]).store(yrow.data() + v * V);
            store_row(yrow.data(), yt, cols);
          }
        }
      }
    }
  });
}

void lora_delta(const at::Tensor& x, at::Tensor y, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& token_slot, at::IntArrayRef slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_delta: x [T, in] and y [T, out]");
  TORCH_CHECK(x.is_contiguous() && y.stride(1) == 1, "lora_delta: x contiguous, y's rows contiguous");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous(),
              "lora_delta: a [S, in, M*R] and b [S, M*R, out], contiguous");
  TORCH_CHECK(a.size(1) == x.size(1) && b.size(2) == y.size(1) && a.size(2) == b.size(1) && a.size(0) == b.size(0),
              "lora_delta: a and b must match x and y");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
              b.scalar_type() == y.scalar_type(), "lora_delta: x, y, a and b in one dtype");
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.is_contiguous() &&
              token_slot.numel() == x.size(0), "lora_delta: token_slot int64 [T]");
  std::vector<int64_t> sizes(slice_sizes.begin(), slice_sizes.end());
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  TORCH_CHECK(!sizes.empty() && total == y.size(1) && a.size(2) % static_cast<int64_t>(sizes.size()) == 0,
              "lora_delta: slice sizes must add up to y's width, and a's width split evenly between them");
  const int64_t* slots = token_slot.data_ptr<int64_t>();
  if (y.scalar_type() == at::kFloat) {
    lora_delta_kernel<float>(x, y, a, b, slots, sizes);
  } else if (y.scalar_type() == at::kBFloat16) {
    lora_delta_kernel<c10::BFloat16>(x, y, a, b, slots, sizes);
  } else if (y.scalar_type() == at::kHalf) {
    lora_delta_kernel<c10::Half>(x, y, a, b, slots, sizes);
  } else {
    TORCH_CHECK(false, "lora_delta: float32, bfloat16 or float16, got ", y.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("lora_delta(Tensor x, Tensor(a!) y, Tensor a, Tensor b, Tensor token_slot, int[] slice_sizes) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("lora_delta", &lora_delta);
}
