"""The flat forward (aserve/models/flat_forward.py) against the modules' forward in one engine: N requests
prefilled, then decode steps with the flat path on and off in alternate pairs, so both see the same machine
state (a VM's speed drifts between runs). Prints each side's median and mean step time.

    python tools/flat_forward_ab.py --model /tmp/bench-model --dtype bfloat16 --requests 64
"""
from __future__ import annotations

import argparse
import random
import time

from aserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    engine = LLM(args.model, dtype=args.dtype, disable_log_stats=True).engine
    model = engine.runner.model
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=args.steps + 1000)
    for i in range(args.requests):
        engine.add_request([rng.randrange(1000, engine.vocab_size) for _ in range(args.prompt_len)], params,
                           request_id=f"r{i}")
    while any(s.num_computed_tokens < args.prompt_len for s in engine.runner.requests.values()) or \
            len(engine.runner.requests) < args.requests:
        engine.step()  # prefill (the first step builds the flat path where the model allows it)
    flat = model.flat
    print(f"flat path: {type(flat).__name__}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps):
        on = step // 2 % 2 == 0
        model.flat = flat if on else None
        start = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - start)
    model.flat = flat
    for on in (True, False):
        t = sorted(times[on])
        print(f"{'flat' if on else 'modules'}: median {t[len(t) // 2] * 1e3:.2f} ms, "
              f"mean {sum(t) / len(t) * 1e3:.2f} ms over {len(t)} steps")


if __name__ == "__main__":
    main()
