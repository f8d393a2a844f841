"""Scoring text pairs, shared by LLM.score and the /score and /rerank routes: which pairs a request names, and
how each becomes a model input. A cross-encoder (a one-label classifier) reads each pair as one prompt, encoded
the way its tokenizer encodes pairs (BERT: [CLS] a [SEP] b [SEP]); an embedding model embeds each side once and
scores a pair by the cosine similarity of the two embeddings, as vLLM does."""
from __future__ import annotations

from typing import Sequence

import torch

from aserve.errors import InvalidRequestError


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """One text_1 against each text_2, or text_1[i] against text_2[i]; a ValueError says what does not fit."""
    ones = [text_1] if isinstance(text_1, str) else list(text_1)
    twos = [text_2] if isinstance(text_2, str) else list(text_2)
    if not ones or not twos:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(ones) == 1:
        ones = ones * len(twos)
    elif len(ones) != len(twos):
        raise ValueError(f"text_1 has {len(ones)} texts and text_2 {len(twos)}: give one text_1 to score against "
                         f"every text_2, or as many of each")
    return list(zip(ones, twos))


def pair_token_ids(tokenizer, pairs: list[tuple[str, str]], max_length: int | None = None) -> list[list[int]]:
    """Each pair as the tokenizer encodes it; with `max_length` (truncate_prompt_tokens) cut longest-first to
    that many tokens, as sentence-transformers' CrossEncoder cuts."""
    cut = {"truncation": True, "max_length": max_length} if max_length else {}
    try:
        return [tokenizer(a, b, **cut)["input_ids"] for a, b in pairs]
    except Exception as exc:  # the tokenizer's own refusal, e.g. a max_length under its special tokens
        raise InvalidRequestError("the pair could not be encoded"
                                  + (f" in {max_length} tokens" if max_length else "") + f": {exc}",
                                  "truncate_prompt_tokens" if max_length else "text_2") from None


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).reshape(1)
