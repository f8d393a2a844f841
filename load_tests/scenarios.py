"""The scenarios. Each is bounded in requests and time, and ends by checking that the server is idle and
still serves a good request. Every function takes a Target and its options and returns a Summary."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from load_tests.client import Result, completion, http_request, raw, text_prompt
from load_tests.report import Summary


@dataclass
class Target:
    url: str
    api_key: str | None = None
    model: str | None = None
    max_model_len: int = 2048

    @property
    def host_port(self) -> tuple[str, int]:
        u = httpx.URL(self.url)
        return u.host, u.port or 80

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 300.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=2000, max_keepalive_connections=100))

    async def discover(self) -> "Target":
        async with self.client(30) as c:
            card = (await c.get("/v1/models")).json()["data"][0]
        self.model = self.model or card["id"]
        self.max_model_len = card.get("max_model_len") or self.max_model_len
        return self


async def state(target: Target, diagnostics: bool = False) -> dict | None:
    """The server's /state; `diagnostics` asks for the core's heap and Python object counts too (costly to
    measure, so the server measures them at most every few seconds)."""
    async with target.client(10) as c:
        r = await c.get("/state", params={"diagnostics": "1"} if diagnostics else None)
    return r.json() if r.status_code == 200 else None


async def wait_idle(target: Target, timeout: float = 60.0) -> dict:
    """Poll /state until nothing is live and every block is free; report what is left if that never comes."""
    deadline = time.monotonic() + timeout
    s = None
    while time.monotonic() < deadline:
        s = await state(target)
        if s is None:
            return {"idle": "unknown: the server has no /state"}
        if (s["num_live_requests"] == 0 and s.get("num_collectors", 0) == 0 and s["num_running"] == 0
                and s["num_waiting"] == 0 and s["num_swapped"] == 0 and s["num_free_blocks"] == s["num_blocks"]
                and s["num_free_host_blocks"] == s["num_host_blocks"]):
            break
        await asyncio.sleep(0.2)
    return {"idle": s is not None and s["num_live_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"],
            "blocks_leaked": s["num_blocks"] - s["num_free_blocks"],
            "host_blocks_leaked": s["num_host_blocks"] - s["num_free_host_blocks"],
            "live_requests": s["num_live_requests"], "live_collectors": s.get("num_collectors", 0)}


async def good_request_served(target: Target) -> bool:
    async with target.client(60) as c:
        r = await completion(c, {"model": target.model, "prompt": "to be or not", "max_tokens": 4, "temperature": 0})
    return r.status == 200


async def finish(name: str, target: Target, started: float, results: list[Result], **extra) -> Summary:
    duration = time.perf_counter() - started
    checks = await wait_idle(target)
    checks["good_request_served"] = await good_request_served(target)
    checks["no_5xx"] = not any(isinstance(r.status, int) and r.status >= 500 and r.status not in r.expected
                               for r in results)
    return Summary(name, duration, results, checks, extra)


def body(target: Target, rng: random.Random, words: int, max_tokens: int, stream: bool = True, **fields) -> dict:
    b = {"model": target.model, "prompt": text_prompt(rng, words), "max_tokens": max_tokens, "stream": stream,
         "ignore_eos": True, **fields}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


async def poisson(rate: float, count: int, rng: random.Random, make):
    """Start `make(i)` at Poisson arrivals of `rate` per second (all at once if rate is inf); gather them."""
    tasks = []
    for i in range(count):
        tasks.append(asyncio.ensure_future(make(i)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


# -- scenarios ------------------------------------------------------------------------------------

async def steady(target: Target, num_requests: int = 100, rate: float = 4.0, input_words: int = 64,
                 max_tokens: int = 64, seed: int = 0) -> Summary:
    rng = random.Random(seed)
    started = time.perf_counter()
    async with target.client() as c:
        results = await poisson(rate, num_requests, rng,
                                lambda i: completion(c, body(target, rng, input_words, max_tokens)))
    return await finish("steady", target, started, results, rate=rate)


async def burst(target: Target, num_requests: int = 64, input_words: int = 32, max_tokens: int = 32,
                check_alone: bool = False, seed: int = 0) -> Summary:
    """N greedy requests at once; with check_alone, each prompt again by itself: the texts must be equal.
    Compare in float32: in bfloat16 two candidate logits often round to the same value, and which one wins
    can then depend on the batch's matmul shape (seen once in 64: ' am' vs ' have', both -2.5962)."""
    rng = random.Random(seed)
    bodies = [body(target, rng, rng.randint(4, input_words), max_tokens, stream=i % 2 == 0, temperature=0)
              for i in range(num_requests)]
    started = time.perf_counter()
    async with target.client() as c:
        results = list(await asyncio.gather(*[completion(c, b) for b in bodies]))
        duration = time.perf_counter() - started
        summary = await finish("burst", target, started, results)
        summary.duration_s = duration
        if check_alone:
            alone = [await completion(c, dict(b, stream=False)) for b in bodies]
            mismatched = [i for i, (a, b) in enumerate(zip(results, alone)) if a.text != b.text]
            summary.checks["outputs_equal_alone"] = not mismatched
            summary.extra["mismatched"] = mismatched
    return summary


