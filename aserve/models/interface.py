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


@dataclass(frozen=True)
class ModelShape:
    """What sizes the KV cache and bounds requests."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


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
    checking shapes, and finally that every parameter (every shard) was filled."""

    def __init__(self, module: nn.Module, shards: dict[str, list[int]] | None = None):
        self.params = dict(module.named_parameters())
        self.shards = shards or {}  # fused parameter name -> its shards' sizes along dim 0
        self.filled: set[tuple[str, int | None]] = set()

    def fill(self, ours: str, tensor: torch.Tensor, source: str, shard: int | None = None) -> None:
        param = self.params.get(ours)
        if param is None:
            raise ValueError(f"unexpected tensor {source!r}")
        dest = param.data
        if shard is not None:
            sizes = self.shards[ours]
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        self.filled.add((ours, shard))

    def check_complete(self) -> None:
        for ours in self.params:
            if (ours, None) in self.filled:  # whole, even where the checkpoint is fused too (Phi-3)
                continue
            for shard in range(len(self.shards[ours])) if ours in self.shards else [None]:
                if (ours, shard) not in self.filled:
                    raise ValueError(f"the checkpoint lacks weights for {ours!r}"
                                     + (f" (shard {shard})" if shard is not None else ""))


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
