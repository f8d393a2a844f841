"""AsyncLLM: infer and streaming, aborts, consumers that leave, slow consumers, and a dying core."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aserve import AsyncLLM, EngineDeadError, SamplingParams
from conftest import random_prompts

PROMPTS = random_prompts(6, lengths=(4, 30), seed=21)
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture
def engine_factory(model_dirs):
    def make(**options):
        return AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB", **options)
    return make


async def idle_state(engine):
    for _ in range(100):
        state = await engine.state()
        if state["num_live_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]:
            return state
        await asyncio.sleep(0.02)
    raise AssertionError(f"not idle: {await engine.state()}")


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


def test_slow_consumer_gets_one_merged_output(engine_factory):
    async def main():
        async with engine_factory() as engine:
            stream = engine.generate("slow consumer", SamplingParams(temperature=0, max_tokens=40))
            first = await anext(stream)
            await asyncio.sleep(0.5)  # the request finishes meanwhile; its deltas merge in one slot
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
            await asyncio.sleep(0.1)
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
            with pytest.raises(ValueError, match="empty"):
                await engine.infer({"prompt_token_ids": []})
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.infer({"prompt_token_ids": [1] * 600})
            assert (await engine.infer("fine", GREEDY)).outputs[0].token_ids
    asyncio.run(main())


def test_a_dying_core_fails_every_caller(engine_factory):
    async def main():
        engine = engine_factory()
        streams = [engine.generate(f"doomed {i}", SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(4)]
        for stream in streams:
            await anext(stream)
        engine.core.proc.kill()  # the engine process dies (an OOM kill, a segfault in a kernel...)

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


def test_start_up_errors_reach_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AsyncLLM(str(tmp_path / "missing"))


def test_readme_async_snippet_runs():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet = re.search(r"```python\n(import asyncio\nfrom aserve import AsyncLLM.*?)```", readme, re.S).group(1)
    assert len(snippet.strip().splitlines()) <= 4
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "RequestOutput" in proc.stdout and "text=" in proc.stdout


def test_chat_fallback_template_without_one():
    from aserve.server.openai import render_chat
    from aserve.server.protocol import ChatMessage

    class NoTemplate:
        chat_template = None

    text = render_chat(NoTemplate(), [ChatMessage(role="system", content="be kind"), ChatMessage(role="user",
                                                                                                   content="hi")])
    assert text == "system: be kind\nuser: hi\nassistant:"
