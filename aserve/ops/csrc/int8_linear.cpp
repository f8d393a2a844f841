// The int8 and int4 weight-only linears of decode batches, torch.ops.aserve.int8_linear and int4_linear, and
// int8_untile, which turns int8 tiles back into a dense matrix (for fp16, where aserve's GEMM does not run).
//
// out[m, n] = T(scale[n] * sum_k x[m, k] * q[n, k]), the int8 codes tiled at load as [ceil(N/16)][K][16]: for
// each k, 16 output channels' weights sit side by side, so one broadcast x[m, k] multiplies a whole vector of
// them and the sums never need a horizontal reduction (the layout of torch's int4 kernel, with one byte a weight).
// A decode step then reads one byte a weight instead of two or four; kTiles tiles at once keep the FMA pipes busy
// (one row: a tile at a time in four sums, int8_tile_one_row).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "int4_args.h"
#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;
using Half = c10::Half;  // int4 scales and zero points (int4_args.h)

constexpr int kInt8Tile = 16;

// One tile's 16 outputs as plain register types (one __m512, or two __m256), in plain arrays: GCC kept arrays of
// at::vec::Vectorized accumulators (and of structs holding registers) on the stack, loading or storing them at every
// FMA, which held the loop to ~17 GB/s of weights on a Zen 5 core with them in L2; these stay in registers.
#if defined(CPU_CAPABILITY_AVX512)
using VecF = __m512;
constexpr int kTileVecs = 1;
constexpr int kRegisters = 32;  // vector registers: what the tiles at once must fit (below)
inline VecF vec_zero() { return _mm512_setzero_ps(); }
inline VecF vec_broadcast(float x) { return _mm512_set1_ps(x); }
inline VecF vec_fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void vec_store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline void widen_tile(const int8_t* p, VecF* out) {  // 16 int8 weights as fp32
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(CPU_CAPABILITY_AVX2)
using VecF = __m256;
constexpr int kTileVecs = 2;
constexpr int kRegisters = 16;
inline VecF vec_zero() { return _mm256_setzero_ps(); }
inline VecF vec_broadcast(float x) { return _mm256_set1_ps(x); }
inline VecF vec_fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void vec_store(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline void widen_tile(const int8_t* p, VecF* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}
#else
using VecF = fVec;
constexpr int kTileVecs = kInt8Tile / fVec::size() > 0 ? kInt8Tile / fVec::size() : 1;
constexpr int kRegisters = 16;
inline VecF vec_zero() { return fVec(0.f); }
inline VecF vec_broadcast(float x) { return fVec(x); }
inline VecF vec_fma(VecF a, VecF b, VecF c) { return at::vec::fmadd(a, b, c); }
inline void vec_store(float* p, VecF v) { v.store(p); }
inline void widen_tile(const int8_t* p, VecF* out) {
  float lanes[kTileVecs * fVec::size()] = {};
  for (int i = 0; i < kInt8Tile; ++i) lanes[i] = static_cast<float>(p[i]);
  for (int v = 0; v < kTileVecs; ++v) out[v] = fVec::loadu(lanes + v * fVec::size());
}
#endif
constexpr int kVecLanes = kInt8Tile / kTileVecs;

// R tiles' sums for M rows (sums[(r * M + m) * kTileVecs + v]) into o[m][16 (t0 + r) ...], each output n's lane
// through scaled(lane, n), the last tile cut at N. Unrolled, so that every index into the sums is a constant: one
// variable index puts the whole array in memory.
template <typename T, int M, int R, typename Scaled>
inline void store_tiles(const VecF* sums, T* o, int64_t N, int64_t t0, Scaled scaled) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (t0 + r) * kInt8Tile;
    const int64_t width = std::min<int64_t>(kInt8Tile, N - n0);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float lanes[kInt8Tile];
#pragma GCC unroll 2
      for (int v = 0; v < kTileVecs; ++v) vec_store(lanes + v * kVecLanes, sums[(r * M + m) * kTileVecs + v]);
      for (int64_t i = 0; i < width; ++i) o[m * N + n0 + i] = static_cast<T>(scaled(lanes[i], n0 + i));
    }
  }
}

// A group of tiles reads kBytes a k step from its own run of memory; the group after it (`next`) is pulled into L1
// at the same pace, step `step`'s share of its lines (a line every 64 / kBytes steps when a step reads less).
template <int kBytes, typename B>
inline void prefetch_step(const B* next, int64_t step) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const char* p = reinterpret_cast<const char*>(next) + step * kBytes;
  if constexpr (kBytes >= 64) {
#pragma GCC unroll 8
    for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  } else if ((step * kBytes) % 64 == 0) {
    _mm_prefetch(p, _MM_HINT_T0);
  }
#endif
}

// Group g's scales and zero points ([2][16] fp16, a line) of R tiles from t0 into L1. A group's fold reads a line
// or two per tile from arrays the hardware does not see as streams: each fold waited on R misses. fp32 int4 at one row
// (bench shapes x 30 layers, cold, Zen 5, 2 threads): 3.31 ms without this and the next run's prefetch, 2.23-2.34 with.
template <int R, typename T>
inline void prefetch_scales(const T* sz, int64_t t0, int64_t groups, int64_t g) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const char* p = reinterpret_cast<const char*>(sz + ((t0 + r) * groups + g) * 2 * kInt8Tile);
    for (size_t b = 0; b < 2 * kInt8Tile * sizeof(T); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
#endif
}

// How far ahead of the line it reads a thread's run of tiles is prefetched into L1: the kernels of one tile at a time
// fetch `ahead + k * row bytes` as they read row k (fetch_ahead), so the distance carries across the tiles' ends; those
// of R tiles at once fetch each tile's stream this many bytes of their reads ahead. It used to be the next tile, which
// made the distance the tile's size: 9 KB for the bench model's K = 576 int8 projections, 24 KB for its down projection
// (K = 1536). The bench model at batch 1, 8 steps a scheduling, every projection's TSC time summed over a run (AMD EPYC
// Zen 4; avx512f avx512_bf16 avx512_vnni; 2 threads; the distance switched round by round in one process, 8-10 rounds a
// run): int8 weights and head, bf16, 2, 3, 4, 6 and 8 KB against the next tile took 0.96-1.03, 0.91-0.96, 0.90-0.96
// (four runs), 0.93 and 0.98 of the projections' time (no software prefetch at all: 0.95), the down projection's own
// 0.83-0.86 at 4 KB; GPTQ int4 with its head 0.97 at 4 KB (none: 1.04); int8 at 4 rows 0.97, int8 in fp32 0.96; the
// AVX2 build (-march=haswell on the same machine, fp32) int8 0.94, GPTQ 1.00 and 1.02.
constexpr int64_t kFetchAhead = 4096;

// For the kernels of R tiles at once: the line of row `row` (16-byte rows, `rows` a tile) of tile i of the group at
// `tiles`, into L1; past the tile's end, the same row less `rows` of tile i of the thread's next group (`next`; none
// where null).
template <typename B> inline void fetch_row(const B* tiles, const B* next, int i, int64_t rows, int64_t row) {
  if (row < rows)
    prefetch_line<1>(tiles + (i * rows + row) * kInt8Tile);
  else if (next != nullptr)
    prefetch_line<1>(next + (i * rows + row - rows) * kInt8Tile);
}

// R tiles (t0..t0+R-1) against the M rows of x (as fp32): R * M independent sums. Each tile's stream is fetched into
// L1 kFetchAhead bytes of the R tiles' reads ahead, into `prefetch` (the next tiles this thread reads, or null) past
// the tiles' end. Against fetching the next R tiles at the pace these were read (R tiles ahead), the bench model's
// 120 int8 layers cold in fp32, alternated in one process (AMD EPYC Zen 4, 2 threads, 12 rounds, two runs) ran
// 1.17x and 1.20x as fast at 2 rows, 1.08x and 1.16x at 4, 1.00x at 8; the AVX2 build on the same machine 1.23x,
// 1.06x and 0.99x.
template <typename T, int M, int R>
inline void int8_tiles(const int8_t* w, const float* xf, int64_t K, const T* sc, T* o, int64_t N, int64_t t0,
                       const int8_t* prefetch = nullptr) {
  constexpr int kAcc = R * M * kTileVecs;
  VecF acc[kAcc];  // [r][m][v]
#pragma GCC unroll 32
  for (int i = 0; i < kAcc; ++i) acc[i] = vec_zero();
  const int8_t* tile = w + t0 * K * kInt8Tile;
  constexpr int64_t kAheadRows = kFetchAhead / (R * kInt8Tile);  // kFetchAhead bytes of the R tiles' reads
  for (int64_t k = 0; k < K; ++k) {
    if (k % 4 == 0) {  // a line of each tile every four rows: kAheadRows on, or past its end in the next group's
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) fetch_row(tile, prefetch, r, K, k + kAheadRows);
    }
    VecF xk[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xk[m] = vec_broadcast(xf[m * K + k]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      VecF wv[kTileVecs];
      widen_tile(tile + (r * K + k) * kInt8Tile, wv);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
        for (int v = 0; v < kTileVecs; ++v)
          acc[(r * M + m) * kTileVecs + v] = vec_fma(wv[v], xk[m], acc[(r * M + m) * kTileVecs + v]);
    }
  }
  store_tiles<T, M, R>(acc, o, N, t0, [sc](float sum, int64_t n) { return sum * static_cast<float>(sc[n]); });
}

// Tiles multiplied at once for M rows: the most of 4, 2, 1 whose accumulators, the M broadcast rows and one widened
// tile fit the vector registers (32 with AVX-512, 16 with AVX2), so that nothing spills.
constexpr int tiles_at_once(int M) {
  for (int r = 4; r > 1; r /= 2)
    if (r * M * kTileVecs + M + kTileVecs <= kRegisters) return r;
  return 1;
}

// M rows in even blocks of at most four (whose sums fill the registers): run(integral_constant<rows>, m0) for each
// block in turn, first to last.
template <typename Run> inline void by_row_blocks(int64_t M, Run run) {
  const int64_t blocks = (M + 3) / 4, block = (M + blocks - 1) / blocks;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    switch (std::min(block, M - m0)) {
      case 1: run(std::integral_constant<int, 1>{}, m0); break;
      case 2: run(std::integral_constant<int, 2>{}, m0); break;
      case 3: run(std::integral_constant<int, 3>{}, m0); break;
      default: run(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

// Each thread takes an equal run of the tiles (not of whole groups: 36 tiles are 9 groups of 4, 5 for one thread and
// 4 for the other) and calls run(integral_constant<R>, t) on them R at a time: kTiles, then what is left 2 and 1.
template <int kTiles, typename Run> inline void by_tile_runs(int64_t tiles, Run run) {
  constexpr int kHalf = kTiles >= 2 ? kTiles / 2 : 1;
  parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t t = begin;
    for (; t + kTiles <= end; t += kTiles) run(std::integral_constant<int, kTiles>{}, t, end);
    for (; t + kHalf <= end; t += kHalf) run(std::integral_constant<int, kHalf>{}, t, end);
    for (; t < end; ++t) run(std::integral_constant<int, 1>{}, t, end);
  });
}

// What a group of R tiles at t prefetches (prefetch_step): the R tiles after it (of `rows` 16-byte rows), whatever
// groups the thread's run makes of them; nothing for the run's last group. (Where fewer than R remain, the lines
// past them are the next thread's first: a hint, never a fault.)
template <int R, typename B>
inline const B* next_run(const B* w, int64_t t, int64_t end, int64_t rows) {
  return t + R < end ? w + (t + R) * rows * kInt8Tile : nullptr;
}

// What a tile starting at `at` prefetches as it goes (above), in a run of tiles ending at `stop`: nothing once the
// lines ahead are past the run.
template <typename B> inline const B* fetch_ahead(const B* at, const B* stop) {
  return at + kFetchAhead < stop ? at + kFetchAhead : nullptr;
}

// x's M rows of K inputs as fp32, in this thread's scratch (reused by the next call: no allocation a call).
template <typename T> inline float* rows_as_float(const at::Tensor& x, int M, int64_t K) {
  thread_local std::vector<float> rows;
  rows.resize(M * K);
  const T* src = x.data_ptr<T>();
  for (int m = 0; m < M; ++m) load_row(src + m * x.stride(0), rows.data() + m * K, K);
  return rows.data();
}

// Inputs made 16-bit integers for the integer row kernels (AVX512-VNNI's vpdpwssd for bf16 rows, AVX2's vpmaddwd for
// fp32 and bf16): x's M rows as int16 ([M][K]), each span's unit ([M][groups][spans a group]) and each group's sum of
// n * unit ([M][groups]), in this thread's scratch.
constexpr int64_t kSpan = 64;  // inputs sharing an exponent: few enough that no 32-bit sum can overflow
struct FixedPointRows {
  const int16_t* values;
  const float* units;
  const float* sums;
  int64_t spans;  // a group's

  FixedPointRows from_row(int64_t m0, int64_t K, int64_t groups) const {  // the rows from m0 on
    return {values + m0 * K, units + m0 * groups * spans, sums + m0 * groups, spans};
  }
};

inline float power_of_two(int p) {  // 2^p for p in fp32's normal range
  const uint32_t b = static_cast<uint32_t>(p + 127) << 23;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// bf16 activations as 16-bit integers for vpdpwssd (AVX512-VNNI), which multiplies pairs of them by pairs of 16-bit
// weights and sums into 32-bit lanes: x's inputs in spans of up to kSpan (of a group's inputs, from its start; int8's
// group is the whole row) share one exponent, each x = n * unit with n = round(x / unit) and unit = 2^(e - 14), e the
// exponent of the span's largest |x|, so |n| < 2^15. A bf16 has 8 significant bits: n is x exactly for every input
// within 7 binades of the span's largest, and for the rest x rounded to half a unit (2^-15 of the largest). The sums
// of n * q are exact integers, folded per span into fp32 as sum * unit (times the weights' scale). On an Intel Xeon
// vdpbf16ps issues one every ~2.2 cycles and vpdpwssd about three times as often.
#define ASERVE_VNNI_ROWS 1

// A span holding a NaN or an infinity gets a NaN unit, so that its outputs are NaN as x q's would be.
inline FixedPointRows rows_as_fixed_point(const at::Tensor& x, int M, int64_t K, int64_t group) {
  thread_local std::vector<int16_t> values;
  thread_local std::vector<float> units, sums;
  const int64_t groups = K / group, spans = (group + kSpan - 1) / kSpan, stride = x.stride(0);
  values.resize(M * K), units.resize(M * groups * spans), sums.resize(M * groups);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  for (int m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float group_sum = 0.f;
      for (int64_t j = 0; j < spans; ++j) {
        const int64_t k0 = g * group + j * kSpan, len = std::min(kSpan, (g + 1) * group - k0);
        constexpr int kVecs = kSpan / 16;
        __m512 v[kVecs];
        __m512 top = _mm512_setzero_ps();
        __mmask16 bad = 0;
#pragma GCC unroll 4
        for (int i = 0; i < kVecs; ++i) {
          const int64_t count = std::max<int64_t>(0, std::min<int64_t>(16, len - 16 * i));
          const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
          v[i] = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bits + m * stride + k0 + 16 * i)), 16));
          const __m512 size = _mm512_abs_ps(v[i]);
          bad |= _mm512_cmp_ps_mask(size, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
          top = _mm512_max_ps(top, size);
        }
        uint32_t top_bits;
        const float largest = _mm512_reduce_max_ps(top);
        std::memcpy(&top_bits, &largest, sizeof top_bits);
        const int e = std::max(static_cast<int>(top_bits >> 23) - 127, -100);  // -100: zeros and denormals
        const __m512 inverse = _mm512_set1_ps(power_of_two(14 - e));
        __m512i total = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < kVecs; ++i) {
          const int64_t count = std::max<int64_t>(0, std::min<int64_t>(16, len - 16 * i));
          const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));  // to nearest, ties to even
          total = _mm512_add_epi32(total, n);
          _mm256_mask_storeu_epi16(values.data() + m * K + k0 + 16 * i, static_cast<__mmask16>((1u << count) - 1),
                                   _mm512_cvtsepi32_epi16(n));
        }
        const float unit = bad ? std::numeric_limits<float>::quiet_NaN() : power_of_two(e - 14);
        units[(m * groups + g) * spans + j] = unit;
        group_sum += static_cast<float>(_mm512_reduce_add_epi32(total)) * unit;
      }
      sums[m * groups + g] = group_sum;
    }
  }
  return {values.data(), units.data(), sums.data(), spans};
}

