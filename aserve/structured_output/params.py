"""StructuredOutputsParams: what a request's output must match, in vLLM's names.

Plain data (no xgrammar objects), because it travels inside SamplingParams from the front end to the
engine core's process. Exactly one constraint is set; `key` names it for the compiled-grammar cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from aserve.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (as a dict or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF) grammar with a `root` rule
    json_object: bool = False  # any JSON object
    # Whitespace between JSON tokens is fixed (", " and ": ") unless this is set: models not trained on
    # JSON otherwise tend to emit whitespace until max_tokens.
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured outputs need exactly one of json, json_object, regex, choice and "
                                      f"grammar; got {', '.join(given) or 'none'}", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError("json must be a JSON schema (an object or its text)", "structured_outputs")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings", "structured_outputs")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{name} must be a non-empty string", "structured_outputs")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a JSON schema (re-encoded, so a dict and its text share a grammar; keys keep
        their order, which is the order properties are generated in), a regex, an EBNF grammar; the choices
        as a JSON list."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    return self.json  # left as given: compiling it says what is wrong
            return json.dumps(schema)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: the cache key."""
        return self.kind, self.spec, self.any_whitespace
