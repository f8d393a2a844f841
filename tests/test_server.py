"""The OpenAI-compatible server, driven by the real openai client (sync and async) over 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import signal
import statistics
import threading
import time

import httpx
import openai
import pytest

import aserve
import conftest
from server_util import RunningServer

KEY = "test-key-123"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(model_dirs):
    srv = RunningServer("--model", str(model_dirs["llama-gqa-tied"]), "--served-model-name", MODEL,
                        "--dtype", "float32", "--kv-cache-memory", "64MiB", "--api-key", KEY,
                        "--max-request-body", "200000", "--max-num-seqs", "32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def wait_idle(server):
    return conftest.wait_idle(server.url, KEY)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    embeddings = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert embeddings.status_code == 400 and "generate runner" in embeddings.json()["error"]["message"]
    for route, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                        ("/classify", {"input": "a"})):
        answer = httpx.post(f"{server.url}{route}", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 400 and "generate runner" in answer.json()["error"]["message"], route
    for route in ("load_lora_adapter", "unload_lora_adapter"):  # only with --enable-lora --allow-runtime-lora-updates
        answer = httpx.post(f"{server.url}/v1/{route}", json={"lora_name": "x", "lora_path": "/x"},
                            headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 404 and answer.json()["error"]["message"]
    assert httpx.get(f"{server.url}/version").json() == {"version": aserve.__version__}


def test_completion_stream_equals_plain_text(client):
    kwargs = dict(model=MODEL, prompt="def main():", max_tokens=24, temperature=0)
    plain = client.completions.create(**kwargs)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 24
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_stream_equals_plain_text(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 20
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content
    parts = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_n_samples_with_and_without_streaming(client):
    out = client.completions.create(model=MODEL, prompt="import", max_tokens=10, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 30
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt="import", max_tokens=10, n=3, temperature=1.0,
                                           seed=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in out.choices}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=6)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_beam_search_over_the_openai_routes(server, client, model_dirs):
    """vLLM's extras: use_beam_search with n beams gives n choices, best first, as LLM.beam_search does offline;
    streaming it, or a sampling field it cannot honour, is a 400 naming the field."""
    prompts = conftest.random_prompts(2, lengths=(5, 20), seed=4)
    llm = aserve.LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory=1 << 24)
    try:
        params = aserve.BeamSearchParams(3, 8, ignore_eos=True, length_penalty=0.5)
        tokenizer = llm.get_tokenizer()
        expected = [[tokenizer.decode(seq.tokens[len(ids):]) for seq in out.sequences]
                    for ids, out in zip(prompts, llm.beam_search(prompts, params))]
    finally:
        llm.engine.executor.shutdown()
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=3,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    assert [[c.text for c in out.choices[3 * i:3 * i + 3]] for i in range(2)] == expected
    assert out.usage.completion_tokens == 6 * 8
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, extra_body={"use_beam_search": True})
    assert [c.index for c in chat.choices] == [0, 1]
    choices = ["the king", "the queen", "a fool"]
    constrained = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "who?"}], n=3, max_tokens=12,
        extra_body={"use_beam_search": True, "structured_outputs": {"choice": choices}})
    assert len(constrained.choices) == 3
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in constrained.choices)
    for extra, param in (({"stream": True}, "stream"), ({"top_p": 0.5}, "top_p"), ({"logprobs": 2}, "logprobs"),
                         ({"seed": 1}, "seed"), ({"guided_regex": "(("}, "guided_regex")):
        r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "hi", "n": 2, "use_beam_search": True, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    metrics = httpx.get(f"{server.url}/metrics").text
    assert any(line.startswith("aserve:beam_search_requests_total") and float(line.split()[-1]) >= 3
               for line in metrics.splitlines())
    wait_idle(server)


def test_logprobs_of_ruled_out_tokens_are_a_finite_floor(server):
    """Tokens a grammar rules out have -inf log-probabilities, which JSON cannot carry (msgspec wrote null, off the
    schema): they report -9999.0, as vLLM's server does, in completions and chat alike (found by the fuzz test)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "guided_regex": "ab"}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "x", "logprobs": 5}, headers=headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    values = [v for top in logprobs["top_logprobs"] for v in top.values()] + logprobs["token_logprobs"]
    assert all(isinstance(v, float) for v in values) and -9999.0 in values
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60,
                   json={**body, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    values = [t["logprob"] for t in content] + [x["logprob"] for t in content for x in t["top_logprobs"]]
    assert all(isinstance(v, float) for v in values) and -9999.0 in values


def test_stop_max_tokens_logprobs_and_token_prompts(client):
    base = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert base.usage.prompt_tokens == 4
    stop = text[5:8]
    stopped = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:text.index(stop)]
    lp = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=5, temperature=0,
                                   logprobs=2)
    assert len(lp.choices) == 2 and lp.choices[0].text == text[:len(lp.choices[0].text)]
    for choice in lp.choices:  # greedy: each chosen token is the most likely, so it heads its top-2
        assert "".join(choice.logprobs.tokens) == choice.text and len(choice.logprobs.token_logprobs) == 5
        for token, logprob, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                       choice.logprobs.top_logprobs):
            assert len(top) == 2 and top[token] == logprob == max(top.values()) and logprob < 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content and len(content) == 4
    for t in content:
        assert [x.token for x in t.top_logprobs][0] == t.token and t.top_logprobs[0].logprob == t.logprob
        assert len(t.top_logprobs) == 2 and t.top_logprobs[1].logprob <= t.logprob
    biased = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, logit_bias={"42": 100},
                                       logprobs=0)
    chat_biased = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, logit_bias={"42": 100}, logprobs=True)
    assert biased.choices[0].logprobs.tokens == [biased.choices[0].logprobs.tokens[0]] * 4
    assert [t.token for t in chat_biased.choices[0].logprobs.content] == [biased.choices[0].logprobs.tokens[0]] * 3
    echo = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, echo=True)
    no_echo = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    assert echo.choices[0].text == "abc" + no_echo.choices[0].text


