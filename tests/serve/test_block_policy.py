"""The adaptive block size inside the server: how the fallback judges a probe, and lossless answers."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from conftest import FakeProposer
from conftest import linear_step_costs as costs
from dflash.decoding.block_policy import BlockSizePolicy, StepCosts


class FakeBatch:
    def __init__(self, rows: int, block_size: int):
        self.sequences = [SimpleNamespace(error=None) for _ in range(rows)]  # rows decoding, none failed
        self.proposer = FakeProposer(block_size)
        self.block_size = block_size  # what its last step verified
        self.verified, self.branched, self.accepted = block_size, False, []
        self.produced, self.cut_short = [], False

    def __len__(self):
        return len(self.sequences)


def test_a_probe_is_judged_at_the_batch_drafting_would_get_back():
    """One probe row drafts while seven decode plainly: the threshold is the break-even of eight drafting rows,
    not of the probe's own one-row batch."""
    from types import SimpleNamespace

    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import DRAFT, PLAIN, Scheduler

    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001), StepCosts({(1, 1): 0.010, (8, 1): 0.020}))
    engine = SimpleNamespace(proposer=FakeProposer(16))
    scheduler = Scheduler(engine, fallback=FallbackConfig(auto=True), block_policy=policy)
    probe, others = FakeBatch(1, 16), FakeBatch(7, 1)
    for seq in probe.sequences + others.sequences:
        scheduler._requests[id(seq)] = SimpleNamespace(workload="w")
    scheduler._running = {DRAFT: probe, PLAIN: others}
    probe.accepted, probe.produced = [1], [2]
    scheduler._record_drafts(probe)
    assert scheduler.fallback.threshold == pytest.approx(policy.break_even(8))
    assert policy.break_even(8) != pytest.approx(policy.break_even(1, 16))
    # and its length as a block of 16 at 8 rows would pay: eight rows would draft a shorter block, which yields
    # less and costs less, so a length the probe's block of 16 reached passed a threshold set for that block
    assert policy.choose(8) < 16
    [judged] = scheduler.fallback._get("w").lengths
    assert judged == pytest.approx(2 * policy.break_even(8) / policy.break_even(8, 16)) and judged < 2


def test_adaptive_server_answers_exactly_like_the_fixed_one(start_server, server):
    adaptive = start_server(adaptive_block_size=True)
    assert adaptive.server_state.scheduler.block_policy is not None

    def ask(client, i: int) -> str:
        return client.completions.create(model="tiny", prompt=f"question {i}: how many clips?", max_tokens=12 + 2 * i,
                                         temperature=0, extra_body={"ignore_eos": True}).choices[0].text

    fixed = [ask(server.client(), i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(adaptive.client(), i), range(8)))
    assert answers == fixed
    gauge = adaptive.metrics()["dflash:spec_decode_block_size"]
    assert 2 <= gauge <= 8  # the tiny pair's drafter block is 8


def test_a_step_with_a_branch_counts_its_proposals_and_teaches_the_policy_the_blocks_acceptance():
    """Block 4 (3 draft tokens) and a branch of 2 from draft position 1: the row kept x1 and both branch tokens.
    The metrics count 5 proposed and 3 accepted; the policy learns that the block's second token was rejected."""
    from types import SimpleNamespace

    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import DRAFT, Scheduler

    policy = BlockSizePolicy(FakeProposer(4), costs(per_token_s=0.001), StepCosts({(1, 1): 0.010}))
    scheduler = Scheduler(SimpleNamespace(proposer=FakeProposer(4)), fallback=FallbackConfig(0.0),
                          block_policy=policy)
    batch = FakeBatch(1, 4)
    batch.verified, batch.branched, batch.accepted, batch.produced = 6, True, [1], [4]
    scheduler._requests[id(batch.sequences[0])] = SimpleNamespace(workload="w")
    scheduler._running = {DRAFT: batch}
    before = (policy.acceptance.tried[:], policy.acceptance.accepted[:])
    scheduler._record_drafts(batch)
    metrics = scheduler.metrics
    assert metrics.num_draft_tokens._value.get() == 5 and metrics.num_accepted_tokens._value.get() == 3
    tried = [a - b for a, b in zip(policy.acceptance.tried, before[0])]
    accepted = [a - b for a, b in zip(policy.acceptance.accepted, before[1])]
    assert tried[:3] == pytest.approx([1, 1, 0]) and accepted[:2] == pytest.approx([1, 0])


