"""Beam search against transformers' own (fp32, the same weights): the same hypotheses in the same order with the
same scores, across models, widths, length penalties and stopping rules, and through preemption."""
from __future__ import annotations

import math

import re
from collections import Counter

import pytest
import torch

from aserve import BeamSearchParams, LLM, SamplingParams
from conftest import VOCAB, kv_memory_for_blocks, load_reference, random_prompts, reference_greedy

FAMILIES = ["llama-gqa-tied", "qwen3", "opt"]
MAX_TOKENS = 12
NEVER = VOCAB + 1  # an eos id no token matches: transformers' beam search with nothing that stops it


def reference_beams(model, ids: list[int], width: int, max_tokens: int, length_penalty: float, stop: list[int],
                    early_stopping=False) -> list[tuple[list[int], float]]:
    """transformers' beam search for one prompt: each hypothesis's generated tokens and its score, best first."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, num_beams=width, num_return_sequences=width,
                             max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=stop or [NEVER], pad_token_id=0, return_dict_in_generate=True,
                             output_scores=True)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [(seq[len(ids):len(ids) + n].tolist(), score)
            for seq, n, score in zip(out.sequences, lengths, out.sequences_scores.tolist())]


@pytest.fixture(scope="module")
def engines(model_dirs):
    """One engine and one reference model per family, for every case below."""
    made = {family: (LLM(str(model_dirs[family]), dtype="float32", kv_cache_memory=1 << 24),
                     load_reference(model_dirs[family])) for family in FAMILIES}
    yield made
    for llm, _ in made.values():
        llm.engine.executor.shutdown()


PROMPTS = random_prompts(2, lengths=(5, 30), seed=3)


def stop_token(llm, width: int) -> int:
    """A token the beams generate often after their first step: as a stop token, hypotheses end at several
    lengths."""
    outs = llm.beam_search(PROMPTS, BeamSearchParams(width, MAX_TOKENS, ignore_eos=True))
    counts = Counter(t for out in outs for seq in out.sequences for t in seq.tokens[-MAX_TOKENS + 1:])
    return counts.most_common(1)[0][0]


def check_against_reference(llm, reference, width: int, length_penalty: float, stop: list[int], **options):
    """`stop`: stop tokens, with the model's eos; none: ignore_eos, only max_tokens ends a hypothesis."""
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty, stop_token_ids=stop,
                              ignore_eos=not stop, **options)
    outs = llm.beam_search(PROMPTS, params)
    reasons = []
    stop_ids = sorted(set(stop) | llm.engine.eos_token_ids) if stop else []
    for ids, out in zip(PROMPTS, outs):
        expected = reference_beams(reference, ids, width, MAX_TOKENS, length_penalty, stop_ids,
                                   options.get("early_stopping", False))
        got = [(seq.tokens[len(ids):], seq.score) for seq in out.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, score), (_, want) in zip(got, expected):
            assert score == pytest.approx(want, abs=1e-4)
        for seq in out.sequences:
            assert seq.tokens[:len(ids)] == ids
            n = len(seq.tokens) - len(ids)
            assert seq.score == pytest.approx(seq.cum_logprob / n ** length_penalty, abs=1e-6)
            assert len(seq.logprobs) == n and seq.cum_logprob == pytest.approx(
                sum(lp.logprob for entry in seq.logprobs for lp in entry.values()), abs=1e-5)
        reasons += [seq.finish_reason for seq in out.sequences]
    llm.engine.check_idle()
    return reasons


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_match_transformers(engines, family, width):
    """Widths 2, 4, 8 with length_penalty 0, 1 and 2; stopping at a token the beams often produce (hypotheses
    end at different lengths) and with nothing that stops them before max_tokens."""
    llm, reference = engines[family]
    stop = [stop_token(llm, width)]
    reasons = []
    for length_penalty in (0.0, 1.0, 2.0):
        assert set(check_against_reference(llm, reference, width, length_penalty, [])) == {"length"}
        reasons += check_against_reference(llm, reference, width, length_penalty, stop)
    assert "stop" in reasons, "the stop token never ended a kept hypothesis: the case tests nothing"


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_early_stopping_matches_transformers(engines, early_stopping):
    llm, reference = engines["llama-gqa-tied"]
    stop = [stop_token(llm, 4)]
    for length_penalty in (0.0, 2.0):
        check_against_reference(llm, reference, 4, length_penalty, stop, early_stopping=early_stopping)


