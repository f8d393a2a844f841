"""`aserve bench serve`: an online benchmark against a running OpenAI-compatible server.

Random token-id prompts of fixed lengths with `ignore_eos` (the workload of `aserve bench throughput`),
sent at a Poisson rate (or all at once) as streaming completions; it reports throughput and
TTFT / TPOT / ITL / end-to-end latency in the layout of vLLM's `bench serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from aserve.bench.sampling import add_sampling_arguments, sampling_options
from aserve.bench.throughput import random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model name (default: the server's first model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-repeats", type=int, default=1, metavar="N",
                        help="each prompt a random passage of input-len / N tokens given N times (a prompt that "
                             "quotes itself: where speculative decoding pays)")
    add_sampling_arguments(parser)
    parser.add_argument("--api-key", default=os.environ.get("ASERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client, url, body, headers) -> RequestResult:
    """One streaming request. Chunks are split by hand and only the usage chunk is parsed as JSON: the
    client shares the machine with the server, so its CPU time is kept small."""
    start = time.perf_counter()
    last, result = start, RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            buffer = b""
            async for data in resp.aiter_bytes():
                now = time.perf_counter()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    if b'"choices":[{' in event:  # as vLLM counts: every chunk, even one whose text is empty
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                    elif b'"usage":{' in event:
                        result.output_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": pick(0.9), "p99": pick(0.99)}


async def describe_server(client) -> str:
    """The first line: the hardware and dtype the figures come from. An aserve server says (GET /state, which
    is behind the API key: `client` carries it); for another server (vLLM's), this machine's CPU is named and
    the dtype is whatever that server chose."""
    from aserve.hardware import cpu_info

    try:
        state = (await client.get("/state")).json()
        return f"aserve bench serve: server on {state['hardware']}, dtype {state['dtype']}"
    except Exception:  # noqa: BLE001 - not an aserve server
        return f"aserve bench serve: client on {cpu_info().describe()}, server dtype not reported"


async def run(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        print(await describe_server(client), flush=True)
        model = args.model or card["id"]
        prompts = random_prompts(args.num_prompts, args.input_len, card.get("vocab_size", 1000), {0}, args.seed,
                                 args.prompt_repeats)
        rng = random.Random(args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def send(prompt):
            async with gate:
                body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                        **sampling_options(args), "stream": True, "stream_options": {"include_usage": True}}
                return await _one(client, "/v1/completions", body, {})

        drafts_before = await _spec_counters(client)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        drafts_after = await _spec_counters(client)
    summary = summarize(results, duration)
    if drafts_before and drafts_after and drafts_after["num_drafts"] > drafts_before["num_drafts"]:
        summary["speculative"] = {name: drafts_after[name] - drafts_before[name] for name in drafts_after}
    return summary


async def _spec_counters(client) -> dict[str, float] | None:
    """The server's speculative-decoding counters (its /metrics), so the report can say how much was accepted
    during the run; None where the server has none (no speculation, or not an aserve server)."""
    try:
        text = (await client.get("/metrics")).text
    except Exception:  # noqa: BLE001 - not every server has them
        return None
    found = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"aserve:spec_decode_{name}_total"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found if len(found) == 3 else None


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    total_in = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (total_in + output) / duration,
        "ttft_ms": {k: v * 1000 for k, v in _percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1000 for k, v in _percentiles(tpot).items()},
        "itl_ms": {k: v * 1000 for k, v in _percentiles([x for r in ok for x in r.itl]).items()},
        "e2el_ms": {k: v * 1000 for k, v in _percentiles([r.e2e for r in ok]).items()},
    }


def print_report(s: dict) -> None:
    def line(label, value):
        print(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    line("Successful requests:", s["successful_requests"])
    line("Failed requests:", s["failed_requests"])
    line("Benchmark duration (s):", s["duration_s"])
    line("Total input tokens:", s["total_input_tokens"])
    line("Total generated tokens:", s["total_output_tokens"])
    line("Request throughput (req/s):", s["request_throughput"])
    line("Output token throughput (tok/s):", s["output_throughput"])
    line("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        print("{s:{c}^50}".format(s=title, c="-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            line(f"{name} {short} (ms):", s[key][stat])
    spec = s.get("speculative")
    if spec:
        print("{s:{c}^50}".format(s="Speculative Decoding", c="-"))
        line("Drafts:", int(spec["num_drafts"]))
        line("Draft tokens:", int(spec["num_draft_tokens"]))
        line("Acceptance rate (%):", 100 * spec["num_accepted_tokens"] / max(1, spec["num_draft_tokens"]))
        line("Mean acceptance length:", 1 + spec["num_accepted_tokens"] / max(1, spec["num_drafts"]))
    print("=" * 50)
    for error in s["errors"]:
        print(f"error: {error}")


def main(args: argparse.Namespace) -> None:
    summary = asyncio.run(run(args))
    print_report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "api_key"}, **summary}, f, indent=2,
                      default=str)

