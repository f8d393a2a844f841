"""`aserve bench throughput`: offline throughput on random prompts of fixed lengths, as vLLM measures it.

Random token ids, `ignore_eos` and fixed output lengths, so every engine does the same work. With
`--compare-transformers` the same workload then runs through transformers' `generate` in this process,
and the ratio is printed: a baseline measured in the same command, on the same machine state.
With `--json-schema FILE` the same prompts then run constrained by that schema (its grammar compiled
before the clock starts) and free again at the constrained outputs' lengths, in alternating rounds, and
the ratio of output tokens/s constrained/free is printed: the cost of structured output. A constrained
request ends where its JSON ends, so pick a schema with room for --output-len tokens
(examples/structured_output/bench_schema.json has a free-text field).
"""
from __future__ import annotations

import argparse
import random
import time

from aserve.bench.sampling import add_sampling_arguments, sampling_options
from aserve.config import EngineConfig, add_engine_arguments, engine_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    add_sampling_arguments(parser)
    parser.add_argument("--prompt-repeats", type=int, default=1, metavar="N",
                        help="each prompt a random passage of input-len / N tokens given N times (a prompt that "
                             "quotes itself)")
    parser.add_argument("--compare-transformers", action="store_true",
                        help="then run transformers' generate on the same workload (batched) and print the ratio")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="then run the same prompts constrained by this JSON schema and print the ratio of "
                             "output tokens/s constrained/free")
    parser.add_argument("--beam-width", type=int, default=0, metavar="N",
                        help="run LLM.beam_search with N beams instead of sampling (output tokens count every beam's); "
                             "also prints the KV blocks one prompt holds at its peak against N independent samples")
    lora = parser.add_argument_group("LoRA (aserve.bench.lora_bench): base alone, then requests spread over adapters")
    lora.add_argument("--num-loras", type=int, default=0,
                      help="write this many random PEFT adapters (all seven projections) and compare with the base")
    lora.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank (default 16)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="use these adapters instead of random ones")
    add_engine_arguments(parser)


def random_prompts(num: int, length: int, vocab_size: int, avoid: set[int], seed: int,
                   repeats: int = 1) -> list[list[int]]:
    """`repeats`: each prompt a random passage of length // repeats tokens, given that many times (and cut or
    topped up with its start to `length`)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    passages = [[rng.choice(allowed) for _ in range(max(1, length // max(1, repeats)))] for _ in range(num)]
    return [(p * (length // len(p) + 1))[:length] for p in passages]


def report(label: str, num: int, total_tokens: int, output_tokens: int, elapsed: float) -> float:
    print(f"{label}Throughput: {num / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s", flush=True)
    return output_tokens / elapsed


def run_transformers(model_dir: str, prompts: list[list[int]], output_len: int, dtype: str) -> float:
    import torch
    import transformers

    torch_dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2,
                                       "attention_mask": torch.ones(1, 8, dtype=torch.long)})
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return report("transformers ", len(prompts), ids.numel() + generated, generated, elapsed)


def main(args: argparse.Namespace) -> None:
    EngineConfig.from_kwargs(**engine_options(args)).verify()  # a wrong folder or policy: an error before torch loads
    from aserve import LLM, SamplingParams
    from aserve.hardware import cpu_info

    def prompts_for(llm, offset: int = 0):
        """The workload's prompts; another `offset`, another set (a run that repeats prompts would find them in the
        prefix cache and skip their prefill)."""
        engine = llm.engine
        return random_prompts(args.num_prompts, args.input_len, engine.vocab_size,
                              set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids), args.seed + offset,
                              args.prompt_repeats)

    if args.num_loras or args.lora_modules:
        from aserve.bench import lora_bench

        lora_bench.run(args, engine_options(args), prompts_for, report)
        return
    if args.speculative_config:
        from aserve.bench import spec_bench

        spec_bench.run(args, engine_options(args), prompts_for, report)
        return
    llm = LLM(**engine_options(args))
    engine = llm.engine
    print(f"aserve bench throughput: {cpu_info().describe()}, dtype {str(engine.dtype).replace('torch.', '')}",
          flush=True)  # first: what the figures below were measured on
    prompts = prompts_for(llm)
    if args.beam_width:
        run_beam_search(llm, prompts, args.beam_width, args.output_len)
        return
    params = SamplingParams(**sampling_options(args), ignore_eos=True, max_tokens=args.output_len)
    # warm-up, on the first prompt's first block reversed: that block itself, cached, would spare its prefill
    llm.generate([{"prompt_token_ids": prompts[0][:16][::-1]}], params.clone(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    total = sum(len(p) for p in prompts) + output_tokens
    ours = report("", len(prompts), total, output_tokens, elapsed)
    if args.json_schema:
        run_constrained(llm, prompts, params, args.json_schema)
        report("", len(prompts), total, output_tokens, elapsed)  # vLLM's format stays the last line
    if args.compare_transformers:
        dtype = str(engine.dtype).replace("torch.", "")  # the same dtype auto chose for aserve, not the checkpoint's
        del llm, engine
        theirs = run_transformers(engine_model_dir(args.model), prompts, args.output_len, dtype)
        print(f"output tokens/s ratio aserve/transformers = {ours / theirs:.2f}")
        report("", len(prompts), total, output_tokens, elapsed)  # vLLM's format stays the last line


def run_beam_search(llm, prompts: list[list[int]], width: int, output_len: int) -> float:
    """Beam search throughput: every prompt's `width` beams decode `output_len` tokens each (ignore_eos), which is
    what the output token count counts, as the same figure for vLLM's LLM.beam_search does
    (benchmarks/vllm_beam_search.py). Then one prompt's peak KV blocks against `width` independent samples."""
    from aserve import BeamSearchParams, SamplingParams

    params = BeamSearchParams(width, output_len, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": prompts[0][:16]}], BeamSearchParams(width, 4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    beams = peak_blocks(llm, prompts[0], params)
    samples = peak_blocks(llm, prompts[0], SamplingParams(n=width, max_tokens=output_len, ignore_eos=True, seed=0))
    print(f"KV blocks at the peak, one prompt of {len(prompts[0])} tokens + {output_len}: beam search "
          f"(width {width}) {beams}, {width} independent samples {samples} ({1 - beams / samples:.0%} fewer)")
    output_tokens = len(prompts) * width * output_len
    return report("", len(prompts), sum(map(len, prompts)) + output_tokens, output_tokens, elapsed)


def peak_blocks(llm, prompt: list[int], params) -> int:
    """The most KV blocks in use at once while the engine runs one request alone."""
    engine = llm.engine
    engine.add_request(prompt, params, request_id="peak-blocks")
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.kv.num_blocks - engine.kv.num_free_blocks)
    return most


