"""Multi-step decoding (num_scheduler_steps): a batch of decoding requests runs several steps per scheduling, and its
outputs are those of one step at a time: token for token when greedy (fp32, and transformers'), under every
sampling option, with seeds, stop strings and tokens, preemption, a row's failed logits and max_model_len; it
steps aside for a waiting request; the cache gives back every block."""
from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from aserve import LLM, AsyncLLM, SamplingParams
from aserve.config import EngineConfig, add_engine_arguments, engine_options
from aserve.errors import ConfigError
from aserve.ops import cpu_kernels
from conftest import load_reference, poison_sampler, random_prompts, reference_greedy
from test_lora import adapters, lora_llm, request_of  # noqa: F401 - adapters is a fixture
from test_spec_decode import greedy, options_hold, tight_cache_rounds

STEPS = 4


@pytest.fixture(scope="module")
def pair(model_dirs):
    """The same model twice: one step at a time, and STEPS a scheduling."""
    path = str(model_dirs["llama-gqa-tied"])
    plain = LLM(path, dtype="float32", kv_cache_memory=1 << 24)
    multi = LLM(path, dtype="float32", kv_cache_memory=1 << 24, num_scheduler_steps=STEPS)
    yield plain, multi
    for llm in (plain, multi):
        llm.engine.executor.shutdown()


def count_steps(llm, monkeypatch) -> list[int]:
    """The steps of each batch the engine's worker runs from now on (1 for a batch run one step at a time)."""
    seen = []
    runner = llm.engine.runner
    real = runner.execute

    def execute(sched, *rest):
        if sched.num_scheduled_tokens:
            seen.append(sched.num_steps)
        return real(sched, *rest)

    monkeypatch.setattr(runner, "execute", execute)
    return seen


SAMPLINGS = {  # each request's options: greedy; drawn at temperature 1; over temperatures; with seeds; both kinds
    "greedy": [dict(temperature=0)] * 4,
    "draw": [dict(temperature=1.0)] * 4,
    "temperatures": [dict(temperature=0.7), dict(temperature=1.3), dict(temperature=1.0), dict(temperature=0.001)],
    "seeds": [dict(temperature=1.0, seed=5), dict(temperature=0.8), dict(temperature=1.0, seed=6), dict()],
    "mixed": [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=0.6), dict(temperature=0)],
}


def sampled(llm, prompts, sampling: str, max_tokens: int):
    """Each prompt's completion with its row of SAMPLINGS[sampling] (cycled), torch's generator seeded first."""
    options = SAMPLINGS[sampling]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options[i % len(options)])
              for i in range(len(prompts))]
    torch.manual_seed(1234)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def one_call_steps(llm, monkeypatch) -> list[int | None]:
    """From now on, each call of the model's decode_steps (the C++ stack's steps in one call): the steps it ran
    whole, None where it could not run them."""
    ran = []
    model = llm.engine.runner.model
    real = model.decode_steps

    def counted(*args):
        tokens = real(*args)
        ran.append(None if tokens is None else int((tokens >= 0).all(dim=1).sum()))
        return tokens

    monkeypatch.setattr(model, "decode_steps", counted)
    return ran


def test_greedy_equals_one_step_at_a_time_and_transformers(pair, model_dirs, monkeypatch):
    """Prompts of different lengths asking for different numbers of tokens: a batch never runs past the fewest
    tokens any of its requests still may make, so each ends at exactly its max_tokens. The steps run in one call
    of the C++ stack where the kernels are built."""
    plain, multi = pair
    prompts = random_prompts(6, lengths=(3, 40), seed=21)
    lengths = [9, 40, 23, 40, 31, 17]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    steps = count_steps(multi, monkeypatch)
    one_call = one_call_steps(multi, monkeypatch)
    got = [o.outputs[0].token_ids for o in multi.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [len(tokens) for tokens in got] == lengths
    reference = reference_greedy(load_reference(model_dirs["llama-gqa-tied"]), prompts, 40)
    assert got == [want[:n] for want, n in zip(reference, lengths)]
    if cpu_kernels.available():
        assert all(ran is not None and ran >= 1 for ran in one_call) and max(one_call) == STEPS
    assert max(steps) == STEPS and steps.count(STEPS) >= 5, steps
    assert len(steps) <= 40 // 2, "most of the decoding should have run several steps at once"
    multi.engine.check_idle()


def test_logprobs_penalties_min_tokens_logit_bias_and_stop_strings_hold(pair):
    """Each step samples with the history the steps before it made: penalties, min_tokens, logit_bias and logprobs
    come out as one step at a time; a stop token or string inside a batch's steps drops the tokens after it."""
    options_hold(*pair)


def test_seeded_sampling_equals_one_step_at_a_time(pair):
    """A seeded request draws from its own generator, step after step, however the steps are grouped."""
    plain, multi = pair
    prompts = random_prompts(5, lengths=(4, 30), seed=23)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=30, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in multi.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [e[t].logprob for e, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(w.logprobs, w.token_ids)], abs=1e-5)
    multi.engine.check_idle()


