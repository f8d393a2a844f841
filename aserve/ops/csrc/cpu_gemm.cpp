// aserve's GEMMs: out[M, N] = x[M, K] @ W[N, K]^T + bias, W packed once at load; fp32 on any CPU with AVX2 and FMA
// (256-bit; 512-bit tiles of two panels on CPUs with AVX-512, namespace wide), bf16 on CPUs with AVX512-BF16 (below,
// namespace bf16).
//
// Why: in the engine, weights stream from DRAM (the bench model's 270 MB of bf16 or 538 MB of fp32 weights, once
// per step), and a GEMM is as fast as it keeps them arriving ahead of the multiplies. Decode steps alternated
// between these kernels and oneDNN's packed linear in one engine (tools/step_ab.py --compare gemm) on an AMD EPYC
// (Zen 4, 2 threads) took, bf16: 62.7 against 71.5 ms at batch 64, 11.4 against 16.6 at batch 1; fp32: 119.6
// against 127.8 and 19.4 against 24.6; fp32 with torch and oneDNN held to AVX2: 118.7 against 143.6 and 22.3 against
// 29.6. Prefill steps, compute-bound, were level in bf16 and 3% slower in fp32 (oneDNN's are 512-bit there). The
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
//    each tile gave 128-134, and 20.5 GB/s at M = 1 against 15, Zen 4), or into L2 where a call reads more lines
//    than it takes k steps (PacedPrefetch); the bf16 GEMM on AMD's cores does not at up to kRowsWithoutPrefetch
//    rows, where on Zen 5 the hardware prefetchers alone stream faster;
//  - threads split the panels: each reads only its share of the weights. Calls of a few rows (a GEMV's) split them
//    evenly; beyond, bound by the multiplies, the threads claim runs of them as they go (aserve_kernels::Claims), so
//    that neither waits at the end on a core its VM ran slower.
// Summation is in fp32, each output's K products in order (one FMA chain per kc chunk): what F.linear computes
// up to the order of the sums.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "int4_args.h"
#include "step_team.h"
#include "vec_helpers.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

constexpr int kNR = 16;    // output channels per panel: two 8-lane vectors
constexpr int kMR = 6;     // rows per micro-kernel call: 12 accumulators + 2 weights + 1 broadcast of 16 registers
constexpr int64_t kKC = 2048;  // most k steps per chunk: beyond, a panel's chunk (kc x 64 bytes) outgrows L2
// The packed x block a thread reuses for all its panels: half of one core's L2 (sysconf), 256 KB where the system
// cannot say. Long rows need it: at 256 KB a K = 7168 block is 12 rows, and a bf16 [2048, 7168] x [7168, 4096]
// product ran at 596 GFLOP/s against 826-833 at 512 KB (Zen 5, 1 MB L2, 2 threads); shorter rows were level.
inline int64_t block_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::clamp<int64_t>(l2 / 2, 128 * 1024, 1024 * 1024) : int64_t{256 * 1024};
  }();
  return bytes;
}

// On AMD's cores, up to this many rows the next panel is not prefetched: a decode batch's few rows multiply too little
// to pace the prefetches by, and the hardware prefetchers alone stream the weights faster. Bench model's 120 layers,
// bf16, cold weights, Zen 5, 2 threads, builds alternated four times: 1 row 42.4-44.2 -> 47.1-48.1 GB/s (stream_read
// 48.6-50.3), 2 rows 39-44 -> 48-49, 4 rows 41-42 -> 45.6; 8 rows level; 16 rows 38 -> 30 and 64 rows 14.0 -> 12.0
// without. Intel's prefetchers do not keep up alone: on a Xeon with AVX512-BF16 and no AMX tiles (2 threads, the
// engine's own weights in their huge pages, six rounds alternated) 1 row ran 9.55 ms without against 8.63 with,
// 2 rows 12.2 against 9.8, 4 rows 15.3 against 12.6; 8 and 16 rows level. The same holds on Zen 4 (the bench
// model's 120 bf16 layers and its head from DRAM, a scratch switch alternated in one process, 15 rounds, medians, 2
// threads): with the prefetches 1 row ran 1.08x the time, 2 rows 1.12x, 4 rows 1.03x; without them 6 rows level,
// 8 rows 1.06x, 12 rows 1.13x, 16 rows 1.08x.
constexpr int64_t kRowsWithoutPrefetch = 4;
inline int64_t rows_without_prefetch() { return aserve_kernels::cpu_is_amd() ? kRowsWithoutPrefetch : 0; }

// How a block's mc rows are cut into micro-kernel calls of at most MR rows (call r's copy of x at slot r, MR rows
// wide): MR at a time, except that a short last call (under MR / 2 rows) is evened out with the one before it
// (12 + 1 -> 7 + 6, 12 + 4 -> 8 + 8). A call of few rows has too few accumulator chains to cover the dot products'
// latency, so one row after twelve cost nearly what twelve did: bench-model shapes, 120 bf16 layers (Zen 5, 2 threads),
// gemm_int4 at 12 rows 4.91 ms, at 13 6.49. Every row's sums are the same however the rows are cut.
template <int MR>
struct RowCalls {
  int64_t count, split, last_first;  // split: the last two calls' first has this many rows (0: not evened out)
  explicit RowCalls(int64_t mc) : count((mc + MR - 1) / MR), split(0), last_first(0) {
    const int64_t tail = mc - (count - 1) * MR;
    if (count >= 2 && tail < MR / 2) {
      split = (MR + tail + 1) / 2;
      last_first = (count - 2) * MR + split;
    }
    rows_of_last = static_cast<int>(split ? MR + tail - split : tail);
  }
  int64_t first(int64_t r) const { return split && r == count - 1 ? last_first : r * MR; }
  int rows(int64_t r) const {
    if (r == count - 1) return rows_of_last;
    return split && r == count - 2 ? static_cast<int>(split) : MR;
  }
  int rows_of_last;
};

// Fetches `lines` 64-byte lines, from `from` on, at an even pace over `steps` k steps of a micro-kernel: into L1, a
// line every few steps, where they are no more than the steps (a block of a panel's rows, its share of the next
// panel); else into L2, as many a step as it takes to fetch them all (a call of up to 12 rows reading a bf16 panel
// pair row, or an fp32 pair of panels, 128 bytes a step: 2 lines a step). One line a step into L1 used to fetch
// half of the next panel there: the bench model's 120 bf16 layers (Intel Xeon without AMX tiles, 2 threads, weights
// in DRAM, both ways alternated in one process) took at 1 row 11.5-13.6 ms against 10.3-11.5 now, 4 rows 14.4-15.9
// against 11.8-13.9, 8 rows 16.1-17.8 against 13.4-15.1; every line into L1 was faster only from 4 rows on, and half
// of them into L2 no faster than before.
struct PacedPrefetch {
  const char* next;
  int64_t lines, every, per_step;  // per_step 0: a line every `every` steps, into L1
  PacedPrefetch(const void* from, int64_t lines, int64_t steps)
      : next(static_cast<const char*>(from)), lines(lines), every(lines > 0 ? (steps + lines - 1) / lines : steps + 1),
        per_step(lines > steps ? (lines + steps - 1) / steps : 0) {}
  // step(k) for k in [0, steps), the lines fetched before steps 0, every, 2 every... (L1), or per_step of them before
  // each step (L2). Between the L1 fetches the steps run in a loop of their own: a check in every step's loop (is
  // a line due?) took the 256-bit fp32 micro-kernel, hot in L1, from ~6.2 to ~11.7 cycles a k step (AMD EPYC Zen 3,
  // avx2: the FMAs' loop was cut into four branchy pieces).
  template <class Step>
  inline void run(int64_t steps, Step&& step) {
    int64_t k = 0;
    if (per_step > 0) {
      for (; k < steps && lines > 0; ++k) {
        for (int64_t i = 0; i < per_step && lines > 0; ++i, --lines, next += 64) _mm_prefetch(next, _MM_HINT_T1);
        step(k);
      }
    } else {
      for (; lines > 0 && k < steps; --lines, next += 64) {
        _mm_prefetch(next, _MM_HINT_T0);
        for (const int64_t end = std::min(steps, k + every); k < end; ++k) step(k);
      }
    }
    for (; k < steps; ++k) step(k);
  }
};

// The activation a GEMM can apply to its outputs as it writes them (gemm_packed's `activation`): GELU, from the
// exact erf or from tanh, on the fp32 sums (before a bf16 output is rounded), so that no second pass reads and writes
// the product. A BERT-base MLP's separate GELU was 3% of an embedding run (Zen 5). kSiluMul: SwiGLU's silu(gate) * up,
// from a gate | up weight packed with its rows interleaved 16 gates, their 16 ups, the next 16 gates...
// (ops/cpu_gemm.py's pack_gated_weight): a bf16 panel's two 16-lane halves, or two fp32 panels side by side, are a gate
// and its up; the output is [M, N/2] (bf16 rounded once). Separately, a [512, 3072] product's silu_and_mul read 3 MB
// and wrote 1.5 MB a layer, 7% of a 4 x 128-token prefill step (Xeon with AMX, 2 threads); 2% of the bench model's fp32
// steps (Zen 4).
enum Activation : int64_t { kNoActivation = 0, kGeluErf = 1, kGeluTanh = 2, kSiluMul = 3 };

// torch's GELU: 0.5 x (1 + erf(x / sqrt 2)), or with tanh(sqrt(2 / pi) (x + 0.044715 x^3)).
template <class Vec>
inline Vec gelu(Vec x, int64_t act) {
  const Vec half = x * Vec(0.5f);
  if (act == kGeluErf)
    return at::vec::fmadd(half, aserve_kernels::erf_rational(x * Vec(static_cast<float>(M_SQRT1_2))), half);
  const Vec u = Vec(0.7978845608028654f) * at::vec::fmadd(Vec(0.044715f) * x, x * x, x);
  return at::vec::fmadd(half, aserve_kernels::tanh_rational(u), half);
}

// fp32 kSiluMul: silu(gate) * up as silu_and_mul computes it in fp32 (norm_activation.cpp, the same 1-ulp exp), so
// that the fused product is the separate one's bit for bit.
inline aserve_kernels::fVec silu_times_fp32(aserve_kernels::fVec gate, aserve_kernels::fVec up) {
  using V = aserve_kernels::fVec;
  return gate / (V(1.f) + gate.neg().exp()) * up;
}

// `rows` rows of 16 gates and their 16 ups -> 16 outputs each.
inline void silu_times_rows(const float* gates, int64_t ldg, const float* ups, int64_t ldu, float* out, int64_t ldo,
                            int rows) {
  using V = aserve_kernels::fVec;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < kNR; j += V::size())
      silu_times_fp32(V::loadu(gates + i * ldg + j), V::loadu(ups + i * ldu + j)).store(out + i * ldo + j);
}

inline void activate(float* v, int64_t n, int64_t act) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) gelu(Vec::loadu(v + i), act).store(v + i);
  if (i < n) gelu(Vec::loadu(v + i, static_cast<int>(n - i)), act).store(v + i, static_cast<int>(n - i));
}

// acc (MR x 2 vectors) over kc steps of a [kc][kMR] slice of x and a [kc][16] slice of a panel, prefetching
// `lines` 64-byte lines from `pf` into L1 at an even pace meanwhile. The sums run in a local copy: __m256 may
// alias float, so sums kept in the caller's array would be stored back on every step (half the speed).
// A k step's 16 weights of a panel as two 8-lane vectors: stored as fp32, or as bf16 values (Bf16Panels), widened
// exactly with a shift.
inline void load_weights(const float* b, __m256& b0, __m256& b1) {
  b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
}
inline __m256 widen_bf16(const uint16_t* b) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), 16));
}
inline void load_weights(const uint16_t* b, __m256& b0, __m256& b1) { b0 = widen_bf16(b), b1 = widen_bf16(b + 8); }

template <int MR, typename W>
inline void micro_kernel(const float* a, const W* b, int64_t kc, __m256 (&acc)[kMR][2], const char* pf,
                         int64_t lines) {
  __m256 r[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) r[i][0] = acc[i][0], r[i][1] = acc[i][1];
  PacedPrefetch(pf, lines, kc).run(kc, [&](int64_t k) __attribute__((always_inline)) {
    __m256 b0, b1;
    load_weights(b + k * kNR, b0, b1);
    const float* ak = a + k * kMR;
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(ak + i);
      r[i][0] = _mm256_fmadd_ps(x, b0, r[i][0]);
      r[i][1] = _mm256_fmadd_ps(x, b1, r[i][1]);
    }
  });
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = r[i][0], acc[i][1] = r[i][1];
}

// Fetches for writing (prefetchw where -march has PRFCHW, else prefetcht0) every 64-byte line of `rows` output rows
// of `n` elements each, `ld` elements apart: what every GEMM tile here does before its k steps (below).
template <typename T>
inline void fetch_rows_for_writing(T* c, int64_t ld, int rows, int n) {
  for (int i = 0; i < rows; ++i) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(c + i * ld) & ~uintptr_t{63};
    const uintptr_t last = reinterpret_cast<uintptr_t>(c + i * ld + n - 1);
    for (uintptr_t line = first; line <= last; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 3);
  }
}

