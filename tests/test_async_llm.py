"""AsyncLLM: infer and streaming, aborts, consumers that leave, slow consumers, and a dying core."""
from __future__ import annotations

import asyncio
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aserve import AsyncLLM, EngineDeadError, SamplingParams
from aserve.errors import (EngineError, EngineOverloadedError, InvalidRequestError, PolicyLoadError,
                                  RemoteEngineError, RemoteError)
from conftest import random_prompts, until

PROMPTS = random_prompts(6, lengths=(4, 30), seed=21)
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture
def engine_factory(model_dirs):
    def make(**options):
        return AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB", **options)
    return make


async def idle_state(engine):
    """The core holds nothing and every block is free (a collector may still hold an unread final output)."""
    return await until(engine.state, lambda s: s["num_live_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"],
                       "the core to hold no request")


def test_streamed_deltas_add_up_to_the_final_output(engine_factory):
    async def main():
        async with engine_factory() as engine:
            final = await engine.infer({"prompt_token_ids": PROMPTS[0]}, GREEDY)
            text, tokens = "", []
            async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY):
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
            assert (text, tokens) == (final.outputs[0].text, final.outputs[0].token_ids)
            assert final.finished and final.outputs[0].finish_reason == "length"
            many = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, GREEDY) for p in PROMPTS])
            assert many[0].outputs[0].token_ids == final.outputs[0].token_ids
            await idle_state(engine)
    asyncio.run(main())


def test_every_output_carries_its_prompt_which_the_core_does_not_send(engine_factory):
    """The core process leaves the prompt out of its outputs (they cross to the front end every step); the front
    end puts back the one each request was sent with, for token-id and text prompts, each output kind and n > 1."""
    async def main():
        async with engine_factory() as engine:
            seen = []
            async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY):
                seen.append(out)
            async for out in engine.generate("a prompt in words", SamplingParams(temperature=0, max_tokens=4, n=2),
                                             output_kind="cumulative"):
                seen.append(out)
            final = await engine.infer({"prompt_token_ids": PROMPTS[2]}, GREEDY)
            text_ids = seen[-1].prompt_token_ids
            assert len(seen) > 2 and final.prompt_token_ids == PROMPTS[2] and final.prompt is None
            assert [(o.prompt, o.prompt_token_ids) for o in seen] == [
                (None, PROMPTS[1]) if o.request_id == seen[0].request_id else ("a prompt in words", text_ids)
                for o in seen]
            assert text_ids and text_ids == engine.tokenizer.encode("a prompt in words")
    asyncio.run(main())


def test_the_core_leaves_prompts_out_of_the_outputs_it_sends():
    from aserve.engine.output_processor import OutputProcessor
    from aserve.request import Request

    class Tokenizer:
        def decode(self, ids, **kwargs):
            return "".join(chr(97 + i % 26) for i in ids)

    for carries in (True, False):
        outputs = OutputProcessor(Tokenizer())
        outputs.carries_prompts = carries
        outputs.add_group("r", "the prompt", [5, 6, 7], [Request("r", [5, 6, 7], SamplingParams())], "cumulative")
        out = outputs.make_output("r")
        assert (out.prompt, out.prompt_token_ids) == (("the prompt", [5, 6, 7]) if carries else (None, None))


def test_slow_consumer_gets_one_merged_output(engine_factory):
    async def main():
        async with engine_factory() as engine:
            stream = engine.generate("slow consumer", SamplingParams(temperature=0, max_tokens=40))
            first = await anext(stream)
            await idle_state(engine)  # the request finishes meanwhile; its deltas merge in one slot
            rest = await anext(stream)
            assert rest.finished and len(first.outputs[0].token_ids) + len(rest.outputs[0].token_ids) == 40
            await stream.aclose()
    asyncio.run(main())


def test_abort_and_cancelled_consumers_free_their_blocks(engine_factory):
    async def main():
        async with engine_factory() as engine:
            long = SamplingParams(max_tokens=400, ignore_eos=True)

            async def consume(request_id):
                async for _ in engine.generate("abort me", long, request_id=request_id):
                    pass

            task = asyncio.create_task(consume("will-cancel"))
            aborted = engine.generate("abort me too", long, request_id="will-abort")
            await anext(aborted)
            await until(engine.state, lambda s: s["num_running"] == 2, "both requests to be running")
            task.cancel()
            await engine.abort("will-abort")
            last = await anext(aborted)
            assert last.finished and last.outputs[0].finish_reason == "abort"
            await aborted.aclose()
            with pytest.raises(asyncio.CancelledError):
                await task
            await idle_state(engine)
            assert (await engine.infer("still serving", GREEDY)).finished
    asyncio.run(main())


def test_bad_requests_raise_and_the_engine_keeps_serving(engine_factory):
    async def main():
        async with engine_factory() as engine:
            for prompt, params, match, param in (
                    ({"prompt_token_ids": []}, GREEDY, "empty", "prompt"),
                    ({"prompt_token_ids": [1] * 600}, GREEDY, "max_model_len", "prompt"),
                    ({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=510), "max_tokens", "max_tokens"),
                    ({"prompt_token_ids": [1] * 10}, SamplingParams(n=33), "at most 32", "n"),
                    (3.5, GREEDY, "a prompt must be", "prompt")):
                with pytest.raises(InvalidRequestError, match=match) as caught:
                    await engine.infer(prompt, params)
                assert caught.value.param == param
            assert (await engine.infer("fine", GREEDY)).outputs[0].token_ids
            assert (await engine.state())["num_collectors"] == 0
    asyncio.run(main())


