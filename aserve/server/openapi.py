"""/openapi.json, generated from the msgspec structs the routes decode and encode, so it cannot drift.

Each route is listed once below with its request and response types; the schemas come from
`msgspec.json.schema_components`. Streaming answers are documented under their own media types.
"""
from __future__ import annotations

import msgspec

import aserve
from aserve.server import protocol as p

REF = "#/components/schemas/{name}"

# path, method, summary, request body, JSON answer, streamed media type (or None)
ROUTES = [
    ("/v1/completions", "post", "Create a completion (OpenAI)", p.CompletionRequest, p.CompletionResponse,
     "text/event-stream"),
    ("/v1/chat/completions", "post", "Create a chat completion (OpenAI)", p.ChatCompletionRequest,
     p.ChatCompletionResponse, "text/event-stream"),
    ("/v1/models", "get", "List the served model", None, p.ModelList, None),
    ("/tokenize", "post", "Tokenize a prompt or chat messages", p.TokenizeRequest, p.TokenizeResponse, None),
    ("/detokenize", "post", "Turn token ids back into text", p.DetokenizeRequest, p.DetokenizeResponse, None),
    ("/generate", "post", "vLLM's /generate: prompt + output text, streamed as NUL-terminated JSON objects",
     p.GenerateRequest, p.GenerateResponse, "application/octet-stream"),
    ("/version", "get", "The server's version", None, p.VersionResponse, None),
    ("/v1/embeddings", "post", "Create embeddings (OpenAI; a model served with --runner pooling)",
     p.EmbeddingRequest, p.EmbeddingResponse, None),
    ("/pooling", "post", "vLLM's /pooling: each input's raw pooled hidden state", p.PoolingRequest, p.PoolingResponse,
     None),
    ("/classify", "post", "vLLM's /classify: each input's label probabilities (a classification model)",
     p.ClassificationRequest, p.ClassificationResponse, None),
    ("/score", "post", "vLLM's /score: a relevance score per text pair (a cross-encoder, or an embedding model's "
     "cosine similarity); also at /v1/score", p.ScoreRequest, p.ScoreResponse, None),
    ("/rerank", "post", "Documents ranked by relevance to a query, Jina's and Cohere's shape; also at /v1/rerank and "
     "/v2/rerank", p.RerankRequest, p.RerankResponse, None),
]
ERRORS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model", 413: "Body too large",
          408: "The body was not sent in time", 499: "The client went away",
          500: "This request failed while generating (the server goes on)",
          503: "The engine is dead or the server is overloaded (see Retry-After)", 504: "The request timed out"}
STREAMED = {  # what stream=true answers: each SSE event's data is a chunk as JSON, the last one [DONE]
    "text/event-stream": {"type": "object", "required": ["data"], "description": "one server-sent event",
                          "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}}},
    "application/octet-stream": {"type": "string",
                                 "description": "GenerateResponse objects as JSON, each followed by a NUL byte"}}
API_ERRORS = (400, 401, 404, 408, 413, 499, 500, 503, 504)


def narrow(node, maxima: dict[str, int]) -> None:
    """Set the upper bound of every integer schema titled in `maxima` (token ids, max tokens, samples) to
    what this server accepts, so generated clients and fuzzers see the real limits."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("title") in maxima:
            node["maximum"] = maxima[node["title"]]
        for value in node.values():
            narrow(value, maxima)
    elif isinstance(node, list):
        for value in node:
            narrow(value, maxima)


# vLLM's run-time adapter routes (--allow-runtime-lora-updates): path, summary, request body; they answer text
LORA_ROUTES = [("/v1/load_lora_adapter", "Load a LoRA adapter and serve it under its name", p.LoadLoRAAdapterRequest),
               ("/v1/unload_lora_adapter", "Stop serving a LoRA adapter (requests running under it finish)",
                p.UnloadLoRAAdapterRequest)]


def build_openapi(root_path: str = "", api_key: bool = False, *, vocab_size: int | None = None,
                  max_model_len: int | None = None, max_n: int | None = None, lora_updates: bool = False) -> dict:
    lora_routes = LORA_ROUTES if lora_updates else []
    types = ([t for route in ROUTES for t in route[3:5] if t is not None] + [body for _, _, body in lora_routes]
             + [p.ErrorResponse])
    (*refs,), components = msgspec.json.schema_components(types, ref_template=REF)
    maxima = {"token id": vocab_size and vocab_size - 1, "max tokens": max_model_len and max_model_len - 1,
              "samples": max_n}
    narrow(components, {k: v for k, v in maxima.items() if v})
    error = {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}
    paths: dict = {}
    for path, method, summary, body, answer, streamed in ROUTES:
        content = {"application/json": {"schema": {"$ref": REF.format(name=answer.__name__)}}}
        if streamed:
            content[streamed] = {"schema": STREAMED[streamed]}
        operation = {"summary": summary, "responses": {"200": {"description": "OK", "content": content}}}
        for status in API_ERRORS if body is not None else (401, 503):
            operation["responses"][str(status)] = {"description": ERRORS[status], "content": error}
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": REF.format(name=body.__name__)}}}}
        if api_key:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = operation
    for path, summary, body in lora_routes:
        operation = {"summary": summary, "responses": {"200": {"description": "OK", "content": {
            "text/plain": {"schema": {"type": "string"}}}}}, "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": REF.format(name=body.__name__)}}}}}
        for status in (400, 401, 404, 413):
            operation["responses"][str(status)] = {"description": ERRORS[status], "content": error}
        if api_key:
            operation["security"] = [{"bearer": []}]
        paths[path] = {"post": operation}
    paths["/health"] = {"get": {"summary": "200 while the engine is alive", "responses": {
        "200": {"description": "healthy"}, "503": {"description": "the engine core died", "content": error}}}}
    doc = {"openapi": "3.1.0", "info": {"title": "aserve", "version": aserve.__version__},
           "paths": paths, "components": {"schemas": components}}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc
