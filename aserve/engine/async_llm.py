"""AsyncLLM: the engine core behind an asyncio API, for servers and async applications.

The core runs in its own thread and steps while work exists; the event loop only tokenizes (in an
executor), enqueues commands and moves outputs. One background task takes each step's outputs and
merges them into per-request collectors: a single slot each, so a slow consumer holds one merged output
instead of a growing queue. A consumer that goes away aborts its request, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from aserve.config import EngineConfig
from aserve.engine.engine_core import EngineCore
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams

log = logging.getLogger("aserve")


class EngineDeadError(RuntimeError):
    """The engine core stopped with an error; no request can be served until the process restarts."""


class RequestCollector:
    """One request's pending output: deltas merge into a single slot until the consumer takes it."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._output is None:
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


class CoreThread:
    """Runs EngineCore.step in a loop on its own thread; other threads talk to it through commands."""

    def __init__(self, core: EngineCore, on_outputs: Callable[[list[RequestOutput]], None],
                 on_error: Callable[[BaseException], None]):
        self.core = core
        self.on_outputs = on_outputs
        self.on_error = on_error
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="aserve-engine-core", daemon=True)
        self.thread.start()

    def call(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        """Run fn(*args) on the core thread between steps; its result (or exception) lands in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(EngineDeadError(f"the engine core died: {self.error!r}"))
        else:
            self.commands.put((fn, args, kwargs, future))
        return future

    def stop(self) -> None:
        self._stopping = True
        self.commands.put(None)

    def _run_command(self, command) -> None:
        fn, args, kwargs, future = command
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # the caller's error (a bad request), not the core's
            future.set_exception(exc)

    def _run(self) -> None:
        try:
            while not self._stopping:
                idle = not self.core.has_unfinished()
                try:
                    command = self.commands.get(timeout=0.5) if idle else self.commands.get_nowait()
                    while command is not None:
                        self._run_command(command)
                        command = self.commands.get_nowait()
                except queue.Empty:
                    pass
                if self.core.has_unfinished() and not self._stopping:
                    outputs = self.core.step()
                    if outputs:
                        self.on_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - anything that kills the loop kills the engine
            self.error = exc
            log.exception("the engine core died")
            self.on_error(exc)
        finally:
            while True:  # nobody will run what is still queued
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None:
                    command[3].set_exception(EngineDeadError("the engine has stopped"))


class AsyncLLM:
    """`AsyncLLM(model=None, **options)`: options are those of EngineConfig (and LLM)."""

    def __init__(self, model: str | None = None, **options):
        self.config = EngineConfig.from_kwargs(model, **options)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self._collectors: dict[str, RequestCollector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._output_task: asyncio.Task | None = None
        self._thread: CoreThread | None = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aserve-tokenizer")
        self.dead_error: BaseException | None = None

    # -- life cycle -------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._output_task = self._loop.create_task(self._move_outputs(), name="aserve-outputs")
        self._thread = CoreThread(self.core, self._from_core, self._core_died)

    def _from_core(self, outputs: list[RequestOutput]) -> None:  # on the core thread
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)

    def _core_died(self, exc: BaseException) -> None:  # on the core thread
        self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _fail_all(self, exc: BaseException) -> None:
        self.dead_error = exc
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"the engine core died: {exc!r}"))

    async def _move_outputs(self) -> None:
        while True:
            for output in await self._outputs.get():
                collector = self._collectors.get(output.request_id)
                if collector is not None:
                    collector.put(output)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and (self._thread is None or self._thread.thread.is_alive())

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._thread.thread.join, 10)
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

    async def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, await self.run_in_tokenizer_pool(self.tokenizer.encode, prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids or a dict with 'prompt' or "
                         "'prompt_token_ids'")

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, output_kind: str = "delta") -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: by default each carries only what is new since the last one."""
        self._ensure_started()
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core died: {self.dead_error!r}")
        params = sampling_params or SamplingParams()
        text, ids = await self._prompt(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.core.validate(ids, params)  # reads only fixed facts of the engine: safe off the core thread
        collector = self._collectors[request_id] = RequestCollector()
        finished = False
        try:
            await asyncio.wrap_future(self._thread.call(
                self.core.add_request, ids, params, request_id=request_id, prompt=text, priority=priority,
                output_kind=output_kind))
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self._collectors.pop(request_id, None)
            if not finished and self.dead_error is None and self._thread is not None:
                self._thread.call(self.core.abort, [request_id])  # the consumer left: free its blocks

    async def infer(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> RequestOutput:
        """Run one request to the end and return its finished output."""
        final = None
        async with aclosing(self.generate(prompt, sampling_params, request_id, priority, "final")) as stream:
            async for final in stream:
                pass
        return final

    async def abort(self, request_id: str) -> None:
        self._ensure_started()
        outputs = await asyncio.wrap_future(self._thread.call(self.core.abort, [request_id]))
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    async def call_in_core(self, fn: Callable, *args) -> Any:
        """Run fn on the core thread between steps (for state inspection that must not race a step)."""
        self._ensure_started()
        return await asyncio.wrap_future(self._thread.call(fn, *args))

    async def state(self) -> dict:
        """Free and used blocks, scheduler queues and live requests: what tests check to prove idleness."""
        def read():
            core = self.core
            return {"num_blocks": core.kv.num_blocks, "num_free_blocks": core.kv.num_free_blocks,
                    "num_running": len(core.scheduler.running), "num_waiting": len(core.scheduler.waiting),
                    "num_live_requests": core.num_unfinished}
        state = await self.call_in_core(read)
        state["num_collectors"] = len(self._collectors)
        return state