def test_every_prompt_form_means_the_same_prompt():
    from aserve.inputs import Prompt, parse_prompt, parse_prompts, tokenize

    assert parse_prompts("hi") == parse_prompts({"prompt": "hi"}) == [Prompt("hi")]
    assert parse_prompts([5, 6]) == parse_prompts({"prompt_token_ids": [5, 6]}) == [Prompt(None, [5, 6])]
    assert parse_prompts(["a", [1], {"prompt": "b", "prompt_token_ids": [2]}]) == [
        Prompt("a"), Prompt(None, [1]), Prompt("b", [2])]
    assert parse_prompts([]) == [] and parse_prompts([[]]) == [Prompt(None, [])]
    assert tokenize(parse_prompts(["ab", [7]]), lambda text: [ord(c) for c in text]) == [
        Prompt("ab", [97, 98]), Prompt(None, [7])]
    for bad in (3.5, {"prompt_token_ids": ["x"]}, {"text": "hi"}, [True, None]):
        with pytest.raises(InvalidRequestError, match="a prompt must be") as caught:
            parse_prompt(bad) if not isinstance(bad, list) else parse_prompts(bad)
        assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(top_p=0)
    assert caught.value.param == "top_p"


def test_one_status_table_answers_every_error():
    import msgspec

    from aserve.errors import EngineDeadError, RequestFailedError, RequestTimeoutError
    from aserve.server.errors import from_exception, stream_error

    def answer(exc):
        response = from_exception(exc)
        return response.status_code, msgspec.json.decode(response.body)["error"], response.headers

    for exc, status, param, code in (
            (InvalidRequestError("top_p must be in (0, 1]", "top_p"), 400, "top_p", None),
            (ValueError("a plain one"), 400, None, None),
            (EngineDeadError("gone"), 503, None, None),
            (RequestTimeoutError("too slow"), 504, None, "timeout"),
            (RequestFailedError("NaN"), 500, None, "generation_failed"),
            (RemoteEngineError("the engine core raised OSError: disk"), 500, None, None),
            (RuntimeError("a bug"), 500, None, "internal_error")):
        got_status, error, _ = answer(exc)
        assert (got_status, error["param"], error["code"]) == (status, param, code), exc
        assert stream_error(exc).error.code == status
    status, error, headers = answer(EngineOverloadedError("12 requests are already waiting"))
    assert status == 503 and error["code"] == "overloaded" and headers["retry-after"] == "1"
    assert "12 requests" in error["message"]


def test_a_dying_core_fails_every_caller(engine_factory):
    async def main():
        engine = engine_factory()
        streams = [engine.generate(f"doomed {i}", SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(4)]
        for stream in streams:
            await anext(stream)
        engine.replicas.proc.kill()  # the engine process dies (an OOM kill, a segfault in a kernel...)

        async def drain(stream):
            async for _ in stream:
                pass
        results = await asyncio.wait_for(asyncio.gather(*map(drain, streams), return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.infer("after death")
        await engine.shutdown()
    asyncio.run(main())


def test_errors_cross_from_the_core_by_type():
    for exc in (InvalidRequestError("n must be at most 32", "n"), EngineOverloadedError("full"),
                FileNotFoundError("gone"), KeyError("k"), ValueError("plain")):
        again = pickle.loads(pickle.dumps(RemoteError.of(exc))).rebuild()
        assert type(again) is type(exc) and again.args == exc.args
        assert getattr(again, "param", None) == getattr(exc, "param", None)
    strange = RemoteError.of(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")).rebuild()
    assert type(strange) is RemoteEngineError and isinstance(strange, EngineError)
    assert "UnicodeDecodeError" in str(strange) and "bad byte" in str(strange)


def test_a_refusal_in_the_core_keeps_its_type(engine_factory):
    async def main():
        async with engine_factory(max_waiting_requests=0) as engine:  # every request finds the queue full
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests=0"):
                await engine.infer({"prompt_token_ids": PROMPTS[0]}, GREEDY)
            assert engine.is_healthy and (await engine.state())["num_collectors"] == 0
    asyncio.run(main())


def test_start_up_errors_reach_the_caller(tmp_path, model_dirs):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AsyncLLM(str(tmp_path / "missing"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no weights: the core fails to load
        (tmp_path / name).write_bytes((model_dirs["llama-gqa-tied"] / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):  # raised in the core's process, rebuilt by type
        AsyncLLM(str(tmp_path))


def test_a_bad_policy_fails_before_the_core_starts(model_dirs, monkeypatch):
    import aserve.engine.async_llm as async_llm

    monkeypatch.setattr(async_llm, "CoreProcess", lambda *args: pytest.fail("the engine core was started"))
    with pytest.raises(PolicyLoadError, match="unknown policy 'nope'; installed policies: .*fcfs"):
        AsyncLLM(str(model_dirs["llama-gqa-tied"]), policy="nope")


def test_docs_async_snippet_runs():
    page = (Path(__file__).parent.parent / "docs" / "offline.md").read_text()
    snippet = re.search(r"```python\n(import asyncio\nfrom aserve import AsyncLLM.*?)```", page, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 0  # the infer() text, then the streamed one


def test_chat_fallback_template_without_one():
    from aserve.server.openai import render_chat
    from aserve.server.protocol import ChatMessage

    class NoTemplate:
        chat_template = None

    text = render_chat(NoTemplate(), [ChatMessage(role="system", content="be kind"), ChatMessage(role="user",
                                                                                                   content="hi")])
    assert text == "system: be kind\nuser: hi\nassistant:"
