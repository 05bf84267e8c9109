"""Sampling parameters and the logits -> probabilities transform shared by drafter and target."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.errors import NoTokenError

MAX_TEMPERATURE = 100.0  # far past any useful one (all but uniform there), far below float32's overflow
MIN_TEMPERATURE = 1e-5  # a smaller one samples at this (all but greedy), so logits / T stays finite


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (one in (0, 1e-5) samples at 1e-5, all but greedy); top_k 0 (or -1, as vLLM
    says it), top_p 1 and min_p 0 mean no truncation."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest's probability

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy) and at most "
                             f"{MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be a number of tokens >= 1, or 0 or -1 (off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def to_probs(logits: torch.Tensor, params: SamplingParams, proposal: bool = False) -> torch.Tensor:
    """logits (..., vocab) -> probabilities (..., vocab) after temperature, min-p, top-k and top-p (vLLM's order).

    Target and drafter go through this same transform, which is what keeps rejection sampling lossless
    with respect to the transformed target distribution. A +inf logit (a float16 overflow, or a model that
    forces a token) takes all the probability, shared with any other +inf; a NaN is an error that says how to
    load the model instead. A `proposal` (a drafter's logits) only proposes tokens: a NaN there (a float16
    overflow in the drafter alone) counts as a logit of 0, and a row with no finite logit as all 0 (uniform),
    so the draft is poor but the answer is the target's, whose probabilities these are checked against.
    """
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        if proposal:
            logits = _without_nan(logits)
        logits = _where_infinite(logits)
    logits = logits / max(params.temperature, MIN_TEMPERATURE)
    if params.min_p > 0:  # below min_p x the likeliest's probability: p / p_max = exp(logit - max logit)
        floor = logits.amax(-1, keepdim=True) + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # most likely first; of tied tokens the higher id first, so the lower is dropped first: a fixed order
        # (transformers' and vLLM's unstable ascending sort drops them so where it keeps ties in id order)
        sorted_logits, order = (t.flip(-1) for t in torch.sort(logits, dim=-1, stable=True))
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # also when top_p is below float32's smallest number (it reads as 0 here)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


OVERFLOW_ADVICE = ("in float16 that is usually an overflow: load the model in bfloat16 or float32 (--dtype, or dtype= "
                   "in the Python API)")
# a row whose logits give no token (greedy) or no distribution (sampling); it fails that row alone (NoTokenError)
NAN_LOGITS = f"the model's logits are NaN (or -inf everywhere), so it chose no token; {OVERFLOW_ADVICE}"


def _where_infinite(logits: torch.Tensor) -> torch.Tensor:
    """Rows with a +inf: 0 there, -inf elsewhere (the +inf tokens share the probability). NaN, or a row with no
    finite logit, is refused: no distribution is left to sample from."""
    if bool(torch.isnan(logits).any()) or bool((logits == float("-inf")).all(-1).any()):
        raise NoTokenError(NAN_LOGITS)
    forced = logits == float("inf")
    return torch.where(forced.any(-1, keepdim=True), torch.where(forced, 0.0, float("-inf")), logits)


def _without_nan(logits: torch.Tensor) -> torch.Tensor:
    """A proposal's logits with NaN as 0, and rows of -inf everywhere (after that) all 0."""
    logits = torch.where(torch.isnan(logits), 0.0, logits)
    return torch.where((logits == float("-inf")).all(-1, keepdim=True), 0.0, logits)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias: -100 (a ban) to 100


def add_logit_bias(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """logits (b, q, vocab) with each row's logit bias (`Sequence.bias`, (vocab,) or None) added, for the target's
    choice and the drafters' alike; the same tensor where no row has one."""
    biases = [getattr(row, "bias", None) for row in rows]
    if all(bias is None for bias in biases):
        return logits
    zeros = logits.new_zeros(logits.shape[-1])
    return logits + torch.stack([zeros if bias is None else bias.to(logits) for bias in biases])[:, None, :]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs (n, vocab), each row with some probability (as `to_probs` leaves it) -> token ids (n,): one uniform a
    row, through the cumulative distribution. (torch.multinomial draws an exponential for every token of the
    vocabulary: 80 us a row at 4,096 tokens on a CPU, ten of the 20 ms a sampled 8-row step at block 16 cost over a
    greedy one.)"""
    probs = probs.float()
    cdf = probs.cumsum(-1)  # (n, vocab); a CPU adds in order, so a token of probability 0 keeps the total
    if probs.device.type != "cpu":
        cdf = never_stepping(cdf, probs)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)  # (n, 1) in [0, 1)
    # in (0, total]: the first token whose total reaches it has a probability above 0
    reach = (1 - u) * cdf[:, -1:]
    return torch.searchsorted(cdf, reach).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def never_stepping(totals: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Running totals (n, vocab) of `probs` that do not move at a token of probability 0 and never decrease. A GPU
    sums in a tree, so its totals can step by a rounding there, and `sample`'s search could stop on such a token."""
    return torch.where(probs > 0, totals, 0.0).cummax(-1).values


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's counter step
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: spreads neighbouring inputs over the whole 64-bit range."""
    x = (x ^ (x >> 30)) * _MIX[0] & _MASK64
    x = (x ^ (x >> 27)) * _MIX[1] & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """A seed of its own for item `index` of a run seeded with `seed`, in [0, 2**64): a hash, so that runs with
    neighbouring seeds do not share streams (with seed + index, item i of a run seeded 1 would draw what item
    i + 1 of a run seeded 0 draws)."""
    return _mix64((_mix64(seed & _MASK64) + (index + 1) * _GOLDEN) & _MASK64)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 patterns (torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`_mix64` on an int64 tensor, whose products wrap modulo 2**64 as the integer's do."""
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX[0])
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX[1])
    return x ^ _shift_right(x, 31)