// One MR x 16 tile of out: starts from the bias (first chunk) or what earlier chunks summed, adds this chunk.
// `cols` < 16 only in the last panel, whose padding columns are computed but not stored.
//
// On the first chunk the tile's output lines are fetched for writing (fetch_rows_for_writing) before its k steps:
// each line is written by this one tile and read by none before, and the stores' reads for ownership, from DRAM once
// the output outgrows the caches, otherwise stalled the tile's end. Rows x in x out alternated in one process, median
// of 15 (AMD EPYC Zen 3, avx2, 2 threads): 512 x 576 x 3072 1.06x, 512 x 576 x 960 1.06x, 512 x 1536 x 576 1.03x,
// 64 x 576 x 3072 1.03x.
template <int MR, typename W>
void tile(const float* a, const W* b, int64_t kc, float* c, int64_t ldc, int cols, const float* bias,
          bool first, const char* pf, int64_t lines) {
  if (first) fetch_rows_for_writing(c, ldc, MR, cols);
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
  micro_kernel<MR, W>(a, b, kc, acc, pf, lines);
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

template <typename W>
using TileFn = void (*)(const float*, const W*, int64_t, float*, int64_t, int, const float*, bool, const char*,
                       int64_t);
template <typename W>
constexpr TileFn<W> kTiles[kMR + 1] = {nullptr, tile<1, W>, tile<2, W>, tile<3, W>, tile<4, W>, tile<5, W>, tile<6, W>};

// x rows [m0, m0 + mc) and columns [k0, k0 + kc) as ceil(mc / MR) blocks of [kc][MR], one per call (RowCalls): MR 6
// for the 256-bit tiles, 12 for the 512-bit ones. A block of fewer rows leaves the others unwritten: its tile<rows>
// never reads them (writing them as zeros was most of a one-row GEMM's fixed cost).
template <int MR>
void pack_rows(const float* x, int64_t ldx, int64_t m0, int64_t mc, int64_t k0, int64_t kc, float* out) {
  const RowCalls<MR> calls(mc);
  for (int64_t r = 0; r < calls.count; ++r) {
    const int rows = calls.rows(r);
    float* block = out + r * MR * kc;
    const float* src = x + (m0 + calls.first(r)) * ldx + k0;
    for (int64_t k = 0; k < kc; ++k)
      for (int i = 0; i < rows; ++i) block[k * MR + i] = src[i * ldx + k];
  }
}

// Where gemm_panels finds a panel's k rows [k0, k0 + kc) as [kc][16] fp32, and what to prefetch for it: the packed
// weight itself (DensePanels), or int8 tiles widened into a scratch panel (Int8Panels, below).
struct DensePanels {
  const float* w;
  int64_t K;
  static constexpr int64_t kBytesPerK = kNR * 4;  // of the stored panel: what a k step streams from memory
  const float* get(int64_t p, int64_t k0, int64_t, int = 0) const { return w + (p * K + k0) * kNR; }
  const char* stored(int64_t p, int64_t k0) const { return reinterpret_cast<const char*>(w + (p * K + k0) * kNR); }
};

// The fp32 GEMMs' blocking: K in chunks of at most kKC, M in blocks whose copy fits half of L2 (row_block_of).
inline int64_t chunk_of(int64_t K) {
  const int64_t chunks = (K + kKC - 1) / kKC;
  return (K + chunks - 1) / chunks;
}
template <int MR> inline int64_t row_block_of(int64_t K) {
  return std::max<int64_t>(MR, block_bytes() / (chunk_of(K) * 4) / MR * MR);
}

// For each (chunk, block), x's rows are copied MR interleaved and body(k0, kc, m0, mc, blocks, copy, i0, i1, last)
// runs the tiles of items (panels, or pairs of them) [i0, i1), each prefetching the next below `last`: items
// [i0, i1) of every block; or, given `claims` (K in one chunk; over row blocks x items i0 = 0 to i1), the parts of
// them this thread claims, each block copied once.
template <int MR, typename Body>
void by_blocks(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t i0, int64_t i1,
               aserve_kernels::Claims* claims, Body&& body) {
  const int64_t kc_max = chunk_of(K), row_block = row_block_of<MR>(K);
  thread_local std::vector<float> packed;
  packed.resize(((std::min(M, row_block) + MR - 1) / MR) * MR * kc_max);
  if (claims != nullptr) {
    int64_t packed_m0 = -1;
    for (int64_t begin, end; claims->claim(begin, end);) {
      const int64_t m0 = begin / i1 * row_block, mc = std::min(row_block, M - m0);
      if (m0 != packed_m0) pack_rows<MR>(x, ldx, m0, mc, 0, K, packed.data()), packed_m0 = m0;
      body(int64_t{0}, K, m0, mc, (mc + MR - 1) / MR, static_cast<const float*>(packed.data()), begin % i1,
           begin % i1 + (end - begin), i1);
    }
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t mc = std::min(row_block, M - m0);
      pack_rows<MR>(x, ldx, m0, mc, k0, kc, packed.data());
      body(k0, kc, m0, mc, (mc + MR - 1) / MR, static_cast<const float*>(packed.data()), i0, i1, i1);
    }
  }
}

// A thread's gate sums of a row block (kSiluMul on the 256-bit tiles): [rows][16], until their ups' panel is done.
inline float* gate_scratch(int64_t rows) {
  thread_local std::vector<float> scratch;
  scratch.resize(rows * kNR);
  return scratch.data();
}

// Panels [p0, p1) of out for all M rows (by_blocks: or the parts `claims` hands this thread). kSiluMul (K one chunk):
// items are a gate panel and its up panel (2i, 2i + 1) and out is [M, N/2]; each block's gate sums wait in
// gate_scratch for its up tile, which writes silu(gate) * up.
template <class Panels>
void gemm_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const Panels& panels, const float* bias,
                 float* out, int64_t N, int64_t p0, int64_t p1, int64_t act = kNoActivation,
                 aserve_kernels::Claims* claims = nullptr) {
  const bool gated = act == kSiluMul;
  const int64_t per_item = gated ? 2 : 1;
  by_blocks<kMR>(x, ldx, M, K, p0, p1, claims, [&](int64_t k0, int64_t kc, int64_t m0, int64_t mc, int64_t blocks,
                                                   const float* packed, int64_t q0, int64_t q1, int64_t end) {
    const RowCalls<kMR> calls(mc);
    const bool first = k0 == 0, last = k0 + kc == K;
    const int64_t total_lines = (kc * Panels::kBytesPerK + 63) / 64;  // of the next panel, shared out to the blocks
    float* gates = gated ? gate_scratch(mc) : nullptr;
    for (int64_t p = q0 * per_item; p < q1 * per_item; ++p) {
      const auto* panel = panels.get(p, k0, kc);  // fp32, or bf16 values to widen (Bf16Panels)
      const auto tile_fn = kTiles<std::remove_cv_t<std::remove_pointer_t<decltype(panel)>>>;
      const char* next = p + 1 < end * per_item ? panels.stored(p + 1, k0) : nullptr;
      const int cols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
      const float* b = bias != nullptr ? bias + p * kNR : nullptr;
      for (int64_t r = 0; r < blocks; ++r) {  // block r fetches its share of the next panel's lines
        const int64_t from = r * total_lines / blocks;
        const int64_t lines = next != nullptr ? (r + 1) * total_lines / blocks - from : 0;
        const char* pf = next != nullptr ? next + from * 64 : nullptr;
        const int rows = calls.rows(r);
        const float* a = packed + r * kMR * kc;
        if (gated) {
          float* g = gates + calls.first(r) * kNR;
          if (p % 2 == 0) {
            tile_fn[rows](a, panel, kc, g, kNR, kNR, b, true, pf, lines);
            continue;
          }
          alignas(64) float ups[kMR * kNR];
          float* o = out + (m0 + calls.first(r)) * (N / 2) + p / 2 * kNR;
          fetch_rows_for_writing(o, N / 2, rows, kNR);  // as the tile does its own output lines (below)
          tile_fn[rows](a, panel, kc, ups, kNR, kNR, b, true, pf, lines);
          silu_times_rows(g, kNR, ups, kNR, o, N / 2, rows);
          continue;
        }
        float* c = out + (m0 + calls.first(r)) * N + p * kNR;
        tile_fn[rows](a, panel, kc, c, N, cols, b, first, pf, lines);
        if (last && act != kNoActivation)
          for (int i = 0; i < rows; ++i) activate(c + i * N, cols, act);
      }
    }
  });
}

#if defined(__AVX512F__)
// The fp32 GEMM on CPUs with AVX-512: the same packed panels ([ceil(N/16)][K][16]), two side by side per tile, each
// k step one 512-bit load of each and 12 broadcasts of x (copied 12 rows interleaved, [kc][12]) into 24 accumulators.
// Where a core's FMA units are 512 bits wide the 256-bit kernel above did half the work per instruction: on an AMD
// EPYC Zen 5 (2 threads) 245-254 GFLOP/s where oneDNN's fp32 GEMM reached 450-512. (Zen 4 splits 512-bit FMAs in two
// halves: no faster there, and no slower.) int8 and int4 panels take it too, each of the pair widened into its own
// scratch (fp32 int8 at 64 rows, 120 bench-model layers: 61.0 ms on the 256-bit kernel against dense's 29.7).
namespace wide {

constexpr int kMR = 12;

inline __m512 load_weights(const float* b) { return _mm512_load_ps(b); }
inline __m512 load_weights(const uint16_t* b) {  // bf16 values (Bf16Panels), widened exactly with a shift
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))), 16));
}

template <int MR, int NP, typename W>
inline void micro_kernel(const float* a, const W* b0, const W* b1, int64_t kc, __m512 (&acc)[kMR][2],
                         const char* pf, int64_t lines) {
  __m512 r[MR][NP];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NP; ++h) r[i][h] = acc[i][h];
  PacedPrefetch(pf, lines, kc).run(kc, [&](int64_t k) __attribute__((always_inline)) {
    const __m512 w0 = load_weights(b0 + k * kNR);
    const __m512 w1 = NP == 2 ? load_weights(b1 + k * kNR) : w0;
    const float* ak = a + k * kMR;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(ak[i]);
      r[i][0] = _mm512_fmadd_ps(x, w0, r[i][0]);
      if constexpr (NP == 2) r[i][1] = _mm512_fmadd_ps(x, w1, r[i][1]);
    }
  });
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NP; ++h) acc[i][h] = r[i][h];
}

// MR rows x (16 NP) columns of out, `cols` of them real (the last panel's padding is computed, not stored): from the
// bias (first chunk of k) or what earlier chunks summed, plus this chunk. On the first chunk its output lines are
// fetched for writing first, as the AVX2 tile's are: the bench model's 120 fp32 layers and its head (bf16 panels), both
// ways alternated in one process, 15 rounds (AMD EPYC Zen 4, avx512f, 2 threads): 16 rows 1.020x, 64 rows 1.013-1.025x,
// 128 rows 1.013x, 512 rows 1.019x. `silu` (kSiluMul, K one chunk): the pair is a gate panel and its up panel, and c
// gets silu(gate) * up, 16 columns a row.
template <int MR, int NP, typename W>
void tile(const float* a, const W* b0, const W* b1, int64_t kc, float* c, int64_t ldc, int cols,
          const float* bias, bool first, const char* pf, int64_t lines, bool silu) {
  if (first) fetch_rows_for_writing(c, ldc, MR, silu ? kNR : cols);
  __m512 acc[kMR][2];
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1) : 0;
  for (int i = 0; i < MR; ++i) {
    const float* src = first ? bias : c + i * ldc;
    acc[i][0] = src != nullptr ? _mm512_maskz_loadu_ps(m0, src) : _mm512_setzero_ps();
    acc[i][1] = src != nullptr && NP == 2 ? _mm512_maskz_loadu_ps(m1, src + 16) : _mm512_setzero_ps();
  }
  micro_kernel<MR, NP, W>(a, b0, b1, kc, acc, pf, lines);
  if (silu) {
    for (int i = 0; i < MR; ++i)
      silu_times_fp32(aserve_kernels::fVec(acc[i][0]), aserve_kernels::fVec(acc[i][1])).store(c + i * ldc);
    return;
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
    if constexpr (NP == 2) _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
  }
}

template <typename W>
using TileFn = void (*)(const float*, const W*, const W*, int64_t, float*, int64_t, int, const float*, bool,
                       const char*, int64_t, bool);
template <int NP, typename W = float>
constexpr TileFn<W> kTiles[kMR + 1] = {nullptr, tile<1, NP, W>, tile<2, NP, W>, tile<3, NP, W>, tile<4, NP, W>,
                                       tile<5, NP, W>, tile<6, NP, W>, tile<7, NP, W>, tile<8, NP, W>, tile<9, NP, W>,
                                       tile<10, NP, W>, tile<11, NP, W>, tile<12, NP, W>};

// Panel pairs [q0, q1) (panels 2q and 2q + 1; a last odd panel alone) of out for all M rows, K in chunks of at most
// kKC, from `panels` (DensePanels, or int8 / int4 tiles widened into scratch: Int8Panels, Int4Panels below); or
// the parts of them `claims` hands this thread (by_blocks). kSiluMul (K one chunk): each pair is a gate panel and its
// up panel, and out is [M, N/2].
template <class Panels>
void gemm_pairs(const float* x, int64_t ldx, int64_t M, int64_t K, const Panels& source, const float* bias, float* out,
                int64_t N, int64_t q0, int64_t q1, int64_t act, aserve_kernels::Claims* claims = nullptr) {
  const int64_t panels = (N + kNR - 1) / kNR;
  by_blocks<kMR>(x, ldx, M, K, q0, q1, claims, [&](int64_t k0, int64_t kc, int64_t m0, int64_t mc, int64_t blocks,
                                                   const float* packed, int64_t i0, int64_t i1, int64_t end) {
    const RowCalls<kMR> calls(mc);
    const bool first = k0 == 0, last = k0 + kc == K;
    for (int64_t q = i0; q < i1; ++q) {
      const int64_t p = 2 * q, np = std::min<int64_t>(2, panels - p);
      const auto* b0 = source.get(p, k0, kc, 0);  // fp32, or bf16 values to widen (Bf16Panels)
      const auto* b1 = np == 2 ? source.get(p + 1, k0, kc, 1) : nullptr;
      // the next pair's chunks as stored, shared out to the blocks: line l of them is byte 64 l % chunk of panel
      // p + 2 + 64 l / chunk's chunk (a block's run may go on past its panel's chunk: a hint)
      const int64_t chunk = kc * Panels::kBytesPerK;
      const int64_t next_np = q + 1 < end ? std::min<int64_t>(2, panels - p - 2) : 0;
      const int64_t total_lines = (next_np * chunk + 63) / 64;
      const int cols = static_cast<int>(std::min<int64_t>(kNR * np, N - p * kNR));
      const float* pb = bias != nullptr ? bias + p * kNR : nullptr;
      for (int64_t r = 0; r < blocks; ++r) {
        const int64_t from = r * total_lines / blocks, lines = (r + 1) * total_lines / blocks - from;
        const int rows = calls.rows(r);
        const char* pf = lines > 0 ? source.stored(p + 2 + from * 64 / chunk, k0) + from * 64 % chunk : nullptr;
        using W = std::remove_cv_t<std::remove_pointer_t<decltype(b0)>>;
        if (act == kSiluMul) {
          kTiles<2, W>[rows](packed + r * kMR * kc, b0, b1, kc, out + (m0 + calls.first(r)) * (N / 2) + q * kNR,
                             N / 2, cols, pb, true, pf, lines, true);
          continue;
        }
        float* c = out + (m0 + calls.first(r)) * N + p * kNR;
        (np == 2 ? kTiles<2, W> : kTiles<1, W>)[rows](packed + r * kMR * kc, b0, b1, kc, c, N, cols, pb, first, pf,
                                                       lines, false);
        if (last && act != kNoActivation)
          for (int i = 0; i < rows; ++i) activate(c + i * N, cols, act);
      }
    }
  });
}

}  // namespace wide

#endif  // __AVX512F__

// The fp32 GEMM over `num_panels` panels of `panels`, the threads splitting them: the 512-bit tiles' pairs where
// AVX-512 is, else single panels. Calls of more than kClaimRows rows are bound by the multiplies, and in every GEMM
// here their threads claim parts as they go (aserve_kernels::Claims; here where K is one chunk); fewer rows stream the
// weights, each thread its own even share.
constexpr int64_t kClaimRows = 4;
template <class Panels>
void gemm_fp32_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const Panels& panels, int64_t num_panels,
                      const float* bias, float* out, int64_t N, int64_t act) {
#if defined(__AVX512F__)
  constexpr int64_t kPanelsPerItem = 2;
  constexpr int MR = wide::kMR;
#else
  constexpr int64_t kPanelsPerItem = 1;
  constexpr int MR = kMR;
#endif
  // kSiluMul (K one chunk, N whole pairs of panels): an item is a gate panel and its up panel on either kernel
  const int64_t per_item = act == kSiluMul ? 2 : kPanelsPerItem;
  const int64_t items = (num_panels + per_item - 1) / per_item;
  if (M > kClaimRows && K <= kKC) {
    const int64_t row_block = row_block_of<MR>(K);
    aserve_kernels::parallel_claims((M + row_block - 1) / row_block, items, [&](aserve_kernels::Claims& claims) {
#if defined(__AVX512F__)
      wide::gemm_pairs(x, ldx, M, K, panels, bias, out, N, 0, items, act, &claims);
#else
      gemm_panels(x, ldx, M, K, panels, bias, out, N, 0, items, act, &claims);
#endif
    });
    return;
  }
  aserve_kernels::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    wide::gemm_pairs(x, ldx, M, K, panels, bias, out, N, begin, end, act);
#else
    gemm_panels(x, ldx, M, K, panels, bias, out, N, begin, end, act);
#endif
  });
}

