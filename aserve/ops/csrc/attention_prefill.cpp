// Prefill attention over the paged KV cache, torch.ops.aserve.paged_prefill_attention: FlashAttention-style
// register tiles, the cache in the query's dtype or FP8 bytes. The same kernel over a step's own rows, no cache:
// torch.ops.aserve.varlen_attention (an encoder's bidirectional layers).
//
// Chunks of prompt tokens, each query attending to its chunk's cached context and causally to the chunk itself
// (its keys are written to the cache before this runs), FlashAttention's way: nothing of size keys x queries is
// kept. A tile is about kTileRows query rows (query tokens x the group's heads); a work item is up to
// kTilesPerItem consecutive tiles of a chunk, one kv head. Each tile's queries are loaded once, scaled and held
// transposed, [head_dim][rows]; the item's keys are walked a step at a time (kKeyStep; on AMX tiles amx_step's),
// read from the cache once a step for all of its tiles (widened to fp32 first when the cache is 16-bit or FP8),
// with a running max, sum and output per query row. Both products are register tiles of 6 rows x 2W columns
// (W = fVec::size()), as in a GEMM: the scores as keys x query rows (a key element broadcast against 2W query
// rows), the output as query rows x head dims (a probability broadcast against 2W dims of a value row). No
// transposes of the keys, no horizontal sums. Threads claim items as they come free, the costliest first, so the
// causal triangle's long items do not all land on one thread, nor does a fast core wait on one the VM slowed. bf16
// queries over bf16 keys and values on a CPU with AVX512-BF16 take vdpbf16ps instead, nothing widened
// (ASERVE_PREFILL_BF16, below), or AMX tiles where the CPU has them (ASERVE_PREFILL_AMX), unless its bf16 products
// run on fp32 FMAs (bf16_products(), as the GEMMs' and decode attention's do).
//
// A tile of a few rows (a prompt's tail after a prefix-cache hit, the last tokens of a chunk) would be mostly
// padding columns; it scores its keys across the vector instead (narrow_scores, narrow_scores_bf16), with the same
// bits. Whatever rows share its tile and item, a row's scores, steps and sums are the same: its output does not
// depend on how its prompt was split (tests/test_cpu_kernels.py), which the engine relies on to give a prompt the
// same logits whatever the prefix cache held.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_args.h"
#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

constexpr int kTileRows = 48;
constexpr int kKeyStep = 64;
// On AMX tiles an item's keys go in steps of up to kAmxMaxStep, as few as cover them and as even as they can be
// (a 136-token prompt: one step of 136, not 64 + 64 + 8; 256: two of 128): each step's products, softmax and
// bookkeeping cost a fixed part besides their per-key work, and the output's sums are loaded and stored once a
// step. Steps of 256 ran slower than two of 128 (their scores and probabilities outgrow L1).
constexpr int kAmxMaxStep = 192;
inline int64_t amx_step(int64_t keys) {
  const int64_t steps = std::max<int64_t>(1, (keys + kAmxMaxStep - 1) / kAmxMaxStep);
  return ((keys + steps - 1) / steps + 31) / 32 * 32;
}
constexpr int kCols = 2 * fVec::size();

// st[i][0..kCols) = sum_d k[i][d] * qt[d][0..kCols): MR keys' scores against kCols query rows.
template <int MR>
inline void score_tile(const float* const* k, const float* qt, int64_t ldq, int64_t D, float* st, int64_t ldst) {
  fReg acc[MR][2];  // registers (see fReg)
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = fVec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const fVec b0 = fVec::loadu(qt + d * ldq), b1 = fVec::loadu(qt + d * ldq + fVec::size());
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const fVec a(k[i][d]);
      acc[i][0] = at::vec::fmadd(a, b0, fVec(acc[i][0]));
      acc[i][1] = at::vec::fmadd(a, b1, fVec(acc[i][1]));
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    fVec(acc[i][0]).store(st + i * ldst);
    fVec(acc[i][1]).store(st + i * ldst + fVec::size());
  }
}

// o[r][0..kCols) = o[r][0..kCols) * corr[r] + sum_j pt[j][r] * v[j][0..kCols), for MR query rows r.
template <int MR>
inline void output_tile(const float* pt, int64_t ldp, const float* const* v, int64_t c, int64_t nk, float* o,
                        int64_t ldo, const float* corr) {
  fReg acc[MR][2];  // registers (see fReg)
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = fVec::loadu(o + i * ldo) * fVec(corr[i]);
    acc[i][1] = fVec::loadu(o + i * ldo + fVec::size()) * fVec(corr[i]);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const fVec b0 = fVec::loadu(v[j] + c), b1 = fVec::loadu(v[j] + c + fVec::size());
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const fVec a(pt[j * ldp + i]);
      acc[i][0] = at::vec::fmadd(a, b0, fVec(acc[i][0]));
      acc[i][1] = at::vec::fmadd(a, b1, fVec(acc[i][1]));
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    fVec(acc[i][0]).store(o + i * ldo);
    fVec(acc[i][1]).store(o + i * ldo + fVec::size());
  }
}

template <typename F> inline void by_rows(int64_t n, F&& f) {  // f(first, rows) in runs of 6, then the rest
  int64_t i = 0;
  for (; i + 6 <= n; i += 6) f(i, std::integral_constant<int, 6>{});
  switch (n - i) {
    case 5: f(i, std::integral_constant<int, 5>{}); break;
    case 4: f(i, std::integral_constant<int, 4>{}); break;
    case 3: f(i, std::integral_constant<int, 3>{}); break;
    case 2: f(i, std::integral_constant<int, 2>{}); break;
    case 1: f(i, std::integral_constant<int, 1>{}); break;
  }
}

// f(integral_constant<R>) for a tile's row count R in 1..16.
template <typename F> inline void by_row_count(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
#if defined(CPU_CAPABILITY_AVX512)
    case 9: return f(std::integral_constant<int, 9>{});
    case 10: return f(std::integral_constant<int, 10>{});
    case 11: return f(std::integral_constant<int, 11>{});
    case 12: return f(std::integral_constant<int, 12>{});
    case 13: return f(std::integral_constant<int, 13>{});
    case 14: return f(std::integral_constant<int, 14>{});
    case 15: return f(std::integral_constant<int, 15>{});
    case 16: return f(std::integral_constant<int, 16>{});
#endif
  }
}

// Rows a tile may have for narrow_scores: as many sums as vector registers allow beside a key vector.
constexpr int64_t kNarrowRows = fVec::size() >= 16 ? 16 : 8;
// Vectors of keys the narrow tiles take at once for R rows: each score is a chain of dependent products (over d, or
// d's pairs), so R chains alone left the FMA pipes waiting on their latency; 8 to 16 chains at once fill them.
constexpr int narrow_runs(int R) { return R <= 4 ? 4 : R <= 8 ? 2 : 1; }

// A run of tokens' pair of dims (2 * run values at `pairs`, token after token) as two rows of their values, widened:
// the dims' `run` values each, to `even` and `odd`. 16 tokens at a time on AVX-512 (fp32 and bf16 caches).
template <typename C> inline void unpair_run(const C* pairs, int64_t run, float* even, float* odd) {
  for (int64_t t = 0; t < run;) {
#if defined(CPU_CAPABILITY_AVX512)
    const int64_t n = std::min<int64_t>(16, run - t);
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    if constexpr (std::is_same_v<C, float>) {
      const __mmask16 lo = static_cast<__mmask16>(n >= 8 ? 0xFFFF : (1u << (2 * n)) - 1);
      const __mmask16 hi = static_cast<__mmask16>(n > 8 ? (1u << (2 * n - 16)) - 1 : 0);
      const __m512 a = _mm512_maskz_loadu_ps(lo, pairs + 2 * t), b = _mm512_maskz_loadu_ps(hi, pairs + 2 * t + 16);
      const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      _mm512_mask_storeu_ps(even + t, lanes, _mm512_permutex2var_ps(a, evens, b));
      const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
      _mm512_mask_storeu_ps(odd + t, lanes, _mm512_permutex2var_ps(a, odds, b));
      t += n;
      continue;
    } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
      const __m512i words = _mm512_maskz_loadu_epi32(lanes, pairs + 2 * t);
      _mm512_mask_storeu_ps(even + t, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      _mm512_mask_storeu_ps(odd + t, lanes, _mm512_castsi512_ps(_mm512_and_si512(words, high)));
      t += n;
      continue;
    }
#endif
    even[t] = static_cast<float>(pairs[2 * t]), odd[t] = static_cast<float>(pairs[2 * t + 1]);
    ++t;
  }
}

