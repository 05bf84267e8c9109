"""Log-probabilities of output tokens: the target's own, whatever drafted them (block size, branch, batch, a stop
that cuts a step's tokens), and their alternatives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import hf_greedy, partial_oracle, random_prompts, tiny_drafter
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from dflash.errors import GenerationError

from .test_branch import BranchOracle

MAX_NEW = 24


def target_logprobs(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's log-probabilities over the vocabulary at each output position, from one transformers forward
    over the prompt and the output (an independent reference): (len(output), vocab)."""
    ids = torch.tensor([prompt + output], device=target.device)
    with torch.no_grad():
        logits = target.model(ids).logits[0].float()  # (n, vocab)
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def check_logprobs(target, prompt: list[int], out, top: int) -> None:
    reference = target_logprobs(target, prompt, out.output_ids)  # (n, vocab)
    assert [lp.token_id for lp in out.logprobs] == out.output_ids
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    want = reference.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for lp, row in zip(out.logprobs, reference):
        assert len(lp.top) == top
        values, ids = row.topk(top)
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)
        assert [i for i, _ in lp.top] == ids.tolist()


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_logprobs_are_the_targets_own_whatever_the_block(target, block_size):
    prompts = random_prompts(3, seed=41)
    refs = {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, block_size))
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True, logprobs=3)
    outs = engine.generate(prompts, config)
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == refs[tuple(prompt)]
        check_logprobs(target, prompt, out, top=3)
        assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)  # greedy: the most likely token
    assert any(a > 1 for o in outs for a in o.stats.acceptance_lengths[1:])  # drafts were accepted


def test_logprobs_through_a_branch(target):
    """A row that takes the branch keeps slots past the block's rejected ones; each token is read at its own."""
    prompts = random_prompts(2, seed=42)
    refs = {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=1, branch_right=2))
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, branch_length=3, ignore_eos=True, logprobs=2)
    for prompt, out in zip(prompts, engine.generate(prompts, config)):
        assert set(out.stats.acceptance_lengths[1:-1]) == {4}  # every step took the branch
        check_logprobs(target, prompt, out, top=2)


def test_sampled_tokens_get_the_targets_raw_logprobs(target):
    """Before temperature and top-k (vLLM's default)."""
    prompt = random_prompts(1, seed=43)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    config = GenerationConfig(max_new_tokens=13, temperature=0.8, top_k=5, seed=7, ignore_eos=True, logprobs=0)
    out = engine.generate([prompt], config)[0]
    assert len(out.output_ids) == 13
    check_logprobs(target, prompt, out, top=0)


def test_a_stop_inside_a_steps_tokens_cuts_their_logprobs_with_them(target):
    prompt = random_prompts(1, seed=48)[0]
    refs = {tuple(prompt): hf_greedy(target, prompt, MAX_NEW)}

    def engine():  # a fresh drafter each time: its drafts are right for the same random numbers of tokens
        return SpeculativeEngine(target, partial_oracle(target, refs, 8))

    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, ignore_eos=True, logprobs=1)
    out = engine().generate([prompt], config)[0]
    ends = [sum(out.stats.acceptance_lengths[: i + 1]) for i in range(len(out.stats.acceptance_lengths))]
    inside = [i for i, t in enumerate(out.output_ids)  # a token first seen before its step's last token
              if out.output_ids.index(t) == i and i + 1 not in ends]
    assert inside, out.stats.acceptance_lengths
    stop_at = out.output_ids[inside[0]]
    cut = engine().generate([prompt], dataclasses.replace(config, stop_token_ids=[stop_at]))[0]
    assert cut.output_ids == out.output_ids[: inside[0] + 1]
    assert cut.stats.acceptance_lengths[-1] < out.stats.acceptance_lengths[len(cut.stats.acceptance_lengths) - 1]
    assert [lp.token_id for lp in cut.logprobs] == cut.output_ids
    check_logprobs(target, prompt, cut, top=1)


def test_only_the_rows_that_ask_get_logprobs(target):
    prompts = random_prompts(2, seed=44)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    configs = [GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=1),
               GenerationConfig(max_new_tokens=8, ignore_eos=True)]
    asked, not_asked = engine.generate(prompts, configs)
    check_logprobs(target, prompts[0], asked, top=1)
    assert not_asked.logprobs is None


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 1.0, "2"])
def test_a_bad_number_of_alternatives_is_refused(bad):
    with pytest.raises(GenerationError, match="logprobs"):
        GenerationConfig(logprobs=bad)


def test_token_logprobs_reads_token_i_at_row_i():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    got = token_logprobs(logits, [0, 0], top=2)
    want = logits.log_softmax(-1)
    assert [g.logprob for g in got] == pytest.approx([want[0, 0].item(), want[1, 0].item()])
    assert [i for i, _ in got[0].top] == [2, 1] and [i for i, _ in got[1].top] == [0, 1]


def test_prompt_logprobs_score_the_prompt_with_or_without_an_answer(target):
    """Each prompt token after the first, read at the position before it; max_new_tokens 0 scores the prompt alone
    (lm-eval's log-likelihood requests)."""
    prompt = random_prompts(1, seed=45, low=12)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    scored = engine.generate([prompt], GenerationConfig(max_new_tokens=0, prompt_logprobs=2))[0]
    assert scored.output_ids == [] and scored.finish_reason == "length" and scored.logprobs is None
    reference = target_logprobs(target, prompt[:1], prompt[1:])  # (len(prompt) - 1, vocab)
    got = torch.tensor([lp.logprob for lp in scored.prompt_logprobs])
    torch.testing.assert_close(got, reference.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    assert [lp.token_id for lp in scored.prompt_logprobs] == prompt[1:]
    assert [[i for i, _ in lp.top] for lp in scored.prompt_logprobs] == reference.topk(2).indices.tolist()
    both = engine.generate([prompt], GenerationConfig(max_new_tokens=6, ignore_eos=True, prompt_logprobs=0,
                                                      logprobs=0))[0]
    assert both.output_ids == hf_greedy(target, prompt, 6)
    whole = [lp.logprob for lp in both.prompt_logprobs + both.logprobs]
    reference = target_logprobs(target, prompt[:1], prompt[1:] + both.output_ids)
    torch.testing.assert_close(torch.tensor(whole), reference.gather(1, torch.tensor(prompt[1:] + both.output_ids)
                                                                     [:, None])[:, 0], atol=1e-4, rtol=0)
    one = engine.generate([prompt[:1]], GenerationConfig(max_new_tokens=0, prompt_logprobs=0))[0]
    assert one.prompt_logprobs == []  # nothing before its one token to read it at


def test_no_new_tokens_reads_the_prompt_alone(target):
    prompt = random_prompts(1, seed=46)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=0))[0]
    assert out.output_ids == [] and out.prompt_logprobs is None and out.finish_reason == "length"
    with pytest.raises(GenerationError, match="prompt_logprobs: the number of most likely"):
        GenerationConfig(max_new_tokens=0, prompt_logprobs=MAX_TOP_LOGPROBS + 1)


def test_nan_in_the_prompts_scores_fails_the_row_not_the_json(target, monkeypatch):
    """A float16 overflow in a prompt's logits would give NaN scores, which JSON cannot carry."""
    prompt = random_prompts(1, seed=47, low=8)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    forward = target.forward

    def nan_at_position_1(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[:, 1] = float("nan")
        return out

    monkeypatch.setattr(target, "forward", nan_at_position_1)
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=0, prompt_logprobs=0))[0]
    assert out.finish_reason == "error" and "NaN" in out.error
