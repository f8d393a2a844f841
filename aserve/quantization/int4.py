"""What GPTQ and AWQ layers become once unpacked: 4-bit codes q [out, in] in 0..15, and per (group of inputs, output)
a scale s and an integer zero point z, the weight being w = (q - z) * s.

On the CPU they run on torch's int4 kernel `_weight_int4pack_mm_for_cpu` (the layout made by
`_convert_weight_to_int4pack_for_cpu`). Its dequantization is w = (q - 8) * s + m, so each group's zero point
becomes m = (8 - z) * s; it wants groups of 32, 64, 128 or 256 consecutive inputs, a multiple of 16 outputs, and
scales in the activations' dtype. A larger group (or a whole row, GPTQ's group size -1) is split into kernel-sized
groups repeating its scale; GPTQ's act-order checkpoints (desc_act: g_idx assigns inputs to groups out of order)
are made contiguous by permuting the inputs, once for the weight at load and per call for the activations.

Measured (bench-model shapes, 30 layers, AMD EPYC avx512_bf16, 2 threads, against oneDNN's prepacked bf16 GEMM):
3.45x faster at 1 row, 2.15x at 4, 1.36x at 8, 0.92x at 16 and 0.47x at 64 (where dequantizing the weight per call
in torch measured 0.23x). The kernel is vectorized for bf16 only (fp32 ran 20x slower than dense at one row), so
in fp32 or fp16, or for a shape it refuses, the layer is dequantized once at load and runs as a dense layer.
"""
from __future__ import annotations

import torch
from torch import nn

from aserve.quantization.base import UNQUANTIZED, LinearMethod, replace_params

KERNEL_DTYPES = (torch.bfloat16,)
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
SHIFTS = tuple(range(0, 32, 4))


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32, value j in bits 4j..4j+3, unpacked along `dim` (0 or 1), which grows 8x."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15  # [rows, 8, cols]
        return values.reshape(packed.shape[0] * 8, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts) & 15  # [rows, cols, 8]
    return values.reshape(packed.shape[0], packed.shape[1] * 8)


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of unpack_int32: values in 0..15, eight consecutive ones along `dim` to an int32."""
    v = values.to(torch.int64)
    v = v.view(-1, 8, v.shape[1]) if dim == 0 else v.view(v.shape[0], -1, 8)
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=values.device)
    words = (v << (shifts.view(1, 8, 1) if dim == 0 else shifts)).sum(dim=1 if dim == 0 else 2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] of codes [out, in], zeros and scales [groups, out], g_idx [in]."""
    g = g_idx.long()
    return (codes.float() - zeros.float()[g].t()) * scales.float()[g].t()


def group_index(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """The group of each input when groups are consecutive (no act-order)."""
    return torch.arange(in_features, dtype=torch.int32, device=device) // (group_size if group_size > 0 else in_features)


class Int4KernelMethod(LinearMethod):
    """A GPTQ or AWQ layer repacked for torch's int4 CPU kernel."""

    def __init__(self, name: str):
        self.name = name

    def create_weights(self, layer, dtype):
        raise TypeError("Int4KernelMethod is what a GPTQ/AWQ layer becomes after loading; it has no checkpoint form")

    def apply(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:  # act-order: the inputs in group order
            x2 = x2.index_select(1, layer.perm)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), layer.qweight, layer.kernel_group_size,
                                                         layer.scales_and_zeros)
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def projection(self, layer):
        perm, qweight, group, scales_and_zeros, bias = (layer.perm, layer.qweight, layer.kernel_group_size,
                                                        layer.scales_and_zeros, layer.bias)
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu

        def project(x: torch.Tensor) -> torch.Tensor:  # apply, for 2-D rows, its tensors bound once
            out = kernel((x if perm is None else x.index_select(1, perm)).contiguous(), qweight, group,
                         scales_and_zeros)
            return out if bias is None else out + bias
        return project


class PackedInt4Method(LinearMethod):
    """What GPTQ and AWQ share: their spec, the model's dtype, and `finish` on the codes each unpacks its own way."""

    def __init__(self, spec, dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype
        self.refusals: list[str] = []  # why layers run dense, for the start-up log

    def finish(self, layer: nn.Module, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None) -> None:
        refusal = finish(layer, codes, zeros, scales, g_idx, self.spec.group_size, f"{self.name} int4", self.dtype)
        if refusal:
            self.refusals.append(refusal)


def kernel_refusal(layer: nn.Module, group_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why torch's int4 kernel cannot run this layer (None when it can)."""
    if device.type != "cpu":
        return f"no int4 kernel on {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"the int4 CPU kernel is fast only in bfloat16, not {str(dtype).replace('torch.', '')}"
    group = layer.in_features if group_size == -1 else group_size
    if layer.in_features % group or not any(group % g == 0 for g in KERNEL_GROUP_SIZES):
        return f"group size {group} over {layer.in_features} inputs does not split into groups of 32/64/128/256"
    if layer.out_features % 16:
        return f"{layer.out_features} outputs are not a multiple of 16"
    return None


def finish(layer: nn.Module, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
           g_idx: torch.Tensor | None, group_size: int, name: str, dtype: torch.dtype) -> str | None:
    """Set `layer` up to compute from its unpacked int4 weights: on the kernel where it can, else dense (the
    reason is returned). codes [out, in], zeros and scales [groups, out], g_idx [in] or None for consecutive groups."""
    device = codes.device
    consecutive = group_index(layer.in_features, group_size, device)
    if g_idx is None:
        g_idx = consecutive
    refusal = kernel_refusal(layer, group_size, dtype, device)
    perm = None
    if refusal is None and not torch.equal(g_idx.int(), consecutive):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm].int(), consecutive):
            refusal = "g_idx groups are not all of group_size inputs"
    if refusal is not None:
        weight = dequantize(codes, zeros, scales, g_idx).to(dtype)
        replace_params(layer, qweight=None, qzeros=None, scales=None, g_idx=None)
        layer.param_layouts = {"bias": layer.param_layouts["bias"]}
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.packed, layer.method = None, UNQUANTIZED
        return refusal
    if perm is not None:
        codes = codes[:, perm]
    group = layer.in_features if group_size == -1 else group_size
    kernel_group = next(g for g in KERNEL_GROUP_SIZES if group % g == 0)
    s = scales.float().repeat_interleave(group // kernel_group, dim=0)
    z = zeros.float().repeat_interleave(group // kernel_group, dim=0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    replace_params(layer, qweight=packed, qzeros=None, g_idx=None, scales=None,
                   scales_and_zeros=torch.stack([s, (8 - z) * s], dim=-1).to(dtype).contiguous())
    layer.register_buffer("perm", perm)  # None without act-order
    layer.param_layouts = {"bias": layer.param_layouts["bias"]}
    layer.kernel_group_size, layer.method = kernel_group, Int4KernelMethod(name)
    return None