// score_tile's scores for a tile of R <= kNarrowRows query rows, keys across the vector: a full tile broadcasts a
// key element against kCols query rows, mostly padding where a chunk is a few tokens (a prompt's tail after a
// prefix-cache hit: 3 of 32 columns at one token and three heads a group); here each of W keys ([D][ldk] in kt,
// widened) is multiplied by a row's element broadcast, R sums. Every score is the same FMA chain over d as
// score_tile's, so the same bits; st's padding columns are zero, as a full tile's zero queries give.
template <int R>
inline void narrow_scores(const float* kt, int64_t ldk, int64_t nk, const float* qt, int64_t cols, int64_t D,
                          float* st) {
  constexpr int W = fVec::size(), U = narrow_runs(R);  // U vectors of keys at once: U * R chains of FMAs
  for (int64_t j = 0; j < nk; j += U * W) {
    fReg acc[U][R];
#pragma GCC unroll 16
    for (int i = 0; i < U * R; ++i) acc[i / R][i % R] = fVec(0.f);
    for (int64_t d = 0; d < D; ++d) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const fVec k = fVec::loadu(kt + d * ldk + j + u * W);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[u][r] = at::vec::fmadd(k, fVec(qt[d * cols + r]), fVec(acc[u][r]));
      }
    }
    float lanes[R][U * W];
#pragma GCC unroll 16
    for (int i = 0; i < U * R; ++i) fVec(acc[i / R][i % R]).store(lanes[i % R] + (i / R) * W);
    for (int64_t i = 0; i < std::min<int64_t>(U * W, nk - j); ++i) {
      float* row = st + (j + i) * cols;
      for (int r = 0; r < R; ++r) row[r] = lanes[r][i];
      std::fill(row + R, row + cols, 0.f);
    }
  }
}

// How far (in base-2 exponent units) a row's new maximum must pass the one in force to replace it. Until then its
// probabilities may reach 2^8 (fp32 and bf16 hold those as precisely as ones below 1) and its output needs no
// rescaling (corr exactly 1, a multiply skipped): most steps after a row's first.
constexpr float kLazyGrowth = 8.f;

// The online softmax over one walk step: for each query row r (a vector holds W rows' scores for one key), its
// running max m and sum l are updated by the nk scores st[0..nk)[r], which become their probabilities; corr[r]
// is what the row's output so far must be multiplied by. Scores are taken as they are and multiplied by `scale`
// here (exp(scale (x - max)) as one FMA in base 2), m kept unscaled. A row with no key yet (its window starts
// further on) keeps m = -inf; its scores, all -inf, give probabilities of 0, not NaN. Rows go two vectors at a
// time with their sums and maxima in registers, the maximum the plain max instruction (scores are never NaN).
inline void online_softmax(float* st, int64_t nk, int64_t padded, float scale, float* m, float* l, float* corr) {
  constexpr int W = fVec::size();
  const fVec lowest(-std::numeric_limits<float>::infinity());
  const fVec k(scale * kLog2e);
  auto rows = [&](int64_t r, auto count) {
    constexpr int V = decltype(count)::value;
    fVec peak[V], shift[V], sum[V];
    for (int u = 0; u < V; ++u) peak[u] = fVec::loadu(m + r + u * W);
    for (int64_t j = 0; j < nk; ++j)
      for (int u = 0; u < V; ++u) peak[u] = max_of(peak[u], fVec::loadu(st + j * padded + r + u * W));
    for (int u = 0; u < V; ++u) {
      const fVec none = peak[u] == lowest, old = fVec::loadu(m + r + u * W);
      // the maximum in force moves only past kLazyGrowth; from none (-inf) always
      const fVec grows = (peak[u] - old) * k > fVec(kLazyGrowth);
      peak[u] = fVec::blendv(old, peak[u], grows);
      shift[u] = fVec::blendv(peak[u] * k, fVec(0.f), none);  // 2^(x k - shift)
      const fVec moved = fVec::blendv(exp2_bounded(at::vec::fmsub(old, k, shift[u])), fVec(1.f), none);
      fVec::blendv(fVec(1.f), moved, grows).store(corr + r + u * W);
      sum[u] = fVec(0.f);
    }
    for (int64_t j = 0; j < nk; ++j)
      for (int u = 0; u < V; ++u) {
        const fVec prob = exp2_bounded(at::vec::fmsub(fVec::loadu(st + j * padded + r + u * W), k, shift[u]));
        prob.store(st + j * padded + r + u * W);
        sum[u] = sum[u] + prob;
      }
    for (int u = 0; u < V; ++u) {
      peak[u].store(m + r + u * W);
      (fVec::loadu(l + r + u * W) * fVec::loadu(corr + r + u * W) + sum[u]).store(l + r + u * W);
    }
  };
  int64_t r = 0;
  for (; r + 2 * W <= padded; r += 2 * W) rows(r, std::integral_constant<int, 2>{});
  for (; r < padded; r += W) rows(r, std::integral_constant<int, 1>{});
}

// Query tokens per item: about kTileRows rows (tokens x the group's heads), as a multiple of kCols rows where one
// near it exists, so that no score column is padding (3 heads a group, 16-lane vectors: 32 tokens = 96 rows
// instead of 16 = 48 rows in 64 columns).
inline int64_t tile_query_count(int64_t group) {
  const int64_t step = kCols / std::gcd<int64_t>(group, kCols);  // tokens whose rows fill whole columns
  const int64_t wanted = std::max<int64_t>(1, kTileRows / group);
  if (step * group <= 2 * kTileRows) return std::max<int64_t>(step, (wanted + step / 2) / step * step);
  return wanted;
}

// e4m3 widens as its value times 2^-8 (vec_helpers.h); prefill multiplies its rows by kFp8Unit to undo that, and
// takes the 2^8 out of the scales: scaled down, the smallest products fell below fp32's normal range (which
// vdpbf16ps flushes to zero, and fp32 FMAs round coarser), and differed from a bf16 or fp32 cache's.
template <typename C> constexpr float kFp8Unit = std::is_same_v<C, E4M3> ? 256.f : 1.f;

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 queries over a bf16 cache (or bf16 keys and values) on a CPU with AVX512-BF16: vdpbf16ps multiplies pairs
// of bf16 values and adds both products to an fp32 lane, so each instruction does twice the products of an fp32
// FMA and nothing is widened. The tiles keep their shapes, with pairs along the sum's dimension:
// - scores: the queries, unscaled, held as [D/2][rows] 32-bit pairs (a row's dims 2p, 2p+1; a query row read as
//   32-bit words is that already), against a key's pair broadcast: the keys are read in place, as they lie;
// - output: the probabilities rounded to bf16 as [keys/2][rows] pairs (keys 2j, 2j+1) against the values of the
//   same two keys interleaved [keys/2][D] (one vpermw-free widen-and-or per 16 dims).
// The scale is applied to the fp32 scores, and the probabilities are rounded to bf16 where the torch path rounds
// them (before its second matmul); the softmax's sums stay fp32.
#define ASERVE_PREFILL_BF16 1
using BF16 = c10::BFloat16;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline int32_t pair_at(const BF16* row, int64_t p) {  // dims 2p and 2p + 1 of a row, as one 32-bit word
  int32_t w;
  std::memcpy(&w, row + 2 * p, sizeof(w));
  return w;
}

