"""Seeded sampling (`PositionNoise`): an exact sampler whose draws belong to positions, not to steps."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dflash.decoding.sampling import PositionNoise, SamplingParams, to_probs

V = 6


def test_position_noise_samples_the_distribution_exactly():
    """Chi-square over many seeds: the token chosen at a position follows p, and is not the argmax."""
    p = to_probs(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0]]), SamplingParams(1.0))  # (1, V)
    counts = torch.zeros(V)
    for seed in range(4000):
        counts[int(PositionNoise(seed).choose(p, first_position=5)[0])] += 1
    support = p[0] > 1e-9
    expected = p[0][support] / p[0][support].sum() * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3, (counts, expected)
    assert counts[0] < 0.7 * counts.sum()  # greedy would put every draw on token 0


def test_a_positions_token_does_not_depend_on_how_positions_are_grouped():
    """Drafter and target ask for a position in blocks of different lengths and starts: same noise."""
    torch.manual_seed(0)
    probs = to_probs(torch.randn(12, 50), SamplingParams(1.0))  # distributions of positions 20..31
    whole = PositionNoise(3).choose(probs, first_position=20)
    noise = PositionNoise(3)
    pieces = torch.cat([noise.choose(probs[:5], 20), noise.choose(probs[5:6], 25), noise.choose(probs[6:], 26)])
    assert torch.equal(whole, pieces)
    assert torch.equal(PositionNoise(3).choose(probs[4:], 24), whole[4:])


def test_seeds_and_positions_give_different_noise():
    noise = PositionNoise(3)
    first, second = noise.exponentials(7, 64).clone(), noise.exponentials(8, 64)
    assert not torch.equal(first, second)
    assert not torch.equal(first, PositionNoise(4).exponentials(7, 64))
    assert torch.equal(first, PositionNoise(3 + 2**64).exponentials(7, 64))  # seeds are taken modulo 2**64
    assert torch.equal(first, PositionNoise(3).exponentials(7, 64))


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_no_finite_number_above_zero_is_refused(temperature):
    with pytest.raises(ValueError, match="finite number >= 0"):
        SamplingParams(temperature)


@pytest.mark.parametrize("weights,top_p", [([4, 3, 3], 0.5), ([1] * 4, 0.5), ([2, 1, 1, 1], 0.7), ([1, 2, 2], 0.5)])
def test_top_p_keeps_the_tokens_transformers_keeps_when_probabilities_tie_at_the_cut(weights, top_p):
    """Of tokens tied at the cut, the lower ids are dropped first, as transformers' TopPLogitsWarper drops them
    where its (unstable) sort keeps ties in id order, as on these short rows; bfloat16 logits tie often."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([weights], dtype=torch.float32).log()  # (1, V): probabilities in these proportions
    ours = to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    theirs = TopPLogitsWarper(top_p)(None, logits.clone()) > float("-inf")
    assert torch.equal(ours, theirs), (ours, theirs)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 0.3])
def test_top_p_keeps_at_least_the_most_likely_token(top_p):
    """A top_p below float32's smallest number reads as 0 there; the most likely token must still stay."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 0.0]])
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))


def test_the_noise_is_splitmix64_of_the_full_64_bit_key():
    """Every bit of the key counts: torch's CPU generator took 32 bits of its seed, so keys 2**32 apart drew the
    same noise. The tensor arithmetic (int64 products that wrap) matches the integers'."""
    import math

    from dflash.decoding.sampling import _GOLDEN, _MASK64, _mix64, hashed_exponentials

    def exponential(bits: int) -> float:  # E = -log(1 - u), u from the top 48 bits, in float64 here
        return -math.log1p(-((bits >> 40) + ((bits >> 16 & (2**24 - 1)) + 0.5) * 2**-24) * 2**-24)

    key = _mix64(2024)
    expected = [exponential(_mix64((key + (x + 1) * _GOLDEN) & _MASK64)) for x in range(8)]
    assert torch.allclose(hashed_exponentials(key, 8).double(), torch.tensor(expected, dtype=torch.float64),
                          rtol=1e-6)
    assert not torch.equal(hashed_exponentials(key, 64), hashed_exponentials((key + 2**32) & _MASK64, 64))
    draws = hashed_exponentials(_mix64(7), 100_000).double()  # Exp(1): mean 1, variance 1
    assert abs(draws.mean().item() - 1) < 0.02 and abs(draws.var().item() - 1) < 0.05 and draws.min() > 0


def test_the_smallest_draws_are_fine_enough_for_unlikely_tokens():
    """With the top 24 bits alone the smallest E was 6e-8: a token of probability 1e-8 beside one of 0.999 was drawn
    about 65 times less often than it should (a seeded sampler's QA). Now the 2**-48 grid near 0 reaches 1e-14, and
    the largest draw stays finite."""
    from dflash.decoding.sampling import exponentials_from_bits

    high, low = torch.tensor([0, 0, 2**24 - 1]), torch.tensor([0, 2**24 - 1, 2**24 - 1])
    smallest, next_step, largest = exponentials_from_bits(high, low).tolist()
    assert 0 < smallest < 1e-14 and 5e-8 < next_step < 7e-8  # (0, max): just below the old smallest step
    assert 16 < largest < 17.5