def hashed_exponentials(key: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(vocab,) float32 Exp(1) draws that are a function of the 64-bit key alone: splitmix64 of the counters
    key + (x + 1) * golden, 48 of its bits a uniform, E = -log(1 - u) (`exponentials_from_bits`). Integers all the
    way to the logarithm, so the same on every device, and no generator's 32-bit seed between the key and the
    noise (float32 throughout: Apple's MPS has no float64)."""
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN) + _signed(key)
    mixed = _mix64_tensor(counters)  # (vocab,) int64 patterns
    return exponentials_from_bits(_shift_right(mixed, 40), _shift_right(mixed, 16) & (2**24 - 1))


def exponentials_from_bits(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from two 24-bit integers each: u = (high + (low + 1/2) / 2**24) / 2**24, E = -log(1 - u).

    The small draws decide whether an unlikely token is drawn (it wins the race argmax p / E when its E is below
    p times the winner's E / p), and they come from u near 0, where the low bits make the grid 2**-48 fine: with
    only the high 24 bits the smallest E was 6e-8, so tokens below about 1e-7 (0.1% of a 150,000-token vocabulary's
    mass at temperature 1) were almost never drawn. Near u = 1 the low bits round away in float32, which only
    coarsens the largest draws; u is held at the float32 below 1, so E is finite: an infinite E made p / E 0 for
    any token, and 1 - u = 0 a NaN."""
    u = ((high.float() + (low.float() + 0.5) * 2.0 ** -24) * 2.0 ** -24).clamp_(max=1 - 2.0 ** -24)
    return -torch.log1p(-u)  # > 0: the smallest, about 2**-49, is a normal float32


class PositionNoise:
    """Seeded sampling that does not depend on drafting: the token at sequence position t is

        argmax_x  p_t(x) / E_t(x),    E_t(x) ~ Exp(1) i.i.d., a hash of (seed, t, x)

    (the exponential race, i.e. Gumbel-max sampling), an exact draw from p_t. The noise belongs to the position,
    not to a step, so the tokens are a function of the seed and the target alone: the same seed gives the same
    text at any block size, in any batch, with the drafter or without it, on any device. The drafter proposes
    with the same noise on its own distribution, argmax_x q_t(x) / E_t(x), and verification keeps the longest
    prefix of proposals equal to the target's tokens, as in greedy decoding. Such a proposal is accepted with
    probability at least (1 - TV(p, q)) / (1 + TV(p, q)) (Daliri, Musco and Suresh, "Coupling without
    communication and drafter-invariant speculative decoding", 2024), against 1 - TV(p, q) for rejection
    sampling, which decoding without a seed keeps.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.seed = seed & _MASK64
        self.device = torch.device(device)
        self._cache: dict[int, torch.Tensor] = {}  # position -> (vocab,) noise; the drafter and target share it

    def exponentials(self, position: int, vocab: int) -> torch.Tensor:
        """E_position, (vocab,): the same tensor every time it is asked for."""
        noise = self._cache.get(position)
        if noise is None or noise.shape[0] != vocab:
            noise = hashed_exponentials(_mix64(self.seed ^ _mix64(position + 1)), vocab, self.device)
            self._cache[position] = noise
        return noise

    def choose(self, probs: torch.Tensor, first_position: int) -> torch.Tensor:
        """probs (n, vocab), the distributions of positions first_position .. first_position + n - 1 -> (n,)."""
        n, vocab = probs.shape
        noise = torch.stack([self.exponentials(first_position + i, vocab) for i in range(n)])
        for old in [p for p in self._cache if p < first_position]:  # decoding only moves forward
            del self._cache[old]
        return (probs.float() / noise).argmax(-1)
