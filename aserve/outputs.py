"""What the engine hands back: RequestOutput and CompletionOutput, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


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
