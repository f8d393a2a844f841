"""The embedded default model: trained on Shakespeare, scored by aserve exactly as by transformers."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from aserve import LLM, SamplingParams
from aserve.config import DEFAULT_MODEL_DIR

VALIDATION = Path(__file__).parent / "data" / "shakespeare_validation.txt"  # held out from training


def test_validation_perplexity_matches_transformers_and_beats_unigram():
    import transformers

    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode(VALIDATION.read_text())[:1024]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = math.exp(-sum(e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1))
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    theirs = math.exp(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item())
    counts = Counter(ids)  # a unigram model fitted on the very text it scores: an optimistic baseline
    vocab = len(llm.get_tokenizer())
    unigram = math.exp(-sum(math.log((counts[t] + 1) / (len(ids) + vocab)) for t in ids[1:]) / (len(ids) - 1))
    print(f"validation perplexity: aserve {ours:.2f}, transformers {theirs:.2f}, unigram {unigram:.2f}")
    assert abs(ours - theirs) / theirs < 0.01
    assert ours < unigram / 3


def test_romeo_reads_like_a_play():
    llm = LLM(kv_cache_memory="64MiB")
    text = llm.generate("ROMEO:\n", SamplingParams(temperature=0.7, max_tokens=80, seed=1), use_tqdm=False)[0]
    words = text.outputs[0].text.lower().split()
    common = {"the", "and", "i", "to", "of", "you", "my", "a", "is", "that", "not", "me", "in", "with", "be"}
    assert len(words) >= 20 and sum(w.strip(",.;:!?'") in common for w in words) >= 6, text.outputs[0].text