at::Tensor pack_fp32(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNR - 1) / kNR;
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({panels, K, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  aserve_kernels::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
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

// x's rows as a matrix with unit inner stride (a view where they allow it, read with their stride; else a copy),
// the output shaped like x with out_features last, and the checked bias.
struct GemmArgs {
  at::Tensor rows, out;
  const void* bias = nullptr;
  int64_t M, K, N;
};

// `out_columns`: the output's (kSiluMul's half of out_features); -1: out_features.
GemmArgs gemm_args(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t out_features,
                   int64_t out_columns = -1) {
  GemmArgs a;
  a.K = x.size(-1), a.N = out_features;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == a.N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "gemm_packed: bias must be a contiguous [out] vector in x's dtype");
    a.bias = bias->data_ptr();
  }
  a.rows = x.reshape({-1, a.K});
  if (a.rows.stride(-1) != 1 || (a.rows.size(0) > 1 && a.rows.stride(0) < a.K)) a.rows = a.rows.contiguous();
  a.M = a.rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_columns < 0 ? a.N : out_columns;
  a.out = at::empty(shape, x.options());
  if (a.M > 0 && a.N > 0 && a.K == 0) a.bias != nullptr ? a.out.copy_(bias->expand_as(a.out)) : a.out.zero_();
  return a;
}

GemmArgs gemm_args(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                   int64_t out_features, int64_t panel_k, int64_t nr, const char* layout, int64_t out_columns = -1) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == packed.scalar_type() ||
                                (x.scalar_type() == at::kFloat && packed.scalar_type() == at::kBFloat16 && nr == kNR)),
              "gemm_packed: x must be [..., in_features] in the packed weight's dtype (or fp32 over "
              "pack_gemm_weight_bf16's panels)");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == panel_k && packed.size(2) == nr &&
                  packed.size(0) == (out_features + nr - 1) / nr,
              "gemm_packed: weight must be pack_gemm_weight's ", layout, " for x's in_features and out");
  return gemm_args(x, bias, out_features, out_columns);
}

// An fp32 GEMM over `num_panels` panels of `panels` into args.out, `act` applied. kSiluMul is fused where K is one
// chunk; a longer K (partial sums between chunks) has its product written whole, then silu(gate) * up taken over it.
template <class Panels>
void run_fp32(const GemmArgs& args, const Panels& panels, int64_t num_panels, int64_t act) {
  const float* x = args.rows.data_ptr<float>();
  const auto* bias = static_cast<const float*>(args.bias);
  const int64_t M = args.M, K = args.K, N = args.N, ldx = args.rows.stride(0);
  if (act != kSiluMul || K <= kKC) {
    gemm_fp32_panels(x, ldx, M, K, panels, num_panels, bias, args.out.data_ptr<float>(), N, act);
    return;
  }
  at::Tensor product = at::empty({M, N}, args.out.options());
  const float* pr = product.data_ptr<float>();
  float* o = args.out.data_ptr<float>();
  gemm_fp32_panels(x, ldx, M, K, panels, num_panels, bias, product.data_ptr<float>(), N, kNoActivation);
  aserve_kernels::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = 0; q < N / (2 * kNR); ++q)
      silu_times_rows(pr + begin * N + 2 * q * kNR, N, pr + begin * N + (2 * q + 1) * kNR, N,
                      o + begin * (N / 2) + q * kNR, N / 2, static_cast<int>(end - begin));
  });
}

// kSiluMul's weight: whole pairs of panels (a gate | up of 2 x a multiple of 16 rows, pack_gated_weight's order).
void check_silu_mul(const at::Tensor& x, int64_t out_features, int64_t act, const char* op) {
  TORCH_CHECK(act != kSiluMul || (out_features % (2 * kNR) == 0 && x.size(-1) > 0), op,
              ": SiLU-and-mul needs a gate | up weight of whole pairs of 16-row panels (2 x a multiple of 16)");
}

at::Tensor gemm_fp32_bf16_stored(GemmArgs& args, const at::Tensor& packed, int64_t act);  // after Bf16Panels

at::Tensor gemm_fp32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     int64_t out_features, int64_t act) {
  check_silu_mul(x, out_features, act, "gemm_packed");
  GemmArgs args = gemm_args(x, packed, bias, out_features, x.size(-1), kNR, "[ceil(out/16), in, 16]",
                            act == kSiluMul ? out_features / 2 : -1);
  if (packed.scalar_type() == at::kBFloat16) return gemm_fp32_bf16_stored(args, packed, act);
  if (args.M == 0 || args.N == 0 || args.K == 0) return args.out;
  run_fp32(args, DensePanels{packed.data_ptr<float>(), args.K}, packed.size(0), act);
  return args.out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bf16 GEMM for CPUs with AVX512-BF16: the same scheme, on vdpbf16ps, which multiplies pairs of bf16 values
// and adds both products to an fp32 lane. A panel holds 32 output channels as [ceil(K/2)][32][2] (lane j of
// the panel's two vectors holds output j's pair of weights for k = 2kk, 2kk + 1), x is copied 12 rows
// interleaved as pairs ([K/2][12] 32-bit words), and a 12 x 32 tile keeps 24 accumulators in registers: 24
// dot products per 2 weight loads and 12 broadcasts. Sums are fp32, rounded to bf16 once at the end (RNE, as
// oneDNN rounds). K is never cut: a partial sum stored as bf16 would lose bits.
namespace bf16 {

constexpr int kNR = 32;
constexpr int kMR = 12;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Where a micro-kernel's k step finds the panel's two weight vectors: a stored bf16 panel (Stored), or two int8 tiles
// widened as it goes (WidenInt8, after Int8Panels below), which also leaves them in scratch for the block's other calls.
struct Stored {
  const uint16_t* b;
  inline void operator()(int64_t k, __m512bh& b0, __m512bh& b1) const {
    b0 = as_bh(_mm512_load_si512(b + k * 2 * kNR));
    b1 = as_bh(_mm512_load_si512(b + k * 2 * kNR + kNR));
  }
};

template <int MR, class Source>
inline void micro_kernel(const uint32_t* a, const Source& source, int64_t kp, __m512 (&acc)[kMR][2], const char* pf,
                         int64_t lines) {
  __m512 r[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) r[i][0] = acc[i][0], r[i][1] = acc[i][1];
  PacedPrefetch(pf, lines, kp).run(kp, [&](int64_t k) __attribute__((always_inline)) {
    __m512bh b0, b1;
    source(k, b0, b1);
    const uint32_t* ak = a + k * kMR;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = as_bh(_mm512_set1_epi32(static_cast<int>(ak[i])));
      r[i][0] = _mm512_dpbf16_ps(r[i][0], x, b0);
      r[i][1] = _mm512_dpbf16_ps(r[i][1], x, b1);
    }
  });
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = r[i][0], acc[i][1] = r[i][1];
}

// What multiplies bf16 panels: AMX tiles where the CPU lends them (amx::gemm_panels, below), else vdpbf16ps or, for
// CPUs whose two FMA ports outrun it, fp32 FMAs on widened values (16-column halves of the panels as tiles of
// gemm_by_tiles, DenseItems below), which give vdpbf16ps's bits: it is two fp32 FMAs, the odd k's product first, of
// products exact in fp32 (but with denormal inputs read as zero and denormal sums flushed). The choice is
// aserve_kernels::bf16_products() (vec_helpers.h), which decode attention follows too.
using aserve_kernels::amx_tiles;
using aserve_kernels::Products;
using aserve_kernels::bf16_products;
// Up to this many rows a dense product is multiplied on vdpbf16ps even where FMAs multiply the rest: a GEMV's row is
// bound by the weights' streaming, and row_by_two_panels streams them as fast as the tiles do (the bench model
// decoding one request, steps alternated in one engine, Intel Xeon without AMX tiles, 2 threads: 13.04 ms a step
// against 12.92 on the tiles). From 2 rows the tiles were faster: 2 requests 14.15/14.79 against 13.57/14.08 ms,
// 3 15.65 against 14.50, 4 15.85 against 15.07 (the panels' 12 x 32 FMA micro-kernel, earlier, had lost to
// vdpbf16ps up to 4 rows). The same bits either way, so a row's output does not depend on its batch.
constexpr int64_t kRowsOnDpbf16 = 1;

inline __m512 widen(const uint16_t* p) { return aserve_kernels::load_bf16_as_float(p); }

// A tile and group's int4 scales and zero points (fp16 [2][16], int4_args.h) as the fp32 s and s * z (exact).
inline void widen_scales_zeros(const uint16_t* record, __m512& s, __m512& sz) {
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
  sz = _mm512_mul_ps(s, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 16))));
}

// A tile row's 32 fp32 sums rounded to bf16 (RNE) into c: `cols` of them (fewer than 32 only in the last panel).
inline void store_row(__m512 lo, __m512 hi, uint16_t* c, int cols) {
  const __m256i l = reinterpret_cast<const __m256i&>(static_cast<const __m256bh&>(_mm512_cvtneps_pbh(lo)));
  const __m256i h = reinterpret_cast<const __m256i&>(static_cast<const __m256bh&>(_mm512_cvtneps_pbh(hi)));
  if (cols == kNR) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16), h);
  } else {
    alignas(64) uint16_t edge[kNR];
    _mm256_store_si256(reinterpret_cast<__m256i*>(edge), l);
    _mm256_store_si256(reinterpret_cast<__m256i*>(edge + 16), h);
    std::memcpy(c, edge, cols * sizeof(uint16_t));
  }
}

// silu(gate) * up in fp32: gate / (1 + 2^(-gate log2 e)), the power held under 2^126 (a gate under -87 gives a
// tiny normal product, not a denormal, whose computation would take a microcode assist on Intel cores).
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(gate, _mm512_set1_ps(-aserve_kernels::kLog2e)), _mm512_set1_ps(126.f));
  const __m512 e = aserve_kernels::exp2_bounded(aserve_kernels::fVec(t));
  return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)), up);
}

// kSiluMul's 16 outputs of a tile row (its gates in lo, their ups in hi) rounded to bf16 (RNE) into c.
inline void store_silu_times(__m512 lo, __m512 hi, uint16_t* c) {
  const __m256bh v = _mm512_cvtneps_pbh(silu_times(lo, hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), reinterpret_cast<const __m256i&>(v));
}

// A tile's 32 biases as whole vectors can read them: `bias` itself, or (a last panel's `cols` < 32) its first `cols`
// copied into `edge`, zeros after; null where there is none.
inline const uint16_t* whole_bias(const uint16_t* bias, int cols, uint16_t* edge) {
  if (bias == nullptr || cols == kNR) return bias;
  std::memcpy(edge, bias, cols * sizeof(uint16_t));
  return edge;
}

// Where a tile's MR rows of sums start: the bias (`init`, whole_bias), or zero where there is none or the sums are
// scaled before it is added (int8 weights).
template <int MR>
inline void start_sums(__m512 (&acc)[kMR][2], const uint16_t* init, const float* scale) {
  const bool bias_first = init != nullptr && scale == nullptr;
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = bias_first ? widen(init) : _mm512_setzero_ps();
    acc[i][1] = bias_first ? widen(init + 16) : _mm512_setzero_ps();
  }
}

// A tile's MR rows of sums into out (bf16): with `scale` (32 fp32 column scales: int8 weights) scaled and then the
// bias added, in fp32, then the activation, before the one rounding. `cols` < 32 only in the last panel.
template <int MR>
inline void finish_tile(__m512 (&acc)[kMR][2], const uint16_t* init, const float* scale, uint16_t* c, int64_t ldc,
                        int cols, int64_t act) {
  if (scale != nullptr) {
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    const __m512 b0 = init != nullptr ? widen(init) : _mm512_setzero_ps();
    const __m512 b1 = init != nullptr ? widen(init + 16) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = _mm512_fmadd_ps(acc[i][0], s0, b0);
      acc[i][1] = _mm512_fmadd_ps(acc[i][1], s1, b1);
    }
  }
  if (act == kSiluMul) {  // c: the tile's 16 outputs of each row
    for (int i = 0; i < MR; ++i) store_silu_times(acc[i][0], acc[i][1], c + i * ldc);
    return;
  }
  if (act != kNoActivation) {  // over the whole tile at once: one call, its vectors back to back
    alignas(64) float sums[kMR * kNR];
    for (int i = 0; i < MR; ++i) _mm512_store_ps(sums + i * kNR, acc[i][0]), _mm512_store_ps(sums + i * kNR + 16, acc[i][1]);
    activate(sums, MR * kNR, act);
    for (int i = 0; i < MR; ++i) acc[i][0] = _mm512_load_ps(sums + i * kNR), acc[i][1] = _mm512_load_ps(sums + i * kNR + 16);
  }
  for (int i = 0; i < MR; ++i) store_row(acc[i][0], acc[i][1], c + i * ldc, cols);
}

// One MR x 32 tile of out (bf16), from the bias or zero (start_sums), finished by finish_tile. Its output lines are
// fetched for writing first (prefetchw), as the AVX2 fp32 tile's are: the bench model's 120 layers and its head, both
// ways alternated in one process, 21 rounds (AMD EPYC Zen 4, avx512_bf16, 2 threads): 64 rows 1.025x, 128 rows 1.030x,
// 512 rows 1.028x (1.045x in 15 other rounds); 16 rows level. End to end, offline 64 x 128/128, 1.013x over 10 rounds
// (0.96-1.06: within the VM's spread).
template <int MR, class Source>
void tile_of(const uint32_t* a, const Source& source, int64_t kp, uint16_t* c, int64_t ldc, int cols,
             const uint16_t* bias, const float* scale, const char* pf, int64_t lines, int64_t act) {
  fetch_rows_for_writing(c, ldc, MR, act == kSiluMul ? kNR / 2 : cols);  // (SiLU-and-mul: 16 outputs a row)
  __m512 acc[kMR][2];
  alignas(64) uint16_t edge[kNR] = {};
  const uint16_t* init = whole_bias(bias, cols, edge);
  start_sums<MR>(acc, init, scale);
  micro_kernel<MR>(a, source, kp, acc, pf, lines);
  finish_tile<MR>(acc, init, scale, c, ldc, cols, act);
}

