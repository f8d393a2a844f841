"""int8 weight-only linear layers: the checkpoint's dense weight, quantized at load to int8 with one symmetric
scale per output channel (w ~ q * scale, q in [-127, 127]).

On the CPU with aserve's kernels (aserve/ops/csrc/int8_linear.cpp) the codes are stored tiled, [ceil(out/16),
in, 16], one byte a weight: for each input feature, sixteen output channels side by side, so `int8_linear`
multiplies a whole vector of them by one broadcast activation, with no horizontal sums (the layout of torch's
int4 kernel, without the nibbles); bf16 rows of a multiple of 64 inputs are made 16-bit integers sharing an exponent
per 64 inputs (as int4_linear's are: exact within 7 binades of the span's largest), and two tile rows' codes
interleaved into the pairs AVX512-VNNI's vpdpwssd multiplies by them. Up to kernel_rows(dtype) rows (decode batches)
run on it; larger batches run
aserve's int8 GEMM (`gemm_int8`, csrc/cpu_gemm.cpp: each panel of two tiles widened to the activations' dtype once per
row block, by the block's first micro-kernel call in bf16, or on AMX tiles one panel ahead while the tiles multiply),
or, where it is not built for the dtype, convert the tiles back to a dense weight (`int8_untile`) and run the GEMM
library. A SwiGLU's gate | up is tiled 16 gates, then their 16 ups (`prepack` with `gated`), so the bf16 GEMM applies
silu(gate) * up as it writes, as the dense GEMM does.
Measured against aserve's prepacked bf16 GEMM on the bench model's shapes (30 layers of q|k|v, o, gate|up and down,
so the weights do not sit in cache), AMD EPYC Zen 5 avx512_bf16, 2 threads: 2.21x at 1 row (2.10 against 4.65 ms,
50 GB/s of int8 weights), 1.87x at 2, 1.59x at 4, 1.17x at 8 (where it is compute-bound: an fp32 FMA per weight and
row, against the bf16 GEMM's dot products of pairs).

Without the kernels (no compiler, ASERVE_CPU_KERNELS=0, CUDA) the codes stay [out, in]: torch's kernel for a few
bf16 rows, convert-then-GEMM otherwise.

Measured and not taken: int8 codes split exactly into two int4 halves (q = 16 * hi + lo) run on torch's int4
kernel as one product over twice the inputs gave the same outputs and 1.80x at 1 row, 1.42x at 2; but that
layout is opaque (no way back to a dense weight for large batches) and needs group-wise scales.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from aserve.ops import cpu_gemm, cpu_kernels
from aserve.quantization.base import INT8, LinearMethod, NativeProjection, add_checkpoint_param, replace_params

KERNEL_MAX_ROWS = 8  # the most rows aserve's int8_linear takes (kernel_rows: where it is used up to)
TORCH_KERNEL_DTYPES = (torch.bfloat16,)  # without aserve's kernels: torch's _weight_int8pack_mm
TORCH_KERNEL_MAX_ROWS = 8
TILE = 16  # output channels per tile (int8_linear's layout)
TILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def gemm_dtypes() -> tuple[torch.dtype, ...]:
    """The activation dtypes aserve's int8 GEMM (gemm_int8, csrc/cpu_gemm.cpp) takes here: fp32 wherever the kernels
    are built, bf16 with AVX512-BF16 (it widens int8 panels to bf16 for vdpbf16ps)."""
    if not cpu_kernels.available() or not hasattr(torch.ops.aserve, "gemm_int8"):
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.aserve.gemm_packs_bf16() else (torch.float32,)


@functools.cache  # asked on every call of a layer: fixed by the CPU and the kernels built
def kernel_rows(dtype: torch.dtype) -> int:
    """Rows of `dtype` up to which int8_linear runs; above, the GEMM. 120 bench-model layers (AMD EPYC Zen 5, 2
    threads, ms, int8_linear against gemm_int8): bf16 at 6 rows 3.27 against 3.20, 7 rows 3.67 against 3.31, 8 rows
    4.11 against 3.55 (its widening of the int8 panels inside the first micro-kernel call, ef0b195, and the 8-row
    tiles make it pay from 7); fp32 int8_linear stays ahead through 8 rows (4.24 against 6.30). On AMX CPUs
    gemm_int8 runs AMX tiles, and int8_linear stays ahead through 8 rows there too (Xeon, AMX: 7 rows 8.99 against
    9.25, 8 rows 9.44 against 10.14); so it does where the bf16 GEMM multiplies on fp32 FMAs (gemm_bf16_products
    "fma", a Xeon without AMX tiles: 7 rows 14.96 against 15.44, 8 rows 16.02 against 16.63, gemm_int8 a tile at a
    time)."""
    from aserve.hardware import cpu_info

    fast_from_7 = (dtype == torch.bfloat16 and dtype in gemm_dtypes() and not cpu_info().amx_bf16
                   and torch.ops.aserve.gemm_bf16_products() != "fma")
    return 6 if fast_from_7 else KERNEL_MAX_ROWS


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale [out] in `scale_dtype`): symmetric, q = round(w / scale), quantized against the
    scale as it will be stored (rounded to `scale_dtype`), so q * scale is the nearest the stored scale allows."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def tile(q: torch.Tensor) -> torch.Tensor:
    """[out, in] codes -> [ceil(out/16), in, 16] tiles (out padded with zero rows to a whole tile)."""
    out, inp = q.shape
    pad = -out % TILE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, inp)])
    return q.view(-1, TILE, inp).transpose(1, 2).contiguous()


def codes(layer: nn.Module) -> torch.Tensor:
    """A layer's int8 codes as [out, in], whichever layout it stores."""
    if not layer.int8_tiled:
        return layer.qweight
    return layer.qweight.transpose(1, 2).reshape(-1, layer.qweight.shape[1])[:layer.out_features]


