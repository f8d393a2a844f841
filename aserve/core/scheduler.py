"""Scheduler: the mechanism of continuous batching; the policy makes its decisions.

Each step hands a token budget first to running requests (a decode token or the next prefill chunk),
then to swapped-out ones (copied back before anyone new is admitted), then to waiting ones, so prefill
and decode mix in one batch. When blocks run out it asks the policy whom to preempt and how (recompute
or swap, falling back to recompute when the host pool is full), and lets the policy displace a running
request for a more urgent waiting one. There are no prefill or decode phases: a request is simply
behind by some tokens.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from aserve.core.beam_search import BeamSearch
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.lora.request import ResolvedLoRA
from aserve.policy import KVView, Policy, PreemptionMode
from aserve.request import Request, RequestStatus
from aserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen: everything it needs to keep its own state for it."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    lora: ResolvedLoRA | None = None  # the adapter it runs under
    pooling: str | None = None  # a pooling request: how it pools (pooling.params.POOLING_KINDS)
    output_token_ids: list[int] = field(default_factory=list)  # a beam made mid-search: the history it continues


@dataclass
class CachedRequestData:
    """A request the worker already holds: what changed since the step it last ran in."""
    request_id: str
    num_computed_tokens: int
    new_block_ids: list[int]  # blocks appended to its table, or the whole table when `replace_blocks`
    replace_blocks: bool = False  # the table changed other than by appending (recompute, swap-in, copy-on-write)
    # Its output tokens, whole, when the engine rather than the worker's sampler chose them (a beam search's step:
    # a beam may go on from another's history); None: unchanged but for what the worker sampled itself.
    output_token_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    """One step for the worker, as plain data: no Request objects cross this line, so the worker can live in
    another process. Sampled tokens are appended by the worker itself (it sampled them)."""
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: list[tuple[str, int]] = field(default_factory=list)  # (request id, new tokens), batch order
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block pairs, before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), copied first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), copied next
    blocks_to_zero: list[int] = field(default_factory=list)  # newly allocated blocks, zeroed after swap-out (see KVCacheManager)
    finished_ids: list[str] = field(default_factory=list)  # requests the worker can forget
    # Structured output: the constrained requests that sample this step, in row order, and their rows of allowed
    # tokens as raw bytes: int32 words, a bit per token of the tokenizer (see structured_output.manager).
    structured_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes = b""
    # Speculative decoding: the proposals each request checks this step, scheduled after its own next token (the
    # last of its num_scheduled_tokens are these).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # With a draft model: the requests it follows this step (catching up on their tokens, proposing for those that
    # sample), set by the engine.
    draft_request_ids: list[str] = field(default_factory=list)
    # Multi-step decoding: the decode steps the worker runs in a row, each step's tokens the next one's input. Every
    # request then decodes, and its num_scheduled_tokens count the steps' tokens (their slots are allocated).
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.num_scheduled_tokens)

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens or self.swap_out or self.finished_ids)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    host_cache_usage: float = 0.0
    preemptions: dict[str, int] = field(default_factory=dict)  # by mode, since start
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V were dropped by recompute preemption
    prefix_queries: int = 0
    prefix_hits: int = 0
    max_loras: int = 0  # with LoRA on: the most adapters in one step
    running_loras: tuple[str, ...] = ()  # the adapters (by name) of running and waiting requests
    waiting_loras: tuple[str, ...] = ()


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


Plan = list[tuple[Request, int]]  # a request's sequences (itself, or its beams) and their new tokens this step


def plan_tokens(plan: Plan | None) -> int:
    return sum(n for _, n in plan) if plan else 0


class StepBatch(dict):
    """A step's requests -> their plans, counting the distinct adapters among them as requests come and go
    (victims leave mid-schedule), so that the multi-LoRA rule costs O(1) a request, not a walk of the batch."""

    def __init__(self, adapter_limit: int | None):
        super().__init__()
        self.adapter_limit = adapter_limit
        self.adapters: Counter = Counter()  # adapter identity -> requests of it in the step

    def __setitem__(self, req: Request, plan: Plan) -> None:
        if req not in self and req.lora is not None:
            self.adapters[req.lora.identity] += 1
        super().__setitem__(req, plan)

    def pop(self, req: Request, default=None):
        if req in self and req.lora is not None:
            self.adapters[req.lora.identity] -= 1
            if not self.adapters[req.lora.identity]:
                del self.adapters[req.lora.identity]
        return super().pop(req, default)

    def fits(self, req: Request) -> bool:
        """The rule of multi-LoRA steps: at most `adapter_limit` distinct adapters (the worker's device slots). A
        request of the base model, or of an adapter already in the step, always fits."""
        if self.adapter_limit is None or req.lora is None:
            return True
        return req.lora.identity in self.adapters or len(self.adapters) < self.adapter_limit


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: Policy, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, max_loras: int | None = None,
                 pooling_kind: str | None = None, chunk_prompts: bool = True, num_scheduler_steps: int = 1):
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_loras = max_loras  # distinct adapters in one step (None: LoRA is off)
        policy.max_loras = max_loras  # the constraint, where a policy can see it
        self.pooling_kind = pooling_kind  # the pooling runner: how every request pools (None: generation)
        # False for an encoder model: a prompt is admitted only when all of it fits this step's budget (its
        # tokens attend to the ones after them, so it cannot be split across steps)
        self.chunk_prompts = chunk_prompts
        self.num_scheduler_steps = num_scheduler_steps  # the most decode steps one batch runs (_decode_steps)
        self.waiting = policy.waiting_queue()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # in the order they were swapped out
        self.failed: list[Request] = []  # ended by the scheduler itself, for the engine to report (take_failed)
        self.preemptions = {mode.value: 0 for mode in PreemptionMode}
        self.blocks_swapped_out = self.blocks_swapped_in = self.recomputed_tokens = 0
        self.finished_since_stats: list[Request] = []  # drained by the engine's stats hand-out
        self.scheduled: list[tuple[Request, int]] = []  # the last step's batch, for update()
        # Pipeline parallelism: the sequences of batches still in the pipeline. They keep their blocks and are
        # neither scheduled again nor preempted until their batch's output is back (the engine's batch queue).
        self.in_flight: set[Request] = set()
        self._finished_ids: list[str] = []  # ended since the last step, for the worker to forget
        self._ended_by_update: set[Request] = set()  # the requests the last update() ended (see finish)

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    # -- requests in and out ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.swapped) or len(self.waiting) > 0

    def finish(self, req: Request, status: RequestStatus, *, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """End a request wherever it is and give back its blocks (and those of samples not yet forked).

        The one place a request's end is decided: nothing else sets its status. A request ends once, with one
        exception: a stop reported for the token that this step's update() ended the request on (a stop string
        it completed, a grammar it terminated) outranks length, and a stop string names the reason."""
        if req.is_finished:
            if status == RequestStatus.FINISHED_STOPPED and req in self._ended_by_update:
                req.status = status
                if stop_reason is not None:
                    req.stop_reason = stop_reason
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            for seq in req.sequences:
                self.kv.free_host(seq)
        elif req in self.waiting:
            self.waiting.remove(req)
        for seq in req.sequences:
            self._forget(seq)
        req.status = status
        req.stop_reason, req.error = stop_reason, error
        req.finished_time = time.monotonic()
        self.finished_since_stats.append(req)
        self.policy.on_event(req, "finished")

    def _forget(self, seq: Request) -> None:
        """Give back a sequence's blocks and tell the worker to drop it."""
        self.kv.free(seq)
        if seq.sent_blocks is not None:
            self._finished_ids.append(seq.request_id)
            seq.sent_blocks = None

    def kv_view(self) -> KVView:
        kv = self.kv
        return KVView(kv.num_free_blocks, kv.num_blocks, kv.num_free_host_blocks, kv.num_host_blocks, kv.block_size)

    def stats(self) -> SchedulerStats:
        kv = self.kv
        host_usage = 1.0 - kv.num_free_host_blocks / kv.num_host_blocks if kv.num_host_blocks else 0.0
        return SchedulerStats(len(self.running), len(self.waiting), len(self.swapped), kv.usage, host_usage,
                              dict(self.preemptions), self.blocks_swapped_out, self.blocks_swapped_in,
                              self.recomputed_tokens, kv.prefix_queries, kv.prefix_hits, self.max_loras or 0,
                              _adapter_names(self.running) if self.max_loras else (),
                              _adapter_names(list(self.waiting) + self.swapped) if self.max_loras else ())

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self, batch_requests: int | None = None) -> SchedulerOutput:
        """The next batch. `batch_requests`: the most requests in it (pipeline parallelism splits the running
        requests into as many batches as there are stages, so that they can be in flight together)."""
        out = SchedulerOutput()
        preempted: list[Request] = []
        scheduled = StepBatch(self.max_loras)
        budget = self.max_num_batched_tokens
        full = batch_requests if batch_requests is not None else float("inf")
        out.num_steps = steps = self._decode_steps(batch_requests)

        in_flight = self.in_flight
        for req in list(self.running):
            if budget <= 0 or len(scheduled) >= full:
                break
            if req.status != RequestStatus.RUNNING or not scheduled.fits(req) or req in in_flight:  # a victim
                continue  # earlier in this loop, or its adapter would be one too many this step (it keeps its
                # blocks and waits a step), or its last batch is still in the pipeline
            plan = self._plan(req, budget) if steps == 1 else [(req, steps)]
            if plan is None:  # beams that cannot all run their last tokens this step
                continue
            while not self.kv.allocate_all(_entries(plan)):
                victim = self.policy.select_victim(self._movable(), req) or req
                budget += plan_tokens(scheduled.pop(victim))
                self._preempt(victim, out, preempted)
                if victim is req:
                    break
            else:
                scheduled[req] = plan
                budget -= plan_tokens(plan)

        while (self.swapped and not preempted and budget > 0 and len(scheduled) < full
               and self._room_for(self.swapped[0])):
            req = self.swapped[0]
            plan = self._plan(req, budget)
            if plan is None or not self.kv.can_swap_in(plan) or not scheduled.fits(req):
                break
            self.swapped.pop(0)
            pairs = self.kv.swap_in(req.sequences)
            out.swap_in.extend(pairs)
            self.blocks_swapped_in += len(pairs)
            if not self.kv.allocate_all(_entries(plan)):
                raise RuntimeError("a swapped-in request found no room it was promised")
            self._run(req, plan, scheduled, "swapped_in")
            budget -= plan_tokens(plan)

        if not preempted and not self.swapped:  # swapped requests come back before anyone new
            skipped: list[Request] = []  # their adapter is one too many this step; the others keep their order
            while len(self.waiting) and budget > 0 and len(scheduled) < full:
                req = self.waiting.peek()
                if not scheduled.fits(req):
                    skipped.append(self.waiting.pop())
                    continue
                if self._room_for(req):
                    found = [self.kv.find_computed(seq) for seq in req.sequences]
                    plan = self._plan(req, budget, [num for _, num in found])
                    if plan is None:
                        break
                    if not self.chunk_prompts and plan[0][1] < req.num_tokens - found[0][1]:
                        break  # the whole prompt next step
                    if self.kv.allocate_all(_entries(plan, found)):
                        self.waiting.pop()
                        if req.num_cached_tokens is None:  # for usage.prompt_tokens_details
                            req.num_cached_tokens = found[0][1]
                        self._run(req, plan, scheduled, "admitted")
                        budget -= plan_tokens(plan)
                        continue
                if out.swap_in:  # no preemption after a swap-in: the worker copies a step's swap-outs first, so a
                    break  # victim's would read device blocks not yet filled, or overwrite host blocks still to be read
                victim = self.policy.should_preempt_for(req, self._movable())
                if victim is None or victim is req or victim not in self.running or victim in in_flight:
                    break
                budget += plan_tokens(scheduled.pop(victim))
                self._preempt(victim, out, preempted)
            for req in reversed(skipped):
                self.waiting.prepend(req)

        self.scheduled = [(seq, n) for plan in scheduled.values() for seq, n in plan if n]
        out.copies = self.kv.take_copies()
        out.blocks_to_zero = self.kv.take_fresh()
        self._diff_for_worker(out)
        return out

    def _decode_steps(self, batch_requests: int | None) -> int:
        """Multi-step decoding: how many decode steps the next batch runs (1: one, as usual). More only while every
        running request decodes a token of its own and nothing else (not a prompt's last token, which is the prefill
        kernel's: see backend.batch_order; no grammar to follow, beams to compare, prompt to pool or proposals to
        check), none waits to be admitted or swapped in (it would wait out the steps), and the batch fits the token
        budget that many times; never past a request's max_tokens or max_model_len, so that only a stop token or
        string can leave a step's tokens unused."""
        steps = self.num_scheduler_steps
        running = self.running
        if (steps == 1 or not running or batch_requests is not None or len(self.waiting) or self.swapped
                or self.in_flight):
            return 1
        steps = min(steps, self.max_num_batched_tokens // len(running))
        for req in running:
            if (req.num_tokens - req.num_computed_tokens != 1 or req.num_computed_tokens < req.num_prompt_tokens
                    or req.beam is not None or req.grammar is not None or req.pooling is not None
                    or req.spec_token_ids):
                return 1
            steps = min(steps, req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return max(steps, 1)

    def _movable(self) -> list[Request]:
        """The running requests a policy may preempt: not those whose batch is still in the pipeline."""
        return [r for r in self.running if r not in self.in_flight] if self.in_flight else self.running

    def _room_for(self, req: Request) -> bool:
        """Whether `req` fits within max_num_seqs beside the running requests, counted in sequences: a beam
        search counts as its beam_width from the start (it widens to that after its prompt)."""
        return sum(map(_width, self.running)) + _width(req) <= self.max_num_seqs

    @staticmethod
    def _plan(req: Request, budget: int, num_computed: list[int] | None = None) -> Plan | None:
        """How many tokens each of the request's sequences runs this step, within `budget` (`num_computed`: what
        the prefix cache holds for each, on admission). One sequence runs what is left of it, up to the budget.
        A beam search's beams are compared with each other after every step, so they reach their last tokens
        in the same step: when the budget cannot take all of them there (catching up after recompute), each holds
        its last token back; None when not one token of them fits."""
        seqs = req.sequences
        done = num_computed or [seq.num_computed_tokens for seq in seqs]
        left = [seq.num_tokens - n for seq, n in zip(seqs, done)]
        if len(seqs) == 1:
            if left[0] == 1 and req.spec_token_ids:  # its proposals ride along, as far as the budget goes
                return [(req, min(1 + len(req.spec_token_ids), budget))]
            return [(req, min(left[0], budget))]
        if sum(left) <= budget:
            return list(zip(seqs, left))
        share = budget // len(seqs)
        plan = [(seq, min(n - 1, share)) for seq, n in zip(seqs, left)]
        return plan if plan_tokens(plan) else None

    def _diff_for_worker(self, out: SchedulerOutput) -> None:
        """The batch as the worker needs it: new requests in full, the others as what changed."""
        out.finished_ids, self._finished_ids = self._finished_ids, []
        for req, num_new in self.scheduled:
            out.num_scheduled_tokens.append((req.request_id, num_new))
            num_spec = _num_spec(req, num_new)
            if num_spec and out.num_steps == 1:  # (a multi-step batch's further tokens are its own, to come)
                out.spec_token_ids[req.request_id] = req.spec_token_ids[:num_spec]
            table, sent = req.block_table, req.sent_blocks
            history = None
            if req.tokens_replaced:  # a beam search's step chose its tokens
                history, req.tokens_replaced = list(req.output_token_ids), False
            if sent is None:
                req.sent_blocks = list(table)
                out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.params, list(table),
                                                       req.num_computed_tokens, req.lora,
                                                       self.pooling_kind if req.pooling is not None else None,
                                                       history or []))
            elif len(table) >= len(sent) and table[:len(sent)] == sent:
                new_ids = table[len(sent):]
                sent.extend(new_ids)
                out.cached_requests.append(CachedRequestData(req.request_id, req.num_computed_tokens, new_ids,
                                                             output_token_ids=history))
            else:
                req.sent_blocks = list(table)
                out.cached_requests.append(CachedRequestData(req.request_id, req.num_computed_tokens, list(table),
                                                             replace_blocks=True, output_token_ids=history))

    def take_finished_ids(self) -> list[str]:
        """Requests that ended since the last step, for an engine that tells the worker outside a step."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _run(self, req: Request, plan: Plan, scheduled: StepBatch, event: str) -> None:
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        self.running.append(req)
        scheduled[req] = plan
        self.policy.on_event(req, event)

    def _preempt(self, victim: Request, out: SchedulerOutput, preempted: list[Request]) -> None:
        """Swap the victim out if the policy asks and the host pool has room; else drop its K/V to recompute. A
        beam search whose beams could not come back by recompute is swapped whatever the policy asks (see
        _recompute_fits), with room made in the host pool if it is full (_make_host_room); where even that
        cannot be done it ends with an error rather than wait forever."""
        mode = self.policy.preemption_mode(victim, self.kv_view())
        must_swap = not self._recompute_fits(victim)
        if must_swap:
            mode = PreemptionMode.SWAP
            self._make_host_room(victim, preempted)
            if not self.kv.can_swap_out(victim.sequences):
                self._fail_unmovable(victim)
                return
        self.running.remove(victim)
        victim.num_preemptions += 1
        victim.spec_token_ids = []
        preempted.append(victim)
        if mode == PreemptionMode.SWAP and self.kv.can_swap_out(victim.sequences):
            pairs = self.kv.swap_out(victim.sequences)
            out.swap_out.extend(pairs)
            self.blocks_swapped_out += len(pairs)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.preemptions[PreemptionMode.SWAP.value] += 1
            self.policy.on_event(victim, "swapped")
            return
        for seq in victim.sequences:
            self.recomputed_tokens += seq.num_computed_tokens
            self.kv.free(seq)
        victim.status = RequestStatus.PREEMPTED
        self.waiting.prepend(victim)
        self.preemptions[PreemptionMode.RECOMPUTE.value] += 1
        self.policy.on_event(victim, "preempted")

    def _make_host_room(self, search: Request, preempted: list[Request]) -> None:
        """Room in the host pool for a search that can only be swapped: swapped requests that can come back by
        recompute give theirs up (the most recently swapped first, not those swapped this very step, whose
        copies are still to be made) and wait to be recomputed, in front of those never admitted."""
        for req in reversed(list(self.swapped)):
            if self.kv.can_swap_out(search.sequences):
                return
            if req in preempted or not self._recompute_fits(req):
                continue
            self.swapped.remove(req)
            for seq in req.sequences:
                self.recomputed_tokens += seq.num_computed_tokens
                self.kv.free_host(seq)
                self.kv.free(seq)
            req.status = RequestStatus.PREEMPTED
            self.waiting.prepend(req)
            self.policy.on_event(req, "preempted")

    def _fail_unmovable(self, search: Request) -> None:
        """A search that can neither be swapped (the host pool is held by other searches that cannot be recomputed
        either, or by requests swapped out this same step) nor recomputed (its beams, each with its own prompt, need
        more than the cache) ends with an error: waiting, it would hold up everyone behind it for good. The engine
        reports it (take_failed)."""
        host = self.kv.num_host_blocks
        self.finish(search, RequestStatus.FINISHED_ERROR,
                    error=f"preempted with no room to keep its {len(search.sequences)} beams: the host swap pool "
                          f"({host} blocks) has no room for them, and recomputed each beam would need "
                          f"its own copy of the prompt, more than the KV cache's {self.kv.num_blocks} blocks; "
                          f"raise swap_space or kv_cache_memory")
        self.failed.append(search)

    def take_failed(self) -> list[Request]:
        """Requests that the scheduler itself ended with an error since the last call (see _fail_unmovable)."""
        failed, self.failed = self.failed, []
        return failed

    def _recompute_fits(self, req: Request) -> bool:
        """Whether the request, recomputed, fits the whole cache up to its last token. A beam search's beams share
        their prompt's blocks while they run; recomputed, each takes its own unless the prefix cache still holds
        them, and a search that needs more than the cache has would wait forever with every block free (and hold
        up everyone behind it)."""
        seqs = req.sequences
        return len(seqs) == 1 or (sum(self.kv.blocks_needed(seq.num_prompt_tokens + seq.max_tokens) for seq in seqs)
                                  <= self.kv.num_blocks)

    def update(self, sampled: dict[str, int | list[int]], pooled: frozenset[str] = frozenset(),
               candidates: dict[str, list[tuple[int, float]]] | None = None) -> list[Request]:
        """After the last step ran: advance computed tokens, append sampled ones (by request id), and finish
        requests that hit a stop condition, and pooling requests whose prompt is pooled (`pooled`, by id).
        A request that checked proposals brings a list: the proposals the worker accepted, then its own token;
        the K/V of the accepted ones count as computed, the blocks that hold only rejected ones go back. A
        multi-step batch's request brings its steps' tokens the same way (fewer where a row's logits failed).
        `candidates`: beam-search rows' best next tokens (by id); a search steps once all its beams brought them."""
        finished = []
        self._ended_by_update = set()
        now = time.monotonic()
        searches: dict[BeamSearch, dict[Request, list[tuple[int, float]]]] = {}
        for req, num_new in self.scheduled:
            if (req.beam.first if req.beam is not None else req).status != RequestStatus.RUNNING:
                continue
            num_spec = _num_spec(req, num_new)
            req.num_computed_tokens += num_new - num_spec
            if not num_spec:
                self.kv.cache_full_blocks(req)
            if req.request_id in pooled:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
                continue
            if req.beam is not None:
                if candidates and req.request_id in candidates:
                    searches.setdefault(req.beam, {})[req] = candidates[req.request_id]
                continue
            token = sampled.get(req.request_id)
            if token is None:
                if num_spec:
                    self.kv.trim(req)
                continue
            tokens = [token] if isinstance(token, int) else token
            if num_spec:  # the accepted proposals' K/V are computed, now that they are its tokens
                req.num_computed_tokens += len(tokens) - 1
            _stamp(req, now)
            if req.pending_forks:  # its prompt is in the cache now: the other samples can share it
                for child in reversed(req.pending_forks):
                    self.waiting.prepend(child)
                req.pending_forks = []
            for token in tokens:
                req.append_token(token)
                status, reason = self._stop_status(req, token)
                if status is not None:  # tokens after this one are dropped
                    self.finish(req, status, stop_reason=reason)
                    finished.append(req)
                    break
            else:
                if num_spec:
                    self.kv.cache_full_blocks(req)
                    self.kv.trim(req)
        for search, found in searches.items():
            if len(found) == len(search.beams) and self._advance_beams(search, found, now):
                finished.append(search.first)
        self._ended_by_update.update(finished)
        return finished

    def _advance_beams(self, search: BeamSearch, found: dict[Request, list[tuple[int, float]]], now: float) -> bool:
        """One step of a beam search: the search picks the next beams; each takes the history and the blocks of the
        beam it continues (beams no candidate continues give theirs back). True when the search ended."""
        moves = search.step(found)
        first = search.first
        _stamp(first, now)
        if search.done:
            best = search.hypotheses[0] if search.hypotheses else None
            status = (RequestStatus.FINISHED_STOPPED if best is not None and best.finish_reason == "stop"
                      else RequestStatus.FINISHED_LENGTH)
            self.finish(first, status, stop_reason=best.stop_reason if best is not None else None)
            return True
        histories = [parent.output_token_ids + [token] for parent, token in moves]
        seqs = search.beams[:len(moves)]
        self.kv.adopt(seqs, [parent for parent, _ in moves])
        for seq, history, grammar in zip(seqs, histories, search.next_grammars):
            seq.replace_output(history)
            seq.tokens_replaced = True
            seq.grammar = grammar
        for seq in search.drop_beams(len(moves)):
            self._forget(seq)
        return False

    def _stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """How the token just appended ends the request, if it does, and the stop token that did it."""
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None


def _entries(plan: Plan, found: list[tuple[list[int], int]] | None = None) -> list:
    """allocate_all's entries for a plan: each sequence with new tokens, or prefix-cache blocks to take over."""
    found = found or [((), 0)] * len(plan)
    return [(seq, n, blocks, num) for (seq, n), (blocks, num) in zip(plan, found) if n or blocks]


def _num_spec(req: Request, num_new: int) -> int:
    """How many of a request's scheduled tokens are proposals, or a multi-step batch's tokens still to be sampled:
    those past its own tokens (before update)."""
    return max(0, num_new - (req.num_tokens - req.num_computed_tokens))


def _width(req: Request) -> int:
    """The sequences a request runs as at most: its beam_width for a beam search, else 1."""
    return req.beam.params.beam_width if req.beam is not None else 1


def _stamp(req: Request, now: float) -> None:
    """A token came for the request: its timestamps, for the latency metrics."""
    if req.first_token_time is None:
        req.first_token_time = now
    req.prev_token_time, req.last_token_time = req.last_token_time, now
