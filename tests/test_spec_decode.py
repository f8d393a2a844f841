"""Speculative decoding (n-gram proposals): outputs are those of decoding without it, token for token when greedy
(fp32), and in distribution when sampled (chi-square against the reference model, with a negative control); the
cache gives back every block; the metrics count proposals."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.errors import ConfigError
from aserve.spec_decode.config import SpeculativeConfig
from aserve.spec_decode.ngram import NgramProposer, propose
from aserve.worker import model_runner
from conftest import kv_memory_for_blocks, load_reference, random_prompts, reference_greedy
from test_sampling_stats import MIN_P_VALUE, chi_square_p_value

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that lookups find earlier places to copy from, beside plain ones."""
    phrases = random_prompts(count, lengths=(3, 8), seed=seed)
    plain = random_prompts(count, lengths=(5, 40), seed=seed + 1)
    return [p * 4 + q[:3] if i % 2 else q for i, (p, q) in enumerate(zip(phrases, plain))]


@pytest.fixture(scope="module")
def pair(model_dirs):
    """The same model twice: without and with n-gram speculation."""
    path = str(model_dirs["llama-gqa-tied"])
    plain = LLM(path, dtype="float32", kv_cache_memory=1 << 24)
    spec = LLM(path, dtype="float32", kv_cache_memory=1 << 24, speculative_config=NGRAM)
    yield plain, spec
    for llm in (plain, spec):
        llm.engine.executor.shutdown()


def counter(llm, name: str) -> float:
    return sum(value for metric, _, value in llm.get_metrics() if metric == f"aserve:{name}_total")


# -- the configuration and the lookup ---------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min (5) must be <= prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown key(s) lookahead"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused_with_a_reason(bad, says):
    with pytest.raises(ConfigError, match=None) as info:
        SpeculativeConfig.parse(bad)
    assert says in str(info.value)


def test_config_reads_json_text():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
            config.disable_by_batch_size) == (3, 2, 4, 8)


def test_lookup_finds_the_longest_suffix():
    tokens = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3])
    assert propose(tokens, 2, 4, 3) == [4, 7, 8]  # [1, 2, 3] twice: the latest that 3 tokens follow
    assert propose(tokens, 2, 4, 6) == [4, 7, 8, 1, 2, 3]
    assert propose(tokens, 2, 4, 7) == [4, 5, 9, 9, 1, 2, 3]  # none has 7 after it: the earliest
    assert propose(np.array([5, 6, 7, 8]), 1, 4, 3) == []
    assert propose(np.array([7, 1, 2, 9, 2]), 2, 3, 2) == []  # [9, 2] never occurred before; 1 token is too short
    assert propose(np.array([7, 1, 2, 9, 2]), 1, 3, 2) == [9, 2]


def test_proposer_keeps_a_growing_buffer_per_request():
    proposer = NgramProposer(3, 1, 3)
    tokens = [4, 5, 6, 4]
    assert proposer.propose([("a", tokens, 3)]) == {"a": [5, 6, 4]}
    tokens += [5, 6]
    assert proposer.propose([("a", tokens, 2), ("b", [1, 2], 3)]) == {"a": [4, 5]}
    assert set(proposer.buffers) == {"a", "b"}
    assert proposer.propose([("b", [1, 2, 1], 3)]) == {"b": [2, 1]}
    assert set(proposer.buffers) == {"b"}  # a request no longer asked about is forgotten
    big = np.random.default_rng(0).integers(1, 1000, 50_000).tolist()
    assert proposer.propose([("c", big + big[:5], 4)])["c"] == big[5:8]  # the quoted start goes on


# -- exactness --------------------------------------------------------------------------------------

def greedy(llm, prompts, max_tokens=40, **options):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_decoding_without_and_transformers(pair, model_dirs):
    plain, spec = pair
    prompts = looping_prompts(8, seed=3)
    drafts_before = counter(spec, "spec_decode_num_drafts")
    accepted_before = counter(spec, "spec_decode_num_accepted_tokens")
    got = [o.token_ids for o in greedy(spec, prompts)]
    assert got == [o.token_ids for o in greedy(plain, prompts)]
    assert got == reference_greedy(load_reference(model_dirs["llama-gqa-tied"]), prompts, 40)
    assert counter(spec, "spec_decode_num_drafts") > drafts_before
    assert counter(spec, "spec_decode_num_accepted_tokens") > accepted_before + 20, "too few accepted to test"
    spec.engine.check_idle()