// A span's CH chains of 32-bit sums for M rows, zeroed.
template <int CH, int M> inline void zero_sums(__m512i (&acc)[CH][M]) {
#pragma GCC unroll 4
  for (int c = 0; c < CH; ++c)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[c][m] = _mm512_setzero_si512();
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// fp32 and bf16 rows as 16-bit integers for vpmaddwd, AVX2's product of 16-bit pairs summed into 32-bit lanes: as
// above, each span's inputs x = n * unit with unit = 2^(e - 14), e the exponent of its largest |x|, n = round(x /
// unit) to nearest even, and n capped at 2^15 - 1 (an fp32 x just under 2^(e + 1) rounds to 2^15). A bf16 x within 7
// binades of its span's largest is n exactly, as above; an fp32 x is rounded to half a unit, 2^-15 of its span's
// largest (bf16 rounds each x to 2^-9 of itself). Spans are whole vectors of 8: int4 groups are multiples of 8.
#define ASERVE_MADD_ROWS 1

template <typename T>
inline FixedPointRows rows_as_fixed_point(const at::Tensor& x, int M, int64_t K, int64_t group) {
  thread_local std::vector<int16_t> values;
  thread_local std::vector<float> units, sums;
  const float* rows = rows_as_float<T>(x, M, K);
  const int64_t groups = K / group, spans = (group + kSpan - 1) / kSpan;
  values.resize(M * K), units.resize(M * groups * spans), sums.resize(M * groups);
  const __m256 sign = _mm256_set1_ps(-0.f), infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256i largest_n = _mm256_set1_epi32(32767);
  for (int m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float group_sum = 0.f;
      for (int64_t j = 0; j < spans; ++j) {
        const int64_t k0 = g * group + j * kSpan, len = std::min(kSpan, (g + 1) * group - k0);
        const float* p = rows + m * K + k0;
        __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t i = 0; i < len; i += 8) {
          const __m256 size = _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i));
          bad = _mm256_or_ps(bad, _mm256_cmp_ps(size, infinity, _CMP_NLT_UQ));
          top = _mm256_max_ps(top, size);
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float largest = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
        uint32_t top_bits;
        std::memcpy(&top_bits, &largest, sizeof top_bits);
        const int e = std::max(static_cast<int>(top_bits >> 23) - 127, -100);  // -100: zeros and denormals
        const __m256 inverse = _mm256_set1_ps(power_of_two(14 - e));
        __m256i total = _mm256_setzero_si256();
        for (int64_t i = 0; i < len; i += 8) {
          const __m256i n =
              _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + i), inverse)), largest_n);
          total = _mm256_add_epi32(total, n);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(values.data() + m * K + k0 + i),
                           _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1)));
        }
        __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
        const float unit = _mm256_movemask_ps(bad) ? std::numeric_limits<float>::quiet_NaN() : power_of_two(e - 14);
        units[(m * groups + g) * spans + j] = unit;
        group_sum += static_cast<float>(_mm_cvtsi128_si32(sum4)) * unit;
      }
      sums[m * groups + g] = group_sum;
    }
  }
  return {values.data(), units.data(), sums.data(), spans};
}
#endif

// One row: one tile at a time, its k in four interleaved sums (k mod 4, added as (0 + 1) + (2 + 3) at the end), the
// line kFetchAhead bytes ahead (`next`) pulled into L1 every four k steps: each thread reads its run of tiles as one
// stream, as int4_tile_vnni does. Four tiles at once (int8_tiles at M = 1) read four streams a tile apart: the bench
// model's 120 int8 layers at one row, caches flushed before each pass (Intel Xeon without AMX tiles, bf16, 2 threads,
// both ways in shuffled order in one process, 16-30 passes each, three runs), took 7.91 -> 7.29, 8.09 -> 7.72 and
// 7.69 -> 7.47 ms (medians), its int8 head 1.43-1.51 -> 1.38-1.43 ms, each tile then fetching the next one whole.
// (Prefetching two tiles ahead into L2 as well was no faster.)
template <typename T>
inline void int8_tile_one_row(const int8_t* w, const float* xf, int64_t K, const T* sc, T* o, int64_t N, int64_t t,
                              const int8_t* next) {
  constexpr int kChains = 4;
  VecF acc[kChains][kTileVecs];
#pragma GCC unroll 4
  for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 2
    for (int v = 0; v < kTileVecs; ++v) acc[c][v] = vec_zero();
  const int8_t* tile = w + t * K * kInt8Tile;
  auto step = [&](int c, int64_t k) __attribute__((always_inline)) {
    VecF wv[kTileVecs];
    widen_tile(tile + k * kInt8Tile, wv);
    const VecF xk = vec_broadcast(xf[k]);
#pragma GCC unroll 2
    for (int v = 0; v < kTileVecs; ++v) acc[c][v] = vec_fma(wv[v], xk, acc[c][v]);
  };
  int64_t k = 0;
  for (; k + kChains <= K; k += kChains) {
    if (next != nullptr) prefetch_step<kChains * kInt8Tile>(next, k / kChains);
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) step(c, k + c);
  }
  for (; k < K; ++k) step(0, k);
  VecF sums[kTileVecs];
#pragma GCC unroll 2
  for (int v = 0; v < kTileVecs; ++v) sums[v] = (acc[0][v] + acc[1][v]) + (acc[2][v] + acc[3][v]);
  store_tiles<T, 1, 1>(sums, o, N, t, [sc](float sum, int64_t n) { return sum * static_cast<float>(sc[n]); });
}

#if defined(ASERVE_VNNI_ROWS)
// int8 with bf16 rows on vpdpwssd: a tile's rows k and k + 1 (32 bytes, 16 outputs each) widened to 16-bit and
// interleaved by one vpermw into the pairs (w[k][n], w[k + 1][n]) vpdpwssd multiplies by (n[k], n[k + 1]): two
// shuffles and M vpdpwssd a 32 weights, against two widening ops and M FMAs a 16 (int8_tile_one_row, int8_tiles).
// Pairs go to CH chains a row (four at one row, to hide vpdpwssd's latency); each span's sums are folded into fp32
// with its unit, and the outputs scaled once at the end. Whole spans only (K a multiple of kSpan). `next`: the line
// kFetchAhead bytes ahead, pulled into L1 at the pace rows are read.
template <int M>
inline void int8_tile_vnni(const int8_t* w, const FixedPointRows& xs, int64_t K, const c10::BFloat16* sc,
                           c10::BFloat16* o, int64_t N, int64_t t, const int8_t* next) {
  constexpr int CH = M == 1 ? 4 : M <= 3 ? 2 : 1;
  const int8_t* tile = w + t * K * kInt8Tile;
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // lane 2j: row k's j, 2j + 1: k + 1's
  __m512 out[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / kSpan; ++j) {
    __m512i acc[CH][M];
    zero_sums(acc);
#pragma GCC unroll 2
    for (int64_t k0 = j * kSpan; k0 < (j + 1) * kSpan; k0 += 8) {  // rows k0..k0+7: two lines
      if (next != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k0 * kInt8Tile), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + (k0 + 4) * kInt8Tile), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // rows k and k + 1: 32 bytes
        const int64_t k = k0 + 2 * p;
        const __m512i wide =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * kInt8Tile)));
        const __m512i wv = _mm512_permutexvar_epi16(pairs, wide);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          int32_t pair;  // (n[k], n[k + 1])
          std::memcpy(&pair, xs.values + m * K + k, sizeof pair);
          acc[p % CH][m] = _mm512_dpwssd_epi32(acc[p % CH][m], wv, _mm512_set1_epi32(pair));
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i sum = acc[0][m];
#pragma GCC unroll 4
      for (int c = 1; c < CH; ++c) sum = _mm512_add_epi32(sum, acc[c][m]);
      out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs.units[m * xs.spans + j]), out[m]);
    }
  }
  store_tiles<c10::BFloat16, M, 1>(out, o, N, t, [sc](float sum, int64_t n) { return sum * static_cast<float>(sc[n]); });
}
#endif

