// aserve's fp32 GEMM for AVX2 CPUs: out[M, N] = x[M, K] @ W[N, K]^T + bias, W packed once at load.
//
// Why: in the engine, weights stream from DRAM (the bench model's 538 MB of fp32 weights, once per step), and a
// GEMM is as fast as it keeps them arriving ahead of the FMAs. On an AMD EPYC with AVX2 alone (Zen 2, 2 cores,
// 213 GFLOP/s of FMA peak), decode steps alternated between this kernel and oneDNN's packed fp32 linear in one
// engine (tools/step_ab.py --compare gemm) took 2-7% less time with this one at batch 64 (more when the VM's
// neighbours load the memory system) and 2% less at batch 1; prefill steps, compute-bound, were level. The
// scheme is the one GotoBLAS and BLIS made standard:
//  - W is packed at load into panels of 16 output channels, [ceil(N/16)][K][16] (the int8 kernel's tile
//    layout), so one k step reads 16 adjacent weights as two 8-lane vectors;
//  - a 6 x 16 micro-kernel holds 12 accumulators in registers and does 12 FMAs per 2 weight loads and 6
//    broadcasts: FMA-bound, ~90 GFLOP/s a core with its operands in L1;
//  - M is cut into blocks whose x slice (rows x K x 4 bytes) fits half of L2; each thread first copies a block 6
//    rows interleaved ([K][6]) so the micro-kernel reads one stream instead of six, then runs it against all its
//    panels. K is not cut up to kKC: at M = 64, splitting K = 576 or 1536 in L1-sized chunks was 5-10% slower
//    (each chunk reloads and stores the outputs, and the x block is copied once per chunk);
//  - while it works through one panel a thread prefetches the next panel into L1, one line every few k steps
//    inside the micro-kernel (with weights in DRAM: 140-155 GFLOP/s at M = 64 where a burst of prefetches before
//    each tile gave 128-134, and 20.5 GB/s at M = 1 against 15);
//  - threads split the panels: each reads only its share of the weights.
// Summation is in fp32, each output's K products in order (one FMA chain per kc chunk): what F.linear computes
// up to the order of the sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kNR = 16;    // output channels per panel: two 8-lane vectors
constexpr int kMR = 6;     // rows per micro-kernel call: 12 accumulators + 2 weights + 1 broadcast of 16 registers
constexpr int64_t kKC = 2048;  // most k steps per chunk: beyond, a panel's chunk (kc x 64 bytes) outgrows L2
constexpr int64_t kBlockBytes = 256 * 1024;  // the packed x block a thread reuses for all its panels: half of L2

