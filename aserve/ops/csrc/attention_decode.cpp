// Decode attention over the paged KV cache, torch.ops.aserve.paged_decode_attention (the cache in the query's
// dtype, or FP8 bytes), with AVX-512 paths for bf16 caches: vdpbf16ps, or fp32 FMAs where bf16_products() picks
// them.
//
// One query token per request. Work items are (request, kv head, group of query heads): each reads its
// request's keys once for the queries of its group (scores, then softmax), then the values once. Tokens
// are walked block by block: keys a block's run of up to 16 tokens at a time (the cache stores them in pairs of
// dims, key_groups below), values row by row; for the common head sizes the loops are unrolled at compile time
// (HeadDim > 0) so their sums live in registers, else a runtime-sized path does the same work.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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

#include "attention_args.h"
#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;
using BF16 = c10::BFloat16;

// A row as fp32: the row itself when it is fp32, else widened into `scratch`.
template <typename T> inline const float* row_as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, scratch, n);
    return scratch;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float total = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  const fVec a(alpha);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) at::vec::fmadd(a, fVec::loadu(x + i), fVec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// A cached row as fp32 vectors, D a multiple of twice the fp32 vector width.
template <typename T, int D> inline void widen(const T* p, fVec* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int c = 0; c < D / fVec::size(); ++c) out[c] = fVec::loadu(p + c * fVec::size());
  } else if constexpr (is_fp8<T>) {
    for (int c = 0; c < D / fVec::size(); ++c) {
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p) + c * fVec::size();
#if defined(CPU_CAPABILITY_AVX512)
      out[c] = fp8_16_as_float<T>(bytes);
#elif defined(CPU_CAPABILITY_AVX2)
      out[c] = fp8_8_as_float<T>(bytes);
#else
      float lanes[fVec::size()];
      for (int i = 0; i < fVec::size(); ++i) lanes[i] = fp8_to_float<T>(bytes[i]);
      out[c] = fVec::loadu(lanes);
#endif
    }
  } else {
    using bVec = at::vec::Vectorized<T>;
    for (int c = 0; c < D / bVec::size(); ++c) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(p + c * bVec::size()));
      out[2 * c] = lo;
      out[2 * c + 1] = hi;
    }
  }
}

// Element offsets, within one kv head's slab of the cache, of the rows of tokens first..len-1: computed once
// per request and used by both passes, whose inner loops then walk a flat list (blocks lie anywhere in the
// cache; with a per-token callback the compiler kept the sums on the stack).
inline void token_offsets(const int64_t* table, int64_t block_size, int64_t row_size, int64_t first, int64_t len,
                          int64_t* out) {
  int64_t block = first / block_size, offset = first % block_size;  // then each block from its start
  for (int64_t t = first; t < len; ++block, offset = 0) {
    const int64_t count = std::min(len - t, block_size - offset);
    const int64_t at = (table[block] * block_size + offset) * row_size;
    for (int64_t j = 0; j < count; ++j) out[j] = at + j * row_size;  // (written so that it vectorizes)
    out += count, t += count;
  }
}

inline void prefetch(const void* row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line<1>(static_cast<const char*>(row) + i);
}

// The next work item's key and value rows, fetched into the L2 cache while this item is computed. One
// request's rows lie in 2 KB runs (a block of one kv head) anywhere in the cache: too short for the hardware
// prefetchers to get ahead of the loads, so each item used to start with its rows in DRAM and the kernel ran at
// half the memory bandwidth. Both passes call step() (the key pass once per group of tokens, each value pass every
// 16 tokens: ahead_steps counts the calls), and each call fetches the next item's rows over the count of calls, so
// that they spread evenly over this item's two passes: a burst fills the line-fill buffers and stalls the loads
// this item needs. (A pace of 9 rows a call suited AVX-512's count of calls; with AVX2's 8-token key groups and
// a value pass per head it fetched the rows in the first third of the item, in bursts of 72 lines: evenly, decode
// attention from DRAM ran 1.1-1.2x as fast, bench model at batch 64, AMD EPYC Zen 3, avx2 fma, fp32.) Into L2
// (hint 2): fetching into L1 evicted the current item's rows and was slower.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* offsets = nullptr;  // rows of the next item, in elements of `elem` bytes
  int64_t n = 0, pos = 0, elem = 0, row_bytes = 0, per_step = 0;
  Ahead() = default;
  Ahead(const void* k_head, const void* v_head, const int64_t* offsets, int64_t n, int64_t elem, int64_t row_bytes,
        int64_t steps)
      : k(static_cast<const char*>(k_head)), v(static_cast<const char*>(v_head)), offsets(offsets), n(n),
        elem(elem), row_bytes(row_bytes), per_step(std::max<int64_t>(1, n / std::max<int64_t>(steps, 1))) {}
  void step() {
    for (const int64_t stop = std::min(n, pos + per_step); pos < stop; ++pos) {
      const int64_t at = offsets[pos] * elem;
      for (int64_t i = 0; i < row_bytes; i += 64) {
        prefetch_line<2>(k + at + i);
        prefetch_line<2>(v + at + i);
      }
    }
  }
};

