"""Speculative decoding with a draft model: greedy outputs are those of decoding without it (and transformers'),
token for token in fp32, over batches, preemption, prefix hits, stop strings and grammars; a draft equal to the
target has every proposal accepted; sampled tokens follow the target's distribution (chi-square, with a negative
control); the draft's own cache gives back every block."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve import LLM, SamplingParams
from aserve.errors import ConfigError
from aserve.spec_decode.config import SpeculativeConfig
from aserve.worker import sampler
from conftest import build_tiny_model, kv_memory_for_blocks, load_reference, random_prompts, reference_greedy
from test_sampling_stats import MIN_P_VALUE
from test_spec_decode import counter, exact_joint, greedy, looping_prompts, options_hold, p_value, sampled_joint


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """The model in `src` with noise (`scale` times each matrix's spread) added to its matrices: a draft that
    agrees with it often, not always (greedy: about 40% of proposals at 0.1)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in src.glob("*.safetensors"):
        weights = load_file(f)
        save_file({name: w + scale * w.std() * torch.randn(w.shape, generator=gen) if w.dim() > 1 else w
                   for name, w in weights.items()}, dst / f.name, metadata={"format": "pt"})
    return dst


def draft_config(path, k: int = 3, **extra) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def target(model_dirs) -> Path:
    return model_dirs["llama-gqa-tied"]


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    return perturbed_copy(target, tmp_path_factory.mktemp("draft") / "draft", 0.1)


@pytest.fixture(scope="module")
def engines(target, draft):
    """The target without speculation, with itself as the draft, and with the perturbed draft."""
    built = {name: LLM(str(target), dtype="float32", kv_cache_memory=1 << 24, **options) for name, options in {
        "plain": {}, "same": dict(speculative_config=draft_config(target)),
        "other": dict(speculative_config=draft_config(draft))}.items()}
    yield built
    for llm in built.values():
        llm.engine.executor.shutdown()


def rates(llm, run) -> float:
    """The share of proposals accepted while `run()` ran."""
    drafted, accepted = counter(llm, "spec_decode_num_draft_tokens"), counter(llm, "spec_decode_num_accepted_tokens")
    run()
    drafted = counter(llm, "spec_decode_num_draft_tokens") - drafted
    assert drafted > 0, "nothing was proposed"
    return (counter(llm, "spec_decode_num_accepted_tokens") - accepted) / drafted


def assert_draft_idle(llm) -> None:
    """No request left in the draft's records, every block of its cache back in its pool."""
    llm.engine.check_idle()
    drafter = llm.engine.runner.drafter
    assert drafter.states == {}
    assert sorted(drafter.free) == list(range(drafter.runner.num_blocks))


# -- the configuration ------------------------------------------------------------------------------

def test_config_takes_a_draft_folder(target):
    config = SpeculativeConfig.parse(json.dumps(draft_config(target, 5)))
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", str(target), 5)
    assert config.describe() == f"draft model {target}, 5 tokens"
    for bad, says in [({"method": "draft_model", "num_speculative_tokens": 2}, "goes in 'model'"),
                      ({"method": "ngram", "model": str(target), "num_speculative_tokens": 2}, "takes no model"),
                      ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, "has no config.json")]:
        with pytest.raises(ConfigError) as info:
            SpeculativeConfig.parse(bad)
        assert says in str(info.value)


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(target, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    word = next(w for w in vocab if vocab[w] == 100)
    vocab["renamed-token"] = vocab.pop(word)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        LLM(str(target), dtype="float32", kv_cache_memory=1 << 22, speculative_config=draft_config(other))


def test_a_draft_shorter_than_max_model_len_is_refused(target, tmp_path):
    short = build_tiny_model(tmp_path / "short", "llama-gqa-tied", max_position_embeddings=64)
    with pytest.raises(ValueError, match="handles 64 positions, fewer than max_model_len"):
        LLM(str(target), dtype="float32", kv_cache_memory=1 << 22, max_model_len=128,
            speculative_config=draft_config(short))


# -- exactness ---------------------------------------------------------------------------------------

def test_greedy_equals_decoding_without_and_transformers(engines, target):
    prompts = random_prompts(8, seed=3)
    want = [o.token_ids for o in greedy(engines["plain"], prompts)]
    assert want == reference_greedy(load_reference(target), prompts, 40)
    for name in ("same", "other"):
        got = []
        rate = rates(engines[name], lambda: got.extend(o.token_ids for o in greedy(engines[name], prompts)))
        assert got == want, name
        assert rate == 1.0 if name == "same" else 0.2 < rate < 0.9, (name, rate)
        assert_draft_idle(engines[name])


def test_a_draft_equal_to_the_target_is_always_accepted_when_sampling(engines):
    """Its distribution is the target's: min(1, p/q) is 1 up to rounding, for every proposal."""
    llm = engines["same"]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=4)
    assert rates(llm, lambda: llm.generate(random_prompts(6, seed=5), params, use_tqdm=False)) > 0.99
    assert_draft_idle(llm)


