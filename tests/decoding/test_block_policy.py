"""Adaptive block size: acceptance by position, step-cost interpolation, the choice it makes, start-up timing,
and that changing the block size between steps leaves greedy output lossless."""

from __future__ import annotations

import random
import types

import pytest
import torch

from conftest import (
    FakeProposer,
    OracleProposer,
    blocks_wanted,
    hf_greedy,
    random_prompts,
    tiny_drafter,
    tiny_target_config,
)
from conftest import linear_step_costs as costs
from dflash.decoding import DFlashProposer, GenerationConfig, NoDraftProposer, SpeculativeEngine, block_policy
from dflash.decoding.block_policy import (
    AcceptanceByConfidence,
    AcceptanceByPosition,
    BlockSizePolicy,
    ServedCostLine,
    StepCosts,
    candidate_block_sizes,
    candidate_rows,
)
from dflash.decoding.proposer import Draft


def policy_with(accepted_per_row: int, step_costs: StepCosts, steps: int = 400) -> BlockSizePolicy:
    policy = BlockSizePolicy(FakeProposer(16), step_costs)
    for _ in range(steps):
        policy.observe([accepted_per_row] * 4, drafted=15)
    return policy


def test_acceptance_by_position_learns_where_drafts_break():
    acc = AcceptanceByPosition(15)
    for _ in range(500):
        acc.observe([3], 15)  # always 3 accepted, the 4th rejected, later positions never judged
    assert [acc.conditional(j) for j in range(4)] == pytest.approx([1.0, 1.0, 1.0, 0.0], abs=0.02)
    assert acc.conditional(10) == pytest.approx(acc.conditional(3))  # never judged: like the last one judged
    assert acc.expected_tokens(2) == pytest.approx(2.0, abs=0.01)
    assert acc.expected_tokens(16) == pytest.approx(4.0, abs=0.05)


def test_positions_never_judged_are_expected_to_do_as_well_as_the_last_one_judged():
    acc = AcceptanceByPosition(15)
    for _ in range(300):  # block 4 only: every row accepts 2 of its 3 draft tokens, 1 in 10 all 3
        acc.observe([2] * 9 + [3], drafted=3)
    judged = acc.conditional(2)
    assert judged == pytest.approx(0.1, abs=0.01)
    assert [acc.conditional(j) for j in range(3, 15)] == pytest.approx([judged] * 12)
    fresh = AcceptanceByPosition(15)
    assert fresh.expected_tokens(16) == pytest.approx(2.0, abs=0.01)  # 0.5 + 0.25 + ...: the first prior


def test_short_blocks_keep_what_was_learned_about_later_positions():
    """Evidence fades only as new evidence about the same position comes: a spell of short blocks does not
    wipe out what long blocks showed (which would keep the policy on short blocks for good)."""
    acc = AcceptanceByPosition(15)
    for _ in range(200):
        acc.observe([15, 12, 14, 15], drafted=15)  # long blocks accepted almost whole
    before = acc.conditional(10)
    for _ in range(2000):
        acc.observe([1, 1, 1, 1], drafted=1)  # block 2 for a long while: position 1 keeps being accepted
    assert acc.conditional(10) == pytest.approx(before)
    assert acc.expected_tokens(16) > 10


def test_acceptance_follows_the_workload():
    acc = AcceptanceByPosition(15)
    for _ in range(250):
        acc.observe([15, 15], 15)
    assert acc.expected_tokens(16) > 14.5
    for _ in range(1500):  # the workload changes: drafts now fail at once
        acc.observe([0], 15)
    assert acc.expected_tokens(16) < 1.2


def test_costs_interpolate_between_measured_rows_and_extrapolate_beyond():
    c = StepCosts({(1, 4): 1.0, (4, 4): 4.0})
    assert c(1, 4) == 1.0 and c(4, 4) == 4.0
    assert c(2, 4) == pytest.approx(2.0)
    assert c(8, 4) == pytest.approx(8.0)
    noisy = StepCosts({(1, 2): 5.0, (1, 4): 2.0, (2, 2): 3.0, (2, 4): 9.0})  # (1, 2) caught a stall
    assert noisy.monotone().seconds == {(1, 2): 2.0, (1, 4): 2.0, (2, 2): 3.0, (2, 4): 9.0}
    assert candidate_block_sizes(16) == [2, 4, 8, 16] and candidate_block_sizes(6) == [2, 4, 6]
    assert candidate_rows(8) == [1, 2, 4, 8] and candidate_rows(6) == [1, 2, 4, 6] and candidate_rows(1) == [1]
    assert candidate_rows(100_000)[-1] == 64  # a huge --max-batch-size is not timed row count by row count


