"""The engine core's control plane: calls (state, abort, new requests) interleave with steps so that no stream of
them stalls generation, /state is cheap and behind the API key, and the reader thread that completes every call
cannot die silently."""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing import Pipe

import httpx
import pytest

from aserve import AsyncLLM, EngineDeadError
from aserve.bench.serve import describe_server
from aserve.engine.core_process import MAX_CALLS_PER_STEP, _answer, _queued, complete, serve_core
from aserve.engine.messages import Abort, GetState, Kind
from aserve.worker import host_memory
from conftest import wait_for
from server_util import RunningServer

KEY = "control-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(model_dirs):
    srv = RunningServer("--model", str(model_dirs["llama-gqa-tied"]), "--dtype", "float32",
                        "--kv-cache-memory", "16MiB", "--api-key", KEY)
    yield srv
    srv.stop()


# -- the child's loop: a bounded batch of calls, then a step ----------------------------------------------

def test_a_batch_of_calls_is_bounded_and_shares_one_state_snapshot():
    parent, child = Pipe()
    for i in range(MAX_CALLS_PER_STEP + 3):
        parent.send(GetState(call_id=i))
    first, rest = _queued(child, 0), _queued(child, 0)
    assert len(first) == MAX_CALLS_PER_STEP and len(rest) == 3  # the step in between always comes
    assert _queued(child, 0) == []

    computed = []
    handlers = {Kind.GET_STATE: lambda m: computed.append(m.diagnostics) or {"n": len(computed)},
                Kind.ABORT: lambda m: []}
    batch = [GetState(call_id=0), GetState(call_id=1), GetState(call_id=2, diagnostics=True),
             Abort(call_id=3, request_ids=["x"]), GetState(call_id=4)]
    assert _answer(child, handlers, batch)
    answers = [parent.recv() for _ in batch]
    assert all(a.kind is Kind.RESULT for a in answers) and [a.call_id for a in answers] == [0, 1, 2, 3, 4]
    # one snapshot for the first two, one with diagnostics, and a fresh one after the abort changed the engine
    assert computed == [False, True, False]
    assert [a.value for a in answers] == [{"n": 1}, {"n": 1}, {"n": 2}, [], {"n": 3}]


# -- completing a call's future ------------------------------------------------------------------------

class CancelledJustBeforeTheSet(concurrent.futures.Future):
    """A future its caller cancels after whoever completes it checked done(), just before the set."""

    def set_result(self, result) -> None:
        self.cancel()
        super().set_result(result)

    def set_exception(self, exception) -> None:
        self.cancel()
        super().set_exception(exception)


def test_complete_survives_a_cancel_between_check_and_set():
    for kwargs in ({"result": 1}, {"error": ValueError("late")}):
        future = CancelledJustBeforeTheSet()
        complete(future, **kwargs)  # a done() check, then the set, raised InvalidStateError here
        assert future.cancelled()
    done = concurrent.futures.Future()
    done.set_result("first")
    complete(done, result="second")
    assert done.result() == "first"


def engine(model_dirs) -> AsyncLLM:
    return AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB")


def test_the_reader_completes_a_call_cancelled_in_flight_and_serves_on(model_dirs):
    async def main():
        async with engine(model_dirs) as llm:
            core = llm.replicas.replicas[0]
            os.kill(core.proc.pid, signal.SIGSTOP)  # the calls stay pending while their callers give up
            try:
                swapped = {}
                for racy in (CancelledJustBeforeTheSet(), CancelledJustBeforeTheSet()):
                    pending = core.call(GetState())
                    (call_id,) = [i for i, f in core._calls.items() if f is pending]
                    core._calls[call_id] = swapped[call_id] = racy
            finally:
                os.kill(core.proc.pid, signal.SIGCONT)
            state = await asyncio.wait_for(llm.state(), 60)  # the reader lived to answer the next call
            assert state["num_live_requests"] == 0 and llm.is_healthy
            assert all(f.cancelled() for f in swapped.values()) and not set(swapped) & set(core._calls)
    asyncio.run(main())


class BuggyCalls(dict):
    """The calls table with a bug in it: the reader's next answer raises something no one expected."""

    def pop(self, key, *default):
        raise RuntimeError("an unexpected bug on the reader thread")


def test_an_unexpected_error_on_the_reader_thread_kills_the_engine_loudly(model_dirs, caplog):
    async def main():
        llm = engine(model_dirs)
        deaths = []
        llm.start()
        llm.on_death.append(deaths.append)
        core = llm.replicas.replicas[0]
        core._calls = BuggyCalls(core._calls)
        with pytest.raises(EngineDeadError, match="reader thread failed"):
            await asyncio.wait_for(llm.state(), 60)  # fails: it does not hang
        await asyncio.wait_for(until_true(lambda: deaths), 60)
        assert isinstance(deaths[0], EngineDeadError) and not llm.is_healthy
        assert core.proc.wait(timeout=60) is not None  # no one reads the core any more: it is ended, not left
        with pytest.raises(EngineDeadError):
            await llm.state()
        await llm.shutdown()
    asyncio.run(main())
    assert "reader thread failed" in caplog.text


