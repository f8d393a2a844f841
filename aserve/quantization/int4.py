"""What GPTQ and AWQ layers become once unpacked: 4-bit codes q [out, in] in 0..15, and per (group of inputs, output)
a scale s and an integer zero point z, the weight being w = (q - z) * s.

On the CPU, where aserve's kernels are built and the activations are fp32 (or bf16 with AVX512-BF16), they run on
aserve's own (`AserveInt4Method`): the codes tiled 16 outputs side by side in 64-byte blocks of 8 inputs
(`tile_int4`: [ceil(out/16), in/2, 16] bytes), and per tile and group the 16 scales s and zero points z in fp16
(GPTQ's and AWQ's own scales, exactly: a layer whose scales fp16 does not hold runs as below); up to 8 rows
(`KERNEL_MAX_ROWS`, 16 where bf16 runs on vdpbf16ps and on AVX2: `kernel_rows`) `int4_linear` (csrc/int8_linear.cpp)
sums x * q per group in registers and folds in s * sum(x q) - s * z * sum(x). bf16 from 3 rows where aserve's GEMMs
multiply on vdpbf16ps (AMD's cores): each code made the bf16 128 + q, exactly, and multiplied by x as it is, 32
products an instruction, in blocks of up to 4 rows against pairs of tiles (a row's output the same bits at 3 to 16
rows). bf16 elsewhere with AVX-512, and one or two rows: x made 16-bit integers sharing an exponent per span of up to
64 inputs, exact within 7 binades of the span's largest, and an output's two codes of a pair of inputs a mask away
from the 16-bit pair vpdpwssd multiplies by. On AVX2-only CPUs, fp32 and bf16 alike the same way on vpmaddwd: an
fp32 x is then rounded to 2^-15 of its span's largest |x| (bf16's own rounding is 2^-9 of each x), a row's output the
same bits at 1 to 16 rows. fp32 with AVX-512: each code masked where it lies and converted, beside x scaled by
powers of two (`int4_row_products` says which). Above,
`gemm_int4` (csrc/cpu_gemm.cpp) dequantizes each panel once per row block into the dense GEMM's layout, or, where
that GEMM multiplies on fp32 FMAs, each tile in registers for every 16 rows (from 5 rows there). Any group size that
is a multiple of 8 and divides the inputs.

Otherwise they run on torch's int4 kernel `_weight_int4pack_mm_for_cpu` (the layout made by
`_convert_weight_to_int4pack_for_cpu`). Its dequantization is w = (q - 8) * s + m, so each group's zero point
becomes m = (8 - z) * s; it wants groups of 32, 64, 128 or 256 consecutive inputs, a multiple of 16 outputs, and
scales in the activations' dtype. A larger group (or a whole row, GPTQ's group size -1) is split into kernel-sized
groups repeating its scale; GPTQ's act-order checkpoints (desc_act: g_idx assigns inputs to groups out of order)
are made contiguous by permuting the inputs, once for the weight at load and per call for the activations.

Measured (bench-model shapes, 30 layers, AMD EPYC Zen 5 avx512_bf16, 2 threads, bf16, ms for all 120 layers):
aserve's kernels 2.20 at 1 row, 2.63 at 2, 3.50 at 4 (gemm_int4), 3.86 at 8, 6.04 at 16, 16.27 at 64; torch's 2.20,
2.33, 3.24, 5.83, 10.64, 39.85; aserve's dense bf16 GEMM 5.11, 5.01, 5.41, 6.06, 5.92, 15.27. torch's kernel is
vectorized for bf16 only (fp32 ran 20x slower than dense at one row), so without aserve's kernels, in fp32 or fp16,
or for a shape it refuses, the layer is dequantized once at load and runs as a dense layer. (Those figures predate
the 64-byte blocks, 5a3e930; see KERNEL_MAX_ROWS for int4_linear against gemm_int4 since.)
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from aserve.ops import cpu_gemm
from aserve.quantization.base import INT4, UNQUANTIZED, LinearMethod, NativeProjection, replace_params

KERNEL_DTYPES = (torch.bfloat16,)
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
SHIFTS = tuple(range(0, 32, 4))
# The most rows int4_linear's kernels take at once, and where layers use it up to (gemm_int4 above). The bench model's
# 120 int4 layers, bf16, the two kernels timed alone (Intel Xeon, avx512_vnni avx512_bf16, no AMX, 2 threads, at
# 7974a57): 2.05 against 6.03 ms at 1 row, 3.43 against 6.75 at 4, 5.67 against 9.16 at 8; fp32 (AMD EPYC Zen 5, at
# 39c8f62) 3.08 against 8.46 at 4 rows, 5.55 against 9.99 at 8.
KERNEL_MAX_ROWS = 8
# Where bf16 rows multiply on vdpbf16ps (int4_linear's bf16 path from 3 rows where the GEMMs use it: AMD's cores), up
# to 16 rows. The bench model's 120 int4 layers from DRAM, alternated in one process (AMD EPYC Zen 5, 2 threads, ms,
# int4_linear on vdpbf16ps / on vpdpwssd / gemm_int4): 4 rows 2.49 / 2.55 / 5.86, 8 rows 3.81 / 3.98 / 4.90,
# 12 rows 5.15 / 6.07 / 6.01, 16 rows 6.42 / 7.22 / 7.16. One layer hot in cache at 24 rows the row kernel and
# gemm_int4 were level (gate | up 111.7 against 110.2 us), so 16.
KERNEL_MAX_ROWS_BF16 = 16
# On AVX2's vpmaddwd (AVX2-only CPUs), up to 16 rows too. The bench model's 120 int4 layers from DRAM, fp32, the two
# kernels alternated in one process (AMD EPYC Zen 3, avx2 fma, no AVX-512, 2 threads, at 2500964, ms, int4_linear /
# gemm_int4): 1 row 7.14 / 28.10, 4 rows 11.14 / 35.18, 8 rows 19.81 / 40.84, 16 rows 43.76 / 70.23.
KERNEL_MAX_ROWS_MADD = 16


def int4_row_products(dtype: torch.dtype, rows: int = 1) -> str:
    """What multiplies int4_linear's rows of this dtype: "vpmaddwd" (AVX2) or "vpdpwssd" (AVX512-VNNI, bf16), where x
    is made 16-bit integers sharing an exponent per span of 64 inputs; "vdpbf16ps" (bf16 x as it is); or "fma"
    (each code widened to fp32)."""
    return torch.ops.aserve.int4_row_products(dtype, rows)


def kernel_rows(dtype: torch.dtype) -> int:
    """Rows up to which a layer runs int4_linear (gemm_int4 above): KERNEL_MAX_ROWS_BF16 for bf16 where the kernels
    multiply bf16 on vdpbf16ps, KERNEL_MAX_ROWS_MADD on AVX2's vpmaddwd, else KERNEL_MAX_ROWS."""
    products = int4_row_products(dtype, KERNEL_MAX_ROWS_BF16)
    if products == "vdpbf16ps":
        return KERNEL_MAX_ROWS_BF16
    return KERNEL_MAX_ROWS_MADD if products == "vpmaddwd" else KERNEL_MAX_ROWS


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