def test_costs_interpolate_between_measured_block_sizes():
    c = StepCosts({(1, 2): 1.0, (1, 4): 2.0, (1, 8): 6.0, (2, 2): 3.0, (2, 4): 5.0, (2, 8): 9.0})
    assert c(1, 3) == pytest.approx(1.5) and c(1, 6) == pytest.approx(4.0) and c(1, 8) == 6.0
    assert c(2, 3) == pytest.approx(4.0)
    assert c(4, 6) == pytest.approx(14.0)  # beyond the measured rows: linear in rows, from 2 rows' 7.0


def test_a_calibrated_drafters_confidence_is_taken_at_its_word():
    acc = AcceptanceByConfidence()
    assert [acc.rate(c) for c in (0.02, 0.33, 0.5, 0.97)] == pytest.approx([0.025, 0.325, 0.525, 0.975])  # centres
    expected = acc.expected_tokens_by_block([[0.97, 0.97, 0.02]])  # one row, B = 4
    assert expected == pytest.approx([1.0, 1.975, 1.975 + 0.975**2, 1.975 + 0.975**2 + 0.975**2 * 0.025])
    two_rows = acc.expected_tokens_by_block([[0.97, 0.97, 0.02], [0.02, 0.97, 0.97]])
    assert two_rows[0] == 2.0 and two_rows[1] == pytest.approx(1.975 + 1.025)  # summed over the rows


def test_verification_corrects_an_over_sure_drafter_bin_by_bin():
    acc = AcceptanceByConfidence()
    rng = random.Random(0)
    for _ in range(400):  # confidence 0.95 but right half the time; confidence 0.3 right as often as it says
        first, second = rng.random() < 0.5, rng.random() < 0.3
        acc.observe([[0.95, 0.31]], [0 if not first else (2 if second else 1)])
    assert acc.rate(0.95) == pytest.approx(0.5, abs=0.08)
    assert acc.rate(0.31) == pytest.approx(0.3, abs=0.1)  # judged only after an accepted first token: fewer counts
    assert acc.rate(0.75) == pytest.approx(0.775)  # a bin never judged keeps its prior


def test_served_steps_fit_the_cost_of_each_verified_token():
    line = ServedCostLine.from_start_up({2: 0.015, 4: 0.016, 8: 0.019, 16: 0.024})  # start-up: too steep
    a, b = line.fit()
    assert b == pytest.approx(0.00064, abs=0.00002)
    for i in range(150):
        k = 2 + i % 15
        line.observe(k, 0.018 + 0.0002 * k + (0.004 if i % 7 == 0 else 0.0))  # served, with a stall now and then
    a, b = line.fit()
    assert b == pytest.approx(0.0002, abs=0.0001) and a == pytest.approx(0.0186, abs=0.001)
    for _ in range(1000):  # a long run at one block size says nothing about the slope
        line.observe(16, 0.0212)
    assert line.fit() is None
    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.002), after_drafting_costs=costs(per_token_s=0.002))
    assert policy.drafted_step_s(1, 10, now=0, after_drafting=True) == pytest.approx(0.03)  # the prior's own line
    policy.after_drafting_line.sums = ServedCostLine.from_start_up({2: 0.02, 16: 0.0242}).sums
    assert policy.drafted_step_s(1, 10, now=0, after_drafting=True) == pytest.approx(0.0224)  # the fit, not start-up
    assert policy.drafted_step_s(2, 10, now=0, after_drafting=True) == pytest.approx(0.05)  # one row only


