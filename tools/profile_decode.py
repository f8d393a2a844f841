"""Where a decode step's time goes: N requests prefilled, then `--steps` decode steps under torch.profiler,
self CPU time grouped by what the op does. The decode profiles in docs/performance.md come from this script.

    python tools/profile_decode.py --model /tmp/bench-model --dtype bfloat16            # as shipped
    ASERVE_CPU_KERNELS=0 ASERVE_PREPACK=0 python tools/profile_decode.py ...            # the plain torch path
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

GROUPS = [  # (label, substrings of op names), first match wins
    ("linear layers (GEMM)", ("linear", "addmm", "mm", "matmul")),
    ("decode attention", ("paged_decode_attention", "bmm", "index_select", "_softmax", "masked_fill")),
    ("KV cache writes", ("index_copy",)),
    ("norms, rotary, activation", ("rms_norm", "rotary", "silu", "pow", "rsqrt", "mean", "neg", "cat")),
    ("sampling", ("cumsum", "searchsorted", "amax", "argmax", "rand", "sort")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()

    from aserve import LLM, SamplingParams
    from aserve.hardware import cpu_info

    llm = LLM(args.model, dtype=args.dtype, disable_log_stats=True)
    engine = llm.engine
    rng = random.Random(0)
    # every prompt prefilled at the engine's step budget, then a few decodes
    warmup = -(-args.num_requests * args.input_len // engine.scheduler.max_num_batched_tokens) + 2
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=warmup + args.steps + 8)
    for i in range(args.num_requests):
        engine.add_request([rng.randrange(1000, engine.vocab_size) for _ in range(args.input_len)], params,
                           request_id=f"p{i}", output_kind="final")
    for _ in range(warmup):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - start
    totals = {label: 0.0 for label, _ in GROUPS}
    other = 0.0
    for event in prof.key_averages():
        name = event.key.split("::")[-1].lower()
        for label, keys in GROUPS:
            if any(k in name for k in keys):
                totals[label] += event.self_cpu_time_total
                break
        else:
            other += event.self_cpu_time_total
    per_step = 1e3 / args.steps
    print(f"{cpu_info().describe()}, dtype {str(engine.dtype).replace('torch.', '')}; {args.num_requests} requests "
          f"in decode, {args.steps} steps")
    print(f"| where | ms per step |\n| --- | ---: |")
    for label, us in totals.items():
        print(f"| {label} | {us / 1e3 * per_step / 1e3:.1f} |")
    ops = sum(totals.values()) + other
    print(f"| other ops | {other / 1e3 * per_step / 1e3:.1f} |")
    print(f"| Python and scheduling (wall minus ops) | {max(0.0, wall * 1e6 - ops) / 1e3 * per_step / 1e3:.1f} |")
    print(f"| **step (wall, profiled)** | **{wall * per_step:.1f}** |")


if __name__ == "__main__":
    main()
