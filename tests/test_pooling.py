"""Pooling models (runner="pooling"): embeddings equal sentence-transformers' `encode`, through the same scheduler
(chunked prefill forced by a small token budget), offline and over /v1/embeddings."""
from __future__ import annotations

import base64
import importlib.util
import json
import struct

import httpx
import openai
import pytest
import torch

from aserve import LLM, PoolingParams, SamplingParams
from conftest import build_tiny_model
from pooling_util import TEXTS, write_st_modules
from server_util import RunningServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                                reason="sentence-transformers not installed (the test extra has it)")

OPTIONS = dict(dtype="float32", kv_cache_memory="16MiB", device="cpu", max_num_batched_tokens=8)  # chunked prefill


def st_folder(tmp_path_factory, kind: str, matryoshka=None):
    """A tiny random Qwen3ForCausalLM folder made a sentence-transformers one (as Qwen3-Embedding ships): modules.json
    with Transformer (the folder itself), Pooling (`kind`) and Normalize; and sentence-transformers' own model read
    from it, the reference."""
    from sentence_transformers import SentenceTransformer

    path = build_tiny_model(tmp_path_factory.mktemp(f"st-{kind}") / "model", "qwen3")
    if matryoshka:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": matryoshka}))
    write_st_modules(path, kind, 64)
    return path, SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module", params=["lasttoken", "mean", "cls"])
def folder(request, tmp_path_factory):
    return st_folder(tmp_path_factory, request.param)


def cosines(got, expected) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(expected), dim=-1).tolist()


def test_embeddings_equal_sentence_transformers(folder):
    path, st = folder
    expected = st.encode(TEXTS, convert_to_numpy=True, batch_size=8)
    llm = LLM(str(path), **OPTIONS)  # runner auto: a sentence-transformers folder pools
    batched = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    alone = [llm.embed([text], use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    assert min(cosines(batched, expected)) >= 0.9999 and min(cosines(alone, expected)) >= 0.9999
    assert all(abs(sum(x * x for x in e) - 1) < 1e-4 for e in batched)  # the Normalize module
    llm.engine.check_idle()


def test_pooling_reads_no_prefix_cache_and_encode_is_raw(tmp_path_factory):
    path, st = st_folder(tmp_path_factory, "mean")
    llm = LLM(str(path), **{**OPTIONS, "enable_prefix_caching": True})
    first, again = (llm.encode([TEXTS[2]], use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == again.num_cached_tokens == 0  # a mean needs every position's state
    raw = first.outputs.data
    assert abs(raw.norm().item() - 1) > 1e-3  # not normalized
    embedded = torch.tensor(llm.embed([TEXTS[2]], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(embedded, torch.nn.functional.normalize(raw, dim=-1))
    llm.engine.check_idle()


def test_matryoshka_dimensions_cut_and_renormalize(tmp_path_factory):
    path, st = st_folder(tmp_path_factory, "lasttoken", matryoshka=[64, 32, 16])
    llm = LLM(str(path), **OPTIONS)
    full = llm.encode([TEXTS[0]], use_tqdm=False)[0].outputs.data
    short = llm.embed([TEXTS[0]], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert len(short) == 16
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(full[:16], dim=-1))
    raw = llm.embed([TEXTS[0]], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), full)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tmp_path_factory):
    path, _ = st_folder(tmp_path_factory, "mean")
    llm = LLM(str(path), **{**OPTIONS, "max_model_len": 32})
    long = list(range(5, 45))  # 40 tokens: over max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.encode([long], use_tqdm=False)
    cut = llm.encode([long], PoolingParams(truncate_prompt_tokens=20), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-20:]
    torch.testing.assert_close(cut.outputs.data, llm.encode([long[-20:]], use_tqdm=False)[0].outputs.data)
    llm.engine.check_idle()


def test_the_wrong_runner_and_undeclared_dimensions_are_refused(folder, model_dirs):
    path, _ = folder
    llm = LLM(str(path), **OPTIONS)
    with pytest.raises(ValueError, match="runs the pooling runner"):
        llm.generate(TEXTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="does not declare Matryoshka dimensions"):
        llm.embed(TEXTS[:2], PoolingParams(dimensions=8), use_tqdm=False)
    llm.engine.check_idle()
    generator = LLM(str(model_dirs["qwen3"]), **OPTIONS)
    with pytest.raises(ValueError, match="runs the generate runner"):
        generator.embed(TEXTS[:1], use_tqdm=False)
    generator.engine.check_idle()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, st = st_folder(tmp_path_factory, "mean", matryoshka=[64, 32])
    srv = RunningServer("--model", str(path), "--served-model-name", "embedder", "--dtype", "float32",
                        "--kv-cache-memory", "16MiB", "--runner", "pooling")
    yield srv, st
    srv.stop()


def test_v1_embeddings_in_openais_shape(server):
    srv, st = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(TEXTS))) and answer.model == "embedder"
    assert min(cosines([d.embedding for d in answer.data], st.encode(TEXTS))) >= 0.9999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
    raw = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    floats = struct.unpack(f"<{64}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert cosines([list(floats)], [answer.data[0].embedding])[0] > 0.99999
    short = client.embeddings.create(model="embedder", input=[[5, 6, 7], [8, 9]], dimensions=32)
    assert [len(d.embedding) for d in short.data] == [32, 32]
    bad = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x", "dimensions": 7})
    assert bad.status_code == 400 and "dimensions" in bad.json()["error"]["message"]
    pooled = httpx.post(f"{srv.url}/pooling", json={"input": [[5, 6, 7, 8]], "truncate_prompt_tokens": 2}).json()
    assert pooled["usage"]["prompt_tokens"] == 2 and pooled["data"][0]["object"] == "pooling"
    raw = torch.tensor(pooled["data"][0]["data"])
    embedded = client.embeddings.create(model="embedder", input=[[7, 8]]).data[0].embedding
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=-1), torch.tensor(embedded))
    completion = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert completion.status_code == 400 and "pooling runner" in completion.json()["error"]["message"]


def test_a_folder_sentence_transformers_saved_loads_as_its_bare_model(tmp_path_factory):
    """sentence-transformers saves the Transformer module as the bare stack (Qwen3Model, no LM head): served by the
    pooling runner (auto), and refused by the generate runner before loading."""
    from sentence_transformers import SentenceTransformer, models

    from aserve.errors import ConfigError

    root = tmp_path_factory.mktemp("st-saved")
    base = build_tiny_model(root / "base", "qwen3", tie_word_embeddings=False)
    transformer = models.Transformer(str(base))
    st = SentenceTransformer(modules=[transformer, models.Pooling(64, pooling_mode="mean"), models.Normalize()],
                             device="cpu")
    st.save(str(root / "st"))
    assert json.loads((root / "st" / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    # sentence-transformers 6 wraps each text in the tokenizer's chat template when the folder has one (the tiny
    # models copy the embedded model's); aserve embeds the text as given, as vLLM does: compare without it
    (root / "st" / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((root / "st" / "sentence_bert_config.json").read_text())
    settings.get("modality_config", {}).pop("message", None)
    (root / "st" / "sentence_bert_config.json").write_text(json.dumps(settings))
    st = SentenceTransformer(str(root / "st"), device="cpu")
    llm = LLM(str(root / "st"), **OPTIONS)
    got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    assert min(cosines(got, st.encode(TEXTS))) >= 0.9999
    with pytest.raises(ConfigError, match="bare decoder stack"):
        LLM(str(root / "st"), runner="generate", **OPTIONS)
