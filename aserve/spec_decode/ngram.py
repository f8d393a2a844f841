"""Prompt-lookup proposals: find the latest earlier place where the context's last tokens occurred, and propose
the tokens that followed there. Costs no model; pays off where outputs repeat their input (quoting, editing,
code, extraction).

The search is vectorized: one numpy comparison over the context for its last token, then the candidates alone are
extended backwards, token by token, to the longest match (at most `prompt_lookup_max`). Each request's tokens are
kept in a growing numpy buffer, so a step converts only the tokens that are new since the last one: a 50k-token
prompt is copied once, not every step.
"""
from __future__ import annotations

import numpy as np


class TokenBuffer:
    """One request's tokens as a numpy array that grows by doubling."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """The buffer made equal to `tokens` (which only ever grew, else it is rebuilt); the view of it."""
        n = len(tokens)
        if n < self.length:
            self.length = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length:n] = tokens[self.length:n]
            self.length = n
        return self.array[:n]


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix of `tokens` of `min_n`..`max_n`
    tokens (the latest that k tokens follow, else the earliest); [] when none occurs."""
    length = tokens.shape[0]
    if length < min_n + 1 or k < 1:
        return []
    last = tokens[-1]
    ends = np.flatnonzero(tokens[:-1] == last)  # where an earlier match could end
    ends = ends[ends >= min_n - 1]
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens each candidate matches, backwards
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        if back >= length:
            break
        starts = ends - back
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[length - 1 - back]
        matched += ok
        alive = ok
        if not alive.any():
            break
    best = matched.max()
    if best < min_n:
        return []
    longest = ends[matched == best]
    full = longest[longest + k < length]  # followed by k tokens: the latest such, else the earliest (the most)
    end = int(full[-1] if full.size else longest[0])
    return tokens[end + 1:end + 1 + k].tolist()


class NgramProposer:
    """Proposals for the running requests, keeping each one's token buffer between steps."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.buffers: dict[str, TokenBuffer] = {}

    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """`requests`: (request id, all its tokens, the most it may propose); returns the non-empty proposals.
        Buffers of requests not asked about are dropped (finished or preempted ones rebuild theirs)."""
        found = {}
        buffers = {}
        for request_id, tokens, most in requests:
            buffer = buffers[request_id] = self.buffers.get(request_id) or TokenBuffer()
            proposal = propose(buffer.sync(tokens), self.min_n, self.max_n, min(self.k, most))
            if proposal:
                found[request_id] = proposal
        self.buffers = buffers
        return found