def test_wrong_api_key_is_rejected(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # health stays open


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 999999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi " * 600}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL}, 400, None),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True, "logit_bias": {"5": 1}}, 400, "logit_bias"),
])
def test_bad_requests_get_clear_errors(server, client, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert error["param"] == param and len(error["message"]) > 10
    after = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2  # unseeded sampling: without ignore_eos an eos could end it early


def test_prompt_too_long_names_both_lengths(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": list(range(1, 600)), "max_tokens": 4},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "599" in r.json()["error"]["message"] and "512" in r.json()["error"]["message"]


def test_malformed_bodies(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    for content in (b"{bad json", b"", b"[]", b"\xff\xfe", b'{"prompt": null}'):
        r = httpx.post(f"{server.url}/v1/completions", content=content, headers=auth)
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(f"{server.url}/v1/completions", content=b"x" * 300_000, headers=auth)
    assert big.status_code == 413
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]},
                      headers=auth)
    assert chat.status_code == 400
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].finish_reason == "length"


def test_tokenize_and_detokenize(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "def main():"}, headers=auth).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()["prompt"]
    assert text == "def main():"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=auth).json()
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}, headers=auth).json()["prompt"]
    assert rendered == "USER:\nhi<|endoftext|>\nASSISTANT:\n"  # the tokenizer's chat template, generation prompt on
    assert chat["count"] == len(chat["tokens"])


def test_generate_route_streams_nul_delimited_json(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "def main():", "max_tokens": 12, "temperature": 0, "n": 2}
    plain = httpx.post(f"{server.url}/generate", json=body, headers=auth).json()
    completion = client.completions.create(model=MODEL, prompt="def main():", max_tokens=12, temperature=0)
    assert plain["text"] == ["def main():" + completion.choices[0].text] * 2  # prompt + greedy text, per sample
    chunks = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=auth) as r:
        buffer = b""
        for data in r.iter_bytes():
            buffer += data
            *complete, buffer = buffer.split(b"\0")
            chunks.extend(json.loads(c) for c in complete if c)
    # How many chunks arrive is timing: cumulative outputs the client has not read yet are merged into the next
    # (12 tokens after a prefix-cache hit can all land in one). Each chunk extends the one before it.
    assert buffer == b"" and chunks
    for before, after in zip(chunks, chunks[1:]):
        assert all(b.startswith(a) for a, b in zip(before["text"], after["text"]))
    assert chunks[-1]["text"] == plain["text"]  # cumulative, like vLLM's api_server


async def _leave_after_events(url, events):
    """Stream a long completion and hang up after `events` events (0: as soon as it is admitted); True if the
    client left before the stream's end."""
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        async with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            if events == 0:
                return True
            seen = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return False
                seen += line.startswith("data: ")
                if seen == events:
                    return True
    return False


