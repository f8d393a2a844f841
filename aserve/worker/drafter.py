"""The draft model of speculative decoding: a smaller model with the target's tokenizer, run in the same worker
right after the target's step, with a paged KV cache of its own.

Its cache has its own block tables, handed out here rather than by the scheduler, and its own share of
kv_cache_memory (split so that both caches hold the same number of tokens). The scheduler and the prefix cache
know nothing of it: the draft follows a request while the engine asks it to draft, keeps its K/V across the
target's preemptions, and prefills for itself what the target found in the prefix cache (a draft is small). Its
blocks go back when a request ends, or to a running request that needs them, taken from the requests that did
not run this step, longest idle first.

After each target step, for the requests the engine names (SchedulerOutput.draft_request_ids):
1. catch up: one flat pass over the tokens the draft has not seen: a prompt chunk, or the token or two after
   the proposals of the last step that the target kept (their K/V the draft wrote while proposing them);
2. propose: the catch-up's last logits of a request that sampled give its first proposal; k - 1 passes of one
   token per request give the rest. A greedy request takes the draft's argmax; a sampled one draws from the
   draft's distribution q, shaped as the target's will be (temperature, top-k/p, min-p, penalties), and q is kept
   for the target's rejection sampling in the next step (worker.sampler.rejection_sample).
"""
from __future__ import annotations

import torch

from aserve.attention.backend import batch_order
from aserve.models.interface import ModelShape
from aserve.models.loader import load_model, load_tokenizer, model_shape
from aserve.spec_decode.config import SpeculativeConfig
from aserve.worker.request_state import ProposalRow, RequestState
from aserve.worker.sampler import SampleResult, draw_proposals


def kv_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def split_memory(kv_cache_memory: int, target: ModelShape, draft_dir: str, dtype: torch.dtype) -> tuple[int, int]:
    """kv_cache_memory as (the target's share, the draft's), in proportion to what a token costs each: the two
    caches hold the same number of tokens. The draft's shape comes from its config alone, so every
    tensor-parallel rank (`target`: its own slice) reserves the same share and they agree on the block count."""
    mine, theirs = kv_bytes_per_token(target, dtype), kv_bytes_per_token(model_shape(draft_dir), dtype)
    target_share = kv_cache_memory * mine // (mine + theirs)
    return target_share, kv_cache_memory - target_share


def check_vocabulary(target_tokenizer_dir: str, draft_dir: str) -> None:
    """A draft must speak the target's tokens: the same token -> id map, or it is refused in one line."""
    target, draft = load_tokenizer(target_tokenizer_dir).get_vocab(), load_tokenizer(draft_dir).get_vocab()
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()))[:3]
        raise ValueError(f"speculative_config: the draft model {draft_dir} does not share the target's vocabulary "
                         f"({len(draft)} vs {len(target)} tokens; e.g. {differ}): speculative decoding needs the "
                         f"same tokenizer")


class DraftState:
    """The draft's record of one request: how many of its tokens the draft's cache holds and in which blocks, the
    proposals whose K/V it wrote past them, and its last proposals with their distributions."""

    __slots__ = ("block_table", "num_computed_tokens", "written", "proposed", "q", "last_step")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.written: list[int] = []  # K/V written at num_computed_tokens..: good while the target keeps them
        self.proposed: list[int] = []
        self.q: torch.Tensor | None = None  # [len(proposed), vocab]: what each was drawn from (sampled requests)
        self.last_step = 0


