"""Paged attention in Triton: one kernel for decode tokens and prefill chunks alike.

The cache layout is the torch backend's ([num_kv_heads, num_blocks, block_size, head_dim] per layer and K/V),
so the runner's block swaps and copies need not know which backend wrote it. A program takes a tile of
query tokens of one request and the query heads of one KV head (the GQA group), as rows token-major:
row r is token r // GROUP_P, head r % GROUP_P. It walks the request's block table over the keys that tile
may see (causal, and inside the sliding window when there is one; for an encoder's bidirectional layer, every
key of its prompt) with an online softmax in fp32, so no score matrix is ever written out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # query rows per program at least: tl.dot's smallest tile
BLOCK_N = 32  # keys per step of the walk


@triton.jit
def _widen_fp8(bits, FP8: tl.constexpr):
    """FP8 bytes -> fp32 through fp16 bit patterns (FP8 1 = e4m3, 2 = e5m2), as attention.kv_quant describes."""
    b = bits.to(tl.uint16)
    if FP8 == 2:
        h = b << 8
    else:
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    x = h.to(tl.float16, bitcast=True).to(tl.float32)
    if FP8 == 1:
        x = x * 256.0
    return x


@triton.jit
def _unified_attention(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, positions_ptr,
                       tile_request_ptr, tile_first_ptr, tile_len_ptr, tile_last_ptr,
                       scale, softcap, window, group, head_dim, block_size, k_scale, v_scale,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cb, stride_cs, stride_table,
                       GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FP8: tl.constexpr, CAUSAL: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    request = tl.load(tile_request_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    count = tl.load(tile_len_ptr + tile)

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    token = first + rows // GROUP_P
    head = kv_head * group + rows % GROUP_P
    row_ok = (rows // GROUP_P < count) & (rows % GROUP_P < group)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    pos = tl.load(positions_ptr + token, mask=row_ok, other=0)
    if FP8 != 0:  # FP8 keys and values widen to fp32: the products run in fp32 (memory, not math, is the point)
        q = q.to(tl.float32)

    # The tile's tokens are consecutive positions of one request: the last one bounds the keys any row sees,
    # the first one (less the window) the earliest.
    # Bidirectional: every key of the prompt, up to its last row's position.
    if CAUSAL:
        key_end = tl.load(positions_ptr + first + count - 1) + 1
    else:
        key_end = tl.load(positions_ptr + tl.load(tile_last_ptr + tile)) + 1
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(tl.load(positions_ptr + first) - window + 1, 0)

    # A finite running max: a row that sees no key in a step yet gets exp(-inf - m) = 0, never NaN.
    m = tl.full([BLOCK_Q * GROUP_P], -1e30, tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    table = block_tables_ptr + request * stride_table
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < key_end
        block = tl.load(table + keys // block_size, mask=key_ok, other=0)
        slot = block * stride_cb + (keys % block_size) * stride_cs
        k = tl.load(k_base + slot[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0)
        if FP8 != 0:
            k = _widen_fp8(k, FP8) * k_scale
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:  # cap * tanh(scores / cap), tanh written with exp (no tanh in tl)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        if CAUSAL:
            seen = keys[None, :] <= pos[:, None]
        else:
            seen = (keys[None, :] + 0 * pos[:, None]) < key_end
        if USE_WINDOW:
            seen = seen & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0)
        if FP8 != 0:
            v = _widen_fp8(v, FP8) * v_scale
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / tl.where(row_ok, l, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def tokens_per_tile(group: int) -> int:
    """Query tokens per program: as many as fill ROWS rows with the group's (padded) heads."""
    return max(1, ROWS // triton.next_power_of_2(group))


def query_tiles(query_starts: list[int], counts: list[int], block_q: int) -> tuple[torch.Tensor, ...]:
    """Each request's tokens cut into tiles of up to `block_q`: (request, first row, tokens, the request's last
    row) per tile."""
    counts_t = torch.tensor(counts)
    per_request = (counts_t + block_q - 1) // block_q
    request = torch.repeat_interleave(torch.arange(len(counts)), per_request)
    index = torch.arange(len(request)) - (torch.cumsum(per_request, 0) - per_request)[request]
    first = torch.tensor(query_starts)[request] + index * block_q
    last = (torch.tensor(query_starts) + counts_t - 1)[request]
    return request, first, torch.clamp(counts_t[request] - index * block_q, max=block_q), last


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, tiles: tuple[torch.Tensor, ...], block_q: int, scale: float,
                      window: int | None = None, softcap: float | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, fp8: int = 0, causal: bool = True) -> torch.Tensor:
    """query [T, Hq, D] (head dim contiguous) against the paged cache -> [T, Hq, D].

    k_cache / v_cache are one layer's [Hkv, num_blocks, block_size, D] views with the same strides, in the
    query's dtype or (fp8 = 1 e4m3, 2 e5m2) FP8 bytes read as bytes * k_scale / v_scale;
    `tiles` is query_tiles(..., block_q) on the query's device; `causal` False: each token sees its whole prompt
    (all of which this step holds)."""
    _, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    grid = (len(tiles[0]), num_kv_heads)
    _unified_attention[grid](
        out, query, k_cache, v_cache, block_tables, positions, *tiles,
        scale, softcap or 1.0, window or 0, group, head_dim, block_size, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP_P=triton.next_power_of_2(group), BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # fp32 models stay fp32, not tf32
        FP8=fp8, CAUSAL=causal)
    return out