// acc[h] = sum_i p[h][i] * v[i] for NH heads (p rows n apart), their sums in registers.
template <typename T, int HeadDim, int NH>
void value_pass(const float* p, int64_t n, const T* v_head, const int64_t* offsets, float* acc, Ahead& ahead) {
  constexpr int C = HeadDim / fVec::size();
  fVec sums[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) sums[h][c] = fVec(0.f);
  for (int64_t i = 0; i < n; ++i) {
    if ((i & 15) == 0) ahead.step();
    fVec vv[C];
    widen<T, HeadDim>(v_head + offsets[i], vv);
    for (int h = 0; h < NH; ++h) {
      const fVec w(p[h * n + i]);
      for (int c = 0; c < C; ++c) sums[h][c] = at::vec::fmadd(w, vv[c], sums[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) sums[h][c].store(acc + h * HeadDim + c * fVec::size());
}

// Calls pass<nh>(first head) over the heads in groups of at most HG (a compile-time count per group, so
// that a group's sums stay in registers).
template <int HG, typename Pass> inline void head_groups(int64_t heads, Pass&& pass) {
  for (int64_t g = 0; g < heads;) {
    const int64_t nh = std::min<int64_t>(HG, heads - g);
    if (nh >= 4) {
      if constexpr (HG >= 4) pass(std::integral_constant<int, 4>{}, g);
      g += 4;
    } else if (nh == 3) {
      if constexpr (HG >= 3) pass(std::integral_constant<int, 3>{}, g);
      g += 3;
    } else if (nh == 2) {
      if constexpr (HG >= 2) pass(std::integral_constant<int, 2>{}, g);
      g += 2;
    } else {
      pass(std::integral_constant<int, 1>{}, g);
      g += 1;
    }
  }
}

// Keys are stored in pairs of dims (kv_write.cpp's paired_keys): a block's keys are [head_dim / 2][block_size][2],
// so pair p (dims 2p, 2p + 1) of a block's consecutive tokens lies in one run, 2 * block_size elements after pair
// p - 1's. The key pass takes W = fVec::size() tokens of a block at a time: each pair's run gives two vectors of W
// tokens' dims 2p and 2p + 1, which every query head meets with one FMA each against its dim broadcast, W scores
// in registers: nothing is widened into scratch and no sum crosses lanes (with rows, each key's products were
// summed across a vector's lanes: 30 of a (token, kv head)'s 59 cycles went to its key pass, bench model, Intel
// Xeon avx512_bf16 without AMX, hot L2).
//
// pair_lanes: `count` (<= W) consecutive tokens' pair at `src` as fp32 vectors, lane t token t's dim 2p (even)
// and 2p + 1 (odd); lanes from count on are zero. FP8 bytes widen as fp8_bytes_as_float does (e4m3's 2^-8 is in the
// scales).
template <typename C> inline float as_float(C x) {
  if constexpr (is_fp8<C>) return fp8_to_float<C>(x.bits); else return static_cast<float>(x);
}

// peaks = max(peaks, the first `count` lanes of scores), lane by lane: the key pass keeps each head's running maximum
// for the softmax, which then needs no pass of its own to find it (NaN propagates as at::vec::maximum does).
inline void running_max(const fVec& scores, int count, float* peaks) {
  const fVec top = fVec::loadu(peaks), higher = at::vec::maximum(top, scores);
  (count == fVec::size() ? higher : fVec::set(top, higher, count)).store(peaks);
}

template <typename C> inline void pair_lanes_scalar(const C* src, int count, fVec& even, fVec& odd) {
  alignas(64) float e[fVec::size()] = {}, o[fVec::size()] = {};
  for (int t = 0; t < count; ++t) e[t] = as_float(src[2 * t]), o[t] = as_float(src[2 * t + 1]);
  even = fVec::loadu(e), odd = fVec::loadu(o);
}

#if defined(CPU_CAPABILITY_AVX512)
inline __m512i load_words(const void* src, int count) {  // `count` 32-bit words, zero after
  return count == 16 ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << count) - 1), src);
}

template <typename C> inline void pair_lanes(const C* src, int count, fVec& even, fVec& odd) {
  if constexpr (std::is_same_v<C, float>) {  // 8 tokens' pairs a vector: de-interleaved across the two
    const __m512 a = _mm512_castsi512_ps(load_words(src, std::min(count, 8) * 2));
    const __m512 b = _mm512_castsi512_ps(load_words(src + 16, std::max(count - 8, 0) * 2));
    even = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
    odd = _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
  } else if constexpr (std::is_same_v<C, BF16>) {  // a bf16 is the top half of its fp32
    const __m512i w = load_words(src, count);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<C, c10::Half>) {
    const __m512i w = load_words(src, count);
    even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
  } else if constexpr (is_fp8<C>) {  // a pair is two bytes
    const __m256i pairs = count == 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                      : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), src);
    // each pair's low byte moved into its lane's high byte, then the high byte where it lies, as fp16 patterns
    const __m256i low = _mm256_slli_epi16(pairs, 8);
    if constexpr (std::is_same_v<C, E5M2>) {
      even = _mm512_cvtph_ps(low);
      odd = _mm512_cvtph_ps(_mm256_and_si256(pairs, _mm256_set1_epi16(static_cast<int16_t>(0xFF00))));
    } else {
      even = _mm512_cvtph_ps(e4m3_high_bytes_as_half(low));
      odd = _mm512_cvtph_ps(e4m3_high_bytes_as_half(pairs));
    }
  } else {
    pair_lanes_scalar(src, count, even, odd);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 fp16 bit patterns, one in the low half of each 32-bit lane, as fp32.
inline __m256 half_lanes_as_float(__m256i h) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // lanes 0-7 as 16-bit, in order
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

template <typename C> inline void pair_lanes(const C* src, int count, fVec& even, fVec& odd) {
  alignas(32) C padded[16] = {};
  if (count < 8) std::memcpy(padded, src, 2 * count * sizeof(C)), src = padded;
  if constexpr (std::is_same_v<C, float>) {  // tokens 0-3 and 4-7, left by shuffle_ps in lanes 0 1 4 5 | 2 3 6 7
    // (every pair alike, so pair_scores puts each head's sums in order once: a lane-crossing permute less a pair)
    const __m256 a = _mm256_loadu_ps(src), b = _mm256_loadu_ps(src + 8);
    even = _mm256_shuffle_ps(a, b, 0x88), odd = _mm256_shuffle_ps(a, b, 0xDD);
  } else if constexpr (std::is_same_v<C, BF16>) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<C, c10::Half>) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    even = half_lanes_as_float(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)));
    odd = half_lanes_as_float(_mm256_srli_epi32(w, 16));
  } else {  // FP8: 8 tokens' pairs as 8 words, the low byte moved up, then the high byte where it lies (as AVX-512's)
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i low = _mm_slli_epi16(w, 8);
    if constexpr (std::is_same_v<C, E5M2>) {
      even = _mm256_cvtph_ps(low);
      odd = _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16(static_cast<int16_t>(0xFF00))));
    } else {
      even = _mm256_cvtph_ps(e4m3_high_bytes_as_half(low));
      odd = _mm256_cvtph_ps(e4m3_high_bytes_as_half(w));
    }
  }
}
#else
template <typename C> inline void pair_lanes(const C* src, int count, fVec& even, fVec& odd) {
  pair_lanes_scalar(src, count, even, odd);
}
#endif

// NH query heads' scores (q fp32, already scaled, rows HeadDim apart) for `count` tokens of one block whose pairs
// start at `pairs` (pair runs `pair_stride` elements apart): out[h * out_stride + t], and each head's running
// maximum in peaks[h]. Even and odd dims sum apart (two chains a head, so that the FMAs' latency overlaps), added at
// the end. Full: count is a whole vector, known when compiled, so that the loop over the pairs has no masks to
// choose (with them it kept two register copies and a branch a pair: hot decode attention, bench model, Intel Xeon
// avx512_bf16 without AMX).
template <typename C, int HeadDim, int NH, bool Full>
inline void pair_scores(const float* q, const C* pairs, int64_t pair_stride, int count, float* out,
                        int64_t out_stride, float* peaks) {
  if constexpr (Full) count = fVec::size();
  fVec acc[NH][2];
  for (int h = 0; h < NH; ++h) acc[h][0] = fVec(0.f), acc[h][1] = fVec(0.f);
#pragma GCC unroll 4
  for (int p = 0; p < HeadDim / 2; ++p) {
    fVec even, odd;
    pair_lanes(pairs + p * pair_stride, count, even, odd);
    for (int h = 0; h < NH; ++h) {
      acc[h][0] = at::vec::fmadd(fVec(q[h * HeadDim + 2 * p]), even, acc[h][0]);
      acc[h][1] = at::vec::fmadd(fVec(q[h * HeadDim + 2 * p + 1]), odd, acc[h][1]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    fVec sums = acc[h][0] + acc[h][1];
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<C, float>)  // pair_lanes' fp32 lanes hold tokens 0 1 4 5 2 3 6 7: in order
      sums = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sums), 0xD8));