// One row against two stored panels at once, on vdpbf16ps: four chains of dot products where a panel alone has two.
// With its weights in the caches a GEMV is bound by the chains' latency (a vdpbf16ps takes about twice an FMA's):
// Intel Xeon without AMX tiles, 2 threads, a [2048, 576] weight in L2 46-51 -> 57-73 GB/s, [1536, 1536] 33-35 -> 48;
// end to end, the bench model at batch 1 (its 269 MB of weights read from DRAM a step), p50 61.0-68.6 -> 65.8-71.4
// tok/s, builds alternated three times. `first` describes panel p, `second` p + 1 (both stored, dense); each output's
// sums are the same instructions in the same order as tile_of<1>'s.
struct PanelOut {
  const uint16_t* w;
  uint16_t* c;
  int cols;
  const uint16_t* bias;
  const float* scale;
};

inline void row_by_two_panels(const uint32_t* a, int64_t kp, const PanelOut& first, const PanelOut& second,
                              const char* pf, int64_t lines, int64_t act) {
  __m512 acc0[kMR][2], acc1[kMR][2];
  alignas(64) uint16_t edge0[kNR] = {}, edge1[kNR] = {};
  const uint16_t* init0 = whole_bias(first.bias, first.cols, edge0);
  const uint16_t* init1 = whole_bias(second.bias, second.cols, edge1);
  start_sums<1>(acc0, init0, first.scale);
  start_sums<1>(acc1, init1, second.scale);
  __m512 r0 = acc0[0][0], r1 = acc0[0][1], r2 = acc1[0][0], r3 = acc1[0][1];
  PacedPrefetch(pf, lines, kp).run(kp, [&](int64_t k) __attribute__((always_inline)) {
    const __m512bh x = as_bh(_mm512_set1_epi32(static_cast<int>(a[k * kMR])));
    r0 = _mm512_dpbf16_ps(r0, x, as_bh(_mm512_load_si512(first.w + k * 2 * kNR)));
    r1 = _mm512_dpbf16_ps(r1, x, as_bh(_mm512_load_si512(first.w + k * 2 * kNR + kNR)));
    r2 = _mm512_dpbf16_ps(r2, x, as_bh(_mm512_load_si512(second.w + k * 2 * kNR)));
    r3 = _mm512_dpbf16_ps(r3, x, as_bh(_mm512_load_si512(second.w + k * 2 * kNR + kNR)));
  });
  acc0[0][0] = r0, acc0[0][1] = r1, acc1[0][0] = r2, acc1[0][1] = r3;
  finish_tile<1>(acc0, init0, first.scale, first.c, 0, first.cols, act);
  finish_tile<1>(acc1, init1, second.scale, second.c, 0, second.cols, act);
}

template <int MR, class Source>
void tile(const uint32_t* a, const void* source, int64_t kp, uint16_t* c, int64_t ldc, int cols, const uint16_t* bias,
          const float* scale, const char* pf, int64_t lines, int64_t act) {
  tile_of<MR>(a, *static_cast<const Source*>(source), kp, c, ldc, cols, bias, scale, pf, lines, act);
}

using TileFn = void (*)(const uint32_t*, const void*, int64_t, uint16_t*, int64_t, int, const uint16_t*, const float*,
                        const char*, int64_t, int64_t);
template <class Source>
constexpr TileFn kTilesOf[kMR + 1] = {nullptr, tile<1, Source>, tile<2, Source>, tile<3, Source>, tile<4, Source>,
                                      tile<5, Source>, tile<6, Source>, tile<7, Source>, tile<8, Source>,
                                      tile<9, Source>, tile<10, Source>, tile<11, Source>, tile<12, Source>};

// 16 vectors of 16 32-bit words transposed in place: word j of r[i] becomes word i of r[j].
inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int j = 0; j < 8; ++j) {  // within 128-bit lanes: words of rows 2j, 2j + 1
    a[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    a[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // b[4j + c], lane L: rows 4j..4j+3 of word 4L + c
    b[4 * j] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
    b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 128-bit lanes transposed: word 4L + c gathers lane L of b[c], b[4 + c], ...
    const __m512i p0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), p1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i p2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i p3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(p0, p2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(p1, p3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
  }
}

// Pairs [k, k + 16) of `rows` (up to 12) rows as 16 groups of 12 at out[k * 12] (the missing rows zero).
inline void pack_16_pairs(const uint16_t* const* src, int rows, int64_t k, uint32_t* out) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(src[i] + 2 * k) : _mm512_setzero_si512();
  transpose_16x16(r);
  for (int j = 0; j < 16; ++j) _mm512_mask_storeu_epi32(out + (k + j) * kMR, 0x0FFF, r[j]);
}

// x rows [m0, m0 + mc) as ceil(mc / 12) blocks of [kp][12] pairs (odd K's last half zero), one per call (RowCalls).
// Blocks of 6 rows or more go 16 pairs at a time through pack_16_pairs: a word at a time, packing was a tenth of a
// [8192, 3072] x [3072, 768] product (each thread packs every row for its panels; short N has few to share it). A block
// of fewer rows leaves the others unwritten, as tile<rows> never reads them: zero-filling them was 2 of a one-row
// GEMM's ~3 us fixed cost.
void pack_rows(const uint16_t* x, int64_t ldx, int64_t m0, int64_t mc, int64_t K, uint32_t* out) {
  const int64_t kp = (K + 1) / 2, whole = K / 2;
  const RowCalls<kMR> calls(mc);
  for (int64_t r = 0; r < calls.count; ++r) {
    const int rows = calls.rows(r);
    const int64_t first = m0 + calls.first(r);
    uint32_t* block = out + r * kMR * kp;
    int64_t done = 0;
    if (rows >= kMR / 2) {
      const uint16_t* src[kMR];
      for (int i = 0; i < rows; ++i) src[i] = x + (first + i) * ldx;
      for (; done + 16 <= whole; done += 16) pack_16_pairs(src, rows, done, block);
    }
    for (int i = 0; i < rows; ++i) {
      const uint16_t* src = x + (first + i) * ldx;
      for (int64_t k = done; k < kp; ++k) {
        uint32_t pair = 0;
        if (k < whole) std::memcpy(&pair, src + 2 * k, sizeof(pair));
        else pair = src[2 * k];
        block[k * kMR + i] = pair;
      }
    }
  }
}

// Where gemm_panels finds panel p ([kp][32][2] bf16), and what to prefetch for it: the packed weight itself
// (DensePanels), or two int8 tiles widened into a scratch panel (Int8Panels, below).
struct DensePanels {
  static constexpr bool kWidensInFirstCall = false;
  static constexpr bool kWidensAhead = false;  // (quantized panels on AMX tiles: widen_rows, see amx::gemm_panels)
  const uint16_t* w;
  int64_t kp;
  int64_t bytes() const { return kp * 2 * kNR * 2; }  // a stored panel's
  const uint16_t* get(int64_t p) const { return w + p * kp * 2 * kNR; }
  const char* stored(int64_t p) const { return reinterpret_cast<const char*>(get(p)); }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles (Intel Sapphire Rapids and later): the same panels, multiplied 16 rows x 16 columns x 32 k at a time by
// tdpbf16ps. A panel's pair rows are already a tile's layout (pair row kk of columns [0, 16) is 64 contiguous bytes,
// the next pair row 128 bytes on), and x's rows are read as they are (32 bf16 of a row per tile row), so nothing is
// repacked. Eight tile registers hold a 32 x 32 block of sums (four tiles), two 16-row slices of x and the panel's
// two 16-column halves; rows go 32 at a time over K in chunks of up to 256 (a tile load from L2 costs what a
// tdpbf16ps does, one from L1 half: a chunk's 16 KB of panel stays in L1 while the row slices pass it), the sums
// wait in L2 between chunks and are finished as tile_of finishes them (bias, int8 scales, the activation, one
// rounding). Chunked, [2048, 768] x [768, 2304] ran at 2284-2465 GFLOP/s against 1971 over the whole K (oneDNN
// 2894-3301 on such hot, compute-bound shapes: the pooling runner takes oneDNN's GEMM on AMX CPUs, gemm_for). The
// bench model's 120 layers, cold weights (Intel Xeon with AMX, 2 threads, ms): 1 row 10.3-11.4 against 13.9-14.2 on the vdpbf16ps tiles and 15.4-15.7 in oneDNN's
// AMX GEMM; 64 rows 17.7 against 20.2 (oneDNN); 1024 rows 122-128 against 127-134. Weights are memory-bound at
// every batch a decode step has, so the tiles pay from one row. The next panel is prefetched into L2, not L1: into
// L1 it evicted the panel and x slices being multiplied (1 row 12.4, 64 rows 20.7).
namespace amx {

constexpr int64_t kChunkPairs = 128;  // pair rows of K per chunk at most: 256 k, a 16 KB slice of a panel

// Tiles 0-3: the sums of rows [0, 16) and [16, 32) (r0 and r1 of them) by columns [0, 16) and [16, 32); 4 and 5:
// the two row slices of x; 6 and 7: the panel's two column halves, 16 pair rows each.
inline void configure(int r0, int r1) { aserve_kernels::configure_tiles({r0, r0, r1, r1, r0, r1, 16, 16}); }

// sums[32][32] (+)= x's rows (16, or 32 with `two`) times the panel's pair rows [k0, k1) (k1 - k0 a multiple of
// 16; from the sums already there unless k0 is 0), prefetching `lines` lines from `pf` at an even pace.
inline void block_sums(const uint16_t* x, int64_t ldx, bool two, const uint16_t* panel, int64_t k0, int64_t k1,
                       float* sums, const char* pf, int64_t lines) {
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, sums, 4 * kNR);
    _tile_loadd(1, sums + 16, 4 * kNR);
    if (two) {
      _tile_loadd(2, sums + 16 * kNR, 4 * kNR);
      _tile_loadd(3, sums + 16 * kNR + 16, 4 * kNR);
    }
  }
  const int64_t steps = (k1 - k0) / 16, per_step = steps > 0 ? (lines + steps - 1) / steps : 0;
  for (int64_t kk = k0; kk < k1; kk += 16) {
    for (int64_t l = 0; l < per_step && lines > 0; ++l, --lines, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    const uint16_t* b = panel + kk * 2 * kNR;
    _tile_loadd(6, b, 4 * kNR);
    _tile_loadd(7, b + kNR, 4 * kNR);
    _tile_loadd(4, x + kk * 2, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + 16 * ldx + kk * 2, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 4 * kNR);
  _tile_stored(1, sums + 16, 4 * kNR);
  if (two) {
    _tile_stored(2, sums + 16 * kNR, 4 * kNR);
    _tile_stored(3, sums + 16 * kNR + 16, 4 * kNR);
  }
}

// The sums of `rows` rows finished into out: pair rows [kt, kp) (K not a multiple of 32) through vdpbf16ps, then
// the int8 scale and the bias (or the bias alone), the activation, and the one rounding to bf16.
inline void finish(float* sums, int rows, const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel,
                   int64_t kt, uint16_t* c, int64_t ldc, int cols, const uint16_t* bias, const float* scale,
                   int64_t act) {
  const int64_t kp = (K + 1) / 2;
  alignas(64) uint16_t edge[kNR] = {};
  if (bias != nullptr && cols < kNR) std::memcpy(edge, bias, cols * sizeof(uint16_t)), bias = edge;
  const __m512 b0 = bias != nullptr ? widen(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? widen(bias + 16) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) {
    __m512 lo = _mm512_loadu_ps(sums + i * kNR), hi = _mm512_loadu_ps(sums + i * kNR + 16);
    for (int64_t kk = kt; kk < kp; ++kk) {
      uint32_t pair = x[i * ldx + 2 * kk];
      if (2 * kk + 1 < K) pair |= static_cast<uint32_t>(x[i * ldx + 2 * kk + 1]) << 16;
      const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      lo = _mm512_dpbf16_ps(lo, a, as_bh(_mm512_load_si512(panel + kk * 2 * kNR)));
      hi = _mm512_dpbf16_ps(hi, a, as_bh(_mm512_load_si512(panel + kk * 2 * kNR + kNR)));
    }
    if (scale != nullptr) {
      lo = _mm512_fmadd_ps(lo, _mm512_loadu_ps(scale), b0);
      hi = _mm512_fmadd_ps(hi, _mm512_loadu_ps(scale + 16), b1);
    } else {
      lo = _mm512_add_ps(lo, b0), hi = _mm512_add_ps(hi, b1);
    }
    if (act == kSiluMul) {  // c: the 16 outputs of each row
      store_silu_times(lo, hi, c + i * ldc);
      continue;
    }
    _mm512_storeu_ps(sums + i * kNR, lo);
    _mm512_storeu_ps(sums + i * kNR + 16, hi);
  }
  if (act == kSiluMul) return;
  if (act != kNoActivation) activate(sums, rows * kNR, act);
  for (int i = 0; i < rows; ++i)
    store_row(_mm512_loadu_ps(sums + i * kNR), _mm512_loadu_ps(sums + i * kNR + 16), c + i * ldc, cols);
}

// gemm_panels on AMX tiles: blocks of x's rows that fit half of L2, each against all of [p0, p1)'s panels, 32 rows at a
// time. The next panel is prefetched, shared out to the panel's row slices. Quantized panels (int8, int4) are widened
// to bf16 one panel ahead: each call's tile products are followed by its share of the next panel's widening, which
// the vector units run while the tiles multiply, and the panel after that is the one prefetched. The bench model's
// 120 layers at 64 rows, int8 (Xeon with AMX, 2 threads): 16.7-18.5 ms widened whole before each panel's products,
// 14.5-15.5 ms so, against 17.4-20.7 ms for the dense bf16 weights.
template <class Panels>
void gemm_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const Panels& panels, const uint16_t* bias,
                 const float* scale, uint16_t* out, int64_t N, int64_t p0, int64_t p1, int64_t act) {
  const int64_t kp = (K + 1) / 2, kt = K / 32 * 16;
  const int64_t ldo = act == kSiluMul ? N / 2 : N, po = act == kSiluMul ? kNR / 2 : kNR;  // out's pitch, a panel's columns
  const int64_t row_block = std::max<int64_t>(32, block_bytes() / (K * 2) / 32 * 32);
  const int64_t total_lines = (panels.bytes() + 63) / 64;
  // K in chunks of at most kChunkPairs pair rows, each chunk's panel slice (16 KB) kept in L1 while the block's
  // slices of x go past it; the block's sums ([mc][32] fp32) wait in L2 between chunks. A slice's sums are finished
  // after the next slice's tile products are issued, so the AVX-512 epilogue runs while the tiles multiply; with a K
  // tail (which reads the panel) at once. A dense panel against row blocks of one slice (up to 32 rows: decode
  // batches) has no second slice to keep a chunk in L1 for: K goes whole, the sums staying in the tiles from the
  // first pair row to the last. The bench model's 120 layers (Xeon with AMX, 2 threads, alternated in one process):
  // 1 row 10.3 -> 9.8 ms, 16 rows 12.0 -> 10.7, 32 rows 13.6 -> 12.3; 64 rows whole ran 12% slower. Quantized
  // panels, widened into scratch, stay chunked (whole, 16-row decode rounds against chunked: int8 0.93-1.02x,
  // int4 0.92-1.07x).
  const bool whole_k = !Panels::kWidensAhead && std::min(row_block, M) <= 32;
  const int64_t chunks = whole_k ? 1 : std::max<int64_t>(1, (kt + kChunkPairs - 1) / kChunkPairs);
  const int64_t chunk = std::max<int64_t>(16, (kt + chunks - 1) / chunks + 15) / 16 * 16;  // evened out
  thread_local std::vector<float> block;
  block.resize(std::min(row_block, M) / 32 * 32 * kNR + 32 * kNR);
  struct Pending {
    float* sums;
    int rows;
    const uint16_t* x;
    uint16_t* c;
    int cols;
    const uint16_t* bias;
    const float* scale;
  };
  Pending pending{nullptr, 0, nullptr, nullptr, 0, nullptr, nullptr};
  const auto finish_pending = [&] {
    if (pending.rows > 0)
      finish(pending.sums, pending.rows, pending.x, ldx, K, nullptr, kt, pending.c, ldo, pending.cols, pending.bias,
             pending.scale, act);
    pending.rows = 0;
  };
  // Quantized panels: two scratch panels, p's (its tiles read by the tile products) and p + 1's (widened meanwhile)
  thread_local std::vector<__m512i> widened;
  if constexpr (Panels::kWidensAhead) widened.resize(4 * kp);
  bool ahead = false;  // (set per row block)
  const auto scratch_of = [&](int64_t p) { return widened.data() + (ahead ? (p & 1) * 2 * kp : 0); };
  int configured = 0;
  for (int64_t m0 = 0; m0 < M; m0 += row_block) {
    const int64_t mc = std::min(row_block, M - m0), slices = (mc + 31) / 32;
    // One slice (32 rows or fewer) is bound by its tile loads, which the next panel's stores slowed (int8, 16 rows:
    // 10.1-11.1 -> 11.6-12.0 ms a step's layers): there a panel is widened whole just before its products, into
    // the one scratch panel, still in L1 when they read it.
    ahead = slices > 1;
    if constexpr (Panels::kWidensAhead) {
      if (ahead && p0 + 1 < p1)  // the panel widened during p0's products: fetched now, the later ones a panel early
        for (int64_t l = 0; l < total_lines; ++l) _mm_prefetch(panels.stored(p0 + 1) + l * 64, _MM_HINT_T1);
      if (ahead) panels.widen_rows(p0, 0, kp, scratch_of(p0));
    }
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel;
      if constexpr (Panels::kWidensAhead) {
        if (!ahead) panels.widen_rows(p, 0, kp, scratch_of(p));
        panel = reinterpret_cast<const uint16_t*>(scratch_of(p));
      } else {
        panel = panels.get(p);
      }
      // the panel whose weights are fetched during this one's products: the next, or with widening ahead the one
      // after (the next is widened meanwhile, and its reads would wait on the lines just asked for)
      const int64_t fetched = p + (ahead && Panels::kWidensAhead ? 2 : 1);
      const char* next = fetched < p1 ? panels.stored(fetched) : nullptr;
      const int cols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
      const uint16_t* pb = bias != nullptr ? bias + p * kNR : nullptr;
      const float* ps = scale != nullptr ? scale + p * kNR : nullptr;
      const int64_t calls = chunks * slices;
      for (int64_t k0 = 0, call = 0; k0 < std::max<int64_t>(kt, 1); k0 += chunk) {
        const int64_t k1 = std::min(kt, k0 + chunk);
        for (int64_t r = 0; r < slices; ++r, ++call) {
          const int64_t first = m0 + r * 32;
          const int rows = static_cast<int>(std::min<int64_t>(32, m0 + mc - first));
          if (rows != configured) configure(std::min(rows, 16), rows - std::min(rows, 16)), configured = rows;
          const int64_t from = call * total_lines / calls;
          const int64_t lines = next != nullptr ? (call + 1) * total_lines / calls - from : 0;
          const uint16_t* xr = x + first * ldx;
          float* sums = block.data() + r * 32 * kNR;
          if (pending.sums == sums) finish_pending();  // (one slice: its own sums are pending)
          block_sums(xr, ldx, rows > 16, panel, k0, k1, sums, next != nullptr ? next + from * 64 : nullptr, lines);
          if constexpr (Panels::kWidensAhead) {
            if (ahead && p + 1 < p1) {  // this call's share of the next panel, in whole blocks of 4 pair rows
              const int64_t a = call * kp / calls / 4 * 4, b = call + 1 == calls ? kp : (call + 1) * kp / calls / 4 * 4;
              panels.widen_rows(p + 1, a, b, scratch_of(p + 1));
            }
          }
          if (k1 < kt) continue;
          finish_pending();
          uint16_t* c = out + first * ldo + p * po;
          if (kt < kp) finish(sums, rows, xr, ldx, K, panel, kt, c, ldo, cols, pb, ps, act);
          else pending = {sums, rows, xr, c, cols, pb, ps};
        }
      }
    }
  }
  finish_pending();
  _tile_release();
}

}  // namespace amx
#endif  // __AMX_TILE__ && __AMX_BF16__

