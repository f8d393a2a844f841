// KV cache writes, torch.ops.aserve.write_kv: new keys and values into their slots of the paged cache, copied
// or quantized to FP8.
//
// key/value [tokens, kv_heads, head_dim] into the caches [kv_heads, blocks, block_size, head_dim] at slot
// (block * block_size + offset) per token: copied in the cache's dtype (kv_format 0), or stored as FP8 bytes
// of x / scale saturated to the format's range (1 = e4m3, 2 = e5m2): the bytes torch's own conversion gives.
// With paired_keys, a block's keys are stored as [head_dim / 2][block_size][2] (pairs of dims, token after
// token: the layout the CPU attention kernels read, kv_layout.py) and its values as rows; else both as rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "step_team.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

#if defined(CPU_CAPABILITY_AVX512)
// 16 floats, already divided by the scale and saturated to the format's range (or NaN), as FP8 bytes rounded to
// nearest even: the bytes c10's scalar Float8_e4m3fn / Float8_e5m2 conversions give (the FP8 test checks every
// rounding case), 16 at a time. The scalar conversion, one value at a time, was 4% of an FP8 prefill (bench model,
// 64 x 512 tokens: 0.40 s of write_kv against 0.03 s for a bf16 cache's copies).
// Normals: the fp32 mantissa rounded to Mant bits by adding half an ulp less one plus the kept lowest bit, the
// exponent rebiased; below the smallest normal, the value as a multiple of the smallest subnormal, rounded to nearest
// even by the conversion to int32 (a result of 2^Mant is the smallest normal's bits, as it should be); NaN keeps its
// sign, over 0x7F.
template <int Mant, int Bias>
inline __m128i fp8_bytes(__m512 x) {
  constexpr int shift = 23 - Mant;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(magnitude, shift), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(magnitude, _mm512_add_epi32(_mm512_set1_epi32((1 << (shift - 1)) - 1),
                                                                          lowest_kept));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, shift), _mm512_set1_epi32((127 - Bias) << Mant));
  const __m512 a = _mm512_castsi512_ps(magnitude);
  const __m512i subnormal = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(std::ldexp(1.f, Bias - 1 + Mant))),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::ldexp(1.f, 1 - Bias)), _CMP_LT_OQ);
  __m512i out = _mm512_mask_blend_epi32(small, normal, subnormal);
  out = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), out, _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(out, sign));
}
#endif

template <typename T, typename C>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const int64_t* slots, double k_scale, double v_scale, bool paired_keys) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), block_size = k_cache.size(2);
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
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
      alignas(64) float row[16];
      const __m512 hi = _mm512_set1_ps(top), lo = _mm512_set1_ps(-top), scale = _mm512_set1_ps(inv);
      for (; i + 16 <= dim; i += 16) {
        load_row(src + i, row, 16);
        // saturated as std::clamp does: NaN stays NaN (min/max return their second operand when one is NaN)
        const __m512 x = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_mul_ps(_mm512_load_ps(row), scale)));
        const __m128i bytes = std::is_same_v<C, E4M3> ? fp8_bytes<3, 7>(x) : fp8_bytes<2, 15>(x);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bytes);
      }
