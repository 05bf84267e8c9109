"""Losslessness with a DFlash2 drafter: its selector changes which tokens are drafted, never the output."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from conftest import dflash2_drafter, hf_greedy, random_prompts, tiny_target_model
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import _sample_path, draft_along_path
from dflash.decoding.sampling import SamplingParams, to_probs
from dflash.model.dflash2 import walk
from dflash.model.target import TargetModel

MAX_NEW = 40
DRAWS = 2000
SEEDED = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=5, ignore_eos=True)


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_with_a_dflash2_drafter_is_lossless(target, block_size):
    prompts = random_prompts(3, seed=21)
    engine = SpeculativeEngine(target, DFlashProposer(dflash2_drafter(target), target))
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True)
    outs = engine.generate(prompts, config)
    assert [o.output_ids for o in outs] == [hf_greedy(target, p, MAX_NEW) for p in prompts]
    assert all(o.stats.drafter_forwards > 0 for o in outs)


def test_seeded_sampling_with_a_dflash2_drafter_is_the_target_alone(target):
    prompts = random_prompts(2, seed=22)
    config = GenerationConfig(**SEEDED)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, config)]
    engine = SpeculativeEngine(target, DFlashProposer(dflash2_drafter(target), target))
    assert [o.output_ids for o in engine.generate(prompts, config)] == plain


@pytest.fixture(scope="module")
def qwen3():
    return TargetModel(tiny_target_model("qwen3"))


@torch.no_grad()
def test_a_sampled_path_reports_the_distribution_each_token_was_drawn_from(qwen3):
    """The proposal distribution of position t is conditional on the token drawn at t-1; rejection sampling is
    exact only if verification gets that one. Draw many paths from one lattice and compare frequencies."""
    target = qwen3
    drafter = dflash2_drafter(target)
    logits, hidden = torch.randn(1, 2, target.vocab_size) * 2, torch.randn(1, 2, target.hidden_size)
    lattice = drafter.candidate_selector.lattice(logits, hidden, torch.tensor([5]))
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)

    class Row:  # what draft_along_path reads of a Sequence
        def __init__(self, seed):
            self.params, self.noise, self.generator = params, None, torch.Generator().manual_seed(seed)

    draws, seconds = Counter(), {}
    for seed in range(DRAWS):
        draft = draft_along_path(lattice, [Row(seed)], target.vocab_size)
        first, second = draft.tokens[0].tolist()
        draws[first, second] += 1
        seconds[first] = draft.probs[0][1]  # the second position's distribution, given the first token
    first_probs = to_probs(lattice.scores[0, 0, 0], params)  # over the candidates
    expected, observed = [], []
    for (i, first), second in itertools.product(enumerate(lattice.candidates[0, 0].tolist()),
                                                lattice.candidates[0, 1].tolist()):
        if first in seconds:
            expected.append(float(first_probs[i] * seconds[first][second]) * DRAWS)
            observed.append(draws[first, second])
    assert sum(observed) > 0.97 * DRAWS  # the pairs never drawn are rare
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3


@torch.no_grad()
def test_a_seeded_path_is_the_noise_race_over_the_whole_vocabulary(qwen3):
    """A sampled path draws among each position's candidates alone; for a seeded row that must be the token the
    position's noise picks from the distribution it reports, and that the vocabulary-wide one `to_probs` gives the
    candidates' scores (top-p breaking ties by token id)."""
    from dflash.decoding.sampling import PositionNoise

    target = qwen3
    lattice = dflash2_drafter(target).candidate_selector.lattice(
        torch.randn(1, 6, target.vocab_size) * 2, torch.randn(1, 6, target.hidden_size), torch.tensor([5]))

    class Row:  # what draft_along_path reads of a Sequence
        def __init__(self, seed):
            self.params, self.generator = SamplingParams(temperature=0.8, top_p=0.6), None
            self.noise, self.next_position = PositionNoise(seed), 30

    lattice.scores = lattice.scores.clone()
    lattice.scores[:, 1:4:2] = 0  # positions 1 and 3: every candidate tied, and top-p keeps the highest ids
    for seed in range(20):
        row = Row(seed)
        tokens, probs = _sample_path(lattice, 0, row, target.vocab_size)
        assert torch.equal(tokens, PositionNoise(seed).choose(probs, 30))
        chosen = (lattice.candidates[0] == tokens[:, None]).int().argmax(-1)  # (6,) each token's candidate index
        for t in range(6):  # the distribution `to_probs` gives the vocabulary-wide logits after the path's token
            logits = torch.full((target.vocab_size,), float("-inf")).scatter(
                0, lattice.candidates[0, t], lattice.scores[0, t, chosen[t - 1] if t else 0])
            assert torch.allclose(probs[t], to_probs(logits, row.params, proposal=True))


@torch.no_grad()
def test_greedy_rows_take_the_walk(qwen3):
    target = qwen3
    drafter = dflash2_drafter(target)
    logits, hidden = torch.randn(2, 7, target.vocab_size), torch.randn(2, 7, target.hidden_size)
    lattice = drafter.candidate_selector.lattice(logits, hidden, torch.tensor([1, 2]))

    class Row:
        params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0)

    draft = draft_along_path(lattice, [Row(), Row()], target.vocab_size)
    assert torch.equal(draft.tokens, walk(lattice)[0]) and draft.probs == [None, None]
