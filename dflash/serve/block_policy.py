"""Adaptive block size: how many tokens each drafted step verifies, chosen before every step.

A drafted step costs a drafter forward and a target forward over rows x k tokens (k = the block size). On a
GPU that cost is almost flat in k until the batch fills the device; on a CPU it grows with every token. What
a step yields is 1 + the expected number of accepted draft tokens per row, which grows ever more slowly with
k. Before each step the policy takes the k in 2..B with the most expected tokens per second:

    k* = argmax_k  rows * E[tokens | k] / T(rows, k)

T(rows, k) is measured once at start-up (real engine steps over dummy rows); E[tokens | k] comes from the
acceptance counted per draft position over recent steps (old evidence fades, so it follows the workload).
Lossless either way: a smaller block only verifies fewer draft tokens of the same drafter.

The same costs give the fallback its break-even acceptance length: a drafted step's time over a plain
step's. Under load both run slower than at start-up, and not by the same factor (the server's own threads
and other processes add time per step, which weighs more on a cheap plain step), so every served step is
timed too, and the break-even is corrected by how much more drafted steps slowed down than plain ones.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import NoDraftProposer, Proposer

log = logging.getLogger("dflash.serve")


@dataclass
class AcceptanceByPosition:
    """c[j] = P(draft token j+1 accepted | the tokens before it were), from decayed counts and a prior."""

    num_draft_tokens: int  # B - 1
    decay: float = 0.995  # per observed row: evidence from ~200 rows ago weighs 1/e
    prior: float = 0.5
    prior_weight: float = 2.0
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.num_draft_tokens
        self.accepted = [0.0] * self.num_draft_tokens

    def observe(self, accepted: list[int], drafted: int) -> None:
        """One step: `drafted` draft tokens per row, of which the first `accepted[i]` were accepted in row i."""
        fade = self.decay ** len(accepted)  # old evidence fades by one decay per row observed
        self.tried = [t * fade for t in self.tried]
        self.accepted = [a * fade for a in self.accepted]
        for n in accepted:
            for j in range(min(n + 1, drafted)):  # positions the target judged: the accepted ones + the first miss
                self.tried[j] += 1.0
                self.accepted[j] += float(j < n)

    def conditional(self, j: int) -> float:
        return (self.accepted[j] + self.prior * self.prior_weight) / (self.tried[j] + self.prior_weight)

    def expected_tokens(self, block_size: int) -> float:
        """Tokens one row keeps from a step at this block size: 1 + expected accepted draft tokens."""
        total, survive = 1.0, 1.0
        for j in range(min(block_size - 1, self.num_draft_tokens)):
            survive *= self.conditional(j)
            total += survive
        return total


@dataclass
class StepCosts:
    """Seconds per drafted step, measured at `rows` x `block_sizes`; other row counts are interpolated."""

    seconds: dict[tuple[int, int], float]  # (rows, block size) -> seconds
    rows: list[int] = field(init=False)  # the measured shapes, sorted once (the policy asks every step)
    block_sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = sorted({r for r, _ in self.seconds})
        self.block_sizes = sorted({k for _, k in self.seconds})

    def __call__(self, rows: int, block_size: int) -> float:
        measured = self.rows
        below = max([r for r in measured if r <= rows], default=measured[0])
        above = min([r for r in measured if r >= rows], default=measured[-1])
        lo, hi = self.seconds[below, block_size], self.seconds[above, block_size]
        if above == below:
            return lo * (rows / below if rows > below else 1.0)  # beyond the measured range: grow linearly
        return lo + (hi - lo) * (rows - below) / (above - below)

    @classmethod
    def measure(cls, engine: SpeculativeEngine, proposer: Proposer, rows: list[int], block_sizes: list[int],
                repeats: int = 5, prompt_len: int = 32) -> "StepCosts":
        """Time real engine steps: `rows` dummy sequences decoding together, each block size in turn."""
        vocab = engine.target.vocab_size
        prompt = [(7 * i + 11) % vocab for i in range(prompt_len)]  # any valid ids: only the time counts
        steps = (repeats + 1) * len(block_sizes)
        config = GenerationConfig(max_new_tokens=steps * max(block_sizes) + 1, stop_token_ids=[])
        seconds = {}
        for r in rows:
            seqs = [engine.new_sequence(prompt, config) for _ in range(r)]
            batch = engine.merge([engine.prefill(seq, proposer) for seq in seqs])
            for k in block_sizes:
                batch.proposer = proposer.with_block_size(k)
                engine.step(batch)  # warm-up at this shape
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    engine.step(batch)
                    times.append(time.perf_counter() - t0)
                seconds[r, k] = statistics.median(times)
        return cls(seconds).monotone()

    def monotone(self) -> "StepCosts":
        """A step over more rows or a longer block never costs less: noise on a shared machine only adds time,
        so each shape takes the least time measured at any shape at least as large."""
        return StepCosts({
            (r, k): min(s for (r2, k2), s in self.seconds.items() if r2 >= r and k2 >= k)
            for r, k in self.seconds
        })


def doublings(start: int, limit: int) -> list[int]:
    """start, 2 x start, 4 x start, ... below `limit`, then `limit` itself."""
    values = []
    while start < limit:
        values.append(start)
        start *= 2
    return values + [limit]


def candidate_block_sizes(max_block: int) -> list[int]:
    """2, 4, 8, ... up to and including the drafter's block size."""
    return doublings(2, max_block)