// Rows a thread packs at a time: their x block (rows x ceil(K / 2) pairs of bf16) fills half of L2.
inline int64_t block_rows(int64_t K) {
  return std::max<int64_t>(kMR, block_bytes() / ((K + 1) / 2 * 4) / kMR * kMR);
}

// `scale`: with int8 weights, every output column's scale in fp32 (zero-padded to whole panels); else null.
// Panels [p0, p1) of every row block; or, given `claims` (over row blocks x panels p0 = 0 to p1, block_rows's
// blocks), whichever parts of them this thread claims.
template <class Panels>
void gemm_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const Panels& panels, const uint16_t* bias,
                 const float* scale, uint16_t* out, int64_t N, int64_t p0, int64_t p1, int64_t act = kNoActivation,
                 aserve_kernels::Claims* claims = nullptr) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (bf16_products() == Products::kAmx)
    return amx::gemm_panels(x, ldx, M, K, panels, bias, scale, out, N, p0, p1, act);
#endif
  const int64_t kp = (K + 1) / 2;
  const int64_t ldo = act == kSiluMul ? N / 2 : N, po = act == kSiluMul ? kNR / 2 : kNR;  // out's pitch, a panel's columns
  const int64_t row_block = block_rows(K);
  const int64_t total_lines = (panels.bytes() + 63) / 64;
  thread_local std::vector<uint32_t> packed;
  packed.resize(((std::min(M, row_block) + kMR - 1) / kMR) * kMR * kp);
  // (on FMA products, more dense rows than kRowsOnDpbf16 take the tile GEMM, gemm_by_tiles, and quantized ones all)
  int64_t packed_m0 = -1;  // the row block `packed` holds
  // panels [q0, q1) of the row block from m0; the panel after each is prefetched where it is below `last`
  const auto run = [&](int64_t m0, int64_t q0, int64_t q1, int64_t last) {
    const int64_t mc = std::min(row_block, M - m0), blocks = (mc + kMR - 1) / kMR;
    if (m0 != packed_m0) {
      pack_rows(x, ldx, m0, mc, K, packed.data());
      packed_m0 = m0;
    }
    const RowCalls<kMR> calls(mc);
    for (int64_t p = q0; p < q1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kNR, N - p * kNR));
      const uint16_t* pb = bias != nullptr ? bias + p * kNR : nullptr;
      const float* ps = scale != nullptr ? scale + p * kNR : nullptr;
      if constexpr (std::is_same_v<Panels, DensePanels>) {
        if (M == 1 && p + 1 < q1) {  // a GEMV: two panels at a time, the two after them prefetched
          const PanelOut second{panels.get(p + 1), out + (p + 1) * po,
                                static_cast<int>(std::min<int64_t>(kNR, N - (p + 1) * kNR)),
                                bias != nullptr ? bias + (p + 1) * kNR : nullptr,
                                scale != nullptr ? scale + (p + 1) * kNR : nullptr};
          const int64_t ahead = M > rows_without_prefetch() ? std::min<int64_t>(2, last - p - 2) : 0;
          row_by_two_panels(packed.data(), kp, {panels.get(p), out + p * po, cols, pb, ps}, second,
                            ahead > 0 ? panels.stored(p + 2) : nullptr, ahead > 0 ? ahead * total_lines : 0, act);
          ++p;
          continue;
        }
      }
      const Stored stored{panels.get(p)};  // int8 panels: the scratch the block's first call widens them into
      const char* next = p + 1 < last && M > rows_without_prefetch() ? panels.stored(p + 1) : nullptr;
      for (int64_t r = 0; r < blocks; ++r) {  // block r fetches its share of the next panel's lines
        const int64_t from = r * total_lines / blocks;
        const int64_t lines = next != nullptr ? (r + 1) * total_lines / blocks - from : 0;
        const int rows = calls.rows(r);
        const char* pf = next != nullptr ? next + from * 64 : nullptr;
        uint16_t* c = out + (m0 + calls.first(r)) * ldo + p * po;
        if constexpr (Panels::kWidensInFirstCall) {
          if (r == 0) {
            const auto widen = panels.widen(p);
            kTilesOf<decltype(widen)>[rows](packed.data(), &widen, kp, c, ldo, cols, pb, ps, pf, lines, act);
            continue;
          }
        }
        kTilesOf<Stored>[rows](packed.data() + r * kMR * kp, &stored, kp, c, ldo, cols, pb, ps, pf, lines, act);
      }
    }
  };
  if (claims != nullptr) {  // the next panel is prefetched past a part's end too: most parts' next is this thread's
    for (int64_t begin, end; claims->claim(begin, end);)
      run(begin / p1 * row_block, begin % p1, begin % p1 + (end - begin), p1);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += row_block) run(m0, p0, p1, p1);
}

// gemm_panels over all `num_panels` panels on every thread. Calls of more rows than kClaimRows are bound by the
// multiplies, and there the threads claim parts as they go (aserve_kernels::Claims): with a static split, each
// call ended waiting on whichever core the VM ran slower then (both threads spent ~11% of a batch-64 run in
// OpenMP's barrier). Fewer rows stream the weights, each thread its own half. Each output comes out the same
// whichever thread makes it. (AMX tiles keep the static split: amx::gemm_panels blocks its rows itself.)
template <class Panels>
void gemm_all_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const Panels& panels, const uint16_t* bias,
                     const float* scale, uint16_t* out, int64_t N, int64_t num_panels, int64_t act = kNoActivation) {
  if (M > kClaimRows && bf16_products() != Products::kAmx) {
    const int64_t row_block = block_rows(K);
    aserve_kernels::parallel_claims((M + row_block - 1) / row_block, num_panels, [&](aserve_kernels::Claims& claims) {
      gemm_panels(x, ldx, M, K, panels, bias, scale, out, N, 0, num_panels, act, &claims);
    });
    return;
  }
  aserve_kernels::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    gemm_panels(x, ldx, M, K, panels, bias, scale, out, N, begin, end, act);
  });
}

at::Tensor pack(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNR - 1) / kNR, kp = (K + 1) / 2;
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({panels, kp * 2, kNR}, w.options());  // [panels][kp][32][2], shaped as its K
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  aserve_kernels::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t k = 0; k < kp; ++k) {
        uint16_t* row = dst + (p * kp + k) * 2 * kNR;
        for (int64_t j = 0; j < kNR; ++j) {
          const int64_t o = p * kNR + j;
          for (int t = 0; t < 2; ++t) row[j * 2 + t] = o < N && 2 * k + t < K ? src[o * K + 2 * k + t] : 0;
        }
      }
    }
  });
  return packed;
}

// int8 tiles ([ceil(N/16)][K][16], quantization.int8's layout) two at a time as a bf16 panel, widened into the
// thread's scratch by the first call of each row block as it multiplies (WidenInt8): once per panel and row block, for
// all the block's rows (int8 codes are exact in bf16). A panel's row kk holds, for each of its 32 outputs, the weights
// of k = 2kk and 2kk + 1: a tile's two 16-byte rows are widened to fp32, narrowed to bf16 together and interleaved.
// Measured and not taken (Zen 5): widening the next panel a row every few k steps inside the micro-kernels running
// this one ran 1.2-1.6x slower than a separate pass; int4 panels widened by the first call as int8's are (their two
// fmsubs a pair row beside the dot products) ran slower than their separate pass, 120 bench layers at 16 rows
// 5.48/5.46 -> 5.76/6.12 ms.
// [even 0..15, odd 0..15] -> pairs (e0 o0 e1 o1 ...)
const __m512i kPairOrder = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                            21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

// Panel p, made of the 16-output tiles 2p and 2p + 1, in the thread's scratch ([kp][2] vectors: the panel's rows):
// widen(t, rows) writes tile t's half of each row kk at rows[kk * 2]; a tile past the last is zeros.
template <typename Widen>
inline const uint16_t* panel_of_tiles(int64_t p, int64_t kp, int64_t num_tiles, Widen widen) {
  thread_local std::vector<__m512i> scratch;
  scratch.resize(kp * 2);
  for (int h = 0; h < 2; ++h) {
    const int64_t t = 2 * p + h;
    if (t >= num_tiles) {
      for (int64_t kk = 0; kk < kp; ++kk) scratch[kk * 2 + h] = _mm512_setzero_si512();
    } else {
      widen(t, scratch.data() + h);
    }
  }
  return reinterpret_cast<const uint16_t*>(scratch.data());
}

// An int8 tile's row of 16 as fp32.
inline __m512 int8_row(const int8_t* row) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
}

// Pair row kk of an int8 tile ([K][16]) as bf16 pairs: rows 2kk and 2kk + 1 widened to fp32 (an odd K's last pair
// has a zero odd row). An int8 value is exact in bf16, whose bits are then the fp32's top half, so each pair word is
// the odd row's top half over the even row's: a shift and a ternary logic op, no rounding conversion, no word permute.
inline __m512i int8_pair_row(const int8_t* tile, int64_t kk, int64_t whole) {
  const __m512i even = _mm512_castps_si512(int8_row(tile + 2 * kk * 16));
  const __m512i odd = kk < whole ? _mm512_castps_si512(int8_row(tile + (2 * kk + 1) * 16)) : _mm512_setzero_si512();
  return _mm512_ternarylogic_epi32(odd, _mm512_srli_epi32(even, 16), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)),
                                   0xEC);  // (odd & mask) | even >> 16
}

// A block's first call over an int8 panel widens its two tiles as it multiplies (the conversions beside its dot
// products) and leaves each pair row in scratch, where the block's other calls read it as a stored panel.
struct WidenInt8 {
  const int8_t *t0, *t1;  // t1 null past the last tile: zeros
  int64_t whole;
  __m512i* rows;
  inline void operator()(int64_t k, __m512bh& b0, __m512bh& b1) const {
    const __m512i v0 = int8_pair_row(t0, k, whole);
    const __m512i v1 = t1 != nullptr ? int8_pair_row(t1, k, whole) : _mm512_setzero_si512();
    _mm512_store_si512(rows + 2 * k, v0);
    _mm512_store_si512(rows + 2 * k + 1, v1);
    b0 = as_bh(v0), b1 = as_bh(v1);
  }
};

