"""Losslessness on more model families than the three the whole suite runs on (conftest.FAMILIES), one
compact check each, and the up-front refusal of families whose layer state cannot be rolled back."""

from __future__ import annotations

import pytest

from conftest import (
    MORE_FAMILIES,
    REFUSED_FAMILIES,
    OracleProposer,
    check_ragged_greedy,
    decode_with_branch_oracle,
    hf_greedy,
    partial_oracle,
    random_prompts,
    tiny_drafter,
    tiny_target_model,
)
from dflash.decoding import GenerationConfig, NoDraftProposer, SpeculativeEngine
from dflash.model.target import TargetModel, UnsupportedTargetError

# families with sliding-window layers (conftest._family_fields): they decode without branches
SLIDING_FAMILIES = {"mistral", "phi3", "qwen2", "gemma2", "gemma3_text", "cohere2"}
# their position bias or window follows the slot order, which a branch breaks
SLOT_ORDER_FAMILIES = {"bloom", "mpt", "gpt_neo"}
MAX_NEW = 32  # with prompts of 3-20 tokens, sequences run well past the sliding window (conftest.SLIDING_WINDOW)
SEEDED = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=11, stop_token_ids=[])


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_speculative_decoding_is_lossless(family):
    """Greedy at block sizes 2, 8 and 16 in a ragged batch gives transformers' own greedy output; seeded
    sampling gives what the target alone samples."""
    target = TargetModel(tiny_target_model(family, layers=2))
    prompts = random_prompts(3, seed=1)
    check_ragged_greedy(target, prompts, MAX_NEW)
    sampled = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, GenerationConfig(**SEEDED))]
    engine = SpeculativeEngine(target, partial_oracle(target, dict(zip(map(tuple, prompts), sampled)), 8))
    outs = engine.generate(prompts, GenerationConfig(**SEEDED, block_size=8))
    assert [o.output_ids for o in outs] == sampled


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_branches_are_lossless_or_left_out(family):
    """A branch needs the family to read a tree-shaped 4D mask as given: every family that says it takes one
    decodes a ragged batch with branches (an oracle's, accepted at known steps) into transformers' own greedy
    output; the others decode without branches."""
    target = TargetModel(tiny_target_model(family, layers=2))
    outs, refs = decode_with_branch_oracle(target, 2, correct=2, branch_right=2, block_size=8, branch_length=3,
                                           max_new=MAX_NEW, rows=3)
    assert [o.output_ids for o in outs] == refs
    steps = {a for o in outs for a in o.stats.acceptance_lengths[1:-1]}
    assert steps == ({5} if target.takes_branches else {3})  # 2 right, then the branch's 2 (or the miss), 1
    assert target.takes_branches == (family not in SLIDING_FAMILIES | SLOT_ORDER_FAMILIES)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_survives_compaction_and_joining(family):
    """Rows join a running batch (left padding) and holes pile up until the cache is compacted; sliding
    windows still see exactly the last `window` tokens of each row."""
    target = TargetModel(tiny_target_model(family, layers=2))
    prompts = random_prompts(3, seed=5, low=2, high=30)
    refs = {tuple(p): hf_greedy(target, p, 80) for p in prompts}
    proposer = OracleProposer(tiny_drafter(target), target, refs, correct=lambda rng: rng.choice([0, 0, 15]), seed=3)
    engine = SpeculativeEngine(target, proposer)
    seqs = [engine.new_sequence(p, GenerationConfig(max_new_tokens=80, stop_token_ids=[])) for p in prompts]
    batch = engine.merge([engine.prefill(seqs[0]), engine.prefill(seqs[1])])
    for _ in range(3):
        engine.step(batch)
    batch = engine.merge([batch, engine.prefill(seqs[2])])
    compacted = False
    while batch is not None:
        holes = int((~batch.target_valid).sum())
        engine.step(batch)
        compacted = compacted or int((~batch.target_valid).sum()) < holes  # a step alone only adds holes
        batch = engine.drop_finished(batch)
    assert compacted
    assert [s.output_ids for s in seqs] == [refs[tuple(p)] for p in prompts]


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
def test_targets_whose_state_cannot_be_rolled_back_are_refused_up_front(family):
    target = TargetModel(tiny_target_model(family, layers=2))
    for proposer in (None, NoDraftProposer()):
        with pytest.raises(UnsupportedTargetError, match=r"layers \[0(, 1)?\] are '\w+' layers: .+full or sliding"):
            SpeculativeEngine(target, proposer)
