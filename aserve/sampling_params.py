"""SamplingParams: vLLM's names and meanings, so a vLLM script ports by changing the import."""
from __future__ import annotations

import dataclasses
import math
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
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to those tokens' logits, each in [-100, 100]
    # Filled in by the engine: the model's eos ids, which end a request unless ignore_eos.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    # Set by BeamSearchParams.sampling_params(): the request runs as a beam search (see core/beam_search.py);
    # its rows return their best next tokens and the engine, not the sampler, picks what each beam appends.
    beam: "BeamSearchParams | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
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
        need(self.logit_bias is None or all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
            and not isinstance(b, bool) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
            "logit_bias", "a map of token ids to biases in [-100, 100]")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None or a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_ids(self) -> frozenset[int]:
        """The token ids that end a sequence: stop_token_ids, and eos unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else self.eos_token_ids)

    @property
    def beam_candidates(self) -> int:
        """How many next tokens a beam-search row brings (0 for other rows): transformers' K, max(2, 1 + stop ids)
        x beam_width, so that beam_width candidates remain to continue after those that stop are set aside (eos
        stops a constrained beam whose grammar it completes, even with ignore_eos)."""
        if self.beam is None:
            return 0
        stops = self.stop_ids | (self.eos_token_ids if self.structured_outputs is not None else frozenset())
        return max(2, 1 + len(stops)) * self.beam.beam_width

    @property
    def num_outputs(self) -> int:
        """How many outputs a prompt gets: n samples, or a beam search's beam_width hypotheses."""
        return self.beam.beam_width if self.beam is not None else self.n

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed, normalized and validated like a new one."""
        return dataclasses.replace(self, **changes)



@dataclass
class BeamSearchParams:
    """Beam search, with vLLM's names (`LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=64))`)
    and transformers' algorithm and meanings: a hypothesis scores cum_logprob / generated_length **
    length_penalty, and `early_stopping` is transformers' (False: stop once no running beam can beat the
    worst kept hypothesis at its current length; True: stop as soon as beam_width hypotheses are done;
    "never": only when no running beam can improve at its longest possible length)."""
    beam_width: int
    max_tokens: int | None  # None: up to max_model_len
    ignore_eos: bool = False
    temperature: float = 0.0  # > 0 scores the log-probabilities of logits / temperature
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # every beam stays within it (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        need(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool) and self.beam_width >= 1,
             "beam_width", "an integer >= 1")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                                         and self.max_tokens >= 1), "max_tokens", "an integer >= 1 or None")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", ">= 0")
        need(isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty),
             "length_penalty", "a finite number")
        need(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
             'True, False or "never"')
        self.sampling_params()  # stop and stop_token_ids are checked as SamplingParams checks them

    def sampling_params(self) -> SamplingParams:
        """What the engine runs each beam with: its stop conditions and max_tokens, greedy rows that bring their
        candidates (`beam`)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos,
                              stop=self.stop, stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              structured_outputs=self.structured_outputs, beam=self)
