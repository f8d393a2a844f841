"""The OpenAI-compatible routes: /v1/completions and /v1/chat/completions, plain and streamed (SSE)."""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

from aserve.engine.async_llm import AsyncLLM, RequestStream
from aserve.inputs import Admitted, Prompt
from aserve.lora.registry import LoRARegistry
from aserve.lora.request import LoRARequest
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.server import constraints, protocol as p, tools
from aserve.server.errors import APIError, stream_error
from aserve.server.http import SSE_DONE, json_response, merge_streams, parse, sse, until_disconnect
from aserve.structured_output import StructuredOutputsParams
from aserve.tool_parsers import ToolParser


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
    tool_parser: ToolParser | None = None  # finds the calls in outputs of tool_choice "auto" (--tool-call-parser)
    adapters: LoRARegistry | None = None  # with --enable-lora: the adapters a request may name in `model`

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter `name` picks (None: the base model); an unknown name is a 404 in OpenAI's shape."""
        if name is None or name in self.model_aliases:
            return None
        lora = self.adapters.get(name) if self.adapters is not None else None
        if lora is None:
            served = [self.model_name, *(self.adapters.adapters if self.adapters is not None else ())]
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(f'`{m}`' for m in served)}.", "model", "model_not_found")
        return lora

    def served_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's when one ran, else the base model's."""
        return lora.lora_name if lora is not None else self.model_name


def _usage(prompts: list[Admitted], outputs: list[RequestOutput]) -> p.Usage:
    prompt_tokens = sum(len(x.token_ids) for x in prompts)
    completion_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    return p.Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                   p.PromptTokensDetails(cached_tokens=cached))


def _continuous(req) -> bool:
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def _decoded(entry: Logprob, token_id: int, tokenizer) -> str:
    return entry.decoded_token if entry.decoded_token is not None else tokenizer.decode([token_id])


# JSON has no -inf (msgspec writes it as null, off the schema): a token the step ruled out (a grammar's mask, a
# penalty that overflowed) reports this floor instead, as vLLM's OpenAI server does. NaN, never sampled, too.
LOGPROB_FLOOR = -9999.0


def _reported(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(o: CompletionOutput, offset: int, tokenizer) -> p.CompletionLogprobs:
    result = p.CompletionLogprobs()
    for token_id, entry in zip(o.token_ids, o.logprobs or []):
        chosen = entry[token_id]
        token = _decoded(chosen, token_id, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(_reported(chosen.logprob))
        result.top_logprobs.append({_decoded(lp, tid, tokenizer): _reported(lp.logprob) for tid, lp in entry.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(o: CompletionOutput, top: int, tokenizer) -> p.ChoiceLogprobs:
    content = []
    for token_id, entry in zip(o.token_ids, o.logprobs or []):
        chosen = entry[token_id]
        token = _decoded(chosen, token_id, tokenizer)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]
        content.append(p.TokenLogprob(token, _reported(chosen.logprob), list(token.encode()),
                                      [p.TopLogprob(_decoded(lp, tid, tokenizer), _reported(lp.logprob),
                                                    list(_decoded(lp, tid, tokenizer).encode()))
                                       for tid, lp in ranked if lp.rank is not None and lp.rank <= top]))
    return p.ChoiceLogprobs(content)


async def submit_all(ctx: ServerContext, prompts: list[Admitted], request_id: str, priority: int,
                     kind: str, lora: LoRARequest | None = None) -> list[RequestStream]:
    """Hand every admitted prompt to the engine, or none: a refusal (a full queue) closes those already in."""
    streams: list[RequestStream] = []
    try:
        for i, x in enumerate(prompts):
            streams.append(await ctx.engine.submit(x, None, f"{request_id}-{i}", priority, kind, ctx.request_timeout,
                                                   lora))
    except BaseException:
        close_all(streams)
        raise
    if ctx.log_requests:
        log.info("request %s: %d prompt(s) %r, params %s", request_id, len(prompts),
                 [x.text if x.text is not None else x.token_ids for x in prompts], prompts[0].params)
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _infer_all(ctx: ServerContext, request: Request, prompts: list[Admitted], request_id, priority, lora):
    streams = await submit_all(ctx, prompts, request_id, priority, "final", lora)

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
    lora = ctx.check_model(req.model)
    constraint, field = constraints.build(req)
    params = req.sampling_params(req.max_tokens, req.logprobs, default_max_tokens=16, structured_outputs=constraint)
    prompts = await ctx.engine.admit(req.prompt, params, field)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tokenizer = ctx.engine.tokenizer
    prefix = [(x.text if x.text is not None else tokenizer.decode(x.token_ids)) if req.echo else "" for x in prompts]

    if req.stream:
        body = await started(_stream_completions(ctx, req, params, prompts, prefix, request_id, created, lora))
        return StreamingResponse(ends_with_error_event(body), media_type="text/event-stream")
    finals = await _infer_all(ctx, request, prompts, request_id, req.priority, lora)
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            lp = completion_logprobs(o, len(prefix[i]), tokenizer) if req.logprobs is not None else None
            choices.append(p.CompletionChoice(i * params.num_outputs + o.index, prefix[i] + o.text, lp, o.finish_reason,
                                              o.stop_reason))
    return json_response(p.CompletionResponse(request_id, created, ctx.served_name(lora), choices,
                                              _usage(prompts, finals)))


def ends_with_error_event(stream):
    async def guarded():
        try:
            async for chunk in stream:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - say what happened in the stream
            yield sse(stream_error(exc))
            yield SSE_DONE
    return guarded()


async def _stream_completions(ctx, req, params, prompts, prefix, request_id, created, lora):
    finals = [RequestOutput("", None, [], []) for _ in prompts]
    streams = await submit_all(ctx, prompts, request_id, req.priority, "delta", lora)
    model = ctx.served_name(lora)
    try:
        yield b""  # admitted (see started())
        async for chunk in _completion_chunks(ctx, req, params, streams, prompts, prefix, request_id, created,
                                              model, finals):
            yield chunk
    finally:
        close_all(streams)
    log_outputs(ctx, request_id, finals)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(p.CompletionResponse(request_id, created, model, [], _usage(prompts, finals)))
    yield SSE_DONE


async def _completion_chunks(ctx, req, params, streams, prompts, prefix, request_id, created, model, finals):
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
            usage = _usage(prompts, finals) if _continuous(req) else None
            yield sse(p.CompletionResponse(request_id, created, model, choices, usage))


# -- /v1/chat/completions ------------------------------------------------------------------------

def message_text(message: p.ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text for part in message.content)  # the struct admits text parts only


def _arguments(text: str):
    """A call's arguments as templates expect them: the object itself (they render it), else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_message(m: p.ChatMessage) -> dict:
    """A message as chat templates read it: role and content, an assistant's tool calls, a tool result's id."""
    out = {"role": m.role, "content": message_text(m)}  # roles: checked by the struct
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def render_chat(tokenizer, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                tool_defs: list[dict] | None = None) -> str:
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    plain = [template_message(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(plain, tools=tool_defs, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain)  # a plain fallback template
    return text + ("assistant:" if add_generation_prompt else "")


def encode_chat(tokenizer, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                tool_defs: list[dict] | None = None) -> Prompt:
    """The conversation rendered by the chat template and encoded (the template writes the special tokens)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, tool_defs)
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


async def chat_prompt(ctx: ServerContext, messages, add_generation_prompt: bool = True,
                      tool_defs: list[dict] | None = None) -> Prompt:
    """The conversation as a prompt, rendered and encoded in one hop off the event loop."""
    return await ctx.engine.run_in_tokenizer_pool(encode_chat, ctx.engine.tokenizer, messages, add_generation_prompt,
                                                  tool_defs)


def chat_constraint(req: p.ChatCompletionRequest,
                    tool_plan: tools.ToolPlan | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint and the field it came in: the tools' grammar for tool_choice required or named,
    else the request's own. Admission checks that it compiles."""
    asked = constraints.build(req)
    forced = tool_plan.constraint() if tool_plan is not None else None
    if forced is None:
        return asked
    if asked[0] is not None:
        raise APIError(400, "tool_choice required or a named function cannot be combined with another output "
                            "constraint", "tool_choice")
    return forced, "tools"


def chat_message(o: CompletionOutput, tool_plan: tools.ToolPlan | None) -> tuple[p.AssistantMessage, str | None]:
    """A finished sample as the assistant's message (its tool calls parsed out) and its finish reason."""
    if tool_plan is None:
        return p.AssistantMessage(content=o.text), o.finish_reason
    parsed = tool_plan.parse(o.text)
    calls = tools.tool_calls(parsed.calls)
    return (p.AssistantMessage(content=parsed.content, tool_calls=calls or None),
            tools.finish_reason(o.finish_reason, bool(calls)))


async def chat_completions(ctx: ServerContext, request: Request):
    req = await parse(request, p.ChatCompletionRequest, ctx.max_body_bytes, ctx.body_timeout)
    lora = ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tool_plan = tools.plan(req, ctx.tool_parser)
    constraint, field = chat_constraint(req, tool_plan)
    params = req.sampling_params(max_tokens, logprobs, default_max_tokens=None, structured_outputs=constraint)
    chat = await chat_prompt(ctx, req.messages, req.add_generation_prompt,
                             tool_plan.template_tools() if tool_plan is not None else None)
    [prompt] = await ctx.engine.admit(chat, params, field)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    tokenizer = ctx.engine.tokenizer
    top = req.top_logprobs or 0

    if req.stream:
        body = await started(_stream_chat(ctx, req, params, prompt, request_id, created, top, tool_plan, lora))
        return StreamingResponse(ends_with_error_event(body), media_type="text/event-stream")
    final = (await _infer_all(ctx, request, [prompt], request_id, req.priority, lora))[0]
    choices = []
    for o in final.outputs:
        message, finish_reason = chat_message(o, tool_plan)
        choices.append(p.ChatChoice(o.index, message, chat_logprobs(o, top, tokenizer) if req.logprobs else None,
                                    finish_reason, o.stop_reason))
    return json_response(p.ChatCompletionResponse(request_id, created, ctx.served_name(lora), choices,
                                                  _usage([prompt], [final])))


def _chunk_choice(o: CompletionOutput, tool_streams: dict, tool_plan, logprobs) -> p.ChatChunkChoice | None:
    """One sample's delta as a chunk choice (None when it has nothing to say yet)."""
    if tool_plan is None:
        return p.ChatChunkChoice(o.index, p.DeltaMessage(content=o.text), logprobs, o.finish_reason, o.stop_reason)
    stream = tool_streams.setdefault(o.index, tool_plan.stream())
    content, calls = stream.feed(o.text, o.finish_reason is not None)
    if content is None and not calls and o.finish_reason is None and logprobs is None:
        return None
    return p.ChatChunkChoice(o.index, p.DeltaMessage(content=content, tool_calls=calls or None), logprobs,
                             tools.finish_reason(o.finish_reason, stream.num_calls > 0), o.stop_reason)


async def _stream_chat(ctx, req, params, prompt, request_id, created, top, tool_plan, lora):
    tokenizer = ctx.engine.tokenizer
    final = RequestOutput("", None, [], [])
    tool_streams: dict[int, tools.ToolStream] = {}
    streams = await submit_all(ctx, [prompt], request_id, req.priority, "delta", lora)
    model = ctx.served_name(lora)
    try:
        yield b""  # admitted (see started())
        yield sse(p.ChatCompletionChunk(request_id, created, model,
                                        [p.ChatChunkChoice(i, p.DeltaMessage(role="assistant", content=""))
                                         for i in range(params.n)]))
        async for _, out in merge_streams(streams):
            final.merge(out)
            choices = [_chunk_choice(o, tool_streams, tool_plan, chat_logprobs(o, top, tokenizer) if req.logprobs
                                     else None) for o in out.outputs]
            choices = [c for c in choices if c is not None]
            if choices:
                usage = _usage([prompt], [final]) if _continuous(req) else None
                yield sse(p.ChatCompletionChunk(request_id, created, model, choices, usage))
    finally:
        close_all(streams)
    log_outputs(ctx, request_id, [final])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(p.ChatCompletionChunk(request_id, created, model, [], _usage([prompt], [final])))
    yield SSE_DONE
