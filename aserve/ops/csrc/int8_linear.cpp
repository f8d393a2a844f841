// The int8 weight-only linear of decode batches, torch.ops.aserve.int8_linear, and int8_untile, which turns
// its tiled weights back into a dense matrix for larger batches.
//
// out[m, n] = T(scale[n] * sum_k x[m, k] * q[n, k]), the int8 codes tiled at load as [ceil(N/16)][K][16]: for
// each k, 16 output channels' weights sit side by side, so one broadcast x[m, k] multiplies a whole vector of
// them and the sums never need a horizontal reduction (the layout of torch's int4 kernel, with one byte a weight).
// A decode step then reads one byte a weight instead of two or four; kTiles tiles at once keep the FMA pipes busy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

constexpr int kInt8Tile = 16;

// One tile's 16 outputs as plain register types (one __m512, or two __m256), in plain arrays: GCC kept arrays of
// at::vec::Vectorized accumulators (and of structs holding registers) on the stack, loading or storing them at every
// FMA, which held the loop to ~17 GB/s of weights on a Zen 5 core with them in L2; these stay in registers.
#if defined(CPU_CAPABILITY_AVX512)
using VecF = __m512;
constexpr int kTileVecs = 1;
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

// R tiles (t0..t0+R-1) against the M rows of x (as fp32): R * M independent sums. `prefetch` (the next tiles this
// thread reads, or null) is pulled into L1 a line at a time as fast as these are consumed (R * 16 bytes a k step).
template <typename T, int M, int R>
inline void int8_tiles(const int8_t* w, const float* xf, int64_t K, const T* sc, T* o, int64_t N, int64_t t0,
                       const int8_t* prefetch = nullptr) {
  constexpr int kAcc = R * M * kTileVecs;
  VecF acc[kAcc];  // [r][m][v]
#pragma GCC unroll 32
  for (int i = 0; i < kAcc; ++i) acc[i] = vec_zero();
  const int8_t* tile = w + t0 * K * kInt8Tile;
  for (int64_t k = 0; k < K; ++k) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (prefetch != nullptr && (k * R * kInt8Tile) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * R * kInt8Tile), _MM_HINT_T0);
#endif
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
  // Unrolled, so that every index into acc is a constant: one variable index puts the whole array in memory.
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (t0 + r) * kInt8Tile;
    const int64_t width = std::min<int64_t>(kInt8Tile, N - n0);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float lanes[kInt8Tile];
#pragma GCC unroll 2
      for (int v = 0; v < kTileVecs; ++v) vec_store(lanes + v * kVecLanes, acc[(r * M + m) * kTileVecs + v]);
      for (int64_t i = 0; i < width; ++i) o[m * N + n0 + i] = static_cast<T>(lanes[i] * static_cast<float>(sc[n0 + i]));
    }
  }
}

// Tiles multiplied at once for M rows: the most of 4, 2, 1 whose accumulators, the M broadcast rows and one widened
// tile fit the vector registers (32 with AVX-512, 16 with AVX2), so that nothing spills.
constexpr int tiles_at_once(int M) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int kRegisters = 32;
#else
  constexpr int kRegisters = 16;
#endif
  for (int r = 4; r > 1; r /= 2)
    if (r * M * kTileVecs + M + kTileVecs <= kRegisters) return r;
  return 1;
}

template <typename T, int M>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& tiled, const at::Tensor& scales, at::Tensor& out) {
  constexpr int kTiles = tiles_at_once(M);
  const int64_t K = x.size(1), N = out.size(1), tiles = tiled.size(0);
  std::vector<float> xf(M * K);
  for (int m = 0; m < M; ++m) load_row(x.data_ptr<T>() + m * x.stride(0), xf.data() + m * K, K);
  const int8_t* w = tiled.data_ptr<int8_t>();
  const T* sc = scales.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // Each thread takes an equal run of tiles (not of whole groups: 36 tiles are 9 groups of 4, 5 for one thread and 4
  // for the other), kTiles at a time, then what is left of its run 2 and 1 at a time.
  constexpr int kHalf = kTiles >= 2 ? kTiles / 2 : 1;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t t = begin;
    for (; t + kTiles <= end; t += kTiles)
      int8_tiles<T, M, kTiles>(w, xf.data(), K, sc, o, N, t, t + 2 * kTiles <= end ? w + (t + kTiles) * K * kInt8Tile
                                                                                     : nullptr);
    for (; t + kHalf <= end; t += kHalf) int8_tiles<T, M, kHalf>(w, xf.data(), K, sc, o, N, t);
    for (; t < end; ++t) int8_tiles<T, M, 1>(w, xf.data(), K, sc, o, N, t);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("int8_linear(Tensor x, Tensor tiled, Tensor scales, int out_features) -> Tensor");
  m.def("int8_untile(Tensor tiled, int out_features, Tensor like) -> Tensor");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_untile", &int8_untile);
}
