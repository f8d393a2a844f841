"""Paged attention in torch: the CPU path and the reference for faster kernels.

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim]. New keys
and values are written by slot (block * block_size + offset); attention reads a request's context
through its block table. The batch is flat: decode tokens first (one query each, attended in one
batched call), then prefill chunks (one call each, causal within the chunk, after any cached context).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None = None  # only when context_len > 0
    mask: torch.Tensor | None = None  # [chunk, context_len + chunk] bool, only when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., blocks] block ids -> [..., blocks * block_size, heads, dim] keys or values."""
    blocks = cache[block_table]
    return blocks.flatten(-4, -3)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (already written to the cache) -> [T, Hq, D]."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        q = query[:nd].unsqueeze(2)  # [B, Hq, 1, D]
        k = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, L, D]
        v = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        q = query[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.context_len == 0:
            k = key[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            v = value[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            total = chunk.mask.shape[-1]
            k = _gather(k_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)
            v = _gather(v_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa)
        out[chunk.start:chunk.end] = o.squeeze(0).transpose(0, 1)
    return out