#endif
    if (count == fVec::size()) sums.store(out + h * out_stride); else sums.store(out + h * out_stride, count);
    running_max(sums, count, peaks + h * fVec::size());
  }
}

// Calls f(i, count, pairs) over tokens [0, n) of an item whose first token is the context's `first`, a block's
// tokens at most W at a time (`pairs`: where their pairs start). offsets[i] is token i's row offset as rows would
// lie, so its block starts at offsets[i] - o * head_dim (o: its place in the block). Keys two groups ahead and
// this group's values are fetched into cache as it goes.
template <typename C, typename F>
inline void key_groups(const C* k_head, const C* v_head, const int64_t* offsets, int64_t first, int64_t n,
                       int64_t block_size, int64_t head_dim, Ahead& ahead, F&& f) {
  constexpr int W = fVec::size();
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(C));
  for (int64_t i = 0; i < n;) {
    const int64_t o = (first + i) % block_size;
    const int count = static_cast<int>(std::min<int64_t>(W, std::min(block_size - o, n - i)));
    ahead.step();
    // a block's rows as rows would lie cover the block's pairs: fetching them fetches the keys
    for (int64_t j = i + 2 * W; j < std::min(n, i + 3 * W); ++j) prefetch(k_head + offsets[j], row_bytes);
    for (int64_t j = i; j < i + count; ++j) prefetch(v_head + offsets[j], row_bytes);
    f(i, count, k_head + offsets[i] - o * head_dim + 2 * o);
    i += count;
  }
}

// scores[g][i] = q[g] . k[i] (q fp32, already scaled) for the item's n tokens.
template <typename C, int HeadDim>
void key_scores(const float* q, int64_t heads, int64_t head_dim, const C* k_head, const C* v_head,
                const int64_t* offsets, int64_t first, int64_t n, int64_t block_size, float* scores, float* scratch,
                float* peaks, Ahead& ahead) {
  constexpr int W = fVec::size();
  if constexpr (HeadDim > 0) {
    key_groups(k_head, v_head, offsets, first, n, block_size, HeadDim, ahead, [&](int64_t i, int count, const C* pairs) {
      head_groups<4>(heads, [&](auto nh, int64_t g) {
        constexpr int NH = decltype(nh)::value;
        const float* qg = q + g * HeadDim;
        float *out = scores + g * n + i, *top = peaks + g * W;
        if (count == W)
          pair_scores<C, HeadDim, NH, true>(qg, pairs, 2 * block_size, count, out, n, top);
        else
          pair_scores<C, HeadDim, NH, false>(qg, pairs, 2 * block_size, count, out, n, top);
      });
    });
  } else {
    key_groups(k_head, v_head, offsets, first, n, block_size, head_dim, ahead, [&](int64_t i, int count, const C* pairs) {
      for (int t = 0; t < count; ++t) {
        for (int64_t d = 0; d < head_dim; ++d) scratch[d] = as_float(pairs[d / 2 * 2 * block_size + 2 * t + d % 2]);
        for (int64_t g = 0; g < heads; ++g) scores[g * n + i + t] = dot(q + g * head_dim, scratch, head_dim);
      }
      for (int64_t g = 0; g < heads; ++g) running_max(fVec::loadu(scores + g * n + i, count), count, peaks + g * W);
    });
  }
}

// The query heads one value pass sums at once (HeadDim > 0): as many as fill half the vector registers with their
// sums. Bf16Values: a bf16 cache on AVX-512 (value_sum_bf16), two 16-lane vectors per 32 dims of each head: 4
// heads at 64 dims, 2 at 128, 1 at 256.
template <int HeadDim, bool Bf16Values> constexpr int value_pass_heads() {
  if constexpr (Bf16Values) {
    return HeadDim / 16 >= 16 ? 1 : 16 / (HeadDim / 16);
  } else {
    constexpr int C = HeadDim / fVec::size(), registers = fVec::size() == 16 ? 32 : 16;
    return std::min(4, C >= registers / 2 ? 1 : registers / 2 / C);
  }
}

// How often an item of n tokens calls Ahead::step(): about once per key group of a vector's width of tokens,
// and every 16 tokens of each value pass (one pass per value_pass_heads heads; one pass where HeadDim is 0).
template <int HeadDim, bool Bf16Values> int64_t ahead_steps(int64_t n, int64_t heads) {
  int64_t passes = 1;
  if constexpr (HeadDim > 0) {
    constexpr int per_pass = value_pass_heads<HeadDim, Bf16Values>();
    passes = (heads + per_pass - 1) / per_pass;
  }
  return (n + fVec::size() - 1) / fVec::size() + passes * ((n + 15) / 16);
}

// acc[g] = sum_i p[g][i] * v[i]. The unrolled path walks the values once per group of heads whose sums fit in
// half the vector registers (re-reads hit the L1/L2 cache).
template <typename T, int HeadDim>
void value_sum(const float* p, int64_t heads, int64_t head_dim, const T* v_head, const int64_t* offsets,
               int64_t n, float* acc, float* scratch, Ahead& ahead) {
  if constexpr (HeadDim > 0) {
    head_groups<value_pass_heads<HeadDim, false>()>(heads, [&](auto nh, int64_t g) {
      value_pass<T, HeadDim, decltype(nh)::value>(p + g * n, n, v_head, offsets, acc + g * HeadDim, ahead);
    });
  } else {
    std::fill(acc, acc + heads * head_dim, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      if ((i & 15) == 0) ahead.step();
      const float* vf = row_as_float(v_head + offsets[i], scratch, head_dim);
      for (int64_t g = 0; g < heads; ++g) axpy(p[g * n + i], vf, acc + g * head_dim, head_dim);
    }
  }
}