@pytest.mark.parametrize("length_penalty", [1e5, -1e5])
def test_extreme_length_penalties_leave_the_engine_running(engines, length_penalty):
    """A penalty the API allows but whose power leaves the floats' range: every score saturates (-0.0 or -inf, as
    floats do) instead of raising in the engine's loop (a fuzzed request's OverflowError once ended it)."""
    llm, _ = engines["llama-gqa-tied"]
    outs = llm.beam_search(PROMPTS[:2], BeamSearchParams(2, MAX_TOKENS, length_penalty=length_penalty))
    scores = [seq.score for out in outs for seq in out.sequences]
    assert len(scores) == 4 and all(score == (-0.0 if length_penalty > 0 else -math.inf) for score in scores)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3),
                                                         use_tqdm=False)][0]
    llm.engine.check_idle()


@pytest.mark.parametrize("family", FAMILIES)
def test_width_one_is_greedy(engines, family):
    llm, reference = engines[family]
    outs = llm.beam_search(PROMPTS, BeamSearchParams(1, MAX_TOKENS))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    expected = reference_greedy(reference, PROMPTS, MAX_TOKENS)
    for ids, out, plain, want in zip(PROMPTS, outs, greedy, expected):
        assert out.sequences[0].tokens[len(ids):] == plain.outputs[0].token_ids == want
    llm.engine.check_idle()


def sequences(outs) -> list[list[tuple[list[int], float]]]:
    return [[(seq.tokens, seq.score) for seq in out.sequences] for out in outs]


def assert_same(got, expected):
    for g, e in zip(sequences(got), sequences(expected), strict=True):
        assert [tokens for tokens, _ in g] == [tokens for tokens, _ in e]
        assert [score for _, score in g] == pytest.approx([score for _, score in e], abs=1e-4)


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_beams_survive_preemption_and_a_tiny_cache(model_dirs, engines, policy):
    """Six width-4 searches in a cache that holds about one at a time: groups are preempted as a unit (recomputed,
    or swapped out and back with their shared blocks), and every hypothesis comes out as with room to spare."""
    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(6, lengths=(5, 30), seed=7)
    params = BeamSearchParams(4, MAX_TOKENS, ignore_eos=True)
    expected = roomy.beam_search(prompts, params)
    tight = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 16),
                swap_space=str(kv_memory_for_blocks(path, 64)))
    try:
        assert_same(tight.beam_search(prompts, params), expected)
        preemptions = tight.engine.scheduler.stats().preemptions
        assert preemptions["swap" if policy == "fcfs-swap" else "recompute"] > 0
        tight.engine.check_idle()
    finally:
        tight.engine.executor.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_search_too_wide_to_recompute_is_swapped(model_dirs, engines, policy):
    """Two width-2 searches over long prompts in a cache that holds one of them only while its beams share the
    prompt's blocks. Recomputed, each beam takes its own copy, so the preempted search needed more than the whole
    cache and waited forever with every block free (found by a randomized server run). It is swapped instead,
    whatever the policy asks, and both searches come out as with room to spare."""
    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(1, lengths=(80, 80), seed=5) + random_prompts(1, lengths=(140, 140), seed=6)
    params = BeamSearchParams(2, MAX_TOKENS, ignore_eos=True)
    expected = roomy.beam_search(prompts, params)
    tight = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 16),
                swap_space=str(kv_memory_for_blocks(path, 64)))
    engine = tight.engine
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"s{i}")
        done = {}
        for _ in range(500):
            done |= {out.request_id: out for out in engine.step() if out.finished}
            if not engine.has_unfinished():
                break
        assert set(done) == {"s0", "s1"}, f"{engine.scheduler.stats()}"
        for request_id, ids, want in zip(("s0", "s1"), prompts, expected):
            assert [ids + o.token_ids for o in done[request_id].outputs] == [seq.tokens for seq in want.sequences]
        assert engine.scheduler.stats().preemptions["swap"] > 0
        engine.check_idle()
    finally:
        engine.executor.shutdown()