#endif
      for (; i < dim; ++i) {
        const float x = std::clamp(static_cast<float>(src[i]) * inv, -top, top);
        dst[i].bits = F8(x).x;
      }
    }
  };
  // Paired keys go a run of tokens at a time (consecutive slots in one block: a prompt's, or one decode token):
  // its rows as stored into scratch, then each pair's run of words copied into place, so that every line of the
  // block is written once a run. Token by token (32 scattered 4-byte stores each for bf16 at head size 64), a
  // 8192-token prefill's writes took 0.93 ms a layer against 0.32 for rows; a run at a time 0.57-0.65.
  parallel_for(0, tokens, paired_keys ? 8 : 64, [&](int64_t begin, int64_t end) {
    std::vector<C> rows(paired_keys ? block_size * dim : 0);
    // The lines token t's key pairs go to (a line a pair: the whole block's keys at head size 64 and 16 tokens a
    // block), asked for one run ahead: a decode token's stores otherwise each miss, one after another.
    const auto fetch_pairs = [&](int64_t t) {
      const int64_t at = slots[t] / block_size * block_size * dim + slots[t] % block_size * 2;
      for (int64_t h = 0; h < heads; ++h) {
        const char* lines = reinterpret_cast<const char*>(k_dst + h * head_stride + at);
        for (int64_t p = 0; p < dim / 2; ++p) __builtin_prefetch(lines + p * block_size * 2 * sizeof(C), 1, 3);
      }
    };
    if (paired_keys) fetch_pairs(begin);
    for (int64_t t = begin; t < end;) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      int64_t run = 1;
      while (paired_keys && t + run < end && offset + run < block_size && slots[t + run] == slots[t] + run) ++run;
      if (paired_keys && t + run < end) fetch_pairs(t + run);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = t; i < t + run; ++i) store(v_src + i * vs0 + h * vs1, v_dst + h * head_stride + slots[i] * dim, inv_v);
        if (!paired_keys) {
          store(k_src + t * ks0 + h * ks1, k_dst + h * head_stride + slots[t] * dim, inv_k);
          continue;
        }
        for (int64_t i = 0; i < run; ++i) store(k_src + (t + i) * ks0 + h * ks1, rows.data() + i * dim, inv_k);
        // sizes in locals, which the compiler keeps in registers (read through the lambda's captures, they were
        // reloaded at every copy)
        const int64_t width = dim, pairs = dim / 2, stride = 2 * block_size, n = run;
        const C* src = rows.data();
        C* dst = k_dst + h * head_stride + block * block_size * dim + 2 * offset;
        for (int64_t p = 0; p < pairs; ++p)
          for (int64_t i = 0; i < n; ++i) std::memcpy(dst + p * stride + 2 * i, src + i * width + 2 * p, 2 * sizeof(C));
      }
      t += run;
    }
  });
}

template <typename T>
void write_kv_by_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const int64_t* slots, double k_scale, double v_scale, int64_t kv_format, bool paired_keys) {
  switch (kv_format) {
    case 0: return write_kv_impl<T, T>(key, value, k_cache, v_cache, slots, k_scale, v_scale, paired_keys);
    case 1: return write_kv_impl<T, E4M3>(key, value, k_cache, v_cache, slots, k_scale, v_scale, paired_keys);
    case 2: return write_kv_impl<T, E5M2>(key, value, k_cache, v_cache, slots, k_scale, v_scale, paired_keys);
  }
  TORCH_CHECK(false, "write_kv: kv_format must be 0 (the keys' dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping, double k_scale, double v_scale, int64_t kv_format, bool paired_keys) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv: key and value must be [tokens, kv_heads, head_dim] with unit inner stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == key.size(1) &&
                  k_cache.size(3) == key.size(2),
              "write_kv: caches must be contiguous [kv_heads, blocks, block_size, head_dim] matching the keys");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv: slot_mapping must be contiguous int64 [tokens]");
  TORCH_CHECK(!paired_keys || key.size(2) % 2 == 0, "write_kv: paired keys need an even head_dim");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (kv_format == 0 ? k_cache.scalar_type() == key.scalar_type() : k_cache.scalar_type() == at::kByte),
              "write_kv: the caches must be in the keys' dtype, or uint8 (FP8 bytes) with kv_format 1 or 2");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t], " is outside the cache");
  switch (key.scalar_type()) {
    case at::kFloat: return write_kv_by_cache<float>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format, paired_keys);
    case at::kBFloat16: return write_kv_by_cache<c10::BFloat16>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format, paired_keys);
    case at::kHalf: return write_kv_by_cache<c10::Half>(key, value, k_cache, v_cache, slots, k_scale, v_scale, kv_format, paired_keys);
    default: TORCH_CHECK(false, "write_kv: unsupported dtype ", key.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "float k_scale=1.0, float v_scale=1.0, int kv_format=0, bool paired_keys=False) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("write_kv", &write_kv);
}
