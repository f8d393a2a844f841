"""Data parallelism: N engine cores (CoreProcess, each with its own model copy and KV cache) behind one front end.

AsyncLLM talks to a ReplicaSet exactly as it once talked to one CoreProcess (`call`, `facts`, `is_alive`,
`stop`); with one replica nothing else changes. With several, an AddRequest goes to the replica the Router
picks, an Abort to the replica that holds the request, GetState to all of them (answered with the totals
plus a `replicas` list), and any other call to every live replica (answered with the first one's result).

A replica that dies loses only its own requests: they fail with ReplicaDeadError, routing skips it, and the
others serve on. An AddRequest that raced the death (sent to a replica already dying) is sent again to a
live one, which is safe because a dead core produces nothing. Once no replica is left the engine is dead,
through the same callback a single core's death always took.
"""
from __future__ import annotations

import concurrent.futures
import copy
from typing import Callable

import msgspec

from aserve.errors import EngineDeadError
from aserve.engine.core_process import complete
from aserve.engine.messages import Abort, AddRequest, Call, Kind
from aserve.engine.router import Router

# summed over replicas in /state's totals (the last two only with diagnostics asked for); the other fields
# (dtype, hardware) are the same on every replica
SUMMED = ("num_blocks", "num_free_blocks", "num_host_blocks", "num_free_host_blocks", "num_running",
          "num_waiting", "num_swapped", "num_live_requests", "core_rss_bytes", "core_heap_bytes",
          "core_python_objects")


def _add_up(values: list):
    """The sum of per-replica numbers, or of dicts of numbers key by key (core_heap_bytes); None if any is None."""
    if any(v is None for v in values):
        return None
    if isinstance(values[0], dict):
        return {key: _add_up([v[key] for v in values]) for key in values[0]}
    return sum(values)


def replica_device(device: str, replica: int) -> str:
    """With several GPUs visible, replica i runs on GPU i (mod their count); else where the config says."""
    if device not in ("auto", "cuda"):
        return device
    import torch

    count = torch.cuda.device_count()
    return f"cuda:{replica % count}" if count > 1 else device


def replica_config(config, replica: int):
    """Replica i's config: its own sampling seed, so unseeded requests on different replicas do not draw
    the same random numbers, and its own GPU where there are several (replica 0 keeps both, so one replica
    is the engine it always was)."""
    if replica == 0:
        return config
    own = copy.copy(config)  # not dataclasses.replace: __post_init__ would read the parsed sizes again
    own.seed = config.seed + replica
    own.device = replica_device(config.device, replica)
    return own


def _chain(source: concurrent.futures.Future, target: concurrent.futures.Future, transform=None) -> None:
    """Complete `target` as `source` completes (with `transform` applied to a result)."""
    if source.exception() is not None:
        complete(target, error=source.exception())
        return
    try:
        result = source.result() if transform is None else transform(source.result())
    except Exception as exc:  # noqa: BLE001 - a bug here must reach the caller, not hang it
        complete(target, error=exc)
    else:
        complete(target, result)


