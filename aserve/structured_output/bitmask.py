"""Applying the step's grammar bitmask to the logits of the rows that sample, in one call, before sampling.

The engine core fills the bitmask rows in its own order; the worker samples in the batch's order, so the
rows are matched by request id here. The bitmask covers the tokenizer's vocabulary: logits past it (a
model's embedding rows padded beyond its tokenizer) are tokens no grammar can allow, and are masked with
one fill instead of bit by bit.

The mask is applied where the logits are: its packed int32 words (a bit per token, 1/32 of the logits' elements)
are laid out in the logits' row order on the host and uploaded; the logits never leave their device.
"""
from __future__ import annotations

from collections import deque

import torch


def apply_grammar_bitmask(logits: torch.Tensor, request_ids: list[str], structured_ids: list[str],
                          bitmask_bytes: bytes) -> None:
    """Set to -inf, in place, every logit a constrained request's grammar does not allow next. `request_ids`
    name the logits' rows; `structured_ids` the bitmask's, whose int32 words come as bytes. An id may name
    several rows (speculative decoding's positions): they pair up in order."""
    import xgrammar

    rows: dict[str, deque[int]] = {}  # a request checking proposals has a row at each position, in order
    for row, rid in enumerate(structured_ids):
        rows.setdefault(rid, deque()).append(row)
    picked = [(i, rows[rid].popleft()) for i, rid in enumerate(request_ids) if rows.get(rid)]
    if not picked:
        return
    bitmask = torch.frombuffer(bytearray(bitmask_bytes), dtype=torch.int32).view(len(structured_ids), -1)
    index = [i for i, _ in picked]
    if index == [r for _, r in picked] and len(index) == bitmask.shape[0] == logits.shape[0]:
        aligned = bitmask  # already in the logits' order (every row constrained)
    else:
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[index] = bitmask[[r for _, r in picked]]
    known = min(logits.shape[-1], bitmask.shape[1] * 32)
    if known < logits.shape[-1]:
        if len(index) == logits.shape[0]:
            logits[:, known:] = float("-inf")
        else:
            for i in index:
                logits[i, known:] = float("-inf")
    xgrammar.apply_token_bitmask_inplace(logits, aligned.to(logits.device), vocab_size=known, indices=index)
