"""What the engine hands back, shaped like vLLM's: RequestOutput and CompletionOutput for generation,
PoolingRequestOutput and EmbeddingRequestOutput for pooling models."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong for this sample

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's shape: None for the first token
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None until admitted)

    def merge(self, newer: "RequestOutput") -> None:
        """Fold a later delta into this one (what a slow consumer's collector does instead of queueing)."""
        by_index = {o.index: o for o in self.outputs}
        for new in newer.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason, old.error = new.finish_reason, new.stop_reason, new.error
        self.outputs.sort(key=lambda o: o.index)
        self.finished = newer.finished
        self.metrics = newer.metrics or self.metrics
        if newer.num_cached_tokens is not None:
            self.num_cached_tokens = newer.num_cached_tokens

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"outputs={self.outputs}, finished={self.finished})")


@dataclass
class BeamSearchSequence:
    """One hypothesis of `LLM.beam_search`, with vLLM's names: `tokens` and `text` include the prompt."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]  # one entry per generated token: its log-probability
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos or a stop token), "length" (max_tokens), "abort"
    stop_reason: int | str | None = None
    score: float = 0.0  # cum_logprob / generated_length ** length_penalty: what `sequences` is ordered by


@dataclass
class BeamSearchOutput:
    """`LLM.beam_search`'s answer for one prompt: its beam_width hypotheses, best first."""
    sequences: list[BeamSearchSequence]


@dataclass
class PoolingOutput:
    """A pooling request's vector (float32): the embedding (task "embed"), or the raw pooled hidden state
    ("encode"). None when the request ended without one (aborted, failed)."""
    data: "torch.Tensor | None"

    def __reduce__(self):
        # Crossing to the front end's process as plain floats: torch's own pickling of a tensor over a
        # multiprocessing Connection shares its storage through a handshake the engine-core child cannot make.
        return _pooling_output, (None if self.data is None else self.data.tolist(),)


def _pooling_output(values: list[float] | None) -> PoolingOutput:
    import torch

    return PoolingOutput(None if values is None else torch.tensor(values, dtype=torch.float32))


@dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM's name): one vector for its prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int | None = None
    error: str | None = None  # why there is no vector (aborted, failed)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # each label's probability, in the order of config.json's id2label

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _PooledAnswer:
    """What LLM.embed / classify / score return for one prompt (vLLM's names), made from the pooling output."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: object
    finished: bool = True

    @classmethod
    def of(cls, out: PoolingRequestOutput):
        if out.outputs.data is None:
            raise RuntimeError(f"request {out.request_id} has no result: {out.error}")
        return cls(out.request_id, out.prompt, out.prompt_token_ids, cls.wrap(out.outputs.data))


@dataclass
class EmbeddingRequestOutput(_PooledAnswer):
    """`outputs.embedding` is a list of floats."""
    outputs: EmbeddingOutput

    @staticmethod
    def wrap(data) -> EmbeddingOutput:
        return EmbeddingOutput(data.tolist())


@dataclass
class ClassificationRequestOutput(_PooledAnswer):
    """`outputs.probs`: each label's probability."""
    outputs: ClassificationOutput

    @staticmethod
    def wrap(data) -> ClassificationOutput:
        return ClassificationOutput(data.tolist())


@dataclass
class ScoringRequestOutput(_PooledAnswer):
    """`outputs.score`: a cross-encoder's relevance of the pair, or an embedding model's cosine similarity."""
    outputs: ScoringOutput

    @staticmethod
    def wrap(data) -> ScoringOutput:
        return ScoringOutput(float(data.reshape(-1)[0]))