def _failed(error: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future


class ReplicaSet:
    """The parent side of `data_parallel_size` engine-core processes, started in parallel."""

    def __init__(self, config, start_core: Callable, on_outputs: Callable[[list], None],
                 on_death: Callable[[BaseException], None], on_stats: Callable[[object, int], None],
                 on_replica_death: Callable[[int, BaseException, list[str], int], None]):
        n = config.data_parallel_size
        self.on_outputs, self.on_death, self.on_stats = on_outputs, on_death, on_stats
        self.on_replica_death = on_replica_death
        self.router = Router(n, config.block_size)
        self.errors: dict[int, BaseException] = {}
        if n == 1:  # in this thread, as a single core always started
            self.replicas = [start_core(config, self._outputs_of(0), self._death_of(0), self._stats_of(0))]
        else:
            self.replicas = self._start_all(config, start_core, n)
        self.facts = self.replicas[0].facts

    def _start_all(self, config, start_core: Callable, n: int) -> list:
        """Load every replica at once (each loads its own weights); if one fails, stop the rest and raise."""
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="aserve-replica-start") as pool:
            futures = [pool.submit(start_core, replica_config(config, i), self._outputs_of(i), self._death_of(i),
                                   self._stats_of(i)) for i in range(n)]
            concurrent.futures.wait(futures)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for f in futures:
                if f.exception() is None:
                    f.result().stop()
            raise failed[0]
        return [f.result() for f in futures]

    # -- callbacks from each replica's reader thread ---------------------------------------------------

    def _outputs_of(self, replica: int) -> Callable[[list], None]:
        def on_outputs(outputs: list) -> None:
            for output in outputs:
                if output.finished:
                    self.router.release(output.request_id)
            self.on_outputs(outputs)
        return on_outputs

    def _stats_of(self, replica: int) -> Callable[[object], None]:
        return lambda stats: self.on_stats(stats, replica)

    def _death_of(self, replica: int) -> Callable[[BaseException], None]:
        def on_death(exc: BaseException) -> None:
            self.errors[replica] = exc
            lost, remaining = self.router.mark_dead(replica)
            try:
                self.on_replica_death(replica, exc, lost, remaining)
            finally:  # whatever the bookkeeping does, the last death must reach the dead-engine path
                if remaining == 0:
                    self.on_death(exc)  # the whole engine is gone: exactly what one core's death always did
        return on_death

    # -- calls ------------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.replicas)

    def _live(self) -> list[int]:
        return [i for i, up in enumerate(self.router.alive) if up]

    def call(self, message: Call) -> concurrent.futures.Future:
        """Send a call where it belongs; the future completes with the answer (as CoreProcess.call's does)."""
        if self.size == 1:
            return self._single(message)
        if not self._live():
            last = list(self.errors.values())[-1] if self.errors else "its process ended"
            return _failed(EngineDeadError(f"the engine core died: every replica has died (the last: {last})"))
        if message.kind is Kind.ADD_REQUEST:
            return self._add(message)
        if message.kind is Kind.ABORT:
            return self._abort(message)
        if message.kind is Kind.GET_STATE:
            return self._gather(message, self.merge_states)
        return self._gather(message, lambda answers: next(a for a in answers if not isinstance(a, BaseException)))

    def _single(self, message: Call) -> concurrent.futures.Future:
        """One replica: the call goes straight to it; only the in-flight count is kept, for /state."""
        if message.kind is Kind.ADD_REQUEST:
            self.router.route(message.request_id, message.prompt_token_ids)
            future = self.replicas[0].call(message)
            future.add_done_callback(lambda f: self._release_if_refused(f, message.request_id))
            return future
        if message.kind is Kind.ABORT:
            for request_id in message.request_ids:
                self.router.release(request_id)
        if message.kind is Kind.GET_STATE:
            outer: concurrent.futures.Future = concurrent.futures.Future()
            self.replicas[0].call(message).add_done_callback(
                lambda f: _chain(f, outer, lambda state: self.merge_states([state])))
            return outer
        return self.replicas[0].call(message)

    def _release_if_refused(self, future: concurrent.futures.Future, request_id: str) -> None:
        if future.cancelled() or future.exception() is not None:
            self.router.release(request_id)

    def _add(self, message: AddRequest, outer: concurrent.futures.Future | None = None,
             exclude: int | None = None) -> concurrent.futures.Future:
        outer = outer or concurrent.futures.Future()
        replica = self.router.route(message.request_id, message.prompt_token_ids, exclude)
        if replica is None:
            self.router.release(message.request_id)
            complete(outer, error=EngineDeadError("every engine replica has died"))
            return outer

        def done(inner: concurrent.futures.Future) -> None:
            error = inner.exception()
            if isinstance(error, EngineDeadError) and self.router.owner(message.request_id) == replica:
                self._add(message, outer, exclude=replica)  # it never reached a live core: try another
                return
            if error is not None and self.router.owner(message.request_id) == replica:
                self.router.release(message.request_id)
            _chain(inner, outer)

        # the inner future is ours alone: a caller that gives up cancels `outer`, never the routing
        self.replicas[replica].call(message).add_done_callback(done)
        return outer

    def _abort(self, message: Abort) -> concurrent.futures.Future:
        by_replica: dict[int, list[str]] = {}
        for request_id in message.request_ids:
            replica = self.router.owner(request_id)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
                self.router.release(request_id)
        outer: concurrent.futures.Future = concurrent.futures.Future()
        if not by_replica:
            outer.set_result([])  # finished already (or lost with a replica): nothing to abort
            return outer
        inners = [self.replicas[replica].call(msgspec.structs.replace(message, request_ids=ids))
                  for replica, ids in by_replica.items()]

        def all_done(_) -> None:
            if all(f.done() for f in inners):  # a dead replica's requests are gone anyway
                complete(outer, [out for f in inners if f.exception() is None for out in f.result()])
        for inner in inners:
            inner.add_done_callback(all_done)
        return outer

    def _gather(self, message: Call, combine: Callable[[list], object]) -> concurrent.futures.Future:
        """Send to every replica (the dead ones answer at once with their error); combine the answers, one per
        replica in order, each a result or the exception it raised."""
        outer: concurrent.futures.Future = concurrent.futures.Future()
        inners = [core.call(message) for core in self.replicas]

        def all_done(_) -> None:
            if not all(f.done() for f in inners) or outer.done():
                return
            answers = [f.exception() if f.exception() is not None else f.result() for f in inners]
            if all(isinstance(a, BaseException) for a in answers):
                complete(outer, error=answers[0])
                return
            try:
                combined = combine(answers)
            except Exception as exc:  # noqa: BLE001 - a bug here must reach the caller, not hang it
                complete(outer, error=exc)
            else:
                complete(outer, combined)
        for inner in inners:
            inner.add_done_callback(all_done)
        return outer

    def merge_states(self, answers: list) -> dict:
        """/state for N replicas: the totals under the old names (so clients of one core read them as before),
        and per replica its own state, whether it is alive, its pid and the requests the router counts on it."""
        states = [a if isinstance(a, dict) else None for a in answers]
        live = [s for s in states if s is not None]
        total = dict(live[0])
        for key in SUMMED:
            if key in total:
                total[key] = _add_up([s[key] for s in live])
        replicas = []
        for i, s in enumerate(states):
            entry = {"replica": i, "alive": s is not None, "pid": self.replicas[i].proc.pid,
                     "in_flight": self.router.in_flight[i]}
            if s is None:
                entry["error"] = str(self.errors.get(i) or answers[i])
            else:
                entry.update({key: s[key] for key in SUMMED if key in s})
            replicas.append(entry)
        if self.size > 1 and "hardware" in total:  # its thread count is one replica's
            total["hardware"] += f" per replica, {self.size} data-parallel replicas"
        total["data_parallel_size"] = self.size
        total["num_replicas_alive"] = len(live)
        total["replicas"] = replicas
        return total

    # -- life cycle -------------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        """True while any replica serves (see `dead` for the ones that do not)."""
        return any(core.is_alive() for core in self.replicas)

    @property
    def dead(self) -> dict[int, str]:
        """The replicas that died: index -> why."""
        return {i: str(self.errors.get(i, "its process ended")) for i, core in enumerate(self.replicas)
                if not core.is_alive()}

    @property
    def proc(self):
        """The engine-core process when there is one replica (what a single CoreProcess offered)."""
        if self.size != 1:
            raise AttributeError("a data-parallel engine has one process per replica: see .replicas")
        return self.replicas[0].proc

    def stop(self) -> None:
        if self.size == 1:
            self.replicas[0].stop()
            return
        with concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="aserve-replica-stop") as pool:
            list(pool.map(lambda core: core.stop(), self.replicas))  # each waits for its process: wait at once