def test_cancelled_streams_free_everything(server, client):
    async def storm():  # more clients than --max-num-seqs: some leave while queued, others while decoding
        return await asyncio.gather(*[_leave_after_events(server.url, i % 4) for i in range(50)])
    gave_up = asyncio.run(storm())
    assert sum(gave_up) == 50  # the clients really left mid-stream
    # ignore_eos: the sampler's random state depends on how far the storm got, so an eos could come early
    out = client.completions.create(model=MODEL, prompt="after", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    wait_idle(server)


def test_health_answers_fast_and_short_requests_overlap_long_ones(server, client):
    finished = {}

    def long(i):  # a deadline for a loaded machine: what is checked below is the order of events, not speed
        client.with_options(timeout=600).completions.create(model=MODEL, prompt=f"long request number {i}",
                                                            max_tokens=480, extra_body={"ignore_eos": True})
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=long, args=(i,)) for i in range(24)]  # a big batch, below --max-num-seqs
    for t in threads:
        t.start()
    conftest.wait_for(lambda: conftest.server_state(server.url, KEY), lambda s: s["num_running"] == 24,
                      "the 24 long requests to run")
    short_start = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt="short", max_tokens=3, stream=True)
    next(iter(stream))
    first_token = time.monotonic()
    latencies = []
    with httpx.Client() as probe:
        for _ in range(100):
            t0 = time.perf_counter()
            assert probe.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
    probes_done = time.monotonic()
    for t in threads:
        t.join()
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"health p99 {p99 * 1000:.1f} ms; short request's first token after {first_token - short_start:.3f} s; "
          f"long ones done after {max(finished.values()) - short_start:.2f} s")
    assert len(finished) == 24 and probes_done < min(finished.values()), "the probes did not run under load"
    assert first_token < min(finished.values())  # the order of events, not their timing, is what must hold
    wait_idle(server)


def test_async_client_concurrent_requests(server):
    """Concurrent answers each belong to their own prompt (equal to the same request made alone), and a
    streamed greedy chat reassembles into the non-streamed greedy answer."""
    messages = [{"role": "user", "content": "x"}]

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        outs = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=8,
                                                                temperature=0) for i in range(12)])
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
        alone = [await client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=8, temperature=0)
                 for i in range(12)]
        await client.close()
        return outs, text, plain, alone
    outs, text, plain, alone = asyncio.run(main())
    assert all(o.usage.completion_tokens == 8 for o in outs)
    assert [o.choices[0].text for o in outs] == [a.choices[0].text for a in alone]
    assert plain.usage.completion_tokens == 5 and text == plain.choices[0].message.content


def test_sigterm_drains_in_flight_requests_and_exits_zero(model_dirs):
    """SIGTERM reaches the server while its core is stopped mid-request, and the core resumes only once the
    server has closed its door to new connections: the request is in flight on any CPU, and must still finish."""
    srv = RunningServer("--model", str(model_dirs["qwen2"]), "--dtype", "float32", "--kv-cache-memory", "16MiB")

    def door_closed():
        try:
            httpx.get(f"{srv.url}/health", timeout=10)
        except httpx.ConnectError:
            return True
        return False

    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the first token: it runs
            with srv.core_stopped():
                srv.proc.send_signal(signal.SIGTERM)
                conftest.wait_for(door_closed, what="the server to stop accepting connections")
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 200
        assert r.status_code == 200 and srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_bench_serve_reports_in_vllm_layout(server, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "aserve.cli", "bench", "serve", "--base-url", server.url,
                           "--api-key", KEY, "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
                           "--request-rate", "50", "--top-p", "0.9", "--top-k", "20", "--frequency-penalty", "0.5",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "P90 E2EL (ms):"):
        assert label in proc.stdout
    result = json.loads(out.read_text())
    assert result["successful_requests"] == 8 and result["failed_requests"] == 0
    assert result["total_output_tokens"] == 64 and result["total_input_tokens"] == 128
    assert result["ttft_ms"]["p99"] >= result["ttft_ms"]["median"] > 0 and "api_key" not in result["args"]
    assert (result["args"]["top_p"], result["args"]["top_k"], result["args"]["frequency_penalty"]) == (0.9, 20, 0.5)
    wait_idle(server)


def test_dead_engine_ends_streams_with_an_error_turns_health_503_and_exits_nonzero(model_dirs):
    import os

    srv = RunningServer("--model", str(model_dirs["qwen3"]), "--dtype", "float32", "--kv-cache-memory", "16MiB")
    try:
        child = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_core_child_of(int(p), srv.proc.pid)]
        assert len(child) == 1
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    os.kill(child[0], signal.SIGKILL)  # the engine dies mid-stream
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert srv.proc.wait(timeout=30) != 0  # exits non-zero, for a supervisor to restart it
    finally:
        srv.stop()


def _is_core_child_of(pid: int, parent: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        cmdline = open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False
    return int(stat[1]) == parent and "aserve.engine.core_child" in cmdline