async def long_prompts(target: Target, num_requests: int = 8, max_tokens: int = 16, seed: int = 0) -> Summary:
    """Prompts just under max_model_len (sized with /tokenize, sent as token ids), plus one just over it (400)."""
    rng = random.Random(seed)
    async with target.client() as c:
        text = text_prompt(rng, 2 * target.max_model_len)
        ids = (await c.post("/tokenize", json={"model": target.model, "prompt": text})).json()["tokens"]
        fit = target.max_model_len - max_tokens
        bodies = [{"model": target.model, "prompt": ids[i:i + fit], "max_tokens": max_tokens, "ignore_eos": True}
                  for i in range(num_requests)]
        started = time.perf_counter()
        results = list(await asyncio.gather(*[completion(c, b) for b in bodies]))
        over = await completion(c, {"model": target.model, "prompt": ids[:target.max_model_len], "max_tokens": 1},
                                kind="over-max-model-len")
        over.expected = (400,)
        results.append(over)
    return await finish("long_prompts", target, started, results, prompt_tokens=fit)


async def priorities(target: Target, num_requests: int = 64, rate: float = 32.0, max_tokens: int = 64,
                     seed: int = 0) -> Summary:
    """Alternating priority 0 (urgent) and 1 under load; run the server with --policy priority and a low
    --max-num-seqs, so requests queue and the policy has choices to make."""
    rng = random.Random(seed)
    started = time.perf_counter()
    async with target.client() as c:
        results = await poisson(rate, num_requests, rng, lambda i: completion(
            c, body(target, rng, 48, max_tokens, priority=i % 2)))
    ttft = {}
    for prio in (0, 1):
        values = sorted(r.ttft for r in results if r.priority == prio and r.ttft is not None)
        ttft[f"priority_{prio}_ttft_p50_s"] = values[len(values) // 2] if values else None
    return await finish("priorities", target, started, results, **ttft)


async def metric_values(target: Target, names: tuple[str, ...]) -> dict[str, float]:
    async with target.client(10) as c:
        text = (await c.get("/metrics")).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name):
                key = line.rsplit(" ", 1)[0].replace(f',model_name="{target.model}"', "")
                values[key] = float(line.rsplit(" ", 1)[1])
    return values


PRESSURE_METRICS = ("aserve:num_preemptions_total", "aserve:swapped_blocks_total", "aserve:recomputed_tokens_total")