def run_with_host_held(path, prompts, held: int):
    """Searches over the two long prompts, then an ordinary request that fcfs-swap swaps out before the wider
    search is preempted, in a cache where that search cannot come back by recompute, with `held` of the host
    pool's 14 blocks taken first (as other swapped requests would hold them). Returns the finished outputs by
    id and the scheduler's stats."""
    llm = LLM(str(path), dtype="float32", policy="fcfs-swap", kv_cache_memory=kv_memory_for_blocks(path, 18),
              swap_space=str(kv_memory_for_blocks(path, 14)))
    engine = llm.engine
    host_pool = engine.kv.host_pool
    taken = [host_pool.allocate() for _ in range(held)]
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, BeamSearchParams(2, MAX_TOKENS, ignore_eos=True), request_id=f"s{i}")
        engine.add_request(random_prompts(1, lengths=(40, 40), seed=2)[0],
                           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0), request_id="r")
        done = {}
        for _ in range(500):
            done |= {out.request_id: out for out in engine.step() if out.finished}
            if not engine.has_unfinished():
                break
        stats = engine.scheduler.stats()
        for block in taken:
            host_pool.release(block)
        engine.check_idle()
        return done, stats
    finally:
        engine.executor.shutdown()


def test_a_search_that_only_swap_can_keep_takes_the_host_pool_from_recomputable_requests(model_dirs, engines):
    """The host pool is full when a search that cannot be recomputed is preempted: the ordinary request swapped
    before it gives its host blocks up and is recomputed instead, and the search is swapped. Without that the
    search was recomputed, each beam with its own prompt: more than the whole cache, waiting forever."""
    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(1, lengths=(80, 80), seed=5) + random_prompts(1, lengths=(140, 140), seed=6)
    expected = roomy.beam_search(prompts, BeamSearchParams(2, MAX_TOKENS, ignore_eos=True))
    done, stats = run_with_host_held(path, prompts, held=3)
    assert set(done) == {"s0", "s1", "r"}, f"{stats}"
    for request_id, ids, want in zip(("s0", "s1"), prompts, expected):
        assert [ids + o.token_ids for o in done[request_id].outputs] == [seq.tokens for seq in want.sequences]
    alone = roomy.generate([random_prompts(1, lengths=(40, 40), seed=2)[0]],
                           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))[0]
    assert done["r"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert stats.preemptions["swap"] >= 2 and stats.recomputed_tokens > 0  # r swapped, then given up for s1


def test_a_search_that_neither_swap_nor_recompute_can_keep_fails_alone(model_dirs, engines):
    """With the host pool held by what cannot give it up, the preempted search ends with an error that says why
    and what to raise; the other search and the ordinary request finish as they would have, and the cache is
    clean."""
    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(1, lengths=(80, 80), seed=5) + random_prompts(1, lengths=(140, 140), seed=6)
    expected = roomy.beam_search(prompts[:1], BeamSearchParams(2, MAX_TOKENS, ignore_eos=True))
    done, stats = run_with_host_held(path, prompts, held=10)
    assert set(done) == {"s0", "s1", "r"}, f"{stats}"
    assert done["s1"].outputs[0].finish_reason == "error"
    assert re.search(r"no room to keep its 2 beams.*raise swap_space or kv_cache_memory", done["s1"].outputs[0].error)
    assert [prompts[0] + o.token_ids for o in done["s0"].outputs] == [seq.tokens for seq in expected[0].sequences]
    alone = roomy.generate([random_prompts(1, lengths=(40, 40), seed=2)[0]],
                           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))[0]
    assert done["r"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_without_a_swap_pool_a_search_must_fit_recomputed(model_dirs):
    """With no host pool to swap to, a preempted search is recomputed, each beam with its own copy of the prompt:
    admission counts that, and refuses a search that would fit only while its beams share (the case above)."""
    from aserve.errors import InvalidRequestError

    path = model_dirs["llama-gqa-tied"]
    prompt = random_prompts(1, lengths=(140, 140), seed=6)[0]
    with_pool = LLM(str(path), dtype="float32", kv_cache_memory=kv_memory_for_blocks(path, 16),
                    swap_space=str(kv_memory_for_blocks(path, 64)))
    without = LLM(str(path), dtype="float32", kv_cache_memory=kv_memory_for_blocks(path, 16), swap_space=0)
    try:
        assert len(with_pool.beam_search([prompt], BeamSearchParams(2, MAX_TOKENS))[0].sequences) == 2
        with pytest.raises(InvalidRequestError, match="each with its own copy of the prompt"):
            without.beam_search([prompt], BeamSearchParams(2, MAX_TOKENS))
        assert len(without.beam_search([prompt[:100]], BeamSearchParams(2, MAX_TOKENS))[0].sequences) == 2
    finally:
        with_pool.engine.executor.shutdown()
        without.engine.executor.shutdown()


def test_beams_beside_ordinary_requests(engines):
    """Beam searches and sampled requests share steps; neither changes the other's output."""
    llm, _ = engines["qwen3"]
    prompts = random_prompts(4, lengths=(5, 30), seed=11)
    params = BeamSearchParams(3, MAX_TOKENS, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected_beams = llm.beam_search(prompts, params)
    expected_greedy = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=f"beam{i}")
        engine.add_request(ids, greedy, request_id=f"greedy{i}", output_kind="final")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, ids in enumerate(prompts):
        assert [ids + o.token_ids for o in done[f"beam{i}"].outputs] == [s.tokens for s in expected_beams[i].sequences]
        assert done[f"greedy{i}"].outputs[0].token_ids == expected_greedy[i]
    engine.check_idle()


def test_no_block_leaks_after_many_searches_with_aborts(engines):
    """100 searches of mixed widths, a third aborted at different points (waiting, mid-prefill, mid-search): every
    block is free afterwards and the worker holds no beam."""
    llm, _ = engines["opt"]
    engine = llm.engine
    prompts = random_prompts(100, lengths=(3, 40), seed=5)
    for i, ids in enumerate(prompts):
        engine.add_request(ids, BeamSearchParams(1 + i % 5, 4 + i % 9, ignore_eos=i % 2 == 0), request_id=f"b{i}")
    step = 0
    ended = {}
    while engine.has_unfinished():
        for out in engine.step():
            ended[out.request_id] = out
        step += 1
        if step % 3 == 0:
            live = [r for r in engine.requests if r not in ended]
            for request_id in live[step % 7::11][:2]:
                final = engine.abort(request_id)[0]
                assert final.finished and all(o.finish_reason == "abort" for o in final.outputs)
                ended[request_id] = final
    assert len(ended) == 100
    assert any(all(o.finish_reason == "abort" for o in out.outputs) for out in ended.values())
    engine.check_idle()


def test_peak_blocks_below_independent_samples(engines):
    """The point of sharing: a width-4 search holds fewer blocks at its peak than 4 independent samples of the same
    prompt and length (n=4, whose samples share only the prompt)."""
    llm, _ = engines["llama-gqa-tied"]
    engine = llm.engine
    prompt = random_prompts(1, lengths=(40, 40), seed=2)[0]

    def peak(params) -> int:
        engine.add_request(prompt, params, request_id="peak")
        most = 0
        while engine.has_unfinished():
            engine.step()
            most = max(most, engine.kv.num_blocks - engine.kv.num_free_blocks)
        engine.check_idle()
        return most

    beams = peak(BeamSearchParams(4, 48, ignore_eos=True))
    samples = peak(SamplingParams(n=4, max_tokens=48, ignore_eos=True, seed=0))
    assert beams < samples


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_hypotheses(engines, include):
    """A candidate whose text completes a stop string stops there like a stop token: its hypothesis's text is cut
    at it (kept with include_stop_str_in_output) and names it as stop_reason; no kept text runs past one."""
    llm, _ = engines["llama-gqa-tied"]
    free = llm.beam_search(PROMPTS, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True))
    generated = free[0].sequences[0].text[len(llm.get_tokenizer().decode(PROMPTS[0])):]
    stop = generated.strip()[4:7]
    assert len(stop) == 3
    outs = llm.beam_search(PROMPTS, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=include))
    reasons = []
    for out, ids in zip(outs, PROMPTS):
        prompt_text = llm.get_tokenizer().decode(ids)
        for seq in out.sequences:
            text = seq.text[len(prompt_text):]
            reasons.append(seq.finish_reason)
            if seq.finish_reason == "stop":
                assert seq.stop_reason == stop
                assert text.endswith(stop) if include else stop not in text
            else:
                assert stop not in text
    assert "stop" in reasons
    llm.engine.check_idle()