class Int8LinearMethod(LinearMethod):
    name = "int8"

    def create_weights(self, layer, dtype):
        add_checkpoint_param(layer, "weight", (layer.out_features, layer.in_features), dtype)

    def process_after_loading(self, layer):
        q, scale = quantize_per_channel(layer.weight.data, layer.weight.dtype)
        tiled = q.device.type == "cpu" and scale.dtype in TILED_DTYPES and cpu_kernels.available()
        replace_params(layer, weight=None, qweight=tile(q) if tiled else q, scales=scale)
        layer.int8_tiled = tiled
        layer.int8_gated = False  # prepack may tile a gate | up for the SiLU-and-mul epilogue

    def prepack(self, layer, dtype, gated=False):
        """A SwiGLU's gate | up on aserve's int8 GEMM (bf16 or fp32): its codes and scales reordered 16 gates, then
        their 16 ups (cpu_gemm.interleave_gates), so that each panel of two tiles is a gate and its up and the GEMM
        applies silu(gate) * up as it writes (gemm_int8's SiLU-and-mul: `silu_and_mul_projection`). The layer's product
        stays gate | up (apply puts it back in order). Without it the bench model's int8 run at 64 x 128/128 spent 5% of
        its time in a separate silu_and_mul and ran at 0.90-0.92x the dense bf16 weights (Xeon with AMX)."""
        if (not gated or not layer.int8_tiled or layer.int8_gated or layer.bias is not None
                or layer.scales.dtype != dtype or dtype not in gemm_dtypes()
                or layer.out_features % (2 * cpu_gemm.GATE_ROWS)):
            return False
        replace_params(layer, qweight=tile(cpu_gemm.interleave_gates(codes(layer))),
                       scales=cpu_gemm.interleave_gates(layer.scales))
        layer.int8_gated = True
        return True

    def silu_and_mul_projection(self, layer):
        if not layer.int8_gated:
            return None
        qweight, scales, out_features = layer.qweight, layer.scales, layer.out_features
        most = kernel_rows(torch.bfloat16)
        kernel, gemm = torch.ops.aserve.int8_linear, torch.ops.aserve.gemm_int8
        silu_and_mul = torch.ops.aserve.silu_and_mul

        def gated(x: torch.Tensor) -> torch.Tensor:  # a few rows: the row kernel's product, its blocks then combined
            if x.shape[0] <= most:
                return silu_and_mul(kernel(x.contiguous(), qweight, scales, out_features), cpu_gemm.GATE_ROWS)
            return gemm(x, qweight, scales, None, out_features, cpu_gemm.SILU_AND_MUL)
        return gated

    def apply(self, layer, x):
        out = self._product(layer, x)
        return cpu_gemm.gates_in_order(out) if layer.int8_gated else out

    def _product(self, layer, x):
        """x W^T + b in the order the tiles hold the rows."""
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if layer.int8_tiled:
            if rows <= kernel_rows(x2.dtype) and cpu_kernels.usable(x2):
                out = torch.ops.aserve.int8_linear(x2.contiguous(), layer.qweight, layer.scales, layer.out_features)
            elif x2.dtype in gemm_dtypes() and cpu_kernels.usable(x2):
                return torch.ops.aserve.gemm_int8(x2, layer.qweight, layer.scales, layer.bias,
                                                  layer.out_features).view(*x.shape[:-1], layer.out_features)
            else:
                dense = torch.ops.aserve.int8_untile(layer.qweight, layer.out_features, x2)
                out = nn.functional.linear(x2, dense) * layer.scales
        elif x2.dtype in TORCH_KERNEL_DTYPES and rows <= TORCH_KERNEL_MAX_ROWS and x2.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), layer.qweight, layer.scales)
        else:
            out = nn.functional.linear(x2, layer.qweight.to(x2.dtype)) * layer.scales
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def projection(self, layer):
        if not layer.int8_tiled or layer.int8_gated:  # (gated: apply puts the product in order)
            return super().projection(layer)
        qweight, scales, out_features, bias = layer.qweight, layer.scales, layer.out_features, layer.bias
        kernel, untile, linear = torch.ops.aserve.int8_linear, torch.ops.aserve.int8_untile, nn.functional.linear

        if layer.scales.dtype in gemm_dtypes():
            gemm, most = torch.ops.aserve.gemm_int8, kernel_rows(layer.scales.dtype)

            def project(x: torch.Tensor) -> torch.Tensor:  # apply's tiled paths, for 2-D rows in the kernels' dtypes
                if x.shape[0] <= most:
                    out = kernel(x.contiguous(), qweight, scales, out_features)
                    return out if bias is None else out + bias
                return gemm(x, qweight, scales, bias, out_features)
            return project

        def project_untiled(x: torch.Tensor) -> torch.Tensor:
            out = (kernel(x.contiguous(), qweight, scales, out_features) if x.shape[0] <= KERNEL_MAX_ROWS
                   else linear(x, untile(qweight, out_features, x)) * scales)
            return out if bias is None else out + bias
        return project_untiled

    def native_projection(self, layer):
        if not layer.int8_tiled or layer.scales.dtype not in gemm_dtypes():
            return None
        return NativeProjection(INT8, layer.qweight, layer.scales, layer.bias, None, 0, layer.out_features,
                                kernel_rows(layer.scales.dtype),
                                cpu_gemm.SILU_AND_MUL if layer.int8_gated else 0)