async def swap_pressure(target: Target, num_requests: int = 24, max_tokens: int = 128, seed: int = 0) -> Summary:
    """More long generations at once than the cache holds; run the server with --policy fcfs-swap and a small
    --kv-cache-memory. Reports the preemption and swap counters the run moved."""
    rng = random.Random(seed)
    before = await metric_values(target, PRESSURE_METRICS)
    started = time.perf_counter()
    async with target.client() as c:
        results = list(await asyncio.gather(*[completion(c, body(target, rng, 48, max_tokens))
                                              for _ in range(num_requests)]))
    summary = await finish("swap_pressure", target, started, results)
    after = await metric_values(target, PRESSURE_METRICS)
    summary.extra["counters"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    return summary


async def disconnect_storm(target: Target, num_clients: int = 60, max_tokens: int = 64, seed: int = 0) -> Summary:
    """Clients that vanish mid-stream, right after sending (before the first token) and halfway through the body."""
    rng = random.Random(seed)
    host, port = target.host_port
    started = time.perf_counter()

    async def one(i: int, c: httpx.AsyncClient) -> Result:
        b = body(target, rng, 32, max_tokens)
        if i % 3 == 0:
            return await completion(c, b, kind="disconnect-mid-stream", stop_after_chunks=rng.randint(1, 4))
        payload = json.dumps(b).encode()
        if i % 3 == 1:
            return await raw(host, port, http_request("/v1/completions", payload, headers=target.headers),
                             "disconnect-before-first-token", hang_up_after_send=True)
        cut = http_request("/v1/completions", payload[:len(payload) // 2], content_length=len(payload),
                           headers=target.headers)
        return await raw(host, port, cut, "disconnect-mid-body", hang_up_after_send=True)

    before = await metric_values(target, ("aserve:request_success_total",))
    async with target.client() as c:
        results = list(await asyncio.gather(*[one(i, c) for i in range(num_clients)]))
    for r in results:
        r.expected = ("closed-by-client",)
    summary = await finish("disconnect_storm", target, started, results)
    after = await metric_values(target, ("aserve:request_success_total",))
    summary.extra["finished_by_reason"] = {k.split('"')[1]: v - before.get(k, 0.0) for k, v in after.items()
                                           if v - before.get(k, 0.0)}  # the good request of the final check is one
    return summary


def malformed_cases(target: Target) -> list[tuple[str, bytes, str | None, tuple]]:
    """(kind, body, content type, expected statuses)."""
    m = json.dumps(target.model)
    return [
        ("bad-json", b'{"prompt": "to be", "max_tokens": ', "application/json", (400,)),
        ("not-an-object", b'[1, 2, 3]', "application/json", (400,)),
        ("wrong-types", f'{{"model": {m}, "prompt": 5, "max_tokens": "many"}}'.encode(), "application/json", (400,)),
        ("huge-int", f'{{"model": {m}, "prompt": "to be", "max_tokens": {10 ** 40}}}'.encode(), "application/json",
         (400,)),
        ("huge-float", f'{{"model": {m}, "prompt": "to be", "temperature": 1e400}}'.encode(), "application/json",
         (400,)),
        ("huge-n", f'{{"model": {m}, "prompt": "to be", "n": 1000000}}'.encode(), "application/json", (400,)),
        ("negative-max-tokens", f'{{"model": {m}, "prompt": "to be", "max_tokens": -5}}'.encode(),
         "application/json", (400,)),
        ("invalid-utf8", b'{"prompt": "to be \xff\xfe or not", "max_tokens": 2}', "application/json", (400,)),
        ("empty-body", b"", "application/json", (400,)),
        ("form-encoded", b"prompt=to+be&max_tokens=2", "application/x-www-form-urlencoded", (400,)),
        ("json-as-text-plain", f'{{"model": {m}, "prompt": "to be", "max_tokens": 2}}'.encode(), "text/plain",
         (200, 415)),
        ("no-content-type", f'{{"model": {m}, "prompt": "to be", "max_tokens": 2}}'.encode(), None, (200, 415)),
        ("10MB-body", b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}', "application/json", (413,)),
        ("huge-logprobs", f'{{"model": {m}, "prompt": "to be", "logprobs": 999}}'.encode(), "application/json",
         (400,)),
    ]


async def malformed(target: Target, rounds: int = 3, good_per_round: int = 8, slow_clients: int = 2,
                    stall: bool = False, seed: int = 0) -> Summary:
    """Broken requests interleaved with good ones: every broken one gets its 4xx, every good one its 200.
    Slow clients dribble a valid body (200) or read a stream slowly; with `stall`, one stops halfway and must
    get 408 (this takes the server's --body-timeout)."""
    rng = random.Random(seed)
    host, port = target.host_port
    cases = malformed_cases(target)
    started = time.perf_counter()
    async with target.client() as c:
        tasks = []
        for _ in range(rounds):
            for kind, payload, ctype, expected in cases:
                tasks.append(raw(host, port, http_request("/v1/completions", payload, ctype, headers=target.headers),
                                 kind, expected))
            tasks += [completion(c, body(target, rng, 16, 16, stream=bool(i % 2))) for i in range(good_per_round)]
        good = json.dumps(body(target, rng, 8, 4, stream=False)).encode()
        for _ in range(slow_clients):
            tasks.append(raw(host, port, http_request("/v1/completions", good, headers=target.headers),
                             "slow-client", (200,), pace=(16, 0.05)))
            tasks.append(completion(c, body(target, rng, 8, 24), kind="slow-reader", read_delay=0.05))
        # Over-limit bodies must get their 413, not a reset: sent fast, dribbled slowly, and chunked (no length)
        big = b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
        tasks.append(raw(host, port, http_request("/v1/completions", big, headers=target.headers),
                         "10MB-body-slow", (413,), pace=(256 * 1024, 0.02)))
        tasks.append(raw(host, port, http_request("/v1/completions", big, headers=target.headers, chunked=True),
                         "10MB-body-chunked", (413,)))
        if stall:
            tasks.append(raw(host, port, http_request("/v1/completions", good[:10], content_length=len(good),
                                                      headers=target.headers), "stalled-body", (408,),
                             read_timeout=120))
        rng.shuffle(tasks)
        results = list(await asyncio.gather(*tasks))
    return await finish("malformed", target, started, results)


async def soak(target: Target, duration_s: float = 600.0, rate: float = 3.0, seed: int = 0) -> Summary:
    """Mixed traffic for `duration_s`: streamed and plain completions, chat, n=2, priorities, clients that vanish,
    malformed bodies. Ends with the server's own state: idle, no blocks leaked, and its memory then vs at start."""
    rng = random.Random(seed)
    host, port = target.host_port
    cases = malformed_cases(target)
    start_state = await state(target, diagnostics=True)
    started = time.perf_counter()
    results: list[Result] = []
    tasks: set[asyncio.Task] = set()

    async def one(c: httpx.AsyncClient) -> None:
        x = rng.random()
        if x < 0.45:
            r = await completion(c, body(target, rng, rng.randint(8, 200), rng.randint(8, 128)))
        elif x < 0.60:
            r = await completion(c, {"model": target.model, "max_tokens": rng.randint(8, 64), "priority": rng.randint(0, 1),
                                     "messages": [{"role": "user", "content": text_prompt(rng, 30)}]},
                                 path="/v1/chat/completions")
        elif x < 0.70:
            r = await completion(c, body(target, rng, 24, 32, stream=False, n=2, temperature=0.8, seed=rng.randint(0, 99)))
        elif x < 0.85:
            r = await completion(c, body(target, rng, 24, 128), kind="disconnect-mid-stream",
                                 stop_after_chunks=rng.randint(1, 8))
            r.expected = ("closed-by-client",)
        else:
            kind, payload, ctype, expected = rng.choice(cases[:-3])  # the 10 MB body is in the malformed scenario
            r = await raw(host, port, http_request("/v1/completions", payload, ctype, headers=target.headers),
                          kind, expected)
        results.append(r)

    # (seconds, server RSS, core RSS, core heap bytes in use, core Python objects) each minute: a leak
    # climbs steadily; a warming cache or allocator levels off
    timeline = []
    next_sample = 0.0
    async with target.client() as c:
        while (elapsed := time.perf_counter() - started) < duration_s:
            if elapsed >= next_sample and start_state is not None:
                now = await state(target, diagnostics=True)
                timeline.append((round(elapsed), now.get("server_rss_bytes"), now.get("core_rss_bytes"),
                                 (now.get("core_heap_bytes") or {}).get("in_use"), now.get("core_python_objects")))
                next_sample += 60.0
            task = asyncio.ensure_future(one(c))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*list(tasks))
    summary = await finish("soak", target, started, results)
    end_state = await state(target, diagnostics=True)
    if start_state and end_state:
        summary.extra["memory"] = {k: {"start": start_state.get(k), "end": end_state.get(k)}
                                   for k in ("server_rss_bytes", "core_rss_bytes", "core_heap_bytes",
                                             "core_python_objects")}
        summary.extra["memory_timeline"] = timeline
    return summary


SCENARIOS = {"steady": steady, "burst": burst, "long_prompts": long_prompts, "priorities": priorities,
             "swap_pressure": swap_pressure, "disconnect_storm": disconnect_storm, "malformed": malformed,
             "soak": soak}
# What `--launch` starts the server with for each scenario (scenarios not listed need nothing special).
SERVER_ARGS = {"burst": ["--dtype", "float32"],
               "priorities": ["--policy", "priority", "--max-num-seqs", "4"],
               "swap_pressure": ["--policy", "fcfs-swap", "--kv-cache-memory", "1MiB", "--swap-space", "0.05"],
               "malformed": ["--body-timeout", "3"],
               # a small cache, so every block has been touched (paged in) within the first minute and the
               # core's memory levels off unless something leaks
               "soak": ["--max-waiting-requests", "64", "--kv-cache-memory", "64MiB"]}
