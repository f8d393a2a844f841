"""Fault isolation and overload protection in the engine: one request's failure (NaN logits, a detokenizer
error) ends that request with an error, the others finish unchanged, and every block comes back."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from aserve import AsyncLLM, LLM, SamplingParams
from aserve.engine.async_llm import RequestFailedError, RequestTimeoutError
from aserve.engine.engine_core import EngineCore
from aserve.errors import EngineOverloadedError
from aserve.engine.output_processor import SequenceText
from aserve.config import EngineConfig
from conftest import POISON, engine_idle, is_idle, kv_memory_for_blocks, poison_sampler, random_prompts

PROMPTS = random_prompts(6, lengths=(5, 30), seed=11)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB")


def run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_idle()
    return outs


@pytest.mark.parametrize("after_tokens", [0, 5])
def test_nan_logits_fail_only_their_request(llm, monkeypatch, after_tokens):
    clean = run(llm, PROMPTS)
    poison_sampler(monkeypatch, POISON, after_tokens)
    bad = [POISON] + PROMPTS[0][1:]
    outs = run(llm, PROMPTS[:3] + [bad] + PROMPTS[3:])
    failed = outs[3].outputs[0]
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert len(failed.token_ids) == after_tokens  # what it had before the fault is kept
    others = outs[:3] + outs[4:]
    assert [o.outputs[0].token_ids for o in others] == [o.outputs[0].token_ids for o in clean]
    assert all(o.outputs[0].finish_reason != "error" for o in others)


def test_nan_before_an_n_sample_fork_fails_every_sample(llm, monkeypatch):
    poison_sampler(monkeypatch, POISON, value=float("inf"))
    outs = llm.generate([{"prompt_token_ids": [POISON, 5, 6, 7]}, {"prompt_token_ids": PROMPTS[1]}],
                        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6), use_tqdm=False)
    assert [o.finish_reason for o in outs[0].outputs] == ["error"] * 3
    assert all(o.finish_reason == "length" for o in outs[1].outputs)
    llm.engine.check_idle()


def test_a_detokenizer_error_fails_only_its_request(llm, monkeypatch):
    clean = run(llm, PROMPTS)
    real_append = SequenceText.append

    def failing(self, token_id, tokenizer):
        if self.req.prompt_token_ids[0] == POISON and self.num_tokens == 2:  # its third token's text
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_append(self, token_id, tokenizer)

    monkeypatch.setattr(SequenceText, "append", failing)
    outs = run(llm, [[POISON] + PROMPTS[2][1:]] + PROMPTS)
    assert outs[0].outputs[0].finish_reason == "error" and "detokenize" in outs[0].outputs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in clean]


def test_huge_top_k_and_limits(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(top_k=10 ** 9, seed=3, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="n must be at most 32"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(n=33), use_tqdm=False)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2 ** 70)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    llm.engine.check_idle()


def test_a_full_waiting_queue_refuses_new_requests(model_dirs):
    core = EngineCore(EngineConfig(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB",
                                   max_waiting_requests=2))
    for p in PROMPTS[:2]:
        core.add_request(p, GREEDY)
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
        core.add_request(PROMPTS[2], GREEDY)
    core.step()  # both admitted: the queue has room again
    core.add_request(PROMPTS[2], GREEDY)
    while core.has_unfinished():
        core.step()
    core.check_idle()


def test_async_timeouts_and_failures_reach_only_their_caller(model_dirs, monkeypatch):
    async def main():
        async with AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB") as engine:
            real_encode = engine.tokenizer.encode

            def encode(text, *args, **kwargs):
                if text == "poison":
                    raise RuntimeError("injected tokenizer failure")
                return real_encode(text, *args, **kwargs)

            engine.tokenizer.encode = encode
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            core = engine.replicas.proc.pid
            os.kill(core, signal.SIGSTOP)  # the timed request cannot be served in time, however fast the CPU
            try:
                calls = [asyncio.ensure_future(engine.infer("poison", GREEDY)),
                         asyncio.ensure_future(engine.infer({"prompt_token_ids": PROMPTS[0]}, long, timeout=0.05)),
                         asyncio.ensure_future(engine.infer({"prompt_token_ids": PROMPTS[1]}, GREEDY))]
                await asyncio.wait(calls[:2])  # neither the tokenizer's failure nor the timeout needs the core
            finally:
                os.kill(core, signal.SIGCONT)
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(results[0], RuntimeError) and "injected" in str(results[0])
            assert isinstance(results[1], RequestTimeoutError)
            assert results[2].outputs[0].finish_reason == "length"
            state = await engine_idle(engine)  # the timed-out request is freed once its abort reaches the core
            assert state["server_rss_bytes"] > 0 and state["core_rss_bytes"] > 0
    asyncio.run(main())


def test_a_model_fault_in_one_request_never_reaches_the_others(nan_model):
    """Poisoned requests write NaN K/V into their blocks. Padding reads the null block, and freed blocks are
    zeroed when handed out again, so neither the requests beside them nor later ones see the NaN."""
    clean = random_prompts(6, lengths=(20, 40), seed=5)
    poisoned = [[POISON] + p[1:] for p in random_prompts(3, lengths=(20, 40), seed=6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        # 20 blocks: the clean requests reuse blocks the poisoned ones held
        async with AsyncLLM(str(nan_model), dtype="float32", enable_prefix_caching=False,
                            kv_cache_memory=kv_memory_for_blocks(nan_model, 20)) as engine:
            alone = [(await engine.infer({"prompt_token_ids": p}, params)).outputs[0].token_ids for p in clean]
            mixed = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, params) for p in poisoned + clean],
                                         return_exceptions=True)
            assert all(isinstance(r, RequestFailedError) and "NaN" in str(r) for r in mixed[:3])
            assert [r.outputs[0].token_ids for r in mixed[3:]] == alone
            again = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, params) for p in clean])
            assert [r.outputs[0].token_ids for r in again] == alone
            assert is_idle(await engine.state())  # finished requests are freed before the core answers
    asyncio.run(main())