// The powers of two an FP8 cache's bf16 patterns are dropped by and the query and probabilities lifted by, where
// its bytes meet vdpbf16ps (ASERVE_FP8_DOT below).
constexpr int kFp8Drop = 104, kFp8Lift = 52;

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// A bf16 cache on a CPU with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 values and adds both products to
// fp32 lanes, so a key pair's run of 16 tokens meets a query head in one instruction (the products are exact in
// fp32, as in the torch path's bf16 matmul). The query stays bf16 and the scale is applied to the scores, as the
// torch path does. Values go in pairs of tokens: their rows are interleaved so that each 32-bit lane holds
// (v[t][d], v[t+1][d]), against the pair of probabilities rounded to bf16 (the torch path rounds them to bf16 too,
// before its second matmul).
#define ASERVE_BF16_DOT 1

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

#if defined(__AVX512VBMI__)
// An FP8 cache on vdpbf16ps too, where AVX512-VBMI permutes bytes: every e4m3 and e5m2 value is a bf16 value, so
// its byte becomes a bf16 pattern exactly, through two 128-entry tables (the pattern's low and its high byte, by the
// byte's seven magnitude bits: one vpermi2b each) with the sign put back. Widened to fp32 for FMAs instead, an FP8
// cache ran slower than a bf16 one: half the bytes, but twice the instructions a value (decode attention at batch
// 64, 30 layers of the bench model from DRAM, AMD EPYC Zen 4). The patterns are the values fp8_to_float reads
// (e4m3's times 2^-8) times 2^-kFp8Drop, so that the subnormals (e4m3's 2^-17 after its 2^-8, e5m2's 2^-16) stay
// normal bf16 values, as vdpbf16ps needs (it reads denormals as zero); the query and the probabilities are lifted
// by 2^kFp8Lift to meet them, so that no product nears fp32's denormals either, and the sums are scaled back with
// the scales. Powers of two throughout: the scores and outputs are the bits a bf16 cache of the same values gives.
#define ASERVE_FP8_DOT 1
#endif

// Reads a cache of C (bf16, or FP8 where ASERVE_FP8_DOT) as the 32-bit words of two bf16 values vdpbf16ps takes.
template <typename C> struct Bf16Words {
#ifdef ASERVE_FP8_DOT
  __m512i lo0, lo1, hi0, hi1, sign, runs_order, rows_order[2];

  Bf16Words() {
    if constexpr (is_fp8<C>) {
      struct alignas(64) Tables { uint8_t lo[128], hi[128], runs[64], rows[2][64]; };
      static const Tables t = [] {
        Tables t{};
        for (int x = 0; x < 128; ++x) {
          const float v = std::ldexp(fp8_to_float<C>(static_cast<uint8_t>(x)), -kFp8Drop);
          uint32_t bits;
          std::memcpy(&bits, &v, sizeof(bits));
          t.lo[x] = static_cast<uint8_t>(bits >> 16), t.hi[x] = static_cast<uint8_t>(bits >> 24);
        }
        // fp8_words turns the bytes at 16L + j (L a 128-bit lane) into words 8L + j of its first vector for j < 8,
        // of its second for j >= 8. Two key runs (a's bytes 0-31, b's 64-95 of the pair vpermi2b reads): a's in
        // order in the first vector, b's in the second.
        for (int L = 0; L < 4; ++L)
          for (int j = 0; j < 8; ++j) t.runs[16 * L + j] = 8 * L + j, t.runs[16 * L + 8 + j] = 64 + 8 * L + j;
        // Two value rows' 64-byte chunk (row a's bytes 0-63, b's 64-127): each 32-dim half h of it in the order of
        // value_pass_bf16's unpacklo/unpackhi of bf16 rows, lane L of the first vector (a, b) at dims 8L .. 8L + 3,
        // of the second at 8L + 4 .. 8L + 7.
        for (int h = 0; h < 2; ++h)
          for (int L = 0; L < 4; ++L)
            for (int k = 0; k < 4; ++k) {
              const int dim = 32 * h + 8 * L + k;
              t.rows[h][16 * L + 2 * k] = dim, t.rows[h][16 * L + 2 * k + 1] = 64 + dim;
              t.rows[h][16 * L + 8 + 2 * k] = dim + 4, t.rows[h][16 * L + 8 + 2 * k + 1] = 64 + dim + 4;
            }
        return t;
      }();
      lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
      hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
      sign = _mm512_set1_epi8(static_cast<char>(0x80));
      runs_order = _mm512_load_si512(t.runs);
      rows_order[0] = _mm512_load_si512(t.rows[0]), rows_order[1] = _mm512_load_si512(t.rows[1]);
    }
  }

  // 64 FP8 bytes as bf16 patterns: bytes 16L + j into word 8L + j of `first` (j < 8) or of `second` (j >= 8), the
  // order unpacklo/unpackhi leave.
  void fp8_words(__m512i bytes, __m512i& first, __m512i& second) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, bytes, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, bytes, hi1), bytes, sign, 0xF8);
    first = _mm512_unpacklo_epi8(lo, hi), second = _mm512_unpackhi_epi8(lo, hi);
  }
#endif

  // Key runs a and b (a block's pair of dims, `count` tokens; zero after) as words, a token a lane.
  template <bool Full> void runs(const C* a, const C* b, int count, __m512i& wa, __m512i& wb) const {
    if constexpr (std::is_same_v<C, BF16>) {
      wa = Full ? _mm512_loadu_si512(a) : load_words(a, count);
      wb = Full ? _mm512_loadu_si512(b) : load_words(b, count);
    } else {
#ifdef ASERVE_FP8_DOT
      const __mmask64 m = Full ? ~0ull : (1ull << (2 * count)) - 1;
      const __m512i ra = Full ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)))
                              : _mm512_maskz_loadu_epi8(m, a);
      const __m512i rb = Full ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)))
                              : _mm512_maskz_loadu_epi8(m, b);
      fp8_words(_mm512_permutex2var_epi8(ra, runs_order, rb), wa, wb);
#endif
    }
  }

  // Two tokens' value rows a and b as value_pass_bf16 takes them: 32-dim chunk c as lo[c] (lane L: (a, b) at dims
  // 32c + 8L .. 32c + 8L + 3) and hi[c] (the next four of each lane).
  template <int HeadDim>
  void rows(const C* a, const C* b, __m512i (&lo)[HeadDim / 32], __m512i (&hi)[HeadDim / 32]) const {
    if constexpr (std::is_same_v<C, BF16>) {
      for (int c = 0; c < HeadDim / 32; ++c) {
        const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
        lo[c] = _mm512_unpacklo_epi16(ra, rb), hi[c] = _mm512_unpackhi_epi16(ra, rb);
      }
    } else {
#ifdef ASERVE_FP8_DOT
      static_assert(HeadDim % 64 == 0, "FP8 rows are read 64 bytes at a time");
      for (int z = 0; z < HeadDim / 64; ++z) {
        const __m512i ra = _mm512_loadu_si512(a + z * 64), rb = _mm512_loadu_si512(b + z * 64);
        for (int h = 0; h < 2; ++h)
          fp8_words(_mm512_permutex2var_epi8(ra, rows_order[h], rb), lo[2 * z + h], hi[2 * z + h]);
      }
#endif
    }
  }
};

