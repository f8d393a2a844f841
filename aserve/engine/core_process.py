"""The engine core in a child process, so the model's Python never shares a GIL with the event loop.

Measured on the 2-core machine (64 x 128/128, bench model): an engine-core thread beside the event loop
kept ~85-90% of offline throughput, a process ~97%; the difference is the GIL convoy between the loop
and the core's op dispatch. The child is started with `python -m aserve.engine.core_child FD` (not
multiprocessing), so user scripts without a `__main__` guard are never re-imported.

The messages over the socket pair (multiprocessing Connection framing) are the typed structs of
messages.py: Start, then AddRequest | Abort | GetState | Shutdown one way; Ready | Failed, then
StepOutputs, Result | Error and Died the other.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable

import msgspec

from aserve.errors import EngineDeadError, RemoteError
from aserve.engine.messages import (Call, Died, Error, Failed, Kind, Ready, Result, Shutdown, Start,
                                    StepOutputs)

log = logging.getLogger("aserve")
# Calls answered between two steps at most: enough to admit a full batch of new requests (max_num_seqs' default)
# at once, and a bound, so the step after them always comes.
MAX_CALLS_PER_STEP = 256
IDLE_WAIT_S = 0.5  # an idle core waits this long for a call before it looks at its (empty) queues again


def complete(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Complete a call's future unless it is done already: its caller gave up (a cancelled await cancels it),
    or another thread won. Checking done() first would not do: a caller can cancel between the check and the
    set, and the InvalidStateError would then end the thread that completes everyone's calls."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


_early: list[tuple[subprocess.Popen, Connection]] = []  # children start_early began, not yet taken
_early_lock = threading.Lock()  # data-parallel replicas take theirs from several threads


def _spawn() -> tuple[subprocess.Popen, Connection]:
    parent_sock, child_sock = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "aserve.engine.core_child", str(child_sock.fileno())],
                            pass_fds=[child_sock.fileno()])
    child_sock.close()
    return proc, Connection(parent_sock.detach())


def start_child() -> tuple[subprocess.Popen, Connection]:
    """An engine-core child process and the parent's end of its socket: one that start_early began, while any is
    left, else a new one."""
    with _early_lock:
        if _early:
            return _early.pop(0)
    return _spawn()


def start_early(count: int) -> None:
    """Start `count` engine-core children now. A child imports torch and the engine (seconds on a slow CPU) before
    it waits for its Start; the server calls this before importing its own modules (torch, transformers,
    starlette), so the two processes import side by side instead of one after the other. Children still unused
    when this process exits are stopped."""
    with _early_lock:
        _early.extend(_spawn() for _ in range(count))


def _stop_unused() -> None:
    with _early_lock:
        unused = _early[:]
        _early.clear()
    for proc, conn in unused:
        conn.close()
        proc.kill()
        proc.wait()


atexit.register(_stop_unused)


class CoreProcess:
    """Parent side: starts the child, sends commands, and hands its outputs to `on_outputs` (on a reader thread)."""

    def __init__(self, config, on_outputs: Callable[[list], None], on_death: Callable[[BaseException], None],
                 on_stats: Callable[[object], None]):
        self.on_outputs = on_outputs
        self.on_stats = on_stats
        self.on_death = on_death
        if config.data_parallel_backend == "ray":  # a replica placed on the Ray cluster (engine.ray_replica)
            from aserve.engine.ray_replica import start_core

            self.proc, self.conn = start_core(config, serve_core)
        else:
            self.proc, self.conn = start_child()
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._stopping = False  # set by stop(): the end of the connection is then expected, not a death
        self.conn.send(Start(config))
        try:
            first: Ready | Failed = self.conn.recv()
        except EOFError:
            self.proc.wait()
            raise EngineDeadError(f"the engine process exited during start-up (status {self.proc.returncode})")
        if first.kind is Kind.FAILED:
            self.proc.wait()
            raise first.error.rebuild()
        self.facts = first.facts
        self._reader = threading.Thread(target=self._read, name="aserve-core-reader", daemon=True)
        self._reader.start()

    def call(self, message: Call) -> concurrent.futures.Future:
        """Send a call (AddRequest, Abort, GetState); its future completes with the core's answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:  # the reader fails the pending calls under this lock: none can slip in after
            if self.error is not None:
                future.set_exception(EngineDeadError(f"the engine core died: {self.error}"))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
            try:
                self.conn.send(msgspec.structs.replace(message, call_id=call_id))
            except OSError as exc:
                self._calls.pop(call_id, None)
                future.set_exception(EngineDeadError(f"the engine core is gone: {exc}"))
        return future

    def _read(self) -> None:
        """The reader thread: hands on outputs and answers until the connection ends. However it ends, the
        engine is then dead to us: every pending call fails and on_death runs (the server answers 503 and exits 1),
        so nothing hangs on a core that no one listens to any more."""
        try:
            self._dispatch()
        except (EOFError, OSError):
            error = EngineDeadError(f"the engine process ended (status {self.proc.poll()})")
        except EngineDeadError as exc:  # the core said it died
            error = exc
        except BaseException as exc:  # noqa: BLE001 - a bug on this thread must not leave callers waiting forever
            error = EngineDeadError(f"the engine core's reader thread failed: {exc!r}")
            if not self._stopping:  # (stop() closing the connection under a recv may fail in odd ways)
                log.exception("the engine core's reader thread failed")
                self.proc.kill()  # no one reads its outputs any more: it could only fill the socket and block
        self._fail_pending(error)

    def _dispatch(self) -> None:
        while True:
            message: StepOutputs | Result | Error | Died = self.conn.recv()
            if message.kind is Kind.STEP_OUTPUTS:
                try:
                    if message.outputs:
                        self.on_outputs(message.outputs)
                    if message.stats is not None:
                        self.on_stats(message.stats)
                except Exception:  # a front-end bug must not stop the outputs of everyone else
                    log.exception("handling the engine core's outputs failed")
            elif message.kind is Kind.RESULT:
                complete(self._calls.pop(message.call_id), result=message.value)
            elif message.kind is Kind.ERROR:
                complete(self._calls.pop(message.call_id), error=message.error.rebuild())
            elif message.kind is Kind.DIED:
                raise EngineDeadError(message.error.describe())

    def _fail_pending(self, error: EngineDeadError) -> None:
        with self._send_lock:
            self.error = error
            pending = list(self._calls.values())
            self._calls.clear()
        for future in pending:
            complete(future, error=error)
        if not self._stopping:
            try:
                self.on_death(error)
            except Exception:  # noqa: BLE001 - the engine is marked dead already; say why its callback failed
                log.exception("handling the engine core's death failed")

    def is_alive(self) -> bool:
        return self.error is None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        with self._send_lock:
            try:
                self.conn.send(Shutdown())
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, TimeoutError):  # a process, or a Ray actor (RayRank)
            self.proc.kill()
            self.proc.wait()
        if not isinstance(self.proc, subprocess.Popen):  # an actor outlives its work: end it, free its CPUs
            self.proc.kill()
        self.conn.close()


