"""The `aserve` command. Alone it runs a generation on the embedded default model (the server comes with
the next issue); `aserve bench throughput ...` measures offline throughput."""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from aserve.bench import throughput

    parser = argparse.ArgumentParser(prog="aserve", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate text offline (the default command)")
    gen.add_argument("--model", default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput.add_arguments(bench_sub.add_parser("throughput", help="offline throughput on random prompts"))
    return parser


def generate(args: argparse.Namespace) -> None:
    from aserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed)
    prompts = args.prompt or ["def fibonacci(n):", "import os\n", "class Server:"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        print(f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.getLogger("aserve").setLevel(args.log_level.upper())
    try:
        if args.command == "bench":
            from aserve.bench import throughput

            throughput.main(args)
        else:
            if args.command is None:
                args = build_parser().parse_args(["generate"])
            generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
