#!/usr/bin/env python3
"""Output tokens a second of each weight format at one batch size, in one process, alternated round by round.

--batch prompts of --input-len tokens, --output-len greedy tokens each (ignore_eos), through an engine per format:
dense, int8, int8 with its head (--quantize-lm-head), GPTQ int4, GPTQ with an int8 head, and GPTQ quantized with its
head (gptq4h: a checkpoint whose lm_head is int4 too, as GPTQModel's lm_head=True writes it). Each round runs every
format once, in turn, so a VM whose speed drifts slows all of them alike; the last lines are each format's median
output rate and its ratio to the first format's, and every round's ratios. Every prompt of the run is new to the
engines' prefix caches (prompt_sets), so each round prefills its prompts as the first one does. A format named with
"@4k" (dense@4k) is the same engine with its weights left in 4 KiB pages (ASERVE_HUGE_PAGE_WEIGHTS=0 while it
loads), to measure what the 2 MiB pages give; with "@8steps" (gptq4h@8steps) it decodes 8 steps a scheduling
(num_scheduler_steps=8); with "@fp8kv" (dense@fp8kv) its KV cache is FP8 (kv_cache_dtype="fp8"), to set an FP8
cache against the model's dtype in one process. Any of them may follow one name (dense@4k@8steps).

    python benchmarks/weight_formats.py --model /tmp/bench-model [--gptq DIR] [--rounds 5] [--formats dense,gptqh]
    python benchmarks/weight_formats.py --model /tmp/bench-model --batch 64 --output-len 128 --formats dense,int8
    python benchmarks/weight_formats.py --model /tmp/bench-model --formats dense,dense@4k,gptqh,gptqh@4k
    python benchmarks/weight_formats.py --model /tmp/bench-model --formats dense,dense@8steps,gptq4h,gptq4h@8steps
    python benchmarks/weight_formats.py --model /tmp/bench-model --formats dense@8steps,gptq4h@8steps --probe 60
    python benchmarks/weight_formats.py --model /tmp/bench-model --batch 64 --output-len 128 --formats dense,dense@fp8kv

Without --gptq (--gptq-head), a round-to-nearest GPTQ copy (with its head) is written to a temporary folder first
(aserve.bench.quantize_rtn, as `aserve bench quality` writes it; group size 64 for the bench model).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

FORMATS = {  # name: (the checkpoint it loads, engine options)
    "dense": ("model", {}),
    "int8": ("model", {"quantization": "int8"}),
    "int8h": ("model", {"quantization": "int8", "quantize_lm_head": True}),
    "gptq": ("gptq", {}),
    "gptqh": ("gptq", {"quantize_lm_head": True}),
    "gptq4h": ("gptq_head", {}),
}


def parse_format(name: str) -> tuple[str, bool, int, str] | None:
    """A format's name as (the FORMATS entry, weights in 4 KiB pages, decode steps a scheduling, the KV cache's
    dtype); None where it is not one."""
    base, *suffixes = name.split("@")
    small_pages, steps, kv = False, 1, "auto"
    for suffix in suffixes:
        if suffix == "4k" and not small_pages:
            small_pages = True
        elif suffix.endswith("steps") and suffix[:-5].isdigit() and int(suffix[:-5]) >= 1 and steps == 1:
            steps = int(suffix[:-5])
        elif suffix == "fp8kv" and kv == "auto":
            kv = "fp8"
        else:
            return None
    return (base, small_pages, steps, kv) if base in FORMATS else None


def load(name: str, checkpoints: dict[str, str], dtype: str):
    """The engine of format `name` on its checkpoint (model, gptq or gptq_head: a folder); with "@4k", its weights
    left in 4 KiB pages; with "@Nsteps", N decode steps a scheduling; with "@fp8kv", an FP8 KV cache."""
    from aserve import LLM

    base, small_pages, steps, kv = parse_format(name)
    checkpoint, options = FORMATS[base]
    before = os.environ.get("ASERVE_HUGE_PAGE_WEIGHTS")
    if small_pages:
        os.environ["ASERVE_HUGE_PAGE_WEIGHTS"] = "0"
    try:
        return LLM(checkpoints[checkpoint], dtype=dtype, disable_log_stats=True, num_scheduler_steps=steps,
                   kv_cache_dtype=kv, **options)
    finally:
        if before is None:
            os.environ.pop("ASERVE_HUGE_PAGE_WEIGHTS", None)
        else:
            os.environ["ASERVE_HUGE_PAGE_WEIGHTS"] = before


def prompt_sets(count: int, batch: int, input_len: int) -> list[list[list[int]]]:
    """`count` sets of `batch` prompts, no two alike in their first token, so that no run finds a prompt's blocks in
    its engine's prefix cache (prompt j's tokens step by 1 from 1000 + 7919 j mod 30000; 7919 is prime). Reusing one
    set every round had decoded rounds after the first without their prefill, and the warm-up's prompt at batch 1."""
    return [[[1000 + ((s * batch + b) * 7919 + i) % 30000 for i in range(input_len)] for b in range(batch)]
            for s in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a 16/32-bit checkpoint (the bench model)")
    parser.add_argument("--gptq", help="its GPTQ copy (default: written to a temporary folder)")
    parser.add_argument("--gptq-head", help="its GPTQ copy with the LM head quantized too (quantize_rtn --lm-head; "
                                            "default: written to a temporary folder)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--probe", type=float, metavar="GBPS",
                        help="read the memory bandwidth (the roofline's probe, best of 3 reads of 1 GiB) before and "
                             "after each round, and give the medians again over the rounds whose both readings reach "
                             "GBPS: a VM whose memory switches between two speeds gives each its own figures")
    args = parser.parse_args()
    names = args.formats.split(",")
    unknown = [n for n in names if parse_format(n) is None]
    if unknown:
        parser.error(f"unknown format {unknown[0]!r}; choose from {', '.join(FORMATS)} (each also with @4k, "
                     f"@Nsteps and @fp8kv)")

    from aserve import SamplingParams
    from aserve.bench.roofline import bandwidth_buffer, read_rate
    from aserve.hardware import cpu_info

    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as scratch:
        from aserve.bench.quantize_rtn import write_rtn_checkpoint

        checkpoints = {"model": args.model, "gptq": args.gptq, "gptq_head": args.gptq_head}
        for name in {FORMATS[parse_format(n)[0]][0] for n in names} - {"model"}:
            if checkpoints[name] is None:
                checkpoints[name] = f"{scratch}/{name}"
                write_rtn_checkpoint(args.model, checkpoints[name], "gptq", lm_head=name == "gptq_head")
        engines = {n: load(n, checkpoints, args.dtype) for n in names}
        first = next(iter(engines.values()))
        print(f"weight_formats: {cpu_info().describe()}, dtype {str(first.engine.dtype).replace('torch.', '')}; "
              f"{args.batch} x {args.input_len}/{args.output_len}, {args.rounds} rounds")
        *rounds, warm = [[{"prompt_token_ids": p} for p in prompts]
                         for prompts in prompt_sets(args.rounds + 1, args.batch, args.input_len)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        rates: dict[str, list[float]] = {n: [] for n in names}
        probes: list[tuple[float, float]] = []
        buffer = bandwidth_buffer(1024) if args.probe is not None else None
        for prompts in rounds:
            before = max(read_rate(buffer) for _ in range(3)) if buffer is not None else None
            for name, llm in engines.items():
                llm.generate(warm[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(args.batch * args.output_len / (time.perf_counter() - start))
            line = "round: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items())
            if buffer is not None:
                probes.append((before, max(read_rate(buffer) for _ in range(3))))
                line += f"; bandwidth {probes[-1][0]:.1f} GB/s before, {probes[-1][1]:.1f} after"
            print(line, flush=True)
    summarize(rates, names[0], "")
    if args.probe is not None:
        kept = [i for i, pair in enumerate(probes) if min(pair) >= args.probe]
        if kept:
            summarize({n: [r[i] for i in kept] for n, r in rates.items()}, names[0],
                      f"the {len(kept)} rounds at >= {args.probe:g} GB/s: ")
        else:
            print(f"no round read >= {args.probe:g} GB/s before and after")


def summarize(rates: dict[str, list[float]], first: str, label: str) -> None:
    base = rates[first]
    print(f"{label}median output tok/s (ratio to {first}): " + ", ".join(
        f"{n} {statistics.median(r):.1f} ({statistics.median(r) / statistics.median(base):.2f}x)"
        for n, r in rates.items()))
    print(f"{label}ratios by round: " + ", ".join(f"{n} " + " / ".join(f"{a / b:.2f}" for a, b in zip(r, base))
                                                  for n, r in rates.items()))


if __name__ == "__main__":
    main()