// st[i][0..16 NV) = scale * sum_p k[i] pair p . qt[p][0..16 NV): MR keys' scores against 16 NV query rows. NV = 4
// where 64 rows remain: each broadcast key pair then feeds four dot products instead of two.
template <int MR, int NV>
inline void score_tile_bf16(const BF16* const* k, const uint32_t* qt, int64_t ldq, int64_t pairs, float scale,
                            float* st, int64_t ldst) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = as_bh(_mm512_loadu_si512(qt + p * ldq + 16 * v));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = as_bh(_mm512_set1_epi32(pair_at(k[i], p)));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
    }
  }
  if (scale != 1.f) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(acc[i][v], s);
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + i * ldst + 16 * v, acc[i][v]);
}

// o[r][c..c+16 NV) = o[r][c..c+16 NV) * corr[r] + sum_j pt[j][r] . vt[j][c..c+16 NV), over key pairs j, for MR
// rows r (o, vt: at column c already).
template <int MR, int NV>
inline void output_tile_bf16(const uint32_t* pt, int64_t ldp, const uint32_t* vt, int64_t ldv, int64_t pairs,
                             float* o, int64_t ldo, const float* corr) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    const __m512 c = _mm512_set1_ps(corr[i]);
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(o + i * ldo + 16 * v), c);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = as_bh(_mm512_loadu_si512(vt + j * ldv + 16 * v));
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pt[j * ldp + i])));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + i * ldo + 16 * v, acc[i][v]);
}

// f(column, width tag) over [0, n) (a multiple of 16): blocks of 64 columns (4 vectors), then one of 32 or 16.
template <typename F> inline void by_columns(int64_t n, F&& f) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) f(c, std::integral_constant<int, 4>{});
  if (c + 32 <= n) f(c, std::integral_constant<int, 2>{}), c += 32;
  if (c < n) f(c, std::integral_constant<int, 1>{});
}

// 16 bf16 values of two rows as 16 32-bit pairs (a in the low half).
inline __m512i interleave16(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// vt[j][0..D) = values of keys 2j and 2j+1, interleaved; an odd last key is paired with zeros.
inline void pair_values(const BF16* const* v, int64_t nk, int64_t D, uint32_t* vt) {
  for (int64_t j = 0; 2 * j < nk; ++j) {
    const BF16* a = v[2 * j];
    const bool two = 2 * j + 1 < nk;
    for (int64_t c = 0; c < D; c += 16) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c));
      const __m256i hi = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2 * j + 1] + c))
                             : _mm256_setzero_si256();
      _mm512_storeu_si512(vt + j * D + c, interleave16(lo, hi));
    }
  }
}

// FP8 rows (tag C) of D bytes as bf16 rows of their values in dst ([rows][D]): exact, every FP8 value is a bf16
// value. The bf16 tiles then take an FP8 cache as they take a bf16 one holding the same values.
template <typename C> inline void fp8_rows_as_bf16(const C* const* rows, int64_t n, int64_t D, BF16* dst) {
  const __m512 unit = _mm512_set1_ps(kFp8Unit<C>);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(rows[j]);
    for (int64_t c = 0; c < D; c += 32) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_mul_ps(fp8_16_as_float<C>(src + c + 16), unit),
                                                _mm512_mul_ps(fp8_16_as_float<C>(src + c), unit));
      _mm512_storeu_si512(dst + j * D + c, reinterpret_cast<const __m512i&>(pair));
    }
  }
}

// pt[j][0..padded) = probabilities of keys 2j and 2j+1 (st rows, fp32) rounded to bf16 pairs; an odd last key
// is paired with zeros.
inline void pair_probabilities(const float* st, int64_t nk, int64_t padded, uint32_t* pt) {
  for (int64_t j = 0; 2 * j < nk; ++j) {
    const bool two = 2 * j + 1 < nk;
    for (int64_t r = 0; r < padded; r += 16) {
      const __m256i lo = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * j * padded + r)));
      const __m256i hi = two ? reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * j + 1) * padded + r)))
                             : _mm256_setzero_si256();
      _mm512_storeu_si512(pt + j * padded + r, interleave16(lo, hi));
    }
  }
}

