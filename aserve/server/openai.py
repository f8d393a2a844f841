"""The OpenAI-compatible routes: /v1/completions and /v1/chat/completions, plain and streamed (SSE)."""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

from aserve.engine.async_llm import AsyncLLM, RequestStream
from aserve.inputs import Prompt, validate_prompts
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.server import protocol as p
from aserve.server.errors import APIError, stream_error
from aserve.server.http import SSE_DONE, json_response, merge_streams, parse, sse, until_disconnect


log = logging.getLogger("aserve")


@dataclass
class ServerContext:
    engine: AsyncLLM
    model_name: str
    model_aliases: frozenset[str]
    max_body_bytes: int
    body_timeout: float | None = 30.0  # seconds a client may take to send its body
    request_timeout: float | None = None  # seconds a generation may take before it is aborted
    log_requests: bool = False  # prompts and completions go to the log only when this is set

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")


def _usage(prompts: list[Prompt], outputs: list[RequestOutput]) -> p.Usage:
    prompt_tokens = sum(len(x.token_ids) for x in prompts)
    completion_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    return p.Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def _decoded(entry: Logprob, token_id: int, tokenizer) -> str:
    return entry.decoded_token if entry.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(o: CompletionOutput, offset: int, tokenizer) -> p.CompletionLogprobs:
    result = p.CompletionLogprobs()
    for token_id, entry in zip(o.token_ids, o.logprobs or []):
        chosen = entry[token_id]
        token = _decoded(chosen, token_id, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob)
        result.top_logprobs.append({_decoded(lp, tid, tokenizer): lp.logprob for tid, lp in entry.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(o: CompletionOutput, top: int, tokenizer) -> p.ChoiceLogprobs:
    content = []
    for token_id, entry in zip(o.token_ids, o.logprobs or []):
        chosen = entry[token_id]
        token = _decoded(chosen, token_id, tokenizer)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]
        content.append(p.TokenLogprob(token, chosen.logprob, list(token.encode()),
                                      [p.TopLogprob(_decoded(lp, tid, tokenizer), lp.logprob,
                                                    list(_decoded(lp, tid, tokenizer).encode()))
                                       for tid, lp in ranked if lp.rank is not None and lp.rank <= top]))
    return p.ChoiceLogprobs(content)


async def submit_all(ctx: ServerContext, prompts: list[Prompt], params, request_id: str, priority: int,
                     kind: str) -> list[RequestStream]:
    """Hand every prompt to the engine, or none: a refusal (bad input, a full queue) closes those already in."""
    streams: list[RequestStream] = []
    try:
        for i, x in enumerate(prompts):
            streams.append(await ctx.engine.submit(x, params, f"{request_id}-{i}", priority, kind,
                                                   ctx.request_timeout))
    except BaseException:
        close_all(streams)
        raise
    if ctx.log_requests:
        log.info("request %s: %d prompt(s) %r, params %s", request_id, len(prompts),
                 [x.text if x.text is not None else x.token_ids for x in prompts], params)
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _infer_all(ctx: ServerContext, request: Request, prompts, params, request_id, priority):
    streams = await submit_all(ctx, prompts, params, request_id, priority, "final")

    async def run():
        finals = [None] * len(prompts)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return finals
    try:
        finals = await until_disconnect(request, run())
    finally:
        close_all(streams)
    log_outputs(ctx, request_id, finals)
    return finals


def log_outputs(ctx: ServerContext, request_id: str, finals: list[RequestOutput]) -> None:
    if ctx.log_requests:
        log.info("request %s finished: %r", request_id,
                 [(o.text, o.finish_reason) for out in finals for o in out.outputs])


async def started(body):
    """Run a streaming body up to its first yield (admission), so refusals still get a status code."""
    await body.__anext__()
    return body


# -- /v1/completions -----------------------------------------------------------------------------

async def completions(ctx: ServerContext, request: Request):
    req = await parse(request, p.CompletionRequest, ctx.max_body_bytes, ctx.body_timeout)
    ctx.check_model(req.model)
    params = req.sampling_params(req.max_tokens, req.logprobs, default_max_tokens=16)
    prompts = await ctx.engine.prepare_prompts(req.prompt)
    validate_prompts(ctx.engine.facts, prompts, params)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tokenizer = ctx.engine.tokenizer
    prefix = [(x.text if x.text is not None else tokenizer.decode(x.token_ids)) if req.echo else "" for x in prompts]

    if req.stream:
        body = await started(_stream_completions(ctx, req, params, prompts, prefix, request_id, created))
        return StreamingResponse(ends_with_error_event(body), media_type="text/event-stream")
    finals = await _infer_all(ctx, request, prompts, params, request_id, req.priority)
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            lp = completion_logprobs(o, len(prefix[i]), tokenizer) if req.logprobs is not None else None
            choices.append(p.CompletionChoice(i * params.n + o.index, prefix[i] + o.text, lp, o.finish_reason,
                                              o.stop_reason))
    return json_response(p.CompletionResponse(request_id, created, ctx.model_name, choices, _usage(prompts, finals)))


def ends_with_error_event(stream):
    async def guarded():
        try:
            async for chunk in stream:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - say what happened in the stream
            yield sse(stream_error(exc))
            yield SSE_DONE
    return guarded()


async def _stream_completions(ctx, req, params, prompts, prefix, request_id, created):
    finals = [RequestOutput("", None, [], []) for _ in prompts]
    streams = await submit_all(ctx, prompts, params, request_id, req.priority, "delta")
    try:
        yield b""  # admitted (see started())
        async for chunk in _completion_chunks(ctx, req, params, streams, prefix, request_id, created, finals):
            yield chunk
    finally:
        close_all(streams)
    log_outputs(ctx, request_id, finals)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(p.CompletionResponse(request_id, created, ctx.model_name, [], _usage(prompts, finals)))
    yield SSE_DONE


async def _completion_chunks(ctx, req, params, streams, prefix, request_id, created, finals):
    tokenizer = ctx.engine.tokenizer
    offsets = {}
    async for i, out in merge_streams(streams):
        finals[i].merge(out)
        choices = []
        for o in out.outputs:
            index = i * params.n + o.index
            text = o.text
            if index not in offsets:
                text = prefix[i] + text
                offsets[index] = 0
            lp = completion_logprobs(o, offsets[index], tokenizer) if req.logprobs is not None else None
            offsets[index] += len(text)
            choices.append(p.CompletionChoice(index, text, lp, o.finish_reason, o.stop_reason))
        if choices:
            yield sse(p.CompletionResponse(request_id, created, ctx.model_name, choices))


# -- /v1/chat/completions ------------------------------------------------------------------------

def message_text(message: p.ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text for part in message.content)  # the struct admits text parts only


def render_chat(tokenizer, messages: list[p.ChatMessage], add_generation_prompt: bool = True) -> str:
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    plain = [{"role": m.role, "content": message_text(m)} for m in messages]  # roles: checked by the struct
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain)  # a plain fallback template
    return text + ("assistant:" if add_generation_prompt else "")