def run_constrained(llm, prompts: list[list[int]], params, schema_file: str, rounds: int = 2) -> dict[str, int]:
    """The cost of the schema's constraint, measured fairly: the same prompts run constrained, then free with
    each request's length set to its constrained output's (constrained outputs end when their grammar does,
    and shorter requests alone would change the batch), alternating `rounds` times so that neither kind
    always runs first; prints each run and the ratio of output tokens/s constrained/free over all rounds, and
    returns the output tokens of each kind."""
    import json

    from aserve.structured_output import StructuredOutputsParams

    with open(schema_file) as f:
        constrained = params.clone(structured_outputs=StructuredOutputsParams(json=json.load(f)))
    start = time.perf_counter()  # compile (and cache) the grammar before the clock starts
    llm.generate([{"prompt_token_ids": prompts[0][:16][::-1]}], constrained.clone(max_tokens=4), use_tqdm=False)
    print(f"grammar compiled and warmed up in {time.perf_counter() - start:.2f} s", flush=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    tokens = {"constrained": 0, "free": 0}
    seconds = {"constrained": 0.0, "free": 0.0}
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.generate(requests, constrained, use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = [len(out.outputs[0].token_ids) for out in outputs]
        finished = sum(out.outputs[0].finish_reason == "stop" for out in outputs)
        report("constrained ", len(prompts), sum(map(len, prompts)) + sum(lengths), sum(lengths), elapsed)
        print(f"  mean {sum(lengths) / len(lengths):.1f} tokens, {finished}/{len(lengths)} ended by their grammar")
        tokens["constrained"] += sum(lengths)
        seconds["constrained"] += elapsed
        start = time.perf_counter()
        outputs = llm.generate(requests, [params.clone(max_tokens=n) for n in lengths], use_tqdm=False)
        elapsed = time.perf_counter() - start
        free = sum(len(out.outputs[0].token_ids) for out in outputs)
        report("free, same lengths ", len(prompts), sum(map(len, prompts)) + free, free, elapsed)
        tokens["free"] += free
        seconds["free"] += elapsed
    ratio = (tokens["constrained"] / seconds["constrained"]) / (tokens["free"] / seconds["free"])
    print(f"output tokens/s ratio constrained/free = {ratio:.2f} (equal lengths, {rounds} alternating rounds)",
          flush=True)
    return tokens


def engine_model_dir(model: str | None) -> str:
    from aserve.config import DEFAULT_MODEL_DIR

    return model or str(DEFAULT_MODEL_DIR)