// The key pass on vdpbf16ps: a pair's run of 16 tokens (one 32-bit word a token) meets each query head's pair of
// dims, broadcast, in one instruction; the scale is applied to the sums. q: the heads' bf16 rows as 32-bit pairs.
// Each head sums in Chains chains (pair p into chain p % Chains), so that vdpbf16ps' latency overlaps; the loop
// over the pairs steps a chain's round at a time, every index known when compiled: indexed by p % 2 inside a loop
// the compiler did not unroll, the sums lived on the stack and each product waited on a store and a load (the key
// pass took 2/3 of hot decode attention, bench model, AMD EPYC Zen 5). Full: count is 16, loads need no mask.
template <typename C, int HeadDim, int NH, bool Full>
inline void pair_scores_bf16(const Bf16Words<C>& words, const uint32_t* q, const C* pairs, int64_t pair_stride,
                             int count, float scale, float* out, int64_t out_stride, float* peaks) {
  constexpr int Pairs = HeadDim / 2, Chains = Pairs % 4 == 0 ? 4 : 2;
  static_assert(Pairs % 2 == 0, "runs are read two at a time");
  if constexpr (Full) count = 16;
  __m512 acc[NH][Chains];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < Chains; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int p = 0; p < Pairs; p += Chains) {
    __m512i w[Chains];
#pragma GCC unroll 2
    for (int c = 0; c < Chains; c += 2)
      words.template runs<Full>(pairs + (p + c) * pair_stride, pairs + (p + c + 1) * pair_stride, count, w[c],
                                w[c + 1]);
#pragma GCC unroll 4
    for (int c = 0; c < Chains; ++c) {
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h)
        acc[h][c] = _mm512_dpbf16_ps(acc[h][c], as_bh(w[c]),
                                     as_bh(_mm512_set1_epi32(static_cast<int>(q[h * Pairs + p + c]))));
    }
  }
  for (int h = 0; h < NH; ++h) {
    __m512 total = acc[h][0];
    for (int c = 1; c < Chains; ++c) total = _mm512_add_ps(total, acc[h][c]);
    const fVec sums = fVec(total) * fVec(scale);
    if (count == 16) sums.store(out + h * out_stride); else sums.store(out + h * out_stride, count);
    running_max(sums, count, peaks + h * 16);
  }
}

template <typename C, int HeadDim>
void key_scores_bf16(const BF16* q, int64_t heads, const C* k_head, const C* v_head, const int64_t* offsets,
                     int64_t first, int64_t n, int64_t block_size, float scale, float* scores, float* peaks,
                     Ahead& ahead) {
  const auto* qw = reinterpret_cast<const uint32_t*>(q);
  const Bf16Words<C> words;
  key_groups(k_head, v_head, offsets, first, n, block_size, HeadDim, ahead, [&](int64_t i, int count, const C* pairs) {
    head_groups<4>(heads, [&](auto nh, int64_t g) {
      constexpr int NH = decltype(nh)::value;
      const uint32_t* qg = qw + g * HeadDim / 2;
      float *out = scores + g * n + i, *top = peaks + g * 16;
      if (count == 16)
        pair_scores_bf16<C, HeadDim, NH, true>(words, qg, pairs, 2 * block_size, count, scale, out, n, top);
      else
        pair_scores_bf16<C, HeadDim, NH, false>(words, qg, pairs, 2 * block_size, count, scale, out, n, top);
    });
  });
}

// out[i] = exp(s[i] - peak) * lift as bf16 bits, for i < n, and a zero after an odd n's last; returns the fp32 sum
// of the exponentials (before lifting and rounding), the softmax's total. lift: a power of two (Bf16Words').
inline float exp_to_bf16(const float* s, float peak, int64_t n, uint16_t* out, float lift) {
  const fVec log2e(kLog2e), top(peak), up(lift);  // exp(x - peak) = 2^((x - peak) log2(e)), the difference exact
  fVec total(0.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const fVec e = exp2_bounded((fVec::loadu(s + i) - top) * log2e);
    total = total + e;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(e * up));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const fVec e = _mm512_maskz_mov_ps(m, exp2_bounded((fVec(_mm512_maskz_loadu_ps(m, s + i)) - top) * log2e));
    total = total + e;
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(e * up));
  }
  if (n % 2 == 1) out[n] = 0;
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, total);
}

// A value pass's sums, two vectors per 32 dims of each head, into acc[h] in dims' order: a chunk's first 16 dims
// are lanes `lo` of the pair (0-15 the first vector's, 16-31 the second's), its last 16 lanes `hi`.
template <int HeadDim, int NH>
inline void store_value_sums(const __m512 (&sums)[NH][HeadDim / 16], __m512i lo, __m512i hi, float* acc) {
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < HeadDim / 32; ++c) {
      float* out = acc + h * HeadDim + c * 32;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(sums[h][2 * c], lo, sums[h][2 * c + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(sums[h][2 * c], hi, sums[h][2 * c + 1]));
    }
}

// acc[h] = sum_t p[h][t] * v[t] for NH heads (p as bf16 bits, rows n apart), their sums in registers. Tokens go
// in pairs; an odd last one is paired with a zero row. Lane i of chunk c's low/high sums holds dim
// 32c + 8(i/4) + i%4 (+ 4 for the high ones), the order unpacklo/unpackhi leave, put back in order at the end.
template <typename Cache, int HeadDim, int NH>
void value_pass_bf16(const uint16_t* p, int64_t stride, int64_t n, const Cache* v_head, const int64_t* offsets,
                     float* acc, Ahead& ahead) {
  constexpr int C = HeadDim / 32;
  alignas(64) static const Cache zero_row[HeadDim] = {};
  const Bf16Words<Cache> words;
  __m512 sums[NH][2 * C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * C; ++c) sums[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if ((i & 15) == 0) ahead.step();
    const bool two = i + 1 < n;
    const Cache* a = v_head + offsets[i];
    const Cache* b = two ? v_head + offsets[i + 1] : zero_row;
    __m512i weights[NH];
    for (int h = 0; h < NH; ++h) {
      int32_t pair;
      std::memcpy(&pair, p + h * stride + i, sizeof(pair));
      weights[h] = _mm512_set1_epi32(pair);
    }
    __m512i lo[C], hi[C];
    words.template rows<HeadDim>(a, b, lo, hi);
    for (int c = 0; c < C; ++c) {
      for (int h = 0; h < NH; ++h) {
        sums[h][2 * c] = _mm512_dpbf16_ps(sums[h][2 * c], as_bh(lo[c]), as_bh(weights[h]));
        sums[h][2 * c + 1] = _mm512_dpbf16_ps(sums[h][2 * c + 1], as_bh(hi[c]), as_bh(weights[h]));
      }
    }
  }
  store_value_sums<HeadDim, NH>(sums, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                                _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), acc);
}