// 16 x 16 32-bit words transposed in registers: x[i] holds row i, afterwards column i.
inline void transpose16(__m512i x[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // then whole 128-bit lanes, between vectors
    t[i] = _mm512_shuffle_i32x4(x[i], x[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(x[i], x[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(x[i + 8], x[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(x[i + 8], x[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    x[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    x[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    x[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// score_tile_bf16's scores for a tile of R <= 16 query rows (16 columns), keys across the vector and read in place:
// the cache holds a block's keys as [D/2][block_size][2], so pair p of a run of up to 16 of a block's tokens is one
// (masked) load of 16 words, from `pair0` (the run's first token's pair 0) in steps of `stride`. Each row's pair
// is broadcast against it: R products a pair instead of a full tile's 16 key broadcasts, and no copy of the keys
// into rows. The sums, transposed in registers, are st's rows ([keys][16]) with score_tile_bf16's bits: each
// score is the same vdpbf16ps chain over the same pairs, the key in the same operand.
template <int R, int U>
inline void narrow_scores_bf16(const BF16* const* pair0, const int64_t* run, int64_t stride, const uint32_t* qt2,
                               int64_t pairs, float scale, float* st) {
  __mmask16 lanes[U];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) lanes[u] = static_cast<__mmask16>((1u << run[u]) - 1);
  __m512 acc[U][R];
#pragma GCC unroll 16
  for (int i = 0; i < U * R; ++i) acc[i / R][i % R] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m512bh k = as_bh(_mm512_maskz_loadu_epi32(lanes[u], pair0[u] + p * stride));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[u][r] = _mm512_dpbf16_ps(acc[u][r], k, as_bh(_mm512_set1_epi32(qt2[p * 16 + r])));
    }
  }
  for (int u = 0; u < U; st += run[u] * 16, ++u) {
    __m512i x[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      x[r] = r < R ? _mm512_castps_si512(scale != 1.f ? _mm512_mul_ps(acc[u][r], _mm512_set1_ps(scale)) : acc[u][r])
                   : _mm512_setzero_si512();
    transpose16(x);
    for (int64_t i = 0; i < run[u]; ++i) _mm512_storeu_si512(st + i * 16, x[i]);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// On CPUs with AMX tiles both products of a key step run on them, 16 x 16 x 32 at a time, in the same layouts:
// - scores: a key step's keys copied into [step][D] rows (zero past the last key) times the queries' pairs
//   [D/2][cols] (qt2, a tile's B layout already) into st [keys][cols];
// - output: the probabilities as [cols][kAmxMaxStep] bf16 rows (pair_probabilities' words transposed 16 x 16 in
//   registers; zero past the last key) times the values' pairs [step/2][D] (vt2, zero past the last key)
//   added into o [cols][D], its rows first scaled by their corrections.
#define ASERVE_PREFILL_AMX 1

// Tiles 0-3: a 2 x 2 block of sums (tile 2 i + j: A's rows i, B's columns j), 4-5: A's two row tiles, 6-7: B's
// two pair-row tiles. Four independent sums let one block's tdpbf16ps overlap the others' (one sum tile, as
// first written, chained every product behind the last); each A and B tile loaded feeds two products.
inline void configure_attention_tiles() { configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}); }

// The 2 x 2 blocks (or the 1-wide edges) of an RT x CT grid of 16 x 16 tiles: f(row tile, column tile, I, J).
template <typename F> inline void by_tile_blocks(int64_t row_tiles, int64_t col_tiles, F&& f) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int64_t i = 0; i < row_tiles; i += 2)
    for (int64_t j = 0; j < col_tiles; j += 2) {
      const bool two_rows = i + 1 < row_tiles, two_cols = j + 1 < col_tiles;
      if (two_rows && two_cols) f(i, j, Two{}, Two{});
      else if (two_rows) f(i, j, Two{}, One{});
      else if (two_cols) f(i, j, One{}, Two{});
      else f(i, j, One{}, One{});
    }
}

// One 32-deep step of a block: A tile 4 (+ 5) from a's rows [0, 16) (+ [16, 32)), lda elements apart; B tile 6
// (+ 7) from b's 16 pair rows at columns [0, 16) (+ [16, 32)), ldb words apart; then sums tile 2 i + j += A tile
// 4 + i . B tile 6 + j over the block's I x J tiles (tile numbers are immediates).
template <int I, int J, typename A> inline void block_step(const A* a, int64_t lda, const uint32_t* b, int64_t ldb) {
  _tile_loadd(4, a, lda * static_cast<int64_t>(sizeof(A)));
  if constexpr (I == 2) _tile_loadd(5, a + 16 * lda, lda * static_cast<int64_t>(sizeof(A)));
  _tile_loadd(6, b, ldb * 4);
  if constexpr (J == 2) _tile_loadd(7, b + 16, ldb * 4);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (J == 2) _tile_dpbf16ps(1, 4, 7);
  if constexpr (I == 2) _tile_dpbf16ps(2, 5, 6);
  if constexpr (I == 2 && J == 2) _tile_dpbf16ps(3, 5, 7);
}

// The block's sums stored to (or loaded from) c [16 I][16 J] fp32 with row stride ldc.
template <int I, int J> inline void store_sums(float* c, int64_t ldc) {
  _tile_stored(0, c, ldc * 4);
  if constexpr (J == 2) _tile_stored(1, c + 16, ldc * 4);
  if constexpr (I == 2) _tile_stored(2, c + 16 * ldc, ldc * 4);
  if constexpr (I == 2 && J == 2) _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

template <int I, int J> inline void load_sums(const float* c, int64_t ldc) {
  _tile_loadd(0, c, ldc * 4);
  if constexpr (J == 2) _tile_loadd(1, c + 16, ldc * 4);
  if constexpr (I == 2) _tile_loadd(2, c + 16 * ldc, ldc * 4);
  if constexpr (I == 2 && J == 2) _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
}

template <int I, int J> inline void zero_sums() {
  _tile_zero(0);
  if constexpr (J == 2) _tile_zero(1);
  if constexpr (I == 2) _tile_zero(2);
  if constexpr (I == 2 && J == 2) _tile_zero(3);
}

// st[j][c] for keys j < 16 * key_tiles, columns c < cols: keys [16 key_tiles][D] bf16 times qt2 [D/2][cols].
inline void score_tiles_amx(const BF16* keys, int64_t D, int64_t key_tiles, const uint32_t* qt2, int64_t cols,
                            float* st) {
  by_tile_blocks(key_tiles, cols / 16, [&](int64_t kt, int64_t ct, auto rows, auto columns) {
    constexpr int I = decltype(rows)::value, J = decltype(columns)::value;
    zero_sums<I, J>();
    for (int64_t d = 0; d < D; d += 32)
      block_step<I, J>(keys + kt * 16 * D + d, D, qt2 + d / 2 * cols + ct * 16, cols);
    store_sums<I, J>(st + kt * 16 * cols + ct * 16, cols);
  });
}

// p16[r][0..keys) = probabilities st[key][r] as bf16, rows r < cols, keys zero from nk to `keys` (a multiple of
// 32): 16 rows x 16 key pairs at a time, pair_probabilities' words transposed.
inline void probabilities_by_row(const float* st, int64_t nk, int64_t cols, int64_t keys, BF16* p16) {
  for (int64_t r0 = 0; r0 < cols; r0 += 16)
    for (int64_t j0 = 0; j0 < keys / 2; j0 += 16) {
      __m512i x[16];
      const auto key_row = [&](int64_t k) {  // key k's probabilities of rows r0..r0+15 as bf16, zero past nk
        return k < nk ? reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(st + k * cols + r0)))
                      : _mm256_setzero_si256();
      };
      for (int64_t i = 0; i < 16; ++i) x[i] = interleave16(key_row(2 * (j0 + i)), key_row(2 * (j0 + i) + 1));
      transpose16(x);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(p16 + (r0 + i) * kAmxMaxStep + 2 * j0, x[i]);
    }
}

// o[r][0..D) += p16[r][0..keys) . values, rows r < cols: vt2 [keys/2][D] pairs. fresh: o = the products (a
// tile's first step: nothing read, o need not be zeroed).
inline void output_tiles_amx(const BF16* p16, int64_t cols, int64_t keys, const uint32_t* vt2, int64_t D, float* o,
                             bool fresh) {
  by_tile_blocks(cols / 16, D / 16, [&](int64_t rt, int64_t ct, auto rows, auto columns) {
    constexpr int I = decltype(rows)::value, J = decltype(columns)::value;
    float* c = o + rt * 16 * D + ct * 16;
    if (fresh) zero_sums<I, J>();
    else load_sums<I, J>(c, D);
    for (int64_t k = 0; k < keys; k += 32)
      block_step<I, J>(p16 + rt * 16 * kAmxMaxStep + k, kAmxMaxStep, vt2 + k / 2 * D + ct * 16, D);
    store_sums<I, J>(c, D);
  });
}
#endif
#endif

// Rows fetched into L2 ahead of use: an item's queries and keys lie anywhere in memory (items go by cost, not
// address; the cache's blocks are scattered), too far apart for the hardware prefetchers.
inline void prefetch_l2(const void* row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line<2>(static_cast<const char*>(row) + i);
}

// Where a chunk's keys and values are. PagedRows: the KV cache, through the chunk's block table. FlatRows: the
// step's own key and value rows ([T, kv_heads, D], a chunk's token t at its row start + t), for an encoder's
// bidirectional layers, which keep nothing in the cache. keys(): `count` keys from token `first` as rows, written
// to `scratch` ([count][D]) where they are not rows already. key(): where a key lies, for prefetching (the cache
// stores a block's keys in pairs of dims, [D / 2][block_size][2]: a token's row-sized share of its block).
template <typename C> struct PagedRows {
  const C* k;
  const C* v;
  const int64_t* tables;
  int64_t table_width, block_size, head_stride, D;
  int64_t at(int64_t chunk, int64_t tok) const {
    const int64_t* table = tables + chunk * table_width;
    return (table[tok / block_size] * block_size + tok % block_size) * D;
  }
  const C* key(int64_t chunk, int64_t kvh, int64_t tok) const { return k + kvh * head_stride + at(chunk, tok); }
  const C* value(int64_t chunk, int64_t kvh, int64_t tok) const { return v + kvh * head_stride + at(chunk, tok); }
  // `count` values from token `first` as rows, a block's run at a time (a token's place costs a division)
  void values(int64_t chunk, int64_t kvh, int64_t first, int64_t count, const C** rows) const {
    for (int64_t j = 0; j < count;) {
      const int64_t tok = first + j, run = std::min(count - j, block_size - tok % block_size);
      const C* row = value(chunk, kvh, tok);
      for (int64_t t = 0; t < run; ++t) rows[j + t] = row + t * D;
      j += run;
    }
  }
  // Token tok's row-sized shares of its block's keys and values (what prefetching reads), and the tokens after it
  // in the block, whose shares follow: a run of them needs one division by the block size, not two a token.
  struct Run { const C* k; const C* v; int64_t first, count; };
  Run run_at(int64_t chunk, int64_t kvh, int64_t tok) const {
    const int64_t place = kvh * head_stride + at(chunk, tok);
    return {k + place, v + place, tok, block_size - tok % block_size};
  }
  // token tok's pair 0 (dims 0 and 1) in its block; its pair p is p * 2 * block_size further on
  const C* key_pairs(int64_t chunk, int64_t kvh, int64_t tok) const {
    const int64_t o = tok % block_size;
    return key(chunk, kvh, tok) - o * D + 2 * o;
  }
  void keys(int64_t chunk, int64_t kvh, int64_t first, int64_t count, C* scratch, const C** rows) const {
    for (int64_t j = 0; j < count;) {  // a block's run of tokens at a time, pair by pair
      const int64_t tok = first + j, o = tok % block_size, run = std::min(count - j, block_size - o);
      const C* pairs = key_pairs(chunk, kvh, tok);
      for (int64_t p = 0; p < D / 2; ++p, pairs += 2 * block_size)
        for (int64_t t = 0; t < run; ++t) std::memcpy(scratch + (j + t) * D + 2 * p, pairs + 2 * t, 2 * sizeof(C));
      for (int64_t t = 0; t < run; ++t) rows[j + t] = scratch + (j + t) * D;
      j += run;
    }
  }
};

template <typename C> struct FlatRows {
  const C* k;
  const C* v;
  const int64_t* starts;
  int64_t ks0, ks1, vs0, vs1;
  const C* key(int64_t chunk, int64_t kvh, int64_t tok) const { return k + (starts[chunk] + tok) * ks0 + kvh * ks1; }
  const C* value(int64_t chunk, int64_t kvh, int64_t tok) const { return v + (starts[chunk] + tok) * vs0 + kvh * vs1; }
  void values(int64_t chunk, int64_t kvh, int64_t first, int64_t count, const C** rows) const {
    for (int64_t j = 0; j < count; ++j) rows[j] = value(chunk, kvh, first + j);
  }
  struct Run { const C* k; const C* v; int64_t first, count; };
  Run run_at(int64_t chunk, int64_t kvh, int64_t tok) const {
    return {key(chunk, kvh, tok), value(chunk, kvh, tok), tok, 1};
  }
  void keys(int64_t chunk, int64_t kvh, int64_t first, int64_t count, C*, const C** rows) const {
    for (int64_t j = 0; j < count; ++j) rows[j] = key(chunk, kvh, first + j);
  }
};

// An item's query tiles (a chunk's consecutive tiles, one kv head) walk the keys together: each key step's keys
// and values are gathered (widened, paired or copied into tile rows) once and used by every tile while they are
// in L1, not fetched and gathered again by each tile. Fewer tiles an item where there would be too few items to
// keep the threads busy.
constexpr int64_t kTilesPerItem = 8;

// One thread's scratch, sized for the largest item: per tile of an item (slot g) its queries, output and softmax
// state; per key step its keys and values as the products take them.
struct PrefillScratch {
  int64_t padded, D;
  std::vector<float> qt, o, m, l, corr, pos;  // per slot; pos: each query row's position, as fp32
  std::vector<float> st, kbuf, vbuf, kt;  // kt: the fp32 path's keys [D][kKeyStep] for narrow tiles
  std::vector<uint32_t> qt2, pt2, vt2;  // the bf16 path's pairs: queries (per slot), probabilities, values
  // the bf16 path over an FP8 cache, or on AMX tiles: a step's keys (and FP8 values) as bf16 rows; on AMX tiles
  // the probabilities by row, p16 [padded][kAmxMaxStep]
  std::vector<c10::BFloat16> k16, v16, p16;
  PrefillScratch(int64_t padded, int64_t D, int64_t slots, bool pairs, bool fp8, bool amx)
      : padded(padded), D(D), qt(pairs ? 0 : slots * D * padded), o(slots * padded * D), m(slots * padded),
        l(slots * padded), corr(slots * padded), pos(slots * padded), st(max_step(amx) * padded),
        kbuf(pairs ? 0 : kKeyStep * D), vbuf(pairs ? 0 : kKeyStep * D), kt(pairs ? 0 : kKeyStep * D),
        qt2(pairs ? slots * D / 2 * padded : 0),
        pt2(pairs && !amx ? kKeyStep / 2 * padded : 0), vt2(pairs ? max_step(amx) / 2 * D : 0),
        k16(pairs && (fp8 || amx) ? max_step(amx) * D : 0), v16(pairs && fp8 ? max_step(amx) * D : 0),
        p16(amx ? padded * kAmxMaxStep : 0) {}
  static int64_t max_step(bool amx) { return amx ? kAmxMaxStep : kKeyStep; }
};

// T: the query's and output's type; C: the keys' and values' (T, or an FP8 tag with k_scale / v_scale folded in);
// Rows: where they are (PagedRows, FlatRows). contexts[c]: chunk c's keys before its first query (0 for FlatRows).
// causal false: every query of a chunk sees all of its keys (no window).
template <typename T, typename C, typename Rows>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& query, const Rows& kv, int64_t num_kv_heads,
                            const int64_t* starts, const int64_t* contexts, int64_t chunks, double scale,
                            int64_t window, double softcap, double k_scale, double v_scale, bool causal) {
  const int64_t num_heads = query.size(1), D = query.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_queries = tile_query_count(group);
  const int64_t max_rows = tile_queries * group, padded = (max_rows + kCols - 1) / kCols * kCols;
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float cap = static_cast<float>(softcap), neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full_cols = D / kCols * kCols;
  // An encoder's output rows (FlatRows: a whole step's prompts, every head; 13 MB for 8.4K BERT-base tokens) are
  // written with streaming stores on the bf16 path: each row is whole 64-byte lines, and plain stores first read
  // every line they overwrite. 57 prompts of 16-256 tokens, Xeon with AMX, 2 threads: 13.08 -> 11.65 ms a call;
  // the embedding run 7.90 -> 7.58 s though the next GEMM reads them from memory. Not measured for a decoder's
  // prefill chunks (PagedRows), which keep plain stores.
  [[maybe_unused]] constexpr bool stream_out = std::is_same_v<Rows, FlatRows<C>>;
#ifdef ASERVE_PREFILL_BF16  // an FP8 cache too, its rows made bf16 a key step at a time (fp8_rows_as_bf16)
  // not where bf16 products run on fp32 FMAs (bf16_products(): Intel cores without AMX, where vdpbf16ps issues
  // once every two cycles and the FMAs twice a cycle): there the fp32 tiles take bf16 and FP8 rows widened
  const bool pairs = std::is_same_v<T, BF16> && (std::is_same_v<C, BF16> || is_fp8<C>) && D % 32 == 0 && D <= 512 &&
                     bf16_products() != Products::kFma;
#else
  const bool pairs = false;
#endif
#ifdef ASERVE_PREFILL_AMX
  const bool amx = pairs && amx_ready();
#else
  const bool amx = false;
#endif
  if constexpr (is_fp8<C>) {  // the rows hold their values, not e4m3's 2^-8 of them: the scales without the 2^8
    k_scale /= kFp8Unit<C>, v_scale /= kFp8Unit<C>;
  }
  const float fscale = static_cast<float>(scale * k_scale), vscale = static_cast<float>(v_scale);
  // where the scale is applied: the fp32 path scales its queries; bf16 pairs' scores are scaled in the softmax's
  // exponent unless a softcap needs them scaled first
  const float tile_scale = pairs && cap > 0.f ? fscale : 1.f, softmax_scale = pairs && cap == 0.f ? fscale : 1.f;

  // A tile: query tokens [q0, q0 + nq) of a chunk. An item: `tiles` consecutive tiles from q0, one kv head.
  struct Item { int64_t chunk, kvh, q0, tiles, cost; };
  auto key_range = [&](int64_t chunk, int64_t q0, int64_t nq) {  // the keys tokens [q0, q0 + nq) see: [first, end)
    const int64_t ctx = contexts[chunk], n = starts[chunk + 1] - starts[chunk];
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx + q0 - window + 1) : 0;
    return std::pair<int64_t, int64_t>{first, causal ? ctx + q0 + nq : ctx + n};
  };
  const auto item_tokens = [&](const Item& item) {  // its query tokens, [q0, q0 + count)
    return std::min(item.tiles * tile_queries, starts[item.chunk + 1] - starts[item.chunk] - item.q0);
  };
  int64_t tiles_per_item = kTilesPerItem;
  std::vector<Item> items;
  for (;; tiles_per_item /= 2) {
    items.clear();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n = starts[c + 1] - starts[c], span = tiles_per_item * tile_queries;
      for (int64_t q0 = 0; q0 < n; q0 += span) {
        Item item{c, 0, q0, (std::min(span, n - q0) + tile_queries - 1) / tile_queries, 0};
        for (int64_t t = q0; t < std::min(n, q0 + span); t += tile_queries) {
          const int64_t nq = std::min(tile_queries, n - t);
          const auto [first, end] = key_range(c, t, nq);
          item.cost += nq * (end - first);
        }
        for (int64_t h = 0; h < num_kv_heads; ++h, ++item.kvh) items.push_back(item);
      }
    }
    if (tiles_per_item == 1 || static_cast<int64_t>(items.size()) >= 4 * at::get_num_threads()) break;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // Tiles of a few rows score their keys across the vector (narrow_scores, narrow_scores_bf16), read from the
  // cache's pairs; not over FP8 bytes, a step's own rows (FlatRows) or AMX tiles.
  constexpr bool kNarrowKeys = std::is_same_v<Rows, PagedRows<C>> && !is_fp8<C>;
  const int64_t narrow_rows = kNarrowKeys && !amx ? (pairs ? 16 : kNarrowRows) : 0;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::atomic<int64_t> next_item{0};  // items are claimed in that order as threads come free

  parallel_for(0, threads, 1, [&](int64_t, int64_t) {  // each thread claims items until none is left
    PrefillScratch s(padded, D, tiles_per_item, pairs, is_fp8<C>, amx);
#ifdef ASERVE_PREFILL_AMX
    if (amx) configure_attention_tiles();
#endif
    std::vector<float> row(D);
    const int64_t max_step = PrefillScratch::max_step(amx);
    std::vector<const C*> krow(max_step), vrow(max_step);
    std::vector<C> key_rows(std::is_same_v<Rows, PagedRows<C>> ? max_step * D : 0);  // keys unpaired (PagedRows)
    std::vector<const c10::BFloat16*> k16(max_step), v16(max_step);  // FP8 with pairs: the scratch's rows
    for (int64_t j = 0; pairs && is_fp8<C> && j < max_step; ++j)
      k16[j] = s.k16.data() + j * D, v16[j] = s.v16.data() + j * D;
    std::vector<const float*> kf(kKeyStep), vf(kKeyStep);
    struct Tile { int64_t q0, nq, rows, cols, lo, hi; bool started; };
    std::vector<Tile> tiles(tiles_per_item);
    const auto is_narrow = [&](const Tile& tile) { return tile.rows <= narrow_rows; };
    const auto claim = [&] { return static_cast<size_t>(next_item.fetch_add(1, std::memory_order_relaxed)); };
    for (size_t it = claim(), after; it < items.size(); it = after) {
      after = claim();  // this thread's next item, claimed now so that its rows can be prefetched
      const Item item = items[it];
      const int64_t ctx = contexts[item.chunk], count = item_tokens(item);
      for (int64_t g = 0; g < item.tiles; ++g) {
        Tile& tile = tiles[g];
        tile.q0 = item.q0 + g * tile_queries, tile.nq = std::min(tile_queries, item.q0 + count - tile.q0);
        tile.rows = tile.nq * group;
        // score columns: the tile's rows rounded up to whole vectors (pairs) or tiles (fp32), not the largest's
        tile.cols = pairs ? (tile.rows + 15) / 16 * 16 : (tile.rows + kCols - 1) / kCols * kCols;
        std::tie(tile.lo, tile.hi) = key_range(item.chunk, tile.q0, tile.nq);
        tile.started = false;
      }
      const int64_t lo = tiles[0].lo, hi = tiles[item.tiles - 1].hi;  // every tile's keys, [lo, hi)
      // The next item's queries, keys and values go into L2 while this one runs, a few rows before each tile's
      // products (what is left of a step's share at its end): they may lie in DRAM (a step's rows outgrow the
      // caches), too scattered for the hardware prefetchers.
      const bool more = after < items.size();
      const Item next = more ? items[after] : item;
      const int64_t next_count = more ? item_tokens(next) : 0;
      const auto [next_lo, next_hi] = key_range(next.chunk, next.q0, std::max<int64_t>(next_count, 1));
      const int64_t next_queries = next_count * group, to_fetch = more ? next_queries + next_hi - next_lo : 0;
      const int64_t step = amx ? amx_step(hi - lo) : kKeyStep;
      const int64_t walk_steps = std::max<int64_t>(1, (hi - lo + step - 1) / step) * item.tiles;
      const int64_t tiles_a_step = (kKeyStep + 5) / 6 * ((padded + 63) / 64) + (max_rows + 5) / 6 * ((D + 63) / 64);
      const int64_t fetch_a_tile = (to_fetch + walk_steps * tiles_a_step - 1) / (walk_steps * tiles_a_step);
      const int64_t fetch_a_step = (to_fetch + walk_steps - 1) / walk_steps;
      int64_t fetched = 0, walked = 0;
      typename Rows::Run ahead{nullptr, nullptr, 0, 0};  // the run of the next item's keys being fetched
      const auto fetch_next = [&](int64_t n) {
        for (; n > 0 && fetched < to_fetch; --n, ++fetched) {
          if (fetched < next_queries) {
            prefetch_l2(q_ptr + (starts[next.chunk] + next.q0 + fetched / group) * qs0 +
                            (next.kvh * group + fetched % group) * qs1, D * sizeof(T));
          } else {
            const int64_t tok = next_lo + fetched - next_queries;
            if (tok >= ahead.first + ahead.count) ahead = kv.run_at(next.chunk, next.kvh, tok);
            prefetch_l2(ahead.k + (tok - ahead.first) * D, D * sizeof(C));
            prefetch_l2(ahead.v + (tok - ahead.first) * D, D * sizeof(C));
          }
        }
      };
      const int64_t h0 = item.kvh * group;
      for (int64_t g = 0; g < item.tiles; ++g) {  // each tile's queries, positions and state
        const Tile& tile = tiles[g];
        const int64_t row0 = starts[item.chunk] + tile.q0;
        // queries as [D][cols] (fp32, scaled) or [D/2][cols] pairs (bf16, as they are); row r = query qi's
        // head g at r = qi * group + g
        const auto query_row = [&](int64_t r) { return q_ptr + (row0 + r / group) * qs0 + (h0 + r % group) * qs1; };
        if (pairs) {
#ifdef ASERVE_PREFILL_BF16
          uint32_t* qt2 = s.qt2.data() + g * D / 2 * padded;
          for (int64_t r0 = 0; r0 < tile.rows; r0 += 16)  // 16 rows' words at a time, transposed in registers
            for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
              __m512i x[16];
              for (int64_t i = 0; i < 16; ++i)
                x[i] = r0 + i < tile.rows ? _mm512_loadu_si512(query_row(r0 + i) + 2 * p0) : _mm512_setzero_si512();
              transpose16(x);
              for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(qt2 + (p0 + i) * tile.cols + r0, x[i]);
            }
#endif
        } else {
          float* qt = s.qt.data() + g * D * padded;
          std::fill(qt, qt + D * tile.cols, 0.f);
          for (int64_t r = 0; r < tile.rows; ++r) {
            load_row(query_row(r), row.data(), D);
            for (int64_t d = 0; d < D; ++d) qt[d * tile.cols + r] = row[d] * fscale;
          }
        }
        float* pos = s.pos.data() + g * padded;
        for (int64_t r = 0; r < tile.rows; ++r) pos[r] = static_cast<float>(ctx + tile.q0 + r / group);
        std::fill(pos + tile.rows, pos + padded, pos[tile.rows - 1]);  // padding rows: copies of the last
        std::fill(s.m.data() + g * padded, s.m.data() + (g + 1) * padded, neg_inf);
        std::fill(s.l.data() + g * padded, s.l.data() + (g + 1) * padded, 0.f);
        if (!amx) std::fill(s.o.data() + g * padded * D, s.o.data() + g * padded * D + tile.cols * D, 0.f);
      }
      // Steps of kKeyStep keys lie at multiples of it, wherever the item's keys start: a row's keys then fall in
      // the same steps (the online softmax's sums and maxima, one per step) whichever rows share its item. Walked
      // from `lo`, a sliding window's tail after a prefix-cache hit summed its keys in other steps than the same
      // row in its whole prompt. (AMX steps are sized by the item's keys: not aligned.)
      for (int64_t t0 = lo, t1; t0 < hi; t0 = t1) {
        t1 = std::min(hi, amx ? t0 + step : (t0 / step + 1) * step);
        const int64_t nk = t1 - t0;
        bool wide = false, narrow = false;  // whether the step's tiles take keys as rows, or in place / as kt
        for (int64_t g = 0; g < item.tiles; ++g)
          if (t0 < tiles[g].hi && t0 + nk > tiles[g].lo) (is_narrow(tiles[g]) ? narrow : wide) = true;
        if (wide) kv.keys(item.chunk, item.kvh, t0, nk, key_rows.data(), krow.data());
        if constexpr (kNarrowKeys) {
          if (narrow && !pairs) {  // the keys widened as [D][kKeyStep], zero past the last
            float* kt = s.kt.data();
            for (int64_t j = 0; j < nk;) {
              const int64_t tok = t0 + j, run = std::min(nk - j, kv.block_size - tok % kv.block_size);
              const C* pair0 = kv.key_pairs(item.chunk, item.kvh, tok);
              for (int64_t p = 0; p < D / 2; ++p)
                unpair_run(pair0 + p * 2 * kv.block_size, run, kt + 2 * p * kKeyStep + j,
                           kt + (2 * p + 1) * kKeyStep + j);
              j += run;
            }
            const int64_t whole = (nk + fVec::size() - 1) / fVec::size() * fVec::size();
            for (int64_t d = 0; d < D; ++d) std::fill(kt + d * kKeyStep + nk, kt + d * kKeyStep + whole, 0.f);
          }
        }
        kv.values(item.chunk, item.kvh, t0, nk, vrow.data());
        // the step's keys and values as the products take them, once for every tile
#ifdef ASERVE_PREFILL_BF16
        const BF16* const* keys = reinterpret_cast<const BF16* const*>(krow.data());
        if (pairs) {
          const BF16* const* values = reinterpret_cast<const BF16* const*>(vrow.data());
          if constexpr (is_fp8<C>) {
            fp8_rows_as_bf16(krow.data(), nk, D, s.k16.data());
            fp8_rows_as_bf16(vrow.data(), nk, D, s.v16.data());
            keys = k16.data(), values = v16.data();
          }
          pair_values(values, nk, D, s.vt2.data());
#ifdef ASERVE_PREFILL_AMX
          if (amx) {  // the keys as [16 tiles][D] rows, zero past the last; the values' pairs zero past it too
            BF16* rows16 = s.k16.data();
            for (int64_t j = 0; j < nk; ++j)
              if (keys[j] != rows16 + j * D) std::memcpy(rows16 + j * D, keys[j], D * sizeof(BF16));
            std::fill(rows16 + nk * D, rows16 + (nk + 15) / 16 * 16 * D, BF16(0.f));
            std::fill(s.vt2.begin() + (nk + 1) / 2 * D, s.vt2.begin() + (nk + 31) / 32 * 16 * D, 0u);
          }
#endif
        }
#endif
        if (!pairs) {
          for (int64_t j = 0; j < nk; ++j) {
            if constexpr (std::is_same_v<C, float>) {
              kf[j] = krow[j];
              vf[j] = vrow[j];
            } else {
              if (wide) load_row(krow[j], s.kbuf.data() + j * D, D);
              load_row(vrow[j], s.vbuf.data() + j * D, D);
              if constexpr (kFp8Unit<C> != 1.f) {
                scale_row(s.kbuf.data() + j * D, kFp8Unit<C>, D);
                scale_row(s.vbuf.data() + j * D, kFp8Unit<C>, D);
              }
              kf[j] = s.kbuf.data() + j * D;
              vf[j] = s.vbuf.data() + j * D;
            }
          }
        }
        for (int64_t g = 0; g < item.tiles; ++g) {
          Tile& tile = tiles[g];
          if (t0 >= tile.hi || t0 + nk <= tile.lo) continue;  // none of this step's keys is the tile's
          const int64_t tk = std::min(nk, tile.hi - t0), cols = tile.cols, rows = tile.rows;  // the tile's keys
          float* o = s.o.data() + g * padded * D;
          float* m = s.m.data() + g * padded;
          float* l = s.l.data() + g * padded;
          float* corr = s.corr.data() + g * padded;
          const float* pos = s.pos.data() + g * padded;
          float* st = s.st.data();  // [tk][cols] scores, then probabilities
          if (pairs) {
#ifdef ASERVE_PREFILL_BF16
            const uint32_t* qt2 = s.qt2.data() + g * D / 2 * padded;
#ifdef ASERVE_PREFILL_AMX
            if (amx) {
              score_tiles_amx(s.k16.data(), D, (tk + 15) / 16, qt2, cols, st);
              if (tile_scale != 1.f)
                for (int64_t j = 0; j < tk; ++j) scale_row(st + j * cols, tile_scale, cols);
            }
#endif
            bool done = false;
            if constexpr (kNarrowKeys && std::is_same_v<C, BF16>) {
              if (is_narrow(tile)) {  // keys read in place, a block's run of up to 16 at a time
                by_row_count(rows, [&](auto r) {
                  constexpr int R = decltype(r)::value, U = narrow_runs(R);
                  for (int64_t j = 0; j < tk;) {  // U runs of up to 16 of a block's tokens (none: run 0)
                    const BF16* pair0[U];
                    int64_t run[U], first = j;
                    for (int u = 0; u < U; ++u) {
                      const int64_t tok = t0 + j;
                      run[u] = std::min({tk - j, kv.block_size - tok % kv.block_size, int64_t{16}});
                      pair0[u] = run[u] > 0 ? kv.key_pairs(item.chunk, item.kvh, tok) : pair0[0];
                      j += run[u];
                    }
                    fetch_next(fetch_a_tile);
                    narrow_scores_bf16<R, U>(pair0, run, 2 * kv.block_size, qt2, D / 2, tile_scale, st + first * 16);
                  }
                });
                done = true;
              }
            }
            if (!amx && !done) by_columns(cols, [&](int64_t c, auto nv) {
              by_rows(tk, [&](int64_t i, auto mr) {
                fetch_next(fetch_a_tile);
                score_tile_bf16<decltype(mr)::value, decltype(nv)::value>(keys + i, qt2 + c, cols, D / 2,
                                                                          tile_scale, st + i * cols + c, cols);
              });
            });
#endif
          } else {
            const float* qt = s.qt.data() + g * D * padded;
            if (is_narrow(tile)) {
              fetch_next(fetch_a_tile);
              by_row_count(rows, [&](auto r) {
                narrow_scores<decltype(r)::value>(s.kt.data(), kKeyStep, tk, qt, cols, D, st);
              });
            } else {
              for (int64_t c = 0; c < cols; c += kCols)
                by_rows(tk, [&](int64_t i, auto mr) {
                  fetch_next(fetch_a_tile);
                  score_tile<decltype(mr)::value>(kf.data() + i, qt + c, cols, D, st + i * cols + c, cols);
                });
            }
          }
          // softcap, mask and the online softmax, each across query rows: a vector holds W rows' scores for one
          // key (padding rows too: their queries are zero, their results unused)
          const fVec lowest(neg_inf);
          if (cap > 0.f)
            for (int64_t j = 0; j < tk; ++j)
              for (int64_t r = 0; r < cols; r += fVec::size()) {
                const fVec x = fVec::loadu(st + j * cols + r);
                (tanh_rational(x / fVec(cap)) * fVec(cap)).store(st + j * cols + r);
              }
          const int64_t first_pos = ctx + tile.q0, last_pos = ctx + tile.q0 + tile.nq - 1;
          if ((causal && t0 + tk - 1 > first_pos) || (window > 0 && t0 <= last_pos - window)) {  // some masked
            for (int64_t j = 0; j < tk; ++j)
              for (int64_t r = 0; r < cols; r += fVec::size()) {
                const fVec key(static_cast<float>(t0 + j)), at = fVec::loadu(pos + r);
                fVec masked = key > at;
                if (window > 0) masked = masked | (key <= at - fVec(static_cast<float>(window)));
                fVec::blendv(fVec::loadu(st + j * cols + r), lowest, masked).store(st + j * cols + r);
              }
          }
          online_softmax(st, tk, cols, softmax_scale, m, l, corr);
          if (pairs) {
#ifdef ASERVE_PREFILL_BF16
#ifdef ASERVE_PREFILL_AMX
            if (amx) {
              const int64_t keys32 = (tk + 31) / 32 * 32;
              probabilities_by_row(st, tk, cols, keys32, s.p16.data());
              for (int64_t r = 0; tile.started && r < cols; ++r)  // corr 1: the maximum held; 0: o is 0
                if (corr[r] != 1.f && corr[r] != 0.f) scale_row(o + r * D, corr[r], D);
              output_tiles_amx(s.p16.data(), cols, keys32, s.vt2.data(), D, o, !tile.started);
              tile.started = true;
              fetch_next(fetch_a_step * ++walked - fetched);
              continue;
            }
#endif
            pair_probabilities(st, tk, cols, s.pt2.data());
            const int64_t key_pairs = (tk + 1) / 2;
            by_rows(rows, [&](int64_t r, auto mr) {
              by_columns(D, [&](int64_t c, auto nv) {
                fetch_next(fetch_a_tile);
                output_tile_bf16<decltype(mr)::value, decltype(nv)::value>(
                    s.pt2.data() + r, cols, s.vt2.data() + c, D, key_pairs, o + r * D + c, D, corr + r);
              });
            });
#endif
          } else {
            by_rows(rows, [&](int64_t r, auto mr) {
              fetch_next(fetch_a_tile);
              for (int64_t c = 0; c < full_cols; c += kCols)
                output_tile<decltype(mr)::value>(st + r, cols, vf.data(), c, tk, o + r * D + c, D, corr + r);
              for (int64_t i = r; i < r + decltype(mr)::value; ++i)  // head dims past the last full tile
                for (int64_t c = full_cols; c < D; ++c) {
                  float acc = o[i * D + c] * corr[i];
                  for (int64_t j = 0; j < tk; ++j) acc += st[j * cols + i] * vf[j][c];
                  o[i * D + c] = acc;
                }
            });
          }
          fetch_next(fetch_a_step * ++walked - fetched);  // what this step's share has left
        }
      }
      for (int64_t g = 0; g < item.tiles; ++g) {
        const Tile& tile = tiles[g];
        const int64_t row0 = starts[item.chunk] + tile.q0;
        const float* l = s.l.data() + g * padded;
        for (int64_t r = 0; r < tile.rows; ++r) {
          T* dst = o_ptr + (row0 + r / group) * os0 + (h0 + r % group) * os1;
          float* src = s.o.data() + (g * padded + r) * D;
#ifdef ASERVE_PREFILL_BF16
          if constexpr (std::is_same_v<T, BF16>) {
            if (pairs) {  // scaled and rounded to bf16 in one pass
              const __m512 inv = _mm512_set1_ps(vscale / l[r]);
              if (stream_out && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {  // whole lines, D % 32 == 0
                for (int64_t c = 0; c < D; c += 32) {
                  const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + c), inv);
                  const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + c + 16), inv);
                  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + c),
                                      reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
                }
                continue;
              }
              for (int64_t c = 0; c < D; c += 16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + c), inv))));
              continue;
            }
          }
#endif
          scale_row(src, vscale / l[r], D);
          store_row(src, dst, D);
        }
      }
    }
