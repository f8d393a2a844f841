"""Tool-call parsers: turn a model's raw output into content and function calls, in that model's format.

`tool_choice: "auto"` leaves the model free, so its calls come back in whatever syntax it was trained on;
`--tool-call-parser NAME` picks the parser. Parsers are plugins under the entry-point group
`aserve.tool_parsers` (the built-in `hermes` registers there too, exactly as a third party's does);
`module:Class` or `path/to/file.py:Class` loads a class directly.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aserve.engine.errors import ConfigError

ENTRY_POINT_GROUP = "aserve.tool_parsers"


class ToolParserLoadError(ConfigError):
    """The tool-call parser cannot be found, imported or is not a ToolParser."""


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class Parsed:
    content: str | None  # text that is not part of a call (None: none)
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallStream(Protocol):
    def feed(self, text: str) -> Parsed:
        """Take the next piece of output; return the content that is surely not part of a call, and the
        calls completed by this piece."""

    def finish(self) -> Parsed:
        """The output ended: whatever was held back, as content or a last call."""


class ToolParser:
    """Base of tool-call parsers. One instance serves the whole server; `stream()` makes one state per
    streamed choice."""

    name: str = "base"

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        raise NotImplementedError


def installed_tool_parsers() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_spec(spec: str):
    target, _, cls_name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ToolParserLoadError(f"tool-call parser file {target!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"aserve_user_tool_parser_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, cls_name)
    except AttributeError:
        raise ToolParserLoadError(f"tool-call parser {spec!r}: {target} has no attribute {cls_name!r}") from None


def load_tool_parser(spec: str | type) -> type[ToolParser]:
    """A parser class from an installed name, 'module:Class', 'path/to/file.py:Class', or a class."""
    if isinstance(spec, type):
        cls = spec
    else:
        try:
            if ":" in spec:
                cls = _load_spec(spec)
            else:
                eps = installed_tool_parsers()
                if spec not in eps:
                    names = ", ".join(sorted(eps)) or "none (pip install -e .)"
                    raise ToolParserLoadError(f"unknown tool-call parser {spec!r}; installed: {names}")
                cls = eps[spec].load()
        except ToolParserLoadError:
            raise
        except Exception as exc:  # a broken plugin: name it and its cause
            raise ToolParserLoadError(f"tool-call parser {spec!r} failed to load: {type(exc).__name__}: {exc}") \
                from exc
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ToolParserLoadError(f"tool-call parser {spec!r} is not a subclass of aserve.tool_parsers.ToolParser")
    return cls
