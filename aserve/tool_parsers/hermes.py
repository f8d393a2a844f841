"""The Hermes format (NousResearch Hermes, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; text before the first
call is the message's content."""
from __future__ import annotations

import json
import re

from aserve.tool_parsers import Parsed, ParsedCall, Streamed, ToolParser
from aserve.tool_parsers.scanner import CallPiece, CallPieces, CallScanner


class TaggedJSONToolParser(ToolParser):
    """Calls as JSON objects between a start and an end tag (the last one may lack its end tag, cut by eos)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def call(self, body: str) -> ParsedCall | None:
        """One call from the text between the tags; None if it is not a call."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ParsedCall(obj["name"], arguments)

    def parse(self, text: str) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text)
        pattern = re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|\Z)"
        calls = [self.call(body) for body in re.findall(pattern, text[first:], re.DOTALL)]
        if not calls or None in calls:  # something that only looks like a call: leave the text alone
            return Parsed(text)
        return Parsed(text[:first].strip() or None, calls)

    def stream(self) -> "TaggedStream":
        return TaggedStream(self)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedStream:
    """Content streams as it comes, but for text that may be the start of a call; a call streams as it is
    generated: its name once known, then its arguments in pieces. A body that never shows a name is
    decided at its end tag: a call sent whole, or text."""

    def __init__(self, parser: TaggedJSONToolParser):
        self.parser = parser
        self.buffer = ""  # outside calls: text not yet decided; inside: the call's body so far
        self.in_call = False
        self.num_calls = 0
        self.pieces: CallPieces | None = None  # the current call's
        self.fed = 0  # how much of the current call's body its scanner has read

    def _content(self, pieces: list[str], text: str) -> None:
        if text and not (self.num_calls and not text.strip()):  # whitespace between calls is not content
            pieces.append(text)

    def _open_call(self) -> None:
        self.in_call, self.fed = True, 0
        self.pieces = CallPieces(CallScanner(call_depth=1), first_index=self.num_calls)

    def _grown(self, body: str) -> list[CallPiece]:
        """The current call's pieces after reading its body up to `body` (its first object only)."""
        scanner = self.pieces.scanner
        scanner.feed(body[self.fed:])
        self.fed = len(body)
        return [piece for piece in self.pieces.take() if piece.index == self.num_calls]

    def _close_call(self, body: str, end: str, content: list[str], out: list[CallPiece]) -> None:
        """The call's body is complete: stream what is left of it, or decide what an unnamed body was."""
        out += self._grown(body)
        started = bool(self.pieces.sent)
        call = self.parser.call(body)
        if not started and call is not None:
            out.append(CallPiece(self.num_calls, call.name, call.arguments))
        if started or call is not None:
            self.num_calls += 1
        else:  # not a call after all: it was text
            self._content(content, self.parser.start + body + end)
        self.in_call, self.pieces = False, None

    def feed(self, text: str) -> Streamed:
        p = self.parser
        self.buffer += text
        content: list[str] = []
        out: list[CallPiece] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(p.start)
                if at < 0:
                    keep = _partial_tag(self.buffer, p.start)
                    self._content(content, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                self._content(content, self.buffer[:at])
                self.buffer = self.buffer[at + len(p.start):]
                self._open_call()
                continue
            at = self.buffer.find(p.end)
            if at < 0:
                out += self._grown(self.buffer[:len(self.buffer) - _partial_tag(self.buffer, p.end)])
                break
            self._close_call(self.buffer[:at], p.end, content, out)
            self.buffer = self.buffer[at + len(p.end):]
        return Streamed("".join(content) or None, out)

    def finish(self) -> Streamed:
        rest, self.buffer = self.buffer, ""
        content: list[str] = []
        out: list[CallPiece] = []
        if self.in_call:  # cut by eos before the end tag
            self._close_call(rest, "", content, out)
        else:
            self._content(content, rest)
        return Streamed("".join(content) or None, out)


class HermesToolParser(TaggedJSONToolParser):
    name = "hermes"
    description = "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)"