def test_a_draft_is_verified_as_far_as_its_confidence_pays():
    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.002), after_drafting_costs=costs(per_token_s=0.002))
    sure = torch.full((1, 15), 0.99)
    falters = torch.tensor([[0.99, 0.99, 0.1] + [0.99] * 12])
    tokens = torch.zeros(1, 15, dtype=torch.long)
    assert policy.choose_after_drafting(1, Draft(tokens, [None], lambda: sure), now=0) == 16
    assert policy.choose_after_drafting(1, Draft(tokens, [None], lambda: falters), now=0) == 3
    policy.observe([2], drafted=2)  # both verified tokens accepted: the policy learns from the two it judged
    assert sum(policy.by_confidence.tried) == 2 and policy._judged_confidence is None
    assert policy.choose_after_drafting(1, Draft(tokens, [None], lambda: sure), now=0) == 16
    policy.observe([3], drafted=3)  # the engine verified 3 of the 16 (what the row still wanted): all accepted
    assert sum(policy.by_confidence.tried) == pytest.approx(sum(policy.by_confidence.accepted))  # none rejected
    assert sum(policy.by_confidence.tried) == pytest.approx(5, abs=0.01)


def _rows(*kinds: str):
    """Stand-ins for `Sequence`s: greedy, seeded or sampled rows."""
    return [types.SimpleNamespace(params=types.SimpleNamespace(greedy=k == "greedy"),
                                  noise=object() if k == "seeded" else None) for k in kinds]


def test_one_greedy_or_seeded_row_chooses_after_drafting_and_the_rest_before():
    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.002), after_drafting_costs=costs(per_token_s=0.002))
    for rows in (_rows("greedy"), _rows("seeded")):
        proposer, choose = policy.plan(rows)
        assert proposer.block_size == 16 and choose is not None  # drafts the whole block, then chooses
    for rows in (_rows("sampled"), _rows("greedy", "greedy")):  # rejection sampling; a batch shares one size
        proposer, choose = policy.plan(rows)
        assert choose is None and proposer.block_size == policy.choose(len(rows))
    before_only = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.002))  # e.g. a draft model
    assert before_only.plan(_rows("greedy"))[1] is None


def test_seeded_sampling_at_auto_block_size_gives_the_targets_own_draws(target):
    """A seeded row's text is the target's draws, whatever the drafts and however far they are verified."""
    prompt = random_prompts(1, seed=5)[0]
    config = dict(max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=11)
    plain = SpeculativeEngine(target).generate([prompt], GenerationConfig(**config))[0].output_ids
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target, layers=2), target))
    out = engine.generate([prompt], GenerationConfig(**config, block_size="auto"))[0]
    assert out.output_ids == plain
    assert sum(engine._block_policy.by_confidence.tried) > 0  # it chose after drafting


def test_flat_costs_and_good_drafts_verify_the_whole_block():
    policy = policy_with(accepted_per_row=12, step_costs=costs(per_token_s=0.0))
    assert policy.choose(1) == policy.choose(8) == 16


def test_costly_tokens_and_poor_drafts_verify_short_blocks_and_shorter_when_the_batch_grows():
    policy = policy_with(accepted_per_row=2, step_costs=costs(per_token_s=0.002))
    assert policy.choose(1) == 4  # 3 expected tokens for 0.018 s beats 2 for 0.014 s and ~3 for 0.026 s
    assert policy.choose(8) == 2
    assert policy.proposer_for(8).block_size == 2


def test_break_even_is_the_cost_ratio_to_a_plain_step():
    plain = StepCosts({(1, 1): 0.010, (8, 1): 0.020})
    policy = BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001), plain)
    assert policy.break_even(1, 4) == pytest.approx(0.014 / 0.010)
    assert policy.break_even(8, 16) == pytest.approx(0.138 / 0.020)
    assert policy.break_even(8) == policy.break_even(8, policy.choose(8))  # at the block it would choose


def served_policy() -> BlockSizePolicy:
    return BlockSizePolicy(FakeProposer(16), costs(per_token_s=0.001), StepCosts({(1, 1): 0.010, (8, 1): 0.020}))


def test_break_even_compares_each_decoders_served_steps_at_the_row_count_judged():
    """Served steps at 8 rows took longer than start-up timed them, each decoder by its own factor; those at one
    row did not, and judge one row."""
    policy = served_policy()
    calibrated = policy.break_even(8, 16, now=0.0)
    assert calibrated == pytest.approx(0.138 / 0.020)
    for t in range(20):
        policy.observe_step(8, 1, 0.020 * 1.2, now=float(t))
        policy.observe_step(8, 16, 0.138 * 1.5, now=float(t))
        policy.observe_step(1, 16, 0.026, now=float(t))  # one row: as at start-up
    assert policy.break_even(8, 16, now=20.0) == pytest.approx(0.138 * 1.5 / (0.020 * 1.2))
    assert policy.break_even(1, 16, now=20.0) == pytest.approx(0.026 / 0.010)  # not 8 rows' extra time
    policy.observe_step(8, 16, 0.138 * 9, now=21.0)  # one stalled step among 21: the median does not move
    assert policy.break_even(8, 16, now=21.0) == pytest.approx(0.138 * 1.5 / (0.020 * 1.2))
    assert policy.break_even(8, 16, now=200.0) == pytest.approx(calibrated)  # neither served lately


