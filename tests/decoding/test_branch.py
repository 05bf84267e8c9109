"""Branches: a second path verified with the block in one target forward. The output stays the target's own
for every family and block size; a right branch adds its tokens; targets and rows that cannot take one decode
without it."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BranchOracle,
    decode_with_branch_oracle,
    dflash2_drafter,
    hf_greedy,
    random_prompts,
    tiny_drafter,
    tiny_target_model,
)
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.branch import Branch, accept_branch, block_visibility, most_likely_first_miss
from dflash.decoding.engine import GenerationError
from dflash.decoding.proposer import branch_along_lattice, branch_per_position
from dflash.model.dflash2 import walk
from dflash.model.target import TargetModel

MAX_NEW = 40


# ---- the pieces --------------------------------------------------------------------------------------------
def test_the_branch_starts_where_the_first_miss_is_likeliest():
    confidence = torch.tensor([[0.9, 0.9, 0.2, 0.9, 0.1],    # P(first miss): .1, .09, .65, ...
                               [0.3, 0.9, 0.9, 0.9, 0.9],    # .7 at the first token
                               [0.99, 0.99, 0.99, 0.99, 0.1]])
    assert most_likely_first_miss(confidence, 5).tolist() == [2, 0, 4]
    assert most_likely_first_miss(confidence, 2).tolist() == [0, 0, 0]  # among the verified draft tokens only


def test_visibility_is_causal_in_the_block_and_cuts_the_branch_off_at_its_start():
    seen = block_visibility(4, torch.tensor([1]), 2)[0].int().tolist()  # anchor x1 x2 x3 | y2 y3 (y2 replaces x2)
    assert seen == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # y2 sees the anchor and x1, not x2 or x3
        [1, 1, 0, 0, 1, 1],
    ]


def test_accepting_a_branch():
    # block: anchor x1 x2 x3 (block size 4); branch of 3 from draft position 1 (x2's place); q = 7.
    # the target's token after each of the 7 slots:
    targets = torch.tensor([
        [11, 12, 13, 14, 90, 91, 92],  # block all right (x = 11 12 13): the branch is not taken
        [11, 22, 40, 41, 23, 24, 25],  # x2 missed, the branch y = 22 23 24 is right throughout: bonus 25
        [11, 22, 40, 41, 23, 99, 98],  # x2 missed, y2 y3 right, y4 wrong: the target's 99 after y3
        [11, 77, 40, 41, 23, 24, 25],  # x2 missed and y2 is wrong too: the target's 77
        [55, 22, 40, 41, 23, 24, 25],  # x1 missed, before the branch starts
    ])
    branch = Branch(start=torch.tensor([1] * 5), tokens=torch.tensor([[22, 23, 24]] * 5))
    num_accepted = torch.tensor([3, 1, 1, 1, 0])
    new_tokens, kept = accept_branch(num_accepted, targets, branch, 4)
    assert new_tokens == [[11, 12, 13, 14], [11, 22, 23, 24, 25], [11, 22, 23, 99], [11, 77], [55]]
    assert kept.int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1],  # the anchor, x1, and the three branch tokens
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
    ]
    assert [len(t) for t in new_tokens] == kept.sum(1).tolist()  # a kept slot per new token but the last + anchor


def test_a_dflash_branch_is_the_next_best_token_then_the_draft():
    logits = torch.zeros(1, 4, 10)
    logits[0, 1, 7], logits[0, 1, 3] = 5.0, 4.0  # position 1: best 7, next best 3
    tokens = torch.tensor([[1, 7, 2, 4]])
    assert branch_per_position(logits, tokens, torch.tensor([1]), 3).tolist() == [[3, 2, 4]]
    assert branch_per_position(logits, tokens, torch.tensor([1]), 5).tolist() == [[3, 2, 4, 4, 4]]  # past the draft


def test_a_dflash2_branch_leaves_the_path_and_walks_on():
    target = TargetModel(tiny_target_model("qwen3"))
    drafter = dflash2_drafter(target)
    torch.manual_seed(0)
    logits, hidden = torch.randn(2, 6, target.vocab_size) * 2, torch.randn(2, 6, target.hidden_size)
    lattice = drafter.candidate_selector.lattice(logits, hidden, torch.tensor([5, 9]))
    path, chosen = walk(lattice)
    start = torch.tensor([0, 2])
    branch = branch_along_lattice(lattice, chosen, start, 3)
    best = lattice.scores.argmax(-1)
    for r, d in enumerate(start.tolist()):
        scores = lattice.scores[r, d, chosen[r, d - 1] if d else 0].clone()
        c = int(scores.argsort(descending=True)[1] if scores.argmax() == chosen[r, d] else scores.argmax())
        assert branch[r, 0] == lattice.candidates[r, d, c] != path[r, d]  # the next best after the path's token
        for j in (1, 2):
            c = int(best[r, d + j, c])
            assert branch[r, j] == lattice.candidates[r, d + j, c]  # then the walk from it


def test_a_negative_branch_length_is_refused():
    with pytest.raises(GenerationError, match="branch_length"):
        GenerationConfig(branch_length=-1)


# ---- decoding ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("drafting", ["drafter", "branch oracle"])
def test_greedy_with_branches_is_lossless(target, block_size, drafting):
    prompts = random_prompts(3, seed=31)
    refs = {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}
    drafter = tiny_drafter(target, layers=2)
    proposer = (DFlashProposer(drafter, target) if drafting == "drafter"
                else BranchOracle(drafter, target, refs, correct=1, branch_right=2))
    engine = SpeculativeEngine(target, proposer)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, branch_length=3, ignore_eos=True)
    batch = engine.generate(prompts, config)
    singles = [engine.generate([p], config)[0] for p in prompts]
    for prompt, out, single in zip(prompts, batch, singles):
        assert out.output_ids == single.output_ids == refs[tuple(prompt)]
        assert block_size < out.stats.block_sizes[0] <= block_size + 3  # the block and a branch (cut in a block of 4)
    if drafting == "branch oracle":  # x1 right, x2 wrong, the branch's first two right: 1 + 2 + the target's token
        steps = [a for o in batch for a in o.stats.acceptance_lengths[1:-1]]  # (the last one may be cut)
        assert set(steps) == {4}, steps


def test_a_dflash2_drafters_branches_are_lossless(target):
    prompts = random_prompts(3, seed=32)
    engine = SpeculativeEngine(target, DFlashProposer(dflash2_drafter(target), target))
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW, branch_length=4, ignore_eos=True))
    assert [o.output_ids for o in outs] == [hf_greedy(target, p, MAX_NEW) for p in prompts]
    assert all(o.stats.block_sizes[0] > 16 for o in outs)


def test_a_branch_that_would_pass_the_block_is_cut():
    """The branch's positions stay within the proposer's block past the anchor (and within the context)."""
    target = TargetModel(tiny_target_model("qwen3"))
    prompts = random_prompts(1, seed=33)
    refs = {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=5, branch_right=8))
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, branch_length=6,
                                                    ignore_eos=True))[0]
    assert out.output_ids == refs[tuple(prompts[0])]
    assert out.stats.block_sizes[0] == 8 + 2  # start 5 in a block of 8: two positions left before the block ends
    assert out.stats.acceptance_lengths[1] == 8  # 5 right, the branch's 2, the target's token


def test_rows_sampling_without_a_seed_decode_without_branches():
    target = TargetModel(tiny_target_model("qwen3"))
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    out = engine.generate(random_prompts(1, seed=34), GenerationConfig(max_new_tokens=12, branch_length=3,
                                                                       block_size=4, temperature=0.8))[0]
    assert max(out.stats.block_sizes) <= 4  # no branch verified beside the block (the last one may be cut)


@pytest.mark.parametrize("drafting", ["dflash2 drafter", "branch oracle"])
def test_seeded_rows_with_branches_write_the_target_alones_text(target, drafting):
    """A seed fixes the target's token at every position, so a branch is checked against the same draws: a branch
    that holds the target's own draws is accepted."""
    prompts = random_prompts(3, seed=37)
    config = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=11, branch_length=3,
                              ignore_eos=True)
    alone = {tuple(p): o.output_ids for p, o in zip(prompts, SpeculativeEngine(target).generate(prompts, config))}
    proposer = (DFlashProposer(dflash2_drafter(target), target) if drafting == "dflash2 drafter"
                else BranchOracle(tiny_drafter(target), target, alone, correct=1, branch_right=2))
    outs = SpeculativeEngine(target, proposer).generate(prompts, config)
    assert [o.output_ids for o in outs] == [alone[tuple(p)] for p in prompts]
    assert all(max(o.stats.block_sizes) > 16 for o in outs)
    if drafting == "branch oracle":  # x1 right, x2 wrong, the branch's first two right, then the target's draw
        assert {a for o in outs for a in o.stats.acceptance_lengths[1:-1]} == {4}


