"""min_new_tokens holds every stop back from the first tokens: the stop ids get no chance at each slot whose token
would be one of them (drafting at any block size, through branches and in batches gives what transformers gives with
its MinNewTokensLengthLogitsProcessor), and a stop string counts only where a later token completes it (the final
text and a stream alike)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

from conftest import VOCAB, BranchOracle, byte_fallback_tokenizer, partial_oracle, random_prompts, tiny_drafter
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.decoding.detokenizer import TextDeltas
from dflash.decoding.stopping import StopChecker
from dflash.errors import GenerationError

from .test_logit_bias import AddBias
from .test_logprobs import check_logprobs
from .test_stopping import CharTokenizer, in_steps

MAX_NEW = 24
STOP = VOCAB - 2  # a token the tests stop at (stop_token_ids), pushed by a logit bias so that it comes early


def hf_greedy_held(target, prompt: list[int], min_new: int, bias: dict[int, float], stops: list[int]) -> list[int]:
    """transformers' greedy answer with the bias, no stop id before min_new tokens, and a stop at the stop ids (the
    stop token kept, as the engine keeps it)."""
    ids = torch.tensor([prompt], device=target.device)
    processors = [AddBias(bias), MinNewTokensLengthLogitsProcessor(len(prompt), min_new, stops, device=target.device)]
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=stops, pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def held_configs(mins: list[int], **options) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=m, stop_token_ids=[STOP], ignore_eos=True,
                             logit_bias={STOP: 10.0}, **options) for m in mins]


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_with_min_new_tokens_is_transformers_with_them(target, block_size):
    """The bias makes the stop token the target's choice at once; each row stops right after its min_new_tokens,
    in blocks that cross that boundary."""
    prompts = random_prompts(3, seed=71)
    mins = [5, 11, 0]
    refs = {tuple(p): hf_greedy_held(target, p, m, {STOP: 10.0}, [STOP]) for p, m in zip(prompts, mins)}
    assert [len(refs[tuple(p)]) for p in prompts] == [m + 1 for m in mins]  # the test's premise: stops come at once
    engine = SpeculativeEngine(target, partial_oracle(target, refs, block_size))
    outs = engine.generate(prompts, held_configs(mins, block_size=block_size, logprobs=0))
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert [o.finish_reason for o in outs] == ["stop"] * 3
    for prompt, out in zip(prompts, outs):
        check_logprobs(target, prompt, out, top=0)  # the target's own: neither the bias nor the held stops


class StopDrafter(BranchOracle):
    """Drafts the stop token wherever the oracle would draft a wrong token, so that held slots are offered it."""

    def propose(self, state, anchors, anchor_positions, rows):
        draft = super().propose(state, anchors, anchor_positions, rows)
        for r, row in enumerate(rows):
            full = row.prompt_ids + self.references[tuple(row.prompt_ids)]
            start = int(anchor_positions[r]) + 1
            truth = (full[start:] + [-1] * draft.tokens.shape[1])[: draft.tokens.shape[1]]
            draft.tokens[r] = torch.tensor([t if t == d else STOP for t, d in zip(truth, draft.tokens[r].tolist())])
        return draft


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_branch_holds_the_stops_back_by_the_tokens_it_sees(target, block_size):
    """A branch's slots are held by the tokens before them on the branch, not by their place in the block."""
    prompts = random_prompts(2, seed=72)
    mins = [9, 14]
    refs = {tuple(p): hf_greedy_held(target, p, m, {STOP: 10.0}, [STOP]) for p, m in zip(prompts, mins)}
    engine = SpeculativeEngine(target, StopDrafter(tiny_drafter(target), target, refs, correct=1, branch_right=2))
    outs = engine.generate(prompts, held_configs(mins, block_size=block_size, branch_length=3))
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert max(a for o in outs for a in o.stats.acceptance_lengths[1:]) >= 4  # branches were taken


def test_seeded_sampling_with_min_new_tokens_is_the_target_alones(target):
    prompts = random_prompts(2, seed=73)
    configs = held_configs([7, 12], temperature=1.0, seed=5, block_size=8)
    plain = SpeculativeEngine(target).generate(prompts, configs)
    drafted = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target)).generate(prompts, configs)
    assert [o.output_ids for o in drafted] == [o.output_ids for o in plain]
    assert all(STOP not in o.output_ids[:m] for o, m in zip(plain, [7, 12]))


