// What the two int4 ops (int8_linear.cpp's int4_linear, cpu_gemm.cpp's gemm_int4) share: their argument checks, GPTQ/AWQ
// codes tiled 16 outputs side by side in 64-byte blocks of 8 inputs (quantization.int4.tile_int4), and each tile and
// group's 16 scales s and 16 zero points z, fp16 ([2][16], 64 bytes: one cache line), read as the fp32 s and s * z.
//
// Why fp16 whatever the activations' dtype: GPTQ's and AWQ's checkpoints store their scales in fp16, and zero points
// are small integers, so the 64 bytes hold them exactly, where fp32 s and s * z took 128 (a fifth of a group-64
// layer's bytes beside its 512 bytes of codes) and bf16 ones rounded both. s * z is exact in fp32: s has 11
// significant bits, z at most 5.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "vec_helpers.h"

namespace aserve_kernels {

// A tile and group's scales and zero points ([2][16] fp16) as fp32: s[0..16) the scales, s[16..32) scale * zero.
inline void load_scales_zeros(const c10::Half* record, float* s) {
  load_row(record, s, 32);
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) s[16 + j] *= s[j];
}

inline void check_int4_weights(const char* op, const at::Tensor& x, int64_t K, const at::Tensor& tiled,
                               const at::Tensor& scales_zeros, int64_t group, int64_t out_features) {
  constexpr int64_t kTile = 16;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, op,
              ": the group size must be a multiple of 8 that divides in (the codes' 64-byte blocks hold 8 inputs)");
  TORCH_CHECK(tiled.dim() == 3 && tiled.is_contiguous() && tiled.scalar_type() == at::kByte && tiled.size(1) * 2 == K &&
                  tiled.size(2) == kTile && tiled.size(0) == (out_features + kTile - 1) / kTile,
              op, ": weight must be contiguous uint8 tiles [ceil(out/16), in/2, 16] matching x");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kHalf &&
                  scales_zeros.numel() == tiled.size(0) * (K / group) * 2 * kTile,
              op, ": scales_zeros must be contiguous fp16 [ceil(out/16), groups, 2, 16] (scales, then zero points)");
}

}  // namespace aserve_kernels
