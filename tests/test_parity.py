"""Greedy output equals transformers' generate token for token (fp32), whatever the batch, block size,
preemption, chunking or prefix-cache state; logprobs equal transformers' log-softmax."""
from __future__ import annotations

import pytest
import torch

from aserve import LLM, SamplingParams
from conftest import FAMILIES, kv_memory_for_blocks, load_reference, random_prompts, reference_greedy

MAX_NEW = 24
PROMPTS = random_prompts(10, lengths=(1, 70), seed=1)
SHARED = random_prompts(8, lengths=(2, 20), seed=2, prefix=random_prompts(1, lengths=(45, 45), seed=3)[0])


class References(dict):
    """transformers' greedy outputs per family, computed the first time a test asks for that family."""

    def __init__(self, model_dirs):
        super().__init__()
        self.model_dirs = model_dirs

    def __missing__(self, family):
        model = load_reference(self.model_dirs[family])
        self[family] = {"random": reference_greedy(model, PROMPTS, MAX_NEW),
                        "shared": reference_greedy(model, SHARED, MAX_NEW)}
        return self[family]


@pytest.fixture(scope="module")
def references(model_dirs):
    return References(model_dirs)


def run(path, prompts, **options):
    options.setdefault("kv_cache_memory", "32MiB")
    llm = LLM(str(path), dtype="float32", **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_matches_transformers(model_dirs, references, family):
    llm, got = run(model_dirs[family], PROMPTS)
    assert got == references[family]["random"]
    llm.engine.check_idle()


# Block size 1 (every token its own block: the most block-table walking) on the families whose attention differs:
# GQA with a tied head, a sliding window, soft-capping with alternating windows, and learned positions with
# multi-head attention; 32 on every family. (Block size 1 on all nine took ~80 s of the suite.)
BLOCK_SIZE_1_FAMILIES = ("llama-gqa-tied", "mistral-swa", "gemma2", "gpt2")


@pytest.mark.parametrize("family, block_size", [(f, 32) for f in FAMILIES] + [(f, 1) for f in BLOCK_SIZE_1_FAMILIES])
def test_block_sizes(model_dirs, references, family, block_size):
    _, got = run(model_dirs[family], PROMPTS, block_size=block_size)
    assert got == references[family]["random"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preemption_under_a_tiny_cache(model_dirs, references, family):
    path = model_dirs[family]
    # 7 blocks of 16 tokens: each request needs up to 6, so they must take turns and get preempted.
    llm, got = run(path, PROMPTS, kv_cache_memory=kv_memory_for_blocks(path, 7))
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == references[family]["random"]
    llm.engine.check_idle()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill(model_dirs, references, family):
    llm, got = run(model_dirs[family], PROMPTS, max_num_batched_tokens=7, max_num_seqs=4)
    assert got == references[family]["random"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_cache_hits(model_dirs, references, family):
    path = model_dirs[family]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    first = llm.generate([{"prompt_token_ids": SHARED[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in SHARED[1:]], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in SHARED], params, use_tqdm=False)
    assert llm.engine.kv.prefix_hits >= 2 * 16 * len(SHARED)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == references[family]["shared"]
    assert [o.outputs[0].token_ids for o in again] == references[family]["shared"]
    llm.engine.check_idle()


def test_prefix_cache_with_preemption_and_chunks(model_dirs, references):
    path = model_dirs["llama-gqa-tied"]
    llm, got = run(path, SHARED + PROMPTS, kv_cache_memory=kv_memory_for_blocks(path, 9), max_num_batched_tokens=20)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert got == references["llama-gqa-tied"]["shared"] + references["llama-gqa-tied"]["random"]
    llm.engine.check_idle()


def test_prefix_caching_off(model_dirs, references):
    llm, got = run(model_dirs["qwen3"], SHARED, enable_prefix_caching=False)
    assert llm.engine.kv.prefix_hits == 0
    assert got == references["qwen3"]["shared"]


@pytest.mark.parametrize("family", ["llama-gqa-tied", "qwen2", "gemma2"])
def test_logprobs_match_transformers(model_dirs, family):
    path = model_dirs[family]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB")
    prompts = PROMPTS[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)
    model = load_reference(path)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ids = prompt + completion.token_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == 1  # greedy picks the top token
            top = row.topk(3)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[tid].logprob - lp) < 1e-4
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in
                                                       zip(completion.token_ids, completion.logprobs))) < 1e-5


def test_n_greedy_samples_share_the_prompt_and_match(model_dirs, references):
    path = model_dirs["llama-untied"]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:5]],
                        SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for out, ref in zip(outs, references["llama-untied"]["random"][:5]):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert all(o.token_ids == ref for o in out.outputs)
    llm.engine.check_idle()


@pytest.mark.parametrize("family", ["qwen3", "llama-gqa-tied", "gemma2"])
def test_prompt_logprobs_match_transformers(model_dirs, family):
    path = model_dirs[family]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=16)  # chunked prompts
    prompts = PROMPTS[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=2),
                        use_tqdm=False)
    model = load_reference(path)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