async def chat_prompt(ctx: ServerContext, messages, add_generation_prompt: bool = True) -> Prompt:
    tokenizer = ctx.engine.tokenizer
    text = await ctx.engine.run_in_tokenizer_pool(render_chat, tokenizer, messages, add_generation_prompt)
    ids = await ctx.engine.run_in_tokenizer_pool(lambda: tokenizer.encode(text, add_special_tokens=False))
    return Prompt(text, ids)


async def chat_completions(ctx: ServerContext, request: Request):
    req = await parse(request, p.ChatCompletionRequest, ctx.max_body_bytes, ctx.body_timeout)
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = await chat_prompt(ctx, req.messages, req.add_generation_prompt)
    params = req.sampling_params(max_tokens, logprobs, default_max_tokens=None)
    validate_prompts(ctx.engine.facts, [prompt], params)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    tokenizer = ctx.engine.tokenizer
    top = req.top_logprobs or 0

    if req.stream:
        body = await started(_stream_chat(ctx, req, params, prompt, request_id, created, top))
        return StreamingResponse(ends_with_error_event(body), media_type="text/event-stream")
    final = (await _infer_all(ctx, request, [prompt], params, request_id, req.priority))[0]
    choices = [p.ChatChoice(o.index, p.AssistantMessage(content=o.text),
                            chat_logprobs(o, top, tokenizer) if req.logprobs else None, o.finish_reason, o.stop_reason)
               for o in final.outputs]
    return json_response(p.ChatCompletionResponse(request_id, created, ctx.model_name, choices,
                                                  _usage([prompt], [final])))


async def _stream_chat(ctx, req, params, prompt, request_id, created, top):
    tokenizer = ctx.engine.tokenizer
    final = RequestOutput("", None, [], [])
    streams = await submit_all(ctx, [prompt], params, request_id, req.priority, "delta")
    try:
        yield b""  # admitted (see started())
        yield sse(p.ChatCompletionChunk(request_id, created, ctx.model_name,
                                        [p.ChatChunkChoice(i, p.DeltaMessage(role="assistant", content=""))
                                         for i in range(params.n)]))
        async for _, out in merge_streams(streams):
            final.merge(out)
            choices = [p.ChatChunkChoice(o.index, p.DeltaMessage(content=o.text),
                                         chat_logprobs(o, top, tokenizer) if req.logprobs else None,
                                         o.finish_reason, o.stop_reason) for o in out.outputs]
            if choices:
                yield sse(p.ChatCompletionChunk(request_id, created, ctx.model_name, choices))
    finally:
        close_all(streams)
    log_outputs(ctx, request_id, [final])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(p.ChatCompletionChunk(request_id, created, ctx.model_name, [], _usage([prompt], [final])))
    yield SSE_DONE
