// The argument checks the two int4 ops (int8_linear.cpp's int4_linear, cpu_gemm.cpp's gemm_int4) share: GPTQ/AWQ codes
// tiled 16 outputs side by side in 64-byte blocks of 8 inputs (quantization.int4.tile_int4), with each tile and
// group's 16 scales and scale * zero.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace aserve_kernels {

inline void check_int4_weights(const char* op, const at::Tensor& x, int64_t K, const at::Tensor& tiled,
                               const at::Tensor& scales_zeros, int64_t group, int64_t out_features) {
  constexpr int64_t kTile = 16;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, op,
              ": the group size must be a multiple of 8 that divides in (the codes' 64-byte blocks hold 8 inputs)");
  TORCH_CHECK(tiled.dim() == 3 && tiled.is_contiguous() && tiled.scalar_type() == at::kByte && tiled.size(1) * 2 == K &&
                  tiled.size(2) == kTile && tiled.size(0) == (out_features + kTile - 1) / kTile,
              op, ": weight must be contiguous uint8 tiles [ceil(out/16), in/2, 16] matching x");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == x.scalar_type() &&
                  scales_zeros.numel() == tiled.size(0) * (K / group) * 2 * kTile,
              op, ": scales_zeros must be contiguous [ceil(out/16), groups, 2, 16] in x's dtype");
}

}  // namespace aserve_kernels
