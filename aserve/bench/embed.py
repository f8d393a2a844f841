"""`aserve bench embed`: offline embedding throughput (sentences/s) on random prompts of random lengths, and with
`--compare-sentence-transformers` the same token ids through sentence-transformers in this process, and the ratio
(`--rounds N`: the two alternated N times, each round's ratio and their median).
With `--base-url`, the same prompts sent instead to a running server's POST /v1/embeddings (any OpenAI-compatible
one: aserve's or vLLM's), one prompt a request from `--concurrency` clients at once; `--model` then names the folder
the prompts' vocabulary comes from.

sentence-transformers is fed exactly what its `encode` feeds the model, without re-tokenizing: the prompts sorted
by length, `--batch-size` at a time, padded, one forward each, pooled and normalized by its own modules; same dtype,
same threads. Both sides make one untimed pass over all the prompts first (oneDNN builds its kernels for each new
shape on first use), so the figures are steady-state rates. A folder that is not a sentence-transformers one is
pooled as aserve pools it by default (CLS for an encoder, else the last token; normalized) on both sides.
`python benchmarks/make_bench_model.py OUT --bert` writes the BERT-base-shaped embedder the docs' figure is
measured on.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from aserve.config import EngineConfig, add_engine_arguments, engine_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--compare-sentence-transformers", action="store_true",
                        help="then embed the same token ids with sentence-transformers and print the ratio")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --compare-sentence-transformers: alternate the two this many times and print "
                             "each round's ratio and their median (a VM's speed drifts within a run)")
    parser.add_argument("--base-url", default=None,
                        help="measure a running server's /v1/embeddings instead (e.g. http://127.0.0.1:8000)")
    parser.add_argument("--concurrency", type=int, default=32, help="with --base-url: clients sending at once")
    add_engine_arguments(parser)


def random_lengths_prompts(args, vocab_size: int, avoid: set[int]) -> list[list[int]]:
    rng = random.Random(args.seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    return [[rng.choice(allowed) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.num_prompts)]


def run_sentence_transformers(model_dir: str, prompts: list[list[int]], batch_size: int, dtype) -> float:
    import torch
    from sentence_transformers import SentenceTransformer, models

    from aserve.models.registry import read_config
    from aserve.pooling.params import is_sentence_transformers, read_spec

    if is_sentence_transformers(model_dir):
        st = SentenceTransformer(model_dir, device="cpu")
    else:
        transformer = models.Transformer(model_dir)
        kind = read_spec(model_dir, read_config(model_dir)).kind
        pooling = models.Pooling(transformer.get_word_embedding_dimension(),
                                 pooling_mode={"last": "lasttoken", "cls": "cls", "mean": "mean"}[kind])
        st = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    st = st.to(dtype).eval()
    pad = st.tokenizer.pad_token_id if st.tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

    def batches():
        for start in range(0, len(order), batch_size):
            chunk = [prompts[i] for i in order[start:start + batch_size]]
            width = max(map(len, chunk))
            ids = torch.tensor([p + [pad] * (width - len(p)) for p in chunk])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk])
            yield {"input_ids": ids, "attention_mask": mask}

    with torch.inference_mode():
        for features in batches():  # warm-up: one untimed pass, every batch's shape seen once (as aserve gets)
            st(features)
        start = time.perf_counter()
        for features in batches():
            st(features)["sentence_embedding"].float()
        elapsed = time.perf_counter() - start
    rate = len(prompts) / elapsed
    print(f"sentence-transformers: {rate:.2f} sentences/s, {sum(map(len, prompts)) / elapsed:.2f} tokens/s "
          f"(batch size {batch_size})", flush=True)
    return rate


async def run_served(base_url: str, prompts: list[list[int]], concurrency: int) -> float:
    """Each prompt as one /v1/embeddings request, `concurrency` in flight; prints and returns sentences/s."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        pending, latencies = iter(prompts), []

        async def one_client():
            for prompt in pending:
                sent = time.perf_counter()
                answer = await client.post("/v1/embeddings", json={"model": model, "input": prompt})
                answer.raise_for_status()
                latencies.append(time.perf_counter() - sent)

        await client.post("/v1/embeddings", json={"model": model, "input": prompts[0]})  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    rate = len(prompts) / elapsed
    print(f"served {base_url}: {rate:.2f} sentences/s, {sum(map(len, prompts)) / elapsed:.2f} tokens/s, "
          f"latency p50 {statistics.median(latencies) * 1e3:.0f} ms ({len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {concurrency} clients)", flush=True)
    return rate


def served(args: argparse.Namespace) -> None:
    from aserve.bench.throughput import engine_model_dir
    from aserve.models.loader import load_tokenizer
    from aserve.models.registry import read_config

    model_dir = engine_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = random_lengths_prompts(args, read_config(model_dir)["vocab_size"], set(tokenizer.all_special_ids))
    asyncio.run(run_served(args.base_url, prompts, args.concurrency))


def main(args: argparse.Namespace) -> None:
    if args.base_url:
        return served(args)
    options = {**engine_options(args), "runner": "pooling"}
    EngineConfig.from_kwargs(**options).verify()  # a wrong folder or policy: an error before torch loads
    from aserve import LLM
    from aserve.hardware import cpu_info

    llm = LLM(**options)
    engine = llm.engine
    print(f"aserve bench embed: {cpu_info().describe()}, dtype {str(engine.dtype).replace('torch.', '')}", flush=True)
    prompts = random_lengths_prompts(args, engine.vocab_size,
                                     set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids))
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(requests, use_tqdm=False)  # warm-up: one untimed pass, every step's shapes seen once
    ratios = []
    for _ in range(max(1, args.rounds) if args.compare_sentence_transformers else 1):
        start = time.perf_counter()
        llm.embed(requests, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ours = len(prompts) / elapsed
        print(f"aserve: {ours:.2f} sentences/s, {sum(map(len, prompts)) / elapsed:.2f} tokens/s "
              f"({args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens)", flush=True)
        if args.compare_sentence_transformers:
            from aserve.bench.throughput import engine_model_dir

            theirs = run_sentence_transformers(engine_model_dir(args.model), prompts, args.batch_size, engine.dtype)
            ratios.append(ours / theirs)
            print(f"sentences/s ratio aserve/sentence-transformers = {ratios[-1]:.2f}", flush=True)
    if len(ratios) > 1:
        print(f"median ratio over {len(ratios)} rounds = {statistics.median(ratios):.2f} "
              f"({' / '.join(f'{r:.2f}' for r in ratios)})")
