"""Adaptive block size: how many tokens each drafted step verifies, chosen before every step.

A drafted step costs a drafter forward and a target forward over rows x k tokens (k = the block size). On a
GPU that cost is almost flat in k until the batch fills the device; on a CPU it grows with every token. What
a step yields is 1 + the expected number of accepted draft tokens per row, which grows ever more slowly with
k. Before each step the policy takes the k in 2..B with the most expected tokens per second:

    k* = argmax_k  rows * E[tokens | k] / T(rows, k)

T(rows, k) is measured once at start-up (real engine steps over dummy rows), plus the time served steps
took beyond that lately; E[tokens | k] comes from the acceptance counted per draft position over recent
steps (old evidence fades as new evidence comes, so it follows the workload). Lossless either way: a smaller
block only verifies fewer draft tokens of the same drafter.

Served steps take longer than at start-up: the server's own threads, its clients and other processes share
the machine, and their cost comes per step (the same for every block size: a step runs the same kernels
whatever k is), which weighs more on short blocks and on cheap plain steps. So every served step is timed,
and what it took beyond its start-up time, a moving average per decoder, is added to T.

The same costs give the fallback its break-even acceptance length: a drafted step's time over a plain
step's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import NoDraftProposer, Proposer
from dflash.timing import fastest_times

log = logging.getLogger("dflash.serve")


@dataclass
class AcceptanceByPosition:
    """c[j] = P(draft token j+1 accepted | the tokens before it were), from decayed counts and a prior.

    A position's old evidence fades only as new evidence about it comes: a workload that lately verified
    short blocks keeps what it learned about the later positions. A position with little evidence leans on
    the estimate of the one before it (acceptance given the earlier tokens were accepted changes slowly along
    a block), so a position never judged is expected to do as well as the last one judged, not worse; that
    keeps longer blocks in the running until they are tried.
    """

    num_draft_tokens: int  # B - 1
    decay: float = 0.995  # per row that judged the position: evidence from ~200 such rows ago weighs 1/e
    prior: float = 0.5  # for the first position
    prior_weight: float = 2.0
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.num_draft_tokens
        self.accepted = [0.0] * self.num_draft_tokens

    def observe(self, accepted: list[int], drafted: int) -> None:
        """One step: `drafted` draft tokens per row, of which the first `accepted[i]` were accepted in row i."""
        for j in range(min(drafted, self.num_draft_tokens)):
            judged = [n for n in accepted if n >= j]  # rows whose target judged draft token j+1
            if not judged:
                break
            fade = self.decay ** len(judged)
            self.tried[j] = self.tried[j] * fade + len(judged)
            self.accepted[j] = self.accepted[j] * fade + sum(n > j for n in judged)

    def conditionals(self) -> list[float]:
        rates, prior = [], self.prior
        for tried, accepted in zip(self.tried, self.accepted):
            prior = (accepted + prior * self.prior_weight) / (tried + self.prior_weight)
            rates.append(prior)
        return rates

    def conditional(self, j: int) -> float:
        return self.conditionals()[j]

    def expected_tokens_by_block(self) -> list[float]:
        """[k - 1] = tokens one row keeps from a step at block size k (1 + expected accepted draft tokens),
        for k = 1 .. B, from one pass over the positions."""
        totals, total, survive = [1.0], 1.0, 1.0
        for rate in self.conditionals():
            survive *= rate
            total += survive
            totals.append(total)
        return totals

    def expected_tokens(self, block_size: int) -> float:
        totals = self.expected_tokens_by_block()
        return totals[min(max(block_size, 1), len(totals)) - 1]


def _step_with(engine: SpeculativeEngine, batch, proposer: Proposer) -> None:
    batch.proposer = proposer
    engine.step(batch)


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
    def measure(cls, engine: SpeculativeEngine, proposers: list[Proposer], rows: list[int], block_sizes: list[int],
                rounds: int = 3, repeats: int = 3, context: int = 192) -> "StepCosts":
        """Time real engine steps (raw; `monotone` gives the costs a policy uses): `rows` dummy sequences
        decoding together after a prompt of `context` tokens, with each proposer (a drafting one at each of
        `block_sizes`, a plain one at its block size 1). Verifying a block attends over the whole context, so a
        step at a served request's usual length (a prompt and part of its answer) costs more than one right
        after a short prompt: on the embedded pair 8 rows x 16 tokens take ~30% longer at 200 tokens than at 32.

        A shape's cost is its fastest step over `rounds` passes through every shape, `repeats` steps each:
        other work on the machine only adds time, and in bursts. Timing one shape after the other (a median of
        5 steps each) put a drafted step at 1.5x to 2.4x a plain one between two starts of the same server on 2
        shared cores, enough to move the fallback's break-even past the acceptance it judges."""
        vocab = engine.target.vocab_size
        # each proposer at every shape it is timed in: a drafting one at each block size, a plain one as it is
        shaped = [[p] if p.block_size == 1 else [p.with_block_size(k) for k in block_sizes if k <= p.block_size]
                  for p in proposers]
        steps = rounds * (repeats + 1) * sum(len(variants) for variants in shaped)
        config = GenerationConfig(max_new_tokens=steps * max(block_sizes) + 1, stop_token_ids=[])
        limit = getattr(engine.target.config, "max_position_embeddings", None)
        if limit:  # leave room for the steps within the target's context
            context = max(1, min(context, limit - config.max_new_tokens - max(block_sizes)))
        prompt = [(7 * i + 11) % vocab for i in range(context)]  # any valid ids: only the time counts
        seconds: dict[tuple[int, int], float] = {}
        for r in rows:
            steps = {}  # (rows, block size) -> one step of a batch of r rows with that proposer
            for variants in shaped:  # one batch per proposer, shared by its block sizes
                batch = engine.merge([engine.prefill(engine.new_sequence(prompt, config), variants[0])
                                      for _ in range(r)])
                steps.update({(r, v.block_size): partial(_step_with, engine, batch, v) for v in variants})
            # each round warms a shape up again: the steps in between changed the batch's block size
            seconds.update(fastest_times(steps, rounds, repeats, warm_up_every_round=True))
        return cls(seconds)

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


