"""The batched LoRA math: each adapted linear layer adds scale * (x @ A[slot]) @ B[slot] to the rows of the tokens
that run under an adapter, for every adapter of the step at once, never a loop over requests or adapters.

Each adaptable Linear holds all `max_loras` slots stacked: A as one [in, modules * slots * rank] matrix (columns
ordered module, slot, rank) and B as one [slots * rank, out] matrix per output slice (q|k|v, gate|up: a fused
projection adds each slice's own module's delta). A step then costs, per layer, one shrink GEMM over all slots, one
multiply by the step's token -> slot mask (a token's other slots, and base-model tokens, become exact zeros), and one
expand GEMM per output slice, added in place: a fixed number of ops whatever the mix of adapters (punica's BGMV/SGMV
do the same grouping in a kernel). Ranks below the slot width, modules an adapter leaves alone and empty slots are
zeros: they add nothing. A step with no adapter tokens skips it all. Adapters are never merged into the weights.

The mask is computed once per step (`LoRAStep.set`) and read by every layer.
"""
from __future__ import annotations

import re

import torch
from torch import nn

# aserve's fused module -> the Hugging Face modules of its output slices, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LoRAStep:
    """The step's token -> slot mask, [tokens, 1, slots, 1] in the model's dtype; None when no token has an
    adapter."""

    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.dtype, self.device = max_loras, dtype, device
        self.mask: torch.Tensor | None = None

    def set(self, slot_per_request: list[int | None], counts: list[int]) -> None:
        """`slot_per_request`: each batch row's slot (None: the base model), `counts`: its tokens, in batch order."""
        if all(slot is None for slot in slot_per_request):
            self.mask = None
            return
        slots = torch.tensor([-1 if s is None else s for s in slot_per_request])
        per_token = torch.repeat_interleave(slots, torch.tensor(counts))
        mask = (per_token.unsqueeze(1) == torch.arange(self.max_loras)).to(self.dtype)
        self.mask = mask.view(len(per_token), 1, self.max_loras, 1).to(self.device)

    def clear(self) -> None:
        self.mask = None


class LoRALinear(nn.Module):
    """The stacked adapter weights of one Linear and the delta they add. `a`: [in, modules, slots, rank];
    `b[i]`: [slots, rank, out_i] for output slice i (scale folded in)."""

    def __init__(self, step: LoRAStep, layer: int, modules: tuple[str, ...], in_features: int, sizes: list[int],
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.step, self.layer, self.modules_ = step, layer, modules
        slots = step.max_loras
        self.register_buffer("a", torch.zeros(in_features, len(modules), slots, max_rank, dtype=dtype,
                                              device=device), persistent=False)
        self.b = [torch.zeros(slots, max_rank, size, dtype=dtype, device=device) for size in sizes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def write(self, slot: int, module: str, a_t: torch.Tensor | None, b_t: torch.Tensor | None) -> None:
        """Put one adapter's A^T [in, r] and scale * B^T [r, out] for `module` in `slot` (None: zeros there)."""
        i = self.modules_.index(module)
        self.a[:, i, slot].zero_()
        self.b[i][slot].zero_()
        if a_t is not None:
            rank = a_t.shape[1]
            self.a[:, i, slot, :rank].copy_(a_t)
            self.b[i][slot, :rank].copy_(b_t)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = self.step.mask
        if mask is None:
            return y
        tokens = x.shape[0]
        a = self.a.view(self.a.shape[0], -1)
        shrunk = (x @ a).view(tokens, *self.a.shape[1:]) * mask  # [tokens, modules, slots, rank]
        for i, (b, offset) in enumerate(zip(self.b, self.offsets)):
            y.narrow(-1, offset, b.shape[-1]).addmm_(shrunk[:, i].reshape(tokens, -1), b.view(-1, b.shape[-1]))
        return y

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


def attach(model: nn.Module, step: LoRAStep, max_rank: int, dtype: torch.dtype,
           device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Give each adaptable Linear its LoRALinear (Linear.forward adds its delta); returns them by (layer, module)."""
    by_module = {}
    for layer, linear, modules in list(adaptable(model)):
        linear.lora = LoRALinear(step, layer, modules, linear.in_features, list(linear.output_sizes), max_rank,
                                 dtype, device)
        for module in modules:
            by_module[(layer, module)] = linear.lora
    return by_module