// The value pass on fp32 FMAs, where bf16_products() says they outrun vdpbf16ps (an Intel Xeon without AMX
// tiles, where one vdpbf16ps takes as long as four FMAs; its key pass is key_scores' over bf16 pairs). A bf16 is
// the top half of its fp32, so a 32-bit lane of two bf16 values gives the even one shifted up 16 and the odd one
// masked: a 64-byte chunk of a row is its 16 even and 16 odd dims as two fp32 vectors, two instructions and no
// shuffle. Values keep their dims' order: each head sums evens and odds apart, interleaved at the end; the
// probabilities stay fp32.
inline __m512 even_half(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_half(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// value_pass_bf16 on FMAs: acc[h] = sum_t p[h][t] * v[t] for NH heads (p fp32, rows `stride` apart), a row's
// evens and odds summed apart in registers and put back in order at the end.
template <int HeadDim, int NH>
void value_pass_fma(const float* p, int64_t stride, int64_t n, const BF16* v_head, const int64_t* offsets,
                    float* acc, Ahead& ahead) {
  constexpr int C = HeadDim / 32;
  __m512 sums[NH][2 * C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * C; ++c) sums[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if ((i & 15) == 0) ahead.step();
    const BF16* row = v_head + offsets[i];
    __m512 v[2 * C];
    for (int c = 0; c < C; ++c) {
      const __m512i pairs = _mm512_loadu_si512(row + c * 32);
      v[2 * c] = even_half(pairs), v[2 * c + 1] = odd_half(pairs);
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * stride + i]);
      for (int c = 0; c < 2 * C; ++c) sums[h][c] = _mm512_fmadd_ps(w, v[c], sums[h][c]);
    }
  }
  store_value_sums<HeadDim, NH>(sums, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                                _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), acc);
}

// acc[g] = sum_t p[g][t] * v[t] over a cache of C, p as bf16 bits (vdpbf16ps, a bf16 or FP8 cache) or fp32 (FMAs, a
// bf16 cache), rows `stride` apart: the heads in passes whose sums fill half the registers.
template <int HeadDim, typename C, typename P>
void value_sum_bf16(const P* p, int64_t stride, int64_t heads, const C* v_head, const int64_t* offsets, int64_t n,
                    float* acc, Ahead& ahead) {
  head_groups<value_pass_heads<HeadDim, true>()>(heads, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    if constexpr (std::is_same_v<P, float>)
      value_pass_fma<HeadDim, NH>(p + g * stride, stride, n, v_head, offsets, acc + g * HeadDim, ahead);
    else
      value_pass_bf16<C, HeadDim, NH>(p + g * stride, stride, n, v_head, offsets, acc + g * HeadDim, ahead);
  });
}
#else  // declared only, so the branches that would call them compile away
template <typename C, int HeadDim>
void key_scores_bf16(const BF16*, int64_t, const C*, const C*, const int64_t*, int64_t, int64_t, int64_t, float,
                     float*, float*, Ahead&);
float exp_to_bf16(const float*, float, int64_t, uint16_t*, float);
template <int HeadDim, typename C, typename P>
void value_sum_bf16(const P*, int64_t, int64_t, const C*, const int64_t*, int64_t, float*, Ahead&);
#endif

// s[i] = exp(s[i] - peak) for i < n, in one pass that also returns their sum (the softmax's total).
inline float exp_in_place(float* s, float peak, int64_t n) {
  constexpr int W = fVec::size();
  const fVec log2e(kLog2e), top(peak);
  fVec total(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const fVec e = exp2_bounded((fVec::loadu(s + i) - top) * log2e);
    e.store(s + i);
    total = total + e;
  }
  if (i < n) {
    const fVec e = exp2_bounded((fVec::loadu(s + i, n - i) - top) * log2e);
    e.store(s + i, n - i);
    total = total + fVec::set(fVec(0.f), e, n - i);
  }
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, total);
}

// Tokens a work item attends to at most: longer contexts are split in parts of at most this size, their softmaxes
// merged. Batch 1 had too few (request, kv head) items for two threads: splitting the query heads instead read every
// key and value once per head, and ran slower on two threads than one (bench model, 9 heads over 3: 29.6 against
// 25.0 us at 1024 tokens, Zen 5). The parts' sizes are within one token of each other, not 128 tokens and a short
// rest: at batch 1 the threads split the items by count, so a 260-token context's 128 + 128 + 4 gave one of two
// threads 516 of the three kv heads' 780 tokens; parts of 86, 87 and 87 give it 433. Bench model at batch 1, decode
// attention over 128-384 tokens (Intel Xeon, avx2 avx512_bf16 avx512f, no AMX, 2 threads, commit fa74fc1): 0.91 ->
// 0.83 ms a step.
constexpr int64_t kPartTokens = 128;

// The parts of a context of `tokens`: as few as kPartTokens allows, their sizes within one token of each other.
struct Parts {
  int64_t tokens, count;
  explicit Parts(int64_t tokens)
      : tokens(tokens), count(std::max<int64_t>(1, (tokens + kPartTokens - 1) / kPartTokens)) {}
  int64_t start(int64_t p) const { return tokens * p / count; }  // part p: [start(p), start(p + 1))
};

