"""Verification by hand-built distributions, and a statistical check that sampling is lossless."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dflash.decoding.sampling import SamplingParams, to_probs
from dflash.decoding.verify import greedy_verify, rejection_sample

V = 6


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    logits = torch.full((1, len(tokens), V), -10.0)
    logits[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_greedy_perfect_match_early_mismatch_and_all_rejected():
    target = one_hot_logits([1, 2, 3, 4])  # target wants 1, 2, 3, then bonus 4
    for draft, accepted, new in [([1, 2, 3], 3, [1, 2, 3, 4]), ([1, 5, 3], 1, [1, 2]), ([0, 2, 3], 0, [1])]:
        n, tokens = greedy_verify(torch.tensor([draft]), target)
        assert int(n[0]) == accepted
        assert tokens[0, : accepted + 1].tolist() == new


def test_greedy_empty_draft_is_plain_decoding():
    n, tokens = greedy_verify(torch.zeros(1, 0, dtype=torch.long), one_hot_logits([4]))
    assert int(n[0]) == 0 and tokens[0, :1].tolist() == [4]


def dist(*probs: float) -> torch.Tensor:
    return torch.tensor(probs + (0.0,) * (V - len(probs)))


def test_rejection_perfect_match_accepts_all_and_adds_bonus():
    p = torch.stack([dist(0, 1), dist(0, 0, 1), dist(0, 0, 0, 1)])  # deterministic target
    q = p[:2].clone()
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert rejection_sample(torch.tensor([1, 2]), q, p, g) == [1, 2, 3]


def test_rejection_early_mismatch_recovers_from_the_residual():
    p = torch.stack([dist(0, 1), dist(0, 0, 1), dist(0, 0, 0, 1)])
    q = torch.stack([dist(0, 1), dist(0, 0, 0, 0, 1)])  # second draft token (4) has p = 0
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(torch.tensor([1, 4]), q, p, g) == [1, 2]


def test_rejection_all_rejected():
    p = torch.stack([dist(1), dist(1), dist(1)])
    q = torch.stack([dist(0, 1), dist(0, 1)])
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(torch.tensor([1, 1]), q, p, g) == [0]


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to a distribution, over the distribution's support."""
    support = probs > 0
    obs = observed[support].double().numpy()
    expected = probs[support].double().numpy()
    return float(chisquare(obs, expected / expected.sum() * obs.sum()).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, top_k=3)])
def test_sampled_tokens_follow_the_target_distribution(params):
    """Chi-square over many seeds: the first and second output tokens follow p, not the drafter's q."""
    torch.manual_seed(0)
    target_logits = torch.randn(3, V) * 1.5
    draft_logits = torch.randn(2, V) * 1.5
    p = to_probs(target_logits, params)
    q = to_probs(draft_logits, params)
    n = 6000
    first = torch.zeros(V)
    second_given = torch.zeros(V)
    second_count = 0
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        draft = torch.stack([torch.multinomial(q[i], 1, generator=g) for i in range(2)]).squeeze(-1)
        out = rejection_sample(draft, q, p, g)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == draft[0]:  # position 2 is drafted in context of an accepted first token
            second_given[out[1]] += 1
            second_count += 1
    assert first[p[0] == 0].sum() == 0
    assert chi2_pvalue(first, p[0]) > 1e-3, (first, p[0] * n)
    if second_count > 300:  # only when the drafter's first token is often acceptable under this transform
        assert chi2_pvalue(second_given, p[1]) > 1e-3
    # the drafter's distribution is clearly different, so the test can tell them apart
    assert chi2_pvalue(first, (q[0] + 1e-9) * (p[0] > 0)) < 1e-3


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    assert (to_probs(logits, SamplingParams(1.0, top_k=2)) > 0).sum() == 2
    probs = logits.softmax(-1)
    kept = to_probs(logits, SamplingParams(1.0, top_p=float(probs[0] + 0.01)))
    assert (kept > 0).sum() == 2 and torch.isclose(kept.sum(), torch.tensor(1.0))