def test_async_llm_yields_one_final_output(model_dirs, engines):
    """AsyncLLM.beam_search (the core in its own process): one final RequestOutput with beam_width outputs, best
    first, as LLM.beam_search gives; concurrent searches do not disturb each other."""
    import asyncio

    from aserve import AsyncLLM
    from conftest import until

    llm, _ = engines["llama-gqa-tied"]
    params = BeamSearchParams(4, MAX_TOKENS, ignore_eos=True, length_penalty=0.5)
    expected = [[seq.tokens[len(ids):] for seq in out.sequences] for ids, out in zip(PROMPTS, llm.beam_search(PROMPTS, params))]

    async def main():
        async with AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB") as engine:
            async def one(i):
                finals = [out async for out in engine.beam_search({"prompt_token_ids": PROMPTS[i]}, f"b{i}", params)]
                assert len(finals) == 1 and finals[0].finished
                return [o.token_ids for o in finals[0].outputs]
            got = await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])
            assert got == expected
            await until(engine.state, lambda s: s["num_live_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"],
                        "the core to hold no request")
    asyncio.run(main())


class GrammarMask:
    """transformers' side of a constrained beam search (a LogitsProcessor): each row's generated tokens replayed
    through a fresh matcher of the same compiled grammar, every token it does not allow next set to -inf. It runs
    after transformers' log-softmax, so scores stay the model's own log-probabilities, as aserve scores them."""

    def __init__(self, compiled, stop_ids: list[int], prompt_len: int):
        self.compiled, self.stop_ids, self.prompt_len = compiled, stop_ids, prompt_len

    def __call__(self, input_ids, scores):
        import xgrammar

        from aserve.structured_output.grammar import RequestGrammar

        for row, ids in enumerate(input_ids.tolist()):
            grammar = RequestGrammar(self.compiled, self.stop_ids)
            if not grammar.follow(ids[self.prompt_len:]) or grammar.terminated:
                continue  # a junk beam (transformers fills a step's slots past the allowed tokens) or a finished one
            mask = xgrammar.allocate_token_bitmask(1, scores.shape[-1])
            grammar.matcher.fill_next_token_bitmask(mask)
            xgrammar.apply_token_bitmask_inplace(scores[row:row + 1], mask)
        return scores


