"""xgrammar behind three small pieces: checking a constraint (no tokenizer needed, for the front end's
400s), compiling it against the model's vocabulary, and one matcher per sample that follows its tokens.

xgrammar is imported on first use: it costs seconds, and engines that never see a constrained request
should not pay them.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from aserve.errors import InvalidRequestError
from aserve.structured_output.params import StructuredOutputsParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'
CHECK_CACHE_SIZE = 1024  # constraints whose check result is remembered (front ends see the same schemas often)


def xgrammar():
    import xgrammar as xgr

    return xgr


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location (`[12:00:00] /project/cpp/x.cc:83: `)."""
    text = str(exc).strip()
    text = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def grammar_of(params: StructuredOutputsParams):
    """The constraint as an xgrammar Grammar; raises ValueError (or RuntimeError from xgrammar) if invalid."""
    xgr = xgrammar()
    kind = params.kind
    if kind in ("json", "json_object"):
        spec = params.spec if kind == "json" else JSON_OBJECT_SCHEMA
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=params.any_whitespace, strict_mode=kind == "json")
        return strictly_valid_json_strings(grammar)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


# xgrammar 0.2.8's JSON strings let through text no strict parser takes back: the characters of a length-bounded
# string (minLength/maxLength) are [^"\\\r\n], which allows unescaped control characters (json.loads refused 5 of
# 200 bench-model outputs), and every string's characters allow UTF-16 surrogates, whose UTF-8 bytes (ED A0..BF ..)
# decode to U+FFFD (1 of 200). Both classes are rewritten to exclude \0-\x1f and the surrogates.
_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def strictly_valid_json_strings(grammar):
    text = str(grammar)
    if not any(chars in text for chars in _STRING_CHARS):
        return grammar
    for chars in _STRING_CHARS:
        text = text.replace(chars, _JSON_STRING_CHARS)
    return xgrammar().Grammar.from_ebnf(text)


WHAT = {"json": "JSON schema", "json_object": "JSON object format", "regex": "regex", "choice": "choice",
        "grammar": "grammar"}
_checked: OrderedDict[tuple, str | None] = OrderedDict()  # key -> None (valid) or why not
_checked_lock = threading.Lock()


_byte_compiler = None  # compiles against a vocabulary of the 256 bytes and a stop token (see matches_nothing)


def matches_nothing(grammar) -> bool:
    """True if no text at all satisfies the grammar (a regex such as `[^\\s\\S]`, a schema no value fits):
    against a vocabulary of single bytes, not even the first byte, nor the end, would be allowed."""
    global _byte_compiler
    xgr = xgrammar()
    if _byte_compiler is None:
        info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<eos>"], stop_token_ids=[256])
        _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    matcher = xgr.GrammarMatcher(_byte_compiler.compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def check(params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """Raise InvalidRequestError naming `param` if the constraint cannot be compiled or matches no text.
    No model vocabulary is needed, and the answer is remembered per constraint, so the engine core never
    meets an invalid one."""
    key = params.key
    with _checked_lock:
        known = key in _checked
        error = _checked.get(key)
        if known:
            _checked.move_to_end(key)
    if not known:
        try:
            error = "no text matches it" if matches_nothing(grammar_of(params)) else None
        except (ValueError, RuntimeError) as exc:
            error = clean_error(exc)
        with _checked_lock:
            _checked[key] = error
            while len(_checked) > CHECK_CACHE_SIZE:
                _checked.popitem(last=False)
    if error is not None:
        raise InvalidRequestError(f"{param}: invalid {WHAT[params.kind]}: {error}", param)


def grammar_vocab_size(tokenizer, model_vocab_size: int) -> int:
    """The tokens a grammar can allow: the tokenizer's, within the model's logits (a model often pads its
    embedding past its tokenizer; those rows are no text, and a bitmask need not cover them)."""
    return min(model_vocab_size, max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1))


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary (see grammar_vocab_size)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        xgr = xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        return self.compiler.compile_grammar(grammar_of(params))


class RequestGrammar:
    """One sample's matcher, kept in step with its output tokens: it accepts the ones it has not seen,
    and replays from the start if the tokens were ever cut back, so recompute or swap cannot desync it."""

    def __init__(self, compiled, stop_token_ids: list[int]):
        xgr = xgrammar()
        # Without an eos the grammar ends the request on its own last token.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None,
                                          terminate_without_stop_token=not stop_token_ids)
        self.num_accepted = 0

    def follow(self, tokens: list[int]) -> bool:
        """Accept tokens[num_accepted:]; False if one is not allowed (the request cannot go on)."""
        if len(tokens) < self.num_accepted:
            self.matcher.reset()
            self.num_accepted = 0
        return all(self.accept(token) for token in tokens[self.num_accepted:])

    def accept(self, token: int) -> bool:
        """Accept one more token; False if it is not allowed (nothing changes then)."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    def fork(self) -> "RequestGrammar":
        """An independent copy in this one's state: a beam that continues this beam's tokens."""
        twin = RequestGrammar.__new__(RequestGrammar)
        twin.matcher, twin.num_accepted = self.matcher.fork(), self.num_accepted
        return twin

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
