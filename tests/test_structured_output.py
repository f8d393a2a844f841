"""Structured output (xgrammar): JSON schemas, regexes, choices and grammars on both OpenAI routes, in the
offline engine under preemption and swap, malformed constraints answered 400, the usage fields, metrics,
and the throughput command's constrained run. The embedded model was never trained on JSON, so every
schema bounds its strings: what is tested is that the grammar, not the model, makes the output valid."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from aserve import LLM, SamplingParams
from aserve.config import DEFAULT_MODEL_DIR
from aserve.errors import InvalidRequestError
from aserve.structured_output import StructuredOutputsParams
from conftest import kv_memory_for_blocks
from server_util import RunningServer
from test_seams import assert_plain

MODEL = "aserve-default"

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,6}\\.com$"}}, "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                      "minItems": 2, "maxItems": 4},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"]},
    "numbers": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                                                 "ratio": {"type": "number", "exclusiveMaximum": 1, "minimum": 0}},
                "required": ["price", "qty", "ratio"]},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "label": {"type": "string", "maxLength": 5}},
                 "required": ["id"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
                "required": ["code", "date"]},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}},
        "required": ["k", "v"]}},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none", "many"]}]},
        "tag": {"type": ["string", "null"], "maxLength": 6}}, "required": ["value", "tag"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"]}}, "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
}


def concurrently(*calls):
    """Run independent requests at once (the engine batches them); their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def valid(text: str, schema: dict) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.fixture(scope="module")
def server():
    srv = RunningServer("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-num-seqs", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


# -- JSON schemas, regexes, choices, grammars over HTTP --------------------------------------------

def test_ten_schemas_on_both_routes_parse_and_validate(server):
    """Each schema once per route, all at once, through every spelling of a JSON schema constraint."""
    async def one(http, route, name, seed):
        schema = SCHEMAS[name]
        body = {"model": MODEL, "max_tokens": 100, "temperature": 0.9, "seed": seed}
        spelling = seed % 3
        if spelling == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        elif spelling == 1:
            body["guided_json"] = schema if seed % 2 else json.dumps(schema)
        else:
            body["structured_outputs"] = {"json": schema}
        if route == "chat":
            body["messages"] = [{"role": "user", "content": f"Give me {name} as JSON."}]
        else:
            body["prompt"] = f"{name} as JSON:"
        answer = (await http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body))
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        assert choice["finish_reason"] == "stop", (name, text)
        return name, text

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, route, name, seed) for route in ("chat", "completions")
                                          for seed, name in enumerate(SCHEMAS)))
    results = asyncio.run(run())
    assert len(results) == 20
    for name, text in results:
        assert valid(text, SCHEMAS[name]), (name, text)


def test_regex_choice_grammar_and_json_object(client):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    choices = ["yes", "no", 'say "maybe"', "naïve\\answer"]
    grammar = 'root ::= "(" item (", " item){0,3} ")"\nitem ::= [a-c] [0-9]'
    pick = [{"role": "user", "content": "pick"}]
    calls = [lambda extra=extra: client.completions.create(model=MODEL, prompt="id:", max_tokens=30, temperature=1.0,
                                                           seed=3, n=3, extra_body=extra)
             for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}})]
    calls += [lambda extra=extra: client.chat.completions.create(model=MODEL, messages=pick, max_tokens=30, seed=4,
                                                                 temperature=1.0, n=4, extra_body=extra)
              for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}})]
    calls += [lambda extra=extra: client.completions.create(model=MODEL, prompt="list:", max_tokens=60, seed=5,
                                                            temperature=0.7, extra_body=extra)
              for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}})]
    calls.append(lambda: client.chat.completions.create(model=MODEL, messages=pick, max_tokens=40, temperature=0,
                                                        response_format={"type": "json_object"}))
    regexed, regexed2, chosen, chosen2, listed, listed2, anything = concurrently(*calls)
    for choice in regexed.choices + regexed2.choices:
        assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop", choice.text
    for choice in chosen.choices + chosen2.choices:
        assert choice.message.content in choices and choice.finish_reason == "stop"
    for out in (listed, listed2):
        assert re.fullmatch(r"\([a-c][0-9](, [a-c][0-9]){0,3}\)", out.choices[0].text), out.choices[0].text
    text = anything.choices[0].message.content  # free keys and values: it may run past max_tokens
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length"
                                     or isinstance(json.loads(text), dict))


