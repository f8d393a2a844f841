// aserve's CPU kernels: fused decode and prefill attention over the paged KV cache, KV cache writes (FP8 quantization
// included), RMSNorm, rotary embedding, SiLU-and-mul and the int8 weight-only linear of decode batches. Each replaces a chain of small torch ops (and, for attention, a gather that copied every
// request's context once per layer) with one pass over the data. Registered as torch ops (torch.ops.aserve.*);
// aserve/ops/cpu_kernels.py builds this file once per CPU kind and falls back to the torch path without it.
//
// Arithmetic is in fp32 whatever the storage dtype (float, bfloat16, half); results are rounded where the
// torch path rounds, so the two agree to the last bit in fp32 up to summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;  // 16 lanes with AVX-512, 8 with AVX2 (CPU_CAPABILITY_* at build)

// An FP8 KV cache stores bytes; these tags say how to read them. Bytes are widened through fp16 bit
// patterns: e5m2 is an fp16's top byte; e4m3's exponent and mantissa moved into fp16's place read as the value
// times 2^-8 (bias 7 against 15, subnormals included). decode_attention_by_cache folds that 2^8 into the
// scales, so a row widens with no multiply. Saturated writes mean e4m3's NaN pattern never occurs.
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };
template <typename T> constexpr bool is_fp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

template <typename T> inline uint16_t fp8_to_fp16_bits(uint8_t b) {
  if constexpr (std::is_same_v<T, E5M2>) {
    return static_cast<uint16_t>(b) << 8;
  } else {
    return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
  }
}

template <typename T> inline float fp8_to_float(uint8_t b) {
  return static_cast<float>(c10::Half(fp8_to_fp16_bits<T>(b), c10::Half::from_bits()));
}

// Rows are converted to fp32 scratch once and worked on there (at::vec's generic convert is scalar for
// 16-bit -> fp32, so the widening is spelled out with Vectorized<T>; the narrowing one is vectorized).
template <typename T> inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (is_fp8<T>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8_to_float<T>(src[i].bits);
  } else {
    using bVec = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}
template <typename T> inline void store_row(const float* src, T* dst, int64_t n) { at::vec::convert(src, dst, n); }

// A row as fp32: the row itself when it is fp32, else widened into `scratch`.
template <typename T> inline const float* row_as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, scratch, n);
    return scratch;
  }
}

// Round a fp32 row through T and back: where the torch path stores an intermediate in the model's dtype.
template <typename T> inline void round_row(float* row, T* tmp, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    store_row(row, tmp, n);
    load_row(tmp, row, n);
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

inline void scale_row(float* x, float alpha, int64_t n) {
  const fVec a(alpha);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) (fVec::loadu(x + i) * a).store(x + i);
  for (; i < n; ++i) x[i] *= alpha;
}

// ---- decode attention ------------------------------------------------------------------------------------
// One query token per request. Work items are (request, kv head, group of query heads): each reads its
// request's keys once for the queries of its group (scores, then softmax), then the values once. Tokens
// are walked block by block; for the common head sizes the row loops are unrolled at compile time
// (HeadDim > 0) so a key or value row lives in registers, else a runtime-sized path does the same work.

// A cached row as fp32 vectors, D a multiple of twice the fp32 vector width.
template <typename T, int D> inline void widen(const T* p, fVec* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int c = 0; c < D / fVec::size(); ++c) out[c] = fVec::loadu(p + c * fVec::size());
  } else if constexpr (is_fp8<T>) {
    for (int c = 0; c < D / fVec::size(); ++c) {
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p) + c * fVec::size();
#if defined(CPU_CAPABILITY_AVX512)
      __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      if constexpr (std::is_same_v<T, E5M2>) {
        w = _mm256_slli_epi16(w, 8);
      } else {
        w = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
      }
      out[c] = _mm512_cvtph_ps(w);
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

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
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
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(row) + i, 0, 3);
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
        __builtin_prefetch(k + at + i, 0, 2);
        __builtin_prefetch(v + at + i, 0, 2);
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
      for (int64_t g = 0; g < heads; ++g) {
        const float* qg = q + g * HeadDim;
        fVec acc[W];
        for (int r = 0; r < W; ++r) {
          fVec kv[C];
          widen<T, HeadDim>(rows[r], kv);
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

// acc[h] = sum_t p[h][t] * v[t] for NH heads (p as bf16 bits, rows n apart), their sums in registers. Tokens go
// in pairs; an odd last one is paired with a zero row. Lane i of chunk c's low/high sums holds dim
// 32c + 8(i/4) + i%4 (+ 4 for the high ones), the order unpacklo/unpackhi leave, put back in order at the end.
template <int HeadDim, int NH>
void value_pass_bf16(const uint16_t* p, int64_t n, const BF16* v_head, const int64_t* offsets, float* acc,
                     Ahead& ahead) {
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
    for (int h = 0; h < NH; ++h)
      weights[h] = _mm512_set1_epi32(
          static_cast<int32_t>(p[h * n + i] | (two ? uint32_t(p[h * n + i + 1]) << 16 : 0u)));
    for (int c = 0; c < C; ++c) {
      const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(ra, rb)), hi = as_bh(_mm512_unpackhi_epi16(ra, rb));
      for (int h = 0; h < NH; ++h) {
        sums[h][2 * c] = _mm512_dpbf16_ps(sums[h][2 * c], lo, as_bh(weights[h]));
        sums[h][2 * c + 1] = _mm512_dpbf16_ps(sums[h][2 * c + 1], hi, as_bh(weights[h]));
      }
    }
  }
  const __m512i lo_order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_order = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) {
      float* out = acc + h * HeadDim + c * 32;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(sums[h][2 * c], lo_order, sums[h][2 * c + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(sums[h][2 * c], hi_order, sums[h][2 * c + 1]));
    }
}