template <typename T, int M>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, at::Tensor& out) {
  constexpr int kTiles = tiles_at_once(M);
  const int64_t K = x.size(1), N = out.size(1), tiles = tiled.size(0);
#if defined(ASERVE_VNNI_ROWS)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (K % kSpan == 0) {
      const FixedPointRows xs = rows_as_fixed_point(x, M, K, K);
      const int8_t* w = tiled.data_ptr<int8_t>();
      const c10::BFloat16* sc = scales.data_ptr<c10::BFloat16>();
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
      parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          int8_tile_vnni<M>(w, xs, K, sc, o, N, t, fetch_ahead(w + t * K * kInt8Tile, w + end * K * kInt8Tile));
      });
      return;
    }
  }
#endif
  const float* xf = rows_as_float<T>(x, M, K);
  const int8_t* w = tiled.data_ptr<int8_t>();
  const T* sc = scales.data_ptr<T>();
  T* o = out.data_ptr<T>();
  if constexpr (M == 1) {
    parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        int8_tile_one_row<T>(w, xf, K, sc, o, N, t, fetch_ahead(w + t * K * kInt8Tile, w + end * K * kInt8Tile));
    });
    return;
  }
  by_tile_runs<kTiles>(tiles, [&](auto r, int64_t t, int64_t end) {
    constexpr int R = decltype(r)::value;
    int8_tiles<T, M, R>(w, xf, K, sc, o, N, t, next_run<R>(w, t, end, K));
  });
}

template <typename T>
void int8_linear_rows(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, at::Tensor& out) {
  switch (x.size(0)) {
    case 1: return int8_linear_impl<T, 1>(x, tiled, scales, out);
    case 2: return int8_linear_impl<T, 2>(x, tiled, scales, out);
    case 3: return int8_linear_impl<T, 3>(x, tiled, scales, out);
    case 4: return int8_linear_impl<T, 4>(x, tiled, scales, out);
    case 5: return int8_linear_impl<T, 5>(x, tiled, scales, out);
    case 6: return int8_linear_impl<T, 6>(x, tiled, scales, out);
    case 7: return int8_linear_impl<T, 7>(x, tiled, scales, out);
    case 8: return int8_linear_impl<T, 8>(x, tiled, scales, out);
  }
  TORCH_CHECK(false, "int8_linear: takes 1 to 8 rows, got ", x.size(0));
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_linear: x must be [rows, in] with unit inner stride");
  TORCH_CHECK(tiled.dim() == 3 && tiled.is_contiguous() && tiled.scalar_type() == at::kChar &&
                  tiled.size(1) == x.size(1) && tiled.size(2) == kInt8Tile &&
                  tiled.size(0) * kInt8Tile >= out_features && (tiled.size(0) - 1) * kInt8Tile < out_features,
              "int8_linear: weight must be contiguous int8 tiles [ceil(out/16), in, 16] matching x");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.size(0) == out_features &&
                  scales.scalar_type() == x.scalar_type(),
              "int8_linear: scales must be a contiguous [out] vector of x's dtype");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: int8_linear_rows<float>(x, tiled, scales, out); break;
    case at::kBFloat16: int8_linear_rows<c10::BFloat16>(x, tiled, scales, out); break;
    case at::kHalf: int8_linear_rows<c10::Half>(x, tiled, scales, out); break;
    default: TORCH_CHECK(false, "int8_linear: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// ---- int4 (GPTQ, AWQ) ----------------------------------------------------------------------------------------
// out[m, n] = T(sum_g (s[g, n] * sum_{k in g} x[m, k] q[n, k] - s[g, n] z[g, n] * sum_{k in g} x[m, k])): w = (q - z) * s
// with 4-bit codes q and, per group of inputs and output, a scale s and zero point z. A tile's codes are
// [K/8] blocks of 64 bytes (quantization.int4.tile_int4): in block b, 32-bit word j holds output j's codes of the
// block's pair rows kk = 4b + s, q[2kk] in bits 4s..4s+3 and q[2kk + 1] in bits 16 + 4s..: one 64-byte load is 128
// weights, and pair row s is a shift and a mask of it. Each group's sums of x q run in registers and are folded into
// the output with the group's s and s * z ([ceil(N/16)][groups][2][16] in x's dtype) and the group's sum of x.
// Groups are multiples of 8 inputs: whole blocks.

// Pair row S (0..3) of a tile's 64-byte block: output j's codes of even k (bits 4S..4S+3 of word j) and of odd k
// (bits 16 + 4S..) as fp32 times 16^S: the nibble masked where it lies (the odd half shifted down 16 first) and
// converted, no shift to the bottom. The x they multiply is scaled by 16^-S (scale_for_nibbles), so each product is x
// q as an unscaled one rounds it (powers of two). Before, a shift by a variable count (S then came at run time), a
// mask and the conversion: the bench model's 120 int4 layers, fp32, one row, took 6.8 ms against 4.5 now in the AVX2
// build and 5.2 against 3.1 with AVX-512 (8 rows 16.0 against 10.2; Intel Xeon, 2 threads, best of three runs).
template <int S>
inline void widen_nibbles(const uint8_t* block, VecF* even, VecF* odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i words = _mm512_loadu_si512(block), mask = _mm512_set1_epi32(15 << (4 * S));
  even[0] = _mm512_cvtepi32_ps(_mm512_and_si512(words, mask));
  odd[0] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(words, 16), mask));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i mask = _mm256_set1_epi32(15 << (4 * S));
  for (int v = 0; v < 2; ++v) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * v));
    even[v] = _mm256_cvtepi32_ps(_mm256_and_si256(words, mask));
    odd[v] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 16), mask));
  }
#else
  float e[kInt8Tile], o[kInt8Tile];
  for (int i = 0; i < kInt8Tile; ++i) {
    uint32_t word;
    std::memcpy(&word, block + 4 * i, sizeof word);
    e[i] = static_cast<float>(word & (15u << (4 * S))), o[i] = static_cast<float>((word >> 16) & (15u << (4 * S)));
  }
  for (int v = 0; v < kTileVecs; ++v) even[v] = VecF::loadu(e + v * kVecLanes), odd[v] = VecF::loadu(o + v * kVecLanes);
#endif
}

// x's inputs 2kk and 2kk + 1 times 16^-(kk % 4), for widen_nibbles' codes (K: whole blocks of 8 inputs).
inline void scale_for_nibbles(float* row, int64_t K) {
  alignas(64) static const float kScales[16] = {1.f, 1.f, 1.f / 16, 1.f / 16, 1.f / 256, 1.f / 256, 1.f / 4096, 1.f / 4096,
                                                1.f, 1.f, 1.f / 16, 1.f / 16, 1.f / 256, 1.f / 256, 1.f / 4096, 1.f / 4096};
  static_assert(fVec::size() <= 16 && 16 % fVec::size() == 0, "the scales repeat every 8 inputs");
  const fVec scales = fVec::loadu(kScales);
  int64_t k = 0;
  for (; k + fVec::size() <= K; k += fVec::size()) (fVec::loadu(row + k) * scales).store(row + k);
  for (; k < K; ++k) row[k] *= kScales[k % 8];
}

inline VecF vec_load(const float* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_loadu_ps(p);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_loadu_ps(p);
#else
  return fVec::loadu(p);
#endif
}

inline VecF vec_add(VecF a, VecF b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_add_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_add_ps(a, b);
#else
  return a + b;
#endif
}

inline VecF vec_fnma(VecF a, VecF b, VecF c) {  // c - a * b
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_fnmadd_ps(a, b, c);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_fnmadd_ps(a, b, c);
#else
  return c - a * b;
#endif
}

