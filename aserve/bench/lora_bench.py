"""`aserve bench throughput --num-loras N` (or `--lora-modules name=path ...`): the cost of serving LoRA adapters.

Random prompts run in this process, an untimed run per engine first, then timed rounds alternating: through the base
model alone (an engine without LoRA, as a user without adapters runs it), then with the requests spread round-robin
over the adapters (an engine with `enable_lora`, `max_loras` at least the number of adapters). Each round's prompts
are new (the same for both engines), so no run finds its prompts in its engine's prefix cache and skips their
prefill. The ratio of output tokens/s LoRA/base is printed.
`--num-loras N` writes N random PEFT adapters of rank `--lora-rank` on all seven projections to a temporary
folder first (their B is not zero, so every delta is really computed).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROUNDS = 2
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, targets: dict[str, tuple[int, int]], num_layers: int, rank: int,
                         seed: int, dtype) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) with random A and B for every
    module in `targets` ({name: (in, out)}) of every layer."""
    import torch
    from safetensors.torch import save_file

    from aserve.lora.adapter import MODULE_PARENT

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name, (features_in, features_out) in targets.items():
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, features_in, generator=gen) / features_in ** 0.5
                                               ).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(features_out, rank, generator=gen) * 0.01).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def run(args: argparse.Namespace, options: dict, prompts_for, report) -> None:
    """`prompts_for(llm, offset)`: the benchmark's random prompts for an engine's vocabulary, a fresh set for each
    run (round r: offset r + 1; the untimed first runs: offset 0), so that no run finds its prompts in the prefix
    cache; `report`: throughput's."""
    from aserve import LLM, LoRARequest, SamplingParams
    from aserve.hardware import cpu_info
    from aserve.lora.registry import parse_module

    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    base = LLM(**{**options, "enable_lora": False})
    print(f"aserve bench throughput (LoRA): {cpu_info().describe()}, dtype "
          f"{str(base.engine.dtype).replace('torch.', '')}", flush=True)
    rounds = [[{"prompt_token_ids": p} for p in prompts_for(base, offset)] for offset in range(ROUNDS + 1)]
    requests = rounds[0]
    with tempfile.TemporaryDirectory(prefix="aserve-bench-lora-") as tmp:
        if args.lora_modules:
            adapters = [parse_module(spec) for spec in args.lora_modules]
            adapters = [LoRARequest(a.lora_name, i + 1, a.lora_path) for i, a in enumerate(adapters)]
        else:
            targets = {name: shape for name, shape in _target_shapes(base).items() if name in ALL_PROJECTIONS}
            layers = base.engine.runner.model.shape.num_layers
            adapters = [LoRARequest(f"random-{i}", i + 1,
                                    str(write_random_adapter(Path(tmp) / f"random-{i}", targets, layers,
                                                             args.lora_rank, args.seed + i, base.engine.dtype)))
                        for i in range(args.num_loras)]
        rank = max(args.lora_rank, options.get("max_lora_rank") or 16)
        lora = LLM(**{**options, "enable_lora": True, "max_loras": max(options.get("max_loras") or 1, len(adapters)),
                      "max_lora_rank": rank, "max_cpu_loras": None})
        spread = [adapters[i % len(adapters)] for i in range(len(requests))]
        for llm, loras in ((base, None), (lora, spread)):  # each engine's first run: slots filled, pages touched
            llm.generate(requests, params, use_tqdm=False, lora_request=loras)
        totals = {"base": [0, 0.0], "lora": [0, 0.0]}
        for round_requests in rounds[1:]:  # alternated, so neither always runs on a warmer or cooler machine
            for key, llm, loras, label in (("base", base, None, "base model alone "),
                                           ("lora", lora, spread, f"{len(adapters)} adapters, round-robin ")):
                tokens, seconds = _timed(llm, round_requests, params, loras, label, report)
                totals[key][0] += tokens
                totals[key][1] += seconds
    ratio = (totals["lora"][0] / totals["lora"][1]) / (totals["base"][0] / totals["base"][1])
    print(f"output tokens/s ratio LoRA/base = {ratio:.2f} ({len(adapters)} adapters, max_loras "
          f"{lora.engine.config.max_loras}, rank {args.lora_rank}, {ROUNDS} alternating rounds)", flush=True)


def _target_shapes(llm) -> dict[str, tuple[int, int]]:
    from aserve.lora.layers import target_shapes

    return target_shapes(llm.engine.runner.model)


def _timed(llm, requests, params, loras, label: str, report) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    total = sum(len(r["prompt_token_ids"]) for r in requests) + output_tokens
    report(label, len(requests), total, output_tokens, elapsed)
    return output_tokens, elapsed