// T: the query's and output's type; C: the cache's (T, or an FP8 tag with k_scale / v_scale folded in).
template <typename T, typename C, int HeadDim>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                           double k_scale, double v_scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = reinterpret_cast<const C*>(k_cache.const_data_ptr());
  const C* v_ptr = reinterpret_cast<const C*>(v_cache.const_data_ptr());
  T* o_ptr = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t q_stride0 = query.stride(0), q_stride1 = query.stride(1);
  const int64_t o_stride0 = out.stride(0), o_stride1 = out.stride(1);
  const int64_t head_stride = num_blocks * block_size * head_dim;  // one kv head's slab of the cache
  const float cap = static_cast<float>(softcap), fscale = static_cast<float>(scale * k_scale);
  const float vscale = static_cast<float>(v_scale);

  // Work items: (request, kv head, part of its context (Parts)), each for all the kv head's query
  // heads. A request's parts depend on its context alone, never on the batch or the threads, so its output is the
  // same in any batch: one part's output is written as it is, several parts' softmaxes are merged in one order.
  // Only the scheduling depends on the batch: with enough (request, kv head) pairs for the threads, a thread runs
  // all of a pair's parts and merges them itself; with few (batch 1), the parts go to the threads one by one and
  // are merged after.
  struct Item { int64_t b, kvh, first, stop, part; };  // part: the item's slot among the partial results, or -1
  struct Pair { int64_t item, count; };  // a (request, kv head)'s items, consecutive
  // This thread's, kept with their capacity from call to call (so is each worker's scratch): a batch-1 call made
  // ~20 allocations. Named through references: the other threads' lambdas must see these, not their own.
  thread_local std::vector<Item> item_store;
  thread_local std::vector<Pair> pair_store;
  std::vector<Item>& items = item_store;
  std::vector<Pair>& pairs = pair_store;
  items.clear(), pairs.clear();
  int64_t partials = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const Parts parts(len - first);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      pairs.push_back({static_cast<int64_t>(items.size()), parts.count});
      for (int64_t p = 0; p < parts.count; ++p)
        items.push_back({b, kvh, first + parts.start(p), first + parts.start(p + 1),
                         parts.count > 1 ? partials++ : -1});
    }
  }
  // A split part's normalized sums per query head ([partials][group][head_dim]), and its softmax's max and total.
  thread_local std::vector<float> part_acc, part_stats;
  part_acc.resize(partials * group * head_dim);
  part_stats.resize(partials * group * 2);
  float* const acc_out = part_acc.data();
  float* const stats_out = part_stats.data();

#ifdef ASERVE_BF16_DOT
  constexpr bool bf16_dot = std::is_same_v<T, BF16> && std::is_same_v<C, BF16> && HeadDim > 0;
#else
  constexpr bool bf16_dot = false;
#endif
#ifdef ASERVE_FP8_DOT
  constexpr bool fp8_dot = std::is_same_v<T, BF16> && is_fp8<C> && HeadDim > 0;
#else
  constexpr bool fp8_dot = false;
#endif
  // bf16 products on fp32 FMAs rather than vdpbf16ps (the choice cpu_gemm's bf16 panels follow; an FP8 cache is
  // then widened to fp32 as on other CPUs)
  const bool fma_dot = (bf16_dot || fp8_dot) && bf16_products() == Products::kFma;
  // probabilities rounded to bf16 pairs for vdpbf16ps
  const bool bf16_probs = (bf16_dot || fp8_dot) && !fma_dot;
  // the query's and the probabilities' lift to meet an FP8 cache's bf16 patterns, which the sums drop again
  const float lift = fp8_dot ? std::ldexp(1.f, kFp8Lift) : 1.f;
  const float unlift = fp8_dot ? std::ldexp(1.f, kFp8Drop - kFp8Lift) : 1.f;
  // One thread's scratch, and the items it runs in turn (the next one's rows found and prefetched meanwhile).
  struct Worker {
    std::vector<float> q, row, acc, scores, merged, totals, peaks;
    std::vector<T> qb;
    std::vector<uint16_t> probs;
    std::vector<int64_t> offsets, next_offsets;
    int64_t ready = -1;  // the item whose rows next_offsets holds
  };
  auto make_worker = [&]() -> Worker& {
    thread_local Worker w;
    w.q.resize(group * head_dim), w.row.resize(head_dim), w.acc.resize(group * head_dim);
    w.merged.resize(head_dim), w.qb.resize(bf16_dot || fp8_dot ? group * head_dim : 0), w.totals.resize(group);
    w.peaks.resize(group * fVec::size());
    w.ready = -1;
    return w;
  };
  auto rows_of = [&](int64_t i, std::vector<int64_t>& offs) {
    const Item& it = items[i];
    offs.resize(it.stop - it.first);
    token_offsets(tables + it.b * table_width, block_size, head_dim, it.first, it.stop, offs.data());
  };
  // Item i; `next`: the item this thread runs after it, or -1.
  auto run_item = [&](Worker& w, int64_t i, int64_t next) {
    const Item& it = items[i];
    if (w.ready != i) rows_of(i, w.next_offsets);
    std::swap(w.offsets, w.next_offsets);
    const int64_t b = it.b, kvh = it.kvh, n = it.stop - it.first, h0 = kvh * group;
    const C* k_head = k_ptr + kvh * head_stride;
    const C* v_head = v_ptr + kvh * head_stride;
    const int64_t* offsets = w.offsets.data();
    w.scores.resize(group * n);
    float* scores = w.scores.data();
    Ahead ahead;
    w.ready = -1;
    if (next >= 0) {
      const Item& following = items[next];
      rows_of(next, w.next_offsets);
      w.ready = next;
      const int64_t steps = bf16_dot || bf16_probs ? ahead_steps<HeadDim, true>(n, group)
                                                   : ahead_steps<HeadDim, false>(n, group);
      ahead = Ahead(k_ptr + following.kvh * head_stride, v_ptr + following.kvh * head_stride, w.next_offsets.data(),
                    following.stop - following.first, sizeof(C), head_dim * sizeof(C), steps);
    }
    for (int64_t j = 0; j < std::min<int64_t>(n, 32); ++j) prefetch(k_head + offsets[j], head_dim * sizeof(C));
    float* peaks = w.peaks.data();  // each head's running maximum, lane by lane
    std::fill(w.peaks.begin(), w.peaks.end(), -std::numeric_limits<float>::infinity());
    if constexpr (bf16_dot || fp8_dot) {
      if (bf16_probs) {
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q_ptr + b * q_stride0 + (h0 + g) * q_stride1;
          T* dst = w.qb.data() + g * head_dim;
          if constexpr (fp8_dot)
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(static_cast<float>(src[d]) * lift);
          else
            std::memcpy(dst, src, head_dim * sizeof(T));
        }
        key_scores_bf16<C, HeadDim>(w.qb.data(), group, k_head, v_head, offsets, it.first, n, block_size,
                                    fscale * unlift, scores, peaks, ahead);
      }
    }
    if (!bf16_probs) {
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + b * q_stride0 + (h0 + g) * q_stride1, w.q.data() + g * head_dim, head_dim);
        scale_row(w.q.data() + g * head_dim, fscale, head_dim);
      }
      key_scores<C, HeadDim>(w.q.data(), group, head_dim, k_head, v_head, offsets, it.first, n, block_size, scores,
                             w.row.data(), peaks, ahead);
    }
    const auto max_of = [](fVec& x, fVec& y) { return at::vec::maximum(x, y); };
    if (cap > 0.f) {  // soft-capping: the maxima are found again after it
      at::vec::map([cap](fVec x) { return tanh_rational(x / fVec(cap)) * fVec(cap); }, scores, scores, group * n);
      for (int64_t g = 0; g < group; ++g)
        fVec(at::vec::reduce_all<float>(max_of, scores + g * n, n)).store(peaks + g * fVec::size());
    }
    // Softmax. bf16 cache on vdpbf16ps: exp(s - max) rounded to bf16 in the same pass that sums it, into rows of
    // even length (the value pass reads a pair of tokens' probabilities as one word); on FMAs in place. Either way
    // the value sums are divided by the total after. Other caches: in place, normalized before the value pass.
    const int64_t stride = (n + 1) / 2 * 2;
    if (bf16_probs) w.probs.resize(group * stride);
    float* totals = w.totals.data();
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * n;
      const float peak = at::vec::vec_reduce_all<float>(max_of, fVec::loadu(peaks + g * fVec::size()));
      float total;
      if (bf16_probs) {  // (exp_to_bf16 is only declared where bf16_dot and fp8_dot are false)
        if constexpr (bf16_dot || fp8_dot) total = exp_to_bf16(s, peak, n, w.probs.data() + g * stride, lift);
      } else {
        total = exp_in_place(s, peak, n);
        if (!bf16_dot) scale_row(s, 1.f / total, n);  // bf16 caches divide the value sums instead
      }
      totals[g] = total;
      if (it.part >= 0) {
        stats_out[(it.part * group + g) * 2] = peak;
        stats_out[(it.part * group + g) * 2 + 1] = total;
      }
    }
    float* sums = it.part >= 0 ? acc_out + it.part * group * head_dim : w.acc.data();
    if (bf16_probs || bf16_dot) {
      if constexpr (bf16_dot || fp8_dot) {
        if (bf16_probs)
          value_sum_bf16<HeadDim>(w.probs.data(), stride, group, v_head, offsets, n, sums, ahead);
        else if constexpr (bf16_dot)
          value_sum_bf16<HeadDim>(scores, n, group, v_head, offsets, n, sums, ahead);
      }
      for (int64_t g = 0; g < group; ++g) scale_row(sums + g * head_dim, vscale * unlift / totals[g], head_dim);
    } else {
      value_sum<C, HeadDim>(scores, group, head_dim, v_head, offsets, n, sums, w.row.data(), ahead);
      if (vscale != 1.f) scale_row(sums, vscale, group * head_dim);
    }
    if (it.part < 0)
      for (int64_t g = 0; g < group; ++g)
        store_row(sums + g * head_dim, o_ptr + b * o_stride0 + (h0 + g) * o_stride1, head_dim);
  };
  // A split pair's heads: out = sum_p w_p acc_p / sum_p w_p, w_p = total_p exp(max_p - max), parts in order.
  auto merge = [&](Worker& w, const Pair& pair) {
    const Item& lead = items[pair.item];
    for (int64_t g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < pair.count; ++p)
        top = std::max(top, stats_out[(items[pair.item + p].part * group + g) * 2]);
      float weights = 0.f;
      std::fill(w.merged.begin(), w.merged.end(), 0.f);
      for (int64_t p = 0; p < pair.count; ++p) {
        const int64_t part = items[pair.item + p].part;
        const float weight = stats_out[(part * group + g) * 2 + 1] * std::exp(stats_out[(part * group + g) * 2] - top);
        weights += weight;
        axpy(weight, acc_out + (part * group + g) * head_dim, w.merged.data(), head_dim);
      }
      scale_row(w.merged.data(), 1.f / weights, head_dim);
      store_row(w.merged.data(), o_ptr + lead.b * o_stride0 + (lead.kvh * group + g) * o_stride1, head_dim);
    }
  };
  const auto num_items = static_cast<int64_t>(items.size()), num_pairs = static_cast<int64_t>(pairs.size());
  if (num_pairs >= 2 * parallel_threads()) {
    // The threads claim runs of pairs as they go (Claims: a static split waited on whichever core the VM ran
    // slower). Each item prefetches the next, past the end of its run too: most runs' next is this thread's.
    parallel_claims(1, num_pairs, [&](Claims& claims) {
      Worker& w = make_worker();
      for (int64_t begin, end; claims.claim(begin, end);) {
        for (int64_t pr = begin; pr < end; ++pr) {
          const Pair& pair = pairs[pr];
          for (int64_t i = pair.item; i < pair.item + pair.count; ++i) run_item(w, i, i + 1 < num_items ? i + 1 : -1);
          if (pair.count > 1) merge(w, pair);
        }
      }
    });
    return;
  }
  parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    Worker& w = make_worker();
    for (int64_t i = begin; i < end; ++i) run_item(w, i, i + 1 < end ? i + 1 : -1);
  });
  if (partials > 0) {
    Worker& w = make_worker();
    for (const Pair& pair : pairs)
      if (pair.count > 1) merge(w, pair);
  }
}

