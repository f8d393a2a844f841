"""What every attention backend offers, the step layout they all start from, and how one is chosen."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch


# A chunk of at most this many tokens past a request's prompt (speculative decoding's checked proposals) may run as
# that many decode rows, one per token, each over the context up to itself: on the CPU the decode kernel does that
# 3-4x faster than the prefill kernel does such a chunk (measured at 5 tokens; the two cross over between 8 and
# 16). The runner puts such chunks right after the decodes.
SHORT_CHUNK = 8


def batch_order(num_tokens: int, num_cached: int, num_prompt: int) -> int:
    """Where a request of the step goes in the flat batch: decodes (one token past its prompt), then short chunks
    past its prompt, then the rest (sort by this; it is stable). Every chunk of a prompt, however short (the tail
    after a prefix-cache hit, the last piece of a chunked prefill), goes with the rest to the prefill kernel, which
    computes a prompt's rows bit for bit alike however the prompt was split: the decode kernel sums in another
    order, and a prompt's logits would then depend on the cache's state."""
    if num_cached < num_prompt:
        return 2
    return 0 if num_tokens == 1 else 1 if num_tokens <= SHORT_CHUNK else 2


@dataclass
class BatchLayout:
    """One step's batch, backend-neutral: all scheduled tokens in one flat row, decode requests first (then
    short chunks, see batch_order)."""
    positions: torch.Tensor  # [T] long: each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] long: the cache slot (block * block_size + offset) each token's K/V goes to
    block_tables: torch.Tensor  # [R, W] long, padded with the null block
    starts: list[int]  # per request: tokens already in the cache before this step
    counts: list[int]  # per request: tokens in this step
    num_decode: int  # the first num_decode requests have one token each, past their prompts
    block_size: int
    num_physical_blocks: int  # including the null block
    num_short: int = 0  # the next num_short requests run a short chunk past their prompts (batch_order 1)


class AttentionBackend(Protocol):
    """Owns the KV cache's shape and dtype, builds per-step metadata, writes K/V and runs attention.

    The cache is one tensor per engine, [num_layers, 2 (K, V), ...] with blocks on dimension `block_dim`,
    so the runner can swap, copy and zero blocks without knowing the rest of the layout."""
    name: str
    block_dim: int

    def kv_cache_shape(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]: ...

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype: ...

    def build_metadata(self, layout: BatchLayout, num_kv_heads: int) -> Any: ...

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]; writes key/value into `kv_cache` first."""


BACKENDS = {"torch": ("aserve.attention.torch_backend", "TorchAttentionBackend"),
            "triton": ("aserve.attention.triton_backend", "TritonAttentionBackend")}


def select_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """`name` as given, or by device: triton on CUDA where it is installed, else torch.

    Backends are imported only when chosen, so triton is needed only where the triton backend runs."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name in (None, "auto"):
        name = "triton" if device.type == "cuda" and has_triton else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; available: {', '.join(sorted(BACKENDS))}")
    if name == "torch" and device.type != "cpu":  # its step metadata (slots, masks, gather rows) stays on the host
        raise ValueError(f"attention backend 'torch' runs on the CPU only, not on {device.type}: use "
                         "attention_backend='triton' (or auto) there")
    if name == "triton":
        if not has_triton:
            raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on"):
            raise ValueError(f"attention backend 'triton' runs on {device.type} only in Triton's interpreter: "
                             "set TRITON_INTERPRET=1 before starting, or use attention_backend='torch'")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()
