"""Tool-call parsers: turn a model's raw output into content and function calls, in that model's format.

`tool_choice: "auto"` leaves the model free, so its calls come back in whatever syntax it was trained on;
`--tool-call-parser NAME` picks the parser. Parsers are plugins under the entry-point group
`aserve.tool_parsers` (the built-in `hermes` registers there too, exactly as a third party's does);
`module:Class` or `path/to/file.py:Class` loads a class directly.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Protocol

from aserve.errors import ConfigError
from aserve.plugins import PluginKind
from aserve.tool_parsers.scanner import CallPiece

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


@dataclass
class Streamed:
    content: str | None  # text surely not part of a call (None: none)
    pieces: list[CallPiece] = field(default_factory=list)  # calls' names and arguments text, as they form


class ToolCallStream(Protocol):
    def feed(self, text: str) -> Streamed:
        """Take the next piece of output; return the content that is surely not part of a call, and the
        calls' pieces this piece of output revealed."""

    def finish(self) -> Streamed:
        """The output ended: whatever was held back, as content or the last call's pieces."""


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


PLUGINS = PluginKind(ENTRY_POINT_GROUP, "tool-call parser", "tool-call parsers", "pip install -e .",
                     ToolParserLoadError)


def installed_tool_parsers() -> dict[str, importlib.metadata.EntryPoint]:
    return PLUGINS.installed()


def load_tool_parser(spec: str | type) -> type[ToolParser]:
    """A parser class from an installed name, 'module:Class', 'path/to/file.py:Class', or a class."""
    if isinstance(spec, type):
        cls = spec
    else:
        cls = PLUGINS.load(spec)
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ToolParserLoadError(f"tool-call parser {spec!r} is not a subclass of aserve.tool_parsers.ToolParser")
    return cls