// acc[g] = sum_t p[g][t] * v[t]: the heads in passes whose sums fill half the registers.
template <int HeadDim>
void value_sum_bf16(const uint16_t* p, int64_t heads, const BF16* v_head, const int64_t* offsets, int64_t n,
                    float* acc, Ahead& ahead) {
  constexpr int HG = HeadDim / 16 >= 16 ? 1 : 16 / (HeadDim / 16);  // 4 heads at 64 dims, 2 at 128, 1 at 256
  head_groups<HG>(heads, [&](auto nh, int64_t g) {
    value_pass_bf16<HeadDim, decltype(nh)::value>(p + g * n, n, v_head, offsets, acc + g * HeadDim, ahead);
  });
}
#else  // declared only, so the branches that would call them compile away
template <int HeadDim>
void key_scores_bf16(const BF16*, int64_t, const BF16*, const BF16*, const int64_t*, int64_t, float, float*, Ahead&);
template <int HeadDim>
void value_sum_bf16(const uint16_t*, int64_t, const BF16*, const int64_t*, int64_t, float*, Ahead&);
#endif

// T: the query's and output's type; C: the cache's (T, or an FP8 tag with k_scale / v_scale folded in).
template <typename T, typename C, int HeadDim>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                           double k_scale, double v_scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  // Split each group of query heads when there are too few (request, kv head) pairs to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = batch * num_kv_heads >= 2 * threads ? 1 : group;
  const int64_t heads_per_item = group / splits;
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

#ifdef ASERVE_BF16_DOT
  constexpr bool bf16_dot = std::is_same_v<T, BF16> && std::is_same_v<C, BF16> && HeadDim > 0;
#else
  constexpr bool bf16_dot = false;
