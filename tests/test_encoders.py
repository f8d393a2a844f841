"""Encoder models and classifiers on the pooling runner: BERT and RoBERTa embeddings equal sentence-transformers'
`encode` (mean and CLS), cross-encoders' scores equal its `CrossEncoder.predict` (BERT, RoBERTa and a Qwen3
reranker), classifiers' probabilities equal transformers' own, offline and over /classify, /score and /rerank."""
from __future__ import annotations

import importlib.util
import json

import httpx
import pytest
import torch

from aserve import LLM
from aserve.errors import ConfigError
from conftest import COMMON
from pooling_util import QUERIES, TEXTS, encoder_folder, write_st_modules
from server_util import RunningServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                                reason="sentence-transformers not installed (the test extra has it)")

# A step holds 32 tokens: the test prompts (7-19 tokens, pairs up to 30) run whole, one or two a step.
OPTIONS = dict(dtype="float32", kv_cache_memory="4MiB", device="cpu", max_num_batched_tokens=32, max_model_len=32)


def cosines(got, expected) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(expected), dim=-1).tolist()


def st_encoder(tmp_path_factory, arch: str, kind: str):
    from sentence_transformers import SentenceTransformer

    path = write_st_modules(encoder_folder(tmp_path_factory.mktemp(f"{arch}-{kind}") / "model", arch), kind, 64)
    return path, SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("arch,kind", [("BertModel", "mean"), ("BertModel", "cls"), ("RobertaModel", "mean"),
                                       ("XLMRobertaModel", "cls")])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path_factory, arch, kind):
    path, st = st_encoder(tmp_path_factory, arch, kind)
    expected = st.encode(TEXTS, convert_to_numpy=True, batch_size=8)
    llm = LLM(str(path), **OPTIONS)  # runner auto: an encoder pools
    assert llm.engine.config.resolved_runner == "pooling"
    batched = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    alone = [llm.embed([text], use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    assert min(cosines(batched, expected)) >= 0.9999 and min(cosines(alone, expected)) >= 0.9999
    assert all(abs(sum(x * x for x in e) - 1) < 1e-4 for e in batched)
    llm.engine.check_idle()


def test_bf16_encoder_embeddings_follow_sentence_transformers(tmp_path_factory):
    """bf16 weights take the packed GEMMs (oneDNN's on AMX CPUs, aserve's elsewhere) with the GELU in the
    epilogue and each residual add in the LayerNorm's kernel: still sentence-transformers' fp32 embeddings,
    within bf16's rounding."""
    path, st = st_encoder(tmp_path_factory, "BertModel", "mean")
    expected = st.encode(TEXTS, convert_to_numpy=True, batch_size=8)
    llm = LLM(str(path), **{**OPTIONS, "dtype": "bfloat16"})
    got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    assert min(cosines(got, expected)) >= 0.999
    llm.engine.check_idle()


def test_an_encoder_runs_prompts_whole_and_keeps_no_cache(tmp_path):
    """Bidirectional prompts cannot be chunked: a step budget under max_model_len is refused at start-up; with
    one prompt per step allowed, each runs whole, and the KV cache is never written."""
    path = encoder_folder(tmp_path / "bert")
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 16})
    llm = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 20, "max_model_len": 20})  # prompts: 7-19 tokens
    steps = []
    schedule = llm.engine.scheduler.schedule

    def spy(*args):
        out = schedule(*args)
        steps.append(dict(out.num_scheduled_tokens))
        return out
    llm.engine.scheduler.schedule = spy
    outs = llm.encode(TEXTS, use_tqdm=False)
    lengths = {o.request_id: len(o.prompt_token_ids) for o in outs}
    for step in steps:  # every request scheduled in a step got its whole prompt
        assert all(n == lengths[rid] for rid, n in step.items() if rid in lengths)
    assert len([s for s in steps if s]) > 1  # they did not all fit one step
    assert not llm.engine.runner.kv_cache.any()
    llm.engine.check_idle()


def test_bert_reads_the_second_segment_of_a_pair(tmp_path):
    """Segment ids follow the first [SEP], as BERT's tokenizer sets token_type_ids for a pair."""
    import transformers

    path = encoder_folder(tmp_path / "bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = transformers.BertModel.from_pretrained(path).eval()
    llm = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 64})
    pairs = [tokenizer(q, t) for q in QUERIES for t in TEXTS[:2]]
    got = llm.encode([pair["input_ids"] for pair in pairs], use_tqdm=False)
    for pair, out in zip(pairs, got):
        with torch.no_grad():
            expected = reference(torch.tensor([pair["input_ids"]]),
                                 token_type_ids=torch.tensor([pair["token_type_ids"]])).last_hidden_state[0, 0]
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)


def decoder_reranker(path):
    """A tiny random Qwen3ForSequenceClassification (one label) with the embedded model's tokenizer."""
    import shutil

    import transformers

    from aserve.config import DEFAULT_MODEL_DIR

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**COMMON, "head_dim": 32, "num_labels": 1})
    transformers.Qwen3ForSequenceClassification(config).to(torch.float32).save_pretrained(path)
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", path / "tokenizer.json")
    # without the chat template: sentence-transformers 6 would wrap each pair in it, aserve scores the pair as given
    settings = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="module", params=["BertForSequenceClassification", "RobertaForSequenceClassification",
                                        "Qwen3ForSequenceClassification"])