// Head sizes the unrolled path takes: multiples of two 16-bit vectors (32 lanes with AVX-512, 16 with AVX2).
template <typename T, typename C>
void decode_attention_dispatch(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                               double k_scale, double v_scale) {
  constexpr int64_t unit = 2 * fVec::size();
  switch (query.size(2)) {
    case 64: if constexpr (64 % unit == 0) return decode_attention_impl<T, C, 64>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale); break;
    case 128: if constexpr (128 % unit == 0) return decode_attention_impl<T, C, 128>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale); break;
    case 256: if constexpr (256 % unit == 0) return decode_attention_impl<T, C, 256>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale); break;
  }
  decode_attention_impl<T, C, 0>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale);
}

// The cache in the query's dtype (kv_format 0), or FP8 bytes with their scales (1 = e4m3, whose widening
// through fp16 reads 2^-8 of the value: the 2^8 goes into the scales here; 2 = e5m2).
template <typename T>
void decode_attention_by_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                               double k_scale, double v_scale, int64_t kv_format) {
  switch (kv_format) {
    case 0: return decode_attention_dispatch<T, T>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale);
    case 1: return decode_attention_dispatch<T, E4M3>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale * 256.0, v_scale * 256.0);
    case 2: return decode_attention_dispatch<T, E5M2>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale);
  }
  TORCH_CHECK(false, "paged_decode_attention: kv_format must be 0 (the query's dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t window, double softcap, double k_scale, double v_scale,
                            int64_t kv_format) {
  check_attention_args("paged_decode_attention", out, query, k_cache, v_cache, kv_format);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int64 [batch, width]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() && context_lens.dim() == 1 &&
                  context_lens.size(0) == query.size(0),
              "context_lens must be contiguous int64 [batch]");
  check_block_tables("paged_decode_attention", block_tables, context_lens.data_ptr<int64_t>(), k_cache);
  switch (query.scalar_type()) {
    case at::kFloat: return decode_attention_by_cache<float>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kBFloat16: return decode_attention_by_cache<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kHalf: return decode_attention_by_cache<c10::Half>(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, float softcap, float k_scale=1.0, float v_scale=1.0, "
        "int kv_format=0) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
