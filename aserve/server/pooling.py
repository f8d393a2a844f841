"""The pooling routes, served by an engine started with runner="pooling": OpenAI's POST /v1/embeddings, vLLM's
POST /pooling, /classify and /score, and the Jina/Cohere-shaped POST /rerank."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid

from starlette.requests import Request

from aserve.pooling.params import PoolingParams
from aserve.pooling.score import cosine, pair_token_ids, pair_up
from aserve.sampling_params import SamplingParams
from aserve.server import protocol as p
from aserve.server.errors import APIError
from aserve.server.http import json_response, parse, until_disconnect
from aserve.server.openai import ServerContext

PREFIXES = {"embed": "embd", "encode": "pool", "classify": "clsf", "score": "score"}


def encode_vector(vector, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the float32 values' little-endian bytes, as OpenAI's clients decode them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().contiguous().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


async def _pool(ctx: ServerContext, request: Request, req, inputs, params: PoolingParams, keep_last: int | None):
    """Admit every input, pool each, and return their finals with the admitted prompts (usage counts them)."""
    if ctx.check_model(req.model) is not None:
        raise APIError(400, "LoRA adapters are not served by the pooling runner", "model")
    prompts = await ctx.engine.admit(inputs, SamplingParams(max_tokens=1), keep_last=keep_last)
    request_id = f"{PREFIXES[params.task]}-{uuid.uuid4().hex}"

    async def run():
        return await asyncio.gather(*(ctx.engine.encode(x, params, f"{request_id}-{i}", timeout=ctx.request_timeout)
                                      for i, x in enumerate(prompts)))

    finals = await until_disconnect(request, run())
    failed = next((out for out in finals if out.outputs.data is None), None)
    if failed is not None:
        raise APIError(500, f"request {failed.request_id} failed: {failed.error}")
    tokens = sum(len(x.token_ids) for x in prompts)
    return request_id, finals, p.EmbeddingUsage(tokens, tokens)


async def embeddings(ctx: ServerContext, request: Request):
    """OpenAI's POST /v1/embeddings."""
    req = await parse(request, p.EmbeddingRequest, ctx.max_body_bytes, ctx.body_timeout)
    params = PoolingParams(dimensions=req.dimensions, task="embed")
    request_id, finals, usage = await _pool(ctx, request, req, req.input, params, req.truncate_prompt_tokens)
    data = [p.EmbeddingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(finals)]
    return json_response(p.EmbeddingResponse(request_id, int(time.time()), ctx.model_name, data, usage))


async def pooling(ctx: ServerContext, request: Request):
    """vLLM's POST /pooling: each input's raw pooled hidden state (a classifier's logits)."""
    req = await parse(request, p.PoolingRequest, ctx.max_body_bytes, ctx.body_timeout)
    params = PoolingParams(dimensions=req.dimensions, task="encode")
    request_id, finals, usage = await _pool(ctx, request, req, req.input, params, req.truncate_prompt_tokens)
    data = [p.PoolingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(finals)]
    return json_response(p.PoolingResponse(request_id, int(time.time()), ctx.model_name, data, usage))


async def classify(ctx: ServerContext, request: Request):
    """vLLM's POST /classify: each input's label probabilities and its most probable label."""
    req = await parse(request, p.ClassificationRequest, ctx.max_body_bytes, ctx.body_timeout)
    params = PoolingParams(task="classify")
    request_id, finals, usage = await _pool(ctx, request, req, req.input, params, req.truncate_prompt_tokens)
    labels = ctx.engine.facts.pooling.labels
    data = []
    for i, out in enumerate(finals):
        probs = out.outputs.data
        data.append(p.ClassificationData(i, labels[int(probs.argmax())], probs.tolist(), len(probs)))
    return json_response(p.ClassificationResponse(request_id, int(time.time()), ctx.model_name, data, usage))


async def _scores(ctx: ServerContext, request: Request, req, pairs: list[tuple[str, str]]):
    """Each pair's score: a cross-encoder reads the pair as one input; an embedding model embeds each text once
    and scores by cosine similarity. (request id, scores, prompt tokens)."""
    spec = ctx.engine.facts.pooling
    if spec is None:
        raise APIError(400, f"{ctx.model_name} runs the generate runner: it scores nothing (start it with "
                            f"--runner pooling and a cross-encoder or an embedding model)", "model")
    if spec.labels is None:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        request_id, finals, usage = await _pool(ctx, request, req, texts, PoolingParams(task="embed"),
                                                req.truncate_prompt_tokens)
        vectors = {text: out.outputs.data for text, out in zip(texts, finals)}
        return request_id, [float(cosine(vectors[a], vectors[b])) for a, b in pairs], usage.prompt_tokens
    inputs = await ctx.engine.run_in_tokenizer_pool(pair_token_ids, ctx.engine.tokenizer, pairs,
                                                    req.truncate_prompt_tokens)
    request_id, finals, usage = await _pool(ctx, request, req, inputs, PoolingParams(task="score"), None)
    return request_id, [float(out.outputs.data[0]) for out in finals], usage.prompt_tokens


def _pairs(text_1, text_2) -> list[tuple[str, str]]:
    try:
        return pair_up(text_1, text_2)
    except ValueError as exc:
        raise APIError(400, str(exc), "text_2") from None


async def score(ctx: ServerContext, request: Request):
    """vLLM's POST /score: a relevance score for each (text_1, text_2) pair."""
    req = await parse(request, p.ScoreRequest, ctx.max_body_bytes, ctx.body_timeout)
    request_id, scores, tokens = await _scores(ctx, request, req, _pairs(req.text_1, req.text_2))
    data = [p.ScoreData(i, s) for i, s in enumerate(scores)]
    usage = p.EmbeddingUsage(tokens, tokens)
    return json_response(p.ScoreResponse(request_id, int(time.time()), ctx.model_name, data, usage))


async def rerank(ctx: ServerContext, request: Request):
    """POST /rerank (Jina's and Cohere's shape): the documents by relevance to the query, best first, the top_n."""
    req = await parse(request, p.RerankRequest, ctx.max_body_bytes, ctx.body_timeout)
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    request_id, scores, tokens = await _scores(ctx, request, req, _pairs(req.query, texts))
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [p.RerankResult(i, scores[i], p.RerankDocument(texts[i]) if req.return_documents else None)
               for i in order]
    return json_response(p.RerankResponse(request_id, ctx.model_name, p.RerankUsage(tokens), results))
