"""Streaming function calls while their JSON is still being generated.

A call is a JSON object with a name and an arguments object (`{"name": "f", "arguments": {...}}`; the
`required` grammar says `"parameters"`). OpenAI's streams send the call's name as soon as it is known and
then its arguments text piece by piece, so a client can show a call forming. `CallScanner` reads such
objects one character at a time, wherever they sit (one bare object, or the elements of an array), and
keeps for each call the name once its string is complete and the arguments text seen so far;
`CallPieces` turns the growth since the last look into `CallPiece`s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass
class CallPiece:
    """The next piece of an output's `index`-th call: its name comes with the first piece, then arguments text
    that a client appends."""
    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ScannedCall:
    name: str | None = None
    arguments: str = ""  # the arguments object's text so far (raw, as generated)
    complete: bool = False  # the call's object closed


class CallScanner:
    """Finds call objects in JSON text as it arrives. `call_depth` is the nesting level of the call objects'
    own members: 1 for one bare object, 2 for objects inside an array."""

    def __init__(self, call_depth: int = 1):
        self.call_depth = call_depth
        self.calls: list[ScannedCall] = []
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.reading_key = True
        self.key = ""  # the member being read, raw JSON text while it is a key
        self.field: str | None = None  # that key decoded, once its ':' is read
        self.value = ""  # its value's raw text

    @property
    def _current(self) -> ScannedCall:
        return self.calls[-1]

    def feed(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        inside = self.depth >= self.call_depth and self.calls and not self._current.complete
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            if inside:
                self._take(ch)
                if not self.reading_key:
                    self._value_grew()
            return
        if ch == '"':
            self.in_string, self.escape = True, False
        elif ch in "{[":
            self.depth += 1
            if ch == "{" and self.depth == self.call_depth:  # a new call's object opens
                self.calls.append(ScannedCall())
                self.reading_key, self.key, self.value = True, "", ""
                return
        elif ch in "}]":
            self.depth -= 1
            if inside and self.depth == self.call_depth - 1:  # the call's object closes
                self._member_done()
                self._current.complete = True
                return
        if not inside:
            return
        if self.depth == self.call_depth and ch in WHITESPACE:
            return
        if self.depth == self.call_depth and ch == ":" and self.reading_key:
            self.reading_key, self.field = False, self._key()
            return
        if self.depth == self.call_depth and ch == ",":
            self._member_done()
            self.reading_key, self.key, self.value = True, "", ""
            return
        self._take(ch)
        if not self.reading_key:
            self._value_grew()

    def _take(self, ch: str) -> None:
        if self.reading_key:
            self.key += ch
        else:
            self.value += ch

    def _key(self) -> str | None:
        try:
            return json.loads(self.key)
        except ValueError:
            return None

    def _value_grew(self) -> None:
        """Arguments stream while they are an object; the name is known once its string closes."""
        call = self._current
        if self.field in ARGUMENT_KEYS and self.value.startswith("{"):
            call.arguments = self.value
        elif self.field == "name" and call.name is None and not self.in_string and self.value.startswith('"'):
            try:
                name = json.loads(self.value)
            except ValueError:
                return
            if isinstance(name, str):
                call.name = name

    def _member_done(self) -> None:
        """Arguments given as a JSON string (some models write them so) count once complete."""
        if self.reading_key or self.field not in ARGUMENT_KEYS or self.value.startswith("{"):
            return
        try:
            value = json.loads(self.value)
        except ValueError:
            return
        self._current.arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class CallPieces:
    """What a scanner found since the last look, as pieces: a call goes out once its name is known, with the
    arguments seen by then; later looks send only the arguments' growth."""

    def __init__(self, scanner: CallScanner, first_index: int = 0):
        self.scanner = scanner
        self.first_index = first_index
        self.sent: list[int] = []  # per named call: how much of its arguments went out

    def take(self) -> list[CallPiece]:
        pieces = []
        for i, call in enumerate(self.scanner.calls):
            if i < len(self.sent):
                grown = call.arguments[self.sent[i]:]
                if grown:
                    pieces.append(CallPiece(self.first_index + i, arguments=grown))
                    self.sent[i] = len(call.arguments)
            elif i == len(self.sent) and call.name is not None:
                pieces.append(CallPiece(self.first_index + i, call.name, call.arguments))
                self.sent.append(len(call.arguments))
            else:
                break
        return pieces
