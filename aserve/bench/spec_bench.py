"""`aserve bench throughput --speculative-config JSON`: the same prompts decoded without speculation, then with it,
each by a fresh engine in this process, and the ratio of their output tokens/s, with the acceptance figures.

Speculation pays where outputs repeat what came before (quotes, code, extraction): `--prompt-repeats N` makes each
prompt a random passage given N times, and `--temperature 0` decodes greedily (a random-weight model's greedy output
soon repeats itself). On random prompts sampled at temperature 1 little is proposed or accepted: the cost of
looking.
"""
from __future__ import annotations

import time


def run(args, options: dict, prompts_for, report) -> None:
    from aserve import LLM, SamplingParams

    spec = options.pop("speculative_config")
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.output_len)
    rates = []
    last = None
    for label, extra in (("without speculation: ", {}), ("with speculation: ", {"speculative_config": spec})):
        llm = LLM(**options, **extra)
        try:
            prompts = prompts_for(llm)
            llm.generate([{"prompt_token_ids": prompts[0][:16]}], params.clone(max_tokens=4), use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            output_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
            last = (len(prompts), sum(map(len, prompts)) + output_tokens, output_tokens, elapsed)
            rates.append(report(label, *last))
            if extra:
                counts = {name: sum(v for n, _, v in llm.get_metrics() if n == f"aserve:spec_decode_{name}_total")
                          for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                drafts, proposed, accepted = (counts[k] for k in ("num_drafts", "num_draft_tokens",
                                                                  "num_accepted_tokens"))
                print(f"proposals: {int(proposed)} tokens in {int(drafts)} checks, {int(accepted)} accepted "
                      f"({accepted / max(1, proposed):.0%}); mean acceptance length "
                      f"{1 + accepted / max(1, drafts):.2f}", flush=True)
        finally:
            llm.engine.executor.shutdown()
    print(f"output tokens/s ratio with/without speculation = {rates[1] / rates[0]:.2f}", flush=True)
    report("", *last)  # vLLM's format stays the last line