// x's M rows of K inputs (scaled for widen_nibbles where `for_nibbles`; the bf16 kernel reads only the sums) and their
// sums per group (M x K / group), as fp32 in this thread's scratch, kept between calls: a batch-1 GPTQ step makes
// ~120, and their two allocations and a division per input, in a serial loop, were 6.6% of the step on the calling
// thread while the other waited (perf, bench model, Zen 5).
struct RowsAndSums {
  const float* rows;
  const float* sums;
};
template <typename T>
inline RowsAndSums rows_and_group_sums(const at::Tensor& x, int M, int64_t K, int64_t group, bool for_nibbles) {
  thread_local std::vector<float> sums;
  float* rows = rows_as_float<T>(x, M, K);
  const int64_t groups = K / group;
  sums.resize(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) {  // row i / groups' group i % groups: `group` inputs from i * group
    const float* p = rows + i * group;
    fVec acc(0.f);
    int64_t k = 0;
    for (; k + fVec::size() <= group; k += fVec::size()) acc = acc + fVec::loadu(p + k);
    float sum = reduce_sum(acc);
    for (; k < group; ++k) sum += p[k];
    sums[i] = sum;
  }
  if (for_nibbles)
    for (int m = 0; m < M; ++m) scale_for_nibbles(rows + m * K, K);
  return {rows, sums.data()};
}

constexpr int int4_tiles_at_once(int M) {  // out and two group sums for R tiles x M rows, 2M broadcasts, 2 widened
  for (int r = 4; r > 1; r /= 2)
    if (3 * r * M * kTileVecs + 2 * M + 2 * kTileVecs + 4 <= kRegisters) return r;  // + 4: the fold's scales
  return 1;
}

// R tiles from t0 against M rows of x (fp32, K apart); sz: the tiles' scales and zero points ([tiles][groups][2][16]);
// xsum [M][groups].
template <typename T, int M, int R>
inline void int4_tiles(const uint8_t* w, const float* xf, int64_t K, int64_t group, const Half* sz, const float* xsum,
                       T* o, int64_t N, int64_t t0, const uint8_t* prefetch) {
  constexpr int kAcc = R * M * kTileVecs;
  const int64_t groups = K / group, pairs = K / 2;
  VecF out[kAcc];
#pragma GCC unroll 32
  for (int i = 0; i < kAcc; ++i) out[i] = vec_zero();
  prefetch_scales<R>(sz, t0, groups, 0);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) prefetch_scales<R>(sz, t0, groups, g + 1);
    VecF acc[kAcc], acc_odd[kAcc];  // even and odd k apart: two FMA chains, not one twice as long
#pragma GCC unroll 32
    for (int i = 0; i < kAcc; ++i) acc[i] = vec_zero(), acc_odd[i] = vec_zero();
    const auto pair_row = [&](auto S, int64_t kk) __attribute__((always_inline)) {  // kk = 4b + S, in block b
      if (prefetch != nullptr) prefetch_step<R * kInt8Tile>(prefetch, kk);
      // x broadcast once for the R tiles where 32 registers hold them; with AVX2's 16, at each use (held, 4 and 8 rows
      // spilled: the bench model's int4 layers 12.5 against 11.5 ms at 4 rows, 25.0 against 20.6 at 8; haswell build)
      constexpr bool kHoldX = kRegisters >= 32;
      VecF xe[M], xo[M];
      if constexpr (kHoldX) {
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) xe[m] = vec_broadcast(xf[m * K + 2 * kk]), xo[m] = vec_broadcast(xf[m * K + 2 * kk + 1]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        VecF even[kTileVecs], odd[kTileVecs];
        widen_nibbles<decltype(S)::value>(w + ((t0 + r) * pairs + kk - decltype(S)::value) * kInt8Tile, even, odd);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const VecF e = kHoldX ? xe[m] : vec_broadcast(xf[m * K + 2 * kk]);
          const VecF o = kHoldX ? xo[m] : vec_broadcast(xf[m * K + 2 * kk + 1]);
#pragma GCC unroll 2
          for (int v = 0; v < kTileVecs; ++v) {
            const int i = (r * M + m) * kTileVecs + v;
            acc[i] = vec_fma(even[v], e, acc[i]);
            acc_odd[i] = vec_fma(odd[v], o, acc_odd[i]);
          }
        }
      }
    };
    for (int64_t kk = g * group / 2; kk < (g + 1) * group / 2; kk += 4) {  // a group is whole blocks
      pair_row(std::integral_constant<int, 0>(), kk);
      pair_row(std::integral_constant<int, 1>(), kk + 1);
      pair_row(std::integral_constant<int, 2>(), kk + 2);
      pair_row(std::integral_constant<int, 3>(), kk + 3);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float s[2 * kInt8Tile];  // the group's 16 scales, then 16 s * z, as fp32
      load_scales_zeros(sz + (((t0 + r) * groups + g) * 2) * kInt8Tile, s);
#pragma GCC unroll 2
      for (int v = 0; v < kTileVecs; ++v) {
        const VecF sv = vec_load(s + v * kVecLanes), mv = vec_load(s + kInt8Tile + v * kVecLanes);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const int i = (r * M + m) * kTileVecs + v;
          out[i] = vec_fnma(mv, vec_broadcast(xsum[m * groups + g]), vec_fma(vec_add(acc[i], acc_odd[i]), sv, out[i]));
        }
      }
    }
  }
  store_tiles<T, M, R>(out, o, N, t0, [](float sum, int64_t) { return sum; });
}

// Tile t's scales and zero points, all its groups, into L2 (the thread's next tile, while this one multiplies).
template <typename T> inline void prefetch_tile_scales(const T* sz, int64_t t, int64_t groups) {
  const char* p = reinterpret_cast<const char*>(sz + t * groups * 2 * kInt8Tile);
  const int64_t bytes = groups * 2 * kInt8Tile * int64_t{sizeof(T)};
  for (int64_t b = 0; b < bytes; b += 64) aserve_kernels::prefetch_line<2>(p + b);
}

