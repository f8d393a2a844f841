"""The `aserve` command. Alone (or as `aserve serve ...`) it serves the OpenAI-compatible API on
127.0.0.1:8000, by default on the embedded model; `aserve generate` runs an offline generation;
`aserve bench throughput|serve|policies|quality|embed|roofline ...` measure."""
from __future__ import annotations

import argparse
import logging
import sys

from aserve.config import add_engine_arguments, engine_options
from aserve.errors import AserveError


def build_parser() -> argparse.ArgumentParser:
    from aserve.bench import (embed as bench_embed, policies as bench_policies, quality, roofline, serve as bench_serve,
                              throughput)
    from aserve.server import launch

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser = argparse.ArgumentParser(prog="aserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    launch.add_arguments(sub.add_parser("serve", parents=[common],
                                        help="serve the OpenAI-compatible API (the default command)"))

    gen = sub.add_parser("generate", parents=[common], help="generate text offline on a model")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.8)
    add_engine_arguments(gen)

    sub.add_parser("policies", parents=[common], help="list the installed scheduling policies")

    worker = sub.add_parser("worker", parents=[common],
                            help="run this machine's tensor-parallel ranks of a multi-node engine (node 1..N-1; "
                                 "node 0 runs `aserve serve` with the same --model, --tensor-parallel-size, "
                                 "--nnodes and --distributed-init-method)")
    add_engine_arguments(worker)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput.add_arguments(bench_sub.add_parser("throughput", parents=[common],
                                                  help="offline throughput on random prompts"))
    bench_serve.add_arguments(bench_sub.add_parser("serve", parents=[common],
                                                   help="online serving benchmark against a running server"))
    bench_policies.add_arguments(bench_sub.add_parser("policies", parents=[common],
                                                      help="replay one workload against several policies"))
    bench_embed.add_arguments(bench_sub.add_parser("embed", parents=[common],
                                                   help="offline embedding throughput (the pooling runner), against "
                                                        "sentence-transformers with --compare-sentence-transformers"))
    quality.add_arguments(bench_sub.add_parser("quality", parents=[common],
                                               help="perplexity, KL and greedy agreement of a lossy option "
                                                    "(--quantization) against the fp32 model"))
    roofline.add_arguments(bench_sub.add_parser("roofline", parents=[common],
                                                help="the machine's peak GEMM rate and memory bandwidth, how close "
                                                     "a workload comes to them, and where its time goes"))
    return parser


def generate(args: argparse.Namespace) -> None:
    from aserve import LLM, SamplingParams

    llm = LLM(**engine_options(args))
    prompts = args.prompt or ["def fibonacci(n):", "import os\n", "class Server:"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        print(f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n")


def list_policies() -> None:
    from aserve.policy import describe_installed

    rows = describe_installed()
    width = max((len(name) for name, _ in rows), default=0)
    for name, description in rows:
        print(f"{name:<{width}}  {description}")
    if not rows:
        print("no policies installed: pip install -e ./policies")


COMMANDS = ("serve", "generate", "bench", "policies", "worker")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["serve"] + argv  # `aserve --model X` is `aserve serve --model X`
    args = build_parser().parse_args(argv)
    logging.getLogger("aserve").setLevel(args.log_level.upper())
    try:
        if args.command == "bench" and args.bench_command == "throughput":
            from aserve.bench import throughput

            throughput.main(args)
        elif args.command == "bench" and args.bench_command == "embed":
            from aserve.bench import embed as bench_embed

            bench_embed.main(args)
        elif args.command == "bench" and args.bench_command == "roofline":
            from aserve.bench import roofline

            roofline.main(args)
        elif args.command == "bench" and args.bench_command == "quality":
            from aserve.bench import quality

            quality.main(args)
        elif args.command == "bench" and args.bench_command == "policies":
            from aserve.bench import policies as bench_policies

            bench_policies.main(args)
        elif args.command == "bench":
            from aserve.bench import serve as bench_serve

            bench_serve.main(args)
        elif args.command == "generate":
            generate(args)
        elif args.command == "policies":
            list_policies()
        elif args.command == "worker":
            from aserve.config import EngineConfig
            from aserve.worker.tp_worker import run_node

            raise SystemExit(run_node(EngineConfig(**engine_options(args)), logging.getLogger("aserve").level))
        else:
            from aserve.server import launch

            launch.serve(args)
    except (AserveError, ValueError, FileNotFoundError) as exc:  # bad input or configuration: one line, status 2
        message = " ".join(str(exc).split("\n"))
        print(f"aserve: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def run() -> None:
    """The `aserve` command: main(), then the process ends without the interpreter's teardown (aserve.process_exit)."""
    from aserve.process_exit import exit_code, exit_now

    try:
        main()
    except SystemExit as exc:
        exit_now(exit_code(exc))
    exit_now(0)


if __name__ == "__main__":
    run()
