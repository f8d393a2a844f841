"""Short versions of load_tests/ against live servers: bursts, disconnect storms, malformed traffic, overload,
timeouts and a model fault. Each ends with every block free, no live request, no 5xx and a good request served."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import pytest

from conftest import POISON, until
from load_tests.scenarios import Target, burst, disconnect_storm, malformed, wait_idle
from server_util import RunningServer

SECRET = "Quintessence-of-dust-7731"  # prompt text that must not reach the logs unless --log-requests


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--body-timeout", "2", "--max-model-len", "512", "--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded():
    """Small queue, one sequence at a time, request logging and CORS for one origin."""
    s = RunningServer("--max-num-seqs", "1", "--max-waiting-requests", "2", "--dtype", "float32",
                      "--log-requests", "--allowed-origins", "http://dashboard.example")
    yield s
    s.stop()


def scenario(server, fn, **options):
    async def go():
        return await fn(await Target(server.url).discover(), **options)
    summary = asyncio.run(go())
    print(summary.line())
    return summary


def assert_clean(summary):
    checks = summary.checks
    assert checks["idle"] is True and checks["blocks_leaked"] == 0 and checks["live_requests"] == 0, checks
    assert checks["live_collectors"] == 0 and checks["no_5xx"] and checks["good_request_served"], checks
    assert summary.passed, summary.as_dict()["failed_by_kind"]


def test_burst_outputs_equal_the_same_prompts_run_alone(server):
    summary = scenario(server, burst, num_requests=32, max_tokens=24, check_alone=True)
    assert_clean(summary)
    assert summary.checks["outputs_equal_alone"] is True, summary.extra["mismatched"]
    assert summary.by_status == {"200": 32}


def test_disconnect_storm_leaves_nothing_behind(server):
    summary = scenario(server, disconnect_storm, num_clients=60)
    assert_clean(summary)
    assert len(summary.results) == 60


def test_malformed_traffic_gets_4xx_and_good_traffic_200(server):
    summary = scenario(server, malformed, rounds=2, good_per_round=6, slow_clients=2, stall=True)
    assert_clean(summary)
    by_kind = {r.kind: r.status for r in summary.results}
    assert by_kind["invalid-utf8"] == 400 and by_kind["huge-int"] == 400
    too_big = [r.status for r in summary.results if r.kind.startswith("10MB-body")]  # fast, slow and chunked senders
    assert {"10MB-body", "10MB-body-slow", "10MB-body-chunked"} <= set(by_kind) and set(too_big) == {413}, too_big
    assert by_kind["stalled-body"] == 408 and by_kind["slow-client"] == 200 and by_kind["slow-reader"] == 200
    assert all(r.status == 200 for r in summary.results if r.kind == "good")


def test_prompts_stay_out_of_the_logs_by_default(server, guarded):
    for s in (server, guarded):
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": SECRET, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    assert SECRET not in server.output()
    assert SECRET in guarded.output()  # --log-requests


def test_cors_is_off_unless_origins_are_allowed(server, guarded):
    preflight = {"Origin": "http://dashboard.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(f"{server.url}/v1/completions", headers=preflight).headers
    r = httpx.options(f"{guarded.url}/v1/completions", headers=preflight)
    assert r.headers["access-control-allow-origin"] == "http://dashboard.example"
    other = httpx.options(f"{guarded.url}/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_a_full_queue_answers_503_with_retry_after(guarded):
    """A long request holds the only seat (--max-num-seqs 1) until the test ends it, so twelve more queue up
    whatever the CPU's speed: the core accepts as many as --max-waiting-requests allows and refuses the rest."""
    async def go():
        async with httpx.AsyncClient(base_url=guarded.url, timeout=120) as c:
            room = (await c.get("/v1/models")).json()["data"][0]["max_model_len"] - 16
            seat = {"prompt": "all the world is a stage", "max_tokens": room, "ignore_eos": True, "stream": True}
            body = {"prompt": "to be or not to be", "max_tokens": 8, "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=seat) as holder:
                events = holder.aiter_lines()  # kept: dropping a half-read iterator would close the connection
                while not (await anext(events)).startswith("data: "):
                    pass  # until its first token: it holds the seat
                sent = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(12)]

                async def queue():
                    return sum(t.done() for t in sent), (await c.get("/state")).json()
                await until(queue, lambda q: q[0] == 10 and (q[1]["num_running"], q[1]["num_waiting"]) == (1, 2),
                            "ten refusals, with two requests waiting behind the seat's holder")
            return await asyncio.gather(*sent)  # the holder hung up: its abort frees the seat for the two
    answers = asyncio.run(go())
    statuses = [r.status_code for r in answers]
    assert sorted(statuses) == [200] * 2 + [503] * 10, statuses  # the waiting queue's two, and no more
    refused = next(r for r in answers if r.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
    assert asyncio.run(wait_idle(Target(guarded.url)))["idle"] is True


@pytest.fixture(scope="module")
def timed():
    # 3 s: ample to admit a request on a loaded machine, as the stream in the test below must be
    s = RunningServer("--request-timeout", "3", "--dtype", "float32")
    yield s
    s.stop()


def test_a_request_past_its_timeout_is_aborted_with_504(timed):
    """The timeout runs from arrival; a stopped core makes sure no request can finish in time on any CPU."""
    long = {"prompt": "to be", "max_tokens": 64, "ignore_eos": True}
    with timed.core_stopped():  # not even admitted in time: 504 as the answer's status, streamed or not
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda b: httpx.post(f"{timed.url}/v1/completions", json=b, timeout=60),
                                    [long, {**long, "stream": True}]))
    for answer in answers:
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout", answer.text
    with httpx.stream("POST", f"{timed.url}/v1/completions", json={**long, "max_tokens": 2000, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 200  # admitted: the status line is out, so the timeout ends the stream
        with timed.core_stopped():
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
    assert asyncio.run(wait_idle(Target(timed.url)))["idle"] is True
    r = httpx.post(f"{timed.url}/v1/completions", json={"prompt": "to be", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


def test_a_model_fault_fails_only_its_request(nan_model):
    s = RunningServer("--model", str(nan_model), "--dtype", "float32")
    try:
        bad = {"prompt": [POISON, 11, 12, 13], "max_tokens": 8}
        good = {"prompt": [21, 22, 23, 24], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(f"{s.url}/v1/completions", json=good, timeout=30).json()["choices"][0]["text"]

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(c.post("/v1/completions", json=bad),
                                            c.post("/v1/completions", json=good),
                                            c.post("/v1/completions", json={**bad, "stream": True}))
        failed, ok, streamed = asyncio.run(go())
        assert failed.status_code == 500 and "NaN" in failed.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == alone
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == 500 and events[-1] == "[DONE]"
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert asyncio.run(wait_idle(Target(s.url)))["idle"] is True
    finally:
        s.stop()


def test_root_path_behind_a_prefix_stripping_proxy():
    s = RunningServer("--root-path", "/llm", "--api-key", "k")
    try:  # the proxy forwards /llm/v1/models as /v1/models; open routes stay open, the others need the key
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{s.url}/openapi.json").json()["servers"] == [{"url": "/llm"}]
    finally:
        s.stop()