#if defined(ASERVE_MADD_ROWS)
// int4 on AVX2's vpmaddwd: pair row r of a 64-byte block, (q[2kk], q[2kk + 1]) in each 32-bit word, masked (and
// shifted) into the 16-bit pairs vpmaddwd multiplies by (n[2kk], n[2kk + 1]), then added to the row's 32-bit sums:
// 32 weights in two ymm, about six vector ops at one row, where widening the codes to fp32 took ten beside four FMAs
// (int4_tiles). Tile t (16 outputs) against M rows (up to 4: their sums, the block and the pair row fill the 16
// registers), one tile at a time so that each thread reads its run of tiles as one stream; each span's sums folded
// into fp32 with its unit and the group's scales, the outputs waiting in L1 between spans. `next`: the line
// kFetchAhead bytes ahead, pulled into L1 as blocks are read; with `fetch_scales`, the next tile's scales too.
//
// Up to two rows, pair rows 1 and 3 are masked in place (16 q, from the words and the words shifted down a byte) into
// a second chain of sums, divided by 16 (exactly: a shift) and added to the first at the fold: one shift a block
// where there were three, and the same integer sums, so the same bits, as with more rows. |n| <= 2^15 and 16 q <= 240,
// so a span's 16 such pair products stay below 2^28. Not inlined: inlined into int4_linear_madd's parallel loop, GCC
// kept the sums on the stack, a load and a store a block on each chain.
template <int M, typename T>
__attribute__((noinline)) void int4_tile_madd(const uint8_t* w, const FixedPointRows& xs, int64_t K, int64_t group,
                                              const Half* sz, T* o, int64_t N, int64_t t, const uint8_t* next,
                                              bool fetch_scales) {
  const int64_t groups = K / group, pairs = K / 2;
  const uint8_t* tile = w + t * pairs * kInt8Tile;
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
  constexpr int C = M <= 2 ? 2 : 1;  // chains a row: [1] the odd pair rows' 16 q, where registers allow
  alignas(32) float out[M][kInt8Tile] = {};
  prefetch_scales<1>(sz, t, groups, 0);
  if (fetch_scales) prefetch_tile_scales(sz, t + 1, groups);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) prefetch_scales<1>(sz, t, groups, g + 1);
    alignas(32) float s[2 * kInt8Tile];  // the group's 16 scales, then 16 s * z
    load_scales_zeros(sz + ((t * groups + g) * 2) * kInt8Tile, s);
    for (int64_t j = 0; j < xs.spans; ++j) {
      const int64_t k0 = g * group + j * kSpan, k1 = std::min(k0 + kSpan, (g + 1) * group);
      __m256i acc[C][M][2];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
          for (int v = 0; v < 2; ++v) acc[c][m][v] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int64_t kk = k0 / 2; kk < k1 / 2; kk += 4) {  // a block: pair rows kk..kk+3
        if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + kk * kInt8Tile), _MM_HINT_T0);
        const __m256i* block = reinterpret_cast<const __m256i*>(tile + kk * kInt8Tile);  // outputs 0-7, then 8-15
        __m256i words[2], words_down[2];  // pair rows 0-3 in each word's nibbles, low first; rows 2-3 shifted down
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v)
          words[v] = _mm256_loadu_si256(block + v), words_down[v] = _mm256_srli_epi16(words[v], 8);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {  // pair row r of both halves, each broadcast pair of x used at once by both
          __m256i rows[2];
#pragma GCC unroll 2
          for (int v = 0; v < 2; ++v) {
            const __m256i from = r < 2 ? words[v] : words_down[v];
            if constexpr (C == 2)
              rows[v] = _mm256_and_si256(from, r % 2 ? high : low);
            else
              rows[v] = r == 3 ? _mm256_srli_epi16(words[v], 12)
                               : _mm256_and_si256(r == 1 ? _mm256_srli_epi16(words[v], 4) : from, low);
          }
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            int32_t pair;  // (n[2(kk + r)], n[2(kk + r) + 1])
            std::memcpy(&pair, xs.values + m * K + 2 * (kk + r), sizeof pair);
            const __m256i xv = _mm256_set1_epi32(pair);
            const int c = C == 2 ? r % 2 : 0;
#pragma GCC unroll 2
            for (int v = 0; v < 2; ++v) {
              acc[c][m][v] = _mm256_add_epi32(acc[c][m][v], _mm256_madd_epi16(rows[v], xv));
              // Each sum in its register here: else GCC reorders the (associative) integer adds into trees of
              // products, which hold more values than the 16 registers and spill every block.
              asm("" : "+x"(acc[c][m][v]));
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 unit = _mm256_set1_ps(xs.units[(m * groups + g) * xs.spans + j]);
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v) {
          __m256i sum = acc[0][m][v];
          if constexpr (C == 2) sum = _mm256_add_epi32(sum, _mm256_srai_epi32(acc[1][m][v], 4));  // exact: 16 q
          _mm256_store_ps(out[m] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                                          _mm256_mul_ps(_mm256_load_ps(s + 8 * v), unit),
                                                          _mm256_load_ps(out[m] + 8 * v)));
        }
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m256 xsum = _mm256_set1_ps(xs.sums[m * groups + g]);
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v)
        _mm256_store_ps(out[m] + 8 * v, _mm256_fnmadd_ps(_mm256_load_ps(s + kInt8Tile + 8 * v), xsum,
                                                         _mm256_load_ps(out[m] + 8 * v)));
    }
  }
  const int64_t n0 = t * kInt8Tile, width = std::min<int64_t>(kInt8Tile, N - n0);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    for (int64_t i = 0; i < width; ++i) o[m * N + n0 + i] = static_cast<T>(out[m][i]);
}
#endif

#if defined(ASERVE_VNNI_ROWS)

// int4: pair row s of a block, (q[2kk], q[2kk + 1]) in each 32-bit word, is a mask (and shift) away from the 16-bit
// pairs vpdpwssd multiplies by (n[2kk], n[2kk + 1]). vdpbf16ps took the same 32 products an instruction, and fp32
// FMAs twice as many instructions to widen the codes: one row's codes hot in L2, 12.5 cycles a 64-byte block on
// either of those against 5.5 here (Intel Xeon, avx512_vnni avx512_bf16, no AMX; a scratch microbenchmark).
//
// Tile t (16 outputs) against M rows, one tile at a time, so that each thread reads its run of tiles as one stream
// (eight tiles at once, eight streams 4.6 KB apart, read the bench model's int4 layers 30% slower from DRAM on Zen 5).
// Pair row s of a block goes to chain s % CH of its row: four chains a row for up to four rows (the vpdpwssd latency
// hidden at one row), two above (their registers). With four chains pair row 1 is its bits masked in place, 16 q, and
// its chain is divided by 16 at the fold; with two, shifted down first. `next`: the line kFetchAhead bytes ahead,
// pulled into L1 as blocks are read; `last`: the run's last tile (no next tile's scales to fetch).
template <int M>
inline void int4_tile_vnni(const uint8_t* w, const FixedPointRows& xs, int64_t K, int64_t group,
                           const Half* sz, c10::BFloat16* o, int64_t N, int64_t t, const uint8_t* next, bool last) {
  constexpr int CH = M <= 4 ? 4 : 2;
  const int64_t groups = K / group, pairs = K / 2;
  const uint8_t* tile = w + t * pairs * kInt8Tile;
  const __m512i low = _mm512_set1_epi16(0x000F), second = _mm512_set1_epi16(0x00F0);
  __m512 out[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  prefetch_scales<1>(sz, t, groups, 0);
  if (!last) prefetch_tile_scales(sz, t + 1, groups);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) prefetch_scales<1>(sz, t, groups, g + 1);
    float s[2 * kInt8Tile];  // the group's 16 scales, then 16 s * z
    load_scales_zeros(sz + ((t * groups + g) * 2) * kInt8Tile, s);
    const __m512 sv = _mm512_loadu_ps(s), mv = _mm512_loadu_ps(s + kInt8Tile);
    for (int64_t j = 0; j < xs.spans; ++j) {
      const int64_t k0 = g * group + j * kSpan, k1 = std::min(k0 + kSpan, (g + 1) * group);
      __m512i acc[CH][M];
      zero_sums(acc);
#pragma GCC unroll 8
      for (int64_t kk = k0 / 2; kk < k1 / 2; kk += 4) {  // a block: pair rows kk..kk+3
        if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + kk * kInt8Tile), _MM_HINT_T0);
        const __m512i block = _mm512_loadu_si512(tile + kk * kInt8Tile);
        const __m512i rows[4] = {
            _mm512_and_si512(block, low),
            CH == 4 ? _mm512_and_si512(block, second) : _mm512_and_si512(_mm512_srli_epi16(block, 4), low),
            _mm512_and_si512(_mm512_srli_epi16(block, 8), low), _mm512_srli_epi16(block, 12)};
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            int32_t pair;  // (n[2(kk + r)], n[2(kk + r) + 1])
            std::memcpy(&pair, xs.values + m * K + 2 * (kk + r), sizeof pair);
            acc[r % CH][m] = _mm512_dpwssd_epi32(acc[r % CH][m], rows[r], _mm512_set1_epi32(pair));
          }
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        __m512 sum;
        if constexpr (CH == 4)
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[1][m]), _mm512_set1_ps(1.f / 16),
                                _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(acc[0][m], acc[2][m]), acc[3][m])));
        else
          sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][m], acc[1][m]));
        const float unit = xs.units[(m * groups + g) * xs.spans + j];
        out[m] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sv, _mm512_set1_ps(unit)), out[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) out[m] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xs.sums[m * groups + g]), out[m]);
  }
  store_tiles<c10::BFloat16, M, 1>(out, o, N, t, [](float sum, int64_t) { return sum; });
}
#endif

#if defined(ASERVE_VNNI_ROWS) && defined(__AVX512BF16__)
// int4 on vdpbf16ps, where aserve's GEMMs multiply bf16 that way (bf16_products(): AMD's cores, which issue two
// vdpbf16ps a cycle and one vpdpwssd). A code q becomes the bf16 128 + q exactly, the nibble in the low bits of a
// 16-bit lane or'd into 0x4300 (128.0, whose last mantissa bit is worth 1): one vpternlogd. x stays bf16, so every
// product is exact and only the fp32 sums round; per group, s * sum(x (128 + q)) - (s z + 128 s) * sum(x) is
// s * sum(x (q - z)). The bench model's 120 int4 layers from DRAM (AMD EPYC Zen 5, 2 threads, alternated in one
// process with the vpdpwssd path): see int4.KERNEL_MAX_ROWS_BF16.
#define ASERVE_BF16_ROWS 1

