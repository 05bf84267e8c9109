"""Presence, frequency and repetition penalties change the target's logits before a token is chosen, by the tokens
before it: drafting at any block size, through branches and in batches, gives what the target alone gives with
them (transformers' generate with a reference processor), and log-probabilities stay the target's own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import (
    BranchOracle,
    check_triples_follow_the_target,
    dflash2_drafter,
    hf_greedy,
    partial_oracle,
    perturbed_copy,
    random_prompts,
    tiny_drafter,
)
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.choice import choice_logits
from dflash.decoding.draft_model import DraftModelProposer
from dflash.decoding.penalties import Penalties, TokenCounts
from dflash.decoding.sampling import SamplingParams
from dflash.errors import GenerationError

from .test_logprobs import check_logprobs

MAX_NEW = 24


def penalized(scores: torch.Tensor, prompt: list[int], output: list[int], penalties: dict) -> torch.Tensor:
    """The reference, one position at a time (vLLM's definitions and order): scores (vocab,) after `prompt` and
    `output`, penalized."""
    repetition = penalties.get("repetition_penalty", 1.0)
    frequency = penalties.get("frequency_penalty", 0.0)
    presence = penalties.get("presence_penalty", 0.0)
    for token in set(prompt) | set(output):
        value = scores[token]
        scores[token] = value / repetition if value > 0 else value * repetition
    for token, count in Counter(output).items():
        scores[token] -= frequency * count
        scores[token] -= presence
    return scores


class Penalize(LogitsProcessor):
    def __init__(self, prompt_len: int, penalties: dict, bias: dict[int, float] | None = None):
        self.prompt_len, self.penalties, self.bias = prompt_len, penalties, bias or {}

    def __call__(self, input_ids, scores):
        for r in range(scores.shape[0]):
            for token, value in self.bias.items():  # the logit bias comes first, as in vLLM
                scores[r, token] += value
            ids = input_ids[r].tolist()
            penalized(scores[r], ids[: self.prompt_len], ids[self.prompt_len:], self.penalties)
        return scores


def hf_greedy_penalized(target, prompt: list[int], penalties: dict, bias=None, max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                                logits_processor=LogitsProcessorList([Penalize(len(prompt), penalties, bias)]))
    return out[0, len(prompt):].tolist()


SETTINGS = [dict(presence_penalty=1.5, frequency_penalty=0.7), dict(repetition_penalty=1.8),
            dict(repetition_penalty=1.3, frequency_penalty=-0.3, presence_penalty=1.2)]


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_with_penalties_is_transformers_with_them(target, block_size):
    prompts = random_prompts(3, seed=61)
    refs = {tuple(p): hf_greedy_penalized(target, p, s) for p, s in zip(prompts, SETTINGS)}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, block_size))
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True, logprobs=0, **s)
               for s in SETTINGS]
    outs = engine.generate(prompts, configs)
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == refs[tuple(prompt)] != hf_greedy(target, prompt, MAX_NEW)
        check_logprobs(target, prompt, out, top=0)  # the target's own, without the penalties
    if block_size > 2:
        assert any(a > 2 for o in outs for a in o.stats.acceptance_lengths[1:])  # draft tokens were accepted


def test_penalties_follow_the_logit_bias(target):
    prompt = random_prompts(1, seed=62)[0]
    plain = hf_greedy(target, prompt, MAX_NEW)
    bias = {plain[0]: -100.0, plain[2]: 5.0}
    penalties = dict(repetition_penalty=1.5, presence_penalty=1.0)
    ref = hf_greedy_penalized(target, prompt, penalties, bias)
    engine = SpeculativeEngine(target, partial_oracle(target, {tuple(prompt): ref}, 8))
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, ignore_eos=True,
                                                     logit_bias=bias, **penalties))[0]
    assert out.output_ids == ref != hf_greedy_penalized(target, prompt, penalties)


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_branch_is_penalized_for_the_tokens_it_sees(target, block_size):
    """A branch's slots count the block's tokens before its start and the branch's own, not the block's after it:
    with an oracle whose branches are right, the steps that take them give transformers' tokens."""
    prompts = random_prompts(2, seed=63)
    settings = [dict(presence_penalty=2.0, frequency_penalty=1.0), dict(repetition_penalty=2.0)]
    refs = {tuple(p): hf_greedy_penalized(target, p, s) for p, s in zip(prompts, settings)}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=1, branch_right=2))
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, branch_length=3, ignore_eos=True, **s)
               for s in settings]
    outs = engine.generate(prompts, configs)
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    steps = [a for o in outs for a in o.stats.acceptance_lengths[1:-1]]
    assert set(steps) == {4}, steps  # x1 right, x2 wrong, the branch's first two right, the target's token after


