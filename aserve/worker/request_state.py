"""The worker's own record of each request it runs: tokens, block table, progress and sampling state.

It is built from the scheduler's plain step data (a new request in full, then diffs) and kept until the
scheduler says the request finished, across preemptions, so a seeded request's generator and its prompt
logprobs carry on where they were.
"""
from __future__ import annotations

import torch

from aserve.lora.request import ResolvedLoRA
from aserve.request import TokenSequence
from aserve.sampling_params import SamplingParams


class RequestState(TokenSequence):
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_table: list[int] | None = None, num_computed_tokens: int = 0, lora: ResolvedLoRA | None = None,
                 pooling: str | None = None):
        super().__init__(prompt_token_ids)
        self.request_id = request_id
        self.params = params
        self.block_table = list(block_table or [])
        self.num_computed_tokens = num_computed_tokens
        self.lora = lora  # its adapter (None: the base model)
        self.pooling = pooling  # a pooling request's kind (pooling.params.POOLING_KINDS); None: it samples
        self.pool_sum = None  # mean pooling: the hidden states summed over the chunks so far (float32)
        self.pool_first = None  # CLS pooling: the first position's hidden state
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs were already computed (never twice)
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self._prompt_distinct: torch.Tensor | None = None  # penalty_tokens' prompt tokens, found once
        self._outputs: tuple[list[int], torch.Tensor] | None = None  # its outputs' list and what of it is a tensor

    def penalty_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's distinct tokens and the output tokens, as int64 tensors, for the sampler's penalties. The
        prompt's are found once and the outputs grow by the new tokens a step, so a penalized request's step
        costs O(its new tokens) here, not O(prompt + output) of Python lists. replace_output (a beam taking
        another's history) makes a new list: then the tensor is built anew."""
        if self._prompt_distinct is None:
            self._prompt_distinct = torch.tensor(self.prompt_token_ids, dtype=torch.long).unique()
        tokens = self.output_token_ids
        if self._outputs is None or self._outputs[0] is not tokens or len(self._outputs[1]) > len(tokens):
            self._outputs = (tokens, torch.tensor(tokens, dtype=torch.long))
        elif len(self._outputs[1]) < len(tokens):
            done = self._outputs[1]
            self._outputs = (tokens, torch.cat([done, torch.tensor(tokens[len(done):], dtype=torch.long)]))
        return self._prompt_distinct, self._outputs[1]

    draft_q = None  # a row checking a draft model's proposal: the draft's distribution (see ProposalRow)


class ProposalRow:
    """The sampler's view of one position of a request checking proposals: the request as if the proposals before
    this position were already its output, so that penalties, min_tokens and logprobs see that history. Its
    generator is the request's: the rows of a step draw from it in order, so a seed gives the same run again.
    A row checking a draft model's proposal carries it (`draft_token`) and the distribution the draft drew it
    from (`draft_q`, None for a greedy request or an n-gram proposal), for the sampler's rejection sampling."""

    __slots__ = ("state", "proposed", "draft_q", "draft_token")

    def __init__(self, state: RequestState, proposed: list[int], draft_q=None, draft_token: int | None = None):
        self.state = state
        self.proposed = proposed
        self.draft_q = draft_q
        self.draft_token = draft_token

    @property
    def output_token_ids(self) -> list[int]:  # built only when read (penalties): not every row of every step
        return self.state.output_token_ids + self.proposed

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def generator(self):
        return self.state.generator

    @property
    def num_output_tokens(self) -> int:
        return len(self.state.output_token_ids) + len(self.proposed)

    def penalty_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        prompt, outputs = self.state.penalty_tokens()
        return prompt, torch.cat([outputs, torch.tensor(self.proposed, dtype=torch.long)]) if self.proposed else outputs