// Each row's sum of x over each group ([M][groups], fp32), in this thread's scratch.
inline const float* group_sums_bf16(const at::Tensor& x, int M, int64_t K, int64_t group) {
  thread_local std::vector<float> sums;
  const int64_t groups = K / group;
  sums.resize(M * groups);
  const c10::BFloat16* rows = x.data_ptr<c10::BFloat16>();
  for (int m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) {
        const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, group - k)) - 1);
        const __m256i bits = _mm256_maskz_loadu_epi16(lanes, rows + m * x.stride(0) + g * group + k);
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
      }
      sums[m * groups + g] = _mm512_reduce_add_ps(total);
    }
  return sums.data();
}

// Four bf16 pair rows of the codes (a 64-byte block: pair row s in nibble s of each 16-bit lane) as 128 + q.
inline void int4_block_bf16(const uint8_t* at, __m512i (&rows)[4]) {
  const __m512i nibble = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const __m512i block = _mm512_loadu_si512(at);
  rows[0] = _mm512_ternarylogic_epi32(block, nibble, bias, 0xEA);  // (A & B) | C
  rows[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(block, 4), nibble, bias, 0xEA);
  rows[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(block, 8), nibble, bias, 0xEA);
  rows[3] = _mm512_or_si512(_mm512_srli_epi16(block, 12), bias);
}

// Group g's fold into a tile's 16 outputs: out + s * sum(x (128 + q)) - (s z + 128 s) * sum(x).
inline __m512 int4_fold_bf16(__m512 out, __m512 sums, const Half* sz, int64_t t, int64_t groups, int64_t g,
                             float xsum) {
  float s[2 * kInt8Tile];  // the group's 16 scales, then 16 s * z
  load_scales_zeros(sz + ((t * groups + g) * 2) * kInt8Tile, s);
  const __m512 sv = _mm512_loadu_ps(s);
  const __m512 offset = _mm512_fmadd_ps(sv, _mm512_set1_ps(128.f), _mm512_loadu_ps(s + kInt8Tile));
  return _mm512_fnmadd_ps(offset, _mm512_set1_ps(xsum), _mm512_fmadd_ps(sums, sv, out));
}

// 16 fp32 outputs to bf16 (to nearest even, as c10::BFloat16 rounds), the tile's real ones.
inline void store_tile_bf16(c10::BFloat16* o, int64_t N, int64_t t, __m512 out) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(kInt8Tile, N - t * kInt8Tile)) - 1);
  _mm256_mask_storeu_epi16(o + t * kInt8Tile, lanes, (__m256i)_mm512_cvtneps_pbh(out));
}

// R (1 or 2) tiles from t against a block of M (up to 4) rows of x, ldx apart: each broadcast pair of x feeds both
// tiles, pair row s of a block into chain s % 2 of its row and tile (16 chains at 2 tiles x 4 rows), the outputs
// waiting in L1 between groups (the sums, pair rows and constants fill the registers). Against one tile at a time in
// four chains, the bench model's 120 int4 layers at 16 rows (Zen 5, alternated in one process) took 6.19 against
// 6.52 ms from DRAM, 5.14 against 5.60 with most of them in L3. Each tile's stream is fetched into L1 kFetchAhead
// bytes of the R tiles' reads ahead, into `next` (the thread's R tiles after these) past the tiles' end: against
// fetching the next tiles at the pace these are read (two tiles ahead), the same 120 layers cold with the int4
// head's shapes left out (AMD EPYC Zen 4, avx512_bf16, 2 threads, a scratch switch alternated in one process, 12
// rounds) ran 1.02x as fast at 16 rows, 1.07x at 8 and 1.02x at 4, and GPTQ with its int4 head at batch 16 in the
// engine 1.02-1.04x (three runs of 8-10 rounds).
template <int M, int R>
inline void int4_tiles_bf16(const uint8_t* w, const c10::BFloat16* x, int64_t ldx, const float* xsums, int64_t K,
                            int64_t group, const Half* sz, c10::BFloat16* o, int64_t N, int64_t t,
                            const uint8_t* next) {
  const int64_t groups = K / group, pairs = K / 2;
  constexpr int64_t kAheadRows = kFetchAhead / (R * kInt8Tile);  // pair rows: kFetchAhead bytes of the R tiles' reads
  alignas(64) float outs[R][M][kInt8Tile];
#pragma GCC unroll 8
  for (int i = 0; i < R * M; ++i) _mm512_store_ps(outs[i / M][i % M], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_scales<R>(sz, t, groups, std::min(g + 1, groups - 1));
    __m512 acc[R][2][M];
#pragma GCC unroll 16
    for (int i = 0; i < R * 2 * M; ++i) acc[i / (2 * M)][(i / M) % 2][i % M] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t kk = g * group / 2; kk < (g + 1) * group / 2; kk += 4) {
      __m512i rows[R][4];
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i) {
        fetch_row(w + t * pairs * kInt8Tile, next, i, pairs, kk + kAheadRows);
        int4_block_bf16(w + ((t + i) * pairs + kk) * kInt8Tile, rows[i]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          int32_t pair;  // (x[2(kk + r)], x[2(kk + r) + 1])
          std::memcpy(&pair, x + m * ldx + 2 * (kk + r), sizeof pair);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
          for (int i = 0; i < R; ++i)
            acc[i][r % 2][m] = _mm512_dpbf16_ps(acc[i][r % 2][m], (__m512bh)rows[i][r], xv);
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
        _mm512_store_ps(outs[i][m], int4_fold_bf16(_mm512_load_ps(outs[i][m]), _mm512_add_ps(acc[i][0][m], acc[i][1][m]),
                                                   sz, t + i, groups, g, xsums[m * groups + g]));
  }
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) store_tile_bf16(o + m * N, N, t + i, _mm512_load_ps(outs[i][m]));
}

// int4_linear on vdpbf16ps: the rows in even blocks of at most four, each pair of tiles (and a thread's odd last tile
// alone) against every block in turn, the blocks after the first finding them in L1. A row's output is then the same
// bits at any number of rows this runs: its sums run the same chains in the same order.
void int4_linear_bf16(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
                      at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), tiles = tiled.size(0), groups = K / group;
  const float* xsums = group_sums_bf16(x, static_cast<int>(M), K, group);
  const uint8_t* w = tiled.data_ptr<uint8_t>();
  const Half* sz = scales_zeros.data_ptr<Half>();
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), pairs = K / 2;
  parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += 2) {
      const int64_t count = std::min<int64_t>(2, end - t);
      by_row_blocks(M, [&](auto m, int64_t m0) {
        constexpr int kRows = decltype(m)::value;
        // the first block fetches the thread's next tiles; the later ones find this pair in L1
        const uint8_t* next = m0 == 0 && t + count < end ? w + (t + count) * pairs * kInt8Tile : nullptr;
        const c10::BFloat16* xr = xp + m0 * ldx;
        const float* sums = xsums + m0 * groups;
        c10::BFloat16* rows = o + m0 * N;
        if (count == 2)
          int4_tiles_bf16<kRows, 2>(w, xr, ldx, sums, K, group, sz, rows, N, t, next);
        else
          int4_tiles_bf16<kRows, 1>(w, xr, ldx, sums, K, group, sz, rows, N, t, next);
      });
    }
  });
}
#endif

template <typename T, int M>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
                      at::Tensor& out) {
#if defined(ASERVE_VNNI_ROWS)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const int64_t K = x.size(1), N = out.size(1), tiles = tiled.size(0);
    const FixedPointRows xs = rows_as_fixed_point(x, M, K, group);
    const uint8_t* w = tiled.data_ptr<uint8_t>();
    const Half* sz = scales_zeros.data_ptr<Half>();
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    const int64_t pairs = K / 2;
    parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        int4_tile_vnni<M>(w, xs, K, group, sz, o, N, t,
                          fetch_ahead(w + t * pairs * kInt8Tile, w + end * pairs * kInt8Tile), t + 1 == end);
    });
    return;
  }
