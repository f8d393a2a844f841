"""Paged attention in torch: the CPU path and the reference for faster kernels. Pure tensor functions.

The cache of one layer is a pair of tensors [num_kv_heads, num_blocks, block_size, head_dim]
(head-major, so a gathered context is already laid out for batched matmuls). New keys and values are
written by slot (block * block_size + offset); attention reads a request's context through its block
table. Values are stored as rows. Keys are too, or, with `paired_keys` (the torch backend's caches, which the
CPU kernels read), each block's keys as [head_dim / 2][block_size][2]: pairs of dims, token after token, so
that one 64-byte line holds a pair of dims of 16 tokens (bf16) and decode attention's key pass multiplies a
query dim into 16 scores at once, with no sum across lanes. Masks are boolean, True = attend; sliding windows and logit soft-capping (Gemma 2) are the
callers' masks and an optional `softcap`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, paired_keys: bool) -> None:
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    if paired_keys:
        pairs = k_cache.view(num_kv_heads, -1, head_dim // 2, block_size, 2)
        pairs[:, slot_mapping // block_size, :, slot_mapping % block_size] = key.reshape(
            -1, num_kv_heads, head_dim // 2, 2)
    else:
        k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def unpair_keys(blocks: torch.Tensor) -> torch.Tensor:
    """[..., block_size, head_dim] blocks of paired keys (each stored [head_dim / 2][block_size][2]) as rows."""
    *lead, block_size, head_dim = blocks.shape
    return blocks.reshape(*lead, head_dim // 2, block_size, 2).transpose(-3, -2).reshape(*lead, block_size, head_dim)


def pair_keys(blocks: torch.Tensor) -> torch.Tensor:
    """unpair_keys' inverse: [..., block_size, head_dim] rows of keys as the blocks a paired cache stores."""
    *lead, block_size, head_dim = blocks.shape
    return blocks.reshape(*lead, block_size, head_dim // 2, 2).transpose(-3, -2).reshape(*lead, block_size, head_dim)


def gather_index(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of the flattened [heads * blocks, block_size * dim] cache that hold these blocks, head-major.

    Computed once per step and shared by all layers; a dim-0 index_select of whole blocks is the
    fastest gather torch has on the CPU."""
    heads = torch.arange(num_kv_heads).view(-1, *([1] * block_ids.dim())) * num_blocks
    return (heads + block_ids.unsqueeze(0)).flatten()


def gather(cache: torch.Tensor, rows: torch.Tensor, paired_keys: bool = False) -> torch.Tensor:
    """[heads, blocks, block_size, dim] cache and gather_index rows -> [heads, tokens, dim] (a paired key
    cache's blocks unpaired)."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    blocks = cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, rows)
    if paired_keys:
        blocks = unpair_keys(blocks.view(-1, block_size, head_dim))
    return blocks.view(num_kv_heads, -1, head_dim)


def softcap_(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping of attention logits: cap * tanh(scores / cap)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None,
                     widen: tuple[Callable, Callable] | None = None, paired_keys: bool = True) -> torch.Tensor:
    """One query per request: [B, Hq, D] against each request's cached context (keys paired, as the torch
    backend stores them, unless `paired_keys` is False).

    The context is gathered head-major ([Hkv * B, L, D]), so both products are single batched matmuls
    with the query heads of a group as rows; no copy of K or V beyond the gather. `mask` is
    [1, B, 1, L] bool. `widen` turns gathered keys and values into the query's dtype (an FP8 cache)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    k = gather(k_cache, rows, paired_keys).view(num_kv_heads * batch, -1, head_dim)
    v = gather(v_cache, rows).view(num_kv_heads * batch, -1, head_dim)
    if widen is not None:
        k, v = widen[0](k), widen[1](v)
    q = query.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * batch, group, head_dim)
    scores = softcap_(torch.bmm(q, k.transpose(1, 2)).view(num_kv_heads, batch, group, -1) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(probs.view(num_kv_heads * batch, group, -1), v)
    return out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1).reshape(batch, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
    """One chunk: q [Hq, n, D] against k/v [Hkv, L, D]; `mask` [n, L] bool, or None for plain causal (n == L)."""
    gqa = q.shape[0] != k.shape[0]
    if softcap is None:
        return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                              is_causal=mask is None, scale=scale, enable_gqa=gqa).squeeze(0)
    group = q.shape[0] // k.shape[0]  # SDPA has no soft-capping: the products by hand
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = softcap_(torch.matmul(q, k.transpose(1, 2)) * scale, softcap)
    if mask is None:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