class Drafter:
    """`target`: the worker's ModelRunner (the draft's cache is laid out by the same backend); `memory`: the draft
    cache's share; `max_model_len`: the target's; `budget`: the most tokens one catch-up pass runs."""

    def __init__(self, spec: SpeculativeConfig, target, memory: int, max_model_len: int, budget: int,
                 tokenizer_dir: str):
        from aserve.worker.model_runner import ModelRunner  # the runner module holds the drafter: no import loop

        check_vocabulary(tokenizer_dir, spec.model)
        self.k = spec.num_speculative_tokens
        shape = model_shape(spec.model)
        if shape.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model {spec.model} handles "
                             f"{shape.max_position_embeddings} positions, fewer than max_model_len "
                             f"({max_model_len}); lower max_model_len")
        loaded = load_model(spec.model, str(target.dtype).replace("torch.", ""), target.device,
                            max_model_len=max_model_len + self.k)
        self.runner = ModelRunner(loaded.model, loaded.dtype, target.block_size, memory,
                                  attention_backend=target.backend.name)
        self.model = loaded.model
        self.vocab_size = target.model.shape.vocab_size  # proposals and q live in the target's vocabulary
        self.max_model_len = max_model_len
        self.budget = budget
        self.free = list(range(self.runner.num_blocks - 1, -1, -1))  # a stack: blocks 0, 1, ... go first
        self.states: dict[str, DraftState] = {}
        self.step = 0

    # -- what the model runner asks ---------------------------------------------------------------

    def distributions(self, request_id: str, spec: list[int]) -> torch.Tensor | None:
        """The distributions the proposals `spec` were drawn from (a sampled request's), if they are this
        drafter's last proposals for the request; None otherwise (greedy: the target checks them as it would
        n-gram proposals, which is exact for proposals from anywhere)."""
        state = self.states.get(request_id)
        if state is None or state.q is None or state.proposed[:len(spec)] != spec:
            return None
        return state.q

    def forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free.extend(state.block_table)

    def propose(self, batch: list[tuple[RequestState, int]], sampled: dict[str, SampleResult]) -> dict[str, list[int]]:
        """After the target's step: catch the draft up on `batch` (each request with the tokens the target ran
        for it) and propose for those that sampled a token. Returns the proposals by request id."""
        self.step += 1
        rows, budget = [], self.budget
        for req, n in batch:
            state = self.states.get(req.request_id)
            if state is None:
                state = self.states[req.request_id] = DraftState()
            state.last_step = self.step
            self._keep_accepted(state, req.all_token_ids)
            result = sampled.get(req.request_id)
            if result is not None and result.error is not None:
                continue
            end = req.num_tokens if result is not None else req.num_computed_tokens + n
            start = state.num_computed_tokens
            count = min(end - start, budget)
            if count <= 0:
                continue
            wants = min(self.k, self.max_model_len - end) if result is not None and start + count == end else 0
            if not self._reserve(state, start + count + max(wants - 1, 0)):
                continue
            budget -= count
            rows.append((req, state, start, count, wants))
        if not rows:
            return {}
        keyed = sorted(((batch_order(row[3], row[2], row[0].num_prompt_tokens), row) for row in rows),
                       key=lambda x: x[0])  # decodes first, as the backend wants them
        rows = [row for _, row in keyed]
        logits = self._run([(state, req.all_token_ids[start:start + count], start)
                            for req, state, start, count, _ in rows], [order for order, _ in keyed],
                           [wants > 0 for *_, wants in rows])
        for req, state, start, count, _ in rows:
            state.num_computed_tokens = start + count
        return self._draw([(req, state, wants) for req, state, _, _, wants in rows if wants > 0], logits)

    # -- inside ---------------------------------------------------------------------------------------

    @staticmethod
    def _keep_accepted(state: DraftState, tokens: list[int]) -> None:
        """The proposals it wrote last step that the request's tokens now hold (the target kept them) count as
        computed; the last proposals are spent either way."""
        done, written = state.num_computed_tokens, state.written
        keep = 0
        while keep < len(written) and done + keep < len(tokens) and tokens[done + keep] == written[keep]:
            keep += 1
        state.num_computed_tokens = done + keep
        state.written, state.proposed, state.q = [], [], None

    def _draw(self, proposing: list[tuple[RequestState, DraftState, int]], logits: torch.Tensor | None):
        """Proposals one position at a time: the draft's token at each, then a one-token pass for the next."""
        drafts: dict[str, list[int]] = {}
        qs: dict[str, list[torch.Tensor]] = {}
        live = proposing
        for j in range(max((wants for *_, wants in proposing), default=0)):
            if j:
                logits = self._run([(state, [drafts[req.request_id][-1]], state.num_computed_tokens + j - 1)
                                    for req, state, _ in live], [0] * len(live))  # a token each, past the prompt
            tokens, q = draw_proposals(logits, [ProposalRow(req, drafts.get(req.request_id, []))
                                                for req, _, _ in live])
            grown = []
            for (req, state, wants), token, dist in zip(live, tokens, q):
                if token is None:
                    continue
                drafts.setdefault(req.request_id, []).append(token)
                if dist is not None:
                    qs.setdefault(req.request_id, []).append(dist)
                if j + 1 < wants:
                    grown.append((req, state, wants))
            live = grown
            if not live:
                break
        for req, state, _ in proposing:
            proposed = drafts.get(req.request_id)
            if proposed:
                state.proposed, state.written = proposed, proposed[:-1]
                state.q = torch.stack(qs[req.request_id]) if req.request_id in qs else None
        return drafts

    def _run(self, rows: list[tuple[DraftState, list[int], int]], orders: list[int], want: list[bool] | None = None):
        """One forward of the draft over `rows` (state, tokens, first position; sorted by their batch_order,
        `orders`): writes their K/V and returns the logits at each row's last token (of the rows in `want`), in the
        target's vocabulary."""
        runner = self.runner
        counts = [len(tokens) for _, tokens, _ in rows]
        positions, meta = runner.flat_batch([state.block_table for state, _, _ in rows],
                                            [start for _, _, start in rows], counts, orders)
        input_ids = torch.tensor([t for _, tokens, _ in rows for t in tokens])
        if runner.device.type != "cpu":
            input_ids, positions = input_ids.to(runner.device), positions.to(runner.device)
        hidden = self.model(input_ids, positions, runner.layer_caches, meta)
        last = torch.cumsum(torch.tensor(counts), 0) - 1
        if want is not None:
            last = last[torch.tensor(want)]
        if not len(last):
            return None
        logits = self.model.compute_logits(hidden[last.to(hidden.device)])
        vocab = self.vocab_size
        if logits.shape[-1] > vocab:
            return logits[:, :vocab]
        if logits.shape[-1] < vocab:
            return torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
        return logits

    def _reserve(self, state: DraftState, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of the request in the draft's cache; False when even the idle requests'
        blocks are not enough (it then drafts nothing this step)."""
        need = -(-num_tokens // self.runner.block_size) - len(state.block_table)
        if need > len(self.free):
            idle = sorted((s for s in self.states.values() if s.last_step < self.step), key=lambda s: s.last_step)
            for other in idle:
                if need <= len(self.free):
                    break
                self.free.extend(other.block_table)
                other.block_table, other.num_computed_tokens, other.written = [], 0, []
            if need > len(self.free):
                return False
        for _ in range(max(need, 0)):
            state.block_table.append(self.free.pop())
        return True
