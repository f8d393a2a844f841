"""BeamSearch: one beam-search request's beams and kept hypotheses, stepped as transformers steps them.

The algorithm is transformers' `_beam_search` (generation/utils.py, 5.x), on the engine's own sequences: each
step every live beam brings its best K next tokens (K = max(2, 1 + stop ids) x beam_width, enough that
beam_width candidates remain after those that stop are set aside); the K best continuations over all beams
(running log-probability + the token's) are kept in order. The first beam_width of them that stop become
hypotheses scored cum_logprob / generated_length ** length_penalty (the best beam_width hypotheses are kept);
the best beam_width that do not stop are the next step's beams. `early_stopping` decides when the search
ends, as there (see `_can_improve`); at max_tokens every candidate stops.

The beams are Requests: the first is the one the scheduler and the policy see, the others ride along with it
and are made as the search widens after its prompt. A beam that continues another takes that one's blocks (the
scheduler's `_advance_beams`, by KVCacheManager.adopt), so nothing is computed twice. This module only
decides; it holds no blocks and imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from aserve.request import Request
from aserve.sampling_params import BeamSearchParams


def length_normalized(cum_logprob: float, length: int, penalty: float) -> float:
    """cum_logprob / length ** penalty, as a float does it where the power leaves the floats' range (a penalty of
    1e5 or -1e5 is allowed): the score goes to -0.0 or -inf, where Python's power raised OverflowError and its
    division ZeroDivisionError (a request's, which ended the engine core's loop)."""
    try:
        factor = float(length) ** -penalty
    except OverflowError:
        factor = math.inf
    return 0.0 if cum_logprob == 0 else cum_logprob * factor


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included), their log-probabilities and its score."""
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (a stop or eos token, a stop string) or "length" (max_tokens)
    stop_reason: int | str | None = None  # the stop token (from stop_token_ids) or stop string that ended it
    text: str | None = None  # with a stop string: the text, cut at it (or after it)


