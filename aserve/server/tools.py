"""Tool calling on /v1/chat/completions.

`tool_choice` decides how calls come out: `none` never parses them; `auto` leaves the model free and the
server's tool-call parser finds them in its text; `required` and a named function are enforced by a
grammar, a JSON schema built from the functions' own (`[{"name": ..., "parameters": {...}}, ...]` for
required, the function's arguments object for a named one), so the calls always parse and their
arguments always match.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from aserve.server import protocol as p
from aserve.server.errors import APIError
from aserve.structured_output import StructuredOutputsParams
from aserve.tool_parsers import Parsed, ParsedCall, ToolParser
from aserve.tool_parsers.scanner import CallPiece, CallPieces, CallScanner

EMPTY_ARGUMENTS = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_schema(tool: p.ChatTool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_ARGUMENTS


@dataclass
class ToolPlan:
    tools: list[p.ChatTool]
    choice: str  # none | auto | required | named
    parallel: bool
    named: str | None = None  # the function a named choice forces
    parser: ToolParser | None = None  # for auto

    def template_tools(self) -> list[dict]:
        """The tools as a chat template expects them (OpenAI's shape, as plain dicts)."""
        return [{"type": "function", "function": {k: v for k, v in (
            ("name", t.function.name), ("description", t.function.description),
            ("parameters", arguments_schema(t))) if v is not None}} for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces `required` or a named choice (None for auto and none)."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return StructuredOutputsParams(json=arguments_schema(tool))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                    "parameters": arguments_schema(t)},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parse(self, text: str) -> Parsed:
        """A finished output as content and calls (a cut-short one stays content: it does not parse)."""
        if self.choice == "named":
            try:
                json.loads(text)
            except ValueError:
                return Parsed(text)
            return Parsed(None, [ParsedCall(self.named, text)])
        if self.choice == "required":
            try:
                calls = [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return Parsed(text)
            return Parsed(None, calls)
        if self.choice == "auto":
            parsed = self.parser.parse(text)
            if not self.parallel:
                parsed.calls = parsed.calls[:1]
            return parsed
        return Parsed(text)

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def plan(req: p.ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan | None:
    """What the request's tools and tool_choice ask for, checked; None when it has no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools have duplicate function names", "tools")
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                f"({', '.join(names)})", "tool_choice")
        return ToolPlan(req.tools, "named", req.parallel_tool_calls, named=choice.function.name)
    choice = choice or "auto"
    if choice == "auto" and parser is None:
        raise APIError(400, 'tool_choice "auto" needs a tool-call parser: start the server with '
                            '--tool-call-parser NAME', "tool_choice")
    return ToolPlan(req.tools, choice, req.parallel_tool_calls, parser=parser if choice == "auto" else None)


def tool_calls(calls: list[ParsedCall]) -> list[p.ToolCall]:
    return [p.ToolCall(id=call_id(), function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def finish_reason(reason: str | None, had_calls: bool) -> str | None:
    return "tool_calls" if had_calls and reason == "stop" else reason


class ToolStream:
    """One streamed choice: content deltas, and `delta.tool_calls` pieces a client appends by index. Every
    call streams as it is generated: its id and name once the name is known, then its arguments text in
    pieces (a named call's arguments are the whole output; required calls are read out of the array as it
    grows; auto calls as the parser finds them). Without parallel tool calls only the first goes out."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan = tool_plan
        self.num_calls = 0  # calls opened so far
        self.required = CallPieces(CallScanner(call_depth=2)) if tool_plan.choice == "required" else None
        self.parser_stream = tool_plan.parser.stream() if tool_plan.choice == "auto" else None

    def _deltas(self, pieces: list[CallPiece]) -> list[p.DeltaToolCall]:
        out = []
        for piece in pieces:
            if piece.index > 0 and not self.plan.parallel:
                continue
            if piece.name is not None:
                self.num_calls += 1
                out.append(p.DeltaToolCall(piece.index, call_id(), "function",
                                           p.DeltaFunctionCall(piece.name, piece.arguments)))
            elif piece.arguments:
                out.append(p.DeltaToolCall(piece.index, function=p.DeltaFunctionCall(arguments=piece.arguments)))
        return out

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[p.DeltaToolCall]]:
        choice = self.plan.choice
        if choice == "named":
            first = self.num_calls == 0
            return None, self._deltas([CallPiece(0, self.plan.named if first else None, text)])
        if choice == "required":
            self.required.scanner.feed(text)
            return None, self._deltas(self.required.take())
        if choice == "auto":
            streamed = self.parser_stream.feed(text)
            content, pieces = streamed.content, streamed.pieces
            if finished:
                last = self.parser_stream.finish()
                pieces += last.pieces
                content = (content or "") + (last.content or "") or None
            return content, self._deltas(pieces)
        return text, []
