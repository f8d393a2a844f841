"""The batched LoRA math: each adapted linear layer adds scale * (x @ A[slot]) @ B[slot] to the rows of the tokens
that run under an adapter, for every adapter of the step at once, never a loop over requests or adapters.

Each adaptable Linear holds all `max_loras` slots stacked (q|k|v, gate|up: a fused projection adds each slice's own
module's delta in its own columns). On the CPU one call of aserve's kernel (csrc/lora.cpp) a layer adds every
token's delta from its own slot's weights, tokens grouped by slot (punica's SGMV); elsewhere a fixed number of torch
ops a layer, whatever the mix of adapters, computes every slot and masks. Ranks below the slot width, modules an
adapter leaves alone and empty slots are zeros: they add nothing. A step with no adapter tokens skips it all.
Adapters are never merged into the weights.

The token -> slot mapping is computed once per step (`LoRAStep.set`) and read by every layer.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch
from torch import nn

from aserve.ops import cpu_gemm

# aserve's fused module -> the Hugging Face modules of its output slices, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LoRAStep:
    """The step's token -> slot mapping, read by every layer: `token_slot` (int64 [tokens], -1 for the base model)
    for aserve's kernel, and for the torch path, a layer of M output slices gets a [tokens, slots * M * rank] mask
    with ones in the columns of the token's slot (built once a step per M). Both None when no token has an
    adapter."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        # slots are max_lora_rank wide, rounded up to 16 columns (whole vectors for the kernel; the rest is zeros)
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, -(-max_rank // 16) * 16, dtype, device
        self.token_slot: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def set(self, slot_per_request: list[int | None], counts: list[int]) -> None:
        """`slot_per_request`: each batch row's slot (None: the base model), `counts`: its tokens, in batch order."""
        self._masks = {}
        if all(slot is None for slot in slot_per_request):
            self.token_slot = None
            return
        slots = torch.tensor([-1 if s is None else s for s in slot_per_request], dtype=torch.long)
        self.token_slot = torch.repeat_interleave(slots, torch.tensor(counts)).to(self.device)

    def mask(self, num_slices: int) -> torch.Tensor:
        mask = self._masks.get(num_slices)
        if mask is None:
            tokens = self.token_slot.shape[0]
            one_hot = (self.token_slot.unsqueeze(1) == torch.arange(self.max_loras, device=self.device))
            mask = one_hot.to(self.dtype).view(tokens, self.max_loras, 1, 1).expand(
                tokens, self.max_loras, num_slices, self.max_rank).reshape(tokens, -1).contiguous()
            self._masks[num_slices] = mask
        return mask

    def clear(self) -> None:
        self.token_slot, self._masks = None, {}


AMX_FLAT_ABOVE = 96  # tokens in a step above which an AMX CPU runs the delta through oneDNN's GEMMs


def _amx() -> bool:
    from aserve.hardware import cpu_info

    return cpu_info().amx_bf16


def kernel_available(device: torch.device) -> bool:
    from aserve.ops import cpu_kernels

    return device.type == "cpu" and cpu_kernels.available() and hasattr(torch.ops.aserve, "lora_delta")


class LoRALinear(nn.Module):
    """The stacked adapter weights of one Linear and the delta they add. `a`: [slots, in, slices * rank] (A^T of
    each slice's module side by side); `b`: [slots, slices * rank, out], block-diagonal by slice (scale * B^T of
    slice i's module in its own output columns, zeros elsewhere).

    On the CPU aserve's kernel (csrc/lora.cpp) computes each token's delta from its own slot's weights alone.
    Elsewhere (no kernels, or CUDA) one GEMM shrinks over every slot, a mask zeroes the columns of the token's
    other slots, and one GEMM expands and adds: prepacked for oneDNN, which does the multiply and the add in the
    GEMMs' epilogues, when it can pack the dtype."""

    def __init__(self, step: LoRAStep, layer: int, modules: tuple[str, ...], in_features: int, sizes: list[int],
                 dtype: torch.dtype, device: torch.device, shard: "Shard | None" = None):
        super().__init__()
        self.step, self.layer, self.modules_, self.sizes = step, layer, modules, list(sizes)
        self.shard = shard  # tensor parallelism: this rank's part of each adapter's A (row-parallel) or B
        slots, width = step.max_loras, len(modules) * step.max_rank
        self.register_buffer("a", torch.zeros(slots, in_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(slots, width, sum(sizes), dtype=dtype, device=device),
                             persistent=False)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.kernel = kernel_available(device)
        # With AMX, bf16 GEMMs over every slot (on AMX tiles) beat the kernel's AVX-512 FMAs above ~100 tokens a
        # step (bench model's layers, 4 slots of rank 16, oneDNN's GEMMs: 400 against 350 us at 128 tokens, 214
        # against 265 at 64; aserve's AMX GEMMs, the default since, ran the bench model's own layers faster still).
        self.flat_above = AMX_FLAT_ABOVE if self.kernel and dtype == torch.bfloat16 and _amx() else None
        self.flat: tuple | None = None  # the torch path's [in, slots * width] and [slots * width, out] (maybe packed)

    def write(self, slot: int, module: str, a_t: torch.Tensor | None, b_t: torch.Tensor | None) -> None:
        """Put one adapter's A^T [in, r] and scale * B^T [r, out] for `module` in `slot` (None: zeros there); call
        `repack` after the slot's writes."""
        i, rank = self.modules_.index(module), self.step.max_rank
        offset, size = self.offsets[i], self.sizes[i]
        if a_t is not None and self.shard is not None:
            a_t, b_t = self.shard.take(i, a_t, b_t)
        self.a[slot, :, i * rank:(i + 1) * rank].zero_()
        self.b[slot, i * rank:(i + 1) * rank].zero_()
        if a_t is not None:
            r = a_t.shape[1]
            self.a[slot, :, i * rank:i * rank + r].copy_(a_t)
            self.b[slot, i * rank:i * rank + r, offset:offset + size].copy_(b_t)

    def repack(self) -> None:
        if self.kernel and self.flat_above is None:
            return
        a = self.a.permute(1, 0, 2).reshape(self.a.shape[1], -1).contiguous()
        b = self.b.reshape(-1, self.b.shape[-1])
        packs = a.device.type == "cpu" and cpu_gemm.can_pack(a.dtype) and os.environ.get("ASERVE_PREPACK", "1") != "0"
        self.flat = ((cpu_gemm.pack_weight(a.t().contiguous()), cpu_gemm.pack_weight(b.t().contiguous()), True)
                     if packs else (a, b.contiguous(), False))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.step.token_slot is None:
            return y
        if self.kernel and (self.flat_above is None or x.shape[0] <= self.flat_above):
            torch.ops.aserve.lora_delta(x.contiguous(), y, self.a, self.b, self.step.token_slot, self.sizes)
            return y
        a, b, packed = self.flat
        mask = self.step.mask(len(self.modules_))
        if packed:
            shrunk = cpu_gemm.packed_linear_then(x, a, "mul", mask)
            return cpu_gemm.packed_linear_then(shrunk, b, "add", y)
        return y.addmm_((x @ a) * mask, b)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, modules={list(self.modules_)}, slots={self.step.max_loras}"


class Shard(NamedTuple):
    """A tensor-parallel rank's part of the adapters of one layer, as its base weight is split
    (models.parallel.Split): a column-parallel layer holds some output rows of each slice, so it takes those
    columns of each slice's B^T (A whole); a row-parallel one holds some input columns, so it takes those rows of
    A^T (B whole): its partial delta joins the partial base product before their one all-reduce."""
    dim: int  # the base weight's split dimension: 0 (outputs) or 1 (inputs)
    parts: tuple[tuple[int, int], ...]  # (start, size) per slice for dim 0; one (start, size) of the inputs for 1

    def take(self, slice_index: int, a_t: torch.Tensor, b_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dim == 0:
            start, size = self.parts[slice_index]
            return a_t, b_t[:, start:start + size]
        start, size = self.parts[0]
        return a_t[start:start + size], b_t

    @classmethod
    def of(cls, linear: nn.Module) -> "Shard | None":
        split = getattr(linear, "tp_splits", {}).get("weight")
        return None if split is None else cls(split.dim, split.parts)


def full_shapes(linear: nn.Module) -> list[tuple[int, int]]:
    """Each output slice's (in, out) features in the checkpoint, whatever this rank holds of them."""
    split = getattr(linear, "tp_splits", {}).get("weight")
    if split is None:
        return [(linear.in_features, size) for size in linear.output_sizes]
    if split.dim == 0:
        return [(linear.in_features, size) for size in split.shard_sizes]
    return [(split.shard_sizes[0], size) for size in linear.output_sizes]


def adaptable(model: nn.Module):
    """(layer index, Linear, its Hugging Face modules) for each linear layer LoRA can adapt."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        match = LAYER.search(name)
        if leaf in FUSED and match and len(getattr(module, "output_sizes", ())) == len(FUSED[leaf]):
            yield int(match.group(1)), module, FUSED[leaf]


def target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The modules an adapter may target, with their (in, out) features (plain data for the core's checks)."""
    shapes = {}
    for _, linear, modules in adaptable(model):
        for module, shape in zip(modules, full_shapes(linear)):
            shapes[module] = shape
    return shapes


def attach(model: nn.Module, step: LoRAStep, dtype: torch.dtype,
           device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Give each adaptable Linear its LoRALinear (Linear.forward adds its delta); returns them by (layer, module)."""
    by_module = {}
    for layer, linear, modules in list(adaptable(model)):
        linear.lora = LoRALinear(step, layer, modules, linear.in_features, list(linear.output_sizes), dtype, device,
                                 Shard.of(linear))
        for module in modules:
            by_module[(layer, module)] = linear.lora
    return by_module