def test_logprobs_penalties_min_tokens_logit_bias_and_stop_strings_hold(pair):
    """Each checked position is sampled with the history its proposals give it: penalties, min_tokens, logit_bias
    and logprobs come out as without speculation; a stop string inside an accepted run cuts the rest off."""
    options_hold(*pair)


def options_hold(plain, spec) -> None:
    """Greedy outputs of `spec` (speculating) equal those of `plain` under each sampling option, and with a stop
    string; no request is left behind. (Shared with the draft-model tests.)"""
    prompts = looping_prompts(6, seed=5)
    for options in (dict(logprobs=3), dict(repetition_penalty=1.3, frequency_penalty=0.2),
                    dict(min_tokens=30, stop_token_ids=[7, 9, 11]), dict(logit_bias={7: 2.0, 9: -3.0, 300: 4.0})):
        want, got = greedy(plain, prompts, **options), greedy(spec, prompts, **options)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], options
        if "logprobs" in options:
            for g, w in zip(got, want):
                assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
                for ge, we in zip(g.logprobs, w.logprobs):
                    for token in we:
                        assert ge[token].logprob == pytest.approx(we[token].logprob, abs=1e-5)
    texts = [o.text for o in greedy(plain, prompts)]
    stop = next(t[12:15] for t in texts if len(t) > 20 and t[12:15].strip())
    want, got = greedy(plain, prompts, stop=[stop]), greedy(spec, prompts, stop=[stop])
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [(o.text, o.token_ids, o.finish_reason)
                                                                    for o in want]
    spec.engine.check_idle()


def test_structured_output_holds_and_speculates(pair):
    """Under a grammar, proposals are cut where the grammar refuses them, each checked position is masked by the
    matcher walked along the proposals before it (then rolled back), and the output is the one without."""
    from aserve.sampling_params import StructuredOutputsParams

    plain, spec = pair
    prompts = looping_prompts(4, seed=7)
    constraint = StructuredOutputsParams(regex="(the (king|queen|fool) ){4,9}")
    accepted = counter(spec, "spec_decode_num_accepted_tokens")
    want = greedy(plain, prompts, max_tokens=60, structured_outputs=constraint)
    got = greedy(spec, prompts, max_tokens=60, structured_outputs=constraint)
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [(o.text, o.token_ids, o.finish_reason)
                                                                    for o in want]
    assert all(o.finish_reason == "stop" for o in got)
    assert counter(spec, "spec_decode_num_accepted_tokens") > accepted + 10
    spec.engine.check_idle()


@contextlib.contextmanager
def tight_cache_rounds(plain, path, policy: str, **options):
    """12 looping prompts through an engine of `options` with a cache of 24 blocks, twice: each round's greedy
    outputs are `plain`'s, and requests were preempted as `policy` does it. Yields the engine and its scheduler's
    stats, and checks after that no block is left behind. (Shared with the multi-step tests.)"""
    prompts = looping_prompts(12, seed=9)
    want = [o.token_ids for o in greedy(plain, prompts, max_tokens=48)]
    tight = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 24),
                swap_space=str(kv_memory_for_blocks(path, 96)), **options)
    try:
        for _ in range(2):
            assert [o.token_ids for o in greedy(tight, prompts, max_tokens=48)] == want
        stats = tight.engine.scheduler.stats()
        assert stats.preemptions["swap" if policy == "fcfs-swap" else "recompute"] > 0
        yield tight, stats
        tight.engine.check_idle()
    finally:
        tight.engine.executor.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_preemption_and_prefix_hits_change_nothing(pair, model_dirs, policy):
    """A cache of 24 blocks for 12 looping prompts: requests are preempted (recomputed or swapped) while they
    speculate; the second round finds its prompts in the prefix cache. No block is left behind."""
    with tight_cache_rounds(pair[0], model_dirs["llama-gqa-tied"], policy, speculative_config=NGRAM) as (tight, stats):
        assert stats.prefix_hits > 0
        assert counter(tight, "spec_decode_num_accepted_tokens") > 0


