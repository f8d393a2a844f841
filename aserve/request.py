"""Request: one sequence's life in the engine (a prompt with n > 1 becomes n of these)."""
from __future__ import annotations

import enum
import time

from aserve.lora.request import ResolvedLoRA
from aserve.pooling.params import PoolingParams
from aserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request failed (NaN logits, a detokenizer error); the others go on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


class TokenSequence:
    """A prompt and the tokens generated after it: what the scheduler's Request and the worker's RequestState
    both count and extend."""

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)

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

    def replace_output(self, token_ids: list[int]) -> None:
        """Take another history after the prompt (a beam continuing another beam's)."""
        self.output_token_ids = list(token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids


class Request(TokenSequence):
    """Token state, cache state and timestamps of one sequence.

    `num_computed_tokens` counts tokens whose K/V sit in the cache; the scheduler schedules the
    tokens after it, and a step that reaches the end of `all_token_ids` samples the next token.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, group_id: str | None = None, index: int = 0, priority: int = 0,
                 arrival_time: float | None = None, max_tokens: int = 16,
                 lora: ResolvedLoRA | None = None, pooling: PoolingParams | None = None):
        super().__init__(prompt_token_ids)
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.lora = lora  # the adapter it runs under (None: the base model)
        self.pooling = pooling  # a pooling request: its prompt is pooled into one vector, nothing is generated
        self.pooled = None  # that vector (a float32 tensor), once its last prompt chunk ran
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks, in order
        self.num_cached_blocks = 0  # how many leading blocks are indexed in the prefix cache
        self.host_block_table: list[int] = []  # where its K/V sit while it is swapped out
        self.prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # for prompt tokens 1..n-1
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it ended with FINISHED_ERROR
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
        self.grammar = None  # its structured-output matcher (structured_output.grammar.RequestGrammar), if any
        # n > 1: samples after the first wait for the first one's prefill, then share its blocks.
        self.fork_parent: Request | None = None
        self.pending_forks: list[Request] = []
        self.sent_blocks: list[int] | None = None  # the block table as the worker last heard it (None: never sent)
        # Beam search: the search this sequence is a beam of (core/beam_search.py). Its first beam is the request
        # the scheduler and the policy see; the others ride along with it.
        self.beam = None
        self.tokens_replaced = False  # a beam search's step gave it another history, not yet sent to the worker
        self.spec_token_ids: list[int] = []  # speculative decoding: tokens proposed to follow it, checked next step
        now = time.monotonic()
        self.arrival_time = arrival_time if arrival_time is not None else now
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prev_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def sequences(self) -> list["Request"]:
        """What this request runs as in a step: itself, or a beam search's live beams (its own first)."""
        return self.beam.beams if self.beam is not None else [self]

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
