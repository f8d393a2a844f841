// KV cache writes, torch.ops.aserve.write_kv: new keys and values into their slots of the paged cache, copied
// or quantized to FP8.
//
// key/value [tokens, kv_heads, head_dim] into the caches [kv_heads, blocks, block_size, head_dim] at slot
// (block * block_size + offset) per token: copied in the cache's dtype (kv_format 0), or stored as FP8 bytes
// of x / scale saturated to the format's range (1 = e4m3, 2 = e5m2): the bytes torch's own conversion gives.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "float k_scale=1.0, float v_scale=1.0, int kv_format=0) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("write_kv", &write_kv);
}
