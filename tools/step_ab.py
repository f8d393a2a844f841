"""Two ways of running the same engine step, alternated in one engine so both see the same machine state (a VM's
speed drifts by 10-50% from minute to minute, so runs one after the other compare nothing). Prints each side's
median and mean step time.

    python tools/step_ab.py --model /tmp/bench-model --dtype bfloat16 --compare flat
    python tools/step_ab.py --model /tmp/bench-model --dtype float32 --compare gemm --phase prefill
    python tools/step_ab.py --model /tmp/bench-gptq4 --compare one-call --requests 1 --num-scheduler-steps 8
    python tools/step_ab.py --model /tmp/bench-model --compare tail-kernel --phase tails --prompt-len 512 --tail 1

--compare flat: the flat forward (aserve/models/flat_forward.py) against the modules' forward.
--compare native: the flat forward's C++ layer loop (csrc/decoder_stack.cpp) against its Python one.
--compare team: the C++ loop's small steps as one team of threads (csrc/step_team.h) against an OpenMP region a kernel.
--compare gemm: aserve's GEMM (csrc/cpu_gemm.cpp; fp32, or bf16 with AVX512-BF16) against oneDNN's, every linear layer packed for both.
--compare bf16-panels: an fp32 model's weights of bf16 values in aserve's fp32 panels stored as bf16 against fp32.
--compare silu-epilogue: gate | up weights packed for the GEMM's SiLU-and-mul epilogue against packed plainly, the
product then silu_and_mul.
--compare one-call: decode steps in one call of the C++ stack (DecoderStack::decode_steps: layers, head and the
tokens) against the step-by-step path (the forward, compute_logits and the sampler from Python).
--compare tail-kernel: a prompt's short tail after a prefix-cache hit on the prefill kernel (backend.batch_order: the
same logits however the prompt was split) against decode rows (the rule before 2afdb2c; with --phase tails).
--temperature: the requests' (1.0; 0 is greedy).
--phase decode: N requests prefilled, then decode steps in alternate pairs. --phase prefill: every step prefills
fresh prompts (one output token each) up to the engine's step budget. --phase tails: a --prompt-len prompt is
cached first; every step admits N prompts of it and --tail fresh tokens each (one output token each).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from aserve import LLM, SamplingParams
from aserve.attention.backend import SHORT_CHUNK
from aserve.models.flat_forward import FlatForward
from aserve.ops import cpu_gemm
from aserve.worker import model_runner


def flat_sides(model):
    flat = model.flat

    def use(side: str) -> None:
        model.flat = flat if side == "flat" else None
    return ("flat", "modules"), use


def native_sides(model):
    flat = model.flat
    stack = getattr(flat, "stack", None)
    if stack is None:
        raise SystemExit("--compare native needs a model whose flat forward runs the C++ loop")

    def use(side: str) -> None:
        flat.stack = stack if side == "native" else None
    return ("native", "python"), use


def team_sides(model):
    stack = getattr(model.flat, "stack", None)
    if stack is None:
        raise SystemExit("--compare team needs a model whose flat forward runs the C++ loop")
    rows = stack.team_rows()

    def use(side: str) -> None:
        stack.set_team_rows(rows if side == "team" else 0)
    return ("team", "regions"), use


def one_call_sides(runner):
    if getattr(getattr(runner.model, "flat", None), "has_head", False) is not True:
        raise SystemExit("--compare one-call needs a model whose C++ loop runs its head too (DecoderStack.set_head)")
    takes = runner._one_call

    def use(side: str) -> None:
        runner._one_call = takes if side == "one-call" else (lambda reqs: False)
    return ("one-call", "step-by-step"), use


def tail_kernel_sides():
    rule = model_runner.batch_order

    def as_decode_rows(num_tokens: int, num_cached: int, num_prompt: int) -> int:  # the rule before 2afdb2c
        return 0 if num_tokens == 1 else 1 if num_tokens <= SHORT_CHUNK else 2

    def use(side: str) -> None:
        model_runner.batch_order = rule if side == "prefill" else as_decode_rows
    return ("prefill", "decode"), use


def gemm_sides(model):
    """Each packed weight in both layouts; `use` points every layer at one."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "packed", None), cpu_gemm.PackedWeight)]
    if not layers or layers[0].weight.dtype not in (torch.float32, torch.bfloat16):
        raise SystemExit("--compare gemm needs an fp32 or bf16 model with packed weights")
    if layers[0].weight.dtype == torch.bfloat16 and not torch.ops.aserve.gemm_packs_bf16():
        raise SystemExit("--compare gemm in bf16 needs a CPU with AVX512-BF16")
    both = []
    for layer in layers:
        w = layer.weight.detach()
        both.append((layer, {"aserve": cpu_gemm.PackedWeight(torch.ops.aserve.pack_gemm_weight(w), w.shape[0], True),
                             "onednn": cpu_gemm.PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64),
                                                             w.shape[0], False)}))

    return sides_of(model, both)


