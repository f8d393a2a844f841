"""StructuredOutputManager: the engine core's side of structured output.

Grammars compile on a thread of their own, cached by what they constrain (concurrent requests with one
schema share one compilation). A constrained prompt's samples wait here, outside the scheduler, until
their grammar is ready, so they never hold up the batch. Each step it fills one bitmask row per sample
that samples, which the worker applies to the batch's logits in one call; after the step each matcher
follows its sample's new token.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from aserve.structured_output.grammar import (GrammarCompiler, RequestGrammar, clean_error, grammar_vocab_size,
                                              xgrammar)
from aserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from aserve.request import Request

log = logging.getLogger("aserve")


class StructuredOutputManager:
    def __init__(self, tokenizer, model_vocab_size: int, stop_token_ids, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = grammar_vocab_size(tokenizer, model_vocab_size)
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < self.vocab_size)
        self.cache_size = cache_size
        self.bitmask_width = -(-self.vocab_size // 32)
        self._stop_row = torch.zeros(self.bitmask_width, dtype=torch.int32)  # only the stop tokens allowed
        for token in self.stop_token_ids:
            self._stop_row[token // 32] |= 1 << (token % 32) if token % 32 < 31 else -(1 << 31)
        self._compiler: GrammarCompiler | None = None  # built on the compile thread, at first use
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._awaiting: dict[str, tuple[list[Request], concurrent.futures.Future]] = {}  # group id -> samples
        self._compile_seconds: list[float] = []
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills the step's rows on several threads
        self._lock = threading.Lock()

    # -- compiling, off the step loop --------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams):
        if self._compiler is None:  # once: xgrammar's import and its view of the vocabulary
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        start = time.perf_counter()
        compiled = self._compiler.compile(params)
        with self._lock:
            self._compile_seconds.append(time.perf_counter() - start)
        return compiled

    def compiled(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of `params`, as a future: from the cache, or queued for the compile thread."""
        key = params.key
        future = self._cache.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aserve-grammar")
            future = self._cache[key] = self._pool.submit(self._compile, params)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def add(self, group_id: str, samples: list[Request], params: StructuredOutputsParams) -> None:
        """Hold a constrained prompt's samples until their grammar is compiled (see take_ready)."""
        self._awaiting[group_id] = (samples, self.compiled(params))

    def discard(self, group_id: str) -> None:
        self._awaiting.pop(group_id, None)

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a pending grammar (an engine with nothing else to do)."""
        pending = [future for _, future in self._awaiting.values()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> list[tuple[list[Request], str | None]]:
        """Prompts whose grammar is done, each sample with a matcher of its own; or why it failed."""
        ready = []
        for group_id, (samples, future) in list(self._awaiting.items()):
            if not future.done():
                continue
            del self._awaiting[group_id]
            try:
                compiled = future.result()
            except Exception as exc:  # noqa: BLE001 - the front end checks constraints, so this is rare
                log.warning("grammar compilation failed for %s: %s", group_id, exc)
                ready.append((samples, f"could not compile its grammar: {clean_error(exc)}"))
                continue
            for sample in samples:
                sample.grammar = RequestGrammar(compiled, self.stop_token_ids)
            ready.append((samples, None))
        return ready

    def take_compile_seconds(self) -> list[float]:
        with self._lock:
            seconds, self._compile_seconds = self._compile_seconds, []
        return seconds

    # -- each step ---------------------------------------------------------------------------------

    def bitmask(self, scheduled: list[tuple[Request, int]],
                spec_token_ids: dict[str, list[int]] | None = None) -> tuple[list[str], bytes]:
        """The constrained samples that sample this step, and one row of allowed tokens for each, as the
        plain data a worker in another process can take (the int32 rows' bytes). A request checking proposals
        (speculative decoding) samples at each of them: its id comes once a row, each row filled with its matcher
        walked along the proposals before that position, and the matcher is rolled back after."""
        spec_token_ids = spec_token_ids or {}
        plain, walked = [], []
        for req, num_new in scheduled:
            if req.grammar is None:
                continue
            spec = spec_token_ids.get(req.request_id, ())
            if req.num_computed_tokens + num_new - len(spec) >= req.num_tokens:
                (walked if spec else plain).append((req, spec))
        if not plain and not walked:
            return [], b""
        num_rows = len(plain) + sum(1 + len(spec) for _, spec in walked)
        mask = torch.full((num_rows, self.bitmask_width), -1, dtype=torch.int32)
        ids = [req.request_id for req, _ in plain]
        if plain:
            if self._batch is None:  # the forward has not started: its threads are free for this
                self._batch = xgrammar().BatchGrammarMatcher(max(1, torch.get_num_threads()))
            self._batch.batch_fill_next_token_bitmask([req.grammar.matcher for req, _ in plain], mask[:len(plain)])
        row = len(plain)
        for req, spec in walked:
            ids.extend([req.request_id] * (1 + len(spec)))
            self._walk(req.grammar.matcher, spec, mask, row)
            row += 1 + len(spec)
        stuck = (mask == 0).all(dim=1)
        if stuck.any():  # a grammar with a dead end (it allows nothing more): end the request there
            mask[stuck] = self._stop_row
        return ids, mask.numpy().tobytes()

    @staticmethod
    def _walk(matcher, spec: list[int], mask: torch.Tensor, row: int) -> None:
        """Rows row..row+len(spec): the tokens allowed after each prefix of the proposals. A proposal the grammar
        refuses is excluded by the row before it, so the rows after are never used (left allowing all)."""
        accepted = 0
        for j in range(len(spec) + 1):
            matcher.fill_next_token_bitmask(mask, row + j)
            if j == len(spec) or not matcher.accept_token(spec[j]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)

    @staticmethod
    def check_proposals(req: Request, spec: list[int]) -> list[int]:
        """The proposals cut before the first one the request's grammar refuses or that would end it (after which
        nothing may follow)."""
        matcher, accepted, kept = req.grammar.matcher, 0, 0
        for token in spec:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
            kept = accepted
        if accepted:
            matcher.rollback(accepted)
        return spec[:kept]

    @staticmethod
    def advance(req: Request) -> bool:
        """Let the sample's matcher accept its new tokens; False if the grammar refused one."""
        return req.grammar.follow(req.output_token_ids)
