"""Prompts and requests on their way in: one normalization and one admission, shared by LLM, AsyncLLM
and the server, so a prompt means the same everywhere and a bad one gets the same error (with the
offending field as `param`) whichever door it came through.

Admission (`admit_prompts`) is the front end's only check: tokenize, validate, check the output
constraint, once per request. What it returns (`Admitted`) goes to the core unchecked on this side; the
core's own `validate_request` stays the authoritative check for those who drive EngineCore directly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from aserve.errors import InvalidRequestError
from aserve.lora.request import LoRAFacts
from aserve.structured_output.grammar import check as check_constraint

if TYPE_CHECKING:
    from aserve.pooling.params import PoolingSpec
    from aserve.sampling_params import SamplingParams

@dataclass(frozen=True)
class EngineFacts:
    """What is fixed once the engine is up: enough to reject a request without asking the core."""
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    num_host_blocks: int = 0
    policy_name: str = ""
    priority_classes: bool = False
    max_n: int = 32
    kv_cache_dtype: str = ""  # the cache's storage: the model's dtype, or fp8_e4m3 / fp8_e5m2
    lora: LoRAFacts | None = None  # with enable_lora: what adapters are checked against
    pooling: PoolingSpec | None = None  # the pooling runner's PoolingSpec (labels for a classifier); None: the generate runner
    max_beam_width: int = 32  # a search's beams decode in one step: min(max_n, max_num_seqs, max_num_batched_tokens)


PROMPT_FORMS = "a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids'"


@dataclass
class Prompt:
    """One prompt: its text (None when it came as token ids) and its token ids (None until tokenized)."""
    text: str | None
    token_ids: list[int] | None = None


def _is_token_ids(value) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def parse_prompt(item) -> Prompt:
    """One prompt in any accepted form: a string, token ids, {"prompt": str} or {"prompt_token_ids": [...]}."""
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(item)
    if isinstance(item, dict):
        if "prompt_token_ids" in item and _is_token_ids(item["prompt_token_ids"]):
            return Prompt(item.get("prompt"), list(item["prompt_token_ids"]))
        if "prompt_token_ids" not in item and isinstance(item.get("prompt"), str):
            return Prompt(item["prompt"])
    elif _is_token_ids(item):
        return Prompt(None, list(item))
    raise InvalidRequestError(f"a prompt must be {PROMPT_FORMS}, got {type(item).__name__}", "prompt")


def parse_prompts(raw) -> list[Prompt]:
    """One prompt or a batch: a string, token ids or a dict is one prompt; a list of them is a batch."""
    if isinstance(raw, (str, dict, Prompt)) or (_is_token_ids(raw) and raw):
        return [parse_prompt(raw)]
    if isinstance(raw, Sequence):
        return [parse_prompt(item) for item in raw]
    raise InvalidRequestError(f"a prompt must be {PROMPT_FORMS}, or a list of them; got {type(raw).__name__}",
                              "prompt")


def tokenize(prompts: list[Prompt], encode: Callable[[str], list[int]]) -> list[Prompt]:
    """Fill in the token ids of the prompts that came as text."""
    for prompt in prompts:
        if prompt.token_ids is None:
            prompt.token_ids = list(encode(prompt.text))
    return prompts


def validate_request(facts: EngineFacts, prompt_token_ids: list[int], params: "SamplingParams") -> int:
    """Raise InvalidRequestError for a request the engine could never serve; return its max_tokens."""
    if params.n > facts.max_n:
        raise InvalidRequestError(f"n must be at most {facts.max_n} on this server (max_n), got {params.n}", "n")
    width = params.beam.beam_width if params.beam is not None else 1
    if width > facts.max_beam_width:
        raise InvalidRequestError(f"beam_width must be at most {facts.max_beam_width} on this server (max_n, "
                                  f"max_num_seqs, max_num_batched_tokens), got {width}", "beam_width")
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty: it must contain at least one token", "prompt")
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad!r} is out of range: the vocabulary has {facts.vocab_size} "
                                  f"tokens (ids 0..{facts.vocab_size - 1})", "prompt")
    bad = next((t for t in params.logit_bias or () if t >= facts.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"logit_bias token id {bad} is out of range: the vocabulary has {facts.vocab_size} "
                                  f"tokens (ids 0..{facts.vocab_size - 1})", "logit_bias")
    if num_prompt >= facts.max_model_len:
        raise InvalidRequestError(f"the prompt has {num_prompt} tokens, but max_model_len is {facts.max_model_len}: "
                                  f"it must be shorter, to leave room for at least one output token", "prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else facts.max_model_len - num_prompt
    if num_prompt + max_tokens > facts.max_model_len:
        raise InvalidRequestError(f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds "
                                  f"max_model_len ({facts.max_model_len}); lower max_tokens or shorten the prompt",
                                  "max_tokens")
    blocks = -(-(num_prompt + max_tokens) // facts.block_size)
    beams = ""
    if width > 1:  # beams share the prompt's full blocks; each may need the rest for itself, and a copy on write
        shared = num_prompt // facts.block_size
        together = shared + width * (blocks - shared + 1)
        if facts.num_host_blocks >= together:  # preempted, the search is swapped out and back, still shared
            blocks, beams = together, f" in each of {width} beams"
        else:  # or recomputed, each beam with its own copy of the prompt (Scheduler._recompute_fits)
            blocks, beams = width * blocks, f" in each of {width} beams, each with its own copy of the prompt " \
                                            f"(no host swap pool to keep them shared through a preemption)"
    if blocks > facts.num_blocks:
        raise InvalidRequestError(f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}){beams} needs "
                                  f"{blocks} KV blocks, but the whole cache has {facts.num_blocks}; raise "
                                  f"kv_cache_memory", "max_tokens")
    return max_tokens


def validate_prompts(facts: EngineFacts, prompts: list[Prompt],
                     params: "SamplingParams | Sequence[SamplingParams]") -> None:
    """Check every prompt of a batch before any is queued, so one bad prompt never leaves half a batch
    behind; in a batch of several, the error says which prompt."""
    per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    for i, (prompt, sp) in enumerate(zip(prompts, per_prompt)):
        try:
            validate_request(facts, prompt.token_ids, sp)
        except InvalidRequestError as exc:
            if len(prompts) == 1:
                raise
            raise InvalidRequestError(f"prompt {i}: {exc}", exc.param) from None


@dataclass(frozen=True)
class Admitted:
    """One prompt that passed admission, with the sampling params it was admitted under: the front end
    hands it to the core as it is, checking nothing again."""
    text: str | None  # None when the prompt came as token ids
    token_ids: list[int]
    params: "SamplingParams"


def admit_prompts(facts: EngineFacts, prompts: list[Prompt], params: "SamplingParams | Sequence[SamplingParams]",
                  encode: Callable[[str], list[int]], constraint_field: str = "structured_outputs",
                  keep_last: int | None = None) -> list[Admitted]:
    """Admit a batch: tokenize the prompts that came as text, validate every prompt, and check each distinct
    output constraint once (an error names `constraint_field`, the request field it came in). Raises
    InvalidRequestError before anything is queued; the caller runs it off the event loop when it encodes
    text or checks a constraint (parsing a schema may take a while). `keep_last`: cut each prompt to its last
    tokens first (pooling's truncate_prompt_tokens)."""
    per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    tokenize(prompts, encode)
    if keep_last is not None:
        for prompt in prompts:
            prompt.token_ids = prompt.token_ids[-keep_last:]
    validate_prompts(facts, prompts, per_prompt)
    for constraint in {id(sp.structured_outputs): sp.structured_outputs for sp in per_prompt}.values():
        if constraint is not None:
            check_constraint(constraint, constraint_field)
    return [Admitted(prompt.text, prompt.token_ids, sp) for prompt, sp in zip(prompts, per_prompt)]

