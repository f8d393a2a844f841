"""The engine core in a child process, so the model's Python never shares a GIL with the event loop.

Measured on the 2-core machine (64 x 128/128, bench model): an engine-core thread beside the event loop
kept ~85-90% of offline throughput, a process ~97%; the difference is the GIL convoy between the loop
and the core's op dispatch. The child is started with `python -m aserve.engine.core_child FD` (not
multiprocessing), so user scripts without a `__main__` guard are never re-imported.

Protocol over one socket pair (multiprocessing Connection framing, pickled tuples):
    parent -> child: EngineConfig first; then (call_id, command, args) or None to stop
    child -> parent: ("ready", EngineFacts) | ("failed", exception type, message) first; then
                     ("step", [RequestOutput], IterationStats | None) after steps, ("result" | "error", call_id, value)
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

log = logging.getLogger("aserve")

from aserve.engine.engine_core import EngineOverloadedError

ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError,
          "EngineOverloadedError": EngineOverloadedError}


class EngineDeadError(RuntimeError):
    """The engine core stopped; no request can be served until the process restarts."""


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Complete a call's future unless its caller gave up on it (a cancelled await cancels the future)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _remote_error(name: str, message: str) -> Exception:
    return ERRORS.get(name, RuntimeError)(message)


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
        self.conn.send(config)
        try:
            first = self.conn.recv()
        except EOFError:
            self.proc.wait()
            raise EngineDeadError(f"the engine process exited during start-up (status {self.proc.returncode})")
        if first[0] == "failed":
            self.proc.wait()
            raise _remote_error(first[1], first[2])
        self.facts = first[1]
        self._reader = threading.Thread(target=self._read, name="aserve-core-reader", daemon=True)
        self._reader.start()

    def call(self, command: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(EngineDeadError(f"the engine core died: {self.error}"))
            return future
        with self._send_lock:
            call_id = next(self._ids)
            self._calls[call_id] = future
            try:
                self.conn.send((call_id, command, args))
            except OSError as exc:
                self._calls.pop(call_id, None)
                future.set_exception(EngineDeadError(f"the engine core is gone: {exc}"))
        return future

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self.conn.recv()
                if kind == "step":
                    outputs, stats = rest
                    try:
                        if outputs:
                            self.on_outputs(outputs)
                        if stats is not None:
                            self.on_stats(stats)
                    except Exception:  # a front-end bug must not stop the outputs of everyone else
                        log.exception("handling the engine core's outputs failed")
                elif kind == "result":
                    _settle(self._calls.pop(rest[0]), result=rest[1])
                elif kind == "error":
                    _settle(self._calls.pop(rest[0]), error=_remote_error(*rest[1]))
                elif kind == "died":
                    raise EngineDeadError(rest[0])
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
                self.conn.send(None)
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


# -- child side -------------------------------------------------------------------------------------

def _commands(core):
    return {"add_request": lambda ids, params, kwargs: core.add_request(ids, params, **kwargs),
            "abort": core.abort, "state": core.state}


def serve_core(conn: Connection) -> None:
    from aserve.engine.engine_core import EngineCore

    config = conn.recv()
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - the parent re-raises it with its message
        conn.send(("failed", type(exc).__name__, str(exc)))
        return
    conn.send(("ready", core.facts))
    commands = _commands(core)
    try:
        while True:
            while conn.poll(0 if core.has_unfinished() else 0.5):
                message = conn.recv()
                if message is None:
                    return
                call_id, name, args = message
                try:
                    conn.send(("result", call_id, commands[name](*args)))
                except Exception as exc:  # the request's fault, not the core's
                    conn.send(("error", call_id, (type(exc).__name__, str(exc))))
            outputs = core.step() if core.has_unfinished() else []
            stats = core.take_stats()
            if outputs or stats:
                conn.send(("step", outputs, stats if stats else None))
    except (EOFError, BrokenPipeError):
        return  # the parent is gone
    except BaseException as exc:
        log.exception("the engine core died")
        try:
            conn.send(("died", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
