"""OutputProcessor: incremental detokenization, stop strings, and RequestOutputs grouped per prompt.

Outputs come in three kinds: "cumulative" (everything so far, vLLM's offline default), "delta" (only
what is new since the last output, for streaming; text that could be the start of a stop string is held
back until it is decided) and "final" (one cumulative output when the prompt's samples are all done).

Detokenization uses `tokenizers.decoders.DecodeStream`, primed with the prompt so the first piece of
output gets its spacing right and multi-byte characters split across tokens come out whole.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.request import Request
from aserve.worker.sampler import SampleResult

PROMPT_CONTEXT = 8  # prompt tokens that prime the decoder; enough for any merge to settle


class SequenceText:
    """The growing text of one sample, and the logprobs that came with its tokens."""

    def __init__(self, req: Request, backend):
        self.req = req
        self.backend = backend
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if req.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if req.params.logprobs is not None else None
        self._stream = self._new_stream()
        self.sent_text = self.sent_tokens = 0  # what delta outputs have already carried
        self.num_tokens = 0  # tokens whose text is in `text` (a step may append several: speculative decoding)
        self.sent_finish = False
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1

    def _new_stream(self):
        if self.backend is None:
            return None
        return DecodeStream(ids=self.req.prompt_token_ids[-PROMPT_CONTEXT:],
                            skip_special_tokens=self.req.params.skip_special_tokens)

    def append(self, token_id: int, tokenizer) -> str:
        """Add a token's text; return the new text (possibly empty while a character is incomplete)."""
        self.num_tokens += 1
        if self._stream is not None:
            piece = self._stream.step(self.backend, token_id) or ""
        else:  # a slow tokenizer: decode the whole output again
            full = tokenizer.decode(self.req.output_token_ids[:self.num_tokens],
                                    skip_special_tokens=self.req.params.skip_special_tokens)
            piece = full[len(self.text):]
        self.text += piece
        return piece

    def find_stop(self, piece: str) -> str | None:
        """A stop string that now appears in the text; the text is cut before it (or after it)."""
        params = self.req.params
        for stop in params.stop:
            begin = max(0, len(self.text) - len(piece) - len(stop) + 1)
            at = self.text.find(stop, begin)
            if at >= 0:
                self.text = self.text[:at + len(stop)] if params.include_stop_str_in_output else self.text[:at]
                return stop
        return None


    def completion(self, cumulative: bool) -> CompletionOutput | None:
        """This sample's output: everything so far, or only what is new (None if nothing is)."""
        req = self.req
        finish = req.status.value if req.is_finished else None
        if cumulative:
            return CompletionOutput(req.index, self.text, list(req.output_token_ids), self.cumulative_logprob,
                                    list(self.logprobs) if self.logprobs is not None else None, finish,
                                    req.stop_reason, req.error)
        end = len(self.text) if finish else max(self.sent_text, len(self.text) - self.holdback)
        tokens = req.output_token_ids[self.sent_tokens:]
        if end == self.sent_text and not tokens and (self.sent_finish or not finish):
            return None
        out = CompletionOutput(req.index, self.text[self.sent_text:end], tokens, self.cumulative_logprob,
                               self.logprobs[self.sent_tokens:] if self.logprobs is not None else None, finish,
                               req.stop_reason, req.error)
        self.sent_text, self.sent_tokens, self.sent_finish = end, len(req.output_token_ids), finish is not None
        return out


