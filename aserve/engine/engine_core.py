"""EngineCore: schedule -> execute -> update -> outputs, one step at a time.

The offline LLM drives it synchronously in the caller's process; the online AsyncLLM runs it in a process of
its own (engine/core_process.py) and talks to it in typed messages. Nothing about scheduling or the model is
written twice.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque

import torch

from aserve.config import DEFAULT_MODEL_DIR, EngineConfig
from aserve.core.beam_search import BeamSearch
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.scheduler import Scheduler, SchedulerOutput
from aserve.errors import ConfigError, EngineOverloadedError, InvalidRequestError
from aserve.engine.output_processor import OutputProcessor
from aserve.hardware import cpu_info, resolve_device
from aserve.inputs import EngineFacts, validate_request
from aserve.lora import adapter
from aserve.lora.request import LoRAFacts, LoRARequest, ResolvedLoRA
from aserve.metrics.stats import FinishedRequestStats, IterationStats
from aserve.models.loader import load_tokenizer
from aserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from aserve.pooling.params import PoolingParams, PoolingSpec, check_params, read_spec
from aserve.policy import load_policy
from aserve.request import Request, RequestStatus
from aserve.sampling_params import BeamSearchParams, SamplingParams
from aserve.spec_decode.config import SpeculativeConfig
from aserve.spec_decode.draft import DraftProposals
from aserve.spec_decode.ngram import NgramProposer
from aserve.structured_output.manager import StructuredOutputManager
from aserve.worker.host_memory import memory_diagnostics, rss_bytes
from aserve.worker.executor import make_executor

log = logging.getLogger("aserve")
GRAMMAR_WAIT_S = 0.05  # an engine with only constrained prompts waiting blocks this long on their grammars


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        t0 = time.monotonic()
        self.executor = make_executor(config)
        info = self.executor.info
        self.model_config = info.model_config
        self.dtype = getattr(torch, info.dtype)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.vocab_size = info.vocab_size
        self.max_model_len = config.max_model_len or info.max_position_embeddings
        eos = set(info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                                 info.num_host_blocks)
        self.policy = load_policy(config.policy, config.policy_options)
        self.pooling_spec = (read_spec(config.model or DEFAULT_MODEL_DIR, info.model_config)
                             if config.resolved_runner == "pooling" else None)  # None: the generate runner
        budget = config.token_budget(resolve_device(config.device), encoder=not info.causal)
        if not info.causal and budget < self.max_model_len:
            self.executor.shutdown()
            raise ConfigError(f"{info.model_class} is an encoder: each prompt runs whole in one step, so "
                              f"max_num_batched_tokens ({budget}) must be at least max_model_len "
                              f"({self.max_model_len}); raise the one or lower the other")
        self.scheduler = Scheduler(self.kv, self.policy, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=budget, max_model_len=self.max_model_len,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   pooling_kind=self.pooling_spec.kind if self.pooling_spec else None,
                                   chunk_prompts=info.causal, num_scheduler_steps=config.num_scheduler_steps)
        self.lora_facts = (LoRAFacts(info.lora_targets, info.num_layers, config.max_lora_rank)
                           if config.enable_lora else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = None
        if self.speculative and self.speculative.method == "draft_model":
            self.proposer = DraftProposals()
        elif self.speculative:
            self.proposer = NgramProposer(self.speculative.num_speculative_tokens, self.speculative.prompt_lookup_min,
                                          self.speculative.prompt_lookup_max)
        if self.speculative:
            log.info("speculative decoding: %s", self.speculative.describe())
        self._stats = IterationStats()
        self.pipeline_depth = config.pipeline_parallel_size  # batches in flight at most (step)
        self._in_flight: deque[tuple[SchedulerOutput, list]] = deque()  # submitted, output not yet collected
        self.requests: dict[str, list[Request]] = {}  # group id -> its samples
        tokens = info.num_blocks * config.block_size
        log.info("dtype %s (%s); %s", info.dtype, info.dtype_reason, cpu_info().describe())
        self.kv_cache_dtype = info.kv_cache_dtype
        log.info("loaded %s (%s, %s, attention %s) in %.1fs; KV cache (%s): %d blocks of %d tokens = %d tokens, "
                 "max concurrency %.2fx at max_model_len %d; host swap pool: %d blocks; policy %s", config.model,
                 info.model_class, info.dtype, info.attention_backend, time.monotonic() - t0, info.kv_cache_dtype,
                 info.num_blocks, config.block_size, tokens, tokens / self.max_model_len,
                 self.max_model_len, info.num_host_blocks, self.policy.name)

    @property
    def runner(self):
        """The in-process worker's model runner (its model and KV cache), for tests and tools."""
        return self.executor.worker.runner

    # -- requests ---------------------------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts(self.vocab_size, self.max_model_len, self.kv.num_blocks, self.kv.block_size,
                           self.eos_token_ids, self.kv.num_host_blocks, self.policy.name,
                           bool(getattr(self.policy, "priority_classes", False)), self.config.max_n,
                           self.kv_cache_dtype, self.lora_facts, self.pooling_spec,
                           min(self.config.max_n, self.config.max_num_seqs, self.scheduler.max_num_batched_tokens))

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams | None = None, *,
                    request_id: str | None = None, prompt: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, output_kind: str = "cumulative",
                    lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None) -> str:
        pooling = self.check_pooling(pooling_params)
        params = params or SamplingParams()
        if isinstance(params, BeamSearchParams):  # one request whose beams the engine picks (core/beam_search.py)
            params = params.sampling_params()
        if params.beam is not None:
            output_kind = "final"  # a beam search's answer is known only when it ends
        if pooling is not None:  # one forward pass over the prompt, nothing sampled
            params = SamplingParams(max_tokens=1)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = validate_request(self.facts, prompt_token_ids, params)  # the authoritative check, for direct users
        lora = self.resolve_lora(lora_request)
        limit = self.config.max_waiting_requests
        num_waiting = len(self.scheduler.waiting) + self.structured.num_awaiting
        if limit is not None and num_waiting >= limit:
            raise EngineOverloadedError(f"{num_waiting} requests are already waiting "
                                        f"(max_waiting_requests={limit}); retry later")
        params = params.clone(eos_token_ids=self.eos_token_ids)
        samples = []
        for i in range(params.n):
            child_params = params if params.seed is None or i == 0 else params.clone(seed=params.seed + i)
            samples.append(Request(request_id if params.n == 1 else f"{request_id}-{i}", prompt_token_ids,
                                   child_params, group_id=request_id, index=i, priority=priority,
                                   arrival_time=arrival_time, max_tokens=max_tokens, lora=lora, pooling=pooling))
        first = samples[0]
        for child in samples[1:]:
            child.fork_parent = first
        first.pending_forks = samples[1:]
        if params.beam is not None:
            skip = params.skip_special_tokens
            BeamSearch(first, params.beam, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip))
            self._stats.beam_requests += 1
        self.requests[request_id] = samples
        self.outputs.add_group(request_id, prompt, prompt_token_ids, samples, output_kind)
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled (see step)
            self.structured.add(request_id, samples, params.structured_outputs)
            self._stats.structured_requests.append(params.structured_outputs.kind)
        else:
            self.scheduler.add_request(first)
        return request_id

    def check_pooling(self, pooling_params: PoolingParams | None) -> PoolingParams | None:
        """A pooling request on the pooling runner, a generation request on the generate runner: the other way
        round is this request's error, naming the runner."""
        if self.pooling_spec is None:
            if pooling_params is not None:
                raise InvalidRequestError(f"{self.config.model_name} runs the generate runner: it pools nothing "
                                          f"(start it with runner='pooling' for embeddings)", "model")
            return None
        if pooling_params is None:
            raise InvalidRequestError(f"{self.config.model_name} runs the pooling runner: it generates nothing "
                                      f"(use embed, encode, classify or score)", "model")
        try:
            check_params(pooling_params, self.pooling_spec, self.config.model_name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "dimensions" if str(exc).startswith("dimensions=") else "model") from None
        return pooling_params

    def resolve_lora(self, lora_request: LoRARequest | None) -> ResolvedLoRA | None:
        """Read and check the request's adapter once, here (a refusal is this request's error); None: the base."""
        if lora_request is None:
            return None
        if not self.config.enable_lora:
            raise InvalidRequestError("lora_request given, but this engine was started without enable_lora",
                                      "lora_request")
        return adapter.inspect(lora_request, self.lora_facts)

    def abort(self, request_ids) -> list[RequestOutput]:
        """Stop requests wherever they are and free their blocks; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for request_id in request_ids:
            samples = self.requests.get(request_id)
            if samples is None:
                continue
            self.structured.discard(request_id)
            for req in samples:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            finals.append(self._finish_group(request_id))
        self._release_finished()
        return finals

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._in_flight)  # a batch of aborted requests still comes back

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output, in each request's output kind, for each prompt that advanced.

        With pipeline parallelism the engine keeps up to pipeline_parallel_size batches in flight (vLLM's batch
        queue): it schedules more, from the requests not in a batch already in the pipeline, until the pipeline
        is full or nothing else can run, then waits for the oldest batch's output."""
        results = self._admit_constrained() if self.structured.num_awaiting else []
        if self.pipeline_depth == 1:
            sched = self._schedule_batch()
            results += self._failed_by_scheduler()
            if not sched:
                return results
            return results + self._finish_batch(sched, self.executor.execute(sched), self.scheduler.scheduled)
        while len(self._in_flight) < self.pipeline_depth:
            scheduler = self.scheduler
            waiting = len(scheduler.running) + len(scheduler.waiting) + len(scheduler.swapped)
            sched = self._schedule_batch(max(1, -(-waiting // self.pipeline_depth)))  # a share for each stage
            if not sched:
                break
            self.executor.submit(sched)
            self._in_flight.append((sched, self.scheduler.scheduled))
            self.scheduler.in_flight.update(seq for seq, _ in self.scheduler.scheduled)
        results += self._failed_by_scheduler()
        if not self._in_flight:
            return results
        while True:
            sched, scheduled = self._in_flight[0]
            ran = self.executor.collect()  # raises once the pipeline is broken, and again at every later step
            self._in_flight.popleft()
            self.scheduler.in_flight.difference_update(seq for seq, _ in scheduled)
            results += self._finish_batch(sched, ran, scheduled)
            if self.requests or not self._in_flight:  # an idle engine has nothing in the pipeline
                self._release_finished()
                return results

    def _schedule_batch(self, batch_requests: int | None = None) -> SchedulerOutput:
        """The next batch, with its grammar masks and proposals; empty when nothing can run."""
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule(batch_requests)
        if not sched:
            return sched
        sched.structured_request_ids, sched.grammar_bitmask = self.structured.bitmask(self.scheduler.scheduled,
                                                                                      sched.spec_token_ids)
        if isinstance(self.proposer, DraftProposals) and self._speculating():
            sched.draft_request_ids = [req.request_id for req, _ in self.scheduler.scheduled if _may_speculate(req)]
        return sched

    def _finish_batch(self, sched: SchedulerOutput, ran, scheduled: list) -> list[RequestOutput]:
        """Fold a batch's output (`ran`) into its requests (`scheduled`): tokens, stops, outputs."""
        results = []
        self.scheduler.scheduled = scheduled  # update() reads the batch it advances
        if isinstance(self.proposer, DraftProposals):
            self.proposer.take(ran.drafts)
        by_id = {req.request_id: req for req, _ in scheduled}
        for request_id, entries in ran.prompt_logprobs.items():
            by_id[request_id].prompt_logprobs.extend(entries)
        sampled = {by_id[request_id]: result for request_id, result in ran.sampled.items()}
        for req, result in sampled.items():
            if result.error is not None:  # before update(), so no token is appended and its blocks go back now
                self._fail(req, result.error)
        tokens = {req.request_id: result.token_ids for req, result in sampled.items()
                  if result.error is None and req.beam is None}
        before = {req: req.num_output_tokens for req, result in sampled.items() if result.accepted is not None}
        candidates = {req.request_id: result.top_logprobs for req, result in sampled.items()
                      if result.error is None and req.beam is not None}
        for request_id, vector in ran.pooled.items():
            by_id[request_id].pooled = vector
        self.scheduler.update(tokens, frozenset(ran.pooled), candidates)
        stats = self._stats
        stats.num_steps += 1
        stats.iteration_tokens.append(sched.num_batched_tokens)
        touched: dict[str, None] = {by_id[request_id].group_id: None for request_id in ran.pooled}  # advanced
        for req, result in sampled.items():
            if req.status == RequestStatus.FINISHED_ABORTED:
                continue
            touched[req.group_id] = None
            if result.error is not None:
                continue
            if req.beam is not None:  # each beam decoded a token; which one its search chose is not per beam
                if req is req.beam.first:
                    stats.record_token(req)
                else:
                    stats.generation_tokens += 1
                continue
            stats.record_token(req)
            try:
                stop = (self._on_tokens(req, result, before[req], sched.spec_token_ids.get(req.request_id))
                        if req in before else self.outputs.on_token(req, result))
            except Exception as exc:  # noqa: BLE001 - this request's text is lost, not the engine
                self._fail(req, f"could not detokenize its output: {type(exc).__name__}: {exc}")
                continue
            if stop is not None:  # the scheduler decides, also when this token ended the request by length
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            if req.grammar is not None:
                self._follow_grammar(req)
        for group_id in touched:
            if all(r.is_finished for r in self.requests[group_id]):
                results.append(self._finish_group(group_id))
            else:
                output = self.outputs.make_output(group_id)
                if output is not None:
                    results.append(output)
        self._release_finished()
        return results

    def _propose(self) -> None:
        """Speculative decoding: proposals for the running requests that will sample next step (none once
        disable_by_batch_size requests are running). A request proposes no more tokens than it may still add."""
        running = self.scheduler.running
        asks = []
        speculating = self._speculating()
        for req in running:
            req.spec_token_ids = []
            if not speculating or not _may_speculate(req):
                continue
            most = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if most > 0 and req.num_computed_tokens == req.num_tokens - 1:
                asks.append((req.request_id, req.all_token_ids, most))
        if not asks:
            return
        found = self.proposer.propose(asks)
        for req in running:
            spec = found.get(req.request_id)
            if spec and req.grammar is not None:  # never a token its grammar refuses, nor past its end
                spec = self.structured.check_proposals(req, spec)
            if spec:
                req.spec_token_ids = spec

    def _speculating(self) -> bool:
        """Whether this step speculates: not once disable_by_batch_size requests are running."""
        off = self.speculative.disable_by_batch_size
        return not off or len(self.scheduler.running) < off

    def _on_tokens(self, req: Request, result, before: int, proposed: list[int] | None) -> str | None:
        """The tokens a request that checked proposals kept, or a multi-step batch's (`proposed` None), through the
        output processor one by one (the scheduler appended them, up to a stop token): at a stop string the rest
        are cut off."""
        appended = req.num_output_tokens - before
        stats = self._stats
        stats.generation_tokens += appended - 1  # record_token counted one
        if proposed is not None:
            stats.record_proposals(len(proposed), len(result.accepted))
        for i, step in enumerate([*result.accepted, result][:appended]):
            stop = self.outputs.on_token(req, step)
            if stop is not None:
                if i + 1 < appended:
                    req.replace_output(req.output_token_ids[:before + i + 1])
                return stop
        return None

    def _admit_constrained(self) -> list[RequestOutput]:
        """Queue the constrained prompts whose grammar is compiled; end those whose grammar failed."""
        if not self.scheduler.has_unfinished():  # nothing else to run: wait on the compile thread, not spin
            self.structured.wait(GRAMMAR_WAIT_S)
        finals = []
        for samples, error in self.structured.take_ready():
            if error is None:
                self.scheduler.add_request(samples[0])
                continue
            for sample in samples:
                self.scheduler.finish(sample, RequestStatus.FINISHED_ERROR, error=error)
            finals.append(self._finish_group(samples[0].group_id))
        return finals

    def _follow_grammar(self, req: Request) -> None:
        """Advance the sample's matcher by its new token; a grammar that has ended ends the request ("stop")."""
        if not self.structured.advance(req):
            if not req.is_finished:  # the bitmask allows only what the grammar does: this is a bug, not input
                self._fail(req, "its grammar rejected a sampled token")
        elif req.grammar.terminated:  # the scheduler decides, also when this token ended it by length
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def _release_finished(self) -> None:
        """Once nothing is left to schedule, tell the worker at once which requests it can forget (otherwise
        the next step's batch carries them)."""
        if not self.scheduler.has_unfinished() and not self._in_flight:  # else they go with the next batch
            ids = self.scheduler.take_finished_ids()
            if ids:
                self.executor.execute(SchedulerOutput(finished_ids=ids))

    def _fail(self, req: Request, message: str) -> None:
        """End one request (and the samples still waiting to fork from it) with an error; the batch goes on."""
        log.warning("request %s failed: %s", req.request_id, message)
        if req.beam is not None:  # a beam fails its whole search
            req = req.beam.first
        for sample in [req, *req.pending_forks]:
            self.scheduler.finish(sample, RequestStatus.FINISHED_ERROR, error=message)
        req.pending_forks = []

    def _failed_by_scheduler(self) -> list[RequestOutput]:
        """The final outputs of requests that the scheduler ended with an error while making a batch."""
        finals = []
        for req in self.scheduler.take_failed():
            log.warning("request %s failed: %s", req.request_id, req.error)
            finals.append(self._finish_group(req.group_id))
        return finals

    def _finish_group(self, group_id: str) -> RequestOutput | PoolingRequestOutput:
        first = self.requests[group_id][0]
        output = (self.outputs.beam_output(group_id, first.beam) if first.beam is not None
                  else self.outputs.make_output(group_id))
        if first.pooling is not None:
            output = pooling_output(output, first, self.pooling_spec)
        self.outputs.release(group_id)
        del self.requests[group_id]
        return output

    def take_stats(self) -> IterationStats:
        """What happened since the last call, with a fresh snapshot of the scheduler (for the loggers)."""
        stats, self._stats = self._stats, IterationStats()
        stats.finished = [FinishedRequestStats.of(r) for r in self.scheduler.finished_since_stats]
        stats.grammar_compile_seconds = self.structured.take_compile_seconds()
        self.scheduler.finished_since_stats = []
        stats.scheduler = self.scheduler.stats()
        return stats

    def state(self, diagnostics: bool = False) -> dict:
        """Free and used blocks, scheduler queues and live requests: what proves an idle engine is clean. Only
        counters the engine keeps as it runs, so polling it between steps costs next to nothing. `diagnostics`
        adds the process's heap and Python object counts, which take tens of ms to measure: they are cached
        (host_memory.memory_diagnostics) and `core_diagnostics_age_s` says how old they are."""
        kv, scheduler = self.kv, self.scheduler
        state = {"num_blocks": kv.num_blocks, "num_free_blocks": kv.num_free_blocks,
                 "num_host_blocks": kv.num_host_blocks, "num_free_host_blocks": kv.num_free_host_blocks,
                 "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                 "num_swapped": len(scheduler.swapped), "num_live_requests": len(self.requests),
                 "core_rss_bytes": rss_bytes(),
                 "dtype": str(self.dtype).replace("torch.", ""), "kv_cache_dtype": self.kv_cache_dtype,
                 "hardware": cpu_info().describe(),
                 "speculative": self.speculative.describe() if self.speculative else None}
        if diagnostics:
            measured = memory_diagnostics()
            state.update(core_heap_bytes=measured.heap_bytes, core_python_objects=measured.python_objects,
                         core_diagnostics_age_s=round(measured.age_s, 3))
        return state

    def check_idle(self) -> None:
        """Assert the state every test wants after traffic ends: nothing live, every block free."""
        if self.requests or self.scheduler.has_unfinished() or self.structured.num_awaiting:
            raise AssertionError(f"live requests remain: {list(self.requests)[:8]}")
        held = self.executor.live_request_ids()
        if held:
            raise AssertionError(f"the worker still holds requests: {held[:8]}")
        self.kv.check_all_free()


def pooling_output(output: RequestOutput, req: Request, spec: PoolingSpec) -> PoolingRequestOutput:
    """A finished pooling request's answer: the embedding (its first `dimensions` features, L2-normalized as
    asked or as the folder says) for task "embed", the raw pooled hidden state (a classifier's logits) for
    "encode", the labels' probabilities for "classify" (softmax; sigmoid for one label), the activated score
    for "score"."""
    vector, params = req.pooled, req.pooling
    if vector is not None and params.task == "embed":
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        if params.normalize if params.normalize is not None else spec.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
    elif vector is not None and params.task == "classify":
        vector = vector.sigmoid() if len(vector) == 1 else vector.softmax(-1)
    elif vector is not None and params.task == "score" and spec.score_activation == "sigmoid":
        vector = vector.sigmoid()
    error = None if vector is not None else (req.error or req.status.value)
    return PoolingRequestOutput(output.request_id, output.prompt, output.prompt_token_ids, PoolingOutput(vector),
                                True, output.num_cached_tokens, error)


def _may_speculate(req: Request) -> bool:
    """Whether proposals can be checked for the request: not a beam (the engine picks its tokens)."""
    return req.beam is None and req.pooling is None