struct Int8Panels {
  static constexpr bool kWidensInFirstCall = true;
  static constexpr bool kWidensAhead = true;
  const int8_t* tiles;
  int64_t K, num_tiles;
  // Pair rows [k0, k1) of panel p into rows ([kp][2] vectors), for the AMX GEMM's widening ahead.
  void widen_rows(int64_t p, int64_t k0, int64_t k1, __m512i* rows) const {
    const WidenInt8 widen_row = widen_into(p, rows);
    __m512bh b0, b1;
    for (int64_t k = k0; k < k1; ++k) widen_row(k, b0, b1);
  }
  int64_t bytes() const { return 2 * K * 16; }  // two stored tiles
  const char* stored(int64_t p) const { return reinterpret_cast<const char*>(tiles + 2 * p * K * 16); }
  static __m512i* scratch(int64_t kp) {
    thread_local std::vector<__m512i> rows;
    rows.resize(kp * 2);
    return rows.data();
  }
  const uint16_t* get(int64_t) const { return reinterpret_cast<const uint16_t*>(scratch((K + 1) / 2)); }
  WidenInt8 widen(int64_t p) const { return widen_into(p, scratch((K + 1) / 2)); }
  WidenInt8 widen_into(int64_t p, __m512i* rows) const {
    const int8_t* t1 = 2 * p + 1 < num_tiles ? tiles + (2 * p + 1) * K * 16 : nullptr;
    return {tiles + 2 * p * K * 16, t1, K / 2, rows};
  }
};

// GPTQ/AWQ int4 tiles ([ceil(N/16)][K/8] blocks of 64 bytes: int8_linear.cpp's int4 layout) two at a time as a
// bf16 panel, dequantized on the way: w = q * s - s * z with each group's s and s * z ([tiles][groups][2][16],
// bf16), rounded to bf16 once. Pair row kk = 4b + s of block b: 32-bit word j holds output j's codes for k = 2kk at
// bits 4s.. and 2kk + 1 at bits 16 + 4s..: the panel's pair.
// A code q as the float 1 + q / 16 (its bits 0x3F800000 | q << 19), made by moving the nibble to bits 19..22 and one
// vpternlogd (bits & 0x00780000 | 0x3F800000) where a shift, a mask and vcvtdq2ps did it: then
// (1 + q / 16) * 16s - (16s + s z) = q s - s z, rounded once as fmsub(q, s, s z) rounds it (16s + s z is exact in
// fp32: two bf16 values within 2^5 of each other).
template <int Shift> inline __m512 nibble_as_float(__m512i block) {
  const __m512i at = Shift >= 0 ? _mm512_slli_epi32(block, Shift) : _mm512_srli_epi32(block, -Shift);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(at, _mm512_set1_epi32(0x00780000),
                                                       _mm512_set1_epi32(0x3F800000), 0xEA));  // (a & b) | c
}

template <int S> inline void int4_pair_row(__m512i block, __m512 s16, __m512 c, __m512i* row) {
  const __m512 even = nibble_as_float<19 - 4 * S>(block), odd = nibble_as_float<3 - 4 * S>(block);
  const __m512bh words = _mm512_cvtne2ps_pbh(_mm512_fmsub_ps(odd, s16, c), _mm512_fmsub_ps(even, s16, c));
  *row = _mm512_permutexvar_epi16(kPairOrder, reinterpret_cast<const __m512i&>(words));
}

struct Int4Panels {
  static constexpr bool kWidensInFirstCall = false;
  static constexpr bool kWidensAhead = true;
  const uint8_t* tiles;
  const uint16_t* scales_zeros;
  int64_t K, group, num_tiles;
  int64_t bytes() const { return 2 * (K / 2) * 16; }  // two stored tiles
  const char* stored(int64_t p) const { return reinterpret_cast<const char*>(tiles + 2 * p * (K / 2) * 16); }
  // Tile t's pair rows [k0, k1) (whole blocks of 4) into rows[kk * 2].
  void widen_tile(int64_t t, int64_t k0, int64_t k1, __m512i* rows) const {
    const int64_t kp = K / 2, groups = K / group;
    const uint8_t* src = tiles + t * kp * 16;
    for (int64_t kk = k0; kk < k1;) {
      const int64_t g = kk * 2 / group, stop = std::min(k1, (g + 1) * group / 2);
      __m512 s, sz;
      widen_scales_zeros(scales_zeros + (t * groups + g) * 32, s, sz);
      const __m512 s16 = _mm512_mul_ps(s, _mm512_set1_ps(16.0f)), c = _mm512_add_ps(s16, sz);
      for (; kk < stop; kk += 4) {  // a block: pair rows kk..kk+3
        const __m512i block = _mm512_loadu_si512(src + kk * 16);
        int4_pair_row<0>(block, s16, c, rows + kk * 2);
        int4_pair_row<1>(block, s16, c, rows + (kk + 1) * 2);
        int4_pair_row<2>(block, s16, c, rows + (kk + 2) * 2);
        int4_pair_row<3>(block, s16, c, rows + (kk + 3) * 2);
      }
    }
  }
  const uint16_t* get(int64_t p) const {
    return panel_of_tiles(p, K / 2, num_tiles, [&](int64_t t, __m512i* rows) { widen_tile(t, 0, K / 2, rows); });
  }
  // Pair rows [k0, k1) of panel p into rows ([kp][2] vectors), for the AMX GEMM's widening ahead.
  void widen_rows(int64_t p, int64_t k0, int64_t k1, __m512i* rows) const {
    for (int h = 0; h < 2; ++h) {
      if (2 * p + h < num_tiles) {
        widen_tile(2 * p + h, k0, k1, rows + h);
      } else {
        for (int64_t kk = k0; kk < k1; ++kk) rows[kk * 2 + h] = _mm512_setzero_si512();
      }
    }
  }
};

// The bf16 GEMMs on FMA products, dense (from 2 rows), int8 and int4: a tile (16 outputs) at a time, its weights
// made fp32 in registers (dense: a panel's half, widened; int8: widened; int4: dequantized with one fmsub, fp32, not
// rounded to bf16 as the panels' are) and multiplied at once by up to kRowsAtOnce rows, the tile widened again for
// each further call (from L1, where it is prefetched: a tile is K x 16 bf16, K x 16 or K / 2 x 16 bytes).
// Widening panels into scratch for the dense micro-kernel (as on vdpbf16ps) was half of a 16-row int4 product on an
// Intel Xeon without AMX (2 threads): writing a panel's bf16 pairs and reading them back cost as much as its
// products. In registers a tile's pair row costs four widening ops (int4: and two fmsubs) beside its 2 x 16 FMAs at
// 16 rows. The bench model's 120 int4 layers (ms, panels against tiles): 16 rows 40.3 against 20.0 (dense 21.7 / 21.3
// in the same runs), 64 rows 102-109 against 67-73, 512 rows 694-772 against 527-552, 2048 rows 2985 against 2298.
// Each output's sums are fp32, in k order. Up to 24 rows a call (24 sums and a pair row's two vectors in registers;
// the loops over rows unrolled up to 32, where an unroll of 16 had kept 24 rows' sums on the stack): a tile's widening
// is shared by more FMAs where 16 split the rows badly (20 rows as one call, not 10 + 10; 64 as 24 + 24 + 16). The
// bench model's 120 layers, int8 and GPTQ (group 64), bf16, 2 threads, both ways alternated in one process (30 rounds,
// best, ms; an Intel Xeon without AMX tiles): 20 rows int8 21.4 -> 18.7, GPTQ 20.1 -> 17.8; 24 rows 23.4 -> 21.6,
// 22.3 -> 20.3; 40 rows 36.1 -> 34.2, 36.1 -> 33.8; 64 rows 54.2 -> 52.6, 54.2 -> 52.8; 32 rows (16 + 16 either way)
// level. Dense weights took the panels' 12 x 32 micro-kernel on FMAs until its compiled loop turned out to copy
// registers (a vmovaps for every two of its FMAs, ~73% of the FMA ports' peak in L1 against ~80% for a 24 x 16 tile;
// an Intel Xeon with AVX512-BF16, no AMX tiles): on the tiles, batch-64 decode steps of the bench model ran 101.4 ms
// against 112.3 (alternated in one engine), its head's [64, 576] x [576, 49152] product 1.07-1.14x as fast.
constexpr int kRowsAtOnce = 24;

// Rows [0, rows) of x (bf16, ldx apart) as fp32 [2 ceil(K / 2)][rows]: x's transpose, 16 rows by 16 k at a time (an
// odd K's last row zeros, for the last pair row's odd half).
inline void transpose_rows_fp32(const uint16_t* x, int64_t ldx, int rows, int64_t K, float* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int m0 = 0; m0 < rows; m0 += 16) {
      const int n = std::min(16, rows - m0);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < n ? _mm512_castps_si512(widen(x + (m0 + i) * ldx + k)) : _mm512_setzero_si512();
      transpose_16x16(r);
      const auto lanes = static_cast<__mmask16>((1u << n) - 1);
      for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(out + (k + j) * rows + m0, lanes, _mm512_castsi512_ps(r[j]));
    }
  }
  for (; k < K; ++k) {
    for (int m = 0; m < rows; ++m) {
      const uint32_t bits = static_cast<uint32_t>(x[m * ldx + k]) << 16;
      std::memcpy(out + k * rows + m, &bits, sizeof bits);
    }
  }
  if (K % 2 != 0) std::fill(out + K * rows, out + (K + 1) * rows, 0.f);
}

// How many pair rows ahead a tile's own weights are prefetched into L1 (DenseTile, Int8Tile, Int4Tile): a call after
// a row block's first finds them in L2. Its first call also fetches the next tile into L2. For int8 and int4 tiles
// (bench model, bf16, decode steps alternated in one engine, Intel Xeon without AMX tiles, 2 threads): int8 batch 64
// 102.5 against 105.2 ms, GPTQ batch 64 97.3 against 99.0, batch 16 24.3 against 25.7.
constexpr int64_t kTileAhead = 8;

// A tile's pair rows as fp32 (even k, odd k), handed to f(kk, even, odd) in order: GPTQ/AWQ codes in 64-byte blocks
// (a block's pair row s: int4_pair_row's nibbles), dequantized with each group's s and s * z.
struct Int4Tile {
  const uint8_t* codes;  // [K / 2][16]
  const uint16_t* sz;    // [groups][2][16] fp16 scales and zero points
  int64_t K, group;
  const char* next;      // the next tile's codes, fetched into L2 a line a block; or null
  template <class F> inline void pair_rows(F&& f) const {
    for (int64_t g = 0, kk = 0; g < K / group; ++g) {
      __m512 s, s_z;
      widen_scales_zeros(sz + g * 32, s, s_z);
      const __m512 s16 = _mm512_mul_ps(s, _mm512_set1_ps(16.0f)), cz = _mm512_add_ps(s16, s_z);
      const auto w = [&](__m512 code) { return _mm512_fmsub_ps(code, s16, cz); };
      for (const int64_t stop = (g + 1) * group / 2; kk < stop; kk += 4) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + (kk + kTileAhead) * 16), _MM_HINT_T0);
        if (next != nullptr) _mm_prefetch(next + kk * 16, _MM_HINT_T1);
        const __m512i block = _mm512_loadu_si512(codes + kk * 16);
        f(kk, w(nibble_as_float<19>(block)), w(nibble_as_float<3>(block)));
        f(kk + 1, w(nibble_as_float<15>(block)), w(nibble_as_float<-1>(block)));
        f(kk + 2, w(nibble_as_float<11>(block)), w(nibble_as_float<-5>(block)));
        f(kk + 3, w(nibble_as_float<7>(block)), w(nibble_as_float<-9>(block)));
      }
    }
  }
};

// int8 rows ([K][16]) widened (an odd K's last pair row has a zero odd half); the scales come after the sums.
struct Int8Tile {
  const int8_t* rows;
  int64_t K;
  const char* next;  // the next tile's rows, fetched into L2 a line every two pair rows; or null
  template <class F> inline void pair_rows(F&& f) const {
    int64_t kk = 0;
    for (; 2 * kk + 1 < K; ++kk) {
      if (kk % 2 == 0) {  // a line every two pair rows
        _mm_prefetch(reinterpret_cast<const char*>(rows + 2 * (kk + kTileAhead) * 16), _MM_HINT_T0);
        if (next != nullptr) _mm_prefetch(next + kk * 32, _MM_HINT_T1);
      }
      f(kk, int8_row(rows + 2 * kk * 16), int8_row(rows + (2 * kk + 1) * 16));
    }
    if (K % 2 != 0) f(kk, int8_row(rows + 2 * kk * 16), _mm512_setzero_ps());
  }
};

// acc[m] += the tile's products with row m of x (fp32 [2 ceil(K / 2)][MR]: transpose_rows_fp32), a pair row's odd k
// first, as vdpbf16ps adds them: exact products (bf16 and int8 weights) give their bits.
template <int MR, class Tile>
inline void tile_sums(const Tile& tile, const float* x, __m512 (&acc)[MR]) {
  __m512 r[MR];  // a local copy: sums kept in the caller's array may be stored back on every step (see micro_kernel)
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m) r[m] = acc[m];
  tile.pair_rows([&](int64_t kk, __m512 even, __m512 odd) __attribute__((always_inline)) {
    const float* xk = x + 2 * kk * MR;  // the MR rows' x[2kk], then their x[2kk + 1]
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      r[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[MR + m]), odd, r[m]);
      r[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), even, r[m]);
    }
  });
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m) acc[m] = r[m];
}

inline void store_tile_row(__m512 v, uint16_t* c, int cols) {
  const __m256bh words = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(c, static_cast<__mmask16>((1u << cols) - 1), reinterpret_cast<const __m256i&>(words));
}

// Tile t's 16 biases (`cols` real, the rest zero) in fp32; zeros without a bias.
inline __m512 tile_bias(const uint16_t* bias, int64_t t, int cols) {
  alignas(64) uint16_t edge[16] = {};
  if (bias != nullptr) std::memcpy(edge, bias + t * 16, cols * sizeof(uint16_t));
  return widen(edge);
}

// What a call multiplies: its rows' fp32 transpose x, their outputs c (ldc apart), and the work item (a tile, or
// for SiLU-and-mul a gate tile and its up tile).
struct TileCall {
  const float* x;
  uint16_t* c;
  int64_t ldc, item;
  bool first;  // the item's first call in its row block
  bool more;   // and calls after this one in the block
};

// A quantized tile's pair rows kept as fp32 ([kp][2][16]: even, odd) by the first of a row block's calls (Keeping),
// read back by the others (KeptTile) in place of widening (int8: four ops a pair row) or dequantizing (int4: six)
// them again: the same values, so the same bits. Batch-64 decode steps of the bench model (bf16, alternated in one
// engine, Intel Xeon without AMX tiles, 2 threads; 64 rows are calls of 24, 24 and 16): int8 101.5 against 106.6 ms,
// GPTQ 96.1 against 98.1. Dense tiles (two ops a pair row) ran slower kept: 104.0 against 102.5.
struct KeptTile {
  const float* w;
  int64_t kp;
  template <class F> inline void pair_rows(F&& f) const {
    for (int64_t kk = 0; kk < kp; ++kk) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kk + kTileAhead) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kk + kTileAhead) * 32 + 16), _MM_HINT_T0);
      f(kk, _mm512_load_ps(w + kk * 32), _mm512_load_ps(w + kk * 32 + 16));
    }
  }
};