def test_streamed_samples_match_their_schema_and_carry_usage(client):
    schema = SCHEMAS["nested"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a user"}], max_tokens=100, temperature=1.0, seed=7, n=2,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema}})
    texts, finish, usages = {0: "", 1: ""}, {}, []
    for chunk in stream:
        usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    assert all(valid(t, schema) for t in texts.values())
    counted = [u.completion_tokens for u in usages[1:-1]]  # every chunk after the role chunk has its usage
    assert all(u is not None for u in usages[1:]) and counted == sorted(counted)
    final = usages[-1]
    assert final.completion_tokens >= counted[-1]
    # prefix-cache hits come in whole blocks (16 tokens), and at least the last prompt token is always computed
    cached = final.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and cached < final.prompt_tokens
    assert all(u.prompt_tokens_details.cached_tokens == cached for u in usages[1:])


def test_openai_parse_with_a_pydantic_model(client):
    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        temperature: int = Field(ge=-30, le=45)
        conditions: list[Literal["sun", "rain", "snow"]] = Field(max_length=2)
        note: str = Field(max_length=12)

    completion = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "forecast?"}],
                                               response_format=Forecast, max_tokens=120, temperature=0.5, seed=1)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and -30 <= parsed.temperature <= 45 and len(parsed.note) <= 12


def test_usage_reports_cached_prompt_tokens(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the whole prompt is in the cache after the first request, in 16-token blocks; its last token is recomputed
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0


# -- bad input ------------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                     "label": {"type": "string", "maxLength": 8}}, "required": ["hour"]}}}
MALFORMED = [  # (route, extra body fields, the field the 400 must name)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("completions", {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}},
     "guided_json"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    ("completions", {"guided_json": [1, 2]}, "guided_json"),
    ("chat", {"guided_json": {"type": "string", "pattern": "(("}}, "guided_json"),
    ("completions", {"guided_regex": "(("}, "guided_regex"),
    ("completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("chat", {"guided_regex": "(?<=x)y"}, "guided_regex"),
    ("completions", {"guided_grammar": "root ::= "}, "guided_grammar"),
    ("completions", {"guided_grammar": 'start ::= "a"'}, "guided_grammar"),
    ("chat", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"guided_choice": ["ok", ""]}, "guided_choice"),
    ("chat", {"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {}}, "structured_outputs"),
    ("completions", {"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
              "tool_choice": "required"}, "tools"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools"),
]


def test_malformed_constraints_answer_400_naming_the_field_and_the_server_keeps_serving(server):
    assert len(MALFORMED) >= 15
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route, extra, field in MALFORMED:
            body = {"model": MODEL, "max_tokens": 4, **extra}
            body.update({"messages": CHAT} if route == "chat" else {"prompt": "hi"})
            answer = http.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=body)
            assert answer.status_code == 400, (extra, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == field, (extra, error)
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                "guided_regex": "[0-9]{4}"})
        assert ok.status_code == 200 and re.fullmatch("[0-9]{4}", ok.json()["choices"][0]["text"])
        assert http.get("/health").status_code == 200


# -- tools --------------------------------------------------------------------------------------------

SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALARM)}


def assert_valid_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_tool_choice_required_and_named(client):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "set_alarm"}}
    required, forced = concurrently(
        lambda: client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ALARM], max_tokens=80,
                                               tool_choice="required", parallel_tool_calls=False, temperature=0.8,
                                               seed=2),
        lambda: client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ALARM], tool_choice=named,
                                               max_tokens=80, temperature=0.8, seed=3))
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, {"get_weather", "set_alarm"})
    assert forced.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(forced.choices[0].message.tool_calls, {"set_alarm"})


def test_streamed_tool_calls_are_reassembled_by_the_openai_client(client):
    ask = [{"role": "user", "content": "Wake me at seven."}]

    def streamed(tool_choice):
        with client.chat.completions.stream(model=MODEL, messages=ask, tools=[WEATHER, ALARM], max_tokens=80,
                                            tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.8,
                                            seed=5) as stream:
            pieces = sum(1 for event in stream if event.type == "chunk" for c in event.chunk.choices
                         for call in c.delta.tool_calls or [] if call.function.arguments)
            return stream.get_final_completion(), pieces
    for final, pieces in concurrently(lambda: streamed({"type": "function", "function": {"name": "set_alarm"}}),
                                      lambda: streamed("required")):
        assert final.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(final.choices[0].message.tool_calls)
        assert pieces > 1  # the arguments stream as they are generated, not in one piece at the end


