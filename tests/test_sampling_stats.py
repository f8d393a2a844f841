"""The sampler draws from the distribution that temperature, top-k, top-p and min-p define (vLLM's meanings).

Each test samples many rows of one fixed logit vector in a single batched call, derives the expected
distribution by hand from the definitions, and applies a chi-square goodness-of-fit test. The draws are
seeded, so every run sees the same counts: a pass or a fail is reproducible, not a matter of luck.
"""
from __future__ import annotations

import math

import pytest
import torch

from aserve.worker.request_state import RequestState
from aserve.sampling_params import SamplingParams
from aserve.worker.sampler import sample

# Distinct values, deliberately not sorted, so the sampler's sort-and-scatter back to vocabulary order matters.
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.2, -0.5, 1.5, 0.0, -2.0, 1.0, -3.0, 0.5, -1.5])
DRAWS = 40_000
MIN_P_VALUE = 1e-4  # a correct sampler passes at this level; the draws are seeded, so it always does


def draw_tokens(rows: list[RequestState], seed: int) -> torch.Tensor:
    """One sampler call over len(rows) copies of LOGITS; the global generator is seeded, then restored.
    Unseeded rows only read their request, so one RequestState may stand for many rows."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        results = sample(LOGITS.expand(len(rows), -1).clone(), rows)
    return torch.tensor([r.token_id for r in results])


def draw_counts(params: SamplingParams, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """How often each token is drawn in `draws` samples of LOGITS under `params`."""
    tokens = draw_tokens([RequestState("row", [1], params)] * draws, seed)
    return torch.bincount(tokens, minlength=LOGITS.numel())


def expected_distribution(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> torch.Tensor:
    """vLLM's definitions, written out one token at a time: softmax(logits / T); keep the k most likely;
    keep the most likely tokens until their mass reaches top_p (a token stays if the mass strictly above it
    is < top_p); keep tokens whose probability is >= min_p times the largest; renormalise what is kept."""
    probs = (LOGITS.double() / temperature).softmax(dim=-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = set(ranked[:top_k] if top_k else ranked)
    mass_of_kept = sum(probs[t] for t in kept)
    above = 0.0
    for t in ranked:
        if t not in kept:
            continue
        share = probs[t] / mass_of_kept
        assert abs(above - top_p) > 1e-3 or top_p == 1.0, "top_p sits on a boundary; pick another value"
        if above >= top_p:
            kept.discard(t)
        above += share
    largest = probs[ranked[0]]
    for t in list(kept):
        if min_p:
            assert abs(probs[t] - min_p * largest) > 1e-4, "min_p sits on a boundary; pick another value"
        if probs[t] < min_p * largest:
            kept.discard(t)
    out = torch.tensor([probs[t] if t in kept else 0.0 for t in range(len(probs))], dtype=torch.float64)
    return out / out.sum()


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit over the tokens with nonzero expected probability (scipy's when installed; otherwise
    the chi-square survival function as the regularized upper incomplete gamma function)."""
    allowed = expected_probs > 0
    obs = observed[allowed].double()
    exp = expected_probs[allowed] * obs.sum()
    assert exp.min() >= 5, "too few draws for a chi-square test on this distribution"
    try:
        from scipy.stats import chisquare
    except ImportError:
        return chi_square_survival(float(((obs - exp) ** 2 / exp).sum()), int(allowed.sum()) - 1)
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def chi_square_survival(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    outside = counts[expected == 0]
    assert outside.sum() == 0, f"drew filtered-out tokens: {counts.tolist()} vs expected {expected.tolist()}"
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, (f"p = {p_value:.2e}: observed {counts.tolist()}, "
                                   f"expected {(expected * counts.sum()).round().tolist()}")


FILTERS = {
    "temperature 0.7": dict(temperature=0.7),
    "temperature 1.5": dict(temperature=1.5),
    "top_k 4": dict(temperature=1.0, top_k=4),
    "top_p 0.8": dict(temperature=1.0, top_p=0.8),
    "min_p 0.15": dict(temperature=1.0, min_p=0.15),
    # top_p on the renormalised top 7 keeps 6 tokens; on all 12 (a wrong order of filters) it would keep 7
    "all at once": dict(temperature=0.8, top_k=7, top_p=0.95, min_p=0.05),
}


@pytest.mark.parametrize("options", FILTERS.values(), ids=FILTERS.keys())
def test_sampling_follows_the_filtered_softmax(options):
    """Each option alone and all together: counts fit the hand-computed distribution, nothing else is drawn."""
    expected = expected_distribution(**options)
    if set(options) != {"temperature"}:
        assert (expected == 0).any(), "the filter should exclude some tokens, or the test shows nothing"
    counts = draw_counts(SamplingParams(**options))
    assert_follows(counts, expected)


def test_a_mixed_batch_gives_each_row_its_own_distribution():
    """Rows with different options in one batch (and greedy rows among them) each keep their own filter."""
    greedy, hot, nucleus = (SamplingParams(temperature=0), SamplingParams(temperature=1.5),
                            SamplingParams(temperature=0.7, top_p=0.8, top_k=5))
    rows = [RequestState(f"r{i}", [1], params) for i, params in enumerate((greedy, hot, nucleus))] * (DRAWS // 2)
    by_kind = draw_tokens(rows, seed=1).view(-1, 3)
    assert (by_kind[:, 0] == int(LOGITS.argmax())).all()
    assert_follows(torch.bincount(by_kind[:, 1], minlength=LOGITS.numel()), expected_distribution(temperature=1.5))
    assert_follows(torch.bincount(by_kind[:, 2], minlength=LOGITS.numel()),
                   expected_distribution(temperature=0.7, top_p=0.8, top_k=5))


def test_seeded_requests_follow_the_distribution_across_steps():
    """A seeded request draws from its own generator step after step; those draws follow the distribution too."""
    params = [SamplingParams(temperature=1.0, top_k=6, seed=seed) for seed in range(500)]
    reqs = [RequestState(f"s{i}", [1], p) for i, p in enumerate(params)]
    counts = torch.zeros(LOGITS.numel(), dtype=torch.long)
    for _ in range(30):  # 15,000 draws: each request's generator advances once per step
        counts += torch.bincount(draw_tokens(reqs, seed=0), minlength=LOGITS.numel())
    assert_follows(counts, expected_distribution(temperature=1.0, top_k=6))


def test_the_check_rejects_a_wrong_distribution():
    """Negative control: draws at temperature 1.0 are rejected as samples of temperature 1.2, and a nucleus one
    token too wide is caught, so the tests above have the power to notice a sampler that is slightly off."""
    counts = draw_counts(SamplingParams(temperature=1.0))
    assert chi_square_p_value(counts, expected_distribution(temperature=1.0)) > MIN_P_VALUE
    assert chi_square_p_value(counts, expected_distribution(temperature=1.2)) < 1e-12
    nucleus = draw_counts(SamplingParams(temperature=1.0, top_p=0.8))
    one_more = expected_distribution(temperature=1.0, top_p=0.85)
    assert int((one_more > 0).sum()) == int((expected_distribution(temperature=1.0, top_p=0.8) > 0).sum()) + 1
    assert chi_square_p_value(nucleus, one_more) < 1e-12


def test_chi_square_survival_matches_known_quantiles():
    """The fallback used without scipy gives the textbook critical values."""
    assert math.isclose(chi_square_survival(3.841459, 1), 0.05, rel_tol=1e-5)
    assert math.isclose(chi_square_survival(9.210340, 2), 0.01, rel_tol=1e-5)
    assert math.isclose(chi_square_survival(29.58830, 10), 0.001, rel_tol=1e-4)
