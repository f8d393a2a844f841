"""Request and response bodies of the HTTP API, as msgspec structs (OpenAI's shapes plus vLLM's extras).

Decoding a body validates its types; value ranges are checked by SamplingParams, so one rule set serves
the offline and online APIs.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from aserve.errors import InvalidRequestError
from aserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

# Bounds on numbers, so a JSON body cannot carry a 300-digit integer into the engine (msgspec's ints are
# unbounded); they appear in /openapi.json too. Finer limits (max_n, max_model_len) are the engine's.
Int32 = Annotated[int, Meta(ge=-(2 ** 31), le=2 ** 31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2 ** 31 - 1)]
Positive = Annotated[int, Meta(ge=1, le=2 ** 31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2 ** 31 - 1, title="token id")]  # /openapi.json narrows these to the
MaxTokens = Annotated[int, Meta(ge=1, le=2 ** 31 - 1, title="max tokens")]  # served model's vocab, length
NumSamples = Annotated[int, Meta(ge=1, le=2 ** 31 - 1, title="samples")]  # and max_n
NonEmpty = Meta(min_length=1)
Seed = Annotated[int, Meta(ge=-(2 ** 63), le=2 ** 63 - 1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`."""
    name: str = "response"
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` object: exactly one of json, json_object, regex, choice and grammar (EBNF)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False  # free whitespace between JSON tokens (default: ", " and ": " only)


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by every generation route; names and defaults as in vLLM's OpenAI server."""
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    n: NumSamples = 1
    stop: Annotated[str, NonEmpty] | list[Annotated[str, NonEmpty]] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None  # token id (as a string) -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Annotated[int, Meta(ge=-1, le=2 ** 31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    min_tokens: Count = 0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int32 = 0
    # structured output: OpenAI's response_format, vLLM's guided_* extras and its newer structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # beam search, as vLLM's extras: n beams, n choices back, best first
    use_beam_search: bool = False
    length_penalty: Annotated[float, Meta(ge=-1e6, le=1e6)] = 1.0
    early_stopping: bool | Literal["never"] = False  # transformers' meaning (see BeamSearchParams)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None,
                        structured_outputs=None):
        if self.use_beam_search:
            return self.beam_search_params(max_tokens if max_tokens is not None else default_max_tokens, logprobs,
                                           structured_outputs).sampling_params()
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=structured_outputs,
            logit_bias=self._logit_bias())

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON keys, so strings: each must be a whole number."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def beam_search_params(self, max_tokens: int | None, logprobs: int | None, structured_outputs) -> BeamSearchParams:
        """use_beam_search: the request as a beam search of n beams; a field it cannot honour is refused by name."""
        if self.stream:
            raise InvalidRequestError("use_beam_search cannot stream: a beam search knows its answer only when it "
                                      "ends; send stream=false", "stream")
        unsupported = {"top_p": self.top_p not in (None, 1.0), "top_k": self.top_k not in (None, 0, -1),
                       "min_p": self.min_p != 0, "seed": self.seed is not None, "min_tokens": self.min_tokens != 0,
                       "presence_penalty": self.presence_penalty != 0,
                       "frequency_penalty": self.frequency_penalty != 0,
                       "repetition_penalty": self.repetition_penalty != 1, "logprobs": logprobs is not None,
                       "logit_bias": bool(self.logit_bias)}
        for name, given in unsupported.items():
            if given:
                raise InvalidRequestError(f"{name} cannot be used with use_beam_search: beam search keeps the "
                                          f"most likely continuations and samples nothing", name)
        return BeamSearchParams(self.n, max_tokens, ignore_eos=self.ignore_eos,
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                early_stopping=self.early_stopping, stop=self.stop,
                                stop_token_ids=self.stop_token_ids, skip_special_tokens=self.skip_special_tokens,
                                structured_outputs=structured_outputs)


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: Annotated[str, NonEmpty] | Annotated[list[Annotated[str, NonEmpty] | TokenId | Annotated[list[TokenId], NonEmpty]], NonEmpty]
    logprobs: TopLogprobs | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]  # images and audio are not served
    text: str


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: Annotated[str, NonEmpty]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: FunctionName
    type: Literal["function"] = "function"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], NonEmpty]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True


class GenerateRequest(SamplingFields, kw_only=True):
    """vLLM's /generate: a prompt plus SamplingParams fields; max_tokens defaults to 16 as there."""
    prompt: Annotated[str, NonEmpty] | Annotated[list[TokenId], NonEmpty]
    logprobs: TopLogprobs | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ------------------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class PooledInputs(msgspec.Struct, kw_only=True):
    """What the pooling routes share: `input` is a string, strings, token ids, or lists of token ids."""
    input: (Annotated[str, NonEmpty]
            | Annotated[list[Annotated[str, NonEmpty] | TokenId | Annotated[list[TokenId], NonEmpty]], NonEmpty])
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1)] | None = None  # vLLM's: keep each input's last N tokens


class EmbeddingRequest(PooledInputs, kw_only=True):
    """OpenAI's POST /v1/embeddings."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None


class ClassificationRequest(PooledInputs, kw_only=True):
    """vLLM's POST /classify: each input's label probabilities (a *ForSequenceClassification model)."""


class ClassificationData(msgspec.Struct):
    index: int
    label: str  # the most probable label (config.json's id2label)
    probs: list[float]
    num_classes: int
    object: str = "classify"


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: "EmbeddingUsage"
    object: str = "list"


Texts = Annotated[str, NonEmpty] | Annotated[list[Annotated[str, NonEmpty]], NonEmpty]


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /score: text_1 against each text_2 (or pairwise when both are lists of one length)."""
    text_1: Texts
    text_2: Texts
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1)] | None = None  # each pair cut longest-first to N tokens


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: "EmbeddingUsage"
    object: str = "list"


class RerankDocument(msgspec.Struct):
    text: Annotated[str, NonEmpty]


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /rerank (also /v1/rerank, /v2/rerank), Jina's and Cohere's shape: `documents` ranked by relevance to
    `query`; `top_n` keeps the best N (None or 0: all)."""
    query: Annotated[str, NonEmpty]
    documents: Annotated[list[Annotated[str, NonEmpty] | RerankDocument], NonEmpty]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] | None = None
    return_documents: bool = True
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1)] | None = None


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int  # the document's place in the request
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """vLLM's POST /pooling: the raw pooled hidden state of each input (no cut, no normalization)."""


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: "EmbeddingUsage"
    object: str = "list"


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float]] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of a tool call in a stream: the first piece of a call has its id, type and name; the
    arguments text follows in pieces, which a client appends by `index`."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class GenerateResponse(msgspec.Struct):
    """/generate's answer (and, streamed, each NUL-terminated object): prompt + output text per sample."""
    text: list[str]


class VersionResponse(msgspec.Struct):
    version: str


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    vocab_size: int | None = None  # aserve's extra: lets `aserve bench serve` draw valid random token ids
    object: str = "model"
    owned_by: str = "aserve"
    root: str | None = None  # the model's folder; an adapter's own folder
    parent: str | None = None  # an adapter's base model (None for the base model itself)


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter."""
    lora_name: Annotated[str, NonEmpty]
    lora_path: Annotated[str, NonEmpty]


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter (`lora_int_id` is accepted and ignored: the name decides)."""
    lora_name: Annotated[str, NonEmpty]
    lora_int_id: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
