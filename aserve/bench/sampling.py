"""The benchmarks' sampling options: every request's temperature, filters and penalties, by vLLM's `bench serve`
names. top-k, top-p, min-p and the penalties are paths of their own in the sampler, measured only where a benchmark
asks for them."""
from __future__ import annotations

import argparse

DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (every request)")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 or -1: no limit")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling arguments as SamplingParams' (and a request's) fields: the temperature, and the others where
    they are not their defaults."""
    return {name: getattr(args, name) for name, default in DEFAULTS.items()
            if name == "temperature" or getattr(args, name) != default}
