#!/usr/bin/env python3
"""Decode attention alone (torch.ops.aserve.paged_decode_attention): milliseconds a layer over each KV cache format.

One query token per request against its context in the paged cache, the bench model's heads by default (9 query
heads over 3 KV heads of 64). Cold: --layers layers' caches called in turn, so each call finds its keys and values in
DRAM, as a decode step does at batch 64; hot: one layer's cache called --layers times, its K/V in the caches after the
first call. The caches (the queries' dtype, bf16 or float32, and fp8_e4m3, fp8_e5m2) are alternated round by round in one process, so a VM
whose speed drifts slows all of them alike; the last lines give each one's medians and its ratio to the first's.
Context lengths are spread over context +- 64 (a seeded draw); blocks lie at random in the cache (--order random,
as a long-running server's do) or one request's after another (--order sequential, as a fresh engine's prompts).

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --batch 8 --context 2048 --caches bf16,fp8_e4m3
    python benchmarks/decode_attention.py --batch 1 --context 4096 --rounds 9
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

CACHES = {"bf16": 0, "float32": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}  # name: the op's kv_format


def make_layers(args, torch) -> tuple[list[tuple], "torch.Tensor"]:
    """Each layer's (block tables, {cache name: (keys, values)}) and the context lengths."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, args.context - 64), args.context + 64, (args.batch,), generator=generator)
    width = -(-int(lengths.max()) // args.block_size)
    blocks = args.batch * width + 1
    names = args.caches.split(",")
    layers = []
    for _ in range(args.layers):
        order = torch.randperm(blocks, generator=generator) if args.order == "random" else torch.arange(blocks)
        tables = order[:args.batch * width].view(args.batch, width).contiguous()
        shape = (args.kv_heads, blocks, args.block_size, args.head_dim)
        keys = torch.randn(shape, generator=generator)
        values = torch.randn(shape, generator=generator)
        caches = {}
        for name in names:
            if name.startswith("fp8"):
                fp8 = torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2
                caches[name] = (keys.to(fp8).view(torch.uint8), values.to(fp8).view(torch.uint8))
            else:
                dtype = torch.bfloat16 if name == "bf16" else torch.float32
                caches[name] = (keys.to(dtype), values.to(dtype))
        layers.append((tables, caches))
    return layers, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="requests, one query token each")
    parser.add_argument("--context", type=int, default=192, help="the contexts' middle length (spread +- 64)")
    parser.add_argument("--caches", default="bf16,fp8_e4m3", help=f"comma-separated, of {', '.join(CACHES)}")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the queries'")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="caches called in turn (cold), or calls of one (hot)")
    parser.add_argument("--order", default="random", choices=("random", "sequential"), help="where blocks lie")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    names = args.caches.split(",")
    unknown = [n for n in names if n not in CACHES]
    if unknown:
        parser.error(f"unknown cache {unknown[0]!r}; choose from {', '.join(CACHES)}")
    plain = {"bfloat16": "bf16", "float32": "float32"}[args.dtype]
    if any(n in ("bf16", "float32") and n != plain for n in names):
        parser.error(f"a cache of 16 or 32 bits is in the queries' dtype: {plain} with --dtype {args.dtype}")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    import torch

    from aserve.hardware import cpu_info
    from aserve.ops import cpu_kernels

    if not cpu_kernels.available():
        sys.exit("decode_attention: aserve's CPU kernels are not built here (see `aserve doctor`)")
    layers, lengths = make_layers(args, torch)
    query = torch.randn(args.batch, args.heads, args.head_dim).to(getattr(torch, args.dtype))
    out = torch.empty_like(query)
    scale = args.head_dim ** -0.5

    def call(tables, caches, name):
        keys, values = caches[name]
        torch.ops.aserve.paged_decode_attention(out, query, keys, values, tables, lengths, scale, 0, 0.0, 1.0, 1.0,
                                                CACHES[name])

    print(f"decode_attention: {cpu_info().describe()}; {args.batch} requests x "
          f"{int(lengths.min())}-{int(lengths.max())} tokens, {args.heads} heads over {args.kv_heads} x "
          f"{args.head_dim}, {args.dtype} queries, blocks of {args.block_size} at {args.order}, {args.layers} layers, "
          f"{args.rounds} rounds")
    cold: dict[str, list[float]] = {n: [] for n in names}
    hot: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for name in names:  # the threads' first call (their pool, their scratch) is not a layer's time
            call(*layers[-1], name)
        for _ in range(args.rounds):
            for name in names:
                start = time.perf_counter()
                for tables, caches in layers:
                    call(tables, caches, name)
                cold[name].append((time.perf_counter() - start) / args.layers * 1e3)
                tables, caches = layers[0]
                call(tables, caches, name)
                start = time.perf_counter()
                for _ in range(args.layers):
                    call(tables, caches, name)
                hot[name].append((time.perf_counter() - start) / args.layers * 1e3)
    first = names[0]
    for name in names:
        c, h = statistics.median(cold[name]), statistics.median(hot[name])
        print(f"{name}: cold {c:.3f} ms a layer ({min(cold[name]):.3f}-{max(cold[name]):.3f}), hot {h:.3f} "
              f"({min(hot[name]):.3f}-{max(hot[name]):.3f}); time against {first}: cold "
              f"{c / statistics.median(cold[first]):.2f}x, hot {h / statistics.median(hot[first]):.2f}x")


if __name__ == "__main__":
    main()