#endif
  at::parallel_for(0, batch * num_kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads_per_item * head_dim), row(head_dim), acc(heads_per_item * head_dim), scores;
    std::vector<T> qb(bf16_dot ? heads_per_item * head_dim : 0);
    std::vector<uint16_t> probs;
    std::vector<int64_t> offsets, next_offsets;
    Ahead ahead;
    struct Rows { int64_t b, kvh, n; };  // a work item's request, kv head and token count
    auto rows_of = [&](int64_t item, std::vector<int64_t>& offs) {
      const int64_t b = item / (num_kv_heads * splits), kvh = (item / splits) % num_kv_heads, len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      offs.resize(len - first);
      token_offsets(tables + b * table_width, block_size, head_dim, first, len, offs.data());
      return Rows{b, kvh, len - first};
    };
    Rows next = end > begin ? rows_of(begin, next_offsets) : Rows{};
    for (int64_t item = begin; item < end; ++item) {
      const Rows cur = next;
      std::swap(offsets, next_offsets);  // this item's rows, found while the one before ran
      const int64_t b = cur.b, kvh = cur.kvh, n = cur.n;
      const int64_t h0 = kvh * group + (item % splits) * heads_per_item;
      const C* k_head = k_ptr + kvh * head_stride;
      const C* v_head = v_ptr + kvh * head_stride;
      scores.resize(heads_per_item * n);
      ahead = Ahead{};
      if (item + 1 < end) {
        next = rows_of(item + 1, next_offsets);
        if (next.b != b || next.kvh != kvh)  // (a split item shares its rows with the one before)
          ahead = Ahead(k_ptr + next.kvh * head_stride, v_ptr + next.kvh * head_stride, next_offsets.data(),
                        next.n, sizeof(C), head_dim * sizeof(C), n);
      }
      for (int64_t j = 0; j < std::min<int64_t>(n, 32); ++j) prefetch(k_head + offsets[j], head_dim * sizeof(C));
      if constexpr (bf16_dot) {
        for (int64_t g = 0; g < heads_per_item; ++g)
          std::memcpy(qb.data() + g * head_dim, q_ptr + b * q_stride0 + (h0 + g) * q_stride1, head_dim * sizeof(T));
        key_scores_bf16<HeadDim>(qb.data(), heads_per_item, k_head, v_head, offsets.data(), n, fscale, scores.data(),
                                 ahead);
      } else {
        for (int64_t g = 0; g < heads_per_item; ++g) {
          load_row(q_ptr + b * q_stride0 + (h0 + g) * q_stride1, q.data() + g * head_dim, head_dim);
          scale_row(q.data() + g * head_dim, fscale, head_dim);
        }
        key_scores<C, HeadDim>(q.data(), heads_per_item, head_dim, k_head, v_head, offsets.data(), n, scores.data(),
                               row.data(), ahead);
      }
      if (cap > 0.f)  // soft-capping
        for (int64_t i = 0; i < heads_per_item * n; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
      for (int64_t g = 0; g < heads_per_item; ++g) {  // softmax in place
        float* s = scores.data() + g * n;
        const float peak = at::vec::reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([peak](fVec x) { return (x - fVec(peak)).exp(); }, s, s, n);
        const float total = at::vec::reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, s, n);
        scale_row(s, 1.f / total, n);
      }
      if constexpr (bf16_dot) {
        probs.resize(heads_per_item * n);
        at::vec::convert(scores.data(), reinterpret_cast<BF16*>(probs.data()), heads_per_item * n);
        value_sum_bf16<HeadDim>(probs.data(), heads_per_item, v_head, offsets.data(), n, acc.data(), ahead);
      } else {
        value_sum<C, HeadDim>(scores.data(), heads_per_item, head_dim, v_head, offsets.data(), n, acc.data(),
                              row.data(), ahead);
      }
      if (vscale != 1.f) scale_row(acc.data(), vscale, heads_per_item * head_dim);
      for (int64_t g = 0; g < heads_per_item; ++g)
        store_row(acc.data() + g * head_dim, o_ptr + b * o_stride0 + (h0 + g) * o_stride1, head_dim);
    }
  });
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