# -- child side -------------------------------------------------------------------------------------

def _handlers(core) -> dict[Kind, Callable]:
    """What the core does for each call; the value returned is the call's Result."""
    return {
        Kind.ADD_REQUEST: lambda m: core.add_request(m.prompt_token_ids, m.params, request_id=m.request_id,
                                                     prompt=m.prompt, priority=m.priority,
                                                     arrival_time=m.arrival_time, output_kind=m.output_kind,
                                                     lora_request=m.lora_request,
                                                     pooling_params=m.pooling_params),
        Kind.ABORT: lambda m: core.abort(m.request_ids),
        Kind.GET_STATE: lambda m: core.state(m.diagnostics),
    }


def share_cpu_threads(num_replicas: int) -> None:
    """Data-parallel replicas on one machine: each gets 1/N of torch's threads (at least one), so N cores do not
    oversubscribe the CPUs; a single replica keeps torch's default, as before."""
    if num_replicas > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // num_replicas))


def _queued(conn: Connection, timeout: float) -> list:
    """The messages already queued, at most MAX_CALLS_PER_STEP (waiting up to `timeout` for the first)."""
    messages = []
    while len(messages) < MAX_CALLS_PER_STEP and conn.poll(timeout if not messages else 0):
        messages.append(conn.recv())
    return messages


def _answer(conn: Connection, handlers: dict[Kind, Callable], messages: list) -> bool:
    """Answer each call; False once a Shutdown came. One snapshot answers every GetState of the batch (with
    the same `diagnostics`) until another call may change what it says."""
    states: dict[bool, dict] = {}
    for message in messages:
        if message.kind is Kind.SHUTDOWN:
            return False
        try:
            if message.kind is Kind.GET_STATE:
                if message.diagnostics not in states:
                    states[message.diagnostics] = handlers[Kind.GET_STATE](message)
                value = states[message.diagnostics]
            else:
                states.clear()
                value = handlers[message.kind](message)
            conn.send(Result(message.call_id, value))
        except Exception as exc:  # the request's fault, not the core's
            conn.send(Error(message.call_id, RemoteError.of(exc)))
    return True


def serve_core(conn: Connection) -> None:
    """The child's loop: answer the calls that are queued, then take a step, and again. Calls never get ahead of
    steps for longer than one batch of them, so no stream of calls (a client polling /state, say) can stall
    generation: each call waits at most one step for its answer."""
    from aserve.engine.engine_core import EngineCore
    # The tokenizer's classes (transformers builds its lazy import tables: a second or more) are imported before
    # the Start comes: while a server started early (start_early) imports its own modules, not after.
    from transformers import AutoTokenizer, PretrainedConfig  # noqa: F401

    try:
        start: Start = conn.recv()
    except EOFError:  # started early (start_early) and never used: the parent went away first
        return
    if start.config.data_parallel_backend == "mp":  # a Ray actor has its own CPUs (OMP_NUM_THREADS, set by Ray)
        share_cpu_threads(start.config.data_parallel_size)
    try:
        core = EngineCore(start.config)
    except Exception as exc:  # noqa: BLE001 - the parent raises it again, by type
        conn.send(Failed(RemoteError.of(exc)))
        return
    core.outputs.carries_prompts = False  # the front end has them (see OutputProcessor)
    conn.send(Ready(core.facts))
    handlers = _handlers(core)
    try:
        while True:
            if not _answer(conn, handlers, _queued(conn, 0 if core.has_unfinished() else IDLE_WAIT_S)):
                return
            outputs = core.step() if core.has_unfinished() else []
            stats = core.take_stats()
            if outputs or stats:
                conn.send(StepOutputs(outputs, stats if stats else None))
    except (EOFError, BrokenPipeError):
        return  # the parent is gone
    except BaseException as exc:
        log.exception("the engine core died")
        try:
            conn.send(Died(RemoteError.of(exc)))
        except OSError:
            pass
        raise