GRAMMARS = {"regex": dict(regex=r"[a-z]{1,6}( [a-z]{1,6}){0,2}\."),
            "choice": dict(choice=["the king", "the queen", "a fool", "my lord, the king"])}


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("width", [2, 4])
def test_constrained_beams_match_transformers(engines, kind, width):
    """Structured output: every beam stays within the grammar (its own matcher, forked as beams fork), a candidate
    that completes it stops, and the hypotheses, their order and scores are transformers' with the same grammar
    masking its beam search. Where the grammar allows fewer continuations than transformers has slots, transformers
    fills them with beams scored near -1e9; only its finite hypotheses are compared."""
    from transformers import LogitsProcessorList

    from aserve.sampling_params import StructuredOutputsParams

    llm, reference = engines["llama-gqa-tied"]
    constraint = StructuredOutputsParams(**GRAMMARS[kind])
    manager = llm.engine.structured
    compiled = manager.compiled(constraint).result()
    max_tokens = 16
    outs = llm.beam_search(PROMPTS, BeamSearchParams(width, max_tokens, length_penalty=0.5,
                                                    structured_outputs=constraint))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = reference.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens, length_penalty=0.5,
                eos_token_id=sorted(llm.engine.eos_token_ids), pad_token_id=0, return_dict_in_generate=True,
                output_scores=True,
                logits_processor=LogitsProcessorList([GrammarMask(compiled, manager.stop_token_ids, len(ids))]))
        lengths = (ref.beam_indices != -1).sum(dim=1).tolist()
        expected = [(seq[len(ids):len(ids) + n].tolist(), score)
                    for seq, n, score in zip(ref.sequences, lengths, ref.sequences_scores.tolist()) if score > -1e8]
        got = [(seq.tokens[len(ids):], seq.score) for seq in out.sequences]
        assert [tokens for tokens, _ in got[:len(expected)]] == [tokens for tokens, _ in expected]
        assert [s for _, s in got[:len(expected)]] == pytest.approx([s for _, s in expected], abs=1e-4)
        prompt_text = llm.get_tokenizer().decode(ids)
        for seq in out.sequences:
            text = seq.text[len(prompt_text):]
            if seq.finish_reason == "stop":
                if kind == "regex":
                    assert re.fullmatch(GRAMMARS[kind]["regex"], text), text
                else:
                    assert text in GRAMMARS[kind]["choice"], text
        if kind == "choice":
            assert all(seq.finish_reason == "stop" for seq in out.sequences)
            assert len({tuple(seq.tokens) for seq in out.sequences}) == len(out.sequences)  # (texts may repeat)
    llm.engine.check_idle()


