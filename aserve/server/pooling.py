"""The pooling routes: OpenAI's POST /v1/embeddings, served by an engine started with runner="pooling"."""
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


async def embeddings(ctx: ServerContext, request: Request):
    req = await parse(request, p.EmbeddingRequest, ctx.max_body_bytes, ctx.body_timeout)
    if ctx.check_model(req.model) is not None:
        raise APIError(400, "LoRA adapters are not served by the pooling runner", "model")
    prompts = await ctx.engine.admit(req.input, SamplingParams(max_tokens=1))
    params = PoolingParams(dimensions=req.dimensions)
    request_id, created = f"embd-{uuid.uuid4().hex}", int(time.time())

    async def run():
        return await asyncio.gather(*(ctx.engine.encode(x, params, f"{request_id}-{i}", timeout=ctx.request_timeout)
                                      for i, x in enumerate(prompts)))

    finals = await until_disconnect(request, run())
    failed = next((out for out in finals if out.outputs.data is None), None)
    if failed is not None:
        raise APIError(500, f"request {failed.request_id} failed: {failed.error}")
    data = [p.EmbeddingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(finals)]
    tokens = sum(len(x.token_ids) for x in prompts)
    return json_response(p.EmbeddingResponse(request_id, created, ctx.model_name, data,
                                             p.EmbeddingUsage(tokens, tokens)))