// What both attention ops require of the query, the output and the caches.
void check_attention_args(const char* op, const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, int64_t kv_format) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), op, ": query and out must be [rows, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              op, ": k_cache and v_cache must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(query.size(1) % k_cache.size(0) == 0, op, ": query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), op, ": head_dim differs between query and cache");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, op, ": query and out need unit stride in head_dim");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": query and out must share a dtype, and so must the two caches");
  TORCH_CHECK(kv_format == 0 ? k_cache.scalar_type() == query.scalar_type() : k_cache.scalar_type() == at::kByte,
              op, ": the cache must be in the query's dtype, or uint8 (FP8 bytes) with kv_format 1 or 2");
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

// ---- prefill attention ---------------------------------------------------------------------------------------
// Chunks of prompt tokens, each query attending to its chunk's cached context and causally to the chunk itself
// (its keys are written to the cache before this runs), FlashAttention's way: nothing of size keys x queries is
// kept. A work item is (chunk, kv head, tile of about kTileRows query rows: query tokens x the group's heads).
// Its queries are loaded once, scaled and held transposed, [head_dim][rows]; its keys are walked kKeyStep at a
// time, read in place from the cache (widened to fp32 first when the cache is 16-bit or FP8), with a running
// max, sum and output per query row. Both products are register tiles of 6 rows x 2W columns (W = fVec::size()),
// as in a GEMM: the scores as keys x query rows (a key element broadcast against 2W query rows), the output as
// query rows x head dims (a probability broadcast against 2W dims of a value row). No transposes of the keys,
// no horizontal sums. Items are dealt to threads round-robin by descending cost, so the causal triangle's long
// tiles do not all land on one thread.
constexpr int kTileRows = 48;
constexpr int kKeyStep = 32;
constexpr int kCols = 2 * fVec::size();

// st[i][0..kCols) = sum_d k[i][d] * qt[d][0..kCols): MR keys' scores against kCols query rows.
template <int MR>
inline void score_tile(const float* const* k, const float* qt, int64_t ldq, int64_t D, float* st, int64_t ldst) {
  fVec acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = fVec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const fVec b0 = fVec::loadu(qt + d * ldq), b1 = fVec::loadu(qt + d * ldq + fVec::size());
    for (int i = 0; i < MR; ++i) {
      const fVec a(k[i][d]);
      acc[i][0] = at::vec::fmadd(a, b0, acc[i][0]);
      acc[i][1] = at::vec::fmadd(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    acc[i][0].store(st + i * ldst);
    acc[i][1].store(st + i * ldst + fVec::size());
  }
}

// o[r][0..kCols) = o[r][0..kCols) * corr[r] + sum_j pt[j][r] * v[j][0..kCols), for MR query rows r.
template <int MR>
inline void output_tile(const float* pt, int64_t ldp, const float* const* v, int64_t c, int64_t nk, float* o,
                        int64_t ldo, const float* corr) {
  fVec acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = fVec::loadu(o + i * ldo) * fVec(corr[i]);
    acc[i][1] = fVec::loadu(o + i * ldo + fVec::size()) * fVec(corr[i]);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const fVec b0 = fVec::loadu(v[j] + c), b1 = fVec::loadu(v[j] + c + fVec::size());
    for (int i = 0; i < MR; ++i) {
      const fVec a(pt[j * ldp + i]);
      acc[i][0] = at::vec::fmadd(a, b0, acc[i][0]);
      acc[i][1] = at::vec::fmadd(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    acc[i][0].store(o + i * ldo);
    acc[i][1].store(o + i * ldo + fVec::size());
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

// Query tokens per item: about kTileRows rows (tokens x the group's heads), as a multiple of kCols rows where one
// near it exists, so that no score column is padding (3 heads a group, 16-lane vectors: 32 tokens = 96 rows
// instead of 16 = 48 rows in 64 columns).
inline int64_t tile_query_count(int64_t group) {
  const int64_t step = kCols / std::gcd<int64_t>(group, kCols);  // tokens whose rows fill whole columns
  const int64_t wanted = std::max<int64_t>(1, kTileRows / group);
  if (step * group <= 2 * kTileRows) return std::max<int64_t>(step, (wanted + step / 2) / step * step);
  return wanted;
}

// One thread's scratch, sized for the largest item.
struct PrefillScratch {
  std::vector<float> qt, o, st, kbuf, vbuf, m, l, corr, pos;  // pos: each query row's position, as fp32
  std::vector<const float*> krow, vrow;
  PrefillScratch(int64_t rows, int64_t padded, int64_t D)
      : qt(D * padded), o(rows * D), st(kKeyStep * padded), kbuf(kKeyStep * D), vbuf(kKeyStep * D), m(padded),
        l(padded), corr(padded), pos(padded), krow(kKeyStep), vrow(kKeyStep) {}
};

// T: the query's and output's type; C: the cache's (T, or an FP8 tag with k_scale / v_scale folded in).
template <typename T, typename C>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, double k_scale, double v_scale) {
  const int64_t num_heads = query.size(1), D = query.size(2), chunks = context_lens.size(0);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  const int64_t tile_queries = tile_query_count(group);
  const int64_t max_rows = tile_queries * group, padded = (max_rows + kCols - 1) / kCols * kCols;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const C* k_ptr = reinterpret_cast<const C*>(k_cache.const_data_ptr());
  const C* v_ptr = reinterpret_cast<const C*>(v_cache.const_data_ptr());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t head_stride = num_blocks * block_size * D;
  const float fscale = static_cast<float>(scale * k_scale), vscale = static_cast<float>(v_scale);
  const float cap = static_cast<float>(softcap), neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full_cols = D / kCols * kCols;

  struct Item { int64_t chunk, kvh, q0, nq, cost; };
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = starts[c + 1] - starts[c], ctx = contexts[c];
    for (int64_t q0 = 0; q0 < n; q0 += tile_queries) {
      const int64_t nq = std::min(tile_queries, n - q0), last = ctx + q0 + nq;
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx + q0 - window + 1) : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({c, h, q0, nq, nq * (last - first)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));

  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch s(max_rows, padded, D);
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      for (size_t it = t; it < items.size(); it += threads) {
        const Item item = items[it];
        const int64_t ctx = contexts[item.chunk], row0 = starts[item.chunk] + item.q0, h0 = item.kvh * group;
        const int64_t rows = item.nq * group;
        const int64_t* table = tables + item.chunk * table_width;
        const C* k_head = k_ptr + item.kvh * head_stride;
        const C* v_head = v_ptr + item.kvh * head_stride;
        // queries, scaled, as [D][padded]; row r = query qi's head g at r = qi * group + g
        std::fill(s.qt.begin(), s.qt.end(), 0.f);
        for (int64_t qi = 0; qi < item.nq; ++qi) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            load_row(q_ptr + (row0 + qi) * qs0 + (h0 + g) * qs1, row.data(), D);
            for (int64_t d = 0; d < D; ++d) s.qt[d * padded + r] = row[d] * fscale;
            s.pos[r] = static_cast<float>(ctx + item.q0 + qi);
          }
        }
        std::fill(s.pos.begin() + rows, s.pos.end(), s.pos[rows - 1]);  // padding rows: copies of the last
        std::fill(s.m.begin(), s.m.end(), neg_inf);
        std::fill(s.l.begin(), s.l.end(), 0.f);
        std::fill(s.o.begin(), s.o.begin() + rows * D, 0.f);
        const int64_t first_pos = ctx + item.q0, last_pos = ctx + item.q0 + item.nq - 1;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0, hi = last_pos + 1;
        for (int64_t t0 = lo; t0 < hi; t0 += kKeyStep) {
          const int64_t nk = std::min<int64_t>(kKeyStep, hi - t0);
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t tok = t0 + j, at = (table[tok / block_size] * block_size + tok % block_size) * D;
            if constexpr (std::is_same_v<C, float>) {
              s.krow[j] = k_head + at;
              s.vrow[j] = v_head + at;
            } else {
              load_row(k_head + at, s.kbuf.data() + j * D, D);
              load_row(v_head + at, s.vbuf.data() + j * D, D);
              s.krow[j] = s.kbuf.data() + j * D;
              s.vrow[j] = s.vbuf.data() + j * D;
            }
          }
          float* st = s.st.data();  // [nk][padded] scores, then probabilities
          for (int64_t c = 0; c < padded; c += kCols)
            by_rows(nk, [&](int64_t i, auto mr) {
              score_tile<decltype(mr)::value>(s.krow.data() + i, s.qt.data() + c, padded, D, st + i * padded + c,
                                              padded);
            });
          // softcap, mask and the online softmax, each across query rows: a vector holds W rows' scores for one
          // key (padding rows too: their queries are zero, their results unused)
          const fVec lowest(neg_inf);
          if (cap > 0.f)
            for (int64_t j = 0; j < nk; ++j)
              for (int64_t r = 0; r < padded; r += fVec::size()) {
                const fVec x = fVec::loadu(st + j * padded + r);
                ((x / fVec(cap)).tanh() * fVec(cap)).store(st + j * padded + r);
              }
          if (t0 + nk - 1 > first_pos || (window > 0 && t0 <= last_pos - window)) {  // some keys masked
            for (int64_t j = 0; j < nk; ++j)
              for (int64_t r = 0; r < padded; r += fVec::size()) {
                const fVec key(static_cast<float>(t0 + j)), pos = fVec::loadu(s.pos.data() + r);
                fVec masked = key > pos;
                if (window > 0) masked = masked | (key <= pos - fVec(static_cast<float>(window)));
                fVec::blendv(fVec::loadu(st + j * padded + r), lowest, masked).store(st + j * padded + r);
              }
          }
          for (int64_t r = 0; r < padded; r += fVec::size()) {
            const fVec old = fVec::loadu(s.m.data() + r);
            fVec peak = old;
            for (int64_t j = 0; j < nk; ++j) peak = at::vec::maximum(peak, fVec::loadu(st + j * padded + r));
            // a row with no key yet (its window starts further on) keeps m = -inf; its scores, all -inf, are
            // shifted by 0 so that they give probabilities of 0, not NaN
            const fVec none = peak == lowest;
            const fVec corr = fVec::blendv((old - peak).exp(), fVec(1.f), none);
            const fVec shift = fVec::blendv(peak, fVec(0.f), none);
            fVec sum(0.f);
            for (int64_t j = 0; j < nk; ++j) {
              const fVec prob = (fVec::loadu(st + j * padded + r) - shift).exp();
              prob.store(st + j * padded + r);
              sum = sum + prob;
            }
            peak.store(s.m.data() + r);
            corr.store(s.corr.data() + r);
            (fVec::loadu(s.l.data() + r) * corr + sum).store(s.l.data() + r);
          }
          by_rows(rows, [&](int64_t r, auto mr) {
            for (int64_t c = 0; c < full_cols; c += kCols)
              output_tile<decltype(mr)::value>(st + r, padded, s.vrow.data(), c, nk, s.o.data() + r * D + c, D,
                                               s.corr.data() + r);
            for (int64_t i = r; i < r + decltype(mr)::value; ++i)  // head dims past the last full tile
              for (int64_t c = full_cols; c < D; ++c) {
                float acc = s.o[i * D + c] * s.corr[i];
                for (int64_t j = 0; j < nk; ++j) acc += st[j * padded + i] * s.vrow[j][c];
                s.o[i * D + c] = acc;
              }
          });
        }
        for (int64_t qi = 0; qi < item.nq; ++qi)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            scale_row(s.o.data() + r * D, vscale / s.l[r], D);
            store_row(s.o.data() + r * D, o_ptr + (row0 + qi) * os0 + (h0 + g) * os1, D);
          }
      }
    }
  });
}

