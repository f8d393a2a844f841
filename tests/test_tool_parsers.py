"""Tool-call parsers: the Hermes format, plain and streamed in any chunking, and the plugin loader."""
from __future__ import annotations

import json
import random

import pytest

from aserve.tool_parsers import ToolParser, ToolParserLoadError, installed_tool_parsers, load_tool_parser
from aserve.tool_parsers.hermes import HermesToolParser
from aserve.tool_parsers.scanner import CallPieces, CallScanner

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


def feed_in_chunks(stream, text, rng):
    """Feed `text` in random chunks; return the content and the calls reassembled from their pieces, and
    how many pieces each call came in."""
    content, calls, pieces_per_call, at = [], {}, {}, 0
    outs = []
    while at < len(text):
        step = rng.randint(1, 7)
        outs.append(stream.feed(text[at:at + step]))
        at += step
    outs.append(stream.finish())
    for out in outs:
        content.append(out.content or "")
        for piece in out.pieces:
            assert (piece.name is not None) == (piece.index not in calls)  # the name comes first, once
            call = calls.setdefault(piece.index, [piece.name, ""])
            call[1] += piece.arguments
            pieces_per_call[piece.index] = pieces_per_call.get(piece.index, 0) + 1
    found = [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())]
    return "".join(content), found, pieces_per_call


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_stream_equals_parse_in_any_chunking(text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        streamed, found, _ = feed_in_chunks(HermesToolParser().stream(), text, rng)
        assert found == calls
        assert streamed.strip() == (content or "")


def test_hermes_stream_sends_arguments_while_they_are_generated():
    """A call's name goes out as soon as it is complete, its arguments in pieces before the end tag."""
    stream = HermesToolParser().stream()
    first = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Os')
    assert [(p.index, p.name, p.arguments) for p in first.pieces] == [(0, "get_weather", '{"city": "Os')]
    second = stream.feed('lo", "days": 2}}</tool_call>')
    assert [(p.index, p.name, p.arguments) for p in second.pieces] == [(0, None, 'lo", "days": 2}')]
    assert stream.finish().pieces == []


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "parameters": {"city": "O\\"s}lo]", "days": [1, 2]}}, '
    '{"parameters": {"hour": 7}, "name": "set_alarm"}]',
    '[ {"name":"get_weather","parameters":{}} ]',
])
def test_call_scanner_reads_required_arrays_in_any_chunking(text):
    """The `required` grammar's array of {"name", "parameters"}: calls and arguments as json.loads sees them,
    whatever the chunking, with arguments streamed in pieces when chunks are small."""
    expected = [(c["name"], c["parameters"]) for c in json.loads(text)]
    rng = random.Random(0)
    for _ in range(20):
        scanner = CallScanner(call_depth=2)
        pieces = CallPieces(scanner)
        calls, counts, at = {}, {}, 0
        while at < len(text):
            step = rng.randint(1, 4)
            scanner.feed(text[at:at + step])
            at += step
            for piece in pieces.take():
                call = calls.setdefault(piece.index, [piece.name, ""])
                call[1] += piece.arguments
                counts[piece.index] = counts.get(piece.index, 0) + 1
        assert [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())] == expected
        assert all(call.complete for call in scanner.calls)
        assert counts[0] > 1 or len(calls[0][1]) <= 4


def test_call_scanner_takes_arguments_written_as_a_json_string():
    scanner = CallScanner()
    scanner.feed('{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert (scanner.calls[0].name, json.loads(scanner.calls[0].arguments)) == ("f", {"a": 1})


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
