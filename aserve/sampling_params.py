"""SamplingParams: vLLM's names and meanings, so a vLLM script ports by changing the import."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from aserve.errors import InvalidRequestError
from aserve.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # log-probabilities of the prompt's own tokens (+ top k); no prefix cache
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar to match
    # Filled in by the engine: the model's eos ids, which end a request unless ignore_eos.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Invalid values raise InvalidRequestError (a ValueError) naming the field as its `param`."""
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        need(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        need(self.temperature >= 0, "temperature", ">= 0 (0 means greedy)")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "0 or -1 (disabled) or an integer >= 1")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "an integer >= 1 or None")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                                      "min_tokens")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 means none)")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        need(self.seed is None or (isinstance(self.seed, int) and -2 ** 63 <= self.seed < 2 ** 63), "seed",
             "a 64-bit integer or None")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "a non-empty string or a list of them")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "a list of non-negative token ids")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None or a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed, normalized and validated like a new one."""
        return dataclasses.replace(self, **changes)