template <typename T>
void prefill_attention_by_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                                int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  switch (kv_format) {
    case 0: return prefill_attention_impl<T, T>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale);
    case 1: return prefill_attention_impl<T, E4M3>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale * 256.0, v_scale * 256.0);
    case 2: return prefill_attention_impl<T, E5M2>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale);
  }
  TORCH_CHECK(false, "paged_prefill_attention: kv_format must be 0 (the query's dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                             int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  check_attention_args("paged_prefill_attention", out, query, k_cache, v_cache, kv_format);
  const int64_t chunks = context_lens.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() && context_lens.dim() == 1,
              "context_lens must be a contiguous int64 [chunks] vector");
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_starts.is_contiguous() &&
                  query_starts.numel() == chunks + 1,
              "query_starts must be contiguous int64 [chunks + 1]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == chunks,
              "block_tables must be contiguous int64 [chunks, width]");
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(starts[c] <= starts[c + 1] && starts[c + 1] <= query.size(0) && contexts[c] >= 0,
                "query_starts must rise within the query's rows, and context_lens be >= 0");
    TORCH_CHECK((contexts[c] + starts[c + 1] - starts[c] + k_cache.size(2) - 1) / k_cache.size(2) <=
                    block_tables.size(1),
                "a chunk's block table is shorter than its context and tokens");
  }
  if (chunks == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat: return prefill_attention_by_cache<float>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kBFloat16: return prefill_attention_by_cache<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kHalf: return prefill_attention_by_cache<c10::Half>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", query.scalar_type());
  }
}

