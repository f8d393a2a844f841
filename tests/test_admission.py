"""One path in: a request is admitted once in the front end (parsed, tokenized, validated, its output
constraint checked), whether it comes through AsyncLLM or the server; a batch is tokenized in one hop off
the event loop; and bad input is refused with a 400 naming its field before any stream starts.

Calls are counted wherever an aserve module in this process looks the function up; the engine core runs
in its own process, so its own authoritative check is not among them."""
from __future__ import annotations

import asyncio
import re
import sys

import httpx
import pytest

from aserve import AsyncLLM, SamplingParams
from aserve.errors import InvalidRequestError
from aserve.inputs import Admitted, validate_request
from aserve.server.app import build_app
from aserve.structured_output import StructuredOutputsParams
from aserve.structured_output.grammar import check as check_constraint

DIGITS = StructuredOutputsParams(regex="[0-9]{3}")
HI = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "foo"}
REFUSED = [  # (route, body fields, the field the 400 must name): each asks for a stream
    ("/v1/completions", {"prompt": ["fine", [1, 2, 999999]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(("}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]}, "tools"),
    ("/generate", {"prompt": [1, 999999]}, "prompt"),
    ("/generate", {"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
]


@pytest.fixture
def engine(model_dirs):
    return AsyncLLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB")


def count_calls(monkeypatch, function) -> list:
    """Wrap `function` in every aserve module of this process that holds it; return the list of its calls."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("aserve"):
            for name, value in list(vars(module).items()):
                if value is function:
                    monkeypatch.setattr(module, name, counting)
    return calls


class Counts:
    """Front-end validations, constraint checks and tokenizer-pool hops, counted from the last reset."""

    def __init__(self, monkeypatch, engine: AsyncLLM):
        self.validations = count_calls(monkeypatch, validate_request)
        self.checks = count_calls(monkeypatch, check_constraint)
        self.hops = []
        pool = engine._tokenizer_pool
        submit = pool.submit

        def counted_submit(fn, *args, **kwargs):
            self.hops.append(fn)
            return submit(fn, *args, **kwargs)
        monkeypatch.setattr(pool, "submit", counted_submit)

    def reset(self) -> None:
        for calls in (self.validations, self.checks, self.hops):
            calls.clear()

    def __call__(self) -> tuple[int, int, int]:
        return len(self.validations), len(self.checks), len(self.hops)


def test_async_llm_admits_a_request_once(engine, monkeypatch):
    async def main():
        async with engine:
            counts = Counts(monkeypatch, engine)
            params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=DIGITS)
            out = await engine.infer("a raw prompt", params)  # admitted by infer itself
            assert re.fullmatch("[0-9]{3}", out.outputs[0].text)
            assert counts() == (1, 1, 1)  # one validation, one check, one hop (encode and check together)

            counts.reset()
            batch = await engine.admit(["one", "two prompts", {"prompt_token_ids": [5, 6, 7]}], params)
            assert counts() == (3, 1, 1)  # each prompt validated once, the shared constraint checked once
            assert [a.text for a in batch] == ["one", "two prompts", None] and batch[2].token_ids == [5, 6, 7]
            outs = await asyncio.gather(*[engine.infer(a) for a in batch])
            assert all(re.fullmatch("[0-9]{3}", o.outputs[0].text) for o in outs)
            assert counts() == (3, 1, 1)  # submitting what was admitted repeats none of it

            counts.reset()
            await engine.infer({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
            assert counts() == (1, 0, 0)  # token ids and no constraint: validated on the loop, no hop
    asyncio.run(main())


def test_async_llm_admission_errors_name_the_prompt_and_the_field(engine):
    async def main():
        async with engine:
            with pytest.raises(InvalidRequestError, match=r"^prompt 1: .*max_model_len") as caught:
                await engine.admit(["fine", [1] * 600], SamplingParams(max_tokens=4))
            assert caught.value.param == "prompt"
            bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(("))
            with pytest.raises(InvalidRequestError, match="^guided_regex: invalid regex") as caught:
                await engine.admit("fine", bad, constraint_field="guided_regex")
            assert caught.value.param == "guided_regex"
            with pytest.raises(InvalidRequestError) as caught:  # direct users get the default field name
                await engine.infer("fine", bad)
            assert caught.value.param == "structured_outputs"
            [admitted] = await engine.admit("fine", SamplingParams(max_tokens=4))
            assert isinstance(admitted, Admitted)
            with pytest.raises(TypeError, match="carries the sampling params"):
                await engine.infer(admitted, SamplingParams(max_tokens=8))  # would skip the new params' checks
            assert (await engine.infer(admitted)).outputs[0].token_ids
            assert (await engine.state())["num_collectors"] == 0
    asyncio.run(main())


def test_the_server_admits_once_and_refuses_before_any_stream(engine, monkeypatch):
    app = build_app(engine, served_model_name="tiny")

    async def main():
        async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                             base_url="http://aserve.test", timeout=60) as http:
            counts = Counts(monkeypatch, engine)
            body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "guided_regex": "[0-9]{3}"}
            r = await http.post("/v1/completions", json={**body, "prompt": ["one", "two", "three"]})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
            assert counts() == (3, 1, 1)  # a batch: tokenized, validated and checked in one hop

            for route, extra in (("/v1/chat/completions", {"messages": HI}),
                                 ("/generate", {"prompt": "hi"})):
                for stream in (False, True):
                    counts.reset()
                    r = await http.post(route, json={**body, **extra, "stream": stream})
                    assert r.status_code == 200, r.text
                    assert counts()[:2] == (1, 1), (route, stream)
            counts.reset()
            r = await http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": HI})
            assert r.status_code == 200 and counts() == (1, 0, 1)  # the chat template rendered and encoded in one hop

            for route, extra, param in REFUSED:
                r = await http.post(route, json={"model": "tiny", "max_tokens": 4, "stream": True, **extra})
                assert r.status_code == 400, (route, extra, r.text)
                assert r.headers["content-type"] == "application/json"  # an answer, not a started stream
                assert r.json()["error"]["param"] == param, (route, extra, r.json())
            assert (await engine.state())["num_collectors"] == 0
    asyncio.run(main())