OUTPUT_KINDS = ("cumulative", "delta", "final")


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        # False in the engine-core process: outputs leave prompt and prompt_token_ids None, and the front end
        # fills them in from what it sent (AsyncLLM's RequestCollector). Each step's outputs cross to it pickled,
        # and a copy of every prompt in them is O(prompt) work a request a step: 64 requests of 4096-token
        # prompts pickled in 3.7 ms and unpickled in 10.0, against 0.10 and 0.13 without them (AMD EPYC Zen 4).
        self.carries_prompts = True
        self.groups: dict[str, tuple[str | None, list[int], list[Request], str]] = {}
        self.texts: dict[Request, SequenceText] = {}

    def add_group(self, group_id: str, prompt: str | None, prompt_token_ids: list[int], reqs: list[Request],
                  output_kind: str = "cumulative") -> None:
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {output_kind!r}")
        self.groups[group_id] = (prompt, prompt_token_ids, reqs, output_kind)
        for req in reqs:
            self.texts[req] = SequenceText(req, self.backend)

    def on_token(self, req: Request, result: SampleResult) -> str | None:
        """Record a sampled token; return the stop string it completed, if any."""
        seq = self.texts[req]
        if seq.logprobs is not None and result.logprob is not None:
            entry = {tid: Logprob(lp, rank + 1, self.tokenizer.decode([tid]))
                     for rank, (tid, lp) in enumerate(result.top_logprobs or [])}
            entry[result.token_id] = Logprob(result.logprob, result.rank, self.tokenizer.decode([result.token_id]))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += result.logprob
        piece = seq.append(result.token_id, self.tokenizer)
        if req.params.stop and piece:
            return seq.find_stop(piece)
        return None

    def make_output(self, group_id: str) -> RequestOutput | None:
        """The group's output in its kind; None when a delta has nothing new or a final one is not due."""
        prompt, prompt_token_ids, reqs, kind = self.groups[group_id]
        finished = all(req.is_finished for req in reqs)
        if kind == "final" and not finished:
            return None
        outputs = [self.texts[req].completion(cumulative=kind != "delta") for req in reqs]
        outputs = [o for o in outputs if o is not None]
        if not outputs and not finished:
            return None
        first = reqs[0]
        carried = self.carries_prompts
        out = RequestOutput(group_id, prompt if carried else None, list(prompt_token_ids) if carried else None,
                            outputs, finished, num_cached_tokens=first.num_cached_tokens)
        if first.params.prompt_logprobs is not None and finished:
            decode = self.tokenizer.decode
            out.prompt_logprobs = [None]
            for token, logprob, top in first.prompt_logprobs:
                entry = {tid: Logprob(lp, rank + 1, decode([tid])) for rank, (tid, lp) in enumerate(top)}
                entry.setdefault(token, Logprob(logprob, None, decode([token])))
                out.prompt_logprobs.append(entry)
        return out

    def beam_output(self, group_id: str, search) -> RequestOutput:
        """A beam search's answer (core/beam_search.py): its hypotheses, best first, each decoded once here. One
        that ended from outside (an abort, an error) answers with the hypotheses kept so far, then its live
        beams."""
        prompt, prompt_token_ids, reqs, _ = self.groups[group_id]
        first = reqs[0]
        found = [(h.token_ids, h.logprobs, h.cum_logprob, h.finish_reason, h.stop_reason, h.text)
                 for h in search.hypotheses]
        if not search.done:
            found += [(beam.output_token_ids, logprobs, cum, first.status.value, None, None)
                      for beam, logprobs, cum in zip(search.beams, search.token_logprobs, search.cum_logprobs)]
        skip = first.params.skip_special_tokens
        outputs = [CompletionOutput(i, text if text is not None else self.tokenizer.decode(tokens, skip_special_tokens=skip),
                                    list(tokens), cum, [{t: Logprob(lp)} for t, lp in zip(tokens, logprobs)], reason,
                                    stop_reason, first.error)
                   for i, (tokens, logprobs, cum, reason, stop_reason, text) in enumerate(found)]
        return RequestOutput(group_id, prompt, list(prompt_token_ids), outputs, True,
                             num_cached_tokens=first.num_cached_tokens)

    def release(self, group_id: str) -> None:
        _, _, reqs, _ = self.groups.pop(group_id)
        for req in reqs:
            self.texts.pop(req, None)
