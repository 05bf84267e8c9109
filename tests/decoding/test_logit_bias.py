"""A logit bias (OpenAI's logit_bias) is added to the target's logits before any token is chosen: drafting at any
block size gives what the target alone gives with the bias, and log-probabilities stay the target's own."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import hf_greedy, partial_oracle, random_prompts, tiny_drafter
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.errors import GenerationError

from .test_logprobs import check_logprobs

MAX_NEW = 24


class AddBias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def hf_greedy_with_bias(target, prompt: list[int], bias: dict[int, float]) -> list[int]:
    """transformers' own generate with the bias as a logits processor (the reference)."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                                logits_processor=LogitsProcessorList([AddBias(bias)]))
    return out[0, len(prompt):].tolist()


def a_bias_that_changes_the_answer(target, prompt: list[int]) -> dict[int, float]:
    """Ban the first and fourth tokens the target would write, and push a token it would not write."""
    plain = hf_greedy(target, prompt, MAX_NEW)
    return {plain[0]: -100.0, plain[3]: -100.0, (plain[1] + 1) % 100: 3.0}


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_with_a_bias_is_transformers_with_it(target, block_size):
    prompts = random_prompts(2, seed=51)
    biases = [a_bias_that_changes_the_answer(target, p) for p in prompts]
    refs = {tuple(p): hf_greedy_with_bias(target, p, b) for p, b in zip(prompts, biases)}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, block_size))
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True, logit_bias=b,
                                logprobs=0) for b in biases]
    outs = engine.generate(prompts, configs)
    for prompt, bias, out in zip(prompts, biases, outs):
        assert out.output_ids == refs[tuple(prompt)] != hf_greedy(target, prompt, MAX_NEW)
        assert not {t for t, b in bias.items() if b == -100} & set(out.output_ids)
        check_logprobs(target, prompt, out, top=0)  # the target's own, without the bias
    if block_size > 2:
        assert any(a > 1 for o in outs for a in o.stats.acceptance_lengths[1:])  # drafts were accepted


def test_seeded_sampling_with_a_bias_is_the_target_alones(target):
    prompts = random_prompts(2, seed=52)
    bias = {5: 4.0, 7: -100.0}
    config = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, seed=9, ignore_eos=True,
                              logit_bias=bias)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, config)]
    drafted = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target)).generate(prompts, config)
    assert [o.output_ids for o in drafted] == plain
    assert all(7 not in ids for ids in plain) and sum(ids.count(5) for ids in plain) > 2
    unbiased = SpeculativeEngine(target).generate(prompts, GenerationConfig(
        max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, seed=9, ignore_eos=True))
    assert [o.output_ids for o in unbiased] != plain


@pytest.mark.parametrize("bias, says", [({3: 101.0}, "from -100 to 100"), ({"3": 1.0}, "mapping of integers"),
                                        ({3: float("nan")}, "from -100 to 100")])
def test_a_bad_bias_is_refused(bias, says):
    with pytest.raises(GenerationError, match=says):
        GenerationConfig(logit_bias=bias)


def test_whole_number_biases_are_taken_as_their_floats(target):
    """{5: 4} as {5: 4.0}: a JSON client's whole numbers (int biases once raised a dtype error out of the engine)."""
    prompt = random_prompts(1, seed=53)[0]
    outs = [SpeculativeEngine(target).generate([prompt], GenerationConfig(
        max_new_tokens=MAX_NEW, ignore_eos=True, logit_bias={5: value, 7: -100}))[0].output_ids
        for value in (4, 4.0)]
    assert outs[0] == outs[1] == hf_greedy_with_bias(target, prompt, {5: 4.0, 7: -100.0})


def test_a_biased_token_outside_the_vocabulary_is_refused(target):
    with pytest.raises(GenerationError, match="logit_bias token ids"):
        SpeculativeEngine(target).new_sequence([1, 2], GenerationConfig(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize("drafter", ["dflash", "dflash2", "draft model"])
def test_the_drafter_drafts_with_the_bias_too(target, drafter):
    """A bias that makes the target write one token over and over: a random drafter drafts it too, so whole blocks
    are accepted (without the bias in its drafts it would be turned down at nearly every position)."""
    from conftest import dflash2_drafter, perturbed_copy
    from dflash.decoding.draft_model import DraftModelProposer

    forced = 11
    if drafter == "draft model":
        proposer = DraftModelProposer(perturbed_copy(target, 5.0), target, 8)
    else:
        proposer = DFlashProposer(dflash2_drafter(target) if drafter == "dflash2" else tiny_drafter(target), target)
    engine = SpeculativeEngine(target, proposer)
    config = GenerationConfig(max_new_tokens=33, block_size=8, ignore_eos=True, logit_bias={forced: 100.0})
    out = engine.generate(random_prompts(1, seed=53), config)[0]
    assert out.output_ids == [forced] * 33
    assert out.stats.acceptance_lengths[1:] == [8, 8, 8, 8]
