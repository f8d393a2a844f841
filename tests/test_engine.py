"""Engine behaviour: block accounting, aborts, sampling options, stop conditions and bad input."""
from __future__ import annotations

import ctypes
import json
import mmap
import shutil
from types import SimpleNamespace

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.errors import InvalidRequestError
from aserve.request import RequestStatus
from aserve.worker.request_state import RequestState
from aserve.worker.sampler import apply_penalties, scale
from conftest import kv_memory_for_blocks, load_reference, random_prompts

PROMPTS = random_prompts(12, lengths=(5, 50), seed=7)
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB")


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def drain(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def resident_pages(tensor: torch.Tensor) -> list[bool]:
    """Which of the pages under `tensor` (contiguous) are in memory, by mincore(2): a lazily zeroed page that
    was never touched is not."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    count = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    flags = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * page), flags) == 0, ctypes.get_errno()
    return [bool(f & 1) for f in flags]


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_zero_blocks_zeroes_those_blocks_in_every_layer_and_nothing_else(model_dirs, monkeypatch, path):
    """Freshly handed-out blocks are zeroed (a NaN an earlier owner left must not reach a new one): every layer's K
    and V of every KV head, those blocks only; an empty list zeroes nothing. "cuda" takes the GPU's index_fill_
    branch over this CPU cache (it once built a float index from an empty list, which the GPU refused)."""
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB", device="cpu")
    runner = llm.engine.executor.worker.runner
    monkeypatch.setattr(runner, "device", torch.device(path))
    runner.kv_cache.fill_(float("nan"))
    runner.zero_blocks([])
    assert runner.kv_cache.isnan().all()
    runner.zero_blocks([2, 5])
    per_block = runner.kv_cache.movedim(runner.block_dim, 0)
    assert not per_block[[2, 5]].isnan().any() and not per_block[[2, 5]].any()
    keep = [b for b in range(per_block.shape[0]) if b not in (2, 5)]
    assert per_block[keep].isnan().all()


def test_fresh_blocks_a_step_fills_are_not_zeroed_first(model_dirs, monkeypatch):
    """Zeroing is for the slots a step leaves unwritten: a 40-token prompt's two whole blocks are written in every
    layer before any is read, so only the third, partly written block is zeroed. Over a cache full of NaN the
    output stays what a fresh engine gives."""
    path = str(model_dirs["llama-gqa-tied"])
    params = SamplingParams(temperature=0, max_tokens=3)
    prompt = list(range(5, 45))
    expected = LLM(path, dtype="float32", kv_cache_memory="16MiB", device="cpu").generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", device="cpu", enable_prefix_caching=False)
    runner = llm.engine.executor.worker.runner
    runner.kv_cache.fill_(float("nan"))
    zeroed = []
    zero_blocks = runner.zero_blocks
    monkeypatch.setattr(runner, "zero_blocks", lambda ids: (zeroed.append(list(ids)), zero_blocks(ids)))
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected
    table = [b for step in zeroed for b in step]
    assert len(zeroed) == 1 and len(table) == 1  # the prefill's third block; the decodes stay inside it


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mincore"), reason="needs mincore(2) (Linux)")
def test_kv_cache_prefault_faults_in_the_first_blocks_only(model_dirs):
    """The blocks the pool hands out first are faulted in at start-up (kv_cache_prefault_tokens), in every layer's
    K and V slabs; the rest stay untouched until used, and generation is the same either way."""
    path = str(model_dirs["llama-gqa-tied"])
    llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", kv_cache_prefault_tokens=100, device="cpu")
    runner = llm.engine.executor.worker.runner
    assert runner.block_dim == 3 and runner.block_size == 16
    first = -(-100 // 16)  # 7 blocks
    layers = runner.kv_cache.shape[0]
    for layer in (0, layers - 1):
        for kv in (0, 1):
            slab = runner.kv_cache[layer, kv, -1]  # the last KV head's [blocks, block_size, head_dim]
            assert all(resident_pages(slab[:first]))
            assert not any(resident_pages(slab[first + 64:first + 128]))
    lazy = LLM(path, dtype="float32", kv_cache_memory="64MiB", kv_cache_prefault_tokens=0, device="cpu")
    assert not any(resident_pages(lazy.engine.executor.worker.runner.kv_cache[0, 0, 0, :first]))
    prompts = token_prompts(PROMPTS[:4])
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in lazy.generate(prompts, GREEDY, use_tqdm=False)])
    with pytest.raises(ValueError, match="kv_cache_prefault_tokens"):
        LLM(path, kv_cache_prefault_tokens=-1)


def test_blocks_all_free_after_finish_preempt_and_abort(model_dirs):
    path = model_dirs["llama-gqa-tied"]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=kv_memory_for_blocks(path, 10))
    engine = llm.engine
    sampled = SamplingParams(temperature=1.0, max_tokens=24, n=3, seed=1)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, sampled if i % 4 == 0 else GREEDY, request_id=f"r{i}")
    aborted = set()
    for step in range(40):
        engine.step()
        if step in (3, 9, 15, 22):  # abort a running one, a waiting one, a group mid-fork...
            victim = next(r for r in (f"r{i}" for i in (0, 11, 4, 5, 8)) if r in engine.requests and r not in aborted)
            final = engine.abort(victim)[0]
            assert final.finished and all(o.finish_reason in ("abort", "stop", "length") for o in final.outputs)
            aborted.add(victim)
    drain(engine)
    assert engine.scheduler.num_preemptions > 0
    engine.check_idle()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(token_prompts([PROMPTS[0]]), params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30 - i) for i in range(16)]
    batch = llm.generate(token_prompts(PROMPTS[1:] + PROMPTS[:5] + [PROMPTS[0]]), others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    again = llm.generate(token_prompts([PROMPTS[0]]), params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_logits_are_bit_for_bit_the_same_in_any_batch(model_dirs):
    """fp32, no prefix cache: a request's logprobs in a batch of 1 to 16 are the same floats (what lets a seeded
    request draw the same tokens anywhere; a prompt split otherwise: the next test)."""
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    prompt, seen = PROMPTS[0] + PROMPTS[1] + PROMPTS[2], set()  # several blocks: a prefix cache would hit
    for n in (1, 2, 7, 16):
        out = llm.generate(token_prompts([prompt] + (PROMPTS * 2)[3:n + 2]), params, use_tqdm=False)[0].outputs[0]
        seen.add((tuple(out.token_ids), out.cumulative_logprob,
                  tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in out.logprobs)))
    assert len(seen) == 1
    llm.engine.executor.shutdown()


def test_a_prompts_logits_are_bit_for_bit_the_same_however_it_was_split(model_dirs):
    """fp32: alone, after a prefix-cache hit (of all but a few tokens, of all but the last) and in chunks of 8, 16,
    32 or 33 tokens, the same floats. A short tail of a prompt once ran through the decode kernel, which sums in
    another order than the prefill kernel, and moved the logprobs by ~2e-6 (a seeded draw near a boundary then
    flipped, in a randomized engine run)."""
    path = str(model_dirs["llama-gqa-tied"])
    prompt = (PROMPTS * 3)[:6]
    prompt = [t for p in prompt for t in p][:100]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)

    def run(budget: int = 2048, cached: int | None = None, steps: int = 1):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=budget,
                  num_scheduler_steps=steps)
        if cached is not None:
            llm.generate(token_prompts([prompt[:cached]]), SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0]
        if cached is not None:
            assert llm.engine.scheduler.stats().prefix_hits > 0
        llm.engine.executor.shutdown()
        return out.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in out.logprobs]

    alone = run()
    for case in [dict(cached=96), dict(cached=100), dict(budget=8), dict(budget=16), dict(budget=32),
                 dict(budget=33, steps=4)]:  # (the last: a running prompt's last token, not in a multi-step batch)
        assert run(**case) == alone, case


def test_filters_leave_the_rows_that_ask_for_none_as_they_are():
    """top-k, top-p and min-p run on the rows that ask for them. Run over every row, a row with none lost the tail
    its fp32 running sum pushed past top_p = 1, and a seeded request sampled differently beside a filtered one
    (found by a randomized engine run: token 15 of a seeded request came out 316 in a batch, 317 alone)."""
    logits = torch.randn(4, 4096, generator=torch.Generator().manual_seed(0)) * 4
    rows = [RequestState(f"r{i}", [1], SamplingParams(temperature=0.9, seed=i, **options)) for i, options in
            enumerate([{}, {"top_k": 20}, {"min_p": 0.05}, {"top_p": 0.9}])]
    batch = scale(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(batch[i], scale(logits[i:i + 1], [row])[0])
    assert torch.equal(batch[0], logits[0] / 0.9)  # no filter: the row as it came
    assert int(torch.isfinite(batch[1]).sum()) == 20  # top-k alone (top_p 1) keeps all k


@pytest.mark.parametrize("kernels", [True, False])
def test_filters_keep_what_the_sorted_rows_keep(monkeypatch, kernels):
    """top-k, top-p and min-p keep the tokens the sorted rows keep (peaked and flat rows, -inf logits, top-k at the
    boundary, vocabularies small and large): on the CPU by aserve's kernel, which sorts nothing; without it from a
    row's top 64 logits, then its top 1024, sorting the whole row only where its kept tokens may go past those.
    Ties are ranked as each way ranks them, so none here."""
    from aserve.worker import sampler

    if not kernels:
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *tensors: False)
    sorted_rows = []
    real = sampler._filter_sorted
    monkeypatch.setattr(sampler, "_filter_sorted", lambda x, *args: sorted_rows.append(len(x)) or real(x, *args))
    gen = torch.Generator().manual_seed(0)
    options = [{"top_p": 0.9}, {"top_k": 20}, {"top_k": 80}, {"min_p": 0.05}, {"top_p": 0.5, "top_k": 50},
               {"top_p": 0.99, "min_p": 0.2}, {"top_k": 65}, {"top_k": 64}, {"top_p": 0.3}, {"top_k": 1}]
    for spread, vocab in [(0.5, 300), (2, 4096), (6, 4096), (15, 32000), (2, 100)]:
        logits = torch.randn(len(options), vocab, generator=gen) * spread
        logits[2, :40] = float("-inf")
        reqs = [RequestState(f"r{i}", [1], SamplingParams(temperature=0.8, **o)) for i, o in enumerate(options)]
        with torch.inference_mode():  # as the engine samples (the kernels take no autograd)
            ours = sampler._filter(logits, reqs)
        k = torch.tensor([[min(r.params.top_k, vocab) or vocab] for r in reqs])
        p = torch.tensor([[r.params.top_p] for r in reqs])
        m = torch.tensor([[r.params.min_p] for r in reqs])
        assert torch.equal(ours, real(logits, k, p, m)), (spread, vocab)
    if kernels and sampler.cpu_kernels.available():
        assert sorted_rows == []
    else:
        assert 0 < sum(sorted_rows) < 5 * len(options)  # some rows went past their top 64, most did not


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = PROMPTS[3] + PROMPTS[4]  # several full blocks
    engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), request_id="fork")
    samples = engine.requests["fork"]
    while not all(s.status == RequestStatus.RUNNING for s in samples):
        engine.step()
    full = (len(prompt) - 1) // engine.kv.block_size
    parent_blocks = samples[0].block_table[:full]
    for child in samples[1:]:
        assert child.block_table[:full] == parent_blocks
    assert all(engine.kv.pool.ref_count(b) == 3 for b in parent_blocks)
    outs = drain(engine)["fork"].outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds: different samples
    engine.check_idle()


def test_sampling_filters_that_reduce_to_greedy(llm):
    greedy = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS[:4]), GREEDY, use_tqdm=False)]
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=20),
                   SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=20),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=20)):
        got = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS[:4]), params, use_tqdm=False)]
        assert got == greedy, params


def test_repetition_penalty_matches_transformers(llm, model_dirs):
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5)
    ours = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS[:3]), params, use_tqdm=False)]
    model = load_reference(model_dirs["llama-gqa-tied"])
    for prompt, got in zip(PROMPTS[:3], ours):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
                             eos_token_id=0)
        assert got == ref[0, len(prompt):].tolist()


def test_logit_bias_matches_transformers(llm, model_dirs):
    """OpenAI's logit_bias as transformers' sequence_bias on single tokens: greedy outputs agree token for token;
    +100 on a token makes it the only one drawn, and an id outside the vocabulary is refused by name."""
    plain = SamplingParams(temperature=0, max_tokens=12)
    first = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS[:3]), plain, use_tqdm=False)]
    bias = {first[0][0]: -100.0, first[1][1]: -5.0, 17: 6.0, 1234: 3.5}
    ours = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS[:3]), plain.clone(logit_bias=bias),
                                                        use_tqdm=False)]
    assert ours != first
    model = load_reference(model_dirs["llama-gqa-tied"])
    for prompt, got in zip(PROMPTS[:3], ours):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             sequence_bias={(t,): b for t, b in bias.items()},
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
                             eos_token_id=0)
        assert got == ref[0, len(prompt):].tolist()
    forced = SamplingParams(temperature=1.0, max_tokens=8, logit_bias={42: 100.0}, seed=3)
    assert llm.generate(token_prompts(PROMPTS[:1]), forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 8
    with pytest.raises(InvalidRequestError, match="logit_bias token id 99999 is out of range"):
        llm.generate(token_prompts(PROMPTS[:1]), plain.clone(logit_bias={99999: 1.0}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="logit_bias must be a map of token ids to biases in"):
        SamplingParams(logit_bias={5: 101.0})


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float,
                        frequency: float, presence: float) -> torch.Tensor:
    """vLLM's penalties, one token at a time: a token seen in the prompt or the output has a positive logit
    divided by the repetition penalty (a negative one multiplied); then each token loses frequency * (times it
    occurs in the output) and, if it occurs in the output at all, the presence penalty."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_penalties_follow_the_reference_formula():
    """The sampler's batched penalties equal the formula on a fixed logits tensor: logits of both signs,
    tokens repeated in prompt and output, penalties above and below neutral, and an unpenalized row."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    cases = [([1, 2, 2, 7, 30], [7, 7, 3, 9, 9, 9], SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6,
                                                                   presence_penalty=0.4)),
             ([4, 63], [4, 4, 10, 0], SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5,
                                                     presence_penalty=1.1)),
             ([1, 2, 3], [5, 5], SamplingParams())]
    reqs = []
    for i, (prompt, output, params) in enumerate(cases):
        req = RequestState(f"r{i}", prompt, params)
        for token in output:
            req.append_token(token)
        reqs.append(req)
    penalized = logits.clone()
    apply_penalties(penalized, reqs, rows=[0, 1])
    for row, (prompt, output, params) in enumerate(cases[:2]):
        expected = reference_penalties(logits[row], prompt, output, params.repetition_penalty,
                                       params.frequency_penalty, params.presence_penalty)
        torch.testing.assert_close(penalized[row], expected, rtol=0, atol=1e-6)
        assert not torch.equal(penalized[row], logits[row])
    assert torch.equal(penalized[2], logits[2])  # a row not asked for is left alone


def dense_penalties(logits: torch.Tensor, reqs, rows: list[int]) -> None:
    """The penalties over the whole vocabulary (counts and masks [rows, vocab]), as the sampler once applied them."""
    vocab, sub = logits.shape[-1], [reqs[i] for i in rows]

    def pad(lists):
        width = max(len(r) for r in lists) or 1
        return torch.tensor([r + [vocab] * (width - len(r)) for r in lists])
    out_ids = pad([r.output_token_ids for r in sub])
    counts = torch.zeros(len(sub), vocab + 1).scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float))
    counts = counts[:, :vocab]
    seen = torch.zeros(len(sub), vocab + 1, dtype=torch.bool).scatter_(
        1, pad([r.prompt_token_ids for r in sub]), True)[:, :vocab] | (counts > 0)
    rep = torch.tensor([r.params.repetition_penalty for r in sub]).clamp_(max=torch.finfo(torch.float32).max)
    freq = torch.tensor([r.params.frequency_penalty for r in sub]).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in sub]).unsqueeze(1)
    x = logits[rows]
    x = torch.where(seen, torch.where(x > 0, x / rep.unsqueeze(1), x * rep.unsqueeze(1)), x)
    logits[rows] = (x - freq * counts - pres * (counts > 0)).to(logits.dtype)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_at_the_seen_tokens_equal_them_over_the_vocabulary(dtype, kernels, monkeypatch):
    """The sampler's penalties touch only the tokens a row has seen; they give the same bits as over the whole
    vocabulary, step after step as outputs grow (each request's tensors grow by its new tokens), after a beam takes
    another history (replace_output), and for rows checking proposals (ProposalRow): on the CPU by aserve's kernel,
    and by the torch path."""
    from aserve.worker import sampler
    from aserve.worker.request_state import ProposalRow

    calls = []
    if kernels:
        if not sampler.cpu_kernels.available():
            pytest.skip("aserve's CPU kernels are not built here")
        real = torch.ops.aserve.apply_penalties
        counted = SimpleNamespace(apply_penalties=lambda *args: calls.append(1) or real(*args))
        monkeypatch.setattr(torch.ops, "aserve", counted)
    else:
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *tensors: False)

    gen = torch.Generator().manual_seed(3)
    vocab = 50

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()
    reqs = [RequestState("a", ids(40), SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7)),
            RequestState("b", ids(5), SamplingParams(presence_penalty=-0.4, repetition_penalty=1e300)),
            RequestState("c", ids(9), SamplingParams()),
            RequestState("d", ids(17), SamplingParams(repetition_penalty=0.6, presence_penalty=1.5,
                                                       frequency_penalty=-1.0))]
    for step in range(6):
        if step == 3:
            reqs[3].replace_output(ids(4))  # another history of another length
        rows = [0, 1, 3] if step != 4 else [3, 0]
        batch = reqs + [ProposalRow(reqs[0], ids(3)), ProposalRow(reqs[3], [])]
        rows += [4, 5]
        logits = (torch.randn(len(batch), vocab, generator=gen) * 4).to(dtype)
        logits[0, 7] = float("-inf")
        ours, theirs = logits.clone(), logits.clone()
        with torch.inference_mode():  # as the engine samples (the kernels take no autograd)
            apply_penalties(ours, batch, rows)
        dense_penalties(theirs, batch, rows)
        assert torch.equal(ours, theirs), step
        assert torch.equal(ours[2], logits[2])
        for req in reqs:
            req.append_token(ids(1)[0])
    assert len(calls) == (6 if kernels else 0)


def test_soft_preferences_never_leave_a_row_nothing_to_sample():
    """min_tokens and penalties are undone for a row they would empty (every logit -inf or NaN), and only there:
    the other rows keep them."""
    from aserve.worker.sampler import sample

    logits = torch.full((2, 8), float("-inf"))
    logits[:, [5, 3]] = torch.tensor([-2.0, 0.0])  # a grammar allows eos (5) and token 3
    reqs = [RequestState("ends-now", [3], SamplingParams(temperature=0, min_tokens=5, repetition_penalty=1e300,
                                                         stop_token_ids=[3])),
            RequestState("keeps-going", [3], SamplingParams(temperature=0, min_tokens=5))]
    for r in reqs:
        r.params.eos_token_ids = [5]
    results = sample(logits.clone(), reqs)
    assert [r.error for r in results] == [None, None]
    assert results[0].token_id in (5, 3)  # both banned by min_tokens: the ban is lifted for this row
    assert results[1].token_id == 3  # eos banned, token 3 left: the ban holds


def test_penalized_greedy_decoding_matches_the_reference_model(llm, model_dirs):
    """End to end: at every step the engine's greedy token is the argmax of transformers' logits after the
    reference penalties (teacher-forced on the engine's own output), and the penalties changed some choices."""
    repetition, frequency, presence = 1.2, 1.0, 0.5
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=repetition,
                            frequency_penalty=frequency, presence_penalty=presence)
    outs = llm.generate(token_prompts(PROMPTS[:4]), params, use_tqdm=False)
    model = load_reference(model_dirs["llama-gqa-tied"])
    changed_choices = 0
    for prompt, out in zip(PROMPTS[:4], outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 20 or tokens[-1] == 0  # ran to max_tokens or stopped at eos
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        for step, token in enumerate(tokens):
            penalized = reference_penalties(logits[step], prompt, tokens[:step], repetition, frequency, presence)
            assert penalized[token] >= penalized.max() - 1e-4, (prompt, step)  # the argmax, up to float noise
            changed_choices += int(penalized.argmax() != logits[step].argmax())
    assert changed_choices > 0


def test_stop_strings_spanning_tokens(llm):
    prompt = PROMPTS[2]
    full = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    # a stop string that starts inside token 3's text and ends inside token 5's
    boundary = len(pieces[4])
    stop = full.text[boundary - 2:boundary + 2] if len(full.text) > boundary + 2 else full.text[-3:]
    assert stop and stop in full.text
    out = llm.generate(token_prompts([prompt]), GREEDY.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate(token_prompts([prompt]), GREEDY.clone(stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_min_tokens_and_lengths(llm):
    prompt = PROMPTS[5]
    full = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    first = full.token_ids[0]
    out = llm.generate(token_prompts([prompt]), GREEDY.clone(stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    later = llm.generate(token_prompts([prompt]), GREEDY.clone(stop_token_ids=[first], min_tokens=3),
                         use_tqdm=False)[0].outputs[0]
    # banned for three tokens, then the first occurrence of the stop token ends the request
    assert first not in later.token_ids[:-1] and len(later.token_ids) > 3
    if later.finish_reason == "stop":
        assert later.token_ids[-1] == first and later.stop_reason == first
    else:
        assert later.finish_reason == "length" and len(later.token_ids) == 20


def test_generation_config_eos_ids_stop(model_dirs, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dirs["llama-gqa-tied"], path)
    probe = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    first = probe.generate(token_prompts([PROMPTS[6]]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, first]}))
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    out = llm.generate(token_prompts([PROMPTS[6]]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    ignored = llm.generate(token_prompts([PROMPTS[6]]), GREEDY.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 20


def test_text_prompts_and_input_order(llm):
    prompts = ["def add(a, b):", "import sys", {"prompt": "class A:"}, [5, 6, 7]]
    outs = llm.generate(prompts, [GREEDY.clone(max_tokens=m) for m in (3, 9, 5, 7)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5, 7]
    assert outs[0].prompt == "def add(a, b):" and outs[0].prompt_token_ids == llm.get_tokenizer().encode(prompts[0])
    assert outs[3].prompt is None and outs[3].prompt_token_ids == [5, 6, 7]
    text = outs[1].outputs[0].text
    assert text == llm.get_tokenizer().decode(outs[1].outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("bad, message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 2, 99999]}, "99999"),
    ({"prompt_token_ids": [1] * 600}, "max_model_len"),
])
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, bad, message):
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="good-before")
    engine.step()
    with pytest.raises(ValueError, match=message):
        llm.generate([bad], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        engine.add_request(bad["prompt_token_ids"], GREEDY)
    outs = drain(engine)
    expected = llm.generate(token_prompts([PROMPTS[0]]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outs["good-before"].outputs[0].token_ids == expected
    engine.check_idle()


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, ">= 1"), ("temperature", -1, ">= 0"), ("top_p", 0, r"\(0, 1\]"), ("top_k", -5, "disabled"),
    ("min_p", 1.5, r"\[0, 1\]"), ("max_tokens", 0, ">= 1"), ("presence_penalty", 3, r"\[-2, 2\]"),
    ("repetition_penalty", 0, "> 0"), ("logprobs", 50, r"\[0, 20\]"),
])
def test_invalid_sampling_params_name_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must be .*{allowed}"):
        SamplingParams(**{field: value})


def test_requests_that_can_never_fit(model_dirs):
    path = model_dirs["qwen2"]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=kv_memory_for_blocks(path, 4))
    with pytest.raises(ValueError, match="whole cache has 4"):
        llm.generate(token_prompts([PROMPTS[0]]), SamplingParams(max_tokens=80), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate(token_prompts([PROMPTS[0]]), SamplingParams(max_tokens=510), use_tqdm=False)
    fits = llm.generate(token_prompts([PROMPTS[0][:10]]), SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(fits.token_ids) == 5 and fits.finish_reason == "length"
    llm.engine.check_idle()