class AserveInt4Method(LinearMethod):
    """A GPTQ or AWQ layer on aserve's int4 kernels (csrc/int8_linear.cpp's int4_linear for up to kernel_rows rows,
    cpu_gemm.cpp's gemm_int4 above): codes tiled in 64-byte blocks of 8 inputs (tile_int4) and, per tile and
    group, the 16 outputs' scales then zero points ([ceil(out/16), groups, 2, 16], fp16: tile_scales_zeros)."""

    def __init__(self, name: str):
        self.name = name

    def create_weights(self, layer, dtype):
        raise TypeError("AserveInt4Method is what a GPTQ/AWQ layer becomes after loading; it has no checkpoint form")

    def apply(self, layer, x):
        out = _aserve_int4(x.reshape(-1, x.shape[-1]), layer.perm, layer.qweight, layer.scales_zeros, layer.int4_group,
                           layer.bias, layer.out_features)
        out = out.view(*x.shape[:-1], layer.out_features)
        return cpu_gemm.gates_in_order(out) if layer.int4_gated else out

    def prepack(self, layer, dtype, gated=False):
        """A SwiGLU's gate | up (bf16 or fp32): its tiles (and their scales) reordered a gate tile, then its up tile, so
        that each of gemm_int4's panels (two tiles) is 16 gates and their 16 ups and the GEMM applies silu(gate) * up as
        it writes (`silu_and_mul_projection`), as int8's gated tiles do; the layer's product stays gate | up (apply puts
        it back in order). Without it a GPTQ step ran a separate silu_and_mul a layer: at 16 x 128/128 other ops took 7%
        of the bench model's run against dense's 5% (AMD EPYC Zen 5)."""
        if (not gated or layer.int4_gated or layer.bias is not None or dtype not in (torch.bfloat16, torch.float32)
                or layer.int4_dtype != dtype or layer.out_features % (2 * cpu_gemm.GATE_ROWS)):
            return False
        tiles = layer.qweight.shape[0]
        order = torch.arange(tiles).view(2, tiles // 2).t().reshape(-1)  # gate tile j, then up tile j
        replace_params(layer, qweight=layer.qweight[order].contiguous(),
                       scales_zeros=layer.scales_zeros[order].contiguous())
        layer.int4_gated = True
        return True

    def silu_and_mul_projection(self, layer):
        if not layer.int4_gated:
            return None
        return functools.partial(_aserve_int4, perm=layer.perm, qweight=layer.qweight, scales_zeros=layer.scales_zeros,
                                 group=layer.int4_group, bias=None, out_features=layer.out_features,
                                 activation=cpu_gemm.SILU_AND_MUL)

    def projection(self, layer):
        if layer.int4_gated:  # apply puts the product in order
            return super().projection(layer)
        return functools.partial(_aserve_int4, perm=layer.perm, qweight=layer.qweight, scales_zeros=layer.scales_zeros,
                                 group=layer.int4_group, bias=layer.bias, out_features=layer.out_features)

    def native_projection(self, layer):
        return NativeProjection(INT4, layer.qweight, layer.scales_zeros, layer.bias, layer.perm, layer.int4_group,
                                layer.out_features, kernel_rows(layer.int4_dtype),
                                cpu_gemm.SILU_AND_MUL if layer.int4_gated else 0)


def _aserve_int4(x: torch.Tensor, perm, qweight, scales_zeros, group: int, bias, out_features: int,
                 activation: int = 0) -> torch.Tensor:
    """A layer on aserve's int4 kernels, for 2-D rows: int4_linear up to kernel_rows, gemm_int4 above.
    `activation` cpu_gemm.SILU_AND_MUL (gated tiles): silu(gate) * up, the row kernel's product combined in blocks
    of 16, the GEMM's in its epilogue."""
    if perm is not None:  # act-order: the inputs in group order
        x = x.index_select(1, perm)
    if x.shape[0] <= KERNEL_MAX_ROWS or x.shape[0] <= kernel_rows(x.dtype):  # kernel_rows only past 8 rows
        out = torch.ops.aserve.int4_linear(x.contiguous(), qweight, scales_zeros, group, out_features)
        out = out if bias is None else out + bias
        return torch.ops.aserve.silu_and_mul(out, cpu_gemm.GATE_ROWS) if activation else out
    return torch.ops.aserve.gemm_int4(x, qweight, scales_zeros, group, bias, out_features, activation)


def aserve_kernel_refusal(layer: nn.Module, group_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why aserve's int4 kernels cannot run this layer (None when they can): they take fp32 anywhere they are built,
    bf16 with AVX512-BF16, and groups of a multiple of 8 inputs."""
    from aserve.ops import cpu_kernels

    if device.type != "cpu" or not cpu_kernels.available() or not hasattr(torch.ops.aserve, "gemm_int4"):
        return "aserve's CPU kernels are not built here"
    if not (dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.aserve.gemm_packs_bf16())):
        return f"aserve's int4 kernels take fp32, or bf16 with AVX512-BF16, not {str(dtype).replace('torch.', '')}"
    group = layer.in_features if group_size == -1 else group_size
    if group % 8 or layer.in_features % group:
        return f"group size {group} over {layer.in_features} inputs is not a split into multiples of 8"
    return None


def tile_int4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 (in a multiple of 8) -> [ceil(out/16), in/2, 16] bytes, in blocks of 64 bytes for 8
    inputs: in block b, little-endian 16-bit word 2j + p holds output j's codes of inputs 8b + 2s + p in its nibble
    s (bits 4s..4s+3). One 64-byte load is 128 weights, and a word's nibble s is a pair row (s) of the block."""
    out, inp = codes.shape
    pad = -out % 16
    c = codes.to(torch.int32)
    if pad:
        c = torch.cat([c, c.new_zeros(pad, inp)])
    c = c.view(-1, 16, inp // 8, 4, 2)  # [tile, j, b, s, p]
    words = (c << (4 * torch.arange(4, dtype=torch.int32)).view(4, 1)).sum(3)  # [tile, j, b, p], 0..65535
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    return words.permute(0, 2, 1, 3).contiguous().view(torch.uint8).view(-1, inp // 2, 16)


def tile_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[groups, out] scales and zero points -> fp16 [ceil(out/16), groups, 2, 16]: each tile's scales, then its zero
    points (the kernels multiply s * z in fp32, exactly). A scale that fp16 does not hold is rounded to it: `finish`
    only tiles layers whose scales it holds (scales_fit_fp16)."""
    groups, out = scales.shape
    pad = -out % 16
    s, z = scales.half(), zeros.half()
    if pad:
        s, z = torch.cat([s, s.new_zeros(groups, pad)], 1), torch.cat([z, z.new_zeros(groups, pad)], 1)
    both = torch.stack([s, z], 1)  # [groups, 2, out]
    return both.view(groups, 2, -1, 16).permute(2, 0, 1, 3).contiguous()


def scales_fit_fp16(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether fp16 holds every scale and zero point exactly, as aserve's int4 kernels store them: always for GPTQ's and
    AWQ's fp16 scales and integer zero points; a bf16 or fp32 scale may need more bits or range."""
    return bool(torch.equal(scales.half().float(), scales.float()) and torch.equal(zeros.half().float(), zeros.float()))


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
    ours = aserve_kernel_refusal(layer, group_size, dtype, device) is None
    unfit = ours and not scales_fit_fp16(scales, zeros)
    ours = ours and not unfit
    refusal = None if ours else kernel_refusal(layer, group_size, dtype, device)
    if unfit and refusal is not None:
        refusal = f"fp16 does not hold its scales exactly (aserve's int4 kernels), and {refusal}"
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
    if ours:
        replace_params(layer, qweight=tile_int4(codes), qzeros=None, g_idx=None, scales=None,
                       scales_zeros=tile_scales_zeros(scales, zeros))
        layer.register_buffer("perm", perm)
        layer.param_layouts = {"bias": layer.param_layouts["bias"]}
        layer.int4_group, layer.int4_dtype, layer.method = group, dtype, AserveInt4Method(name)
        layer.int4_gated = False  # prepack may reorder a gate | up's tiles for the SiLU-and-mul epilogue
        return None
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