def test_a_target_with_sliding_windows_decodes_without_branches():
    target = TargetModel(tiny_target_model("mistral"))
    assert not target.takes_branches
    prompts = random_prompts(2, seed=35)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW, branch_length=3, block_size=8,
                                                     ignore_eos=True))
    assert [o.output_ids for o in outs] == [hf_greedy(target, p, MAX_NEW) for p in prompts]
    assert max(k for o in outs for k in o.stats.block_sizes) == 8  # no branch beside a block (the last ones cut)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_branches_under_each_attention_that_takes_a_mask(attention):
    """Eager attention adds a float mask, SDPA takes a boolean one: the tree must hold in both."""
    model = tiny_target_model("llama")
    model.set_attn_implementation(attention)
    target = TargetModel(model)
    assert target.takes_branches
    outs, refs = decode_with_branch_oracle(target, 36, correct=2, branch_right=3, block_size=8, branch_length=4,
                                           max_new=MAX_NEW)
    assert [o.output_ids for o in outs] == refs
    assert {a for o in outs for a in o.stats.acceptance_lengths[1:-1]} == {6}  # 2 right, 3 of the branch, 1


def test_steps_with_branches_teach_the_block_policy_acceptance_but_no_step_costs():
    """The adaptive block size learns step costs per block size; a branch's extra tokens would be billed to the
    block, so its steps leave the costs alone. What the block's draft tokens were accepted still counts."""
    target = TargetModel(tiny_target_model("qwen3"))
    prompts = random_prompts(1, seed=38)
    refs = {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=2, branch_right=1))
    auto = dict(max_new_tokens=MAX_NEW, block_size="auto", ignore_eos=True)
    engine.generate(prompts, GenerationConfig(**auto, branch_length=0))
    policy = engine._block_policy
    line, tried = list(policy.after_drafting_line.sums), sum(policy.by_confidence.tried)
    out = engine.generate(prompts, GenerationConfig(**auto, branch_length=2))[0]
    assert out.output_ids == refs[tuple(prompts[0])]
    assert policy.after_drafting_line.sums == line  # no step time learnt
    assert sum(policy.by_confidence.tried) > tried  # acceptance learnt
    engine.generate(prompts, GenerationConfig(**auto, branch_length=0))
    assert policy.after_drafting_line.sums != line  # (steps without a branch do teach it)
