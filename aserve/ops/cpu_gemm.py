"""Linear layers whose weights are prepacked once, at load, for the GEMM that multiplies by them.

Measured on an AMD EPYC with AVX512-BF16 (2 threads), bf16: a 64x576 @ 576x1728 product took 0.51 ms through
`F.linear` and 0.31 ms prepacked; at batch 1, 0.065 ms against 0.034 ms. `F.linear` reorders the weight on
every call; the packed one is reordered once. In float32 `F.linear` goes to MKL, which on that AMD CPU
reached 92-137 GFLOP/s where oneDNN's packed fp32 GEMM reached 178-209 (64x576 @ 576x3072: 2.46 -> 1.26 ms;
the 49152-wide logits projection at batch 64: 48.1 -> 19.9 ms), so fp32 weights are packed too. Weights
are packed only in a dtype the CPU runs natively (16-bit ones are emulated elsewhere and run as fp32), and only
in one oneDNN can pack here (`can_pack`).

fp32 weights, and bf16 weights on a CPU with AVX512-BF16 (on AMX tiles where the CPU has them), go to aserve's own GEMM
instead where the CPU kernels are built (csrc/cpu_gemm.cpp, see `gemm_for`). A packed weight records which layout it
is in, so callers only ever call `packed_linear`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from typing import NamedTuple

import torch
from torch import nn

log = logging.getLogger("aserve")

PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMMS = ("aserve", "onednn")
# What multiplies aserve's bf16 panels (csrc/cpu_gemm.cpp's bf16::products): AMX tiles where the CPU lends them,
# else vdpbf16ps (AMD) or fp32 FMAs on widened bf16 (Intel without AMX), with vdpbf16ps's bits.
BF16_PRODUCTS = {"amx": "AMX tiles", "dpbf16": "vdpbf16ps", "fma": "fp32 FMAs"}


class PackedWeight(NamedTuple):
    """A weight reordered for one GEMM: oneDNN's blocked layout, or aserve's panels (fp32 [ceil(out/16), in, 16],
    stored as fp32 or, for the fp32 GEMM over weights of bf16 values, as bf16; bf16 [ceil(out/32), 2 * ceil(in/2),
    32], pairs of k interleaved). `gated`: a gate | up weight whose rows were
    interleaved for the SwiGLU epilogue first (pack_gated_weight)."""
    data: torch.Tensor
    out_features: int
    aserve: bool
    gated: bool = False


# Packing for a model whose steps are all large (the pooling runner's thousands of prompt tokens, never a decode
# batch): set by the loader around its prepacking (`packing`), read by pack_weight.
_LARGE_STEPS: contextvars.ContextVar[bool] = contextvars.ContextVar("aserve_large_steps", default=False)


@contextlib.contextmanager
def packing(large_steps: bool):
    """Weights packed inside are for a model whose steps are all large (see gemm_for)."""
    token = _LARGE_STEPS.set(large_steps)
    try:
        yield
    finally:
        _LARGE_STEPS.reset(token)


@functools.cache
def gemm_for(dtype: torch.dtype, large_steps: bool = False) -> str:
    """Which GEMM multiplies packed weights of `dtype` in this process: `aserve` (csrc/cpu_gemm.cpp) for fp32 and
    (with AVX512-BF16) bf16, where the CPU kernels are built; else `onednn`. On CPUs with AMX tiles a model whose
    steps are all large (`large_steps`: the pooling runner) takes oneDNN's: its AMX kernels run the thousands of rows
    of an embedding step faster than aserve's (BERT-base, 512 prompts of 16-256 tokens, ~7.7K tokens a step, Xeon
    with AMX, 2 threads: GEMMs 5.38 against 7.58 s, `aserve bench embed` 58-62 against 48-50 sentences/s), while
    aserve's run decode batches and the bench model's prefill steps faster (below).

    Decode steps of the bench model alternated in one engine (tools/step_ab.py --compare gemm), aserve's GEMM against
    oneDNN's, 2 threads. On an AMD EPYC (Zen 4, AVX512-BF16, no AMX): bf16 batch 64 62.7 against 71.5 ms, batch 1
    11.4 against 16.6; fp32 119.6 against 127.8 and 19.4 against 24.6 (fp32 held to AVX2, as on an AVX2-only CPU:
    118.7 against 143.6 and 22.3 against 29.6). On an AMD EPYC Zen 5 (full-width 512-bit FMAs), before aserve's
    fp32 GEMM had 512-bit tiles, oneDNN's fp32 ran compute-bound shapes at ~500 GFLOP/s against its ~250; with them,
    451-492 against 456-504, and the bench model's fp32 64 x 128/128 643 against 601 output tok/s (was 408).
    On an Intel Xeon with AMX (Sapphire Rapids class), where aserve's bf16 GEMM multiplies on AMX tiles: bf16 batch
    64 44.1 against 46.8 ms, batch 1 11.3 against 15.6, prefill steps 115.7 against 120.7; fp32 batch 64 98.4
    against 121.9, batch 1 23.5 against 29.5, prefill steps 418 against 384 (oneDNN's AVX-512 fp32 keeps both FMA
    ports busier on large shapes).
    ASERVE_GEMM=aserve|onednn overrides (aserve still needs the kernels, and AVX512-BF16 for bf16);
    ASERVE_BF16_PRODUCTS=amx|dpbf16|fma what multiplies aserve's bf16 panels (BF16_PRODUCTS)."""
    from aserve.hardware import cpu_info
    from aserve.ops import cpu_kernels

    asked = os.environ.get("ASERVE_GEMM", "").lower()
    if asked and asked not in GEMMS:
        raise ValueError(f"ASERVE_GEMM={asked!r}: expected one of {', '.join(GEMMS)}")
    products = os.environ.get("ASERVE_BF16_PRODUCTS", "")
    if products and products not in BF16_PRODUCTS:
        raise ValueError(f"ASERVE_BF16_PRODUCTS={products!r}: expected one of {', '.join(BF16_PRODUCTS)}")
    built = cpu_kernels.available() and hasattr(torch.ops.aserve, "gemm_packed")
    can = built and (dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.aserve.gemm_packs_bf16()))
    if asked == "aserve" and not can and dtype in (torch.float32, torch.bfloat16):
        log.warning("ASERVE_GEMM=aserve, but aserve's %s GEMM is not built here (no compiler, or no AVX2/FMA, or "
                    "for bf16 no AVX512-BF16): using oneDNN", str(dtype).replace("torch.", ""))
    if not asked and large_steps and dtype == torch.bfloat16 and cpu_info().amx_bf16:
        return "onednn"
    wanted = asked != "onednn"
    return "aserve" if wanted and can else "onednn"


