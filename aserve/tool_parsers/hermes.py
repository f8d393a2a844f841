"""The Hermes format (NousResearch Hermes, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; text before the first
call is the message's content."""
from __future__ import annotations

import json
import re

from aserve.tool_parsers import Parsed, ParsedCall, ToolParser


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
    """Content streams as it comes, but for text that may be the start of a call; a call is sent whole
    once its end tag arrives (or the output ends)."""

    def __init__(self, parser: TaggedJSONToolParser):
        self.parser = parser
        self.buffer = ""
        self.in_call = False
        self.had_call = False

    def _content(self, pieces: list[str], text: str) -> None:
        if text and not (self.had_call and not text.strip()):  # whitespace between calls is not content
            pieces.append(text)

    def feed(self, text: str) -> Parsed:
        p = self.parser
        self.buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(p.start)
                if at < 0:
                    keep = _partial_tag(self.buffer, p.start)
                    self._content(content, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                self._content(content, self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at + len(p.start):], True
                continue
            at = self.buffer.find(p.end)
            if at < 0:
                break
            call = p.call(self.buffer[:at])
            if call is None:  # not a call after all: it was text
                self._content(content, p.start + self.buffer[:at + len(p.end)])
            else:
                calls.append(call)
                self.had_call = True
            self.buffer, self.in_call = self.buffer[at + len(p.end):], False
        return Parsed("".join(content) or None, calls)

    def finish(self) -> Parsed:
        p = self.parser
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = p.call(rest)
            if call is not None:
                return Parsed(None, [call])
            rest = p.start + rest
        return Parsed(rest if rest and not (self.had_call and not rest.strip()) else None)


class HermesToolParser(TaggedJSONToolParser):
    name = "hermes"
    description = "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)"