#ifdef ASERVE_PREFILL_BF16
    if (stream_out && pairs) _mm_sfence();  // the streamed rows visible before the threads' barrier
#endif
#ifdef ASERVE_PREFILL_AMX
    if (amx) _tile_release();
#endif
  });
}

template <typename X> struct Tag { using type = X; };

template <typename T>
void prefill_attention_by_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                                int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  const int64_t num_kv_heads = k_cache.size(0), block_size = k_cache.size(2), D = k_cache.size(3);
  const int64_t head_stride = k_cache.size(1) * block_size * D;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t chunks = context_lens.size(0), width = block_tables.size(1);
  auto run = [&](auto tag, double ks, double vs) {
    using C = typename decltype(tag)::type;
    const PagedRows<C> kv{reinterpret_cast<const C*>(k_cache.const_data_ptr()),
                          reinterpret_cast<const C*>(v_cache.const_data_ptr()), tables, width, block_size,
                          head_stride, D};
    prefill_attention_impl<T, C>(out, query, kv, num_kv_heads, starts, contexts, chunks, scale, window, softcap, ks,
                                 vs, true);
  };
  switch (kv_format) {
    case 0: return run(Tag<T>{}, k_scale, v_scale);
    case 1: return run(Tag<E4M3>{}, k_scale * 256.0, v_scale * 256.0);
    case 2: return run(Tag<E5M2>{}, k_scale, v_scale);
  }
  TORCH_CHECK(false, "paged_prefill_attention: kv_format must be 0 (the query's dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void check_query_starts(const char* op, const at::Tensor& query_starts, int64_t chunks, int64_t rows) {
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_starts.is_contiguous() &&
                  query_starts.numel() == chunks + 1,
              op, ": query_starts must be contiguous int64 [chunks + 1]");
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  TORCH_CHECK(chunks == 0 || starts[0] >= 0, op, ": query_starts must rise within the query's rows");
  for (int64_t c = 0; c < chunks; ++c)
    TORCH_CHECK(starts[c] <= starts[c + 1] && starts[c + 1] <= rows, op,
                ": query_starts must rise within the query's rows");
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                             int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  check_attention_args("paged_prefill_attention", out, query, k_cache, v_cache, kv_format);
  const int64_t chunks = context_lens.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() && context_lens.dim() == 1,
              "context_lens must be a contiguous int64 [chunks] vector");
  check_query_starts("paged_prefill_attention", query_starts, chunks, query.size(0));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == chunks,
              "block_tables must be contiguous int64 [chunks, width]");
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  std::vector<int64_t> tokens(chunks);  // each chunk's context and its own tokens
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(contexts[c] >= 0, "context_lens must be >= 0");
    tokens[c] = contexts[c] + starts[c + 1] - starts[c];
  }
  check_block_tables("paged_prefill_attention", block_tables, tokens.data(), k_cache);
  if (chunks == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat: return prefill_attention_by_cache<float>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kBFloat16: return prefill_attention_by_cache<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kHalf: return prefill_attention_by_cache<c10::Half>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", query.scalar_type());
  }
}

