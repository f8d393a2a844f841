"""Sampler: logits of the rows that sample this step -> next tokens (and logprobs), batched.

Order as in vLLM: raw logprobs (for `logprobs`), min_tokens masking, penalties, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> inverse-CDF sampling. A seeded request draws its uniform from
its own generator, so its text does not depend on what else is in the batch.

It runs where the logits are: its small tensors (parameters, uniforms, indices) are made on the logits' device,
and what comes back to the host is the sampled token ids, the logprobs asked for, and a flag saying whether any
row is unusable (its row indices when one is). On the CPU that is the same work as before: there is nothing to
move. The uniforms are drawn on the host, from the same generators on every device, and uploaded.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from aserve.ops import cpu_kernels
from aserve.worker.request_state import RequestState


FP32_MAX = torch.finfo(torch.float32).max  # a larger factor (JSON allows 1e300) would round to inf in fp32
MIN_TEMPERATURE = 0.01  # as vLLM: dividing by less overflows fp32 logits (to inf, then NaN in the softmax)


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # raw log-softmax of the chosen token, when logprobs were asked
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # this row's logits were unusable: the engine ends the request with an error
    # Speculative decoding: the results of the proposals accepted before this token (each sampled as this one was,
    # so each carries its own logprobs); multi-step decoding: the earlier steps' results. None without either.
    accepted: list["SampleResult"] | None = None

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step gave the request: the accepted proposals, then its own."""
        return [r.token_id for r in self.accepted or ()] + [self.token_id]


UNUSABLE = "the model produced NaN or infinite logits for it"  # a row's error where unusable_rows finds it


