"""LoRA adapters over HTTP: picked by `model`, listed by /v1/models, loaded and unloaded at run time (vLLM's routes)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import httpx
import openai
import pytest

import conftest
from lora_helpers import greedy, load_with_adapter, make_adapter
from server_util import RunningServer

# peft imports triton: only when a test runs, so that TRITON_INTERPRET (set by test_triton_backend at collection)
# is in place first
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed (the test extra "
                                                                                  "has it)")

FAMILY = "llama-gqa-tied"
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    base = model_dirs[FAMILY]
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "sql": make_adapter(base, root / "sql", targets=["q_proj", "v_proj"], r=4, seed=21),
        "chat": make_adapter(base, root / "chat", targets=["gate_proj", "up_proj", "down_proj", "o_proj"], r=8,
                             seed=22),
        "late": make_adapter(base, root / "late", targets=["k_proj", "down_proj"], r=16, seed=23),
        "too-big": make_adapter(base, root / "big", targets=["q_proj"], r=32, seed=24),
    }


@pytest.fixture(scope="module")
def server(model_dirs, adapters):
    srv = RunningServer("--model", str(model_dirs[FAMILY]), "--served-model-name", "base", "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--api-key", KEY, "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "16", "--lora-modules", f"sql={adapters['sql']}",
                        f'{{"name": "chat", "path": "{adapters["chat"]}", "base_model_name": "base"}}',
                        "--allow-runtime-lora-updates")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def reference_text(model_dirs, adapter, prompt_ids, max_tokens):
    from aserve.models.loader import load_tokenizer

    tokens = greedy(load_with_adapter(model_dirs[FAMILY], adapter), prompt_ids, max_tokens)
    return load_tokenizer(str(model_dirs[FAMILY])).decode(tokens)


PROMPT = conftest.random_prompts(1, lengths=(12, 13), seed=31)[0]


def complete(client, model, max_tokens=10, **kwargs):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)


def test_the_schema_lists_the_adapter_routes(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        operation = schema["paths"][route]["post"]
        assert operation["security"] == [{"bearer": []}] and "text/plain" in operation["responses"]["200"]["content"]
    assert "parent" in schema["components"]["schemas"]["ModelCard"]["properties"]


def test_models_lists_each_adapter_with_its_parent_and_root(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["base", "sql", "chat"]
    assert cards["sql"].parent == "base" and cards["sql"].root == str(adapters["sql"])
    assert cards["chat"].parent == "base" and getattr(cards["base"], "parent", None) is None


def test_a_request_picks_its_adapter_by_model(client, model_dirs, adapters):
    for model, adapter in (("sql", adapters["sql"]), ("chat", adapters["chat"]), ("base", None)):
        out = complete(client, model)
        assert out.model == model
        assert out.choices[0].text == reference_text(model_dirs, adapter, PROMPT, 10)
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.usage.completion_tokens == 4


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "nope")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`nope` does not exist" in error["message"] and "`sql`" in error["message"]


def test_load_and_unload_at_run_time(server, client, model_dirs, adapters):
    url = server.url
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}
                      ).status_code == 401  # behind the API key like every route
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH,
                        json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert loaded.status_code == 200, loaded.text
    assert complete(client, "late").choices[0].text == reference_text(model_dirs, adapters["late"], PROMPT, 10)
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    refused = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH,
                         json={"lora_name": "big", "lora_path": str(adapters["too-big"])})
    assert refused.status_code == 400 and "rank 32 is above max_lora_rank=16" in refused.json()["error"]["message"]
    assert "big" not in [m.id for m in client.models.list().data]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"})
    assert gone.status_code == 404
    conftest.wait_idle(url, KEY)


def test_unloading_lets_running_requests_finish(server, client, model_dirs, adapters):
    """A stream under `chat` is running when `chat` is unloaded: it ends normally, every token under the adapter."""
    stream = complete(client, "chat", max_tokens=60, stream=True)
    first = next(iter(stream))
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "chat"}
                      ).status_code == 200
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream if c.choices)
    assert text == reference_text(model_dirs, adapters["chat"], PROMPT, 60)
    with pytest.raises(openai.NotFoundError):
        complete(client, "chat")
    conftest.wait_idle(server.url, KEY)  # nothing live, every block free
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "chat", "lora_path": str(adapters["chat"])}).status_code == 200


def test_lora_flags_are_checked_before_and_after_loading(model_dirs, adapters):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "aserve.cli", "serve", "--model", str(model_dirs[FAMILY]),
                               "--port", "0", *args], capture_output=True, text=True, timeout=300)

    early = run("--lora-modules", f"sql={adapters['sql']}")
    assert early.returncode == 2 and early.stderr.strip() == (
        "aserve: error: --lora-modules and --allow-runtime-lora-updates need --enable-lora")
    assert run("--enable-lora", "--lora-modules", "sql").stderr.strip().endswith("expected name=path or a JSON object")
    late = run("--enable-lora", "--dtype", "float32", "--kv-cache-memory", "8MiB", "--lora-modules",
               f"big={adapters['too-big']}")
    last = late.stderr.strip().splitlines()[-1]
    assert late.returncode == 2 and last.startswith("aserve: error: LoRA adapter ") and "max_lora_rank=16" in last


def test_metrics_count_requests_per_adapter(server, client):
    complete(client, "sql", max_tokens=2)
    conftest.wait_idle(server.url, KEY)
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    counted = [line for line in text.splitlines() if line.startswith("aserve:lora_requests_total{")]
    assert any('lora_name="sql"' in line and float(line.split()[-1]) >= 1 for line in counted), counted
    info = [line for line in text.splitlines() if line.startswith("aserve:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info