def test_the_noise_is_never_zero_so_a_token_of_probability_zero_is_never_drawn(monkeypatch):
    """In float32, the largest uniform (24 bits all set) rounded to 1 and its noise to 0: at such a position a token
    of probability 0 came out (p / E was NaN, which argmax takes), and the drafter's path search crashed. Seed 3 put
    one at position 74, token 491, of the embedded pair's vocabulary (4,096); with 48 bits that draw is now the
    largest there is (`test_the_smallest_draws_are_fine_enough_for_unlikely_tokens` checks both ends)."""
    from dflash.decoding.sampling import PositionNoise

    def no_float64(*args, **kwargs):
        raise TypeError("Cannot convert a MPS Tensor to float64 dtype")  # Apple's GPUs have none

    monkeypatch.setattr(torch.Tensor, "double", no_float64)
    noise = PositionNoise(3)
    draws = noise.exponentials(74, 4096)  # where the top bit pattern fell with 24 bits
    assert torch.isfinite(draws).all() and (draws > 0).all()
    probs = torch.zeros(1, 4096)
    probs[0, 10], probs[0, 11] = 0.7, 0.3
    assert noise.choose(probs, 74).item() in (10, 11)


def test_an_infinite_logit_takes_all_the_probability_and_nan_is_a_clear_error():
    from dflash.errors import GenerationError

    inf, nan = float("inf"), float("nan")
    probs = to_probs(torch.tensor([[0.0, inf, 3.0, inf], [1.0, 2.0, -inf, 0.0]]), SamplingParams(0.7, top_k=2))
    assert torch.equal(probs[0], torch.tensor([0.0, 0.5, 0.0, 0.5]))  # the two +inf tokens share it
    assert torch.allclose(probs[1], to_probs(torch.tensor([[1.0, 2.0, -inf, 0.0]]), SamplingParams(0.7, top_k=2))[0])
    assert int(PositionNoise(0).choose(to_probs(torch.tensor([[0.0, 0.0, inf]]), SamplingParams(1.0)), 0)[0]) == 2
    for bad in ([0.0, nan, 1.0], [-inf, -inf, -inf]):
        with pytest.raises(GenerationError, match="load the model in bfloat16 or float32"):
            to_probs(torch.tensor([bad]), SamplingParams(1.0))


def test_top_k_minus_one_is_no_top_k_as_in_vllm():
    from dflash.decoding.engine import GenerationConfig

    assert SamplingParams(1.0, top_k=-1) == SamplingParams(1.0, top_k=0)
    assert GenerationConfig(temperature=1.0, top_k=-1).sampling.top_k == 0
    with pytest.raises(ValueError, match=r"top_k must be a number of tokens >= 1, or 0 or -1 \(off\), got -2"):
        SamplingParams(1.0, top_k=-2)


def test_unseeded_draws_follow_the_distribution_and_never_take_a_token_of_probability_zero(monkeypatch):
    """`sample` draws through the cumulative distribution (torch.multinomial drew an exponential for every token of
    the vocabulary): the draws follow p, and the uniforms at both ends of [0, 1) still land on tokens p allows."""
    from dflash.decoding import sampling

    p = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])  # zeros first, between and last
    generator = torch.Generator().manual_seed(0)
    draws = sampling.sample(p.expand(6000, -1), generator)
    counts = torch.bincount(draws, minlength=6).float()
    assert counts[p[0] == 0].sum() == 0
    assert chisquare(counts[p[0] > 0].numpy(), (p[0][p[0] > 0] * 6000).numpy()).pvalue > 1e-3
    for u in (0.0, 1 - 2.0 ** -24):  # torch.rand's smallest and largest float32
        monkeypatch.setattr(torch, "rand", lambda *shape, u=u, **kw: torch.full(shape, u))
        assert int(sampling.sample(p, None)[0]) in (1, 3, 4)
    assert int(sampling.sample(torch.tensor([[0.0, 0.0, 1.0]]), None)[0]) == 2


def test_a_running_total_that_steps_at_a_token_of_probability_zero_still_never_draws_it():
    """A GPU sums the probabilities in a tree, so its running total can rise (or fall) by a rounding at a token of
    probability 0, and a search for the first total to reach the draw stopped there; such totals, as a GPU's are
    mended before the search (a CPU adds in order and needs no mending)."""
    from dflash.decoding.sampling import never_stepping

    p = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0]])
    stepped = torch.tensor([[0.5, 0.501, 1.0, 0.999, 1.0]])  # a rise at token 1, a fall at token 3
    assert torch.searchsorted(stepped, torch.tensor([[0.5005]])).item() == 1  # the token of probability 0
    mended = never_stepping(stepped, p)
    assert mended.tolist() == [[0.5, 0.5, 1.0, 1.0, 1.0]]
    assert torch.searchsorted(mended, torch.tensor([[0.5005]])).item() == 2


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 2.0), (1.0, 1.0)])
def test_min_p_keeps_the_tokens_transformers_keeps(min_p, temperature):
    """After temperature: the tokens at least min_p x as likely as the likeliest (transformers' MinPLogitsWarper as
    the reference); min_p 1 keeps the likeliest (and its ties)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(4, 40) * 3
    logits[0, :3] = 5.0  # a tie at the top
    ids = torch.zeros(4, 1, dtype=torch.long)
    want = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits.clone())).softmax(-1)
    got = to_probs(logits, SamplingParams(temperature, min_p=min_p))
    torch.testing.assert_close(got, want)
    assert ((got > 0).sum(-1) >= 1).all()


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan")])
def test_a_min_p_outside_0_to_1_is_refused(min_p):
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(1.0, min_p=min_p)