// Attention within each chunk of the step's own rows, no cache: chunk c's queries, keys and values are rows
// query_starts[c] .. query_starts[c + 1] of query / key / value ([T, heads, D], [T, kv_heads, D]). causal false:
// an encoder's bidirectional layer, each token seeing its whole prompt.
template <typename T>
void varlen_attention_typed(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& query_starts, double scale, bool causal) {
  const int64_t chunks = query_starts.numel() - 1;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const std::vector<int64_t> contexts(chunks, 0);
  const FlatRows<T> kv{key.data_ptr<T>(), value.data_ptr<T>(), starts, key.stride(0), key.stride(1), value.stride(0),
                       value.stride(1)};
  prefill_attention_impl<T, T>(out, query, kv, key.size(1), starts, contexts.data(), chunks, scale, 0, 0.0, 1.0, 1.0,
                               causal);
}

void varlen_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& query_starts, double scale, bool causal) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "varlen_attention: query and out must be [rows, heads, head_dim]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(0) == query.size(0) &&
                  key.size(2) == query.size(2),
              "varlen_attention: key and value must be [rows, kv_heads, head_dim], the query's rows and head_dim");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "varlen_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "varlen_attention: every tensor needs unit stride in head_dim");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "varlen_attention: query, key, value and out must share a dtype");
  check_query_starts("varlen_attention", query_starts, query_starts.numel() - 1, query.size(0));
  if (query_starts.numel() <= 1) return;
  switch (query.scalar_type()) {
    case at::kFloat: return varlen_attention_typed<float>(out, query, key, value, query_starts, scale, causal);
    case at::kBFloat16: return varlen_attention_typed<c10::BFloat16>(out, query, key, value, query_starts, scale, causal);
    case at::kHalf: return varlen_attention_typed<c10::Half>(out, query, key, value, query_starts, scale, causal);
    default: TORCH_CHECK(false, "varlen_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("varlen_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor query_starts, float scale, "
        "bool causal) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor context_lens, float scale, int window, float softcap, float k_scale=1.0, "
        "float v_scale=1.0, int kv_format=0) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("varlen_attention", &varlen_attention);
}
