"""Paged attention in torch: the CPU path and the reference for faster kernels.

The cache of one layer is a pair of tensors [num_kv_heads, num_blocks, block_size, head_dim]
(head-major, so a gathered context is already laid out for batched matmuls). New keys and values are
written by slot (block * block_size + offset); attention reads a request's context through its block
table. The batch is flat: decode tokens first (one query each, attended in one
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
    rows: torch.Tensor | None = None  # gather_index of its block table, only when context_len > 0
    mask: torch.Tensor | None = None  # [chunk, context_len + chunk] bool, only when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int = 0
    decode_rows: torch.Tensor | None = None  # gather_index of the decode requests' block tables
    decode_mask: torch.Tensor | None = None  # [1, num_decode, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_index(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of the flattened [heads * blocks, block_size * dim] cache that hold these blocks, head-major.

    Computed once per step and shared by all layers; a dim-0 index_select of whole blocks is the
    fastest gather torch has on the CPU."""
    heads = torch.arange(num_kv_heads).view(-1, *([1] * block_ids.dim())) * num_blocks
    return (heads + block_ids.unsqueeze(0)).flatten()


def gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[heads, blocks, block_size, dim] cache and gather_index rows -> [heads, tokens, dim]."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, rows).view(
        num_kv_heads, -1, head_dim)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per request: [B, Hq, D] against each request's cached context.

    The context is gathered head-major ([Hkv * B, L, D]), so both products are single batched matmuls
    with the query heads of a group as rows; no copy of K or V beyond the gather.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    k = gather(k_cache, rows).view(num_kv_heads * batch, -1, head_dim)
    v = gather(v_cache, rows).view(num_kv_heads * batch, -1, head_dim)
    q = query.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * batch, group, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2)).view(num_kv_heads, batch, group, -1) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(probs.view(num_kv_heads * batch, group, -1), v)
    return out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1).reshape(batch, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (already written to the cache) -> [T, Hq, D]."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = decode_attention(query[:nd], k_cache, v_cache, meta.decode_rows, meta.decode_mask, scale)
    for chunk in meta.prefills:
        q = query[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.context_len == 0:
            k = key[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            v = value[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            total = chunk.mask.shape[-1]
            k = gather(k_cache, chunk.rows)[:, :total].unsqueeze(0)
            v = gather(v_cache, chunk.rows)[:, :total].unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa)
        out[chunk.start:chunk.end] = o.squeeze(0).transpose(0, 1)
    return out