def test_a_decoder_not_served_lately_is_taken_to_run_as_far_over_start_up_as_the_other():
    """Sampled drafted steps at 8 rows took 1.7x their (greedy) start-up time while no plain step ran: the plain
    steps' time was taken to grow by the drafted steps' extra, which put the break-even at 1.6 where it was 3.9.
    Now the start-up ratio stands until a plain step is timed at that many rows."""
    policy = served_policy()
    for t in range(10):
        policy.observe_step(8, 16, 0.138 * 1.7, now=float(t))
    assert policy.break_even(8, 16, now=10.0) == pytest.approx(0.138 / 0.020)
    policy.observe_step(8, 1, 0.020 * 1.3, now=11.0)
    assert policy.break_even(8, 16, now=11.0) == pytest.approx(0.138 * 1.7 / (0.020 * 1.3))
    policy.observe_step(1, 1, 0.010 * 2.0, now=12.0)  # and the other way round, at one row
    assert policy.break_even(1, 16, now=12.0) == pytest.approx(0.026 / 0.010)


def test_break_even_stays_within_the_block_when_served_steps_beat_start_up():
    """A start-up slowed by other work times plain steps too dear; served ones then come in far under it. The
    break-even stays at most the block size (no acceptance length is longer), and finite."""
    policy = served_policy()
    for t in range(30):
        policy.observe_step(8, 1, 0.001, now=float(t))  # served plain steps at a twentieth of start-up's time
    assert policy.break_even(8, 4, now=30.0) == pytest.approx(0.042 / 0.020)  # no drafted step: start-up ratio
    for t in range(31, 61):
        policy.observe_step(8, 16, 0.138, now=float(t))
    assert policy.break_even(8, 16, now=61.0) == 16.0  # 138x a plain step: never pays, and no more than that


def test_time_served_steps_take_beyond_start_up_favours_longer_blocks():
    """Per-step costs that are the same for every block size (other threads and processes, bookkeeping)
    weigh more on short blocks: with enough of them, verifying more tokens per step pays."""
    policy = policy_with(accepted_per_row=2, step_costs=costs(per_token_s=0.002))
    assert policy.choose(8, now=0.0) == 2
    for t in range(30):
        policy.observe_step(8, 2, 0.042 + 0.200, now=float(t))  # 200 ms more per step than at start-up
    assert policy.choose(8, now=30.0) == 4  # 3 tokens per row for 0.274 s beats 2 for 0.242 s
    assert policy.drafted_step_s(8, 4, now=30.0) == pytest.approx(0.074 + 0.200)
    assert policy.choose(8, now=100.0) == 2  # not timed lately: the start-up costs alone


def test_changing_the_block_size_every_step_is_lossless(target):
    prompts = random_prompts(3, seed=5)
    refs = {tuple(p): hf_greedy(target, p, 40) for p in prompts}
    proposer = OracleProposer(tiny_drafter(target, layers=2), target, refs,
                              correct=lambda rng: rng.randint(0, 15), seed=3)
    engine = SpeculativeEngine(target, proposer)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    batch = engine.merge([engine.prefill(engine.new_sequence(p, config)) for p in prompts])
    rng, used = random.Random(0), set()
    while not all(seq.finished for seq in batch.sequences):
        k = rng.choice([2, 3, 5, 8, 16])
        used.add(k)
        batch.proposer = proposer.with_block_size(k)
        engine.step(batch)
    assert len(used) > 3
    assert [seq.output_ids[:40] for seq in batch.sequences] == [refs[tuple(p)] for p in prompts]


