"""Scheduler: the mechanism of continuous batching; the policy makes its decisions.

Each step hands a token budget first to running requests (a decode token or the next prefill chunk),
then to waiting ones, so prefill and decode mix in one batch. When blocks run out it asks the policy
whom to preempt. There are no prefill or decode phases: a request is simply behind by some tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from aserve.core.kv_cache_manager import KVCacheManager
from aserve.policy import KVView, Policy, PreemptionMode
from aserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens), batch order
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block pairs, before the forward
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # since start
    prefix_queries: int = 0
    prefix_hits: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: Policy, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting = policy.waiting_queue()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- requests in and out ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request wherever it is and give back its blocks (and those of samples not yet forked)."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        self.policy.on_event(req, "finished")

    def kv_view(self) -> KVView:
        return KVView(self.kv.num_free_blocks, self.kv.num_blocks, 0, 0, self.kv.block_size)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions,
                              self.kv.prefix_queries, self.kv.prefix_hits)

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[Request, int] = {}
        budget = self.max_num_batched_tokens

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.policy.select_victim(self.running, req) or req
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req] = num_new
                budget -= num_new

        if not out.preempted:
            while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek()
                computed, num_computed = self.kv.find_computed(req)
                num_new = min(req.num_tokens - num_computed, budget)
                if not self.kv.allocate_slots(req, num_new, computed, num_computed):
                    break
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                if req.scheduled_time is None:
                    req.scheduled_time = time.monotonic()
                self.running.append(req)
                scheduled[req] = num_new
                budget -= num_new
                self.policy.on_event(req, "admitted")

        out.scheduled = list(scheduled.items())
        out.copies = self.kv.take_copies()
        return out

    def _preempt(self, victim: Request) -> None:
        mode = self.policy.preemption_mode(victim, self.kv_view())
        if mode != PreemptionMode.RECOMPUTE:
            raise NotImplementedError(f"preemption mode {mode} is not supported by this engine yet")
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        self.policy.on_event(victim, "preempted")

    def update(self, out: SchedulerOutput, sampled: dict[Request, int]) -> list[Request]:
        """Advance computed tokens, append sampled ones, and finish requests that hit a stop condition."""
        finished = []
        now = time.monotonic()
        for req, num_new in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += num_new
            self.kv.cache_full_blocks(req)
            token = sampled.get(req)
            if token is None:
                continue
            req.append_token(token)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if req.pending_forks:  # its prompt is in the cache now: the other samples can share it
                for child in reversed(req.pending_forks):
                    self.waiting.prepend(child)
                req.pending_forks = []
            status = self._stop_status(req, token)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
