"""`aserve bench embed`: offline embedding throughput (sentences/s) on random prompts of random lengths, and with
`--compare-sentence-transformers` the same token ids through sentence-transformers in this process, and the ratio.

sentence-transformers is fed exactly what its `encode` feeds the model, without re-tokenizing: the prompts sorted
by length, `--batch-size` at a time, padded, one forward each, pooled and normalized by its own modules; same dtype,
same threads. A folder that is not a sentence-transformers one is pooled as aserve pools it by default (CLS for an
encoder, else the last token; normalized) on both sides. `python benchmarks/make_bench_model.py OUT --bert` writes the
BERT-base-shaped embedder the docs' figure is measured on.
"""
from __future__ import annotations

import argparse
import random
import time

from aserve.config import add_engine_arguments, engine_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--compare-sentence-transformers", action="store_true",
                        help="then embed the same token ids with sentence-transformers and print the ratio")
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
        st(next(batches()))  # warm-up
        start = time.perf_counter()
        for features in batches():
            st(features)["sentence_embedding"].float()
        elapsed = time.perf_counter() - start
    rate = len(prompts) / elapsed
    print(f"sentence-transformers: {rate:.2f} sentences/s, {sum(map(len, prompts)) / elapsed:.2f} tokens/s "
          f"(batch size {batch_size})", flush=True)
    return rate


def main(args: argparse.Namespace) -> None:
    from aserve import LLM
    from aserve.hardware import cpu_info

    llm = LLM(**{**engine_options(args), "runner": "pooling"})
    engine = llm.engine
    print(f"aserve bench embed: {cpu_info().describe()}, dtype {str(engine.dtype).replace('torch.', '')}", flush=True)
    prompts = random_lengths_prompts(args, engine.vocab_size,
                                     set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids))
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(requests[:8], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.embed(requests, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ours = len(prompts) / elapsed
    print(f"aserve: {ours:.2f} sentences/s, {sum(map(len, prompts)) / elapsed:.2f} tokens/s "
          f"({args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens)", flush=True)
    if args.compare_sentence_transformers:
        from aserve.bench.throughput import engine_model_dir

        dtype = engine.dtype
        del llm, engine
        theirs = run_sentence_transformers(engine_model_dir(args.model), prompts, args.batch_size, dtype)
        print(f"sentences/s ratio aserve/sentence-transformers = {ours / theirs:.2f}")