def gemm_name(dtype: torch.dtype, large_steps: bool = False) -> str:
    """The GEMM that multiplies weights of `dtype` packed here, for the start-up log."""
    if gemm_for(dtype, large_steps) != "aserve":
        return "oneDNN"
    if dtype == torch.bfloat16:
        return f"aserve's GEMM on {BF16_PRODUCTS[torch.ops.aserve.gemm_bf16_products()]}"
    return "aserve's GEMM"


class PackedLinear(nn.Module):
    """`nn.Linear` with a packed copy of its weight. The plain weight stays a parameter (so the model's
    state is still readable and checkable); the packed one is what the forward uses."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, batch_hint: int = 64):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self.packed = pack_weight(weight, batch_hint)

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def holds_bf16(weight: torch.Tensor) -> bool:
    """Whether an fp32 weight's values are all bf16 ones (the low 16 bits of each zero), as a bf16 checkpoint's are
    when an fp32 model loads it: pack_weight then stores its panels as bf16, half the bytes for the same products.
    ASERVE_BF16_PANELS=0 keeps them fp32."""
    if weight.dtype != torch.float32 or os.environ.get("ASERVE_BF16_PANELS", "1") == "0":
        return False
    return not bool(torch.any(weight.contiguous().view(torch.int32) & 0xFFFF))


def stored_bytes(weight: torch.Tensor, packed: PackedWeight | None) -> int:
    """The bytes a GEMM reads for `weight`: aserve's panels in the dtype they are stored in (fp32 panels may hold
    bf16, holds_bf16), else the weight as it is."""
    stored = packed.data if packed is not None and packed.aserve else weight
    return weight.numel() * stored.element_size()


def pack_weight(weight: torch.Tensor, batch_hint: int = 64) -> PackedWeight:
    """An [out, in] weight reordered once for the GEMM that will multiply by it. For aserve's fp32 GEMM, a weight of
    bf16 values is stored as bf16 (`holds_bf16`): an fp32 decode step waits on its weights' bytes, and a bf16
    checkpoint run in fp32 (`dtype=auto` on a CPU without AVX512-BF16) then reads the bytes its file holds."""
    weight = weight.detach()
    if gemm_for(weight.dtype, _LARGE_STEPS.get()) == "aserve":
        pack = torch.ops.aserve.pack_gemm_weight_bf16 if holds_bf16(weight) else torch.ops.aserve.pack_gemm_weight
        return PackedWeight(pack(weight), weight.shape[0], True)
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), weight.shape[0], False)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.gated:  # the product in the interleaved rows' order, put back as gate | up (LoRA steps need it so)
        return gates_in_order(torch.ops.aserve.gemm_packed(x, packed.data, bias, packed.out_features))
    if packed.aserve:
        return torch.ops.aserve.gemm_packed(x, packed.data, bias, packed.out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")


SILU_AND_MUL = 3  # gemm_packed's activation code: silu(gate) * up, over a weight packed by pack_gated_weight
GATE_ROWS = 16  # a gated panel's 32 rows: this many gates, then their ups


def interleave_gates(rows: torch.Tensor) -> torch.Tensor:
    """A gate | up projection's rows (weight rows, codes or per-row scales: [2I, ...]) reordered 16 gates, their 16
    ups, the next 16 gates...: the order the GEMMs' SiLU-and-mul epilogue reads them in. I a multiple of 16."""
    n = rows.shape[0]
    return rows.view(2, n // (2 * GATE_ROWS), GATE_ROWS, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def gates_in_order(y: torch.Tensor) -> torch.Tensor:
    """A product over interleave_gates' rows [..., 2I] put back as gate | up."""
    return y.unflatten(-1, (-1, 2, GATE_ROWS)).transpose(-3, -2).reshape(y.shape)


def pack_gated_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A SwiGLU's gate | up weight [2I, in] packed for aserve's GEMM to apply silu(gate) * up as it writes its
    outputs (`packed_silu_and_mul`): rows interleaved 16 gates, their 16 ups, the next 16 gates..., so each bf16
    panel's two 16-lane halves, or each pair of fp32 panels, are a gate and its up, and the [rows, 2I] product is never
    written. None where aserve's GEMM does not multiply this weight (oneDNN's) or I is not a multiple of 16. A 4 x
    128-token prefill step of the bench model (Xeon with AMX, 2 threads) spent 7% of its time in the separate
    silu_and_mul; its fp32 decode and prefill steps 2% (AMD EPYC Zen 4, 2 threads)."""
    weight = weight.detach()
    rows = weight.shape[0]
    if (weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2 or rows % (2 * GATE_ROWS)
            or gemm_for(weight.dtype, _LARGE_STEPS.get()) != "aserve"):
        return None
    return pack_weight(interleave_gates(weight))._replace(gated=True)  # fp32 panels may hold bf16 (holds_bf16)


def packed_silu_and_mul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """silu(gate) * up of x's gate | up product, in the GEMM's epilogue: [rows, I] from a pack_gated_weight pack."""
    return torch.ops.aserve.gemm_packed(x, packed.data, None, packed.out_features, SILU_AND_MUL)


def packed_linear_then(x: torch.Tensor, packed: PackedWeight, op: str, other: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ bias)` then `op` ("mul" or "add") with `other` (same shape as the product). oneDNN does the op
    in the GEMM's epilogue (a bf16 elementwise op over a [64, 3072] product cost as much as a third of the GEMM);
    aserve's GEMM does it after. Returns a new tensor."""
    if not packed.aserve:
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other.contiguous(), packed.data, bias, op)
    product = packed_linear(x, packed, bias)
    return product.mul_(other) if op == "mul" else product.add_(other)


