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

After drafting, from the draft itself. A DFlash drafter drafts the whole block in one forward, and says how
sure it is of each token (`Draft.confidence`). For one row, the policy drafts the full block and then picks k
from that step's own draft: E[tokens | k] = 1 + sum_{j<k} prod_{i<=j} q_i, where q_i is the acceptance that
verification has shown for draft tokens of confidence like token i's (`AcceptanceByConfidence`). A step whose
draft falters early verifies a short block, one the drafter is sure of a long one. On the embedded pair and a
2-core CPU, where a verified token costs ~0.2-0.3 ms of a ~20 ms step, it decodes GSM8K 3-6% faster than choosing
before drafting, verifying ~9 tokens per step instead of ~16 for almost the same acceptance length
(`benchmarks/block_choice.py`); the steeper a step's cost in k, the more it gains.

It is kept to batches of one row, and to greedy or seeded rows:
- drafting all 16 positions instead of 4 costs 0.15 ms of a ~3 ms drafter forward at one row, but 2.2 ms
  (6.1 -> 8.3 ms) at 8 rows, where one block size serves every row (a replay of 814 recorded steps, 8 at a time,
  put the gain there at ~2%);
- rejection sampling (a row sampling without a seed) is exact only when whether a draft token is verified does
  not depend on the token drawn; a greedy row's text, or a seeded row's (the target's own draws), does not
  depend on the drafts at all.

Served steps take longer than at start-up: the server's own threads, its clients and other processes share
the machine, and their cost comes per step (the same for every block size: a step runs the same kernels
whatever k is), which weighs more on short blocks and on cheap plain steps. So every served step is timed,
and what it took beyond its start-up time, a moving average per decoder, is added to T.

The same costs give the fallback its break-even acceptance length: a drafted step's time over a plain
step's at the same rows, each as served lately at that many rows (`ServedRatios`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import Draft, NoDraftProposer, Proposer
from dflash.timing import fastest_times

log = logging.getLogger(__name__)


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


@dataclass
class AcceptanceByConfidence:
    """q(c) = P(draft token accepted | the tokens before it were, the drafter's confidence c in it), per bin of c.

    Decayed counts per bin, on a prior that takes the drafter at its word (c itself, worth `prior_weight`
    tokens): a calibrated drafter needs no evidence, an over- or under-sure one is corrected as verification
    shows it. The embedded DFlash2 drafter's confidence is calibrated within a few points (60 GSM8K answers:
    confidence 0.2-0.4 accepted 0.24 of the time, 0.5-0.6 0.48, 0.8-0.9 0.83, 0.98+ 0.97); the embedded DFlash
    drafter's top-1 probability is under-sure (the same answers: 0-0.2 accepted 0.34, 0.7-0.8 0.86), which the
    counts correct. Plain floats: a
    step asks about one row's 15 tokens, where tensor operations would cost more than the arithmetic.
    """

    bins: int = 20
    decay: float = 0.999  # per judged token: evidence from ~1,000 judged tokens ago weighs 1/e
    prior_weight: float = 4.0
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.bins
        self.accepted = [0.0] * self.bins

    def _bin(self, confidence: float) -> int:
        if not confidence > 0:  # NaN too (a drafter's float16 overflow): no confidence at all
            return 0
        return min(int(confidence * self.bins), self.bins - 1)

    def rate(self, confidence: float) -> float:
        b = self._bin(confidence)
        centre = (b + 0.5) / self.bins
        return (self.accepted[b] + centre * self.prior_weight) / (self.tried[b] + self.prior_weight)

    def expected_tokens_by_block(self, confidence: list[list[float]]) -> list[float]:
        """confidence [row][position] of a draft's B - 1 tokens -> [k - 1] = tokens its rows keep together from a
        step at block size k = 1 .. B (each row: 1 + the expected accepted draft tokens)."""
        totals = [0.0] * (len(confidence[0]) + 1)
        for row in confidence:
            total, survive = 1.0, 1.0  # survive: P(the draft tokens so far are all accepted)
            totals[0] += total
            for j, c in enumerate(row):
                survive *= self.rate(c)
                total += survive
                totals[j + 1] += total
        return totals

    def observe(self, confidence: list[list[float]], accepted: list[int]) -> None:
        """One step: confidence [row][position] of the draft tokens it verified, of which row i accepted
        `accepted[i]` (a token is judged when the ones before it were accepted)."""
        judged = [(self._bin(c), j < n) for row, n in zip(confidence, accepted) for j, c in enumerate(row[: n + 1])]
        fade = self.decay ** len(judged)
        self.tried = [t * fade for t in self.tried]
        self.accepted = [a * fade for a in self.accepted]
        for b, right in judged:
            self.tried[b] += 1
            self.accepted[b] += right


@dataclass
class ServedCostLine:
    """seconds = a + b * k for one row's steps that chose their block size k after drafting, fitted by least
    squares to the steps served lately (decayed sums), on the start-up times as a prior.

    Start-up times each block size over a few steps, and on a shared machine that moves the slope a lot: three
    start-ups of the embedded pair in a row put 1 row x 2 -> 16 tokens at +8.1, +3.0 and +3.2 ms, another at
    +0.0, while the decoding steps of 20 GSM8K answers cost +0.2 ms per verified token (18.6 ms at block 4, 21.1
    at 16). A slope too steep cuts drafts the target would have accepted; then the block sizes vary from step
    to step, and the served steps correct it. The start-up points fade as served steps come; when the steps
    left in the sums do not spread over block sizes enough to tell a slope, `fit` says so.
    """

    decay: float = 0.99  # per step: ~100 recent steps
    min_spread: float = 1.0  # standard deviation of the block sizes in the sums
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, k, k^2, seconds, k x seconds

    @classmethod
    def from_start_up(cls, costs: dict[int, float], weight: float = 5.0) -> "ServedCostLine":
        """A line whose prior is start-up's seconds per block size, each worth `weight` served steps."""
        line = cls()
        for k, seconds in costs.items():
            line.observe(k, seconds, weight, fade=False)
        return line

    def observe(self, block_size: int, seconds: float, weight: float = 1.0, fade: bool = True) -> None:
        k, decay = float(block_size), self.decay if fade else 1.0
        point = (1.0, k, k * k, seconds, k * seconds)
        self.sums = [s * decay + weight * x for s, x in zip(self.sums, point)]

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the steps in the sums cannot tell the slope."""
        w, sk, skk, st, skt = self.sums
        variance = skk / w - (sk / w) ** 2 if w > 0 else 0.0
        if variance < self.min_spread**2:
            return None
        slope = max((skt / w - sk / w * st / w) / variance, 0.0)  # a longer block never costs less
        return st / w - slope * sk / w, slope


class _TimedRows:
    """Dummy rows decoding together after one prompt, for timing steps: each step runs `proposer`, given a block
    size drafting in full and verifying that many tokens (the cost of a step that chooses after drafting). The
    rows start again from the prompt before a step could pass their max_new_tokens, so a target whose context
    holds fewer tokens than all the timed steps may write is timed too; a restart costs one step's timing, and
    only a shape's fastest step counts."""

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], config: GenerationConfig, rows: int,
                 proposer: Proposer, block_size: int):
        self.engine, self.prompt, self.config, self.rows = engine, prompt, config, rows
        self.proposer, self.block_size = proposer, block_size  # the first proposer; the largest block timed
        self._start()

    def _start(self) -> None:
        self.batch = self.engine.merge([self.engine.prefill(self.engine.new_sequence(self.prompt, self.config),
                                                            self.proposer) for _ in range(self.rows)])

    def step(self, proposer: Proposer, block_size: int | None = None) -> None:
        longest = max(len(seq.output_ids) for seq in self.batch.sequences)
        if longest + self.block_size >= self.config.max_new_tokens:
            self._start()
        self.batch.proposer = proposer
        self.engine.step(self.batch, None if block_size is None else (lambda draft: block_size))


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
        lo, hi = self._at(below, block_size), self._at(above, block_size)
        if above == below:
            return lo * (rows / below if rows > below else 1.0)  # beyond the measured range: grow linearly
        return lo + (hi - lo) * (rows - below) / (above - below)

    def _at(self, rows: int, block_size: int) -> float:
        """A measured row count's cost at any block size within the measured ones: linear in between."""
        below = max(k for k in self.block_sizes if k <= block_size)
        above = min(k for k in self.block_sizes if k >= block_size)
        lo, hi = self.seconds[rows, below], self.seconds[rows, above]
        return lo if above == below else lo + (hi - lo) * (block_size - below) / (above - below)

    @classmethod
    def measure(cls, engine: SpeculativeEngine, proposers: list[Proposer], rows: list[int], block_sizes: list[int],
                rounds: int = 3, repeats: int = 3, context: int = 192, after_drafting: bool = False) -> "StepCosts":
        """Time real engine steps (raw; `monotone` gives the costs a policy uses): `rows` dummy sequences
        decoding together after a prompt of `context` tokens, with each proposer (a drafting one at each of
        `block_sizes`, a plain one at its block size 1). Verifying a block attends over the whole context, so a
        step at a served request's usual length (a prompt and part of its answer) costs more than one right
        after a short prompt: on the embedded pair 8 rows x 16 tokens take ~30% longer at 200 tokens than at 32.

        A shape's cost is its fastest step over `rounds` passes through every shape, `repeats` steps each:
        other work on the machine only adds time, and in bursts. Timing one shape after the other (a median of
        5 steps each) put a drafted step at 1.5x to 2.4x a plain one between two starts of the same server on 2
        shared cores, enough to move the fallback's break-even past the acceptance it judges.

        `after_drafting`: each drafting proposer drafts its full block and verifies the first k tokens, as a step
        that chooses its block size after drafting does."""
        vocab = engine.target.vocab_size
        # each proposer at every shape it is timed in: a drafting one at each block size, a plain one as it is
        shaped = [[p] if p.block_size == 1 else [p.with_block_size(k) for k in block_sizes if k <= p.block_size]
                  for p in proposers]
        # (the proposer that drafts, the block size it verifies after drafting in full; None: all it drafted)
        shaped = [[(p, v.block_size) if after_drafting and p.drafts_in_one_forward else (v, None) for v in variants]
                  for p, variants in zip(proposers, shaped)]
        steps = rounds * (repeats + 1) * sum(len(variants) for variants in shaped)
        largest = max([max(block_sizes)] + [p.block_size for p in proposers])
        new_tokens = steps * largest + 1
        limit = engine.context_length
        if limit:  # a short context: a shorter prompt, and the rows start again when their room runs out
            context = max(1, min(context, limit // 4, limit - largest - 1))  # leaves room for one new token
            new_tokens = max(1, min(new_tokens, limit - context - largest))
        config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        prompt = [(7 * i + 11) % vocab for i in range(context)]  # any valid ids: only the time counts
        seconds: dict[tuple[int, int], float] = {}
        for r in rows:
            steps = {}  # (rows, block size) -> one step of a batch of r rows with that proposer
            for variants in shaped:  # one batch per proposer, shared by its block sizes
                timed = _TimedRows(engine, prompt, config, r, variants[0][0], largest)
                steps.update({(r, k or p.block_size): partial(timed.step, p, k) for p, k in variants})
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


@dataclass
class ServedRatios:
    """How many times its start-up time a served step took, per decoder (drafted or plain) and row count: the
    median of the last `keep` steps of that shape within `fresh_for_s`. The fallback's break-even compares the two
    decoders at one row count by these. One extra time per decoder, added at every shape, did not: the extra grows
    with the rows and the block (medians on 2 cores: 0.3-2.5 ms a step at one row, 4.0-4.7 ms at 8 x 8, 10-16 ms
    at 8 x 16; a sampled plain step at 8 rows 2.5 ms), so one at 8 rows judged a step of one row, and a drafted one's
    stood in for the plain one's, which pulled the break-even towards 1 (1.75 on average where sampled drafting at
    8 rows broke even at 3.9; the server drafted at 0.86x plain speed)."""

    keep: int = 16
    fresh_for_s: float = 120.0
    seen: dict[tuple[bool, int], deque] = field(default_factory=dict)  # (drafted, rows) -> (time, ratio)

    def observe(self, drafted: bool, rows: int, measured_s: float, calibrated_s: float, now: float) -> None:
        if calibrated_s > 0:
            self.seen.setdefault((drafted, rows), deque(maxlen=self.keep)).append((now, measured_s / calibrated_s))

    def of(self, drafted: bool, rows: int, now: float) -> float | None:
        """The decoder's recent ratio at this many rows; None when it has not run at it lately."""
        recent = [ratio for at, ratio in self.seen.get((drafted, rows), ()) if now - at <= self.fresh_for_s]
        return statistics.median(recent) if recent else None


class BlockSizePolicy:
    """Picks each drafted step's block size from the batch's rows; used from the decode thread only."""

    def __init__(self, proposer: Proposer, costs: StepCosts, plain_costs: StepCosts | None = None,
                 after_drafting_costs: StepCosts | None = None):
        self.costs = costs
        self.plain_costs = plain_costs  # (rows, 1) -> seconds of a plain step, for the break-even
        # (1, k) -> seconds of a step that drafts in full and verifies k tokens; None: never chosen after drafting
        self.after_drafting_costs = after_drafting_costs
        self.max_block = max(costs.block_sizes)
        self.acceptance = AcceptanceByPosition(self.max_block - 1)
        self.by_confidence = AcceptanceByConfidence()
        # one row's steps that chose after drafting: start-up's times, then the served steps'
        self.after_drafting_line = ServedCostLine() if after_drafting_costs is None else ServedCostLine.from_start_up(
            {k: s for (r, k), s in after_drafting_costs.seconds.items() if r == 1})
        self._proposers = {k: proposer.with_block_size(k) for k in costs.block_sizes}
        self._judged_confidence: list[list[float]] | None = None  # of the tokens the last step verified
        self.overhead = StepOverhead()
        self.served = ServedRatios()

    @classmethod
    def calibrate(cls, engine: SpeculativeEngine, max_batch_size: int) -> "BlockSizePolicy":
        proposer = engine.proposer
        t0 = time.perf_counter()
        rows = candidate_rows(max_batch_size)
        blocks = candidate_block_sizes(proposer.block_size)
        both = StepCosts.measure(engine, [proposer, NoDraftProposer()], rows, blocks).seconds
        costs = StepCosts({shape: s for shape, s in both.items() if shape[1] > 1}).monotone()
        plain = StepCosts({shape: s for shape, s in both.items() if shape[1] == 1}).monotone()
        after = None
        if proposer.drafts_in_one_forward:
            after = StepCosts.measure(engine, [proposer], [1], blocks, after_drafting=True).monotone()
        shapes = sorted((costs.seconds | plain.seconds).items())
        log.info("adaptive block size: step times (rows x block) measured in %.1f s: %s%s", time.perf_counter() - t0,
                 ", ".join(f"{r}x{k}: {s * 1e3:.1f} ms" for (r, k), s in shapes),
                 "" if after is None else "; choosing after drafting (one row): " + ", ".join(
                     f"1x{k}: {s * 1e3:.1f} ms" for (_, k), s in sorted(after.seconds.items())))
        return cls(proposer, costs, plain, after)

    def drafted_step_s(self, rows: int, block_size: int, now: float | None = None,
                       after_drafting: bool = False) -> float:
        """A drafted step's expected time as served lately: start-up time + recent extra per step."""
        now = time.monotonic() if now is None else now
        if after_drafting:
            return self._after_drafting_step_s(rows, now)(block_size)
        return self.costs(rows, block_size) + self.overhead.of(True, now)

    def _after_drafting_step_s(self, rows: int, now: float) -> Callable[[int], float]:
        """block size -> the time of a step that chooses it after drafting: one row's line refitted from its served
        steps (fitted once here, not once per block size a choice weighs), else start-up's + the recent extra."""
        line = self.after_drafting_line.fit() if rows == 1 else None
        if line is not None:
            return lambda k: line[0] + line[1] * k
        extra = self.overhead.of(True, now)
        return lambda k: self.after_drafting_costs(rows, k) + extra

    def break_even(self, rows: int, block_size: int | None = None, now: float | None = None) -> float:
        """The acceptance length at which a drafted step of this shape yields as many tokens/s as plain steps;
        without a block size, at the one this policy would choose for that many rows. From served times: each
        decoder's start-up time at this many rows times how much longer its served steps at that many rows took
        lately (`ServedRatios`). A decoder that has not run at it lately (the other carries the load) is taken to
        run as far over start-up as the other one does: the start-up ratio, not one decoder's time against the
        other's guess."""
        now = time.monotonic() if now is None else now
        k = block_size if block_size is not None else self.choose(rows, now)
        drafted_ratio, plain_ratio = self.served.of(True, rows, now), self.served.of(False, rows, now)
        drafted_ratio = drafted_ratio or plain_ratio or 1.0
        plain_ratio = plain_ratio or drafted_ratio
        ratio = self.costs(rows, k) * drafted_ratio / (self.plain_costs(rows, 1) * plain_ratio)
        return min(ratio, float(k))  # no acceptance length exceeds the block: a break-even above it never pays

    def observe_step(self, rows: int, block_size: int, seconds: float, now: float | None = None,
                     after_drafting: bool = False) -> None:
        """A served step's time; block size 1 is a plain step (the only kind whose costs lack that size)."""
        drafted = block_size > 1
        if after_drafting and rows == 1:
            self.after_drafting_line.observe(block_size, seconds)
        costs = self.after_drafting_costs if after_drafting else self.costs
        calibrated = costs(rows, block_size) if drafted else self.plain_costs(rows, 1)
        now = time.monotonic() if now is None else now
        self.overhead.observe(drafted, seconds, calibrated, now)
        self.served.observe(drafted, rows, seconds, calibrated, now)

    def choose(self, rows: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expected = self.acceptance.expected_tokens_by_block()  # once per step, not once per candidate

        def tokens_per_s(k: int) -> float:
            return rows * expected[k - 1] / self.drafted_step_s(rows, k, now)

        return max(self._proposers, key=tokens_per_s)

    def proposer_for(self, rows: int) -> Proposer:
        return self._proposers[self.choose(rows)]

    def plan(self, rows: list) -> tuple[Proposer, Callable[[Draft], int] | None]:
        """The next drafted step of these rows (`Sequence`s): its proposer, and how it picks the block size to
        verify from its draft (`SpeculativeEngine.step`'s `choose`), or None when the block size is chosen now."""
        if (self.after_drafting_costs is None or len(rows) != 1
                or not all(seq.params.greedy or seq.noise is not None for seq in rows)):
            return self.proposer_for(len(rows)), None
        return self._proposers[self.max_block], partial(self.choose_after_drafting, len(rows))

    def choose_after_drafting(self, rows: int, draft: Draft, now: float | None = None) -> int:
        """The block size with the most expected tokens per second for this draft, from its confidence."""
        if draft.confidence is None:
            return self.choose(rows, now)
        now = time.monotonic() if now is None else now
        confidence = draft.confidence.tolist()  # [row][position]
        expected = self.by_confidence.expected_tokens_by_block(confidence)  # [k - 1]
        step_s = self._after_drafting_step_s(rows, now)
        best = max(range(2, len(expected) + 1), key=lambda k: expected[k - 1] / step_s(k))
        self._judged_confidence = [row[: best - 1] for row in confidence]
        return best

    def observe(self, accepted: list[int], drafted: int) -> None:
        """One drafted step: accepted draft tokens per row, `drafted` = block size - 1."""
        self.acceptance.observe(accepted, drafted)
        if self._judged_confidence is not None:  # the step chose its block size after drafting
            # the engine may have verified fewer than chosen (the context's end, or what the rows still want)
            self.by_confidence.observe([row[:drafted] for row in self._judged_confidence], accepted)
            self._judged_confidence = None
