"""The worker's own record of each request it runs: tokens, block table, progress and sampling state.

It is built from the scheduler's plain step data (a new request in full, then diffs) and kept until the
scheduler says the request finished, across preemptions, so a seeded request's generator and its prompt
logprobs carry on where they were.
"""
from __future__ import annotations

import torch

from aserve.sampling_params import SamplingParams


class RequestState:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_table: list[int] | None = None, num_computed_tokens: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.block_table = list(block_table or [])
        self.num_computed_tokens = num_computed_tokens
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs were already computed (never twice)
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