template <class Tile>
struct Keeping {
  const Tile& tile;
  float* out;
  template <class F> inline void pair_rows(F&& f) const {
    tile.pair_rows([&](int64_t kk, __m512 even, __m512 odd) __attribute__((always_inline)) {
      _mm512_store_ps(out + kk * 32, even);
      _mm512_store_ps(out + kk * 32 + 16, odd);
      f(kk, even, odd);
    });
  }
};

// The thread's scratch for kept tiles: `slot` 0 or 1 (a SiLU-and-mul item's gate and up), `floats` each.
inline float* kept_scratch(int slot, int64_t floats) {
  thread_local std::vector<float> scratch[2];  // 16 floats over, to start on a 64-byte line
  if (static_cast<int64_t>(scratch[slot].size()) < floats + 16) scratch[slot].resize(floats + 16);
  const auto at = reinterpret_cast<uintptr_t>(scratch[slot].data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t{63});
}

// tile_sums over `tile` (kp pair rows), kept in the thread's `slot` for the block's later calls where there are any.
template <int MR, class Tile>
inline void tile_sums_kept(const Tile& tile, int64_t kp, const TileCall& call, int slot, __m512 (&acc)[MR]) {
  if (call.first && !call.more) return tile_sums<MR>(tile, call.x, acc);
  float* kept = kept_scratch(slot, kp * 32);
  if (call.first) return tile_sums<MR>(Keeping<Tile>{tile, kept}, call.x, acc);
  tile_sums<MR>(KeptTile{kept, kp}, call.x, acc);
}

// int4: tile `item`'s 16 outputs (`cols` real), from the bias.
struct Int4Items {
  const uint8_t* tiles;
  const uint16_t* sz;
  const uint16_t* bias;
  int64_t K, group, N, act;
  int64_t count() const { return act == kSiluMul ? N / 32 : (N + 15) / 16; }
  int64_t tiles_count() const { return (N + 15) / 16; }
  template <int MR> void sums(int64_t t, const TileCall& call, int cols, __m512 (&acc)[MR]) const {
    const __m512 b = tile_bias(bias, t, cols);
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) acc[m] = b;
    const char* next =
        call.first && t + 1 < tiles_count() ? reinterpret_cast<const char*>(tiles + (t + 1) * (K / 2) * 16) : nullptr;
    tile_sums_kept<MR>(Int4Tile{tiles + t * (K / 2) * 16, sz + t * (K / group) * 32, K, group, next}, K / 2, call,
                       static_cast<int>(t % 2), acc);
  }
  template <int MR> void run(const TileCall& call) const {
    write_item<MR>(call, N, act, [&](int64_t t, int cols, __m512 (&acc)[MR]) { sums<MR>(t, call, cols, acc); });
  }
};

// A call's outputs of its item: tile `item`'s 16 (`cols` real; GELU where `act` asks), or with SiLU-and-mul (gate |
// up tiles alternating) 16 columns of silu(gate) * up from tiles 2 item and 2 item + 1. sums(t, cols, acc) makes tile
// t's MR rows of fp32 sums.
template <int MR, class Sums>
inline void write_item(const TileCall& call, int64_t N, int64_t act, const Sums& sums) {
  __m512 acc[MR];
  if (act != kSiluMul) {
    const int cols = static_cast<int>(std::min<int64_t>(16, N - call.item * 16));
    sums(call.item, cols, acc);
    if (act != kNoActivation) {
      for (int m = 0; m < MR; ++m) acc[m] = gelu(aserve_kernels::fVec(acc[m]), act);
    }
    for (int m = 0; m < MR; ++m) store_tile_row(acc[m], call.c + m * call.ldc + call.item * 16, cols);
    return;
  }
  __m512 gates[MR];
  sums(2 * call.item, 16, gates);
  sums(2 * call.item + 1, 16, acc);
  for (int m = 0; m < MR; ++m) store_tile_row(silu_times(gates[m], acc[m]), call.c + m * call.ldc + call.item * 16, 16);
}

// int8: tile `item`'s sums scaled per column, then the bias added; with SiLU-and-mul (gate | up tiles alternating,
// quantization.int8's gated tiling) item p's gates are tile 2p and its ups 2p + 1, out 16 columns of silu(gate) * up.
struct Int8Items {
  const int8_t* tiles;
  const float* scale;  // fp32, per column (zero-padded to whole panels)
  const uint16_t* bias;
  int64_t K, N, act;
  int64_t count() const { return act == kSiluMul ? N / 32 : (N + 15) / 16; }
  int64_t tiles_count() const { return (N + 15) / 16; }
  template <int MR> void scaled_sums(int64_t t, const TileCall& call, int cols, __m512 (&acc)[MR]) const {
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const char* next =
        call.first && t + 1 < tiles_count() ? reinterpret_cast<const char*>(tiles + (t + 1) * K * 16) : nullptr;
    tile_sums_kept<MR>(Int8Tile{tiles + t * K * 16, K, next}, (K + 1) / 2, call, static_cast<int>(t % 2), acc);
    const __m512 s = _mm512_loadu_ps(scale + t * 16), b = tile_bias(bias, t, cols);
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(acc[m], s, b);
  }
  template <int MR> void run(const TileCall& call) const {
    write_item<MR>(call, N, act, [&](int64_t t, int cols, __m512 (&acc)[MR]) { scaled_sums<MR>(t, call, cols, acc); });
  }
};

// A dense panel's 16-column half as a tile: pair row kk's 16 pairs of bf16 (64 bytes, 128 bytes apart: the other
// half's between), widened to fp32 (a bf16 is the top half of its fp32). Its own pair rows are prefetched into L1
// kTileAhead rows ahead (without it a tenth of a 64-row product's samples sat on their loads). `next` (for the call
// that first reads this half in its row block) is where the next panel's matching half starts, fetched into L2 a
// line a step.
struct DenseTile {
  const uint16_t* w;  // the half's first pair row
  int64_t kp;
  const char* next;   // or null
  template <class F> inline void pair_rows(F&& f) const {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t kk = 0; kk < kp; ++kk) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kk + kTileAhead) * 2 * kNR), _MM_HINT_T0);
      if (next != nullptr) _mm_prefetch(next + kk * 64, _MM_HINT_T1);
      const __m512i p = _mm512_load_si512(w + kk * 2 * kNR);
      f(kk, _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)), _mm512_castsi512_ps(_mm512_and_si512(p, high)));
    }
  }
};

// Dense bf16 panels ([ceil(N/32)][kp][32][2]) on FMAs: tile t is panel t / 2's half t % 2, from the bias, then GELU
// where asked; with SiLU-and-mul item p is panel p, its gates in half 0 and their ups in half 1 (pack_gated_weight),
// out 16 columns of silu(gate) * up. Each output's sums are fp32 FMAs in k order, a pair row's odd k first: the bits
// of vdpbf16ps, which multiplies one row.
struct DenseItems {
  const uint16_t* w;
  const uint16_t* bias;
  int64_t kp, N, act;
  int64_t count() const { return act == kSiluMul ? N / 32 : (N + 15) / 16; }
  int64_t panels() const { return (N + kNR - 1) / kNR; }
  template <int MR> void sums(int64_t t, const TileCall& call, int cols, __m512 (&acc)[MR]) const {
    const __m512 b = tile_bias(bias, t, cols);
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) acc[m] = b;
    const int64_t p = t / 2, half = t % 2;
    const char* next = call.first && p + 1 < panels()
                           ? reinterpret_cast<const char*>(w + (p + 1) * kp * 2 * kNR) + half * kp * 64 : nullptr;
    tile_sums<MR>(DenseTile{w + p * kp * 2 * kNR + half * 16 * 2, kp, next}, call.x, acc);
  }
  template <int MR> void run(const TileCall& call) const {
    write_item<MR>(call, N, act, [&](int64_t t, int cols, __m512 (&acc)[MR]) { sums<MR>(t, call, cols, acc); });
  }
};

template <class Items, int... MR>
constexpr std::array<void (Items::*)(const TileCall&) const, sizeof...(MR) + 1> rows_table(
    std::integer_sequence<int, MR...>) {
  return {nullptr, &Items::template run<MR + 1>...};
}

// The tile GEMM: row blocks whose fp32 rows fit half of L2 (block_bytes), each against all of a thread's items in
// calls of up to kRowsAtOnce rows: an item's weights are read once per block, the block's rows once per item. Each
// call's rows are transposed once, by whichever thread takes them first (the threads take them in turn before their
// items, and wait on a block's before multiplying it): made by the calling thread alone before the region, they held
// the others back (batch-64 decode steps of the bench model 98.1 ms against 97.1, alternated in one engine).
template <class Items>
void gemm_by_tiles(const GemmArgs& args, const Items& items, uint16_t* out, int64_t ldo) {
  static constexpr auto kRuns = rows_table<Items>(std::make_integer_sequence<int, kRowsAtOnce>());
  const int64_t M = args.M, K = args.K, K2 = (K + 1) / 2 * 2, ldx = args.rows.stride(0);
  const int64_t row_block = std::max<int64_t>(kRowsAtOnce, block_bytes() / (K2 * 4) / kRowsAtOnce * kRowsAtOnce);
  const int64_t calls_per_block = RowCalls<kRowsAtOnce>(std::min(row_block, M)).count;  // all but the last block's
  const int64_t num_calls = (M / row_block) * calls_per_block +
                            (M % row_block != 0 ? RowCalls<kRowsAtOnce>(M % row_block).count : 0);
  thread_local std::vector<float> rows;  // each call's rows as [K2][rows] fp32, one call after the other
  rows.resize(M * K2);
  thread_local std::vector<std::atomic<int>> state;  // per call: 0 to take, 1 being transposed, 2 ready
  if (static_cast<int64_t>(state.size()) < num_calls) state = std::vector<std::atomic<int>>(num_calls);
  for (int64_t c = 0; c < num_calls; ++c) state[c].store(0, std::memory_order_relaxed);
  const auto* x = reinterpret_cast<const uint16_t*>(args.rows.data_ptr());
  float* xt = rows.data();  // (the workers' own `rows` are other vectors)
  std::atomic<int>* ready = state.data();
  const auto transpose_all = [&] {  // every call nobody has taken yet
    for (int64_t m0 = 0, c = 0; m0 < M; m0 += row_block) {
      const RowCalls<kRowsAtOnce> calls(std::min(row_block, M - m0));
      for (int64_t r = 0; r < calls.count; ++r, ++c) {
        int expected = 0;
        if (ready[c].load(std::memory_order_relaxed) != 0 ||
            !ready[c].compare_exchange_strong(expected, 1, std::memory_order_relaxed))
          continue;
        const int64_t first = m0 + calls.first(r);
        transpose_rows_fp32(x + first * ldx, ldx, calls.rows(r), K, xt + first * K2);
        ready[c].store(2, std::memory_order_release);
      }
    }
  };
  const auto run = [&](int64_t m0, int64_t begin, int64_t end) {  // items [begin, end) of the block from m0
    const RowCalls<kRowsAtOnce> calls(std::min(row_block, M - m0));
    const int64_t c0 = m0 / row_block * calls_per_block;
    for (int64_t r = 0; r < calls.count; ++r) {
      for (uint32_t spins = 0; ready[c0 + r].load(std::memory_order_acquire) != 2;) aserve_kernels::spin_pause(spins);
    }
    for (int64_t item = begin; item < end; ++item) {
      for (int64_t r = 0; r < calls.count; ++r) {
        const int64_t first = m0 + calls.first(r);
        const TileCall call{xt + first * K2, out + first * ldo, ldo, item, r == 0, r + 1 < calls.count};
        (items.*kRuns[calls.rows(r)])(call);
      }
    }
  };
  const int64_t count = items.count();
  if (M > kClaimRows) {  // claimed as they go, as gemm_all_panels's
    aserve_kernels::parallel_claims((M + row_block - 1) / row_block, count, [&](aserve_kernels::Claims& claims) {
      transpose_all();
      for (int64_t begin, end; claims.claim(begin, end);)
        run(begin / count * row_block, begin % count, begin % count + (end - begin));
    });
    return;
  }
  aserve_kernels::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    transpose_all();
    for (int64_t m0 = 0; m0 < M; m0 += row_block) run(m0, begin, end);
  });
}

