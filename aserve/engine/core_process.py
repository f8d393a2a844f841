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


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Complete a call's future unless its caller gave up on it (a cancelled await cancels the future)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class CoreProcess:
    """Parent side: starts the child, sends commands, and hands its outputs to `on_outputs` (on a reader thread)."""

    def __init__(self, config, on_outputs: Callable[[list], None], on_death: Callable[[BaseException], None],
                 on_stats: Callable[[object], None]):
        self.on_outputs = on_outputs
        self.on_stats = on_stats
        self.on_death = on_death
        parent_sock, child_sock = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "aserve.engine.core_child", str(child_sock.fileno())],
                                     pass_fds=[child_sock.fileno()])
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
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
        if self.error is not None:
            future.set_exception(EngineDeadError(f"the engine core died: {self.error}"))
            return future
        with self._send_lock:
            call_id = next(self._ids)
            self._calls[call_id] = future
            try:
                self.conn.send(msgspec.structs.replace(message, call_id=call_id))
            except OSError as exc:
                self._calls.pop(call_id, None)
                future.set_exception(EngineDeadError(f"the engine core is gone: {exc}"))
        return future

    def _read(self) -> None:
        try:
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
                    _settle(self._calls.pop(message.call_id), result=message.value)
                elif message.kind is Kind.ERROR:
                    _settle(self._calls.pop(message.call_id), error=message.error.rebuild())
                elif message.kind is Kind.DIED:
                    raise EngineDeadError(message.error.describe())
        except (EOFError, OSError, EngineDeadError) as exc:
            code = self.proc.poll()
            self.error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"the engine process ended (status {code})")
            for future in self._calls.values():
                _settle(future, error=self.error)
            self._calls.clear()
            if not self._stopping:
                self.on_death(self.error)

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
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


# -- child side -------------------------------------------------------------------------------------

def _handlers(core) -> dict[Kind, Callable]:
    """What the core does for each call; the value returned is the call's Result."""
    return {
        Kind.ADD_REQUEST: lambda m: core.add_request(m.prompt_token_ids, m.params, request_id=m.request_id,
                                                     prompt=m.prompt, priority=m.priority,
                                                     arrival_time=m.arrival_time, output_kind=m.output_kind),
        Kind.ABORT: lambda m: core.abort(m.request_ids),
        Kind.GET_STATE: lambda m: core.state(),
    }


def share_cpu_threads(num_replicas: int) -> None:
    """Data-parallel replicas on one machine: each gets 1/N of torch's threads (at least one), so N cores do not
    oversubscribe the CPUs; a single replica keeps torch's default, as before."""
    if num_replicas > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // num_replicas))


def serve_core(conn: Connection) -> None:
    from aserve.engine.engine_core import EngineCore

    start: Start = conn.recv()
    share_cpu_threads(start.config.data_parallel_size)
    try:
        core = EngineCore(start.config)
    except Exception as exc:  # noqa: BLE001 - the parent raises it again, by type
        conn.send(Failed(RemoteError.of(exc)))
        return
    conn.send(Ready(core.facts))
    handlers = _handlers(core)
    try:
        while True:
            while conn.poll(0 if core.has_unfinished() else 0.5):
                message: Call | Shutdown = conn.recv()
                if message.kind is Kind.SHUTDOWN:
                    return
                try:
                    conn.send(Result(message.call_id, handlers[message.kind](message)))
                except Exception as exc:  # the request's fault, not the core's
                    conn.send(Error(message.call_id, RemoteError.of(exc)))
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