def test_priority_policy_sees_a_search_as_one_request(model_dirs, engines):
    """Under the priority policy in a tight cache, urgent searches arriving late preempt running ones as whole
    groups; every event and victim the policy sees is a search's first beam, never one of its other beams, and
    every hypothesis comes out as with room to spare."""
    from aserve_policies.priority import PriorityPolicy

    class Watching(PriorityPolicy):
        seen: set[str] = set()

        def on_event(self, req, event):
            self.seen.add(req.request_id)
            super().on_event(req, event)

        def select_victim(self, running, needing):
            self.seen.update(r.request_id for r in (*running, needing))
            return super().select_victim(running, needing)

    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(5, lengths=(20, 30), seed=13)
    params = BeamSearchParams(4, MAX_TOKENS, ignore_eos=True)
    expected = roomy.beam_search(prompts, params)
    policy = Watching()
    tight = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 16))
    engine = tight.engine
    try:
        for i in range(3):
            engine.add_request(prompts[i], params, request_id=f"late{i}", priority=1)
        for _ in range(3):
            engine.step()
        for i in range(3, 5):
            engine.add_request(prompts[i], params, request_id=f"urgent{i}", priority=0)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        ids = ["late0", "late1", "late2", "urgent3", "urgent4"]
        for request_id, ids_, want in zip(ids, prompts, expected):
            assert [ids_ + o.token_ids for o in done[request_id].outputs] == [s.tokens for s in want.sequences]
        assert engine.scheduler.stats().preemptions["recompute"] > 0
        assert policy.seen and policy.seen <= set(ids)
        engine.check_idle()
    finally:
        engine.executor.shutdown()


def test_max_num_seqs_counts_every_beam(model_dirs, engines):
    """max_num_seqs caps a step's sequences: a width-4 search counts as 4 (from its admission on), so two of them
    never run together under a cap of 6, and a width past the cap is refused up front."""
    from aserve.errors import InvalidRequestError

    path = model_dirs["llama-gqa-tied"]
    roomy, _ = engines["llama-gqa-tied"]
    prompts = random_prompts(3, lengths=(5, 30), seed=17)
    params = BeamSearchParams(4, MAX_TOKENS, ignore_eos=True)
    expected = roomy.beam_search(prompts, params)
    capped = LLM(str(path), dtype="float32", max_num_seqs=6, kv_cache_memory=1 << 24)
    engine = capped.engine
    try:
        with pytest.raises(InvalidRequestError, match="beam_width must be at most 6"):
            capped.beam_search(prompts[:1], BeamSearchParams(8, 4))
        for i, ids in enumerate(prompts):
            engine.add_request(ids, params, request_id=f"s{i}")
        done, most = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
            most = max(most, len(engine.scheduler.scheduled))
            assert sum(len(r.sequences) for r in engine.scheduler.running) <= 6
        assert most == 4
        for i, (ids, want) in enumerate(zip(prompts, expected)):
            assert [ids + o.token_ids for o in done[f"s{i}"].outputs] == [s.tokens for s in want.sequences]
        engine.check_idle()
    finally:
        engine.executor.shutdown()