// ---- KV cache writes ----------------------------------------------------------------------------------------
// key/value [tokens, kv_heads, head_dim] into the caches [kv_heads, blocks, block_size, head_dim] at slot
// (block * block_size + offset) per token: copied in the cache's dtype (kv_format 0), or stored as FP8 bytes
// of x / scale saturated to the format's range (1 = e4m3, 2 = e5m2): the bytes torch's own conversion gives.
template <typename T, typename C>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const int64_t* slots, double k_scale, double v_scale) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t head_stride = k_cache.size(1) * k_cache.size(2) * dim;
  const T* k_src = key.data_ptr<T>();
  const T* v_src = value.data_ptr<T>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  C* k_dst = reinterpret_cast<C*>(k_cache.data_ptr());
  C* v_dst = reinterpret_cast<C*>(v_cache.data_ptr());
  const float inv_k = static_cast<float>(1.0 / k_scale), inv_v = static_cast<float>(1.0 / v_scale);
  auto store = [dim](const T* src, C* dst, float inv) {
    if constexpr (std::is_same_v<C, T>) {
      std::memcpy(dst, src, dim * sizeof(T));
    } else {
      using F8 = std::conditional_t<std::is_same_v<C, E4M3>, c10::Float8_e4m3fn, c10::Float8_e5m2>;
      const float top = static_cast<float>(std::numeric_limits<F8>::max());
      for (int64_t i = 0; i < dim; ++i) {
        const float x = std::clamp(static_cast<float>(src[i]) * inv, -top, top);
        dst[i].bits = F8(x).x;
      }
    }
  };
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        store(k_src + t * ks0 + h * ks1, k_dst + h * head_stride + slots[t] * dim, inv_k);
        store(v_src + t * vs0 + h * vs1, v_dst + h * head_stride + slots[t] * dim, inv_v);
      }
    }
  });
}

