"""The HTTP app: routes, API-key guard, and the rule that no input produces a 500 or a traceback.

The server knows AsyncLLM's public API and nothing of the engine's internals.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from typing import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import aserve
from aserve.engine.async_llm import AsyncLLM
from aserve.lora import adapter
from aserve.lora.registry import LoRARegistry
from aserve.lora.request import LoRARequest
from aserve.server import constraints, openai, pooling, protocol as p
from aserve.server import ui as playground
from aserve.server.errors import APIError, error_response, from_exception, stream_error
from aserve.server.http import json_response, parse, until_disconnect
from aserve.server.openai import ServerContext
from aserve.server.openapi import build_openapi
from aserve.tool_parsers import load_tool_parser

log = logging.getLogger("aserve")

# Everything else needs the API key if one is set; /state too, since it describes the engine's internals (as in vLLM)
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")
OPEN_PATHS += playground.PATHS  # the playground page holds no secret; the key is typed into it


def route_path(scope) -> str:
    """The path without --root-path (uvicorn puts the prefix in front of the path the proxy forwarded)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyGuard:
    """ASGI middleware: Bearer token on the API routes, compared in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                      code="invalid_api_key")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def api_route(ctx: ServerContext, handler: Callable[[ServerContext, Request], Awaitable[Response]]):
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except Exception as exc:  # noqa: BLE001 - answer every input with JSON, never a traceback
            return from_exception(exc)
    return endpoint


async def health(ctx: ServerContext, request: Request) -> Response:
    if ctx.engine.is_healthy:
        dead = ctx.engine.dead_replicas
        if dead:  # data parallel: 200, since the live replicas serve (a liveness probe must not restart us), but say so
            size = ctx.engine.config.data_parallel_size
            return json_response({"status": "degraded", "replicas": size, "replicas_alive": size - len(dead),
                                  "dead_replicas": [{"replica": i, "error": why} for i, why in sorted(dead.items())]})
        return Response(status_code=200)
    return error_response(503, f"the engine core is dead: {ctx.engine.dead_error!r}")


async def version(ctx: ServerContext, request: Request) -> Response:
    return json_response(p.VersionResponse(aserve.__version__))


async def models(ctx: ServerContext, request: Request) -> Response:
    """The base model, then each adapter with its base as `parent` and its folder as `root` (vLLM's fields)."""
    engine, now = ctx.engine, int(time.time())
    cards = [p.ModelCard(ctx.model_name, now, engine.max_model_len, engine.vocab_size, root=engine.config.model)]
    for lora in (ctx.adapters.adapters.values() if ctx.adapters is not None else ()):
        cards.append(p.ModelCard(lora.lora_name, now, engine.max_model_len, engine.vocab_size, root=lora.lora_path,
                                 parent=ctx.model_name))
    return json_response(p.ModelList(cards))


async def load_lora_adapter(ctx: ServerContext, request: Request) -> Response:
    """Check the adapter against the served model, then serve it under its name (400 for one it cannot serve)."""
    req = await parse(request, p.LoadLoRAAdapterRequest, ctx.max_body_bytes, ctx.body_timeout)
    if ctx.adapters.get(req.lora_name) is not None or req.lora_name in ctx.model_aliases:
        raise APIError(400, f"The adapter `{req.lora_name}` is already loaded; unload it first.", "lora_name")
    await ctx.engine.check_lora(LoRARequest(req.lora_name, 1, req.lora_path))
    ctx.adapters.add(req.lora_name, req.lora_path)
    log.info("loaded LoRA adapter %s from %s", req.lora_name, req.lora_path)
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(ctx: ServerContext, request: Request) -> Response:
    """Forget the name; requests already running under it finish with the adapter they were admitted with."""
    req = await parse(request, p.UnloadLoRAAdapterRequest, ctx.max_body_bytes, ctx.body_timeout)
    if ctx.adapters.remove(req.lora_name) is None:
        raise APIError(404, f"The adapter `{req.lora_name}` is not loaded.", "lora_name", "model_not_found")
    log.info("unloaded LoRA adapter %s", req.lora_name)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")


async def metrics(ctx: ServerContext, request: Request) -> Response:
    return Response(generate_latest(ctx.engine.stats.prometheus.registry), media_type=CONTENT_TYPE_LATEST)


STATE_FLAGS = {"0": False, "false": False, "1": True, "true": True}


async def state(ctx: ServerContext, request: Request) -> Response:
    """The engine's counters (AsyncLLM.state); `?diagnostics=1` adds heap and Python object counts, cached."""
    flag = request.query_params.get("diagnostics", "0").lower()
    if flag not in STATE_FLAGS:
        raise APIError(400, f"diagnostics must be 0 or 1 (or false or true), got {flag!r}", param="diagnostics")
    return json_response(await ctx.engine.state(diagnostics=STATE_FLAGS[flag]))


async def tokenize(ctx: ServerContext, request: Request) -> Response:
    req = await parse(request, p.TokenizeRequest, ctx.max_body_bytes, ctx.body_timeout)
    ctx.check_model(req.model)
    tokenizer = ctx.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        ids = (await openai.chat_prompt(ctx, req.messages, req.add_generation_prompt)).token_ids
    else:
        ids = await ctx.engine.run_in_tokenizer_pool(
            lambda: tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return json_response(p.TokenizeResponse(len(ids), ctx.engine.max_model_len, ids))


async def detokenize(ctx: ServerContext, request: Request) -> Response:
    req = await parse(request, p.DetokenizeRequest, ctx.max_body_bytes, ctx.body_timeout)
    ctx.check_model(req.model)
    vocab = ctx.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range: the vocabulary has {vocab} tokens", "tokens")
    return json_response(p.DetokenizeResponse(ctx.engine.tokenizer.decode(req.tokens)))


async def generate(ctx: ServerContext, request: Request) -> Response:
    """vLLM's /generate: `{"text": [prompt + output, ...]}`; streamed as such objects, each followed by NUL."""
    req = await parse(request, p.GenerateRequest, ctx.max_body_bytes, ctx.body_timeout)
    lora = ctx.check_model(req.model)
    constraint, field = constraints.build(req)
    params = req.sampling_params(req.max_tokens, req.logprobs, default_max_tokens=16, structured_outputs=constraint)
    [prompt] = await ctx.engine.admit([req.prompt], params, field)
    prefix = prompt.text if prompt.text is not None else ctx.engine.tokenizer.decode(prompt.token_ids)

    kind = "cumulative" if req.stream else "final"

    async def outputs():
        stream = await ctx.engine.submit(prompt, None, None, req.priority, kind, ctx.request_timeout, lora)
        try:
            yield None  # admitted (see openai.started)
            async for out in stream:
                yield p.GenerateResponse([prefix + o.text for o in out.outputs])
        finally:
            stream.close()

    body = await openai.started(outputs())
    if req.stream:
        async def chunks():
            try:
                async for out in body:
                    yield msgspec.json.encode(out) + b"\0"
            except Exception as exc:  # noqa: BLE001 - the status line is sent: end with an error object
                yield msgspec.json.encode(stream_error(exc)) + b"\0"
        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def last():
        result = None
        async for result in body:
            pass
        return result
    return json_response(await until_disconnect(request, last()))


def build_app(engine: AsyncLLM, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = 8 * 1024 * 1024, root_path: str = "", *, body_timeout: float | None = 30.0,
              request_timeout: float | None = None, log_requests: bool = False,
              allowed_origins: list[str] | None = None, tool_call_parser: str | type | None = "hermes",
              ui: bool = True, lora_modules: list[LoRARequest] = (),
              allow_runtime_lora_updates: bool = False) -> Starlette:
    """The app. CORS is off unless `allowed_origins` names origins (or "*"). `tool_call_parser` (an installed
    name, module:Class, or a class; None for none) finds tool calls in the output of tool_choice "auto".
    `ui` serves the playground page at `/` (aserve.server.ui). With an engine started with enable_lora,
    `lora_modules` are served by name (each checked here: one the model cannot serve is a ValueError), and
    `allow_runtime_lora_updates` adds vLLM's load and unload routes."""
    model_name = served_model_name or engine.config.model_name
    aliases = frozenset({model_name, engine.config.model})
    parser = load_tool_parser(tool_call_parser)(engine.tokenizer) if tool_call_parser is not None else None
    adapters = LoRARegistry(aliases) if engine.config.enable_lora else None
    for lora in lora_modules:
        if adapters is None:
            raise ValueError("LoRA modules given, but the engine was started without enable_lora")
        adapter.inspect(lora, engine.facts.lora)  # a one-line refusal before the server starts
        adapters.add(lora.lora_name, lora.lora_path, lora.base_model_name)
    ctx = ServerContext(engine, model_name, aliases, max_body_bytes, body_timeout, request_timeout, log_requests,
                        parser, adapters)
    schema = msgspec.json.encode(build_openapi(root_path, api_key is not None, vocab_size=engine.vocab_size,
                                               max_model_len=engine.max_model_len, max_n=engine.facts.max_n,
                                               lora_updates=adapters is not None and allow_runtime_lora_updates))

    async def openapi_json(request: Request) -> Response:
        return Response(schema, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.shutdown()

    routes = [
        Route("/health", api_route(ctx, health), methods=["GET"]),
        Route("/version", api_route(ctx, version), methods=["GET"]),
        Route("/state", api_route(ctx, state), methods=["GET"]),
        Route("/metrics", api_route(ctx, metrics), methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/models", api_route(ctx, models), methods=["GET"]),
        Route("/v1/completions", api_route(ctx, openai.completions), methods=["POST"]),
        Route("/v1/chat/completions", api_route(ctx, openai.chat_completions), methods=["POST"]),
        Route("/tokenize", api_route(ctx, tokenize), methods=["POST"]),
        Route("/detokenize", api_route(ctx, detokenize), methods=["POST"]),
        Route("/generate", api_route(ctx, generate), methods=["POST"]),
        Route("/v1/embeddings", api_route(ctx, pooling.embeddings), methods=["POST"]),
        Route("/pooling", api_route(ctx, pooling.pooling), methods=["POST"]),
        Route("/classify", api_route(ctx, pooling.classify), methods=["POST"]),
        *(Route(path, api_route(ctx, pooling.score), methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, api_route(ctx, pooling.rerank), methods=["POST"]) for path in ("/rerank", "/v1/rerank",
                                                                                     "/v2/rerank")),
    ]
    if adapters is not None and allow_runtime_lora_updates:
        routes += [Route("/v1/load_lora_adapter", api_route(ctx, load_lora_adapter), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", api_route(ctx, unload_lora_adapter), methods=["POST"])]
    if ui:
        routes += playground.routes()

    async def not_found(request, exc):  # 404 and 405 (with its Allow header) in OpenAI's error shape
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              headers=getattr(exc, "headers", None))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.root_path = root_path
    app.add_middleware(APIKeyGuard, api_key=api_key)
    if allowed_origins:  # outermost, so preflight requests are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app