GELU_ALGORITHMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # oneDNN's names: erf, tanh
GEMM_ACTIVATION_CODES = {"gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2}  # gemm_packed's activation codes: erf, tanh


def packed_linear_gelu(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """GELU(`x @ W^T + bias`), `kind` a models.layers activation name of GELU, in the GEMM's epilogue: over a
    BERT-base MLP's [4096, 3072] bf16 product oneDNN took 9.2 ms with it against 27 ms for the GEMM then torch's
    GELU (Sapphire Rapids, 2 threads). aserve's GEMM applies it to the fp32 sums before rounding them."""
    if not packed.aserve:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "gelu", [], GELU_ALGORITHMS[kind])
    return torch.ops.aserve.gemm_packed(x, packed.data, bias, packed.out_features, GEMM_ACTIVATION_CODES[kind])


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU. float32 everywhere it is built in; bf16 and fp16 only
    with the instructions oneDNN converts them with (AVX-512 BW/VL/DQ or AVX-NE-CONVERT for bf16): on an
    AVX2-only CPU the reorder raises rather than emulate."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def prepack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Pack every CPU linear layer of `dtype` in `model`: a plain `nn.Linear` is swapped for a PackedLinear, and
    aserve's own `Linear` (models.layers) packs itself if its weight format can (the dense one can, the quantized
    ones keep their own kernels). Return how many were packed."""
    if not can_pack(dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == dtype and child.weight.device.type == "cpu"]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear.of(child))
    packed = len(targets) + sum(bool(m.prepack(dtype)) for m in model.modules() if hasattr(m, "prepack"))
    head = getattr(model, "output_weight", None)  # the logits projection, when tied to the embedding
    tied = getattr(model, "lm_head", None) is None and getattr(model, "packed_head", None) is None
    if head is not None and tied and head() is not None and head().dtype == dtype and head().device.type == "cpu":
        model.packed_head = PackedLinear(head())  # 49152x576 bf16 at batch 1: 5.05 ms unpacked, 2.52 ms packed
        return packed + 1
    return packed