MAX_TIMED_ROWS = 64  # larger batches are not timed at start-up: their step costs grow linearly from here


def candidate_rows(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to and including the largest batch, or `MAX_TIMED_ROWS`."""
    return doublings(1, min(max_batch_size, MAX_TIMED_ROWS))


@dataclass
class StepOverhead:
    """Seconds a served step took beyond its start-up time, a moving average per decoder (drafted or plain)."""

    smoothing: float = 0.1  # weight of the newest step
    fresh_for_s: float = 30.0  # a decoder not timed for this long has no say any more
    extra_s: dict[bool, float] = field(default_factory=dict)  # drafted? -> measured - calibrated seconds
    seen_at: dict[bool, float] = field(default_factory=dict)

    def observe(self, drafted: bool, measured_s: float, calibrated_s: float, now: float) -> None:
        extra = measured_s - calibrated_s
        old = self.extra_s.get(drafted) if self.fresh(drafted, now) else None
        self.extra_s[drafted] = extra if old is None else (1 - self.smoothing) * old + self.smoothing * extra
        self.seen_at[drafted] = now

    def fresh(self, drafted: bool, now: float) -> bool:
        return now - self.seen_at.get(drafted, float("-inf")) <= self.fresh_for_s

    def of(self, drafted: bool, now: float) -> float:
        """The decoder's recent extra time per step; 0 when it was not timed lately."""
        return self.extra_s[drafted] if self.fresh(drafted, now) else 0.0


class BlockSizePolicy:
    """Picks each drafted step's block size from the batch's rows; used from the decode thread only."""

    def __init__(self, proposer: Proposer, costs: StepCosts, plain_costs: StepCosts | None = None):
        self.costs = costs
        self.plain_costs = plain_costs  # (rows, 1) -> seconds of a plain step, for the break-even
        self.max_block = max(costs.block_sizes)
        self.acceptance = AcceptanceByPosition(self.max_block - 1)
        self._proposers = {k: proposer.with_block_size(k) for k in costs.block_sizes}
        self.overhead = StepOverhead()

    @classmethod
    def calibrate(cls, engine: SpeculativeEngine, max_batch_size: int) -> "BlockSizePolicy":
        proposer = engine.proposer
        t0 = time.perf_counter()
        rows = candidate_rows(max_batch_size)
        blocks = candidate_block_sizes(proposer.block_size)
        both = StepCosts.measure(engine, [proposer, NoDraftProposer()], rows, blocks).seconds
        costs = StepCosts({shape: s for shape, s in both.items() if shape[1] > 1}).monotone()
        plain = StepCosts({shape: s for shape, s in both.items() if shape[1] == 1}).monotone()
        shapes = sorted((costs.seconds | plain.seconds).items())
        log.info("adaptive block size: step times (rows x block) measured in %.1f s: %s", time.perf_counter() - t0,
                 ", ".join(f"{r}x{k}: {s * 1e3:.1f} ms" for (r, k), s in shapes))
        return cls(proposer, costs, plain)

    def drafted_step_s(self, rows: int, block_size: int, now: float | None = None) -> float:
        """A drafted step's expected time as served lately: start-up time + recent extra per step."""
        now = time.monotonic() if now is None else now
        return self.costs(rows, block_size) + self.overhead.of(True, now)

    def break_even(self, rows: int, block_size: int | None = None, now: float | None = None) -> float:
        """The acceptance length at which a drafted step of this shape yields as many tokens/s as plain steps;
        without a block size, at the one this policy would choose for that many rows. From served times:
        start-up time + the recent extra time per step of each decoder. A decoder not served lately (the
        other one carries the whole load) is taken to have the same extra time as the one served: the extra
        comes per forward whatever the decoder (the server's bookkeeping, its clients, other processes).
        Measured at 8 rows on this CPU (while KV caches still grew by a copy every forward): plain steps ~6 ms
        over start-up, drafted ones ~7 ms; the start-up ratio alone put break-even at ~3.0 where drafting
        already paid at an acceptance of 2.6."""
        now = time.monotonic() if now is None else now
        k = block_size if block_size is not None else self.choose(rows, now)
        served = {d: self.overhead.of(d, now) for d in (True, False) if self.overhead.fresh(d, now)}
        extra_drafted = served.get(True, served.get(False, 0.0))
        extra_plain = served.get(False, served.get(True, 0.0))
        drafted, plain = self.costs(rows, k), self.plain_costs(rows, 1)
        # Served steps may run faster than start-up timed them (a start-up slowed by other work), but a step
        # never costs nothing: a plain step taken at under half its start-up time would make the ratio run away
        # (a break-even of 23 was seen at block 16 on a shared machine). Nor can any acceptance length
        # exceed the block size, so a break-even above it means the same as the block size: never pays.
        ratio = max(drafted + extra_drafted, 0.5 * drafted) / max(plain + extra_plain, 0.5 * plain)
        return min(ratio, float(k))

    def observe_step(self, rows: int, block_size: int, seconds: float, now: float | None = None) -> None:
        """A served step's time; block size 1 is a plain step (the only kind whose costs lack that size)."""
        drafted = block_size > 1
        calibrated = self.costs(rows, block_size) if drafted else self.plain_costs(rows, 1)
        self.overhead.observe(drafted, seconds, calibrated, time.monotonic() if now is None else now)

    def choose(self, rows: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expected = self.acceptance.expected_tokens_by_block()  # once per step, not once per candidate

        def tokens_per_s(k: int) -> float:
            return rows * expected[k - 1] / self.drafted_step_s(rows, k, now)

        return max(self._proposers, key=tokens_per_s)

    def proposer_for(self, rows: int) -> Proposer:
        return self._proposers[self.choose(rows)]

    def observe(self, accepted: list[int], drafted: int) -> None:
        """One drafted step: accepted draft tokens per row, `drafted` = block size - 1."""
        self.acceptance.observe(accepted, drafted)