def test_a_waiting_request_runs_in_the_next_step(pair, monkeypatch):
    """Steps are grouped only while nothing waits: a request added while others decode is admitted by the next
    batch, which then runs one step, as its prompt has to be computed."""
    _, multi = pair
    engine = multi.engine
    steps = count_steps(multi, monkeypatch)
    first, second = random_prompts(2, lengths=(5, 20), seed=25)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request(first, params, request_id="first")
    engine.step()  # its prompt
    engine.step()  # decoding, several steps
    assert steps == [1, STEPS]
    engine.add_request(second, params, request_id="second")
    outputs = {o.request_id: o for o in engine.step()}
    assert steps[-1] == 1 and len(outputs["second"].outputs[0].token_ids) == 1
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    want = greedy(pair[0], [first, second], max_tokens=30)
    assert [outputs[rid].outputs[0].token_ids for rid in ("first", "second")] == [o.token_ids for o in want]
    engine.check_idle()


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_preemption_and_prefix_hits_change_nothing(pair, model_dirs, policy):
    """A cache of 24 blocks for 12 prompts, each batch allocating its steps' slots ahead: requests are preempted
    (recomputed or swapped) while they decode several steps at a time; with recompute, the second round finds its
    prompts in the prefix cache. No block is left behind."""
    with tight_cache_rounds(pair[0], model_dirs["llama-gqa-tied"], policy, num_scheduler_steps=STEPS) as (_, stats):
        if policy == "fcfs":  # (swapped-out requests keep their blocks: with swaps these prompts find none cached)
            assert stats.prefix_hits > 0


@pytest.mark.parametrize("after_tokens", [1, 6])
def test_failed_logits_fail_only_their_request_after_its_good_tokens(pair, monkeypatch, after_tokens):
    """A row whose logits turn NaN partway through a batch's steps: the others keep their tokens, and that request
    ends with the error and the tokens it had before it, as it would one step at a time."""
    plain, multi = pair
    prompts = random_prompts(4, lengths=(5, 30), seed=29)
    clean = greedy(plain, prompts, max_tokens=20)
    poison_sampler(monkeypatch, prompts[2][0], after_tokens)
    outs = greedy(multi, prompts, max_tokens=20)
    failed = outs[2]
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert failed.token_ids == clean[2].token_ids[:after_tokens]
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [o.token_ids for i, o in enumerate(clean) if i != 2]
    multi.engine.check_idle()


@pytest.mark.parametrize("sampling", ["greedy", "seeds", "mixed"])
def test_a_fault_inside_the_one_call_steps_fails_its_request_as_the_sampler_does(model_dirs, monkeypatch, sampling):
    """A token whose embedding is NaN: the request that feeds it back gets NaN logits at that step. The C++ stack's
    steps end there, the step runs again through the sampler, and that request fails with the tokens it had while
    the others keep theirs: as through the sampler every step, with one step a scheduling and with several. Drawn
    rows draw after the fault what they would have (the draws made for the steps that did not run are taken
    back)."""
    path = str(model_dirs["llama-untied"])  # (its own head: a NaN embedding row is no logit of every row)
    # the sampler's way and the one call, with one step a scheduling and with several (where a fault after a
    # batch's first step draws that step twice: the first time ends the batch, the second fails the request)
    engines = [LLM(path, dtype="float32", kv_cache_memory=1 << 24, num_scheduler_steps=s) for s in (1, 1, STEPS, STEPS)]
    for llm in engines[::2]:
        monkeypatch.setattr(llm.engine.runner, "_one_call", lambda reqs: False)
    try:
        prompts = random_prompts(4, lengths=(5, 30), seed=29)
        clean = sampled(engines[0], prompts, sampling, max_tokens=20)
        others = {t for i, (p, o) in enumerate(zip(prompts, clean)) if i != 2 for t in p + o.token_ids}
        made = clean[2].token_ids
        at = next(i for i in range(5, len(made)) if made[i] not in others | set(prompts[2]) | set(made[:i]))
        with torch.no_grad():
            for llm in engines:
                llm.engine.runner.model.embed_tokens.weight[made[at]] = float("nan")
        one_call = [one_call_steps(llm, monkeypatch) for llm in engines[1::2]]
        got = [[(o.token_ids, o.finish_reason, o.error) for o in sampled(llm, prompts, sampling, max_tokens=20)]
               for llm in engines]
        for outs in got:
            tokens, reason, error = outs[2]
            assert reason == "error" and "NaN" in error and tokens == made[:at + 1]
        if sampling == "greedy":  # (drawn, the others' draws after the fault are not those of a run without it)
            assert all([o[0] for i, o in enumerate(outs) if i != 2] == [o.token_ids for i, o in enumerate(clean)
                                                                         if i != 2] for outs in got)
        assert got[1] == got[0] and got[3] == got[2]
        if cpu_kernels.available():
            assert max(one_call[0]) == 1 and 0 in one_call[0]  # a step of one: the faulty one ran no step whole
            assert max(one_call[1]) > 1 and any(ran < STEPS for ran in one_call[1])
        for llm in engines:
            llm.engine.check_idle()
    finally:
        for llm in engines:
            llm.engine.executor.shutdown()