class BeamSearch:
    """`decode` (token ids -> text) is needed only for stop strings: a candidate whose text completes one stops
    there, as a stop token would (a beam's text is decoded whole, once a step, only when there are stop
    strings)."""

    def __init__(self, first: Request, params: BeamSearchParams, decode: Callable[[list[int]], str] | None = None):
        self.params = params
        self.stop_strings = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        self.decode = decode
        self.texts = [""]  # each live beam's text, with stop strings
        self.beams: list[Request] = [first]  # the live beams, the first the request the scheduler sees
        self.cum_logprobs = [0.0]  # each live beam's running log-probability
        self.token_logprobs: list[list[float]] = [[]]  # each live beam's tokens' log-probabilities
        self.next_grammars: list = [None]  # with structured output: each next beam's matcher, its token accepted
        self.hypotheses: list[Hypothesis] = []  # the best beam_width finished, best first
        self.may_improve = True  # transformers' is_early_stop_heuristic_unsatisfied (once False, for good)
        self.done = False
        first.beam = self

    @property
    def first(self) -> Request:
        return self.beams[0]

    def _new_beam(self, index: int) -> Request:
        first = self.first
        beam = Request(f"{first.request_id}~beam{index}", first.prompt_token_ids, first.params,
                       group_id=first.group_id, index=index, priority=first.priority,
                       arrival_time=first.arrival_time, max_tokens=first.max_tokens, lora=first.lora)
        beam.beam = self  # its status stays as made: the first beam's is the search's
        return beam

    def step(self, candidates: dict[Request, list[tuple[int, float]]]) -> list[tuple[Request, int]]:
        """Given every live beam's best next tokens (token, logprob), best first: keep the hypotheses that end
        here, and return the next beams as (the beam each continues, its new token), best first; `done` says
        whether the search is over (then the list is empty)."""
        width, params = self.params.beam_width, self.first.params
        stop_ids = params.stop_ids
        num_candidates = params.beam_candidates
        scored = []
        for i, beam in enumerate(self.beams):
            for token, logprob in candidates[beam]:
                scored.append((self.cum_logprobs[i] + logprob, i, token, logprob))
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))  # as torch.topk over (beam, token) orders ties
        scored = scored[:num_candidates]
        length = self.first.num_output_tokens + 1  # generated tokens once this one is appended
        at_limit = length >= self.first.max_tokens
        stops = [at_limit or token in stop_ids for _, _, token, _ in scored]
        grammars: list = [None] * len(scored)
        if self.first.grammar is not None:  # each beam follows its grammar; a candidate that completes it stops
            scored, stops, grammars = self._within_grammars(scored, stops)
        texts: list[str | None] = [None] * len(scored)
        cuts: dict[int, tuple[str, str]] = {}  # candidate -> (the stop string it completed, the text cut there)
        if self.stop_strings and self.decode is not None:
            for j, (_, i, token, _) in enumerate(scored):
                if token not in stop_ids:
                    texts[j] = self.decode(self.beams[i].output_token_ids + [token])
                    cut = self._stop_string(self.texts[i], texts[j])
                    if cut is not None:
                        stops[j], cuts[j] = True, cut

        full = len(self.hypotheses) >= width
        if self.may_improve and not (full and self.params.early_stopping is True):
            new = [self._hypothesis(c, length, cuts.get(j), grammars[j])
                   for j, (c, stop) in enumerate(zip(scored[:width], stops)) if stop]
            if new:  # the best beam_width of kept and new; on a tie the one kept earlier stays first
                merged = sorted(self.hypotheses + new, key=lambda h: -h.score)
                self.hypotheses = merged[:width]
        kept = [j for j, stop in enumerate(stops) if not stop][:width]
        survivors = [scored[j] for j in kept]

        best_running = survivors[0][0] if survivors else None
        self.may_improve = self.may_improve and self._can_improve(best_running, length)
        finished_all = len(self.hypotheses) >= width and self.params.early_stopping is True
        if not survivors or not self.may_improve or finished_all:
            self.done = True
            if len(self.hypotheses) < width:  # (a stop string cut beams short): the best live ones fill in
                extra = [self._hypothesis(c, length) for c in survivors]
                self.hypotheses = sorted(self.hypotheses + extra, key=lambda h: -h.score)[:width]
            return []
        parents = [self.beams[i] for _, i, _, _ in survivors]
        self.token_logprobs = [self.token_logprobs[i] + [lp] for _, i, _, lp in survivors]
        self.cum_logprobs = [score for score, _, _, _ in survivors]
        self.texts = [texts[j] or "" for j in kept]
        self.next_grammars = [grammars[j] for j in kept]
        while len(self.beams) < len(survivors):
            self.beams.append(self._new_beam(len(self.beams)))
        return [(parent, token) for parent, (_, _, token, _) in zip(parents, survivors)]

    def _hypothesis(self, candidate, length: int, cut: tuple[str, str] | None = None, grammar=None) -> Hypothesis:
        """`grammar`: the candidate's, having accepted its token (a grammar it completed stopped it)."""
        cum_logprob, i, token, logprob = candidate
        params = self.first.params
        stopped = token in params.stop_ids or cut is not None or (grammar is not None and grammar.terminated)
        stop_reason = cut[0] if cut is not None else token if token in params.stop_token_ids else None
        return Hypothesis(self.beams[i].output_token_ids + [token], self.token_logprobs[i] + [logprob], cum_logprob,
                          length_normalized(cum_logprob, length, self.params.length_penalty),
                          "stop" if stopped else "length",
                          stop_reason, cut[1] if cut is not None else None)

    def _within_grammars(self, scored: list, stops: list[bool]) -> tuple[list, list[bool], list]:
        """Each candidate's grammar: its beam's, forked, having accepted the candidate's token. A candidate the
        grammar refuses is dropped (the step's bitmask allowed only what it accepts, so none should be); one that
        completes it stops, as a stop token would."""
        kept, kept_stops, grammars = [], [], []
        for candidate, stop in zip(scored, stops):
            grammar = self.beams[candidate[1]].grammar.fork()
            if grammar.accept(candidate[2]):
                kept.append(candidate)
                kept_stops.append(stop or grammar.terminated)
                grammars.append(grammar)
        return kept, kept_stops, grammars

    def _stop_string(self, before: str, text: str) -> tuple[str, str] | None:
        """The stop string the new end of `text` completes (after `before`, its text a token earlier), and the
        text cut before it (after it with include_stop_str_in_output)."""
        for stop in self.stop_strings:
            at = text.find(stop, max(0, len(before) - len(stop) + 1))
            if at >= 0:
                return stop, text[:at + len(stop)] if self.params.include_stop_str_in_output else text[:at]
        return None

    def _can_improve(self, best_running: float | None, length: int) -> bool:
        """Whether the best running beam could still beat the worst kept hypothesis (transformers'
        _check_early_stop_heuristic): always while fewer than beam_width are kept. Its best score is taken at
        its current length, or with early_stopping="never" and a positive length_penalty at max_tokens (a
        longer hypothesis then scores higher)."""
        if len(self.hypotheses) < self.params.beam_width:
            return True
        if best_running is None:
            return False
        penalty = self.params.length_penalty
        best_length = self.first.max_tokens if self.params.early_stopping == "never" and penalty > 0 else length
        return length_normalized(best_running, best_length, penalty) > self.hypotheses[-1].score

    def drop_beams(self, count: int) -> list[Request]:
        """The beams past the first `count` (fewer survived this step): removed from the search, returned."""
        dropped, self.beams = self.beams[count:], self.beams[:count]
        return dropped
