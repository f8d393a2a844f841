"""Data parallelism (--data-parallel-size): the router's rule, DP=2 equal to DP=1 per request, requests spread
over the replicas, /state and /metrics per replica, and a replica that dies while the other serves on."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aserve import LLM, AsyncLLM, SamplingParams
from aserve.errors import ConfigError
from aserve.engine.router import Router
from conftest import engine_idle, random_prompts, wait_for
from server_util import RunningServer

FAMILY = "llama-gqa-tied"
PROMPTS = random_prompts(8, lengths=(20, 40), seed=15)  # more than a block each, all first blocks different
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


# -- the routing rule alone -------------------------------------------------------------------------

def test_router_picks_the_least_loaded_live_replica():
    r = Router(2, block_size=4, slack=1)
    assert [r.route(f"r{i}", [i]) for i in range(4)] == [0, 1, 0, 1]  # ties rotate, loads stay even
    r.release("r0")
    r.release("r2")
    assert r.in_flight == [0, 2] and r.route("r4", [9]) == 0 and r.route("r5", [9]) == 0
    r.release("r4")
    r.release("r4")  # idempotent: a finished request aborted later does not count twice
    assert r.in_flight == [1, 2]
    assert r.route("r6", [1], exclude=0) == 1  # a resend avoids the replica that failed it
    lost, remaining = r.mark_dead(1)
    assert sorted(lost) == ["r1", "r3", "r6"] and remaining == 1 and r.in_flight == [1, 0]
    assert all(r.route(f"s{i}", [i]) == 0 for i in range(3))
    assert r.route("t", [1], exclude=0) is None
    assert r.mark_dead(0)[1] == 0 and r.route("u", [1]) is None


def test_router_keeps_a_prefix_on_its_replica_within_the_slack():
    r = Router(2, block_size=4, slack=1)
    shared = [7, 7, 7, 7]
    assert r.route("a", shared + [1]) == 0
    r.release("a")
    assert r.route("b", [5, 5, 5, 5, 5]) == 1  # a new first block: the rotation's turn
    r.release("b")
    assert r.route("x", [1]) == 0  # (so that the rotation's next turn is replica 1)
    r.release("x")
    assert r.route("c", shared + [2]) == 0  # tied loads: the rotation says 1, the prefix's home is 0
    assert r.route("d", shared + [3]) == 0  # one over the least loaded: within the slack
    assert r.route("e", shared + [4]) == 1  # two over: balance wins, and the prefix moves
    assert r.route("f", shared) == 1  # exactly one block shares nothing (its last token is always computed)


def test_each_replica_gets_its_own_seed_and_gpu(monkeypatch):
    import torch

    from aserve.config import EngineConfig
    from aserve.engine.replicas import replica_config

    config = EngineConfig(seed=5, swap_space=1, data_parallel_size=3)
    assert replica_config(config, 0) is config
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    one = replica_config(config, 1)
    assert (one.seed, one.device, one.swap_space, config.seed) == (6, "auto", 1024 ** 3, 5)  # sizes parsed once
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [replica_config(config, i).device for i in (1, 2)] == ["cuda:1", "cuda:0"]
    assert replica_config(EngineConfig(device="cpu", data_parallel_size=2), 1).device == "cpu"


# -- AsyncLLM: parity and balance ---------------------------------------------------------------

def test_dp2_equals_dp1_per_request_and_spreads_the_load(model_dirs):
    path = str(model_dirs[FAMILY])
    # On the CPU: on a GPU the first long request can finish before the other replica's first token (its Triton
    # compile), and what is checked here is the spreading, the same on any device.
    options = dict(dtype="float32", kv_cache_memory="16MiB", device="cpu")
    reference = LLM(path, **options).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    with pytest.raises(ConfigError, match="data_parallel_size=2 needs AsyncLLM"):
        LLM(path, data_parallel_size=2, **options)

    async def main():
        async with AsyncLLM(path, data_parallel_size=2, **options) as engine:
            # two long requests at once land on different replicas
            streams = [engine.generate({"prompt_token_ids": p}, LONG) for p in PROMPTS[:2]]
            for stream in streams:
                await anext(stream)
            state = await engine.state()
            assert [r["num_live_requests"] for r in state["replicas"]] == [1, 1]
            assert [r["in_flight"] for r in state["replicas"]] == [1, 1] and state["num_live_requests"] == 2
            for stream in streams:
                await stream.aclose()  # aborts go to the replica holding the request
            outs = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, GREEDY) for p in PROMPTS])
            assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
            state = await engine_idle(engine)  # the two long ones are freed once their aborts reach their replicas
            assert state["data_parallel_size"] == 2 and state["num_replicas_alive"] == 2
            assert state["num_blocks"] == sum(r["num_blocks"] for r in state["replicas"])
            assert [r["in_flight"] for r in state["replicas"]] == [0, 0]
            done = {lab["replica"]: v for name, lab, v in engine.get_metrics()
                    if name == "aserve:request_success_total" and lab["finished_reason"] == "length"}
            assert done["0"] + done["1"] == len(PROMPTS) and min(done.values()) >= 2
    asyncio.run(main())


# -- the server: /state, /metrics, a replica that dies ------------------------------------------

def samples(url: str) -> list[tuple[str, dict, float]]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def by_replica(url: str, name: str, **labels) -> dict[str, float]:
    return {lab["replica"]: v for n, lab, v in samples(url)
            if n == name and all(lab.get(k) == v_ for k, v_ in labels.items())}


def stream_completion(url: str, prompt: list[int], started: concurrent.futures.Future) -> list[dict]:
    """A streamed completion's events (the last one may be an error event); `started` is set at the first."""
    events = []
    body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
                if not started.done():
                    started.set_result(None)
    return events


def complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True},
                      timeout=60)


def test_server_reports_replicas_and_serves_on_when_one_dies(model_dirs):
    srv = RunningServer("--model", str(model_dirs[FAMILY]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", "16MiB", "--data-parallel-size", "2")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert {r.status_code for r in pool.map(lambda p: complete(srv.url, p), PROMPTS[:4])} == {200}
        state = httpx.get(f"{srv.url}/state").json()
        assert state["data_parallel_size"] == 2 and [r["alive"] for r in state["replicas"]] == [True, True]
        pids = [r["pid"] for r in state["replicas"]]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        tokens = wait_for(lambda: by_replica(srv.url, "aserve:generation_tokens_total"),
                          lambda t: sum(t.values()) >= 32, "the replicas' stats for the four requests")
        assert set(tokens) == {"0", "1"} and sum(tokens.values()) == 32 and min(tokens.values()) > 0
        assert by_replica(srv.url, "aserve:replica_up") == {"0": 1.0, "1": 1.0}

        # two long streams, one on each replica; replica 1 is killed while both are in flight
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = [concurrent.futures.Future() for _ in range(2)]
            streams = [pool.submit(stream_completion, srv.url, p, s) for p, s in zip(PROMPTS[4:6], started)]
            assert not concurrent.futures.wait(started, timeout=30).not_done
            os.kill(pids[1], signal.SIGKILL)
            results = [s.result(timeout=60) for s in streams]
        errors = [events[-1]["error"] for events in results if "error" in events[-1]]
        finished = [events for events in results if "error" not in events[-1]]
        assert len(errors) == 1 and len(finished) == 1, results
        assert errors[0]["code"] == 503 and "replica 1 died" in errors[0]["message"]
        assert finished[0][-1]["choices"][0]["finish_reason"] == "length"

        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [d["replica"] for d in health.json()["dead_replicas"]] == [1]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # new requests go to the live replica
            assert {r.status_code for r in pool.map(lambda p: complete(srv.url, p), PROMPTS[:4])} == {200}
        state = httpx.get(f"{srv.url}/state").json()
        assert [r["alive"] for r in state["replicas"]] == [True, False] and state["num_replicas_alive"] == 1
        assert "died" in state["replicas"][1]["error"] or "ended" in state["replicas"][1]["error"]
        assert by_replica(srv.url, "aserve:replica_up") == {"0": 1.0, "1": 0.0}
        assert "engine replica 1 died" in srv.output()

        os.kill(pids[0], signal.SIGKILL)  # the last replica: the engine is dead, as with one core
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()
