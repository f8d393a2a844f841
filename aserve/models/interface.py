"""What the engine needs of a model family, and the weight-filling every family's `load_weights` shares.

A family is a torch module built from config.json (`from_config`, on the meta device), filled from the
checkpoint by `load_weights` (which maps the checkpoint's names to its own, fused or not), made ready
for a dtype and length by `prepare`, and run as `forward` (hidden states of a flat token batch) then
`compute_logits`. The runner reads only `shape`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
from torch import nn

from aserve.models import parallel


@dataclass(frozen=True)
class ModelShape:
    """What sizes the KV cache and bounds requests."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    causal: bool = True  # False: an encoder (bidirectional attention); prompts run whole and keep no KV cache


class CausalLM(Protocol):
    shape: ModelShape

    @classmethod
    def from_config(cls, config: dict) -> "CausalLM": ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def prepare(self, max_positions: int, dtype: torch.dtype) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def need(config: dict, name: str):
    if name not in config:
        raise ValueError(f"config.json: required field {name!r} is missing")
    return config[name]


class ParamFiller:
    """Copies checkpoint tensors into a module's parameters, whole or as one shard of a fused parameter,
    checking shapes, and finally that every parameter (every shard) was filled.

    Shards are concatenated along dim 0 unless the parameter's layer records another layout (a `ParamLayout` in
    its `param_layouts`, as quantized formats do): the output dimension, how many outputs one stored element packs,
    or no output dimension at all (every shard carries the same whole tensor, which must then agree). With tensor
    parallelism a parameter's `Split` (models.parallel, in its layer's `tp_splits`) first cuts this rank's part out
    of the checkpoint tensor, read from the file alone when the loader hands safetensors slices."""

    def __init__(self, module: nn.Module, shards: dict[str, list[int]] | None = None):
        self.params = dict(module.named_parameters())
        self.layouts = {f"{prefix}.{name}" if prefix else name: layout for prefix, m in module.named_modules()
                        for name, layout in getattr(m, "param_layouts", {}).items()}
        self.shards = shards or {}  # fused parameter name -> its shards' sizes along the output dimension
        # tensor parallelism (models.parallel): the part of a checkpoint tensor this rank holds
        self.splits = {f"{prefix}.{name}" if prefix else name: split for prefix, m in module.named_modules()
                       for name, split in getattr(m, "tp_splits", {}).items()}
        self.filled: set[tuple[str, int | None]] = set()
        self.touched: set[str] = set()  # names with at least one shard filled

    def fill(self, ours: str, tensor: torch.Tensor, source: str, shard: int | None = None) -> None:
        param = self.params.get(ours)
        if param is None:
            raise ValueError(f"unexpected tensor {source!r}")
        dest = param.data
        layout = self.layouts.get(ours)
        split = self.splits.get(ours)
        tensor = split.take(tensor, shard) if split is not None else parallel.materialize(tensor)
        if shard is not None and layout is not None and layout.output_dim is None:
            if ours in self.touched and not torch.equal(dest, tensor.to(dest.dtype)):
                raise ValueError(f"tensor {source!r} differs from the other shards fused into {ours!r}, "
                                 "which must hold the same values")
        elif shard is not None:
            dim, pack = (layout.output_dim, layout.pack_factor) if layout is not None else (0, 1)
            sizes = self.shards[ours]
            if any(size % pack for size in sizes):
                raise ValueError(f"tensor {source!r}: the fused shards of {ours!r} ({sizes} outputs) do not divide "
                                 f"into the {pack} outputs one packed element holds")
            dest = dest.narrow(dim, sum(sizes[:shard]) // pack, sizes[shard] // pack)
        if split is not None and split.padded and tensor.shape[split.dim] < dest.shape[split.dim]:
            held = tensor.shape[split.dim]  # the last vocab range: rows past the vocabulary are zeros
            dest.narrow(split.dim, held, dest.shape[split.dim] - held).zero_()
            dest = dest.narrow(split.dim, 0, held)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        self.filled.add((ours, shard))
        self.touched.add(ours)

    def check_complete(self) -> None:
        for ours, param in self.params.items():
            if (ours, None) in self.filled:  # whole, even where the checkpoint is fused too (Phi-3)
                continue
            layout = self.layouts.get(ours)
            shards = range(len(self.shards[ours])) if ours in self.shards else [None]
            if layout is not None and layout.output_dim is None and ours in self.touched:
                continue  # one shard carries the whole tensor
            missing = [shard for shard in shards if (ours, shard) not in self.filled]
            if missing and layout is not None and layout.fill_default is not None and len(missing) == len(shards):
                layout.fill_default(param.data)
                continue
            if missing:
                raise ValueError(f"the checkpoint lacks weights for {ours!r}"
                                 + (f" (shard {missing[0]})" if missing[0] is not None else ""))


def fill_from_checkpoint(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         checkpoint_name: Callable[[str], tuple[str, int | None] | None],
                         shards: dict[str, list[int]] | None = None) -> None:
    """The usual `load_weights`: map each checkpoint name to (our name, shard) or None to skip, fill, then check
    that nothing is missing."""
    filler = ParamFiller(module, shards)
    for name, tensor in weights:
        target = checkpoint_name(name)
        if target is not None:
            filler.fill(target[0], tensor, name, target[1])
    filler.check_complete()