def reranker(request, tmp_path_factory):
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp(request.param)
    path = (decoder_reranker(root / "model") if request.param.startswith("Qwen3")
            else encoder_folder(root / "model", request.param, num_labels=1))
    return path, CrossEncoder(str(path), device="cpu")


def test_cross_encoder_scores_equal_sentence_transformers(reranker):
    path, cross_encoder = reranker
    llm = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 64, "max_model_len": 64})
    pairs = [(QUERIES[0], text) for text in TEXTS]
    expected = cross_encoder.predict(pairs, batch_size=1)  # unpadded: a decoder's last token is its last
    got = [o.outputs.score for o in llm.score(QUERIES[0], TEXTS, use_tqdm=False)]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)
    pairwise = llm.score([QUERIES[1]] * 2, TEXTS[:2], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        cross_encoder.predict([(QUERIES[1], t) for t in TEXTS[:2]], batch_size=1).tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="it does not embed"):
        llm.embed(TEXTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="as many of each"):
        llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
    llm.engine.check_idle()


def test_classify_gives_each_labels_probability(tmp_path):
    import transformers

    labels = {0: "sad", 1: "neutral", 2: "glad"}
    path = encoder_folder(tmp_path / "bert", "BertForSequenceClassification", num_labels=3, id2label=labels,
                          label2id={v: k for k, v in labels.items()})
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.pooling_spec.labels == ("sad", "neutral", "glad")
    got = llm.classify(TEXTS, use_tqdm=False)
    with torch.no_grad():
        expected = [reference(**tokenizer(t, return_tensors="pt")).logits[0].softmax(-1) for t in TEXTS]
    for out, probs in zip(got, expected):
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), probs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="a score needs a one-label classifier"):
        llm.score(QUERIES[0], TEXTS[:2], use_tqdm=False)
    raw = llm.encode(TEXTS[:1], use_tqdm=False)[0].outputs.data  # the logits
    torch.testing.assert_close(raw.softmax(-1), expected[0], atol=1e-5, rtol=1e-5)
    llm.engine.check_idle()


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path_factory):
    path, st = st_encoder(tmp_path_factory, "BertModel", "mean")
    llm = LLM(str(path), **OPTIONS)
    got = [o.outputs.score for o in llm.score(QUERIES[0], TEXTS, use_tqdm=False)]
    query, docs = st.encode([QUERIES[0]], convert_to_tensor=True), st.encode(TEXTS, convert_to_tensor=True)
    assert got == pytest.approx(torch.nn.functional.cosine_similarity(query, docs).tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="not a classifier"):
        llm.classify(TEXTS[:1], use_tqdm=False)


@pytest.fixture(scope="module")
def server(reranker):
    path, cross_encoder = reranker
    if not path.parent.name.startswith("Bert"):
        pytest.skip("one server: the BERT cross-encoder")
    srv = RunningServer("--model", str(path), "--served-model-name", "reranker", "--dtype", "float32",
                        "--kv-cache-memory", "4MiB", "--max-model-len", "64")
    yield srv, cross_encoder
    srv.stop()


def test_score_rerank_and_classify_routes(server):
    srv, cross_encoder = server
    expected = cross_encoder.predict([(QUERIES[0], t) for t in TEXTS]).tolist()
    for route in ("/score", "/v1/score"):
        answer = httpx.post(f"{srv.url}{route}", json={"model": "reranker", "text_1": QUERIES[0], "text_2": TEXTS})
        body = answer.json()
        assert answer.status_code == 200 and body["object"] == "list" and body["model"] == "reranker"
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
        assert body["usage"]["prompt_tokens"] > len(TEXTS)
    ranked = sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(f"{srv.url}{route}", json={"query": QUERIES[0], "documents": TEXTS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == ranked[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in ranked[:3]],
                                                                               abs=1e-4)
        assert body["results"][0]["document"] == {"text": TEXTS[ranked[0]]} and body["usage"]["total_tokens"] > 0
    bare = httpx.post(f"{srv.url}/rerank", json={"query": QUERIES[0], "documents": [{"text": t} for t in TEXTS[:2]],
                                                 "return_documents": False}).json()
    assert len(bare["results"]) == 2 and "document" not in bare["results"][0]
    classified = httpx.post(f"{srv.url}/classify", json={"input": TEXTS[:2]}).json()
    assert [d["num_classes"] for d in classified["data"]] == [1, 1] and classified["data"][0]["label"] == "LABEL_0"
    cut = httpx.post(f"{srv.url}/score", json={"text_1": QUERIES[0], "text_2": TEXTS[2],
                                               "truncate_prompt_tokens": 12}).json()
    assert cut["usage"]["prompt_tokens"] == 12  # cut longest-first, as CrossEncoder cuts to its max_length
    errors = [("/v1/embeddings", {"input": "x"}, "it does not embed"),
              ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "as many of each"),
              ("/score", {"text_1": "x " * 40, "text_2": "y " * 40}, "max_model_len"),
              ("/rerank", {"query": "x", "documents": []}, "documents"),
              ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "pooling runner")]
    for route, body, message in errors:
        answer = httpx.post(f"{srv.url}{route}", json=body)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], (route, answer.text)
    assert httpx.post(f"{srv.url}/score", json={"text_1": "a", "text_2": "b"}).status_code == 200  # still serving