def test_local_decoding_teaches_the_policy_what_its_steps_take(target, monkeypatch):
    """`generate` at block size auto times its steps as the server does: steps 60 ms slower than start-up's
    costs are seen (and move the policy to longer blocks, as `test_time_served_steps_take_beyond_start_up_...`
    shows)."""
    import time

    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    policy = BlockSizePolicy(engine.proposer, costs(per_token_s=0.002))
    engine._block_policy = policy
    real_step = engine.step

    def slow_step(batch, choose=None):
        time.sleep(0.060)
        return real_step(batch, choose)

    monkeypatch.setattr(engine, "step", slow_step)
    engine.generate(random_prompts(1, seed=2), GenerationConfig(max_new_tokens=12, block_size="auto",
                                                                ignore_eos=True))
    # start-up costs put a one-row step at 0.042 s at most (block 16): each step took at least 0.018 s more
    assert policy.overhead.extra_s[True] > 0.018


def test_a_block_cut_to_what_the_row_wants_teaches_no_step_cost(target, monkeypatch):
    """The last steps of an answer verify only what it still wants (and draft fewer outputs): timed as if they were
    the block sizes start-up timed, they made short blocks look cheaper than they are."""
    prompts = random_prompts(1, seed=2)
    refs = {tuple(p): hf_greedy(target, p, 12) for p in prompts}
    engine = SpeculativeEngine(target, OracleProposer(tiny_drafter(target, block_size=8), target, refs))
    policy = BlockSizePolicy(engine.proposer, costs(per_token_s=0.002))
    engine._block_policy = policy
    timed, cut = [], []
    monkeypatch.setattr(policy, "observe_step", lambda rows, k, seconds, **kw: timed.append(k))
    real_step = engine.step

    def step(batch, choose=None):
        kept = real_step(batch, choose)
        cut.append(batch.cut_short)
        return kept

    monkeypatch.setattr(engine, "step", step)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=12, block_size="auto", ignore_eos=True))[0]
    assert out.output_ids == refs[tuple(prompts[0])]
    assert any(cut) and len(timed) == cut.count(False)


def test_calibration_times_every_shape_on_a_real_pair(target):
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target, block_size=8))
    policy = BlockSizePolicy.calibrate(engine, max_batch_size=3)
    assert set(policy.costs.seconds) == {(r, k) for r in (1, 2, 3) for k in (2, 4, 8)}
    assert set(policy.plain_costs.seconds) == {(r, 1) for r in (1, 2, 3)}
    # a DFlash drafter drafts in one forward: one row's steps are also timed drafting in full, verifying k
    assert set(policy.after_drafting_costs.seconds) == {(1, k) for k in (2, 4, 8)}
    assert all(s > 0 for s in policy.costs.seconds.values())
    assert policy.choose(3) in (2, 4, 8)


def test_calibration_keeps_each_shapes_fastest_step(target, monkeypatch):
    """Noise only adds time: a shape's cost is its fastest step, whatever bursts hit some of its steps."""
    import types

    import dflash.timing

    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target, block_size=4))
    clock = [0.0]
    monkeypatch.setattr(dflash.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real_step, steps = engine.step, []

    def step(batch, choose=None):  # a step of block k takes k seconds on the fake clock; every third one 100x longer
        steps.append(batch.proposer.block_size)
        clock[0] += batch.proposer.block_size * (100 if len(steps) % 3 == 0 else 1)
        return real_step(batch, choose)

    engine.step = step
    costs = StepCosts.measure(engine, [engine.proposer, NoDraftProposer()], rows=[1], block_sizes=[2, 4],
                              rounds=2, repeats=2)
    assert costs.seconds == {(1, 1): 1.0, (1, 2): 2.0, (1, 4): 4.0}
    assert steps.count(1) == steps.count(2) == steps.count(4) == 2 * 3  # rounds x (warm-up + repeats)
    assert steps[:3] == [2, 2, 2] and 1 in steps[:12] and steps[-1] == 1  # shapes interleave round by round


@pytest.mark.parametrize("block", [8, 16])
def test_generate_with_auto_block_size_is_lossless_and_uses_several_sizes(target, block, monkeypatch):
    """Three rows choose their block size before drafting, from the doubling sizes; one row (the stream, and the
    last row left) after drafting, from any size up to the block."""
    prompts = random_prompts(3, seed=11)
    refs = {tuple(p): hf_greedy(target, p, 30) for p in prompts}
    proposer = OracleProposer(tiny_drafter(target, layers=2, block_size=block), target, refs,
                              correct=lambda rng: rng.randint(0, block - 1), seed=4)
    engine = SpeculativeEngine(target, proposer)
    before, after = [], []
    real_proposer_for, real_after = BlockSizePolicy.proposer_for, BlockSizePolicy.choose_after_drafting

    def spy_before(self, rows):
        picked = real_proposer_for(self, rows)
        before.append(picked.block_size)
        return picked

    def spy_after(self, rows, draft, now=None):
        after.append(real_after(self, rows, draft, now))
        return after[-1]

    monkeypatch.setattr(BlockSizePolicy, "proposer_for", spy_before)
    monkeypatch.setattr(BlockSizePolicy, "choose_after_drafting", spy_after)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, block_size="auto")
    outputs = engine.generate(prompts, config)
    assert [o.output_ids for o in outputs] == [refs[tuple(p)] for p in prompts]
    policy = engine._block_policy
    assert policy is not None and set(policy.costs.block_sizes) == set(candidate_block_sizes(block))
    assert before and set(before) <= set(candidate_block_sizes(block))
    for out in outputs:  # each verify step records the block it checked
        assert len(out.stats.block_sizes) == len(out.stats.acceptance_lengths) - 1
        wanted = blocks_wanted(out.stats.acceptance_lengths, block, 30)
        # a chosen size, or one cut to what the batch still wants (at least what this row does)
        assert all(k in before + after or wanted[i] <= k < block for i, k in enumerate(out.stats.block_sizes))
        assert all(n <= b for n, b in zip(out.stats.acceptance_lengths[1:], out.stats.block_sizes))
    assert sum(policy.acceptance.tried) > 0  # it learned from the steps it chose
    streamed = [t for piece in engine.stream(prompts[0], config) for t in piece]
    assert streamed == refs[tuple(prompts[0])]
    assert after and all(2 <= k <= block for k in after)
    assert sum(policy.by_confidence.tried) > 0  # ... and what the drafter's confidence is worth
    assert engine._block_policy is policy  # timed once, then reused