def bf16_panels_sides(model):
    """An fp32 model's weights of bf16 values in aserve's fp32 panels stored as bf16 (cpu_gemm.holds_bf16) against
    the same panels stored as fp32; `use` points every layer at one."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "packed", None), cpu_gemm.PackedWeight)
              and m.packed.aserve]
    if not layers or layers[0].weight.dtype != torch.float32 or not cpu_gemm.holds_bf16(layers[0].weight):
        raise SystemExit("--compare bf16-panels needs an fp32 model on aserve's GEMM from a bf16 checkpoint")
    both = []
    for layer in layers:
        w, n = layer.weight.detach(), layer.weight.shape[0]
        both.append((layer, {"bf16 panels": cpu_gemm.PackedWeight(torch.ops.aserve.pack_gemm_weight_bf16(w), n, True),
                             "fp32 panels": cpu_gemm.PackedWeight(torch.ops.aserve.pack_gemm_weight(w), n, True)}))
    return sides_of(model, both)


def silu_epilogue_sides(model):
    """Each gate | up packed for the SiLU-and-mul epilogue (cpu_gemm.pack_gated_weight) and plainly."""
    layers = [m for m in model.modules() if getattr(getattr(m, "packed", None), "gated", False)]
    if not layers:
        raise SystemExit("--compare silu-epilogue needs dense gate | up weights packed for aserve's GEMM")
    return sides_of(model, [(layer, {"epilogue": layer.packed, "separate": cpu_gemm.pack_weight(layer.weight)})
                            for layer in layers])


def sides_of(model, both):
    """`use(side)` for layers each with a PackedWeight per side: points them at it (and their SiLU-and-mul at the
    epilogue where it has one), with its own flat forward."""
    names = tuple(both[0][1])

    def point(side: str) -> None:
        for layer, packed in both:
            layer.packed = packed[side]
            if hasattr(layer, "silu_and_mul_fused"):
                layer.silu_and_mul_fused = layer.method.silu_and_mul_projection(layer)

    flats = {}
    for side in names:  # the flat forward holds the packed weights it was built with: one per side
        point(side)
        flats[side] = FlatForward.build(model) if model.flat is not None else None

    def use(side: str) -> None:
        point(side)
        model.flat = flats[side]
    return names, use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=("int8", "gptq", "awq"), default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, or an FP8 format (fp8, fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--compare", choices=("flat", "native", "team", "gemm", "bf16-panels", "silu-epilogue",
                                                  "one-call", "tail-kernel"),
                        default="flat")
    parser.add_argument("--phase", choices=("decode", "prefill", "tails"), default="decode")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--tail", type=int, default=1, help="--phase tails: each prompt's tokens past the cached one")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps a scheduling (multi-step)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the requests' temperature (0: greedy)")
    args = parser.parse_args()
    engine = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                 num_scheduler_steps=args.num_scheduler_steps, disable_log_stats=True).engine
    model = engine.runner.model
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(1000, engine.vocab_size) for _ in range(args.prompt_len)]  # noqa: E731

    temperature = args.temperature
    if args.phase == "decode":
        params = SamplingParams(temperature=temperature, ignore_eos=True,
                                max_tokens=args.steps + 1000 if args.num_scheduler_steps == 1
                                else (args.steps + 2) * args.num_scheduler_steps)
        for i in range(args.requests):
            engine.add_request(prompt(), params, request_id=f"r{i}")
        while any(s.num_computed_tokens < args.prompt_len for s in engine.runner.requests.values()) or \
                len(engine.runner.requests) < args.requests:
            engine.step()  # prefill (the first step builds the flat path where the model allows it)
        refill = lambda: None  # noqa: E731
    elif args.phase == "tails":
        prefix = prompt()
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=1)
        engine.add_request(prefix, params, request_id="prefix")
        while engine.num_unfinished:
            engine.step()
        count = iter(range(10**9))

        def refill() -> None:
            for _ in range(args.requests):
                tail = [rng.randrange(1000, engine.vocab_size) for _ in range(args.tail)]
                engine.add_request(prefix + tail, params, request_id=f"t{next(count)}")
    else:
        per_step = max(1, engine.scheduler.max_num_batched_tokens // args.prompt_len)
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=1)
        count = iter(range(10**9))

        def refill() -> None:
            for _ in range(per_step - engine.num_unfinished):
                engine.add_request(prompt(), params, request_id=f"p{next(count)}")
        refill()
        engine.step()

    sides = {"flat": flat_sides, "native": native_sides, "team": team_sides, "gemm": gemm_sides,
             "bf16-panels": bf16_panels_sides, "silu-epilogue": silu_epilogue_sides,
             "one-call": lambda model: one_call_sides(engine.runner), "tail-kernel": lambda model: tail_kernel_sides()}
    names, use = sides[args.compare](model)
    print(f"{args.compare}, {args.phase}: {names[0]} against {names[1]}")
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.steps):
        side = names[step // 2 % 2]
        use(side)
        refill()
        start = time.perf_counter()
        engine.step()
        times[side].append(time.perf_counter() - start)
    use(names[0])
    for side in names:
        t = sorted(times[side])
        print(f"{side}: median {t[len(t) // 2] * 1e3:.2f} ms, mean {sum(t) / len(t) * 1e3:.2f} ms over {len(t)} steps")


if __name__ == "__main__":
    main()