@pytest.mark.parametrize("drafter", ["dflash", "dflash2", "draft model"])
def test_seeded_sampling_with_penalties_is_the_target_alones(target, drafter):
    prompts = random_prompts(2, seed=64)
    sampled = dict(max_new_tokens=MAX_NEW, temperature=1.0, top_k=30, seed=9, ignore_eos=True)
    configs = [GenerationConfig(**sampled, **s) for s in SETTINGS[:2]]
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, configs)]
    if drafter == "draft model":
        proposer = DraftModelProposer(perturbed_copy(target, 0.3), target, 8)
    else:
        proposer = DFlashProposer(dflash2_drafter(target) if drafter == "dflash2" else tiny_drafter(target), target)
    assert [o.output_ids for o in SpeculativeEngine(target, proposer).generate(prompts, configs)] == plain
    unpenalized = SpeculativeEngine(target).generate(prompts, GenerationConfig(**sampled))
    assert [o.output_ids for o in unpenalized] != plain


def test_unseeded_sampling_with_penalties_follows_the_penalized_target():
    """Rejection sampling against the penalized target: the first three tokens of 1,500 drafted generations follow
    its distribution (chi-square), each position penalized for the tokens drawn before it."""
    from conftest import tiny_target_model
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    prompt = random_prompts(1, seed=65)[0]
    penalties = dict(repetition_penalty=3.0, frequency_penalty=1.0, presence_penalty=2.0)
    config = GenerationConfig(max_new_tokens=3, temperature=1.0, top_k=4, ignore_eos=True, block_size=4, **penalties)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    counts: dict[tuple, int] = {}
    for _ in range(3):
        for out in engine.generate([prompt] * 500, config):
            counts[tuple(out.output_ids)] = counts.get(tuple(out.output_ids), 0) + 1

    def adjust(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return penalized(logits, prompt, ids[len(prompt):], penalties)

    check_triples_follow_the_target(target.model, SamplingParams(1.0, top_k=4), prompt, counts, min_cells=10,
                                    adjust=adjust)
    repeats = sum(n for triple, n in counts.items() if len(set(triple)) < 3)
    assert repeats < 0.5 * sum(counts.values())  # the penalties are felt: without them most triples repeat a token


@pytest.mark.parametrize("field, value, says", [
    ("presence_penalty", 2.5, "presence_penalty must be a number from -2 to 2"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a number from -2 to 2"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", "1", "presence_penalty must be"),
])
def test_a_bad_penalty_is_refused(field, value, says):
    with pytest.raises(GenerationError, match=says):
        GenerationConfig(**{field: value})


def test_a_slot_counts_the_tokens_it_sees_past_the_anchor():
    """Unit: slot i of a forward penalizes the output and tokens 1..i (the anchor is in the output already)."""
    class Row:
        penalties = Penalties(frequency=1.0)
        counts = TokenCounts([])

    row = Row()
    row.counts.add([3, 5])  # the output so far; 5 is the anchor
    tokens = torch.tensor([[5, 2, 2, 4]])  # (1, q): the anchor and three draft tokens
    got = choice_logits(torch.zeros(1, 4, 6), [row], tokens)[0]
    want = -torch.tensor([[0, 0, 0, 1, 0, 1], [0, 0, 1, 1, 0, 1], [0, 0, 2, 1, 0, 1], [0, 0, 2, 1, 1, 1]]).float()
    torch.testing.assert_close(got, want)
    sees = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]]).bool()  # a tree
    got = choice_logits(torch.zeros(1, 4, 6), [row], tokens, sees)[0]
    torch.testing.assert_close(got[1], got[2])
    assert got[3].tolist() == [0, 0, -1, -1, -1, -1]
