// Decode attention over the paged KV cache, torch.ops.aserve.paged_decode_attention (the cache in the query's
// dtype, or FP8 bytes), with AVX-512 paths for bf16 caches: vdpbf16ps, or fp32 FMAs where bf16_products() picks
// them.
//
// One query token per request. Work items are (request, kv head, group of query heads): each reads its
// request's keys once for the queries of its group (scores, then softmax), then the values once. Tokens
// are walked block by block; for the common head sizes the row loops are unrolled at compile time
// (HeadDim > 0) so a key or value row lives in registers, else a runtime-sized path does the same work.
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
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

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
      __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      if constexpr (std::is_same_v<T, E5M2>) {
        w = _mm_slli_epi16(w, 8);
      } else {
        w = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                         _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
      }
      out[c] = _mm256_cvtph_ps(w);
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
  for (int64_t t = first; t < len;) {
    const int64_t offset = t % block_size, block = t / block_size;
    const int64_t stop = std::min(len, t - offset + block_size);
    int64_t at = (table[block] * block_size + offset) * row_size;
    for (; t < stop; ++t, at += row_size) *out++ = at;
  }
}

inline void prefetch(const void* row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line<1>(static_cast<const char*>(row) + i);
}

// The next work item's key and value rows, fetched into the L2 cache while this item is computed. One
// request's rows lie in 2 KB runs (a block of one kv head) anywhere in the cache: too short for the hardware
// prefetchers to get ahead of the loads, so each item used to start with its rows in DRAM and the kernel ran at
// half the memory bandwidth. Both passes call step() every 16 tokens, which fetches the next item's rows at a
// pace that spreads them over this item's two passes (a burst would fill the line-fill buffers and stall the
// loads this item needs). Into L2 (hint 2): fetching into L1 evicted the current item's rows and was slower.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* offsets = nullptr;  // rows of the next item, in elements of `elem` bytes
  int64_t n = 0, pos = 0, elem = 0, row_bytes = 0, per_step = 0;
  Ahead() = default;
  Ahead(const void* k_head, const void* v_head, const int64_t* offsets, int64_t n, int64_t elem, int64_t row_bytes,
        int64_t current_n)
      : k(static_cast<const char*>(k_head)), v(static_cast<const char*>(v_head)), offsets(offsets), n(n),
        elem(elem), row_bytes(row_bytes), per_step(n * 8 / std::max<int64_t>(current_n, 1) + 1) {}
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

// Lane i of the result = the sum of v[i]'s lanes, for W = fVec::size() vectors: one transposing tree of
// shuffles and adds (about 3 instructions a vector) in place of W horizontal sums (about 8 each).
inline fVec reduce_lanes(const fVec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 s[8], u[4];
  for (int j = 0; j < 8; ++j)  // 128-bit quarters: [v0 q0+q2, v0 q1+q3, v1 q0+q2, v1 q1+q3]
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarter k holds four partial sums of v[4j + k]
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));  // [v k, v 8+k, v 4+k, v 12+k]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), z);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
#else
  float sums[fVec::size()];
  for (int i = 0; i < fVec::size(); ++i) sums[i] = reduce_sum(v[i]);
  return fVec::loadu(sums);
#endif
}