def test_acceptance_is_counted_before_a_stop_or_max_tokens_cuts_the_row():
    """A row that wanted one more token accepted all 7 draft tokens of its block: the metrics and the fallback
    count 7 accepted (as vLLM does), not the 0 the row kept; they counted 0, and a workload of short answers fell
    back from a drafter that was right every time. A block cut to what its rows still want counts in the metrics
    but not in the fallback's verdict, nor does a step left with no draft token at all."""
    from types import SimpleNamespace

    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import Scheduler

    scheduler = Scheduler(SimpleNamespace(proposer=FakeProposer(8)),
                          fallback=FallbackConfig(min_acceptance_length=3.0, window=2))
    batch = FakeBatch(2, 8)
    for seq in batch.sequences:
        scheduler._requests[id(seq)] = SimpleNamespace(workload="w")
    batch.accepted, batch.produced = [7, 7], [8, 8]  # the rows kept 1 and 3 of those 8 (a stop, max_tokens)
    scheduler._record_drafts(batch)
    metrics = scheduler.metrics
    assert metrics.num_drafts._value.get() == 2 and metrics.num_accepted_tokens._value.get() == 14
    assert scheduler.fallback._get("w").lengths == deque([8, 8]) and scheduler.fallback.drafting("w")
    batch.block_size = batch.verified = 2
    batch.accepted, batch.produced, batch.cut_short = [0, 1], [1, 2], True  # each row wanted 2 more tokens
    scheduler._record_drafts(batch)
    assert metrics.num_drafts._value.get() == 4 and metrics.num_accepted_tokens._value.get() == 15
    # no verdict from a cut block: the row that took it whole would have taken more of a full one, and judging by
    # the misses alone put a drafter right 9 times in 10 below the threshold (a workload of short requests)
    assert scheduler.fallback._get("w").lengths == deque([8, 8])
    batch.block_size = batch.verified = 1
    batch.accepted, batch.produced = [0, 0], [1, 1]  # one token wanted: verified without a draft token
    scheduler._record_drafts(batch)
    assert metrics.num_drafts._value.get() == 4 and metrics.num_draft_tokens._value.get() == 7 * 2 + 1 * 2


@pytest.mark.parametrize("produced, keeps_drafting", [(2, True), (1, False)])
def test_a_cut_step_judges_the_fallback_weighed_by_what_its_block_costs(produced, keeps_drafting):
    """Requests of 2 tokens: every step verifies a block of 2, which yields at most 2 tokens and costs what a step
    of 2 costs. Weighed by the break-even of the planned block over its own, a drafter right every time keeps
    drafting (2 tokens where 1.2 pay) and one never right falls back."""
    from types import SimpleNamespace

    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import Scheduler

    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001), StepCosts({(1, 1): 0.010}))
    scheduler = Scheduler(SimpleNamespace(proposer=FakeProposer(16)), fallback=FallbackConfig(auto=True, window=4),
                          block_policy=policy)
    batch = FakeBatch(1, 16)  # planned 16, ran 2
    scheduler._requests[id(batch.sequences[0])] = SimpleNamespace(workload="w")
    scheduler._running = {"draft": batch}
    batch.block_size = batch.verified = 2
    batch.accepted, batch.produced, batch.cut_short = [produced - 1], [produced], True
    for _ in range(4):
        scheduler._record_drafts(batch)
    assert policy.break_even(1, 2) == pytest.approx(1.2)
    judged = scheduler.fallback._get("w").lengths  # as long as the blocks the policy would choose now pay for
    assert judged[-1] == pytest.approx(produced * scheduler.fallback.threshold / 1.2)  # the threshold in use
    assert scheduler.fallback.drafting("w") == keeps_drafting
    assert (sum(judged) / len(judged) >= scheduler.fallback.threshold) == keeps_drafting


@pytest.mark.parametrize("auto", [True, False])
def test_a_workload_drafting_beside_a_plain_one_is_judged_at_its_own_rows(auto):
    """Four rows of one workload draft while four of another decode plainly: their step is judged by whether
    it paid at four rows, not by the break-even of eight (in auto mode the threshold is eight rows')."""
    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import DRAFT, PLAIN, Scheduler

    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001),
                             StepCosts({(1, 1): 0.010, (4, 1): 0.015, (8, 1): 0.020}))
    fallback = FallbackConfig(auto=True) if auto else FallbackConfig(min_acceptance_length=2.0)
    scheduler = Scheduler(SimpleNamespace(proposer=FakeProposer(16)), fallback=fallback, block_policy=policy)
    drafting, plain = FakeBatch(4, 8), FakeBatch(4, 1)
    for batch, workload in ((drafting, "a"), (plain, "b")):
        for seq in batch.sequences:
            scheduler._requests[id(seq)] = SimpleNamespace(workload=workload)
    scheduler._running = {DRAFT: drafting, PLAIN: plain}
    drafting.accepted, drafting.produced = [3] * 4, [4] * 4
    scheduler._record_drafts(drafting)
    reference = policy.break_even(8) if auto else policy.break_even(4)
    [judged, *_] = scheduler.fallback._get("a").lengths
    assert judged == pytest.approx(4 * reference / policy.break_even(4, 8))
    assert (judged >= reference) == (4 >= policy.break_even(4, 8))  # paid at its own rows and block, or not


def test_a_server_without_the_fallback_weighs_no_drafts(monkeypatch):
    """--fallback-min-acceptance 0: the decode step computes no break-even for a verdict nobody asks for."""
    from dflash.serve.fallback import FallbackConfig
    from dflash.serve.scheduler import DRAFT, Scheduler

    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001), StepCosts({(1, 1): 0.010}))
    scheduler = Scheduler(SimpleNamespace(proposer=FakeProposer(16)), fallback=FallbackConfig(), block_policy=policy)
    batch = FakeBatch(1, 16)
    scheduler._requests[id(batch.sequences[0])] = SimpleNamespace(workload="w")
    scheduler._running = {DRAFT: batch}
    batch.accepted, batch.produced = [3], [4]
    asked = []
    monkeypatch.setattr(policy, "break_even", lambda *a, **k: asked.append(a) or 2.0)
    scheduler._record_drafts(batch)
    assert asked == [] and scheduler.metrics.num_drafts._value.get() == 1
    scheduler.fallback.config.auto = True  # and in auto mode, one break-even for the threshold, one for the step
    scheduler._record_drafts(batch)
    assert asked == [(1,), (1, 16)]