def test_disable_by_batch_size_turns_it_off_for_big_batches(model_dirs):
    path = str(model_dirs["llama-gqa-tied"])
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 24,
              speculative_config={**NGRAM, "disable_by_batch_size": 4})
    try:
        greedy(llm, looping_prompts(8, seed=3), max_tokens=4)  # 8 at once: all steps but the tail without
        big = counter(llm, "spec_decode_num_drafts")
        greedy(llm, looping_prompts(2, seed=3), max_tokens=24)
        assert counter(llm, "spec_decode_num_drafts") > big
        assert big < 8
    finally:
        llm.engine.executor.shutdown()


# -- sampling: the target's distribution, whatever is proposed ----------------------------------------

def exact_joint(reference, prompt: list[int], top_k: int, depth: int) -> dict[tuple[int, ...], float]:
    """The probability of every `depth`-token continuation under top-k sampling at temperature 1."""
    joint = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, p in joint.items():
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            values, ids = logits.topk(top_k)
            for token, q in zip(ids.tolist(), values.softmax(-1).tolist()):
                grown[prefix + (token,)] = p * q
        joint = grown
    return joint


def sampled_joint(llm, prompt: list[int], count: int, top_k: int, depth: int) -> dict[tuple[int, ...], int]:
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=depth, ignore_eos=True)
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([prompt] * count, params, use_tqdm=False):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def p_value(counts: dict, joint: dict) -> float:
    """Goodness of fit of the drawn continuations to the exact joint; 0 if one was drawn that it cannot give."""
    keys = sorted(joint)
    if not set(counts) <= set(joint):
        return 0.0
    return chi_square_p_value(torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64),
                              torch.tensor([joint[k] for k in keys], dtype=torch.float64))


def test_sampled_tokens_follow_the_target_whatever_is_proposed(model_dirs, monkeypatch):
    """Proposals forced to the likeliest continuation (accepted about half the time): three-token continuations
    under top-2 sampling follow the reference model's exact joint distribution. A verifier that keeps the first
    proposal unchecked (the negative control) is caught by the same test."""
    path = model_dirs["llama-gqa-tied"]
    reference = load_reference(path)
    prompt = random_prompts(1, lengths=(12, 12), seed=21)[0]
    joint = exact_joint(reference, prompt, top_k=2, depth=3)
    likeliest = max(joint, key=joint.get)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 24, speculative_config=NGRAM)
    try:
        engine = llm.engine
        monkeypatch.setattr(engine.proposer, "propose",
                            lambda asks: {rid: list(likeliest[len(tokens) - len(prompt):])[:most] or [likeliest[0]]
                                          for rid, tokens, most in asks})
        counts = sampled_joint(llm, prompt, 3000, top_k=2, depth=3)
        proposed = counter(llm, "spec_decode_num_draft_tokens")
        accepted = counter(llm, "spec_decode_num_accepted_tokens")
        assert proposed > 2000 and 0.2 < accepted / proposed < 0.9
        assert p_value(counts, joint) > MIN_P_VALUE

        real = model_runner.accept_proposals

        def unchecked_first(results, spec):  # keeps proposal 0 whatever the target drew
            final = real(results, spec)
            if not final.accepted:
                final.token_id, final.accepted = spec[0], []
            return final

        monkeypatch.setattr(model_runner, "accept_proposals", unchecked_first)
        assert p_value(sampled_joint(llm, prompt, 3000, top_k=2, depth=3), joint) < 1e-6
    finally:
        llm.engine.executor.shutdown()


def test_seeded_requests_repeat_with_speculation(pair):
    _, spec = pair
    prompts = looping_prompts(6, seed=13)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True) for i in range(len(prompts))]
    first = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in spec.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    assert first == again


def test_the_flag_and_state_say_what_is_on(pair):
    import argparse

    from aserve.config import EngineConfig, add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineConfig.from_kwargs(**engine_options(args))
    assert SpeculativeConfig.parse(config.speculative_config).num_speculative_tokens == 3
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram"})
    plain, spec = pair
    assert spec.engine.state()["speculative"] == "ngram, 4 tokens, lookup 1..4"
    assert plain.engine.state()["speculative"] is None