template <typename T>
void write_kv_by_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const int64_t* slots, double k_scale, double v_scale, int64_t kv_format) {
  switch (kv_format) {
    case 0: return write_kv_impl<T, T>(key, value, k_cache, v_cache, slots, k_scale, v_scale);
    case 1: return write_kv_impl<T, E4M3>(key, value, k_cache, v_cache, slots, k_scale, v_scale);
    case 2: return write_kv_impl<T, E5M2>(key, value, k_cache, v_cache, slots, k_scale, v_scale);
  }
  TORCH_CHECK(false, "write_kv: kv_format must be 0 (the keys' dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping, double k_scale, double v_scale, int64_t kv_format) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv: key and value must be [tokens, kv_heads, head_dim] with unit inner stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == key.size(1) &&
                  k_cache.size(3) == key.size(2),
              "write_kv: caches must be contiguous [kv_heads, blocks, block_size, head_dim] matching the keys");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv: slot_mapping must be contiguous int64 [tokens]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (kv_format == 0 ? k_cache.scalar_type() == key.scalar_type() : k_cache.scalar_type() == at::kByte),
              "write_kv: the caches must be in the keys' dtype, or uint8 (FP8 bytes) with kv_format 1 or 2");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t], " is outside the cache");
  switch (key.scalar_type()) {
    case at::kFloat: return write_kv_by_cache<float>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format);
    case at::kBFloat16: return write_kv_by_cache<c10::BFloat16>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format);
    case at::kHalf: return write_kv_by_cache<c10::Half>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format);
    default: TORCH_CHECK(false, "write_kv: unsupported dtype ", key.scalar_type());
  }
}

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
      const bVec b = at::vec::convert_from_float<T>(lo, hi);
      if (store) b.store(store);
      std::tie(lo, hi) = at::vec::convert_to_float<T>(b);
    }
  };
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(dim);
    load_row(w_ptr, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
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
        lo = lo * fVec::loadu(w.data() + i);
        if constexpr (std::is_same_v<T, float>) {
          lo.store(o + i);
        } else {
          hi = hi * fVec::loadu(w.data() + i + fVec::size());
          at::vec::convert_from_float<T>(lo, hi).store(o + i);
        }
      }
      for (; i < dim; ++i)
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(static_cast<float>(src[i]) * inv)) * w[i]);
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

// ---- rotary embedding (rotate-half convention), in place ---------------------------------------------------
// x[t, h, :rotary_dim] = x * cos + rotate_half(x) * sin with cos/sin rows [max_pos, rotary_dim] taken at
// positions[t]; features past rotary_dim (partial rotary) are left as they are.
template <typename T>
void rotary_impl(at::Tensor& x, const int64_t* positions, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t rotary_dim) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = rotary_dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* x_ptr = x.data_ptr<T>();
  const T* c_ptr = cos.data_ptr<T>();
  const T* s_ptr = sin.data_ptr<T>();
  const int64_t cs = cos.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(rotary_dim), s(rotary_dim), v(rotary_dim), out(rotary_dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(c_ptr + positions[t] * cs, c.data(), rotary_dim);
      load_row(s_ptr + positions[t] * cs, s.data(), rotary_dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* x = x_ptr + t * s0 + h * s1;
        load_row(x, v.data(), rotary_dim);
        for (int64_t i = 0; i < half; ++i) {
          out[i] = v[i] * c[i] - v[i + half] * s[i];
          out[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
        }
        store_row(out.data(), x, rotary_dim);
      }
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
    case at::kFloat: rotary_impl<float>(q, pos, cos, sin, rotary_dim); rotary_impl<float>(k, pos, cos, sin, rotary_dim); break;
    case at::kBFloat16: rotary_impl<c10::BFloat16>(q, pos, cos, sin, rotary_dim); rotary_impl<c10::BFloat16>(k, pos, cos, sin, rotary_dim); break;
    case at::kHalf: rotary_impl<c10::Half>(q, pos, cos, sin, rotary_dim); rotary_impl<c10::Half>(k, pos, cos, sin, rotary_dim); break;
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

template <typename T> void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x_ptr + r * xs;
      const T* up = gate + d;
      T* o = o_ptr + r * d;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; i + fVec::size() <= d; i += fVec::size())
          (silu<T>(fVec::loadu(gate + i)) * fVec::loadu(up + i)).store(o + i);
      } else {
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
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [rows, 2 * d]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: silu_and_mul_impl<float>(out, x); break;
    case at::kBFloat16: silu_and_mul_impl<c10::BFloat16>(out, x); break;
    case at::kHalf: silu_and_mul_impl<c10::Half>(out, x); break;
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}


// ---- int8 weight-only linear, for decode batches ----------------------------------------------------------
// out[m, n] = T(scale[n] * sum_k x[m, k] * q[n, k]), the int8 codes tiled at load as [ceil(N/16)][K][16]: for
// each k, 16 output channels' weights sit side by side, so one broadcast x[m, k] multiplies a whole vector of
// them and the sums never need a horizontal reduction (the layout of torch's int4 kernel, with one byte a weight).
// A decode step then reads one byte a weight instead of two or four; kTiles tiles at once keep the FMA pipes busy.
constexpr int kInt8Tile = 16;
constexpr int kInt8TileVecs = kInt8Tile / fVec::size() > 0 ? kInt8Tile / fVec::size() : 1;

inline void widen_int8_tile(const int8_t* p, fVec* out) {  // 16 int8 weights as fp32 lanes
#if defined(CPU_CAPABILITY_AVX512)
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  float lanes[kInt8TileVecs * fVec::size()] = {};
  for (int i = 0; i < kInt8Tile; ++i) lanes[i] = static_cast<float>(p[i]);
  for (int v = 0; v < kInt8TileVecs; ++v) out[v] = fVec::loadu(lanes + v * fVec::size());
#endif
}

