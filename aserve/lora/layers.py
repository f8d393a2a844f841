"""The batched LoRA math: each adapted linear layer adds scale * (x @ A[slot]) @ B[slot] to the rows of the tokens
that run under an adapter, for every adapter of the step at once, never a loop over requests or adapters.

Each adaptable Linear holds all `max_loras` slots stacked: A as one [in, slices * slots * rank] matrix (columns
ordered slice, slot, rank) and B as one block-diagonal [slices * slots * rank, out] matrix (q|k|v, gate|up: a fused
projection adds each slice's own module's delta in its own columns). A step then costs, per layer, one shrink GEMM
over all slots, a multiply by the step's token -> slot mask (a token's other slots, and base-model tokens, become
exact zeros), and one expand GEMM added to the base output: a fixed number of ops whatever the mix of adapters
(punica's BGMV/SGMV do the same grouping in a kernel). Ranks below the slot width, modules an adapter leaves alone and empty slots are
zeros: they add nothing. A step with no adapter tokens skips it all. Adapters are never merged into the weights.

The mask is computed once per step (`LoRAStep.set`) and read by every layer.
"""
from __future__ import annotations

import os
import re

import torch
from torch import nn

from aserve.ops import cpu_gemm

# aserve's fused module -> the Hugging Face modules of its output slices, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LoRAStep:
    """The step's token -> slot mask, read by every layer: for a layer of M output slices, [tokens, M * slots *
    rank] with ones in the columns of the token's slot (built once a step per M); None when no token has an
    adapter."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.one_hot: torch.Tensor | None = None  # [tokens, slots]
        self._masks: dict[int, torch.Tensor] = {}

    def set(self, slot_per_request: list[int | None], counts: list[int]) -> None:
        """`slot_per_request`: each batch row's slot (None: the base model), `counts`: its tokens, in batch order."""
        self._masks = {}
        if all(slot is None for slot in slot_per_request):
            self.one_hot = None
            return
        slots = torch.tensor([-1 if s is None else s for s in slot_per_request])
        per_token = torch.repeat_interleave(slots, torch.tensor(counts))
        self.one_hot = (per_token.unsqueeze(1) == torch.arange(self.max_loras)).to(self.dtype).to(self.device)

    def mask(self, num_slices: int) -> torch.Tensor | None:
        if self.one_hot is None:
            return None
        mask = self._masks.get(num_slices)
        if mask is None:
            tokens = self.one_hot.shape[0]
            mask = self.one_hot.view(tokens, 1, self.max_loras, 1).expand(
                tokens, num_slices, self.max_loras, self.max_rank).reshape(tokens, -1).contiguous()
            self._masks[num_slices] = mask
        return mask

    def clear(self) -> None:
        self.one_hot, self._masks = None, {}


class LoRALinear(nn.Module):
    """The stacked adapter weights of one Linear and the delta they add. `a`: [in, slices, slots, rank] (A^T of
    each slice's module in each slot); `b`: [slices * slots * rank, out], block-diagonal by slice (scale * B^T of
    slice i's module in its own output columns, zeros elsewhere), so the expand is one GEMM for a fused layer.

    Both are prepacked for the CPU GEMM as the base weights are (ops.cpu_gemm), after every slot write. With
    oneDNN the mask multiply and the add to the base output ride in the GEMMs' epilogues: two ops a layer."""

    def __init__(self, step: LoRAStep, layer: int, modules: tuple[str, ...], in_features: int, sizes: list[int],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.step, self.layer, self.modules_ = step, layer, modules
        slots, rank = step.max_loras, step.max_rank
        self.register_buffer("a", torch.zeros(in_features, len(modules), slots, rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(len(modules), slots, rank, sum(sizes), dtype=dtype, device=device),
                             persistent=False)
        self.offsets = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
        self.packed: tuple | None = None  # (A, B) packed for the CPU GEMM, or None to multiply them as they are

    def write(self, slot: int, module: str, a_t: torch.Tensor | None, b_t: torch.Tensor | None) -> None:
        """Put one adapter's A^T [in, r] and scale * B^T [r, out] for `module` in `slot` (None: zeros there); call
        `repack` after the slot's writes."""
        i = self.modules_.index(module)
        offset, size = self.offsets[i]
        self.a[:, i, slot].zero_()
        self.b[i, slot].zero_()
        if a_t is not None:
            rank = a_t.shape[1]
            self.a[:, i, slot, :rank].copy_(a_t)
            self.b[i, slot, :rank, offset:offset + size].copy_(b_t)

    def repack(self) -> None:
        a, b = self.a.view(self.a.shape[0], -1), self.b.view(-1, self.b.shape[-1])
        self.packed = None
        if a.device.type == "cpu" and cpu_gemm.can_pack(a.dtype) and os.environ.get("ASERVE_PREPACK", "1") != "0":
            self.packed = (cpu_gemm.pack_weight(a.t().contiguous()), cpu_gemm.pack_weight(b.t().contiguous()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = self.step.mask(len(self.modules_))
        if mask is None:
            return y
        if self.packed is not None:
            packed_a, packed_b = self.packed
            shrunk = cpu_gemm.packed_linear_then(x, packed_a, "mul", mask)
            return cpu_gemm.packed_linear_then(shrunk, packed_b, "add", y)
        shrunk = (x @ self.a.view(self.a.shape[0], -1)) * mask
        return y.addmm_(shrunk, self.b.view(-1, self.b.shape[-1]))

    def extra_repr(self) -> str:
        return f"layer={self.layer}, modules={list(self.modules_)}, slots={self.step.max_loras}"


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
        for module, size in zip(modules, linear.output_sizes):
            shapes[module] = (linear.in_features, size)
    return shapes


def attach(model: nn.Module, step: LoRAStep, dtype: torch.dtype,
           device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Give each adaptable Linear its LoRALinear (Linear.forward adds its delta); returns them by (layer, module)."""
    by_module = {}
    for layer, linear, modules in list(adaptable(model)):
        linear.lora = LoRALinear(step, layer, modules, linear.in_features, list(linear.output_sizes), dtype, device)
        for module in modules:
            by_module[(layer, module)] = linear.lora
    return by_module
