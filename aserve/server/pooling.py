"""The pooling routes, served by an engine started with runner="pooling": OpenAI's POST /v1/embeddings and vLLM's
POST /pooling."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid

from starlette.requests import Request

from aserve.pooling.params import PoolingParams
from aserve.sampling_params import SamplingParams
from aserve.server import protocol as p
from aserve.server.errors import APIError
from aserve.server.http import json_response, parse, until_disconnect
from aserve.server.openai import ServerContext


def encode_vector(vector, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the float32 values' little-endian bytes, as OpenAI's clients decode them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().contiguous().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


async def _pool(ctx: ServerContext, request: Request, req, task: str):
    """Admit every input, pool each, and return their finals with the admitted prompts (usage counts them)."""
    if ctx.check_model(req.model) is not None:
        raise APIError(400, "LoRA adapters are not served by the pooling runner", "model")
    prompts = await ctx.engine.admit(req.input, SamplingParams(max_tokens=1), keep_last=req.truncate_prompt_tokens)
    params = PoolingParams(dimensions=req.dimensions, task=task)
    request_id = f"{'embd' if task == 'embed' else 'pool'}-{uuid.uuid4().hex}"

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
    request_id, finals, usage = await _pool(ctx, request, req, "embed")
    data = [p.EmbeddingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(finals)]
    return json_response(p.EmbeddingResponse(request_id, int(time.time()), ctx.model_name, data, usage))


async def pooling(ctx: ServerContext, request: Request):
    """vLLM's POST /pooling: each input's raw pooled hidden state."""
    req = await parse(request, p.PoolingRequest, ctx.max_body_bytes, ctx.body_timeout)
    request_id, finals, usage = await _pool(ctx, request, req, "encode")
    data = [p.PoolingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(finals)]
    return json_response(p.PoolingResponse(request_id, int(time.time()), ctx.model_name, data, usage))
