"""The Triton backend: the CUDA path, one kernel launch per layer for decode tokens and prefill chunks alike.

It keeps the torch backend's cache layout, so swaps, copies and zeroing in the runner are the same. An encoder's
bidirectional layer writes its prompt's keys into the cache like any other (the kernel reads them from there) and
sees all of them; the blocks go back when the request ends. Only
`select_backend` imports this module, so aserve runs without triton wherever this backend is not chosen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from aserve.attention import kv_quant
from aserve.attention.backend import BatchLayout
from aserve.ops.triton_attention import query_tiles, tokens_per_tile, unified_attention


@dataclass
class TritonAttentionMetadata:
    backend: "TritonAttentionBackend"
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [R, W]
    query_starts: list[int]  # per request: its first row in the flat batch
    counts: list[int]
    _tiles: dict = field(default_factory=dict)

    def move_to(self, device: torch.device) -> None:
        """The layout is built on the host; move it once per step, at the first layer, not once per layer."""
        if self.positions.device != device:
            self.slot_mapping, self.positions, self.block_tables = (
                t.to(device, non_blocking=True) for t in (self.slot_mapping, self.positions, self.block_tables))

    def tiles(self, block_q: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """query_tiles for this step, made by the first layer that asks and shared by the rest."""
        if block_q not in self._tiles:
            self._tiles[block_q] = tuple(t.to(device, non_blocking=True)
                                         for t in query_tiles(self.query_starts, self.counts, block_q))
        return self._tiles[block_q]


class TritonAttentionBackend:
    name = "triton"
    block_dim = 3  # [layers, 2, kv_heads, blocks, block_size, head_dim], as the torch backend
    kv_format: kv_quant.FP8Format | None = None  # an FP8 cache (set by the runner), else the model's dtype

    def kv_cache_shape(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def build_metadata(self, layout: BatchLayout, num_kv_heads: int) -> TritonAttentionMetadata:
        query_starts = [0, *accumulate(layout.counts)][:-1]
        return TritonAttentionMetadata(self, layout.slot_mapping, layout.positions, layout.block_tables,
                                       query_starts, list(layout.counts))

    def forward(self, layer, query, key, value, kv_cache, meta: TritonAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        meta.move_to(query.device)
        fmt = self.kv_format
        kv_quant.write(layer, kv_cache, key, value, meta.slot_mapping, fmt, paired_keys=False)
        block_q = tokens_per_tile(layer.num_heads // layer.num_kv_heads)
        return unified_attention(query, k_cache, v_cache, meta.block_tables, meta.positions,
                                 meta.tiles(block_q, query.device), block_q, layer.scale, layer.sliding_window,
                                 layer.logit_softcap, layer.k_scale, layer.v_scale, 0 if fmt is None else fmt.code,
                                 layer.causal)
