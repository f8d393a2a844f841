"""Stats the engine core hands out: a snapshot of the scheduler plus what happened since the last hand-out.

They are plain data, so they cross from the core's process to the front end's loggers with the outputs.
Latencies come from each request's own timestamps, not from the HTTP layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from aserve.core.scheduler import SchedulerStats
from aserve.request import Request


@dataclass
class FinishedRequestStats:
    finish_reason: str
    priority: int
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    prompt_tokens: int
    generation_tokens: int
    lora_name: str | None = None  # the adapter it ran under

    @classmethod
    def of(cls, req: Request) -> "FinishedRequestStats":
        end = req.finished_time or time.monotonic()
        scheduled = req.scheduled_time or end
        first = req.first_token_time or end
        return cls(req.status.value, req.priority, end - req.arrival_time, scheduled - req.arrival_time,
                   first - scheduled, end - first, req.num_prompt_tokens, req.num_output_tokens,
                   req.lora.name if req.lora is not None else None)


@dataclass
class IterationStats:
    """What happened in the steps (and aborts) since the last hand-out."""
    scheduler: SchedulerStats | None = None
    num_steps: int = 0
    iteration_tokens: list[int] = field(default_factory=list)  # tokens batched per step
    prompt_tokens: int = 0  # prompts of requests that produced their first token
    generation_tokens: int = 0
    time_to_first_token: list[tuple[int, float]] = field(default_factory=list)  # (priority, seconds)
    inter_token_latency: list[tuple[int, float]] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    structured_requests: list[str] = field(default_factory=list)  # the structured-output kind of each new one
    grammar_compile_seconds: list[float] = field(default_factory=list)
    beam_requests: int = 0  # beam-search requests admitted
    # speculative decoding: requests that checked proposals, the proposals, those accepted, and how often each
    # position (0 = the first proposal) was accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_steps or self.finished or self.structured_requests or self.grammar_compile_seconds
                    or self.beam_requests)

    def record_proposals(self, proposed: int, accepted: int) -> None:
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_per_pos) < accepted:
            self.spec_accepted_per_pos.extend([0] * (accepted - len(self.spec_accepted_per_pos)))
        for position in range(accepted):
            self.spec_accepted_per_pos[position] += 1

    def record_token(self, req: Request) -> None:
        """Account for the token a request just sampled (its timestamps are already updated)."""
        self.generation_tokens += 1
        if req.num_output_tokens == 1:
            self.prompt_tokens += req.num_prompt_tokens
            self.time_to_first_token.append((req.priority, req.first_token_time - req.arrival_time))
        elif req.prev_token_time is not None:
            self.inter_token_latency.append((req.priority, req.last_token_time - req.prev_token_time))
