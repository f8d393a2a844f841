"""`speculative_config`, as vLLM spells it: read and checked once, without torch, so a bad one fails at start-up."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from aserve.errors import ConfigError

METHODS = ("ngram", "draft_model")
KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: proposals a request carries into a step, at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the context
    prompt_lookup_min: int = 2  # ngram: the shortest
    disable_by_batch_size: int | None = None  # no proposals in a step once this many requests are running
    model: str | None = None  # draft_model: the draft's folder (it must share the target's tokenizer)

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the --speculative-config flag); None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - KEYS
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; known: "
                              f"{', '.join(sorted(KEYS))}")
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        if method not in METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config: num_speculative_tokens is required")
        if (method == "draft_model") != ("model" in value):
            raise ConfigError("speculative_config: a draft model's folder goes in 'model', with method "
                              "'draft_model' (or no method); method 'ngram' takes no model")
        config = cls(method, *(value.get(k, d) for k, d in (("num_speculative_tokens", None),
                                                             ("prompt_lookup_max", 4), ("prompt_lookup_min", 2),
                                                             ("disable_by_batch_size", None), ("model", None))))
        config._check()
        return config

    def _check(self) -> None:
        def whole(name: str, low: int, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if allow_none and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"speculative_config: {name} must be an integer >= {low}, got {v!r}")

        whole("num_speculative_tokens", 1)
        whole("prompt_lookup_min", 1)
        whole("prompt_lookup_max", 1)
        whole("disable_by_batch_size", 1, allow_none=True)
        if self.model is not None and not (Path(str(self.model)) / "config.json").is_file():
            raise ConfigError(f"speculative_config: the draft model folder {self.model} has no config.json")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    def describe(self) -> str:
        """One line for the start-up log and /state."""
        if self.method == "draft_model":
            return (f"draft model {self.model}, {self.num_speculative_tokens} tokens"
                    + (f", off from batch {self.disable_by_batch_size}" if self.disable_by_batch_size else ""))
        return (f"{self.method}, {self.num_speculative_tokens} tokens, lookup {self.prompt_lookup_min}.."
                f"{self.prompt_lookup_max}" + (f", off from batch {self.disable_by_batch_size}"
                                               if self.disable_by_batch_size else ""))