def test_auto_tool_choice_parses_hermes_calls_plain_and_streamed(client):
    """The model is steered (a regex) into Hermes' format; the server's parser must find both calls."""
    text = ('Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>\n'
            '<tool_call>{"name": "set_alarm", "arguments": {"hour": 7}}</tool_call>')
    steer = {"guided_regex": re.escape(text)}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "weather and alarm"}], tools=[WEATHER, ALARM],
                  max_tokens=200, temperature=0, extra_body=steer)

    def streamed():
        return list(client.chat.completions.create(**kwargs, stream=True))
    out, chunks, one, none = concurrently(lambda: client.chat.completions.create(**kwargs), streamed,
                                          lambda: client.chat.completions.create(**kwargs, parallel_tool_calls=False),
                                          lambda: client.chat.completions.create(**kwargs, tool_choice="none"))
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "set_alarm"]
    assert_valid_calls(message.tool_calls)
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for piece in c.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather", "set_alarm"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Lima", "days": 2}

    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert none.choices[0].message.content == text and none.choices[0].message.tool_calls is None


def test_tool_results_go_back_through_the_chat_template(client):
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 1})}}
    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 3}'}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4)
    assert out.choices[0].finish_reason == "length"


def test_templates_receive_tools_and_tool_messages():
    from aserve.models.loader import load_tokenizer
    from aserve.server import protocol as p
    from aserve.server.openai import render_chat

    tokenizer = load_tokenizer(str(DEFAULT_MODEL_DIR))
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %};{% endfor %}")
    messages = [p.ChatMessage(role="user", content="weather?"),
                p.ChatMessage(role="assistant", tool_calls=[p.ToolCall(id="call_1", function=p.FunctionCall(
                    name="get_weather", arguments='{"city": "Oslo"}'))]),
                p.ChatMessage(role="tool", tool_call_id="call_1", content="3 degrees")]
    text = render_chat(tokenizer, messages, tool_defs=[WEATHER])
    assert text == "TOOL get_weather;user:weather?;assistant: CALL get_weather(Oslo);tool:3 degrees FOR call_1;"


def test_metrics_count_kinds_and_compile_times(server, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_choice": ["a", "b"]})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    kinds = {s.labels["kind"]: s.value for s in families["aserve:structured_output_requests"].samples
             if s.name.endswith("_total")}
    assert kinds["choice"] >= 1 and kinds["json"] >= 1 and set(kinds) == {"json", "json_object", "regex", "choice",
                                                                          "grammar"}
    compiles = next(s.value for s in families["aserve:grammar_compile_seconds"].samples if s.name.endswith("_count"))
    assert compiles >= 1


# -- the offline engine: n > 1, preemption by recompute and swap, failures ------------------------------

@pytest.fixture(scope="module")
def small_llm():
    """10 KV blocks and a one-block host pool: constrained requests get preempted, by swap while the host pool
    has room and by recompute after."""
    return LLM(dtype="float32", kv_cache_memory=kv_memory_for_blocks(DEFAULT_MODEL_DIR, 10, dtype_bytes=4),
               policy="fcfs-swap", swap_space="80KiB")


def test_preempted_and_swapped_constrained_requests_stay_valid(small_llm):
    names = ["nested", "refs"]
    params = [SamplingParams(temperature=0.9, seed=seed, max_tokens=60, n=2 if seed == 0 else 1,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
              for name in names for seed in (0, 1)]
    engine = small_llm.engine
    before, real_execute, constrained_steps = dict(engine.scheduler.preemptions), engine.executor.execute, []

    def execute(sched):  # what reaches the worker stays plain data, bitmask rows included
        assert_plain(sched)
        constrained_steps.append(len(sched.structured_request_ids))
        return real_execute(sched)
    engine.executor.execute = execute
    try:
        outputs = small_llm.generate(["Write the JSON:"] * len(params), params, use_tqdm=False)
    finally:
        engine.executor.execute = real_execute
    assert max(constrained_steps) >= 2  # several constrained samples shared a step
    after = engine.scheduler.preemptions
    assert after["recompute"] > before["recompute"] and after["swap"] > before["swap"]
    for out, sp in zip(outputs, params):
        for o in out.outputs:
            assert o.finish_reason == "stop" and valid(o.text, sp.structured_outputs.json), o.text
    for i in range(0, len(outputs), 2):  # sample 1 of n=2 has seed 1, as the next request: same text
        assert outputs[i].outputs[1].text == outputs[i + 1].outputs[0].text
    engine.check_idle()


def test_invalid_constraints_fail_before_queueing_or_end_only_their_request(small_llm):
    with pytest.raises(InvalidRequestError, match="regex"):
        small_llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="((")))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    engine = small_llm.engine  # past the front door's check, the core ends only that request
    engine.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= ")),
                       request_id="bad")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{3}")), request_id="good")
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["bad"].finish_reason == "error" and "grammar" in finals["bad"].error
    assert re.fullmatch("[0-9]{3}", finals["good"].text) and finals["good"].finish_reason == "stop"
    engine.check_idle()


