"""OutputProcessor: incremental detokenization, stop strings, and RequestOutputs grouped per prompt.

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

    def _new_stream(self):
        if self.backend is None:
            return None
        return DecodeStream(ids=self.req.prompt_token_ids[-PROMPT_CONTEXT:],
                            skip_special_tokens=self.req.params.skip_special_tokens)

    def append(self, token_id: int, tokenizer) -> str:
        """Add a token's text; return the new text (possibly empty while a character is incomplete)."""
        if self._stream is not None:
            piece = self._stream.step(self.backend, token_id) or ""
        else:  # a slow tokenizer: decode the whole output again
            full = tokenizer.decode(self.req.output_token_ids,
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


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.groups: dict[str, tuple[str | None, list[int], list[Request]]] = {}
        self.texts: dict[Request, SequenceText] = {}

    def add_group(self, group_id: str, prompt: str | None, prompt_token_ids: list[int], reqs: list[Request]) -> None:
        self.groups[group_id] = (prompt, prompt_token_ids, reqs)
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

    def make_output(self, group_id: str) -> RequestOutput:
        prompt, prompt_token_ids, reqs = self.groups[group_id]
        outputs = []
        for req in reqs:
            seq = self.texts[req]
            outputs.append(CompletionOutput(
                index=req.index, text=seq.text, token_ids=list(req.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=req.status.value if req.is_finished else None, stop_reason=req.stop_reason))
        finished = all(req.is_finished for req in reqs)
        return RequestOutput(group_id, prompt, list(prompt_token_ids), outputs, finished)

    def release(self, group_id: str) -> None:
        _, _, reqs = self.groups.pop(group_id)
        for req in reqs:
            self.texts.pop(req, None)