def test_logprobs_penalties_min_tokens_logit_bias_and_stop_strings_hold(engines):
    options_hold(engines["plain"], engines["other"])
    assert_draft_idle(engines["other"])


def test_structured_output_holds(engines):
    from aserve.sampling_params import StructuredOutputsParams

    constraint = StructuredOutputsParams(regex="(the (king|queen|fool) ){4,9}")
    prompts = looping_prompts(4, seed=7)
    want = greedy(engines["plain"], prompts, max_tokens=60, structured_outputs=constraint)
    got = greedy(engines["same"], prompts, max_tokens=60, structured_outputs=constraint)
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [(o.text, o.token_ids, o.finish_reason)
                                                                    for o in want]
    assert_draft_idle(engines["same"])


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_preemption_prefix_hits_and_a_small_draft_cache_change_nothing(engines, target, draft, policy):
    """24 blocks for the target (and 24 for the draft) and 12 prompts: requests are preempted while they
    speculate, the draft gives blocks of idle requests to running ones, and the second round finds its prompts in
    the prefix cache (which the draft prefills for itself)."""
    prompts = looping_prompts(12, seed=9)
    want = [o.token_ids for o in greedy(engines["plain"], prompts, max_tokens=48)]
    tight = LLM(str(target), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(target, 48),
                swap_space=str(kv_memory_for_blocks(target, 96)), speculative_config=draft_config(draft))
    try:
        assert tight.engine.kv.num_blocks == tight.engine.runner.drafter.runner.num_blocks == 24
        for _ in range(2):
            assert [o.token_ids for o in greedy(tight, prompts, max_tokens=48)] == want
        stats = tight.engine.scheduler.stats()
        assert stats.preemptions["swap" if policy == "fcfs-swap" else "recompute"] > 0
        assert stats.prefix_hits > 0
        assert counter(tight, "spec_decode_num_accepted_tokens") > 0
        assert_draft_idle(tight)
    finally:
        tight.engine.executor.shutdown()


def test_disable_by_batch_size_stops_the_draft_for_big_batches(target, draft):
    llm = LLM(str(target), dtype="float32", kv_cache_memory=1 << 24,
              speculative_config=draft_config(draft, disable_by_batch_size=4))
    try:
        want = [o.token_ids for o in greedy(llm, random_prompts(8, seed=3), max_tokens=6)]
        big = counter(llm, "spec_decode_num_drafts")
        greedy(llm, random_prompts(2, seed=3), max_tokens=24)
        assert counter(llm, "spec_decode_num_drafts") > big
        assert big < 8 and len(want) == 8
        assert_draft_idle(llm)
    finally:
        llm.engine.executor.shutdown()


# -- sampling: the target's distribution, whatever the draft proposes ---------------------------------

SAMPLES = 1000  # continuations drawn per check: the negative control's p was 1e-26 at 1000 (1e-49 at 2000)


def test_sampled_tokens_follow_the_target_with_a_different_draft(engines, target, monkeypatch):
    """Four-token continuations under top-2 sampling, with the perturbed draft proposing (about half accepted):
    their frequencies fit the reference model's exact joint distribution. Resampling a rejection from p instead of
    max(p - q, 0) (the negative control) is caught by the same test."""
    prompt = random_prompts(1, lengths=(12, 12), seed=21)[0]
    joint = exact_joint(load_reference(target), prompt, top_k=2, depth=4)
    llm = engines["other"]
    drafted, accepted = counter(llm, "spec_decode_num_draft_tokens"), counter(llm, "spec_decode_num_accepted_tokens")
    counts = sampled_joint(llm, prompt, SAMPLES, top_k=2, depth=4)
    drafted = counter(llm, "spec_decode_num_draft_tokens") - drafted
    accepted = counter(llm, "spec_decode_num_accepted_tokens") - accepted
    assert drafted > SAMPLES and 0.2 < accepted / drafted < 0.95
    assert p_value(counts, joint) > MIN_P_VALUE

    monkeypatch.setattr(sampler, "rejection_sample", redrawn_from_p)
    assert p_value(sampled_joint(llm, prompt, SAMPLES, top_k=2, depth=4), joint) < 1e-6
    assert_draft_idle(llm)


def redrawn_from_p(x, q, proposed, accept_u, residual_u):
    """Keeps d with probability min(1, p(d)/q(d)), as it should, but redraws a rejection from p itself."""
    p = x.float().softmax(dim=-1)
    keep = accept_u * q.gather(1, proposed.unsqueeze(1)).squeeze(1) < p.gather(1, proposed.unsqueeze(1)).squeeze(1)
    cdf = p.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, residual_u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return torch.where(keep, proposed, picked.clamp_(max=x.shape[-1] - 1))


def test_seeded_requests_repeat(engines):
    spec = engines["other"]
    prompts = random_prompts(6, seed=13)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True) for i in range(len(prompts))]
    first = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in spec.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    assert first == again