async def until_true(probe, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, "the awaited state did not come"
        await asyncio.sleep(0.02)


# -- diagnostics: on request, cached; the C library looked up once ------------------------------------------

def test_cores_started_early_are_taken_in_order_and_the_unused_stopped_at_exit():
    """`aserve serve` starts its core processes before it imports the server (core_process.start_early): a
    CoreProcess takes them first come first served, and any left when the process exits (a bad flag found
    after the start) are stopped, not left behind."""
    code = ("from aserve.engine import core_process as c\n"
            "c.start_early(3)\n"
            "pids = [proc.pid for proc, _ in c._early]\n"
            "taken, _ = c.start_child()\n"
            "assert taken.pid == pids[0] and len(c._early) == 2\n"
            "taken.kill(); taken.wait()\n"
            "print(*pids)")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    pids = [int(pid) for pid in ran.stdout.split()]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_core_whose_parent_goes_before_its_start_exits_quietly():
    """A core started early whose server exits first (killed, say) finds its socket closed: it returns."""
    ours, theirs = Pipe()
    ours.close()
    assert serve_core(theirs) is None


def test_memory_diagnostics_are_cached_and_libc_is_looked_up_once(monkeypatch):
    lookups = []
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: lookups.append(name) or real(name))
    host_memory._libc.cache_clear()
    for _ in range(3):
        host_memory.heap_bytes()
    host_memory.keep_large_allocations_in_heap()
    assert lookups == ["c"]

    first = host_memory.memory_diagnostics(max_age_s=3600)
    again = host_memory.memory_diagnostics(max_age_s=3600)
    assert again.python_objects == first.python_objects and again.age_s >= first.age_s
    fresh = host_memory.memory_diagnostics(max_age_s=0)
    assert fresh.age_s == 0 and fresh.python_objects > 0


# -- the HTTP side: /state behind the key, diagnostics on request, fairness ------------------------------------

def test_state_needs_the_key_and_diagnostics_are_asked_for(server):
    assert httpx.get(f"{server.url}/state", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/state", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    for path in ("/health", "/version", "/metrics"):  # these stay open, as in vLLM
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200, path

    plain = httpx.get(f"{server.url}/state", headers=AUTH, timeout=10).json()
    assert plain["num_free_blocks"] == plain["num_blocks"] > 0 and plain["core_rss_bytes"] > 0
    assert plain["dtype"] == "float32" and "threads" in plain["hardware"]
    assert "core_python_objects" not in plain and "core_heap_bytes" not in plain
    rich = httpx.get(f"{server.url}/state", params={"diagnostics": "1"}, headers=AUTH, timeout=10).json()
    assert rich["core_python_objects"] > 0 and rich["core_diagnostics_age_s"] >= 0
    assert rich["core_heap_bytes"] is None or rich["core_heap_bytes"]["in_use"] > 0
    bad = httpx.get(f"{server.url}/state", params={"diagnostics": "maybe"}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "diagnostics"


def test_bench_serve_reads_the_hardware_with_the_key(server):
    async def describe(headers):
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
            return await describe_server(client)
    assert "server on CPU capability" in asyncio.run(describe(AUTH))
    assert "client on" in asyncio.run(describe({}))  # without it the server says nothing of itself


POLLER = """
import sys, httpx
url, key = sys.argv[1], sys.argv[2]
with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
    first = True
    while True:
        if client.get(url).status_code != 200:
            sys.exit(3)
        if first:
            print("polling", flush=True)
            first = False
"""


def stream_seconds_while_polled(server, paths: list[str], cap_s: float) -> float:
    """How long a 128-token stream takes while one client per path polls it as fast as it can (each a process
    of its own, as separate clients would be); `cap_s` turns a stalled stream into an infinite time."""
    pollers = [subprocess.Popen([sys.executable, "-c", POLLER, f"{server.url}{path}", KEY], stdout=subprocess.PIPE,
                                text=True) for path in paths]
    try:
        for poller in pollers:
            assert poller.stdout.readline().strip() == "polling", f"a poller of {paths} failed"
        body = {"prompt": "the control plane", "max_tokens": 128, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        started, last = time.monotonic(), None
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=cap_s) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
                    if time.monotonic() - started > cap_s:
                        return float("inf")
        except httpx.ReadTimeout:
            return float("inf")
        assert last["usage"]["completion_tokens"] == 128, last
        assert all(p.poll() is None for p in pollers), "a poller got an error answer"
        return time.monotonic() - started
    finally:
        for poller in pollers:
            poller.terminate()
            poller.wait()


def test_polling_state_slows_generation_no_more_than_polling_health(server):
    """Two clients poll /state (one asking for diagnostics) as fast as they can: generation goes on, slowed no
    more than a few times as much as by the same two clients polling /health. Before, each /state call ran
    gc.get_objects and find_library between steps and every queued call was answered before the next step: 0 of
    128 tokens in 60 s. (The bound is loose on purpose: a /state answer costs more than /health's, and a shared VM's
    speed drifts between the rounds; a CI run once measured 2.35x.)"""
    rounds = {"health": [], "state": []}
    for _ in range(3):  # alternating, best of three: other work on the machine hits both sides alike
        health = stream_seconds_while_polled(server, ["/health", "/health"], cap_s=120)
        rounds["health"].append(health)
        cap = max(60.0, 20 * health)
        rounds["state"].append(stream_seconds_while_polled(server, ["/state", "/state?diagnostics=1"], cap_s=cap))
    assert min(rounds["state"]) <= 4 * min(rounds["health"]), rounds
    wait_for(lambda: httpx.get(f"{server.url}/state", headers=AUTH, timeout=10).json(),
             lambda s: s["num_live_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"], "the server idle")