// `act`: kSiluMul for a gate | up weight tiled 16 gates then their 16 ups (quantization.int8's gated tiling), so
// that a panel's two tiles are a gate and its up, as pack_gated_weight's rows are for the dense GEMM.
void gemm_int8(const GemmArgs& args, const at::Tensor& tiled, const float* scale, at::Tensor& out, int64_t act) {
  if (bf16_products() == Products::kFma) {
    const Int8Items items{tiled.data_ptr<int8_t>(), scale, static_cast<const uint16_t*>(args.bias), args.K, args.N, act};
    return gemm_by_tiles(args, items, reinterpret_cast<uint16_t*>(out.data_ptr()), out.size(-1));
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(args.rows.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Int8Panels panels{tiled.data_ptr<int8_t>(), args.K, tiled.size(0)};
  gemm_all_panels(xp, args.rows.stride(0), args.M, args.K, panels, static_cast<const uint16_t*>(args.bias), scale, o,
                  args.N, (args.N + kNR - 1) / kNR, act);
}

void gemm_int4(const GemmArgs& args, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
               at::Tensor& out, int64_t act) {
  if (bf16_products() == Products::kFma) {
    const Int4Items items{tiled.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr()),
                          static_cast<const uint16_t*>(args.bias), args.K, group, args.N, act};
    return gemm_by_tiles(args, items, reinterpret_cast<uint16_t*>(out.data_ptr()), out.size(-1));
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(args.rows.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Int4Panels panels{tiled.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr()),
                          args.K, group, tiled.size(0)};
  gemm_all_panels(xp, args.rows.stride(0), args.M, args.K, panels, static_cast<const uint16_t*>(args.bias), nullptr, o,
                  args.N, (args.N + kNR - 1) / kNR, act);
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                int64_t out_features, int64_t act) {
  TORCH_CHECK(act != kSiluMul || (out_features % kNR == 0 && x.size(-1) > 0),
              "gemm_packed: SiLU-and-mul needs a gate | up weight of whole 32-row panels (2 x a multiple of 16)");
  GemmArgs args = gemm_args(x, packed, bias, out_features, (x.size(-1) + 1) / 2 * 2, kNR,
                            "[ceil(out/32), 2 * ceil(in/2), 32] (bf16)", act == kSiluMul ? out_features / 2 : -1);
  if (args.M == 0 || args.N == 0 || args.K == 0) return args.out;
  const auto* xp = reinterpret_cast<const uint16_t*>(args.rows.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* b = static_cast<const uint16_t*>(args.bias);
  auto* o = reinterpret_cast<uint16_t*>(args.out.data_ptr());
  if (bf16_products() == Products::kFma && args.M > kRowsOnDpbf16) {
    gemm_by_tiles(args, DenseItems{w, b, (args.K + 1) / 2, args.N, act}, o, args.out.size(-1));
    return args.out;
  }
  const DensePanels panels{w, (args.K + 1) / 2};
  gemm_all_panels(xp, args.rows.stride(0), args.M, args.K, panels, b, nullptr, o, args.N, packed.size(0), act);
  return args.out;
}

}  // namespace bf16
#endif  // __AVX512BF16__ && __AVX512BW__

// int8 tiles as fp32 panels: the tile layout is the fp32 panel's ([ceil(N/16)][K][16]), so a panel's k rows are its
// tile's, widened into the thread's scratch once per (k chunk, row block) and multiplied by all the block's rows.
struct alignas(64) Line { float v[kNR]; };

// The calling thread's scratch for `kc` widened k steps of a panel (slot 1: the second panel of a 512-bit pair),
// shared by the panel sources below that widen (Int8Panels, Bf16PanelsWidened, Int4Panels). Written through the
// returned pointer, not the vector: a store through the vector's operator[] may alias it, and GCC then rereads the
// thread_local (a __tls_get_addr call) between every two stores.
inline Line* scratch_lines(int slot, int64_t kc) {
  thread_local std::vector<Line> scratches[2];
  std::vector<Line>& scratch = scratches[slot];
  scratch.resize(kc);
  return scratch.data();
}
// Each code is widened times its output's scale (one fp32 rounding of q * s, as Int4Panels dequantizes), so the
// GEMM's bias and claims apply as for dense panels: scaling the outputs after, in each thread's own columns, kept
// gemm_int8 on a static split of the panels, which on an AVX2-only AMD EPYC Zen 3 (avx2 fma, 2 threads, fp32, at
// 2500964) ran the bench model's 120 int8 layers at 64 rows 0.66x the dense bf16 panels' speed (1.02x since 6a6cf76).
struct Int8Panels {
  const int8_t* tiles;
  const float* scale;  // per output, zero past N to whole panels
  int64_t K;
  static constexpr int64_t kBytesPerK = kNR;
  const char* stored(int64_t p, int64_t k0) const { return reinterpret_cast<const char*>(tiles + (p * K + k0) * kNR); }
  const float* get(int64_t p, int64_t k0, int64_t kc, int slot = 0) const {
    Line* lines = scratch_lines(slot, kc);
    const int8_t* src = tiles + (p * K + k0) * kNR;
    const float* s = scale + p * kNR;
#if defined(__AVX512F__)
    const __m512 s0 = _mm512_loadu_ps(s);
#else
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
#endif
    for (int64_t k = 0; k < kc; ++k) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kNR));
#if defined(__AVX512F__)
      _mm512_store_ps(lines[k].v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s0));
#else
      _mm256_store_ps(lines[k].v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s0));
      _mm256_store_ps(lines[k].v + 8,
                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), s1));
#endif
    }
    return lines[0].v;
  }
};

// An fp32 model's weights that are bf16 values (a bf16 checkpoint run in fp32, what dtype=auto picks on a CPU
// without AVX512-BF16), stored as bf16 panels in the fp32 layout ([ceil(N/16)][K][16]): the fp32 panels' products
// bit for bit, from half the bytes, which is what a decode step's GEMMs wait on. A row block of one micro-kernel call
// widens them as it loads them (load_weights: a shift); larger ones widen each panel into the thread's scratch once
// (Bf16PanelsWidened) for all their calls, where the shifts beside the FMAs cost: the bench model's decode steps at
// 64 rows, the weights widened in the micro-kernel, took 368.6 against 339.3 ms with fp32 panels (AMD EPYC Zen 3,
// avx2, 2 threads; tools/step_ab.py --compare bf16-panels). Widened into scratch at one row, 120 bench-model layers
// took longer than the fp32 panels.
struct Bf16Panels {
  const uint16_t* w;
  int64_t K;
  static constexpr int64_t kBytesPerK = kNR * 2;
  const char* stored(int64_t p, int64_t k0) const { return reinterpret_cast<const char*>(w + (p * K + k0) * kNR); }
  const uint16_t* get(int64_t p, int64_t k0, int64_t, int = 0) const { return w + (p * K + k0) * kNR; }
};
struct Bf16PanelsWidened : Bf16Panels {
  const float* get(int64_t p, int64_t k0, int64_t kc, int slot = 0) const {
    Line* lines = scratch_lines(slot, kc);
    const uint16_t* src = Bf16Panels::get(p, k0, kc);
    for (int64_t k = 0; k < kc; ++k) {
#if defined(__AVX512F__)
      _mm512_store_ps(lines[k].v, wide::load_weights(src + k * kNR));
#else
      load_weights(src + k * kNR, *reinterpret_cast<__m256*>(lines[k].v), *reinterpret_cast<__m256*>(lines[k].v + 8));
#endif
    }
    return lines[0].v;
  }
};

at::Tensor gemm_fp32_bf16_stored(GemmArgs& args, const at::Tensor& packed, int64_t act) {
  TORCH_CHECK(args.rows.scalar_type() == at::kFloat, "gemm_packed: bf16 weights in the fp32 layout need fp32 x; got ",
              args.rows.scalar_type());
  if (args.M == 0 || args.N == 0 || args.K == 0) return args.out;
  const Bf16Panels panels{reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), args.K};
#if defined(__AVX512F__)
  constexpr int64_t kCallRows = wide::kMR;
#else
  constexpr int64_t kCallRows = kMR;
#endif
  args.M <= kCallRows ? run_fp32(args, panels, packed.size(0), act)
                      : run_fp32(args, Bf16PanelsWidened{panels}, packed.size(0), act);
  return args.out;
}

// torch.ops.aserve.gemm_int8: x @ (q * scale)^T + bias for int8 weights in int8_linear's tiles, as a GEMM: for the
// batches too large for int8_linear (which widens every weight once per call and multiplies it by each row in fp32),
// each panel is widened once per row block into the dense GEMM's layout and run by its micro-kernel (bf16 dot
// products with AVX512-BF16). Sums are scaled per output column in fp32, then the bias added.
at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t act) {
  TORCH_CHECK(x.dim() >= 1, "gemm_int8: x must be [..., in_features]");
  TORCH_CHECK(tiled.dim() == 3 && tiled.is_contiguous() && tiled.scalar_type() == at::kChar &&
                  tiled.size(1) == x.size(-1) && tiled.size(2) == kNR &&
                  tiled.size(0) == (out_features + kNR - 1) / kNR,
              "gemm_int8: weight must be contiguous int8 tiles [ceil(out/16), in, 16] matching x");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.size(0) == out_features &&
                  scales.scalar_type() == x.scalar_type(),
              "gemm_int8: scales must be a contiguous [out] vector of x's dtype");
  TORCH_CHECK(act == kNoActivation || act == kSiluMul, "gemm_int8: the activation is none or SiLU-and-mul");
  check_silu_mul(x, out_features, act, "gemm_int8");
  GemmArgs args = gemm_args(x, bias, out_features, act == kSiluMul ? out_features / 2 : -1);
  const int64_t M = args.M, K = args.K, N = args.N;
  at::Tensor out = args.out;
  if (M == 0 || N == 0 || K == 0) return out;
  // fp32 scales for whole panels of either GEMM, widened here: scales.to(kFloat) was an ATen op a call (a decode
  // step of the bench model makes 120 of these calls; ~13 us each in the profiler, 2.6% of a 64 x 128/128 run)
  std::vector<float> scale(((N + 31) / 32) * 32, 0.f);
  if (scales.scalar_type() == at::kFloat) {
    std::memcpy(scale.data(), scales.data_ptr<float>(), N * sizeof(float));
  } else {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(scales.scalar_type(), "gemm_int8", [&] {
      const scalar_t* from = scales.data_ptr<scalar_t>();
      for (int64_t j = 0; j < N; ++j) scale[j] = static_cast<float>(from[j]);
    });
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    bf16::gemm_int8(args, tiled, scale.data(), out, act);
    return out;
  }
#endif
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemm_int8: x must be fp32, or bf16 on a CPU with AVX512-BF16; got ",
              x.scalar_type());
  run_fp32(args, Int8Panels{tiled.data_ptr<int8_t>(), scale.data(), K}, tiled.size(0), act);
  return out;
}

// int4 tiles as fp32 panels ([K][16] rows), dequantized: row k holds q[k] * s - s * z of its group (fp32 s and s * z).
struct Int4Panels {
  const uint8_t* tiles;
  const c10::Half* scales_zeros;
  int64_t K, group;
  static constexpr int64_t kBytesPerK = kNR / 2;
  const char* stored(int64_t p, int64_t k0) const {
    return reinterpret_cast<const char*>(tiles + (p * (K / 2) + k0 / 2) * kNR);
  }
  const float* get(int64_t p, int64_t k0, int64_t kc, int slot = 0) const {
    Line* lines = scratch_lines(slot, kc);
    const int64_t groups = K / group;
    const uint8_t* src = tiles + p * (K / 2) * kNR;
    alignas(64) float sz[2 * kNR];  // the group's s, then s * z
    for (int64_t k = k0, g = -1; k < k0 + kc; ++k) {  // k: pair row k / 2 = 4b + s of block b, half k & 1 of each word
      if (k / group != g) g = k / group, aserve_kernels::load_scales_zeros(scales_zeros + (p * groups + g) * 2 * kNR, sz);
      const uint8_t* block = src + (k / 8) * 4 * kNR;
      const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(16 * (k & 1) + 4 * ((k / 2) & 3)));
#if defined(__AVX512F__)
      const __m512i b = _mm512_loadu_si512(block);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(b, shift), _mm512_set1_epi32(15)));
      _mm512_store_ps(lines[k - k0].v, _mm512_fmsub_ps(q, _mm512_loadu_ps(sz), _mm512_loadu_ps(sz + kNR)));
#else
      for (int half = 0; half < 2; ++half) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * half));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b, shift), _mm256_set1_epi32(15)));
        _mm256_store_ps(lines[k - k0].v + 8 * half,
                        _mm256_fmsub_ps(q, _mm256_loadu_ps(sz + 8 * half), _mm256_loadu_ps(sz + kNR + 8 * half)));
      }
#endif
    }
    return lines[0].v;
  }
};

// torch.ops.aserve.gemm_int4: x @ W^T + bias for GPTQ/AWQ weights in int4 tiles with per-group scales and zero terms,
// as a GEMM (the batches too large for int4_linear): each panel dequantized once per row block into the dense GEMM's
// layout (bf16 on FMA products: each tile in registers, gemm_by_tiles). bf16 with AVX512-BF16 (the weights
// rounded to bf16, as a dequantized bf16 layer's are, except on FMA products), else fp32.
at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
                     const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t act) {
  TORCH_CHECK(x.dim() >= 1, "gemm_int4: x must be [..., in_features]");
  const int64_t K = x.size(-1);
  aserve_kernels::check_int4_weights("gemm_int4", x, K, tiled, scales_zeros, group, out_features);
  TORCH_CHECK(act == kNoActivation || act == kSiluMul, "gemm_int4: the activation is none or SiLU-and-mul");
  check_silu_mul(x, out_features, act, "gemm_int4");
  GemmArgs args = gemm_args(x, bias, out_features, act == kSiluMul ? out_features / 2 : -1);
  at::Tensor out = args.out;
  if (args.M == 0 || args.N == 0 || K == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    bf16::gemm_int4(args, tiled, scales_zeros, group, out, act);
    return out;
  }
#endif
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemm_int4: x must be fp32, or bf16 on a CPU with AVX512-BF16; got ",
              x.scalar_type());
  run_fp32(args, Int4Panels{tiled.data_ptr<uint8_t>(), scales_zeros.data_ptr<c10::Half>(), K, group}, tiled.size(0),
           act);
  return out;
}

// The ops take either dtype: fp32 everywhere this file builds, bf16 where the CPU has AVX512-BF16.
at::Tensor pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_gemm_weight: weight must be [out, in]");
  if (weight.scalar_type() == at::kFloat) return pack_fp32(weight);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (weight.scalar_type() == at::kBFloat16) return bf16::pack(weight);
#endif
  TORCH_CHECK(false, "pack_gemm_weight: weight must be fp32, or bf16 on a CPU with AVX512-BF16; got ",
              weight.scalar_type());
}

// An fp32 weight's panels for the fp32 GEMM, stored as bf16 (Bf16Panels): for weights that are bf16 values, which
// it keeps exactly (others it rounds to nearest even).
at::Tensor pack_gemm_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_gemm_weight_bf16: weight must be fp32 [out, in]");
  return pack_fp32(weight).to(at::kBFloat16);
}

// `activation`: an Activation applied to the outputs as they are written (0: none).
at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t activation) {
  TORCH_CHECK(activation >= kNoActivation && activation <= kSiluMul,
              "gemm_packed: activation must be 0 (none), 1 (GELU, erf), 2 (GELU, tanh) or 3 (SiLU and mul); got ",
              activation);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (packed.scalar_type() == at::kBFloat16 && x.scalar_type() != at::kFloat)
    return bf16::gemm(x, packed, bias, out_features, activation);
#endif
  return gemm_fp32(x, packed, bias, out_features, activation);
}

// What multiplies the bf16 GEMM's panels: "amx", "dpbf16" or "fma" (bf16::products), which `set` changes for the
// process first (tests, A/B runs; "amx" only where the tiles are lent). "" where the bf16 GEMM is not built.
std::string gemm_bf16_products(const std::string& set) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  using bf16::Products;
  TORCH_CHECK(set.empty() || set == "dpbf16" || set == "fma" || (set == "amx" && bf16::amx_tiles()),
              "gemm_bf16_products: expected dpbf16, fma", bf16::amx_tiles() ? " or amx" : "", "; got ", set);
  if (!set.empty())
    bf16::bf16_products() = set == "amx" ? Products::kAmx : set == "fma" ? Products::kFma : Products::kDpbf16;
  const Products now = bf16::bf16_products();
  return now == Products::kAmx ? "amx" : now == Products::kFma ? "fma" : "dpbf16";
#else
  return "";
#endif
}

bool gemm_packs_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.def("pack_gemm_weight_bf16(Tensor weight) -> Tensor");
  m.def("gemm_packed(Tensor x, Tensor packed, Tensor? bias, int out_features, int activation=0) -> Tensor");
  m.def("gemm_packs_bf16() -> bool", &gemm_packs_bf16);  // no tensor to dispatch on: one kernel for all
  m.def("gemm_bf16_products(str set=\"\") -> str", &gemm_bf16_products);
  m.def("gemm_int8(Tensor x, Tensor tiled, Tensor scales, Tensor? bias, int out_features, int act=0) -> Tensor");
  m.def("gemm_int4(Tensor x, Tensor tiled, Tensor scales_zeros, int group, Tensor? bias, int out_features, "
        "int act=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("pack_gemm_weight", &pack_gemm_weight);
  m.impl("pack_gemm_weight_bf16", &pack_gemm_weight_bf16);
  m.impl("gemm_packed", &gemm_packed);
  m.impl("gemm_int8", &gemm_int8);
  m.impl("gemm_int4", &gemm_int4);
}

#endif  // __AVX2__ && __FMA__
