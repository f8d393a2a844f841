"""The benchmarks' sampling options: every request's temperature, filters and penalties, by vLLM's `bench serve`
names. top-k, top-p, min-p and the penalties are paths of their own in the sampler, measured only where a benchmark
asks for them."""
from __future__ import annotations

import argparse

DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0}


HELP = {"temperature": "sampling temperature (0: greedy)", "top_k": "0 or -1: no limit"}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (every request)")
    for name, default in DEFAULTS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=HELP.get(name))


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling arguments as SamplingParams' (and a request's) fields: the temperature, and the others where
    they are not their defaults."""
    return {name: getattr(args, name) for name, default in DEFAULTS.items()
            if name == "temperature" or getattr(args, name) != default}