// scores[g][i] = q[g] . k[i] (q already scaled) over the rows at `offsets`. The
// unrolled path takes W = fVec::size() keys at a time per head, their products in registers, summed by one
// reduce_lanes; a short group repeats its last row and stores only `count` scores. Keys are fetched two groups
// ahead, and each group's values before the value pass needs them.
template <typename T, int HeadDim>
void key_scores(const float* q, int64_t heads, int64_t head_dim, const T* k_head, const T* v_head,
                const int64_t* offsets, int64_t n, float* scores, float* scratch, Ahead& ahead) {
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  if constexpr (HeadDim > 0) {
    constexpr int C = HeadDim / fVec::size(), W = fVec::size();
    const T* rows[W];
    for (int64_t i = 0; i < n; i += W) {
      if ((i & 15) == 0) ahead.step();
      const int count = static_cast<int>(std::min<int64_t>(W, n - i));
      for (int j = 0; j < W; ++j) rows[j] = k_head + offsets[i + std::min(j, count - 1)];
      for (int64_t j = i + 2 * W; j < std::min(n, i + 3 * W); ++j) prefetch(k_head + offsets[j], row_bytes);
      for (int64_t j = i; j < i + count; ++j) prefetch(v_head + offsets[j], row_bytes);
      // 16-bit and FP8 rows are widened once for all the group's heads (per head, an FP8 cache's keys were widened
      // `heads` times over: its decode ran 1.4x slower than a bf16 cache's at half the bytes)
      alignas(64) float wide[std::is_same_v<T, float> ? 1 : W * HeadDim];
      if constexpr (!std::is_same_v<T, float>)
        for (int r = 0; r < W; ++r) {
          fVec kv[C];
          widen<T, HeadDim>(rows[r], kv);
          for (int c = 0; c < C; ++c) kv[c].store(wide + r * HeadDim + c * W);
        }
      for (int64_t g = 0; g < heads; ++g) {
        const float* qg = q + g * HeadDim;
        fVec acc[W];
        for (int r = 0; r < W; ++r) {
          fVec kv[C];
          if constexpr (std::is_same_v<T, float>) {
            widen<T, HeadDim>(rows[r], kv);
          } else {
            for (int c = 0; c < C; ++c) kv[c] = fVec::loadu(wide + r * HeadDim + c * W);
          }
          fVec a = kv[0] * fVec::loadu(qg);
          for (int c = 1; c < C; ++c) a = at::vec::fmadd(kv[c], fVec::loadu(qg + c * W), a);
          acc[r] = a;
        }
        const fVec sums = reduce_lanes(acc);
        if (count == W) sums.store(scores + g * n + i); else sums.store(scores + g * n + i, count);
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if ((i & 15) == 0) ahead.step();
      const float* kf = row_as_float(k_head + offsets[i], scratch, head_dim);
      for (int64_t g = 0; g < heads; ++g) scores[g * n + i] = dot(q + g * head_dim, kf, head_dim);
    }
  }
}

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

// acc[g] = sum_i p[g][i] * v[i]. The unrolled path walks the values once per group of heads whose sums fit in
// half the vector registers (re-reads hit the L1/L2 cache).
template <typename T, int HeadDim>
void value_sum(const float* p, int64_t heads, int64_t head_dim, const T* v_head, const int64_t* offsets,
               int64_t n, float* acc, float* scratch, Ahead& ahead) {
  if constexpr (HeadDim > 0) {
    constexpr int C = HeadDim / fVec::size();
    constexpr int registers = fVec::size() == 16 ? 32 : 16;
    constexpr int HG = std::min(4, C >= registers / 2 ? 1 : registers / 2 / C);
    head_groups<HG>(heads, [&](auto nh, int64_t g) {
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

using BF16 = c10::BFloat16;

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// A bf16 cache on a CPU with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 values and adds both products to
// fp32 lanes, so a 64-wide key row meets a query head in 2 instructions where widening it to fp32 took 8 (the
// products are exact in fp32, as in the torch path's bf16 matmul). The query stays bf16 and the scale is applied
// to the scores, as the torch path does. Values go in pairs of tokens: their rows are interleaved so that each
// 32-bit lane holds (v[t][d], v[t+1][d]), against the pair of probabilities rounded to bf16 (the torch path
// rounds them to bf16 too, before its second matmul).
#define ASERVE_BF16_DOT 1

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Up to 16 cached keys (rows) against each query head: 16 sums in registers, folded by one reduce_lanes. A
// short group repeats its last row and stores only `count` scores.
template <int HeadDim>
inline void score_rows(const BF16* q, int64_t heads, const BF16* const* rows, int count, float scale, float* out,
                       int64_t stride) {
  constexpr int C = HeadDim / 32;
  const fVec scale_v(scale);
  for (int64_t g = 0; g < heads; ++g) {
    __m512i qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(q + g * HeadDim + c * 32);
    fVec acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(_mm512_loadu_si512(rows[i])), as_bh(qv[0]));
      for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, as_bh(_mm512_loadu_si512(rows[i] + c * 32)), as_bh(qv[c]));
      acc[i] = a;
    }
    const fVec sums = reduce_lanes(acc) * scale_v;
    if (count == 16) sums.store(out + g * stride); else sums.store(out + g * stride, count);
  }
}

template <int HeadDim>
void key_scores_bf16(const BF16* q, int64_t heads, const BF16* k_head, const BF16* v_head, const int64_t* offsets,
                     int64_t n, float scale, float* scores, Ahead& ahead) {
  const BF16* rows[16];
  for (int64_t i = 0; i < n; i += 16) {
    ahead.step();
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    for (int j = 0; j < 16; ++j) rows[j] = k_head + offsets[i + std::min(j, count - 1)];
    // Keys 32 ahead, and this group's values for the pass after this one: the cache lies in DRAM, blocks anywhere.
    for (int64_t j = i + 32; j < std::min(n, i + 48); ++j) prefetch(k_head + offsets[j], HeadDim * 2);
    for (int64_t j = i; j < i + count; ++j) prefetch(v_head + offsets[j], HeadDim * 2);
    score_rows<HeadDim>(q, heads, rows, count, scale, scores + i, n);
  }
}

// out[i] = exp(s[i] - peak) as bf16 bits, for i < n, and a zero after an odd n's last; returns the fp32 sum of the
// exponentials (before rounding), the softmax's total.
inline float exp_to_bf16(const float* s, float peak, int64_t n, uint16_t* out) {
  const fVec log2e(kLog2e), top(peak);  // exp(x - peak) = 2^((x - peak) log2(e)), the difference exact
  fVec total(0.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const fVec e = exp2_bounded((fVec::loadu(s + i) - top) * log2e);
    total = total + e;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const fVec e = _mm512_maskz_mov_ps(m, exp2_bounded((fVec(_mm512_maskz_loadu_ps(m, s + i)) - top) * log2e));
    total = total + e;
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(e));
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
template <int HeadDim, int NH>
void value_pass_bf16(const uint16_t* p, int64_t stride, int64_t n, const BF16* v_head, const int64_t* offsets,
                     float* acc, Ahead& ahead) {
  constexpr int C = HeadDim / 32;
  alignas(64) static const BF16 zero_row[HeadDim] = {};
  __m512 sums[NH][2 * C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * C; ++c) sums[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if ((i & 15) == 0) ahead.step();
    const bool two = i + 1 < n;
    const BF16* a = v_head + offsets[i];
    const BF16* b = two ? v_head + offsets[i + 1] : zero_row;
    __m512i weights[NH];
    for (int h = 0; h < NH; ++h) {
      int32_t pair;
      std::memcpy(&pair, p + h * stride + i, sizeof(pair));
      weights[h] = _mm512_set1_epi32(pair);
    }
    for (int c = 0; c < C; ++c) {
      const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(ra, rb)), hi = as_bh(_mm512_unpackhi_epi16(ra, rb));
      for (int h = 0; h < NH; ++h) {
        sums[h][2 * c] = _mm512_dpbf16_ps(sums[h][2 * c], lo, as_bh(weights[h]));
        sums[h][2 * c + 1] = _mm512_dpbf16_ps(sums[h][2 * c + 1], hi, as_bh(weights[h]));
      }
    }
  }
  store_value_sums<HeadDim, NH>(sums, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                                _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), acc);
}

// The same products on fp32 FMAs, where bf16_products() says they outrun vdpbf16ps (an Intel Xeon without AMX
// tiles, where one vdpbf16ps takes as long as four FMAs). A bf16 is the top half of its fp32, so a 32-bit lane of
// two bf16 values gives the even one shifted up 16 and the odd one masked: a 64-byte chunk of a row is its 16 even
// and 16 odd dims as two fp32 vectors, two instructions and no shuffle. The query is split the same way once an
// item, so a key row meets it in dims' pairs (even, then odd) and the sums are the same products as vdpbf16ps's.
// Values keep their dims' order: each head sums evens and odds apart, interleaved at the end; the probabilities
// stay fp32.
inline __m512 even_half(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_half(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// q's heads as [head][chunk][even 16, odd 16] fp32.
template <int HeadDim> inline void split_query(const BF16* q, int64_t q_stride, int64_t heads, float* out) {
  for (int64_t g = 0; g < heads; ++g)
    for (int c = 0; c < HeadDim / 32; ++c) {
      const __m512i pairs = _mm512_loadu_si512(q + g * q_stride + c * 32);
      _mm512_storeu_ps(out + (g * HeadDim / 32 + c) * 32, even_half(pairs));
      _mm512_storeu_ps(out + (g * HeadDim / 32 + c) * 32 + 16, odd_half(pairs));
    }
}

// key_scores_bf16 on FMAs: each group of 16 keys is split into evens and odds once ([row][chunk][32] fp32 in
// `wide`, in L1), then met by every head, 16 sums in registers folded by one reduce_lanes.
template <int HeadDim>
void key_scores_fma(const float* q, int64_t heads, const BF16* k_head, const BF16* v_head, const int64_t* offsets,
                    int64_t n, float scale, float* scores, Ahead& ahead) {
  constexpr int C = HeadDim / 32;
  alignas(64) float wide[16 * HeadDim];
  const fVec scale_v(scale);
  for (int64_t i = 0; i < n; i += 16) {
    ahead.step();
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    for (int64_t j = i + 32; j < std::min(n, i + 48); ++j) prefetch(k_head + offsets[j], HeadDim * 2);
    for (int64_t j = i; j < i + count; ++j) prefetch(v_head + offsets[j], HeadDim * 2);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const BF16* row = k_head + offsets[i + std::min(r, count - 1)];
      for (int c = 0; c < C; ++c) {
        const __m512i pairs = _mm512_loadu_si512(row + c * 32);
        _mm512_store_ps(wide + r * HeadDim + c * 32, even_half(pairs));
        _mm512_store_ps(wide + r * HeadDim + c * 32 + 16, odd_half(pairs));
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      __m512 qv[2 * C];
      for (int c = 0; c < 2 * C; ++c) qv[c] = _mm512_loadu_ps(q + g * HeadDim + c * 16);
      fVec acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        __m512 a = _mm512_mul_ps(_mm512_load_ps(wide + r * HeadDim), qv[0]);
        for (int c = 1; c < 2 * C; ++c) a = _mm512_fmadd_ps(_mm512_load_ps(wide + r * HeadDim + c * 16), qv[c], a);
        acc[r] = a;
      }
      const fVec sums = reduce_lanes(acc) * scale_v;
      if (count == 16) sums.store(scores + g * n + i); else sums.store(scores + g * n + i, count);
    }
  }
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

// acc[g] = sum_t p[g][t] * v[t] over a bf16 cache, p as bf16 bits (vdpbf16ps) or fp32 (FMAs), rows `stride` apart:
// the heads in passes whose sums fill half the registers.
template <int HeadDim, typename P>
void value_sum_bf16(const P* p, int64_t stride, int64_t heads, const BF16* v_head, const int64_t* offsets, int64_t n,
                    float* acc, Ahead& ahead) {
  constexpr int HG = HeadDim / 16 >= 16 ? 1 : 16 / (HeadDim / 16);  // 4 heads at 64 dims, 2 at 128, 1 at 256
  head_groups<HG>(heads, [&](auto nh, int64_t g) {
    constexpr int NH = decltype(nh)::value;
    if constexpr (std::is_same_v<P, float>)
      value_pass_fma<HeadDim, NH>(p + g * stride, stride, n, v_head, offsets, acc + g * HeadDim, ahead);
    else
      value_pass_bf16<HeadDim, NH>(p + g * stride, stride, n, v_head, offsets, acc + g * HeadDim, ahead);
  });
}
#else  // declared only, so the branches that would call them compile away
template <int HeadDim>
void key_scores_bf16(const BF16*, int64_t, const BF16*, const BF16*, const int64_t*, int64_t, float, float*, Ahead&);
float exp_to_bf16(const float*, float, int64_t, uint16_t*);
template <int HeadDim, typename P>
void value_sum_bf16(const P*, int64_t, int64_t, const BF16*, const int64_t*, int64_t, float*, Ahead&);
template <int HeadDim> void split_query(const BF16*, int64_t, int64_t, float*);
template <int HeadDim>
void key_scores_fma(const float*, int64_t, const BF16*, const BF16*, const int64_t*, int64_t, float, float*, Ahead&);
#endif

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
  std::vector<Item> items;
  std::vector<Pair> pairs;
  items.reserve(batch * num_kv_heads);
  pairs.reserve(batch * num_kv_heads);
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
  // bf16 products on fp32 FMAs rather than vdpbf16ps (the choice cpu_gemm's bf16 panels follow)
  const bool fma_dot = bf16_dot && bf16_products() == Products::kFma;
  const bool bf16_probs = bf16_dot && !fma_dot;  // probabilities rounded to bf16 pairs for vdpbf16ps
  // One thread's scratch, and the items it runs in turn (the next one's rows found and prefetched meanwhile).
  struct Worker {
    std::vector<float> q, row, acc, scores, merged, totals;
    std::vector<T> qb;
    std::vector<uint16_t> probs;
    std::vector<int64_t> offsets, next_offsets;
    int64_t ready = -1;  // the item whose rows next_offsets holds
  };
  auto make_worker = [&] {
    Worker w;
    w.q.resize(group * head_dim), w.row.resize(head_dim), w.acc.resize(group * head_dim);
    w.merged.resize(head_dim), w.qb.resize(bf16_dot ? group * head_dim : 0), w.totals.resize(group);
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
      ahead = Ahead(k_ptr + following.kvh * head_stride, v_ptr + following.kvh * head_stride, w.next_offsets.data(),
                    following.stop - following.first, sizeof(C), head_dim * sizeof(C), n);
    }
    for (int64_t j = 0; j < std::min<int64_t>(n, 32); ++j) prefetch(k_head + offsets[j], head_dim * sizeof(C));
    if constexpr (bf16_dot) {
      if (fma_dot) {
        split_query<HeadDim>(q_ptr + b * q_stride0 + h0 * q_stride1, q_stride1, group, w.q.data());
        key_scores_fma<HeadDim>(w.q.data(), group, k_head, v_head, offsets, n, fscale, scores, ahead);
      } else {
        for (int64_t g = 0; g < group; ++g)
          std::memcpy(w.qb.data() + g * head_dim, q_ptr + b * q_stride0 + (h0 + g) * q_stride1, head_dim * sizeof(T));
        key_scores_bf16<HeadDim>(w.qb.data(), group, k_head, v_head, offsets, n, fscale, scores, ahead);
      }
    } else {
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + b * q_stride0 + (h0 + g) * q_stride1, w.q.data() + g * head_dim, head_dim);
        scale_row(w.q.data() + g * head_dim, fscale, head_dim);
      }
      key_scores<C, HeadDim>(w.q.data(), group, head_dim, k_head, v_head, offsets, n, scores, w.row.data(), ahead);
    }
    if (cap > 0.f)  // soft-capping
      at::vec::map([cap](fVec x) { return tanh_rational(x / fVec(cap)) * fVec(cap); }, scores, scores, group * n);
    // Softmax. bf16 cache on vdpbf16ps: exp(s - max) rounded to bf16 in the same pass that sums it, into rows of
    // even length (the value pass reads a pair of tokens' probabilities as one word); on FMAs in place. Either way
    // the value sums are divided by the total after. Other caches: in place, normalized before the value pass.
    const int64_t stride = (n + 1) / 2 * 2;
    if (bf16_probs) w.probs.resize(group * stride);
    float* totals = w.totals.data();
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * n;
      const float peak = at::vec::reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, s, n);
      float total;
      if (bf16_probs) {  // (exp_to_bf16 is only declared where bf16_dot is false)
        if constexpr (bf16_dot) total = exp_to_bf16(s, peak, n, w.probs.data() + g * stride);
      } else {
        const fVec log2e(kLog2e), top(peak);
        at::vec::map([&](fVec x) { return exp2_bounded((x - top) * log2e); }, s, s, n);
        total = at::vec::reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, s, n);
        if (!bf16_dot) scale_row(s, 1.f / total, n);  // bf16 caches divide the value sums instead
      }
      totals[g] = total;
      if (it.part >= 0) {
        stats_out[(it.part * group + g) * 2] = peak;
        stats_out[(it.part * group + g) * 2 + 1] = total;
      }
    }
    float* sums = it.part >= 0 ? acc_out + it.part * group * head_dim : w.acc.data();
    if constexpr (bf16_dot) {
      if (fma_dot)
        value_sum_bf16<HeadDim>(scores, n, group, v_head, offsets, n, sums, ahead);
      else
        value_sum_bf16<HeadDim>(w.probs.data(), stride, group, v_head, offsets, n, sums, ahead);
      for (int64_t g = 0; g < group; ++g) scale_row(sums + g * head_dim, vscale / totals[g], head_dim);
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
  if (num_pairs >= 2 * at::get_num_threads()) {
    at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
      Worker w = make_worker();
      const int64_t last = pairs[end - 1].item + pairs[end - 1].count;
      for (int64_t pr = begin; pr < end; ++pr) {
        const Pair& pair = pairs[pr];
        for (int64_t i = pair.item; i < pair.item + pair.count; ++i) run_item(w, i, i + 1 < last ? i + 1 : -1);
        if (pair.count > 1) merge(w, pair);
      }
    });
    return;
  }
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    Worker w = make_worker();
    for (int64_t i = begin; i < end; ++i) run_item(w, i, i + 1 < end ? i + 1 : -1);
  });
  if (partials > 0) {
    Worker w = make_worker();
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
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int64 [batch, width]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.size(0) == query.size(0),
              "context_lens must be contiguous int64 [batch]");
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