@pytest.mark.parametrize("steps", [1, STEPS])
@pytest.mark.parametrize("weights, sampling", [
    *((weights, "greedy") for weights in ("float32", "float32-untied", "onednn", "bfloat16", "int8", "gptq")),
    *((weights, sampling) for weights in ("float32", "gptq") for sampling in SAMPLINGS if sampling != "greedy"),
])
def test_one_call_steps_give_the_tokens_of_step_by_step(model_dirs, monkeypatch, pick_gemm, tmp_path, weights, steps,
                                                        sampling):
    """The C++ stack's decode steps (embedding, layers, last norm, head and tokens in one call) against the same
    steps one at a time through the model and the sampler, in one engine each: a tied head's packed copy and an
    untied head, oneDNN's packed weights (no team of threads), bf16, an int8 head and a GPTQ int4 one; with
    several steps a scheduling, and with one (every decode step of such rows takes the call); greedy, drawn (over
    temperatures, with seeds and torch's generator), and both in one batch."""
    from aserve.bench.quantize_rtn import write_rtn_checkpoint
    from aserve.ops import cpu_gemm

    if not cpu_kernels.available():
        pytest.skip("the C++ kernels are not built here")
    path, options = model_dirs["llama-untied" if weights == "float32-untied" else "llama-gqa-tied"], {}
    dtype = "bfloat16" if torch.ops.aserve.gemm_packs_bf16() else "float32"  # where the quantized kernels take bf16
    if weights == "int8":
        options = dict(quantization="int8", quantize_lm_head=True)
    elif weights == "gptq":
        write_rtn_checkpoint(path, tmp_path / "gptq", "gptq", lm_head=True)
        path = tmp_path / "gptq"
    elif weights == "bfloat16" and not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("no bf16 GEMM here (AVX512-BF16)")
    elif weights != "bfloat16":
        dtype = "float32"
    if weights == "onednn":
        pick_gemm("onednn")
    prompts = random_prompts(5, lengths=(3, 30), seed=39)
    outputs = []
    for one_call in (True, False):
        llm = LLM(str(path), dtype=dtype, kv_cache_memory=1 << 24, num_scheduler_steps=steps, **options)
        try:
            if not one_call:
                monkeypatch.setattr(llm.engine.runner, "_decode_steps", lambda *args: [])
            ran = one_call_steps(llm, monkeypatch)
            outputs.append([o.token_ids for o in sampled(llm, prompts, sampling, max_tokens=17)])
            assert (max(ran, default=None) == steps) == one_call
            model = llm.engine.runner.model
            head = model.packed_head if model.packed_head is not None else model.lm_head
            if weights in ("int8", "gptq"):
                assert head.method.name.startswith(weights)
            if weights == "onednn":
                assert not head.packed.aserve
            llm.engine.check_idle()
        finally:
            llm.engine.executor.shutdown()
    assert outputs[0] == outputs[1]