def test_ignore_eos_still_stops_where_the_grammar_ends(small_llm):
    out = small_llm.generate(["pick"], SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=(
        StructuredOutputsParams(choice=["left", "right"]))), use_tqdm=False)[0].outputs[0]
    assert out.text in ("left", "right") and out.finish_reason == "stop"


def test_a_grammar_that_dead_ends_stops_there(small_llm):
    """`ab` then a class no character is in: the check cannot see the dead end, the engine ends it with eos."""
    params = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(regex="ab[^\\s\\S]"))
    out = small_llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="no text matches it"):
        small_llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[^\\s\\S]")))


@pytest.mark.parametrize("options", [dict(min_tokens=20, min_p=0.16), dict(repetition_penalty=2.6e267, min_p=0.16),
                                     dict(min_tokens=20, repetition_penalty=1e30, temperature=1e-300)])
def test_min_tokens_and_extreme_penalties_give_way_to_the_grammar(small_llm, options):
    """A grammar that must end before min_tokens, or a penalty so large (found by the API fuzzer) that every
    allowed logit overflows to -inf: the constrained text still comes out whole, not an error or a cut."""
    params = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(regex=":\u00be,n\u00ac'"),
                            **options)
    out = small_llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == (":\u00be,n\u00ac'", "stop")


def test_the_matcher_replays_when_the_tokens_are_cut_back(small_llm):
    from aserve.structured_output.grammar import GrammarCompiler, RequestGrammar

    engine = small_llm.engine
    compiled = GrammarCompiler(engine.tokenizer, engine.vocab_size, [0]).compile(
        StructuredOutputsParams(regex="ab(c|d)e"))
    ids = lambda s: engine.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    grammar = RequestGrammar(compiled, [0])
    assert grammar.follow(ids("abc")) and not grammar.follow(ids("abcx"))
    grammar = RequestGrammar(compiled, [0])
    assert grammar.follow(ids("abc")) and grammar.follow(ids("ab"))  # cut back: replayed from the start
    assert grammar.follow(ids("abd") + ids("e") + [0]) and grammar.terminated


def test_bitmask_rows_are_matched_by_request_id_and_padded_logits_masked():
    import torch

    from aserve.structured_output.bitmask import apply_grammar_bitmask

    logits = torch.zeros(3, 100)  # 100 logits, a tokenizer of 64 tokens: 36 padded rows no grammar allows
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0 (request "c") allows token 5
    bitmask[1, 1] = 1 << 2  # row 1 (request "a") allows token 34
    apply_grammar_bitmask(logits, ["a", "b", "c"], ["c", "a"], bitmask.numpy().tobytes())
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[34], list(range(100)), [5]]


def test_bench_throughput_prints_the_constrained_ratio(small_llm, tmp_path, capsys):
    from aserve.bench.throughput import random_prompts, run_constrained

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"note": {"type": "string"}}}))
    engine = small_llm.engine
    prompts = random_prompts(2, 8, engine.vocab_size, set(engine.eos_token_ids), 0)
    tokens = run_constrained(small_llm, prompts, SamplingParams(ignore_eos=True, max_tokens=8), str(schema))
    printed = capsys.readouterr().out
    assert re.search(r"output tokens/s ratio constrained/free = [0-9.]+ \(equal lengths, 2 alternating rounds\)",
                     printed)
    assert printed.count("constrained Throughput:") == 2 and printed.count("free, same lengths Throughput:") == 2
    assert tokens["free"] == tokens["constrained"] > 0  # the free runs did exactly the constrained runs' work


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 8}, {"type": "string"}],
                         ids=["bounded", "unbounded"])
def test_json_strings_refuse_what_strict_parsers_refuse(schema):
    """Unescaped control characters and UTF-16 surrogates' bytes (ED A0..BF ..) are no JSON a strict parser takes
    back; xgrammar's string rules let them through and aserve rewrites them (seen on the bench model)."""
    import xgrammar as xgr

    from aserve.structured_output.grammar import grammar_of

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<eos>"], stop_token_ids=[256])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar_of(StructuredOutputsParams(json=schema)))

    def accepts(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(b) for b in text)

    assert accepts('"é€ok"'.encode())
    assert not accepts(b'"a\tb"') and not accepts(b'"a\x0bb"')
    assert not accepts(b'"\xed\xab\xb7"')  # U+DAF7 as UTF-8: a surrogate