def apply_penalties(logits: torch.Tensor, reqs: list[RequestState], rows: list[int]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place, at the tokens each row
    has seen and nowhere else: O(the rows' tokens) a step, not O(rows x vocabulary) of counts and masks rebuilt
    from Python lists every step (64 rows of 128-token prompts: 2.0 against 17.1 ms a step; of 2048-token prompts
    8.6 against 41.3; AMD EPYC Zen 4, 2 threads). On the CPU aserve's kernel counts each row's tokens in an array
    of its own instead of sorting all the (row, token) pairs (csrc/sampling.cpp): 0.58 and 1.39 ms a step where
    that took 1.80 and 5.26. The same operations on the same values as over the whole vocabulary, so the same bits
    (RequestState.penalty_tokens keeps the tensors it reads)."""
    vocab, device = logits.shape[-1], logits.device
    prompts, outputs = zip(*(reqs[i].penalty_tokens() for i in rows))
    by_row = torch.tensor([[min(r.params.repetition_penalty, FP32_MAX), r.params.frequency_penalty,
                            r.params.presence_penalty] for r in (reqs[i] for i in rows)])
    if logits.dim() == 2 and logits.stride(-1) == 1 and cpu_kernels.usable(logits):
        torch.ops.aserve.apply_penalties(logits, torch.tensor(rows), torch.cat(prompts),
                                         torch.tensor([len(t) for t in prompts]), torch.cat(outputs),
                                         torch.tensor([len(t) for t in outputs]), by_row)
        return
    row_ids = torch.tensor(rows)  # a (row, token) pair is the key row * vocab + token (ids < vocab: admission)
    out_keys = torch.repeat_interleave(row_ids, torch.tensor([len(t) for t in outputs])) * vocab + torch.cat(outputs)
    prompt_keys = torch.repeat_interleave(row_ids, torch.tensor([len(t) for t in prompts])) * vocab + torch.cat(prompts)
    keys = torch.cat([prompt_keys, out_keys]).unique()  # sorted: the pairs seen in the prompt or the output
    out_keys, counts = out_keys.unique(return_counts=True)
    at = torch.searchsorted(keys, out_keys)  # every output pair is a seen pair
    penalty = torch.ones(logits.shape[0], 3)  # per logits row: repetition, frequency, presence
    penalty[row_ids] = by_row
    penalty = penalty.to(device)
    keys, out_keys, counts, at = keys.to(device), out_keys.to(device), counts.to(device), at.to(device)
    row, token = keys // vocab, keys % vocab
    x = logits[row, token]
    rep = penalty[row, 0]
    x = torch.where(x > 0, x / rep, x * rep)
    out_row = out_keys // vocab
    x[at] = x[at] - penalty[out_row, 1] * counts.to(x.dtype) - penalty[out_row, 2]
    logits[row, token] = x.to(logits.dtype)


FILTER_CANDIDATES = (64, 1024)  # how many of a row's top logits _filter reads, before it sorts the whole row


def _filter(logits: torch.Tensor, reqs: list[RequestState]) -> torch.Tensor:
    """top-k, top-p and min-p on temperature-scaled logits [R, V], all rows at once, each where its row asks for it:
    a running sum in fp32 can reach top_p = 1 before a row's last token, and that row would lose its tail.

    On the CPU, aserve's kernel cuts each row at values found by a radix select, no sort (filter_rows,
    csrc/sampling.cpp). Elsewhere: each rule drops a token only after the ones ranked before it, so a row whose 65th
    logit is dropped keeps only tokens among its top 64: those rows are filtered from torch.topk, the others from
    their top 1024 the same way, and only the rows left sort their whole row. Sorting 64 rows of 32000 logits took
    ~110 ms on 2 cores, more than a decode step; their top 64 ~6 ms, the kernel 2-4 ms whatever the rows (AMD EPYC
    Zen 4). The kernel keeps the tokens a stable sort keeps (equal logits ranked by index); torch's sort and topk
    may rank them otherwise."""
    vocab, device = logits.shape[-1], logits.device
    top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in reqs], device=device).unsqueeze(1)
    top_p = torch.tensor([r.params.top_p for r in reqs], device=device).unsqueeze(1)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=device).unsqueeze(1)
    if logits.stride(-1) == 1 and cpu_kernels.usable(logits):
        return torch.ops.aserve.filter_rows(logits, top_k.view(-1), top_p.view(-1), min_p.view(-1))
    last = FILTER_CANDIDATES[-1]
    out, rest, to_sort = None, torch.arange(len(reqs), device=device), []  # rest: the rows not settled yet
    for count in FILTER_CANDIDATES:
        if vocab <= 2 * count or len(rest) == 0:
            break
        rows, k, p, m = (x[rest] for x in (logits, top_k, top_p, min_p))
        values, order = rows.topk(count + 1, dim=-1)
        # The softmax's sum: over the candidates where top-k keeps only tokens among them, else the whole row.
        whole = torch.where(k <= count + 1, float("-inf"), rows.logsumexp(dim=-1, keepdim=True))
        kept, settled, reach = _drops(values, k, p, m, whole, last + 1)
        done = settled.nonzero().squeeze(1)
        if len(done):
            if out is None:
                out = torch.full_like(logits, float("-inf"))
            out[rest[done]] = torch.full((len(done), vocab), float("-inf"), dtype=logits.dtype,
                                         device=device).scatter_(1, order[done, :-1], kept[done, :-1])
        # A row no top 1025 can settle (a flat row, whose top-p keeps most of it) is sorted now, not read again.
        hopeless = ((k > last + 1) & (m == 0) & (reach < p)).squeeze(1)
        to_sort.append(rest[~settled & hopeless])
        rest = rest[~settled & ~hopeless]
    if out is None:  # every row sorts
        return _filter_sorted(logits, top_k, top_p, min_p)
    left = torch.cat(to_sort + [rest])
    if len(left):
        out[left] = _filter_sorted(logits[left], top_k[left], top_p[left], min_p[left])
    return out


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """_filter over whole sorted rows."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kept, _, _ = _drops(sorted_logits, top_k, top_p, min_p, None)
    return logits.scatter(1, order, kept)


def _drops(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           others: torch.Tensor | None, within: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ranked high to low with the filters' drops set to -inf, whether each row drops its last one (so
    every token ranked after it too), and the most probability its top `within` tokens can hold (each one past
    these at most the last one's). `others`: None where these are the whole row; else the row's logsumexp
    where the softmax spans tokens past these, -inf where top-k keeps only tokens among them."""
    ranks = torch.arange(ranked.shape[-1], device=ranked.device).unsqueeze(0)
    drop = ranks >= top_k
    ranked = ranked.masked_fill(drop, float("-inf"))
    if others is None:
        probs = ranked.softmax(dim=-1)
    else:
        probs = (ranked - torch.maximum(ranked.logsumexp(dim=-1, keepdim=True), others)).exp()
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1)  # the smallest prefix whose mass reaches top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    reach = probs.sum(dim=-1, keepdim=True) + max(0, within - probs.shape[-1]) * probs[:, -1:]
    return ranked.masked_fill(drop, float("-inf")), drop[:, -1], reach


def greedy(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima), as torch.argmax gives it. aserve's CPU kernel reads the
    row once in its own dtype: torch's argmax over a bf16 row of 49152 logits took ~165 us, 5% of a GPTQ batch-1
    step (AMD EPYC Zen 5)."""
    if x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] > 0 and cpu_kernels.usable(x):
        return torch.ops.aserve.argmax_rows(x)
    return x.argmax(dim=-1)


def draw(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform draw per row instead of one per vocabulary entry: the first token whose
    cumulative softmax mass passes the draw. aserve's CPU kernel does it in one pass over each row; the torch path
    writes the probabilities and their running sums."""
    if x.stride(-1) == 1 and cpu_kernels.usable(x):  # fp32, bf16 or fp16, read as they are
        return torch.ops.aserve.sample_inverse_cdf(x, uniform)
    cdf = x.float().softmax(dim=-1).cumsum_(dim=-1)
    picked = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return picked.clamp_(max=x.shape[-1] - 1)


def unusable_rows(logits: torch.Tensor) -> list[int]:
    """Rows whose logits hold a NaN or +inf, or are all -inf: nothing can be sampled from them.
    (On the CPU, aserve's kernel first counts the rows with anything not finite, one pass; where there are none,
    that is the answer. Otherwise one reduction over the batch's logits; amax propagates NaN. One flag crosses to
    the host, and the rows' indices only when there are any.)"""
    if logits.dim() == 2 and logits.stride(-1) == 1 and cpu_kernels.usable(logits) and \
            not torch.ops.aserve.count_nonfinite_rows(logits):
        return []
    peak = logits.amax(dim=-1)
    bad = ~torch.isfinite(peak)
    return bad.nonzero().flatten().tolist() if bad.any() else []


@contextmanager
def keeping_a_candidate(logits: torch.Tensor, rows: list[int]):
    """Undo, row by row, a soft preference (min_tokens, penalties) that left a row nothing to sample: a grammar
    that must end now outranks min_tokens, and a penalty that overflows every allowed logit to -inf must not
    turn the draw into noise that the grammar then rejects."""
    index = torch.tensor(rows, device=logits.device)
    before = logits[index]
    yield
    emptied = ~torch.isfinite(logits[index].amax(dim=-1))
    if emptied.any():
        logits[index[emptied]] = before[emptied]


def plain_greedy(r: RequestState) -> bool:
    """A greedy row whose token is its logits' argmax and nothing more (no logprobs, penalties, bias, min_tokens or
    beams)."""
    return r.params.greedy and reads_logits_as_they_are(r)


def plain_draw(r: RequestState) -> bool:
    """A sampled row whose token is the inverse-CDF draw from its logits over its temperature and nothing more (no
    top-k, top-p or min-p, logprobs, penalties, bias, min_tokens still to reach, beams, or a draft to check)."""
    p = r.params
    return not p.greedy and _unsteered(r) and _unfiltered(p) and r.draft_q is None


class StepDraws(NamedTuple):
    """What `sample` would draw plain-draw rows' tokens with over several steps (step_draws)."""
    uniforms: torch.Tensor  # [steps, rows]: each step's uniforms(rows), in the order the steps would draw them
    temperatures: torch.Tensor | None  # [rows], clamped as `scale` clamps them; None where all are 1 (the logits
    # are then drawn from as they are, else widened to fp32 and divided)


def step_draws(reqs: list[RequestState], steps: int) -> tuple[StepDraws, Callable[[int], None]]:
    """The draws of `steps` steps of plain-draw rows (plain_draw), made now, and `keep(n)`: leave the generators
    (torch's and the seeded requests' own) as if only the first n steps had drawn, for steps that did not run."""
    saved = torch.get_rng_state(), [r.generator.get_state() if r.generator is not None else None for r in reqs]
    draws = torch.stack([uniforms(reqs) for _ in range(steps)])
    scaled = _temperatures(reqs, torch.device("cpu"))

    def keep(n: int) -> None:
        if n < steps:
            torch.set_rng_state(saved[0])
            for r, state in zip(reqs, saved[1]):
                if state is not None:
                    r.generator.set_state(state)
            for _ in range(n):
                uniforms(reqs)
    return StepDraws(draws, scaled), keep


def reads_logits_as_they_are(r: RequestState) -> bool:
    """True where this row's token comes from the model's logits untouched (greedy, or a plain draw at
    temperature 1): argmax and the draw then read 16-bit logits directly, as exact as from an fp32 copy."""
    p = r.params
    return _unsteered(r) and (p.greedy or (p.temperature == 1.0 and _unfiltered(p)))


def _unsteered(r: RequestState) -> bool:
    """No logprobs to report, beams, min_tokens still to reach, penalties or bias: nothing changes the logits or
    reads them besides the token's choice."""
    p = r.params
    return (p.logprobs is None and p.beam is None and r.num_output_tokens >= p.min_tokens and not p.needs_penalties
            and not p.logit_bias)


def _unfiltered(p) -> bool:
    """No top-k, top-p or min-p."""
    return not p.top_k and p.top_p >= 1 and p.min_p <= 0


def _beam_logits(logits: torch.Tensor, reqs: list[RequestState], rows: list[int]) -> torch.Tensor:
    """The beam rows' logits in fp32, divided by their temperature where that is > 0 and not 1."""
    x = logits[torch.tensor(rows, device=logits.device)].float()
    temperatures = [r.params.beam.temperature for r in reqs]
    if any(t > 0 and t != 1.0 for t in temperatures):
        x = x / torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=x.device).clamp_(
            MIN_TEMPERATURE, FP32_MAX).unsqueeze(1)
    return x


def beam_log_normalizers(logits: torch.Tensor, reqs: list[RequestState]) -> torch.Tensor | None:
    """Each beam row's log-partition, taken before a grammar masks the logits, so that a constrained beam's scores
    stay the model's own log-probabilities (as in transformers, whose logits processors mask after its
    log-softmax): one per beam row, in row order; None without beam rows."""
    rows = [i for i, r in enumerate(reqs) if r.params.beam is not None]
    return _beam_logits(logits, [reqs[i] for i in rows], rows).logsumexp(dim=-1) if rows else None


def beam_candidates(logits: torch.Tensor, reqs: list[RequestState], rows: list[int],
                    normalizers: torch.Tensor | None = None) -> list[list[tuple[int, float]]]:
    """Beam-search rows: each one's best `beam_candidates` next tokens and their log-probabilities, best first, as
    transformers scores them (fp32 log-softmax; of logits / temperature where that is > 0); tokens a grammar
    masked are left out. `normalizers`: the rows' log-partitions from before the mask (beam_log_normalizers).
    The engine picks the beams from these; the row's sampled token is not used."""
    x = _beam_logits(logits, reqs, rows)
    x = x - normalizers.unsqueeze(1) if normalizers is not None else x.log_softmax(dim=-1)
    k = min(max(r.params.beam_candidates for r in reqs), x.shape[-1])
    values, ids = x.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [[(t, v) for t, v in zip(ids[j][:r.params.beam_candidates], values[j][:r.params.beam_candidates])
             if v != -math.inf]
            for j, r in enumerate(reqs)]


def steer(logits: torch.Tensor, reqs: list[RequestState]) -> None:
    """min_tokens (stop ids banned before it), logit_bias and the penalties, in that order (vLLM's), in place, on
    writable fp32 logits."""
    held_back = {}  # row -> the stop ids min_tokens bans there
    biased, penalized = [], []  # one walk of the rows finds all three kinds
    for i, r in enumerate(reqs):
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
            if banned:
                held_back[i] = banned
        if p.logit_bias:
            biased.append(i)
        if p.needs_penalties:
            penalized.append(i)
    if held_back:
        with keeping_a_candidate(logits, list(held_back)):
            for i, banned in held_back.items():
                logits[i, banned] = float("-inf")
    for i in biased:
        bias = reqs[i].params.logit_bias
        logits[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    if penalized:
        with keeping_a_candidate(logits, penalized):
            apply_penalties(logits, reqs, penalized)


def scale(x: torch.Tensor, sub: list[RequestState]) -> torch.Tensor:
    """Sampled rows' logits divided by their temperature, then top-k, top-p and min-p on the rows that ask for them.
    The other rows stay as they are, so that a seeded request draws the same tokens whatever else is in the batch."""
    temperatures = _temperatures(sub, x.device)
    if temperatures is not None:
        x = x / temperatures.unsqueeze(1)
    filtered = [j for j, r in enumerate(sub) if not _unfiltered(r.params)]
    if len(filtered) == len(sub):
        x = _filter(x, sub)
    elif filtered:
        rows = torch.tensor(filtered, device=x.device)
        x = x.index_copy(0, rows, _filter(x[rows], [sub[j] for j in filtered]))
    return x


def _temperatures(reqs: list[RequestState], device: torch.device) -> torch.Tensor | None:
    """The rows' temperatures, clamped to what fp32 logits can be divided by; None where all are 1."""
    temperatures = [r.params.temperature for r in reqs]
    if all(t == 1.0 for t in temperatures):
        return None
    return torch.tensor(temperatures, device=device).clamp_(MIN_TEMPERATURE, FP32_MAX)


def uniforms(sub: list[RequestState]) -> torch.Tensor:
    """One uniform draw per row, on the host (the generators' device): a seeded request's from its own generator."""
    uniform = torch.rand(len(sub))
    for j, r in enumerate(sub):
        if r.generator is not None:
            uniform[j] = torch.rand(1, generator=r.generator)
    return uniform


def rejection_sample(x: torch.Tensor, q: torch.Tensor, proposed: torch.Tensor, accept_u: torch.Tensor,
                     residual_u: torch.Tensor) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for rows checking a draft model's proposal
    d, drawn from the draft's distribution q: keep d with probability min(1, p(d) / q(d)), else draw from
    max(p - q, 0) normalized. The token that comes out follows p = softmax(x) exactly, whatever q is. A rejected
    row's token is never d (there p(d) < q(d), so its residual is 0), which is how the caller tells them apart."""
    p = x.float().softmax(dim=-1)
    p_d = p.gather(1, proposed.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, proposed.unsqueeze(1)).squeeze(1)
    keep = accept_u * q_d < p_d
    residual = (p - q).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: never rejected
    cdf = residual.cumsum_(dim=-1)
    picked = torch.searchsorted(cdf, residual_u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return torch.where(keep, proposed, picked.clamp_(max=x.shape[-1] - 1))


def draw_proposals(logits: torch.Tensor, reqs: list[RequestState]) -> tuple[list[int | None], list]:
    """A draft model's next tokens, one per row: a greedy request's is the draft's argmax; a sampled one's is drawn
    from the draft's distribution q, shaped as the target's will be (min_tokens, logit_bias, penalties,
    temperature, top-k, top-p, min-p), and q comes back with it for the target's rejection sampling (None for greedy rows). A row
    whose logits are unusable proposes nothing (None)."""
    bad = set(unusable_rows(logits))
    logits = logits.float()
    if bad:
        logits[list(bad)] = 0.0
    steer(logits, reqs)
    tokens = greedy(logits)
    q: list = [None] * len(reqs)
    random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if random_rows:
        sub = [reqs[i] for i in random_rows]
        index = torch.tensor(random_rows, device=logits.device)
        x = scale(logits[index], sub)
        tokens[index] = draw(x, uniforms(sub).to(logits.device))
        for i, row in zip(random_rows, x.softmax(dim=-1)):
            q[i] = row
    return [None if i in bad else t for i, t in enumerate(tokens.tolist())], q


def sample(logits: torch.Tensor, reqs: list[RequestState],
           beam_normalizers: torch.Tensor | None = None) -> list[SampleResult]:
    """One token per row (or, for a beam-search row, its candidates). `beam_normalizers`: see beam_candidates."""
    if all(map(plain_greedy, reqs)) and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0 and \
            cpu_kernels.usable(logits):  # argmax and the check for unusable rows in one pass (greedy_rows)
        return [SampleResult(t) if t >= 0 else SampleResult(0, error=UNUSABLE)
                for t in torch.ops.aserve.greedy_rows(logits).tolist()]
    n, device = len(reqs), logits.device
    bad_rows = unusable_rows(logits)
    if logits.dtype != torch.float32 and (bad_rows or not all(map(reads_logits_as_they_are, reqs))):
        logits = logits.float()  # what follows writes to the logits or needs fp32 arithmetic
    if bad_rows:  # sample the rest as usual; these rows get an error instead of a token
        logits[bad_rows] = 0.0
    want_logprobs = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(dim=-1) if want_logprobs else None

    steer(logits, reqs)

    random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if len(random_rows) < n:
        tokens = greedy(logits)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=device)
    if random_rows:
        sub = [reqs[i] for i in random_rows]
        index = torch.tensor(random_rows, device=device)
        x = scale(logits if len(random_rows) == n else logits[index], sub)
        uniform = uniforms(sub)
        tokens[index] = draw(x, uniform.to(device))
        drafted = [j for j, r in enumerate(sub) if r.draft_q is not None]
        if drafted:  # rows checking a draft model's proposal: rejection sampling against its distribution
            rows = torch.tensor(drafted, device=device)
            tokens[index[rows]] = rejection_sample(
                x[rows], torch.stack([sub[j].draft_q for j in drafted]),
                torch.tensor([sub[j].draft_token for j in drafted], device=device), uniform[drafted].to(device),
                uniforms([sub[j] for j in drafted]).to(device))

    token_list = tokens.tolist()  # what every step brings to the host
    results = [SampleResult(t) for t in token_list]
    if raw_logprobs is not None:  # and the logprobs asked for: a few numbers a row, each tensor in one transfer
        k = max(reqs[i].params.logprobs for i in want_logprobs)
        chosen = tokens[torch.tensor(want_logprobs, device=device)]
        chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
        chosen_lps, rank_list = chosen_lp.tolist(), ranks.tolist()
        top_vals, top_ids = (top_vals.tolist(), top_ids.tolist()) if k else (None, None)
        for j, i in enumerate(want_logprobs):
            res, kk = results[i], reqs[i].params.logprobs
            res.logprob, res.rank = chosen_lps[j], rank_list[j]
            res.top_logprobs = list(zip(top_ids[j][:kk], top_vals[j][:kk])) if kk else []
    beam_rows = [i for i, r in enumerate(reqs) if r.params.beam is not None]
    if beam_rows:
        for i, candidates in zip(beam_rows, beam_candidates(logits, [reqs[i] for i in beam_rows], beam_rows,
                                                                       beam_normalizers)):
            results[i].top_logprobs = candidates
    for i in bad_rows:
        results[i] = SampleResult(results[i].token_id, error=UNUSABLE)
    assert len(results) == n
    return results