def test_auto_block_size_serves_what_a_fixed_block_serves_in_a_context_barely_longer_than_a_block():
    """20 positions and a block of 16: the start-up timing's own rows must fit as well (they were a 5-token prompt,
    refused in the user's name when a block was kept free at the context's end)."""
    from transformers import AutoModelForCausalLM

    from dflash.model import TargetModel

    config = tiny_target_config("qwen3")
    config.max_position_embeddings = 20
    torch.manual_seed(0)
    target = TargetModel(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target, block_size=16), target))
    fixed = engine.generate([[1, 2]], GenerationConfig(max_new_tokens=2, block_size=16))[0].output_ids
    assert engine.generate([[1, 2]], GenerationConfig(max_new_tokens=2, block_size="auto"))[0].output_ids == fixed


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_auto_block_size_on_a_target_with_a_short_context(family, monkeypatch):
    """The start-up timing of block size auto fits any context: on a target of 160 positions (all its timed steps
    write ~960 tokens, and a gpt2 target cannot even embed a position past its last), drafts that are always right
    use up the rows' room many times over, and `generate` still decodes losslessly."""
    from transformers import AutoModelForCausalLM

    from dflash.model import TargetModel

    config = tiny_target_config(family)
    config.max_position_embeddings = 160
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    target = TargetModel(model)
    prompt = random_prompts(1, seed=3)[0]
    refs = {tuple(prompt): hf_greedy(target, prompt, 24)}
    timing_rows = [(7 * i + 11) % target.vocab_size for i in range(160 // 4)]
    refs[tuple(timing_rows)] = hf_greedy(target, timing_rows, 160 - 40 - 16)  # the timing's own dummy rows
    proposer = OracleProposer(tiny_drafter(target, block_size=16), target, refs)  # every draft token right
    engine = SpeculativeEngine(target, proposer)
    starts = []
    real_start = block_policy._TimedRows._start
    monkeypatch.setattr(block_policy._TimedRows, "_start", lambda self: starts.append(1) or real_start(self))
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True, block_size="auto"))[0]
    assert out.output_ids == refs[tuple(prompt)]
    assert len(starts) > 2  # two proposers' rows, started again when their room ran out
    assert engine._block_policy is not None and engine._block_policy.costs.block_sizes


def test_auto_block_size_without_a_drafter_or_with_a_bad_name():
    from dflash.decoding.engine import GenerationError

    with pytest.raises(GenerationError, match="'auto'"):
        GenerationConfig(block_size="fast")
