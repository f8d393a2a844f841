"""int8 weight-only linear layers: the checkpoint's dense weight, quantized at load to int8 with one symmetric
scale per output channel (w ~ q * scale, q in [-127, 127]).

Two ways to multiply, chosen per call by measurement (bench-model shapes, 30 layers so the weights do not sit in
cache, AMD EPYC avx512_bf16, bf16, 2 threads, against oneDNN's prepacked bf16 GEMM): torch's weight-only kernel
`_weight_int8pack_mm` reads half the bytes and wins at a few rows (1.47x at 1 row, 1.33x at 2, 1.08x at 4, a tie
with the other way at 8); from there on converting the weight to the activations' dtype and running the dense GEMM
wins (at 64 rows 0.84x of dense, where the kernel gives 0.39x). The kernel is vectorized for bf16 only: in fp32
it ran 10x slower than dense at one row, while the convert-then-GEMM way ran 2.1x faster than dense fp32 (it reads
a quarter of the bytes), so fp32 (and fp16, emulated on most CPUs) always convert.

Measured and not taken: int8 codes split exactly into two int4 halves (q = 16 * hi + lo) run on torch's int4 kernel
as one product over twice the inputs (scales 16s and s, zero terms 0 and 8s) gave the same outputs bit for bit and
ran 2.17x faster than dense at 1 row (this kernel: 1.62x), 1.82x at 2 (1.39x); but that layout is opaque, so more
rows would need the int8 codes kept as well: twice the memory of int8, as much as bf16.
"""
from __future__ import annotations

import torch
from torch import nn

from aserve.quantization.base import LinearMethod, add_checkpoint_param, replace_params

KERNEL_DTYPES = (torch.bfloat16,)
KERNEL_MAX_ROWS = 8


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale [out] in `scale_dtype`): symmetric, q = round(w / scale), quantized against the
    scale as it will be stored (rounded to `scale_dtype`), so q * scale is the nearest the stored scale allows."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    name = "int8"

    def create_weights(self, layer, dtype):
        add_checkpoint_param(layer, "weight", (layer.out_features, layer.in_features), dtype)

    def process_after_loading(self, layer):
        q, scale = quantize_per_channel(layer.weight.data, layer.weight.dtype)
        replace_params(layer, weight=None, qweight=q, scales=scale)

    def apply(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype in KERNEL_DTYPES and x2.shape[0] <= KERNEL_MAX_ROWS and x2.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), layer.qweight, layer.scales)
        else:
            out = nn.functional.linear(x2, layer.qweight.to(x2.dtype)) * layer.scales
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], out.shape[-1])