// R tiles (t0..t0+R-1) against the M rows of x (as fp32): R * M * vectors independent sums.
template <typename T, int M, int R>
inline void int8_tiles(const int8_t* w, const float* xf, int64_t K, const T* sc, T* o, int64_t N, int64_t t0) {
  fVec acc[R][M][kInt8TileVecs];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < kInt8TileVecs; ++v) acc[r][m][v] = fVec(0.f);
  const int8_t* tile = w + t0 * K * kInt8Tile;
  for (int64_t k = 0; k < K; ++k) {
    fVec xk[M];
    for (int m = 0; m < M; ++m) xk[m] = fVec(xf[m * K + k]);
    for (int r = 0; r < R; ++r) {
      fVec wv[kInt8TileVecs];
      widen_int8_tile(tile + (r * K + k) * kInt8Tile, wv);
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < kInt8TileVecs; ++v) acc[r][m][v] = at::vec::fmadd(wv[v], xk[m], acc[r][m][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (t0 + r) * kInt8Tile;
    const int64_t width = std::min<int64_t>(kInt8Tile, N - n0);
    for (int m = 0; m < M; ++m) {
      float lanes[kInt8TileVecs * fVec::size()];
      for (int v = 0; v < kInt8TileVecs; ++v) acc[r][m][v].store(lanes + v * fVec::size());
      for (int64_t i = 0; i < width; ++i) o[m * N + n0 + i] = static_cast<T>(lanes[i] * static_cast<float>(sc[n0 + i]));
    }
  }
}

template <typename T, int M>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, at::Tensor& out) {
  constexpr int kTiles = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  const int64_t K = x.size(1), N = out.size(1), tiles = tiled.size(0);
  std::vector<float> xf(M * K);
  for (int m = 0; m < M; ++m) load_row(x.data_ptr<T>() + m * x.stride(0), xf.data() + m * K, K);
  const int8_t* w = tiled.data_ptr<int8_t>();
  const T* sc = scales.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t groups = tiles / kTiles;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) int8_tiles<T, M, kTiles>(w, xf.data(), K, sc, o, N, g * kTiles);
  });
  for (int64_t t = groups * kTiles; t < tiles; ++t) int8_tiles<T, M, 1>(w, xf.data(), K, sc, o, N, t);
}

template <typename T>
void int8_linear_rows(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, at::Tensor& out) {
  switch (x.size(0)) {
    case 1: return int8_linear_impl<T, 1>(x, tiled, scales, out);
    case 2: return int8_linear_impl<T, 2>(x, tiled, scales, out);
    case 3: return int8_linear_impl<T, 3>(x, tiled, scales, out);
    case 4: return int8_linear_impl<T, 4>(x, tiled, scales, out);
  }
  TORCH_CHECK(false, "int8_linear: takes 1 to 4 rows, got ", x.size(0));
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

// The tiles back as a dense [out, in] weight in `like`'s dtype (the codes, unscaled): for batches too large for
// int8_linear, converted once per call and handed to the GEMM library.
template <typename T> void int8_untile_impl(const at::Tensor& tiled, at::Tensor& out) {
  const int64_t N = out.size(0), K = out.size(1);
  const int8_t* w = tiled.data_ptr<int8_t>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, tiled.size(0), 1, [&](int64_t begin, int64_t end) {
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


// ---- sampling: softmax and inverse-CDF draw in one pass per row -------------------------------------------
// token[r] = the first v with sum_{i<=v} exp(x[r,i] - max) > u[r] * sum_i exp(x[r,i] - max): what
// softmax -> cumsum -> searchsorted computes, without writing the vocabulary-wide probabilities and their
// running sums (two [rows, vocab] tensors a step). One pass sums, a second walks to the draw's chunk.
// The logits are read in their own dtype (a bf16 model's need no fp32 copy): widening is exact, so the draw is
// the same as from fp32 logits.
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

TORCH_LIBRARY(aserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window, float softcap, float k_scale=1.0, float v_scale=1.0, "
        "int kv_format=0) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor context_lens, float scale, int window, float softcap, float k_scale=1.0, "
        "float v_scale=1.0, int kv_format=0) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int rotary_dim) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor tiled, Tensor scales, int out_features) -> Tensor");
  m.def("int8_untile(Tensor tiled, int out_features, Tensor like) -> Tensor");
  m.def("sample_inverse_cdf(Tensor logits, Tensor uniforms) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "float k_scale=1.0, float v_scale=1.0, int kv_format=0) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_untile", &int8_untile);
  m.impl("sample_inverse_cdf", &sample_inverse_cdf);
  m.impl("write_kv", &write_kv);
}
