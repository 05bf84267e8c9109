"""The DFlash proposer drafts over the drafter's whole trained block whatever block size is verified."""

from __future__ import annotations

import torch

from conftest import random_prompts, tiny_drafter, tiny_target_model
from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import DFlashProposer, Draft, PendingContext
from dflash.model.target import TargetModel


def draft_after_prompt(proposer: DFlashProposer, engine: SpeculativeEngine, prompt: list[int]) -> Draft:
    """The draft (tokens (1, block_size - 1)) of the first step after `prompt`, anchored on its last token."""
    target = proposer.target
    ids = torch.tensor([prompt])
    positions = torch.arange(len(prompt))[None]
    out = target.forward(ids[:, :-1], positions[:, :-1], target.new_cache(), logits_to_keep=1,
                         feature_layer_ids=proposer.feature_layer_ids)
    state = proposer.new_state()
    proposer.observe(state, PendingContext(out.features, positions[:, :-1], torch.ones_like(ids[:, :-1]).bool()))
    rows = [engine.new_sequence(prompt, GenerationConfig())]
    return proposer.propose(state, ids[:, -1], torch.tensor([len(prompt) - 1]), rows)


def test_a_smaller_block_verifies_the_first_tokens_of_the_full_draft():
    target = TargetModel(tiny_target_model("qwen3"))
    drafter = tiny_drafter(target, layers=2, block_size=16)
    full = DFlashProposer(drafter, target)
    engine = SpeculativeEngine(target, full)
    for prompt in random_prompts(3, seed=4):
        wide = draft_after_prompt(full, engine, prompt).tokens  # (1, 15)
        assert wide.shape == (1, 15)
        for block_size in (2, 4, 8):
            short = draft_after_prompt(full.with_block_size(block_size), engine, prompt).tokens
            assert short.shape == (1, block_size - 1)
            assert torch.equal(short, wide[:, : block_size - 1])


def test_the_drafter_sees_its_whole_block_of_masks():
    """Guards the test above: a block of 4 masks alone would draft other tokens than the first of 16."""
    target = TargetModel(tiny_target_model("qwen3"))
    drafter = tiny_drafter(target, layers=2, block_size=16)
    engine = SpeculativeEngine(target, DFlashProposer(drafter, target))
    differs = 0
    for prompt in random_prompts(3, seed=4):
        wide = draft_after_prompt(DFlashProposer(drafter, target), engine, prompt).tokens
        narrow = DFlashProposer(drafter, target, block_size=4)
        narrow.draft_width = 4  # what drafting a shorter block would do
        differs += not torch.equal(draft_after_prompt(narrow, engine, prompt).tokens, wide[:, :3])
    assert differs > 0


def test_a_greedy_draft_says_how_sure_the_drafter_is_of_each_token_and_cuts_to_a_prefix():
    target = TargetModel(tiny_target_model("qwen3"))
    proposer = DFlashProposer(tiny_drafter(target, layers=2, block_size=8), target)
    engine = SpeculativeEngine(target, proposer)
    seen = []
    real_logits = proposer.draft_logits
    proposer.draft_logits = lambda hidden: seen.append(real_logits(hidden)) or seen[-1]
    draft = draft_after_prompt(proposer, engine, random_prompts(1, seed=7)[0])
    top = seen[0].softmax(-1).max(-1)  # (1, 7): the drafter's top-1 probability and token per position
    assert torch.equal(draft.tokens, top.indices)
    assert torch.allclose(draft.confidence, top.values)
    cut = draft.first(3)
    assert torch.equal(cut.tokens, draft.tokens[:, :3]) and torch.equal(cut.confidence, draft.confidence[:, :3])
    assert cut.probs == [None]


def test_an_incomplete_proposer_is_refused_naming_what_it_lacks():
    """A proposer written against an older interface failed deep in a prefill (AttributeError); now the engine
    names the missing members when it is built."""
    import pytest

    from dflash.decoding.proposer import NoDraftProposer
    from dflash.errors import UserError

    target = TargetModel(tiny_target_model("qwen3"))
    SpeculativeEngine(target, NoDraftProposer())  # complete: accepted

    class Partial:
        kind, block_size, drafts_in_one_forward, feature_layer_ids = "mine", 2, False, []

        def new_state(self):
            return None

    with pytest.raises(UserError, match=r"Partial is not a complete proposer: it lacks observe, prefill, propose"):
        SpeculativeEngine(target, Partial())
