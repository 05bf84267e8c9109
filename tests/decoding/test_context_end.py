"""A sequence may fill the target's context exactly, as in plain decoding: the steps near its end verify shorter
blocks, and no step writes a position past the context. gpt2's absolute position table ends
at its context, so a position past it is an IndexError there, not a silent extrapolation."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    BranchOracle,
    OracleProposer,
    hf_greedy,
    partial_oracle,
    random_prompts,
    tiny_drafter,
    tiny_target_config,
)
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.draft_model import DraftModelProposer
from dflash.decoding.engine import GenerationError
from dflash.model.target import TargetModel

CONTEXT = 48


def short_context_target(family: str, seed: int = 0) -> TargetModel:
    """A tiny random `family` model whose context is CONTEXT tokens (peaky logits, as conftest's)."""
    from transformers import AutoModelForCausalLM

    config = tiny_target_config(family)
    config.max_position_embeddings = CONTEXT  # gpt2: n_positions, the size of its position table
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return TargetModel(model.eval())


@pytest.fixture(params=["qwen3", "gpt2", "llama"])
def short_target(request) -> TargetModel:
    return short_context_target(request.param)


def positions_written(target: TargetModel) -> list[int]:
    """The largest position of every target forward from now on (the list grows as the target runs)."""
    seen, forward = [], target.forward

    def spy(ids, positions, *args, **kwargs):
        seen.append(int(positions.max()))
        return forward(ids, positions, *args, **kwargs)

    target.forward = spy
    return seen


def filling(prompts: list[list[int]]) -> list[GenerationConfig]:
    """Each prompt's config asks for every token its context has left."""
    return [GenerationConfig(max_new_tokens=CONTEXT - len(p), ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("drafting", ["oracle", "partial"])
def test_decoding_fills_the_context_exactly_and_losslessly(short_target, block_size, drafting):
    """Whole blocks accepted (the oracle) reach the end with a block that would not fit; a ragged batch (partial)
    has rows near the end beside rows that are not."""
    prompts = random_prompts(3, seed=5, low=4, high=30)
    refs = {tuple(p): hf_greedy(short_target, p, CONTEXT - len(p)) for p in prompts}
    if drafting == "oracle":
        proposer = OracleProposer(tiny_drafter(short_target), short_target, refs, seed=block_size)
    else:
        proposer = partial_oracle(short_target, refs, block_size)
    engine = SpeculativeEngine(short_target, proposer.with_block_size(block_size))
    positions = positions_written(short_target)
    for config in (configs := filling(prompts)):
        config.block_size = block_size
    together = engine.generate(prompts, configs)
    assert [o.output_ids for o in together] == [refs[tuple(p)] for p in prompts]
    assert all(len(p) + len(o.output_ids) == CONTEXT for p, o in zip(prompts, together))
    for prompt, config in zip(prompts, configs):
        assert engine.generate([prompt], config)[0].output_ids == refs[tuple(prompt)]
    assert CONTEXT - 2 <= max(positions) <= CONTEXT - 1  # the end reached (the last token is never read), never passed
    if drafting == "oracle":  # whole blocks before the end
        assert max(n for o in together for n in o.stats.acceptance_lengths) == block_size


def test_one_token_more_than_the_context_holds_is_refused(short_target):
    engine = SpeculativeEngine(short_target, DFlashProposer(tiny_drafter(short_target), short_target))
    prompt = random_prompts(1, seed=6, low=10, high=10)[0]
    with pytest.raises(GenerationError, match=rf"a prompt of 10 tokens leaves room for at most {CONTEXT - 10} new"):
        engine.generate([prompt], GenerationConfig(max_new_tokens=CONTEXT - 10 + 1))


def test_a_random_drafter_and_auto_block_sizes_fill_the_context(short_target):
    """Mostly rejected drafts (one token a step), at block sizes the engine chooses for itself."""
    prompts = random_prompts(2, seed=7, low=20, high=40)
    engine = SpeculativeEngine(short_target, DFlashProposer(tiny_drafter(short_target, layers=2), short_target))
    configs = filling(prompts)
    for config in configs:
        config.block_size = "auto"
    outs = engine.generate(prompts, configs)
    assert [o.output_ids for o in outs] == [hf_greedy(short_target, p, CONTEXT - len(p)) for p in prompts]


def test_a_draft_model_with_absolute_positions_drafts_within_the_context():
    """A gpt2 draft model reads its own position table: the draft shortens with the block near the end."""
    target, draft = short_context_target("gpt2"), short_context_target("gpt2", seed=0)
    prompts = random_prompts(2, seed=8, low=5, high=25)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target, 6))  # drafts all the target says
    outs = engine.generate(prompts, filling(prompts))
    assert [o.output_ids for o in outs] == [hf_greedy(target, p, CONTEXT - len(p)) for p in prompts]
    assert max(n for o in outs for n in o.stats.acceptance_lengths) == 6


def test_a_branch_near_the_end_stays_within_the_context():
    target = short_context_target("gpt2")
    prompts = random_prompts(2, seed=9, low=5, high=25)
    refs = {tuple(p): hf_greedy(target, p, CONTEXT - len(p)) for p in prompts}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=5, branch_right=3))
    configs = filling(prompts)
    for config in configs:
        config.block_size, config.branch_length = 8, 4
    outs = engine.generate(prompts, configs)
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert any(n > 6 for o in outs for n in o.stats.acceptance_lengths)  # branches were accepted


def test_a_request_larger_block_than_the_engines_also_stops_at_the_context():
    """A request's own block size, larger than the engine's, shortens near the end the same way."""
    target = short_context_target("gpt2")
    prompt = random_prompts(1, seed=10, low=30, high=30)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target, block_size=2))
    config = GenerationConfig(max_new_tokens=CONTEXT - 30, block_size=16, ignore_eos=True)
    assert engine.generate([prompt], config)[0].output_ids == hf_greedy(target, prompt, CONTEXT - 30)
