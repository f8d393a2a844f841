"""AsyncLLM: the engine core behind an asyncio API, for servers and async applications.

The core runs in its own process (see core_process.py for why not a thread) and steps while work exists;
the event loop only admits requests (once each, tokenizing in an executor), sends commands and moves
outputs. One background task takes each step's outputs and merges them into per-request collectors: a
single slot each, so a slow consumer holds one merged output instead of a growing queue. A consumer that
goes away aborts its request, which frees its blocks. With `data_parallel_size` N the core is N processes,
one per replica, and replicas.py routes each request to one of them; the rest of this file does not know
how many there are.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from aserve.config import EngineConfig
from aserve.engine.core_process import CoreProcess
from aserve.errors import (EngineDeadError, InvalidRequestError, ReplicaDeadError,  # noqa: F401 - re-exported
                                  RequestFailedError, RequestTimeoutError)
from aserve.engine.messages import Abort, AddRequest, GetState
from aserve.engine.replicas import ReplicaSet
from aserve.inputs import Admitted, Prompt, admit_prompts, parse_prompt, parse_prompts
from aserve.lora.request import LoRARequest
from aserve.metrics.loggers import StatLoggers
from aserve.models.loader import load_tokenizer
from aserve.outputs import PoolingRequestOutput, RequestOutput
from aserve.pooling.params import PoolingParams
from aserve.request import RequestStatus
from aserve.sampling_params import BeamSearchParams, SamplingParams
from aserve.worker.host_memory import rss_bytes

log = logging.getLogger("aserve")


class RequestCollector:
    """One request's pending output: deltas merge into a single slot until the consumer takes it
    (cumulative and final outputs simply replace what is there). The core's outputs come without the prompt
    (OutputProcessor.carries_prompts): the collector puts back the one the request was sent with."""

    def __init__(self, merge: bool = True, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self._merge = merge
        self._prompt, self._prompt_token_ids = prompt, prompt_token_ids
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if output.prompt_token_ids is None:
            output.prompt, output.prompt_token_ids = self._prompt, self._prompt_token_ids
        if self._output is None or not self._merge:
            self._output = output
        else:
            self._output.merge(output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._output is None and self._error is not None:
            raise self._error
        output, self._output = self._output, None
        return output


class RequestStream:
    """An admitted request's outputs as an async iterator. Closing it before the end aborts the request
    and frees its blocks; the engine forgets it either way."""

    def __init__(self, engine: "AsyncLLM", request_id: str, collector: RequestCollector, timeout: float | None,
                 arrival: float | None = None):
        self.engine = engine
        self.request_id = request_id
        self._collector = collector
        start = time.monotonic() if arrival is None else arrival  # the timeout covers queueing and admission too
        self._deadline = start + timeout if timeout is not None else None
        self._timeout = timeout
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            if self._deadline is None:
                output = await self._collector.get()
            else:
                output = await asyncio.wait_for(self._collector.get(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.close()
            raise self.timeout_error() from None
        except BaseException:
            self.close()
            raise
        if isinstance(output, PoolingRequestOutput):
            aborted = output.error == RequestStatus.FINISHED_ABORTED.value
            error = output.error if output.outputs.data is None and not aborted else None
        else:
            error = next((o.error for o in output.outputs if o.finish_reason == "error"), None)
        if error is not None:
            self.close()
            raise RequestFailedError(f"generation failed: {error}")
        if output.finished:
            self.finished = True
            self.engine._collectors.pop(self.request_id, None)
        return output

    def remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"the request did not finish within its timeout of {self._timeout:g} s "
                                   f"and was aborted")

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        engine = self.engine
        engine._collectors.pop(self.request_id, None)
        if engine.dead_error is None:
            engine.replicas.call(Abort(request_ids=[self.request_id]))  # the consumer left: free its blocks


class AsyncLLM:
    """`AsyncLLM(model=None, **options)`: options are those of EngineConfig (and LLM)."""

    def __init__(self, model: str | None = None, **options):
        self.config = EngineConfig.from_kwargs(model, **options)
        self.config.verify()  # a wrong policy or model folder fails here, not after the core loads weights
        # The tokenizer (transformers' import is most of its ~3 s) loads while the core process loads weights.
        loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aserve-tokenizer-load")
        tokenizer = loading.submit(load_tokenizer, self.config.tokenizer or self.config.model)
        loading.shutdown(wait=False)
        self._collectors: dict[str, RequestCollector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._output_task: asyncio.Task | None = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aserve-tokenizer")
        self.dead_error: BaseException | None = None
        self.on_death: list[Callable[[BaseException], None]] = []  # called on the event loop when the core dies
        try:  # one engine-core process per data-parallel replica (one by default)
            self.replicas = ReplicaSet(self.config, CoreProcess, self._from_core, self._core_died, self._record_stats,
                                   self._replica_died)
        finally:
            concurrent.futures.wait([tokenizer])
        try:
            self.tokenizer = tokenizer.result()
        except BaseException:
            self.replicas.stop()
            raise
        self.facts = self.replicas.facts
        self.stats = StatLoggers(self.config.model_name, self.facts, self.facts.policy_name,
                                 self.facts.priority_classes, log_stats=self.config.disable_log_stats is not True,
                                 num_replicas=self.replicas.size)
        for replica in self.replicas.dead:  # died while the others loaded
            self.stats.replica_died(replica)

    def _record_stats(self, stats, replica: int = 0) -> None:  # on a reader thread; the collectors are thread-safe
        self.stats.record(stats, replica)

    def get_metrics(self) -> list[tuple[str, dict, float]]:
        """The Prometheus samples /metrics exports: (name, labels, value) for each."""
        return self.stats.prometheus.samples()

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    # -- life cycle -------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._output_task = self._loop.create_task(self._move_outputs(), name="aserve-outputs")

    def _from_core(self, outputs: list[RequestOutput]) -> None:  # on the reader thread
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)

    def _core_died(self, exc: BaseException) -> None:  # on the reader thread
        self.dead_error = exc
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, exc)

    def _replica_died(self, replica: int, exc: BaseException, lost: list[str], remaining: int) -> None:
        """One replica's core died (on its reader thread). While others remain, only its requests fail; the
        last one's death is the engine's (`_core_died`, exactly as with a single core)."""
        stats = getattr(self, "stats", None)  # absent while the replicas are still loading
        if stats is not None:
            stats.replica_died(replica)
        if remaining == 0:
            return
        log.error("engine replica %d died (%s): %d request(s) in flight on it failed; %d replica(s) serve on",
                  replica, exc, len(lost), remaining)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            error = ReplicaDeadError(f"engine replica {replica} died while serving this request ({exc}); "
                                     f"{remaining} replica(s) still serve, so a retry can succeed")
            loop.call_soon_threadsafe(self._fail_requests, lost, error)

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.fail(error)

    @property
    def dead_replicas(self) -> dict[int, str]:
        """Data-parallel replicas that died while others serve on (index -> why); empty when all are up."""
        return self.replicas.dead

    def _fail_all(self, exc: BaseException) -> None:
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"the engine core died: {exc}"))
        for callback in self.on_death:
            callback(exc)

    def start(self) -> None:
        """Bind to the running event loop now (a server does this at start-up, so a core that dies before
        the first request is still noticed)."""
        self._ensure_started()
        if self.dead_error is not None:
            self._loop.call_soon(self._fail_all, self.dead_error)

    async def _move_outputs(self) -> None:
        while True:
            for output in await self._outputs.get():
                collector = self._collectors.get(output.request_id)
                if collector is not None:
                    collector.put(output)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.replicas.is_alive()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.replicas.stop)
        if self._output_task is not None:
            self._output_task.cancel()
        for collector in self._collectors.values():
            collector.fail(EngineDeadError("the engine was shut down"))
        self._tokenizer_pool.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # -- requests ---------------------------------------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    async def run_in_tokenizer_pool(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def admit(self, prompts, sampling_params: SamplingParams | None = None,
                    constraint_field: str = "structured_outputs", keep_last: int | None = None) -> list[Admitted]:
        """The front end's one admission of one prompt or a batch (any form aserve.inputs accepts): parse,
        tokenize, validate, check the output constraint (its error names `constraint_field`). Raises
        InvalidRequestError before anything is queued, so a server can answer 400 before a stream starts;
        submit, generate and infer take each Admitted as it is. `keep_last`: pooling's truncate_prompt_tokens."""
        return await self._admit(parse_prompts(prompts), sampling_params or SamplingParams(), constraint_field,
                                 keep_last)

    async def _admit(self, prompts: list[Prompt], params: SamplingParams,
                     constraint_field: str = "structured_outputs", keep_last: int | None = None) -> list[Admitted]:
        args = (self.facts, prompts, params, self.tokenizer.encode, constraint_field, keep_last)
        if params.structured_outputs is None and all(prompt.token_ids is not None for prompt in prompts):
            return admit_prompts(*args)  # token ids alone are quick to validate
        # Text to encode or a schema to parse may take a while: the whole batch goes off the loop in one hop.
        return await self.run_in_tokenizer_pool(admit_prompts, *args)

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter folder against the served model (off the event loop), raising
        InvalidRequestError with a one-line reason for one it cannot serve; the core checks again at admission."""
        from aserve.lora import adapter

        if self.facts.lora is None:
            raise InvalidRequestError("this engine was started without enable_lora", "lora_request")
        await self.run_in_tokenizer_pool(adapter.inspect, lora_request, self.facts.lora)

    async def submit(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                     priority: int = 0, output_kind: str = "delta", timeout: float | None = None,
                     lora_request: LoRARequest | None = None,
                     pooling_params: PoolingParams | None = None) -> "RequestStream":
        """Hand one request to the core; return its stream once the core has accepted it. `prompt` is an
        Admitted (from admit(), with its own params: pass none here) or a raw prompt, which is admitted first.
        `lora_request`: the adapter it runs under (None: the base model).

        Refusals (bad input: ValueError; a full waiting queue: EngineOverloadedError) surface here, before any
        output, so a server can answer them with a status code. The caller must iterate or close the stream.
        """
        self._ensure_started()
        arrival = time.monotonic()  # CLOCK_MONOTONIC is system-wide: the core's process reads the same clock
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self.dead_error}")
        if isinstance(prompt, Admitted):
            if sampling_params is not None and sampling_params is not prompt.params:
                raise TypeError("an Admitted prompt carries the sampling params it was admitted under; "
                                "pass sampling_params=None with it")
        else:
            [prompt] = await self._admit([parse_prompt(prompt)], sampling_params or SamplingParams())
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        collector = self._collectors[request_id] = RequestCollector(output_kind == "delta", prompt.text,
                                                                    prompt.token_ids)
        stream = RequestStream(self, request_id, collector, timeout, arrival)
        accepted = self.replicas.call(AddRequest(prompt_token_ids=prompt.token_ids, params=prompt.params,
                                                 request_id=request_id, prompt=prompt.text, priority=priority,
                                                 arrival_time=arrival, output_kind=output_kind,
                                                 lora_request=lora_request, pooling_params=pooling_params))
        try:  # the timeout holds while the core is busy admitting too (its abort follows the add in order)
            await asyncio.wait_for(asyncio.wrap_future(accepted), stream.remaining())
        except asyncio.TimeoutError:
            stream.close()
            raise stream.timeout_error() from None
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, output_kind: str = "delta", timeout: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (`prompt`: raw or Admitted, as for submit): by default each carries
        only what is new since the last one."""
        stream = await self.submit(prompt, sampling_params, request_id, priority, output_kind, timeout, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def beam_search(self, prompt, request_id: str | None, params: BeamSearchParams,
                          lora_request: LoRARequest | None = None, priority: int = 0,
                          timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        """A beam search (vLLM's call): yields one final RequestOutput with the beam_width hypotheses, best first.
        It runs in the core as one request whose beams share their blocks (core/beam_search.py)."""
        async with aclosing(self.generate(prompt, params.sampling_params(), request_id, priority, "final", timeout,
                                          lora_request)) as stream:
            async for final in stream:
                yield final

    async def infer(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, timeout: float | None = None,
                    lora_request: LoRARequest | None = None) -> RequestOutput:
        """Run one request (`prompt`: raw or Admitted, as for submit) to the end and return its finished output."""
        final = None
        async with aclosing(self.generate(prompt, sampling_params, request_id, priority, "final", timeout,
                                          lora_request)) as stream:
            async for final in stream:
                pass
        return final

    async def encode(self, prompt, pooling_params: PoolingParams | None = None, request_id: str | None = None,
                     priority: int = 0, timeout: float | None = None) -> PoolingRequestOutput:
        """Pool one prompt (raw or Admitted) on an engine started with runner="pooling": its embedding (task
        "embed", the default) or its raw pooled hidden state ("encode") in `.outputs.data`."""
        stream = await self.submit(prompt, None if isinstance(prompt, Admitted) else SamplingParams(max_tokens=1),
                                   request_id, priority, "final", timeout,
                                   pooling_params=pooling_params or PoolingParams())
        final = None
        try:
            async for final in stream:
                pass
        finally:
            stream.close()
        return final

    async def abort(self, request_id: str) -> None:
        self._ensure_started()
        for output in await asyncio.wrap_future(self.replicas.call(Abort(request_ids=[request_id]))):
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    async def state(self, diagnostics: bool = False) -> dict:
        """Free and used blocks, scheduler queues and live requests: what tests check to prove idleness.
        `diagnostics` adds the core's heap and Python object counts (see EngineCore.state)."""
        state = await asyncio.wrap_future(self.replicas.call(GetState(diagnostics=diagnostics)))
        state["num_collectors"] = len(self._collectors)  # live request objects on this side of the core
        state["server_rss_bytes"] = rss_bytes()
        return state