#endif
  constexpr int kTiles = int4_tiles_at_once(M);
  const int64_t K = x.size(1), N = out.size(1), tiles = tiled.size(0);
  const RowsAndSums xs = rows_and_group_sums<T>(x, M, K, group, true);
  const uint8_t* w = tiled.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const Half* sz = scales_zeros.data_ptr<Half>();
  by_tile_runs<kTiles>(tiles, [&](auto r, int64_t t, int64_t end) {
    int4_tiles<T, M, decltype(r)::value>(w, xs.rows, K, group, sz, xs.sums, o, N, t,
                                         next_run<decltype(r)::value>(w, t, end, K / 2));
  });
}

constexpr int64_t kInt4MaxRows = 16;  // int4.KERNEL_MAX_ROWS_BF16: where the rows run on vdpbf16ps, layers use all 16
// From here bf16 rows run on vdpbf16ps where the GEMMs do; one or two rows stay on vpdpwssd, bound by the bytes,
// which the pairs of tiles read as two streams (120 bench layers from DRAM, Zen 5: 2 rows 2.30 against 2.20 ms).
constexpr int64_t kInt4Bf16FromRows = 3;

#if defined(ASERVE_MADD_ROWS)
// int4_linear on vpmaddwd: each thread's tiles one at a time, against the rows in even blocks of at most four (their
// sums fill the registers), the blocks after the first finding the tile in L1. The bench model's 120 int4 layers from
// DRAM, fp32 (AMD EPYC Zen 3, avx2, 2 threads): see int4.KERNEL_MAX_ROWS_MADD.
template <typename T>
void int4_linear_madd(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
                      at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), tiles = tiled.size(0), pairs = K / 2, groups = K / group;
  const FixedPointRows xs = rows_as_fixed_point<T>(x, static_cast<int>(M), K, group);
  const uint8_t* w = tiled.data_ptr<uint8_t>();
  const Half* sz = scales_zeros.data_ptr<Half>();
  T* o = out.data_ptr<T>();
  parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      by_row_blocks(M, [&](auto m, int64_t m0) {  // the first block fetches ahead, the later ones find the tile in L1
        const uint8_t* ahead = m0 == 0 ? fetch_ahead(w + t * pairs * kInt8Tile, w + end * pairs * kInt8Tile) : nullptr;
        int4_tile_madd<decltype(m)::value, T>(w, xs.from_row(m0, K, groups), K, group, sz, o + m0 * N, N, t, ahead,
                                              m0 == 0 && t + 1 < end);
      });
  });
}
#endif

template <typename T>
void int4_linear_rows(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& sz, int64_t group, at::Tensor& out) {
#if defined(ASERVE_MADD_ROWS)
  int4_linear_madd<T>(x, tiled, sz, group, out);
#else
#if defined(ASERVE_BF16_ROWS)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (bf16_products() == Products::kDpbf16 && x.size(0) >= kInt4Bf16FromRows)
      return int4_linear_bf16(x, tiled, sz, group, out);
#endif
  if (x.size(0) > 8) {  // the other paths' kernels take up to 8 rows: blocks of 8
    for (int64_t m0 = 0; m0 < x.size(0); m0 += 8) {
      at::Tensor rows = out.narrow(0, m0, std::min<int64_t>(8, x.size(0) - m0));
      int4_linear_rows<T>(x.narrow(0, m0, rows.size(0)), tiled, sz, group, rows);
    }
    return;
  }
  switch (x.size(0)) {
    case 1: return int4_linear_impl<T, 1>(x, tiled, sz, group, out);
    case 2: return int4_linear_impl<T, 2>(x, tiled, sz, group, out);
    case 3: return int4_linear_impl<T, 3>(x, tiled, sz, group, out);
    case 4: return int4_linear_impl<T, 4>(x, tiled, sz, group, out);
    case 5: return int4_linear_impl<T, 5>(x, tiled, sz, group, out);
    case 6: return int4_linear_impl<T, 6>(x, tiled, sz, group, out);
    case 7: return int4_linear_impl<T, 7>(x, tiled, sz, group, out);
    case 8: return int4_linear_impl<T, 8>(x, tiled, sz, group, out);
  }
#endif
}

// What multiplies int4_linear's rows of this dtype: "vpmaddwd" or "vpdpwssd" (x made 16-bit integers sharing an
// exponent per span), "vdpbf16ps" (bf16 x as it is) or "fma" (each code widened to fp32), for int4.kernel_rows and
// the tests' expectations.
std::string int4_row_products(at::ScalarType dtype, int64_t rows) {
#if defined(ASERVE_MADD_ROWS)
  return "vpmaddwd";
#else
  if (dtype == at::kBFloat16) {
#if defined(ASERVE_BF16_ROWS)
    if (bf16_products() == Products::kDpbf16 && rows >= kInt4Bf16FromRows) return "vdpbf16ps";
#endif
#if defined(ASERVE_VNNI_ROWS)
    return "vpdpwssd";
#endif
  }
  return "fma";
#endif
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales_zeros, int64_t group,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int4_linear: x must be [rows, in] with unit inner stride");
  const int64_t K = x.size(1);
  check_int4_weights("int4_linear", x, K, tiled, scales_zeros, group, out_features);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kInt4MaxRows, "int4_linear: takes 1 to ", kInt4MaxRows, " rows, got ",
              x.size(0));
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: int4_linear_rows<float>(x, tiled, scales_zeros, group, out); break;
    case at::kBFloat16: int4_linear_rows<c10::BFloat16>(x, tiled, scales_zeros, group, out); break;
    default: TORCH_CHECK(false, "int4_linear: takes fp32 or bf16 (as gemm_int4 does), got ", x.scalar_type());
  }
  return out;
}

// The tiles back as a dense [out, in] weight in `like`'s dtype (the codes, unscaled): for batches too large for
// int8_linear, converted once per call and handed to the GEMM library.
template <typename T> void int8_untile_impl(const at::Tensor& tiled, at::Tensor& out) {
  const int64_t N = out.size(0), K = out.size(1);
  const int8_t* w = tiled.data_ptr<int8_t>();
  T* o = out.data_ptr<T>();
  parallel_for(0, tiled.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t width = std::min<int64_t>(kInt8Tile, N - t * kInt8Tile);
      const int8_t* tile = w + t * K * kInt8Tile;
      for (int64_t i = 0; i < width; ++i) {
        T* row = o + (t * kInt8Tile + i) * K;
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<T>(static_cast<float>(tile[k * kInt8Tile + i]));
      }
    }
  });
}

at::Tensor int8_untile(const at::Tensor& tiled, int64_t out_features, const at::Tensor& like) {
  TORCH_CHECK(tiled.dim() == 3 && tiled.is_contiguous() && tiled.scalar_type() == at::kChar &&
                  tiled.size(2) == kInt8Tile && tiled.size(0) * kInt8Tile >= out_features,
              "int8_untile: weight must be contiguous int8 tiles [ceil(out/16), in, 16]");
  at::Tensor out = at::empty({out_features, tiled.size(1)}, like.options());
  switch (like.scalar_type()) {
    case at::kFloat: int8_untile_impl<float>(tiled, out); break;
    case at::kBFloat16: int8_untile_impl<c10::BFloat16>(tiled, out); break;
    case at::kHalf: int8_untile_impl<c10::Half>(tiled, out); break;
    default: TORCH_CHECK(false, "int8_untile: unsupported dtype ", like.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("int8_linear(Tensor x, Tensor tiled, Tensor scales, int out_features) -> Tensor");
  m.def("int8_untile(Tensor tiled, int out_features, Tensor like) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor tiled, Tensor scales_zeros, int group, int out_features) -> Tensor");
  m.def("int4_row_products(ScalarType dtype, int rows) -> str", &int4_row_products);  // no tensor to dispatch on
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_untile", &int8_untile);
  m.impl("int4_linear", &int4_linear);
}
