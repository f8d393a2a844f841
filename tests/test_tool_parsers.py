"""Tool-call parsers: the Hermes format, plain and streamed in any chunking, and the plugin loader."""
from __future__ import annotations

import json
import random

import pytest

from aserve.tool_parsers import ToolParser, ToolParserLoadError, installed_tool_parsers, load_tool_parser
from aserve.tool_parsers.hermes import HermesToolParser

CALL_A = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
CALL_B = '{"name": "set_alarm", "arguments": {"hour": 7, "label": "<tool_call>"}}'
CASES = [  # (model output, expected content, expected [(name, arguments)])
    ("just text, no calls", "just text, no calls", []),
    (f"<tool_call>\n{CALL_A}\n</tool_call>", None, [("get_weather", {"city": "Oslo", "days": 2})]),
    (f"Let me check.\n<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>{CALL_B}</tool_call>", "Let me check.",
     [("get_weather", {"city": "Oslo", "days": 2}), ("set_alarm", {"hour": 7, "label": "<tool_call>"})]),
    (f"<tool_call>{CALL_A}", None, [("get_weather", {"city": "Oslo", "days": 2})]),  # eos before the end tag
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
]


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_parse(text, content, calls):
    parsed = HermesToolParser().parse(text)
    assert parsed.content == content and calls_of(parsed) == calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_stream_equals_parse_in_any_chunking(text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        stream = HermesToolParser().stream()
        pieces, found, at = [], [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            parsed = stream.feed(text[at:at + step])
            at += step
            pieces.append(parsed.content or "")
            found += calls_of(parsed)
        last = stream.finish()
        pieces.append(last.content or "")
        found += calls_of(last)
        assert found == calls
        assert "".join(pieces).strip() == (content or "")


def test_loader_finds_installed_and_direct_parsers(tmp_path):
    assert "hermes" in installed_tool_parsers()
    assert load_tool_parser("hermes") is HermesToolParser
    assert load_tool_parser("aserve.tool_parsers.hermes:HermesToolParser") is HermesToolParser
    plugin = tmp_path / "mine.py"
    plugin.write_text("from aserve.tool_parsers import ToolParser, Parsed\n"
                      "class Mine(ToolParser):\n    def parse(self, text):\n        return Parsed(text)\n")
    assert issubclass(load_tool_parser(f"{plugin}:Mine"), ToolParser)
    with pytest.raises(ToolParserLoadError, match="unknown tool-call parser 'nope'; installed tool-call parsers: .*hermes"):
        load_tool_parser("nope")
    with pytest.raises(ToolParserLoadError, match="not a subclass"):
        load_tool_parser("json:dumps")
    with pytest.raises(ToolParserLoadError, match="failed to load"):
        load_tool_parser("no_such_module_xyz:Parser")
