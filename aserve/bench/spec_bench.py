"""`aserve bench throughput --speculative-config JSON`: the same prompts decoded without speculation and with it, by
two engines in this process, in alternating rounds (a slow spell of the machine then hits both), and the ratio of
their output tokens/s over all rounds, with the acceptance figures.

Speculation pays where outputs repeat what came before (quotes, code, extraction): `--prompt-repeats N` makes each
prompt a random passage given N times, and `--temperature 0` decodes greedily (a random-weight model's greedy output
soon repeats itself). On random prompts sampled at temperature 1 little is proposed or accepted: the cost of
looking.
"""
from __future__ import annotations

import time

from aserve.bench.sampling import sampling_options

ROUNDS = 2


def run(args, options: dict, prompts_for, report) -> None:
    from aserve import LLM, SamplingParams

    spec = options.pop("speculative_config")
    params = SamplingParams(**sampling_options(args), ignore_eos=True, max_tokens=args.output_len)
    engines = {"without speculation: ": LLM(**options), "with speculation: ": LLM(**options, speculative_config=spec)}
    try:
        # a fresh set of prompts each round (one run of a round per engine), so that no run finds its prompts in
        # its engine's prefix cache; the warm-up's comes from a set no round uses
        rounds = [prompts_for(next(iter(engines.values())), offset) for offset in range(ROUNDS + 1)]
        prompts = rounds[0]
        totals = {label: [0, 0.0] for label in engines}  # output tokens, seconds
        for llm in engines.values():
            llm.generate([{"prompt_token_ids": rounds[-1][0][:16]}], params.clone(max_tokens=4), use_tqdm=False)
        for round_prompts in rounds[:ROUNDS]:
            for label, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.generate([{"prompt_token_ids": p} for p in round_prompts], params, use_tqdm=False)
                totals[label][1] += time.perf_counter() - start
                totals[label][0] += sum(len(o.token_ids) for out in outputs for o in out.outputs)
        rates = {}
        for label, (output_tokens, elapsed) in totals.items():
            last = (ROUNDS * len(prompts), ROUNDS * sum(map(len, prompts)) + output_tokens, output_tokens, elapsed)
            rates[label] = report(label, *last)
        counts = {name: sum(v for n, _, v in engines["with speculation: "].get_metrics()
                            if n == f"aserve:spec_decode_{name}_total")
                  for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        drafts, proposed, accepted = counts["num_drafts"], counts["num_draft_tokens"], counts["num_accepted_tokens"]
        print(f"proposals: {int(proposed)} tokens in {int(drafts)} checks, {int(accepted)} accepted "
              f"({accepted / max(1, proposed):.0%}); mean acceptance length {1 + accepted / max(1, drafts):.2f}",
              flush=True)
        without, with_ = rates.values()
        print(f"output tokens/s ratio with/without speculation = {with_ / without:.2f} ({ROUNDS} alternating rounds)",
              flush=True)
        report("", *last)  # vLLM's format stays the last line
    finally:
        for llm in engines.values():
            llm.engine.executor.shutdown()