def candidate_rows(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to and including the largest batch."""
    return doublings(1, max_batch_size)


@dataclass
class StepSlowdown:
    """Measured over calibrated step time, a moving average per decoder (drafted or plain steps)."""

    smoothing: float = 0.1  # weight of the newest step
    fresh_for_s: float = 30.0  # a decoder not timed for this long has no say any more
    ratio: dict[bool, float] = field(default_factory=dict)  # drafted? -> measured / calibrated
    seen_at: dict[bool, float] = field(default_factory=dict)

    def observe(self, drafted: bool, measured_s: float, calibrated_s: float, now: float) -> None:
        ratio = measured_s / calibrated_s
        old = self.ratio.get(drafted) if self.fresh(drafted, now) else None
        self.ratio[drafted] = ratio if old is None else (1 - self.smoothing) * old + self.smoothing * ratio
        self.seen_at[drafted] = now

    def fresh(self, drafted: bool, now: float) -> bool:
        return now - self.seen_at.get(drafted, float("-inf")) <= self.fresh_for_s

    def relative(self, now: float) -> float:
        """How much more drafted steps slowed down than plain ones, when both were timed lately; else 1 (the
        calibrated ratio stands: one decoder's slowdown alone says nothing about the other's)."""
        if not (self.fresh(True, now) and self.fresh(False, now)):
            return 1.0
        return self.ratio[True] / self.ratio[False]


class BlockSizePolicy:
    """Picks each drafted step's block size from the batch's rows; used from the decode thread only."""

    def __init__(self, proposer: Proposer, costs: StepCosts, plain_costs: StepCosts | None = None):
        self.costs = costs
        self.plain_costs = plain_costs  # (rows, 1) -> seconds of a plain step, for the break-even
        self.max_block = max(costs.block_sizes)
        self.acceptance = AcceptanceByPosition(self.max_block - 1)
        self._proposers = {k: proposer.with_block_size(k) for k in costs.block_sizes}
        self.slowdown = StepSlowdown()

    @classmethod
    def calibrate(cls, engine: SpeculativeEngine, max_batch_size: int) -> "BlockSizePolicy":
        proposer = engine.proposer
        t0 = time.perf_counter()
        rows = candidate_rows(max_batch_size)
        costs = StepCosts.measure(engine, proposer, rows, candidate_block_sizes(proposer.block_size))
        plain = StepCosts.measure(engine, NoDraftProposer(), rows, [1])
        shapes = sorted((costs.seconds | plain.seconds).items())
        log.info("adaptive block size: step times (rows x block) measured in %.1f s: %s", time.perf_counter() - t0,
                 ", ".join(f"{r}x{k}: {s * 1e3:.1f} ms" for (r, k), s in shapes))
        return cls(proposer, costs, plain)

    def break_even(self, rows: int, block_size: int | None = None, now: float | None = None) -> float:
        """The acceptance length at which a drafted step of this shape yields as many tokens/s as plain steps;
        without a block size, at the one this policy would choose for that many rows. Corrected by the
        relative slowdown of the two kinds of step as served lately."""
        k = block_size if block_size is not None else self.choose(rows)
        now = time.monotonic() if now is None else now
        return self.costs(rows, k) / self.plain_costs(rows, 1) * self.slowdown.relative(now)

    def observe_step(self, rows: int, block_size: int, seconds: float, now: float | None = None) -> None:
        """A served step's time; block size 1 is a plain step (the only kind whose costs lack that size)."""
        drafted = block_size > 1
        calibrated = self.costs(rows, block_size) if drafted else self.plain_costs(rows, 1)
        self.slowdown.observe(drafted, seconds, calibrated, time.monotonic() if now is None else now)

    def choose(self, rows: int) -> int:
        def tokens_per_s(k: int) -> float:
            return rows * self.acceptance.expected_tokens(k) / self.costs(rows, k)

        return max(self._proposers, key=tokens_per_s)

    def proposer_for(self, rows: int) -> Proposer:
        return self._proposers[self.choose(rows)]

    def observe(self, accepted: list[int], drafted: int) -> None:
        """One drafted step: accepted draft tokens per row, `drafted` = block size - 1."""
        self.acceptance.observe(accepted, drafted)