def test_a_min_new_tokens_the_answer_reaches_anyway_changes_nothing(target):
    """An answer that stops at its token k + 1 (counting from 1) is the same with min_new_tokens up to k, and goes on
    past that token with k + 1."""
    prompt = random_prompts(1, seed=76)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    free = engine.generate([prompt], GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, block_size=8))[0]
    k = next(k for k in range(3, MAX_NEW) if free.output_ids[k] not in free.output_ids[:k])
    stop = free.output_ids[k]

    def answer(min_new: int) -> list[int]:
        config = GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=min_new, stop_token_ids=[stop],
                                  ignore_eos=True, block_size=8)
        return engine.generate([prompt], config)[0].output_ids

    assert answer(0) == answer(k // 2) == answer(k) == free.output_ids[: k + 1]
    held = answer(k + 1)
    assert held[: k + 1] == free.output_ids[:k] + [held[k]] and held[k] != stop and len(held) > k + 1


@pytest.mark.parametrize("options, says", [
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens must be from 0 to max_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens must be from 0"),
    (dict(min_new_tokens=3, regex="a+"), "drop min_new_tokens"),
])
def test_a_bad_min_new_tokens_is_refused(options, says):
    with pytest.raises(GenerationError, match=says):
        GenerationConfig(**options)


# ---- stop strings ---------------------------------------------------------------------------------------------
TOKENS = [0, 1, 2, 3, 1, 2, 3, 1, 2, 9]  # "abcdbcdbcj": "bc" at tokens 1-2, 4-5 and 7-8


@pytest.mark.parametrize("step", [1, 3, 16])
@pytest.mark.parametrize("min_new, stops_after", [(0, 3), (2, 3), (3, 6), (5, 6), (6, 9), (8, 9), (9, None)])
def test_a_stop_string_counts_where_a_token_past_min_new_tokens_completes_it(step, min_new, stops_after):
    """"bc" completed by token 3, 6 or 9 (counting from 1): with min_new_tokens m the first one past m stops."""
    checker = StopChecker([], ["bc"], 100, CharTokenizer(), min_new)
    kept, reason = in_steps(checker, TOKENS, step)
    assert (len(kept), reason) == ((stops_after, "stop") if stops_after else (len(TOKENS), None))
    text, stop = checker.ending(kept)
    assert text == "abcdbcdbcj"[: (stops_after or 99) - 2 if stops_after else None]
    assert stop == ("bc" if stops_after else None)


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("min_new", [0, 3, 5, 9])
def test_a_stream_with_min_new_tokens_adds_up_to_the_final_text(step, min_new):
    checker = StopChecker([], ["bc"], 100, CharTokenizer(), min_new)
    kept, _ = in_steps(checker, TOKENS, step)
    final, _ = checker.ending(kept)
    deltas = TextDeltas(CharTokenizer(), ["bc"], (), min_new)
    sent = "".join(deltas.add(kept[i:i + step]) for i in range(0, len(kept), step))
    assert final.startswith(sent) and sent + deltas.finish(final) == final
    if min_new and final:
        assert sent.startswith("abc")  # the held-back "bc" went out as text


@pytest.mark.parametrize("min_new", [2, 3, 4])
@pytest.mark.parametrize("step", [1, 6])
def test_a_stop_character_whose_bytes_straddle_min_new_tokens_stops(min_new, step):
    """"€" is three byte tokens (3-5 of " a€b"): the 5th completes it, past min_new_tokens 2-4, so it stops there,
    though the first tokens' text ends in part of it at 3 and 4 (helper-123 found those missed)."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer("a€b", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6  # the space the tokenizer starts with, "a", three bytes, "b"
    checker = StopChecker([], ["€"], 100, tokenizer, min_new)
    kept, reason = in_steps(checker, ids, step)
    assert (len(kept), reason) == (5, "stop") and checker.ending(kept) == ("a", "€")
    deltas = TextDeltas(tokenizer, ["€"], (), min_new)
    sent = "".join(deltas.add(ids[i:i + step]) for i in range(0, len(ids), step))
    assert sent == "a"