// acc (MR x 2 vectors) over kc steps of a [kc][kMR] slice of x and a [kc][16] slice of a panel, prefetching
// `lines` 64-byte lines from `pf` into L1 at an even pace meanwhile. The sums run in a local copy: __m256 may
// alias float, so sums kept in the caller's array would be stored back on every step (half the speed).
template <int MR>
inline void micro_kernel(const float* a, const float* b, int64_t kc, __m256 (&acc)[kMR][2], const float* pf,
                         int64_t lines) {
  __m256 r[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) r[i][0] = acc[i][0], r[i][1] = acc[i][1];
  const int64_t every = lines > 0 ? (kc + lines - 1) / lines : kc + 1;
  int64_t next = 0;
  for (int64_t k = 0; k < kc; ++k) {
    if (k == next && lines > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
      pf += kNR, --lines, next += every;
    }
    const __m256 b0 = _mm256_load_ps(b + k * kNR), b1 = _mm256_load_ps(b + k * kNR + 8);
    const float* ak = a + k * kMR;
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(ak + i);
      r[i][0] = _mm256_fmadd_ps(x, b0, r[i][0]);
      r[i][1] = _mm256_fmadd_ps(x, b1, r[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = r[i][0], acc[i][1] = r[i][1];
}

// One MR x 16 tile of out: starts from the bias (first chunk) or what earlier chunks summed, adds this chunk.
// `cols` < 16 only in the last panel, whose padding columns are computed but not stored.
template <int MR>
void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, int cols, const float* bias,
          bool first, const float* pf, int64_t lines) {
  __m256 acc[kMR][2];
  alignas(32) float edge[kNR];
  for (int i = 0; i < MR; ++i) {
    const float* src = first ? bias : c + i * ldc;
    if (src == nullptr) {
      acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      continue;
    }
    if (cols < kNR) {
      std::fill(edge, edge + kNR, 0.f);
      std::memcpy(edge, src, cols * sizeof(float));
      src = edge;
    }
    acc[i][0] = _mm256_loadu_ps(src);
    acc[i][1] = _mm256_loadu_ps(src + 8);
  }
  micro_kernel<MR>(a, b, kc, acc, pf, lines);
  for (int i = 0; i < MR; ++i) {
    if (cols == kNR) {
      _mm256_storeu_ps(c + i * ldc, acc[i][0]);
      _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    } else {
      _mm256_store_ps(edge, acc[i][0]);
      _mm256_store_ps(edge + 8, acc[i][1]);
      std::memcpy(c + i * ldc, edge, cols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int, const float*, bool, const float*,
                       int64_t);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// x rows [m0, m0 + mc) and columns [k0, k0 + kc) as ceil(mc / 6) blocks of [kc][6] (rows past mc are zero).
void pack_rows(const float* x, int64_t ldx, int64_t m0, int64_t mc, int64_t k0, int64_t kc, float* out) {
  for (int64_t r = 0; r < mc; r += kMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMR, mc - r));
    float* block = out + r * kc;
    const float* src = x + (m0 + r) * ldx + k0;
    for (int64_t k = 0; k < kc; ++k) {
      for (int i = 0; i < rows; ++i) block[k * kMR + i] = src[i * ldx + k];
      for (int i = rows; i < kMR; ++i) block[k * kMR + i] = 0.f;
    }
  }
}

// Panels [p0, p1) of out for all M rows.
void gemm_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, const float* bias, float* out,
                 int64_t N, int64_t p0, int64_t p1) {
  const int64_t chunks = (K + kKC - 1) / kKC, kc_max = (K + chunks - 1) / chunks;
  const int64_t row_block = std::max<int64_t>(kMR, kBlockBytes / (kc_max * 4) / kMR * kMR);
  thread_local std::vector<float> packed;
  packed.resize(((std::min(M, row_block) + kMR - 1) / kMR) * kMR * kc_max);
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
    const bool first = k0 == 0;
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t mc = std::min(row_block, M - m0), blocks = (mc + kMR - 1) / kMR;
      pack_rows(x, ldx, m0, mc, k0, kc, packed.data());
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = w + (p * K + k0) * kNR;
        const float* next = p + 1 < p1 ? w + ((p + 1) * K + k0) * kNR : nullptr;
        const int cols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
        const float* b = bias != nullptr ? bias + p * kNR : nullptr;
        for (int64_t r = 0; r < blocks; ++r) {  // block r fetches its share of the next panel's lines
          const int64_t from = r * kc / blocks, lines = next != nullptr ? (r + 1) * kc / blocks - from : 0;
          const int rows = static_cast<int>(std::min<int64_t>(kMR, mc - r * kMR));
          kTiles[rows](packed.data() + r * kMR * kc, panel, kc, out + (m0 + r * kMR) * N + p * kNR, N, cols, b,
                       first, next != nullptr ? next + from * kNR : nullptr, lines);
        }
      }
    }
  }
}

at::Tensor pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_gemm_weight: weight must be fp32 [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNR - 1) / kNR;
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({panels, K, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kNR, N - p * kNR);
      for (int64_t k = 0; k < K; ++k) {
        float* row = dst + (p * K + k) * kNR;
        for (int64_t j = 0; j < cols; ++j) row[j] = src[(p * kNR + j) * K + k];
        for (int64_t j = cols; j < kNR; ++j) row[j] = 0.f;
      }
    }
  });
  return packed;
}

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "gemm_packed: x must be fp32 [..., in_features]");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                  packed.size(1) == K && packed.size(2) == kNR && packed.size(0) == (N + kNR - 1) / kNR,
              "gemm_packed: weight must be pack_gemm_weight's [ceil(out/16), in, 16] for x's in_features and out");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "gemm_packed: bias must be a contiguous fp32 [out] vector");
    b = bias->data_ptr<float>();
  }
  at::Tensor rows = x.reshape({-1, K});  // a view where the rows allow it (read with their stride), else a copy
  if (rows.stride(-1) != 1 || (rows.size(0) > 1 && rows.stride(0) < K)) rows = rows.contiguous();
  const int64_t M = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b != nullptr ? out.copy_(bias->expand_as(out)) : out.zero_();
  const float* xp = rows.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    gemm_panels(xp, rows.stride(0), M, K, w, b, o, N, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.def("gemm_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("pack_gemm_weight", &pack_gemm_weight);
  m.impl("gemm_packed", &gemm_packed);
}

#endif  // __AVX2__ && __FMA__
