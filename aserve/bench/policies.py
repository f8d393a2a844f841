"""`aserve bench policies`: replay one workload against several scheduling policies and compare them.

The workload (arrival times, prompt and output lengths, priorities) comes from a JSONL trace or is made
up (`--synthetic`). Each policy gets a fresh engine with the same KV cache, by default small enough that
requests must be preempted, and the same arrivals in real time. One table compares throughput, time to
first token per priority class, preemptions by mode, swapped blocks and recomputed tokens.

Trace lines: {"arrival": seconds, "prompt_len": int, "output_len": int, "priority": int}
(or "prompt_token_ids": [...] instead of "prompt_len").
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from aserve.config import add_engine_arguments, engine_options, parse_memory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="fcfs,fcfs-swap,priority", help="comma-separated policy names/specs")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", default=None, help="a JSONL workload file")
    source.add_argument("--synthetic", action="store_true", help="make up a workload (the default)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--input-len", default="16:192", help="prompt lengths, uniform in MIN:MAX")
    parser.add_argument("--output-len", default="16:96", help="output lengths, uniform in MIN:MAX")
    parser.add_argument("--urgent-fraction", type=float, default=0.25, help="share of requests with priority 0 "
                                                                            "(the rest get priority 1)")
    parser.add_argument("--json", default=None, metavar="FILE")
    # kv_cache_memory and swap_space also take `auto`: a quarter of what the whole workload would hold at
    # once, and as much host memory as that (so requests must be preempted, and swapping can take them all)
    add_engine_arguments(parser, exclude=("policy", "policy_options"),
                         defaults={"kv_cache_memory": "auto", "swap_space": "auto", "max_num_seqs": 64})


@dataclass
class TraceRequest:
    arrival: float
    prompt_token_ids: list[int]
    output_len: int
    priority: int


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def synthetic(args, vocab_size: int) -> list[TraceRequest]:
    rng = random.Random(args.seed)
    in_lo, in_hi = _range(args.input_len)
    out_lo, out_hi = _range(args.output_len)
    t, workload = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.request_rate)
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(in_lo, in_hi))]
        workload.append(TraceRequest(t, prompt, rng.randint(out_lo, out_hi),
                                     0 if rng.random() < args.urgent_fraction else 1))
    return workload


def load_trace(path: str, vocab_size: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    workload = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ids = item.get("prompt_token_ids") or [rng.randrange(1, vocab_size) for _ in range(int(item["prompt_len"]))]
            workload.append(TraceRequest(float(item["arrival"]), ids, int(item["output_len"]),
                                         int(item.get("priority", 0))))
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: a trace line needs arrival, prompt_len (or prompt_token_ids) and "
                             f"output_len: {exc}") from None
    return sorted(workload, key=lambda r: r.arrival)


def replay(engine, workload: list[TraceRequest]) -> dict:
    """Feed arrivals in real time, step while there is work; return per-request timings and engine stats."""
    from aserve.sampling_params import SamplingParams

    pending = list(enumerate(workload))
    requests = {}
    start = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][1].arrival <= now:
            i, item = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=item.output_len, ignore_eos=True)
            rid = engine.add_request(item.prompt_token_ids, params, request_id=f"req-{i}", priority=item.priority,
                                     arrival_time=start + item.arrival, output_kind="final")
            requests[rid] = engine.requests[rid][0]
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0][1].arrival - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    ttft: dict[int, list[float]] = {}
    for req in requests.values():
        ttft.setdefault(req.priority, []).append(req.first_token_time - req.arrival_time)
    stats = engine.scheduler.stats()
    output_tokens = sum(r.num_output_tokens for r in requests.values())
    return {"duration_s": elapsed, "output_throughput": output_tokens / elapsed,
            "ttft_s": {prio: {"p50": _pct(v, 0.5), "p99": _pct(v, 0.99), "mean": statistics.fmean(v)}
                       for prio, v in sorted(ttft.items())},
            "preemptions": stats.preemptions, "blocks_swapped_out": stats.blocks_swapped_out,
            "blocks_swapped_in": stats.blocks_swapped_in, "recomputed_tokens": stats.recomputed_tokens}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def auto_kv_budget(model_dir: str, workload: list[TraceRequest], block_size: int, dtype: str) -> int:
    from aserve.models.loader import read_json

    config = read_json(Path(model_dir) / "config.json")
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if dtype == "float32" or (dtype == "auto" and str(config.get("torch_dtype")) == "float32") else 2
    per_block = 2 * config["num_hidden_layers"] * block_size * heads * head_dim * itemsize
    blocks = [-(-(len(r.prompt_token_ids) + r.output_len) // block_size) for r in workload]
    return max(sum(blocks) // 4, max(blocks) + 1) * per_block


def print_table(results: dict[str, dict]) -> None:
    classes = sorted({prio for r in results.values() for prio in r["ttft_s"]})
    headers = ["policy", "out tok/s"] + [f"TTFT p50/p99 prio {c} (s)" for c in classes] + [
        "preempt recompute/swap", "blocks out/in", "recomputed tok"]
    rows = []
    for name, r in results.items():
        ttft = [f"{r['ttft_s'][c]['p50']:.2f} / {r['ttft_s'][c]['p99']:.2f}" if c in r["ttft_s"] else "-"
                for c in classes]
        rows.append([name, f"{r['output_throughput']:.1f}", *ttft,
                     f"{r['preemptions'].get('recompute', 0)} / {r['preemptions'].get('swap', 0)}",
                     f"{r['blocks_swapped_out']} / {r['blocks_swapped_in']}", str(r["recomputed_tokens"])])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = " | ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))


def main(args: argparse.Namespace) -> None:
    from aserve.config import DEFAULT_MODEL_DIR, EngineConfig, check_before_loading

    options = engine_options(args)
    model_dir = options["model"] = options["model"] or str(DEFAULT_MODEL_DIR)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:  # every policy, and the model folder, before anything (torch) loads
        check_before_loading(model_dir, policy)
    from aserve.engine.engine_core import EngineCore
    from aserve.models.loader import load_tokenizer
    vocab_size = len(load_tokenizer(model_dir))
    workload = load_trace(args.trace, vocab_size, args.seed) if args.trace else synthetic(args, vocab_size)
    if options["kv_cache_memory"] == "auto":
        options["kv_cache_memory"] = auto_kv_budget(model_dir, workload, options["block_size"], options["dtype"])
    if options["swap_space"] == "auto":
        options["swap_space"] = f"{parse_memory(options['kv_cache_memory'])}B"
    results = {}
    for policy in policies:
        engine = EngineCore(EngineConfig(**options, policy=policy))
        print(f"replaying {len(workload)} requests with policy {policy} ...", flush=True)
        results[policy] = replay(engine, workload)
        del engine
    print()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload_requests": len(workload),
                                               "kv_cache_memory": options["kv_cache_memory"],
                                               "results": results}, indent=2))
