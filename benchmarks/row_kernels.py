#!/usr/bin/env python3
"""A model's linear kernels at a few rows against reading their bytes: whether a decode step's projections stream
their weights as fast as this machine reads the same bytes in the same calls.

For each weight format, every projection of the model (the decoder layers' and the head, in module order) runs once on
--rows rows as the engine runs it (aserve's GEMM on packed weights, int8_linear, int4_linear, SiLU-and-mul in the gate |
up GEMM where it is packed for it), the caches flushed first; then torch.ops.aserve.stream_read_each reads the tensors
each kernel reads (packed panels, codes, scales), one call a projection, in the same order, flushed the same way. Both
sides are called from Python, a dispatch a projection (the kernels' Python wrappers cost a few us a call more than the
reads': the flat forward calls the kernels from C++). Round by round the sides alternate, so a VM whose speed drifts
slows both alike; the lines give each format's medians: the kernels' time and rate, the reads' rate, and kernels / reads
(1.00: the projections are at the memory wall; above it, the time the kernels spend beyond reading their bytes).

    python benchmarks/row_kernels.py --model /tmp/bench-model
    python benchmarks/row_kernels.py --model /tmp/bench-model --gptq /tmp/bench-gptq4 --formats dense,int8h,gptq
    python benchmarks/row_kernels.py --model /tmp/bench-model --rows 4 --dtype float32

Formats: dense, int8 (--quantization int8), int8h (with --quantize-lm-head), gptq (the --gptq checkpoint, whose
head is int4 where it was quantized with it: quantize_rtn --lm-head).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

FLUSH_MIB = 256  # read between timings: more than any CPU's caches here hold


def projections(model):
    """(module, run(x), in_features, [tensors it reads]) for each projection of the model, in module order, the head
    once (a tied head's own copy where it has one, as the step reads it)."""
    from aserve.models.layers import Linear
    from aserve.ops.cpu_gemm import PackedLinear

    found = []
    skip = getattr(model, "lm_head", None) if getattr(model, "packed_head", None) is not None else None
    for module in model.modules():
        if not isinstance(module, (Linear, PackedLinear)) or module is skip:
            continue
        packed = getattr(module, "packed", None)
        if packed is not None and packed.aserve:  # the panels are what the GEMM reads, not the plain weight
            read = [packed.data]
        else:  # codes and scales; or a weight packed for oneDNN, whose opaque copy has the plain weight's bytes
            read = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if isinstance(module, PackedLinear):
            run = module
        else:
            run = getattr(module, "silu_and_mul_fused", None) or module.method.projection(module)
        found.append((module, run, module.in_features, read))
    return found


def engine_model(path: str, dtype: str, name: str, gptq: str | None):
    from aserve import LLM

    options = {"int8": {"quantization": "int8"}, "int8h": {"quantization": "int8", "quantize_lm_head": True}}
    model = gptq if name == "gptq" else path
    return LLM(model, dtype=dtype, disable_log_stats=True, **options.get(name, {})).engine.runner.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a 16/32-bit checkpoint (the bench model)")
    parser.add_argument("--gptq", help="its GPTQ copy (for the gptq format)")
    parser.add_argument("--formats", default=None, help="comma-separated, of dense, int8, int8h, gptq "
                        "(default: dense,int8h, and gptq with --gptq)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    formats = (args.formats or "dense,int8h" + (",gptq" if args.gptq else "")).split(",")
    unknown = [f for f in formats if f not in ("dense", "int8", "int8h", "gptq")]
    if unknown:
        parser.error(f"unknown format {unknown[0]!r}")
    if "gptq" in formats and not args.gptq:
        parser.error("the gptq format needs --gptq DIR (python -m aserve.bench.quantize_rtn MODEL DIR --lm-head)")

    import torch

    from aserve.hardware import cpu_info
    from aserve.ops import cpu_kernels

    if not cpu_kernels.available():
        sys.exit("row_kernels: aserve's CPU kernels are not built here (see `aserve doctor`)")
    flush = torch.ones(FLUSH_MIB << 20, dtype=torch.uint8)
    runs = {}
    for name in formats:
        model = engine_model(args.model, args.dtype, name, args.gptq)
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        found = projections(model)
        inputs = {k: torch.randn(args.rows, k).to(dtype) for k in {k for _, _, k, _ in found}}
        calls = [(run, inputs[k]) for _, run, k, _ in found]
        # stream_read reads whole 64-bit words: a tensor of another size (none in these formats) is left out
        tensors = [[t for t in read if t.numel() * t.element_size() % 8 == 0] for _, _, _, read in found]
        size = sum(t.numel() * t.element_size() for each in tensors for t in each)
        runs[name] = (model, calls, tensors, size, str(dtype).replace("torch.", ""))
    first = runs[formats[0]]
    print(f"row_kernels: {cpu_info().describe()}, dtype {first[4]}; {args.rows} row(s), every projection and the head "
          f"once a pass, {args.rounds} rounds")
    kernel: dict[str, list[float]] = {n: [] for n in formats}
    reads: dict[str, list[float]] = {n: [] for n in formats}
    with torch.inference_mode():
        for _, calls, _, _, _ in runs.values():  # the threads' first calls (their pool, scratch) are not timed
            for run, x in calls:
                run(x)
        for r in range(args.rounds):
            for name in formats:
                _, calls, tensors, _, _ = runs[name]
                sides = ("kernels", "reads") if r % 2 == 0 else ("reads", "kernels")
                for side in sides:
                    torch.ops.aserve.stream_read(flush)
                    start = time.perf_counter()
                    if side == "kernels":
                        for run, x in calls:
                            run(x)
                    else:
                        for each in tensors:
                            torch.ops.aserve.stream_read_each(each)
                    (kernel if side == "kernels" else reads)[name].append(time.perf_counter() - start)
    for name in formats:
        size = runs[name][3]
        k, rd = statistics.median(kernel[name]), statistics.median(reads[name])
        print(f"{name}: {len(runs[name][1])} projections, {size / 1e6:.1f} MB; kernels {k * 1e3:.3f} ms "
              f"({size / k / 1e9:.1f} GB/s), reads {rd * 1e3:.3f} ms ({size / rd / 1e9:.1f} GB/s); kernels / reads "
              f"{k / rd:.2f} (rounds {min(a / b for a, b in zip(kernel[name], reads[name])):.2f}-"
              f"{max(a / b for a, b in zip(kernel[name], reads[name])):.2f})")


if __name__ == "__main__":
    main()
