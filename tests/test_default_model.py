"""The embedded default model: trained on Shakespeare, scored by aserve exactly as by transformers."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from aserve import LLM, SamplingParams
from aserve.config import DEFAULT_MODEL_DIR

VALIDATION = Path(__file__).parent / "data" / "shakespeare_validation.txt"  # held out from training
WINDOW = 256  # the training sequence length


def test_validation_perplexity_matches_transformers_and_beats_unigram():
    import transformers

    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode(VALIDATION.read_text())
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]  # the context it trained on
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours_nll = [-e[t].logprob for out, w in zip(outs, windows) for e, t in zip(out.prompt_logprobs[1:], w[1:])]
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor(windows)).logits[:, :-1].log_softmax(-1)
    theirs_nll = -logprobs.gather(2, torch.tensor(windows)[:, 1:].unsqueeze(2)).flatten()
    ours, theirs = math.exp(sum(ours_nll) / len(ours_nll)), math.exp(theirs_nll.mean().item())
    scored = [t for w in windows for t in w[1:]]
    counts = Counter(scored)  # a unigram model fitted on the very text it scores: an optimistic baseline
    vocab = len(llm.get_tokenizer())
    unigram = math.exp(-sum(math.log((counts[t] + 1) / (len(scored) + vocab)) for t in scored) / len(scored))
    print(f"validation perplexity: aserve {ours:.2f}, transformers {theirs:.2f}, unigram {unigram:.2f}")
    assert abs(ours - theirs) / theirs < 0.01
    assert ours < unigram / 3


def test_romeo_reads_like_a_play():
    llm = LLM(kv_cache_memory="64MiB")
    text = llm.generate("ROMEO:\n", SamplingParams(temperature=0.7, max_tokens=80, seed=1), use_tqdm=False)[0]
    words = text.outputs[0].text.lower().split()
    common = {"the", "and", "i", "to", "of", "you", "my", "a", "is", "that", "not", "me", "in", "with", "be"}
    assert len(words) >= 20 and sum(w.strip(",.;:!?'") in common for w in words) >= 6, text.outputs[0].text


def test_fresh_server_answers_romeo_and_chat():
    import httpx

    from server_util import RunningServer

    srv = RunningServer("--kv-cache-memory", "64MiB")  # no --model: the embedded one
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "aserve-default", "prompt": "ROMEO:",
                                                          "max_tokens": 40, "seed": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].strip()
        chat = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Speak of love."}], "max_tokens": 30}, timeout=60)
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        srv.stop()