def test_wide_batches_keep_the_step_by_step_path(model_dirs, monkeypatch):
    """Past ONE_CALL_MAX_ROWS rows a step runs the usual way (where the call measured no faster): 40 requests
    decode step by step until fewer than that are left, and then in one call."""
    from aserve.worker.model_runner import ONE_CALL_MAX_ROWS

    if not cpu_kernels.available():
        pytest.skip("the C++ kernels are not built here")
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory=1 << 24, num_scheduler_steps=STEPS)
    try:
        rows = []
        model = llm.engine.runner.model
        real = model.decode_steps

        def counted(token_ids, *args):
            rows.append(len(token_ids))
            return real(token_ids, *args)
        monkeypatch.setattr(model, "decode_steps", counted)
        lengths = [4 + (i % 3) * 8 for i in range(ONE_CALL_MAX_ROWS + 8)]  # some end early
        outs = llm.generate(random_prompts(len(lengths), lengths=(3, 20), seed=41),
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                            use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
        assert rows and max(rows) <= ONE_CALL_MAX_ROWS
        llm.engine.check_idle()
    finally:
        llm.engine.executor.shutdown()


def test_lora_adapters_apply_in_every_step(model_dirs, adapters, monkeypatch):
    """Base and adapter requests in one batch: each step maps each row to its adapter, as one step at a time."""
    prompts = random_prompts(4, lengths=(5, 30), seed=35)
    loras = [request_of(adapters, name) for name in (None, "attn", "all", "attn")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = []
    for steps in (1, STEPS):
        llm = lora_llm(model_dirs, num_scheduler_steps=steps)
        try:
            counted = count_steps(llm, monkeypatch)
            outputs.append([o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)])
            assert max(counted) == steps
            llm.engine.check_idle()
        finally:
            llm.engine.executor.shutdown()
    assert outputs[0] == outputs[1]


def test_async_llm_streams_what_one_step_at_a_time_gives(pair, model_dirs):
    """Through AsyncLLM's core process: each request's streamed deltas add up to the text and tokens of one step at
    a time, several tokens to a delta."""
    plain, _ = pair
    prompts = random_prompts(3, lengths=(4, 30), seed=37)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]

    async def main():
        async with AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB",
                            num_scheduler_steps=STEPS) as engine:
            async def stream(prompt):
                text, tokens, sizes = "", [], []
                async for out in engine.generate({"prompt_token_ids": prompt}, params):
                    text += out.outputs[0].text
                    tokens += out.outputs[0].token_ids
                    sizes.append(len(out.outputs[0].token_ids))
                return text, tokens, sizes
            return await asyncio.gather(*[stream(p) for p in prompts])

    got = asyncio.run(main())
    assert [(text, tokens) for text, tokens, _ in got] == [(w.text, w.token_ids) for w in want]
    assert max(max(sizes) for _, _, sizes in got) > 1


def test_steps_stop_at_max_model_len(model_dirs):
    path = str(model_dirs["llama-gqa-tied"])
    capped = LLM(path, dtype="float32", kv_cache_memory=1 << 24, max_model_len=48, num_scheduler_steps=8)
    plain = LLM(path, dtype="float32", kv_cache_memory=1 << 24, max_model_len=48)
    try:
        prompts = random_prompts(3, lengths=(10, 30), seed=31)
        got, want = greedy(capped, prompts, max_tokens=None), greedy(plain, prompts, max_tokens=None)
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
        assert all(len(p) + len(o.token_ids) == 48 and o.finish_reason == "length" for p, o in zip(prompts, got))
        capped.engine.check_idle()
    finally:
        for llm in (capped, plain):
            llm.engine.executor.shutdown()


def test_metrics_count_every_token(pair):
    _, multi = pair

    def generated() -> float:
        return sum(v for name, _, v in multi.get_metrics() if name == "aserve:generation_tokens_total")

    before = generated()
    outs = greedy(multi, random_prompts(3, lengths=(5, 20), seed=33), max_tokens=25)
    assert generated() - before == sum(len(o.token_ids) for o in outs) == 75


@pytest.mark.parametrize("options, says", [
    (dict(num_scheduler_steps=0), "num_scheduler_steps must be >= 1"),
    (dict(num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "choose one"),
    (dict(num_scheduler_steps=4, tensor_parallel_size=2), "single worker"),
    (dict(num_scheduler_steps=4, pipeline_parallel_size=2), "single worker"),
])
def test_conflicting_options_are_refused(options, says):
    with pytest.raises((ConfigError, ValueError), match=says):
        EngineConfig.from_kwargs(**options)


def test_the_flag_reaches_the_scheduler(pair):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = EngineConfig.from_kwargs(**engine_options(parser.parse_args(["--num-scheduler-steps", "8"])))
    assert config.num_scheduler_steps == 8
    plain, multi = pair
    assert (plain.engine.scheduler.num_scheduler_steps, multi.engine.scheduler.num_scheduler_steps) == (1, STEPS)
