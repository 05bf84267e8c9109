"""Classic speculative decoding with a small causal LM as the drafter: lossless like DFlash, on every family."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, perturbed_copy, random_prompts, save_tiny_pair, tiny_target_model
from dflash import DFlash
from dflash.cli.main import main
from dflash.decoding import GenerationConfig, SpeculativeEngine
from dflash.decoding.draft_model import DraftModelProposer, drop_last_valid, fit_vocabulary
from dflash.decoding.sampling import SamplingParams, to_probs
from dflash.errors import UserError
from dflash.model.target import IncompatibleDrafterError, TargetModel

MAX_NEW = 40


def draft_models(target: TargetModel) -> dict[str, TargetModel]:
    return {
        "itself": target,  # drafts exactly what the target says: every draft token accepted
        "perturbed": perturbed_copy(target, 0.5),  # some accepted
        "another family": TargetModel(tiny_target_model("llama", seed=3, layers=1)),  # few accepted
    }


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_with_a_draft_model_is_lossless(target, block_size):
    prompts = random_prompts(3, seed=31)
    expected = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True)
    taus = {}
    for name, draft in draft_models(target).items():
        engine = SpeculativeEngine(target, DraftModelProposer(draft, target, block_size))
        together = engine.generate(prompts, config)  # a ragged batch: rows catch up on different tokens
        assert [o.output_ids for o in together] == expected, name
        assert engine.generate(prompts[:1], config)[0].output_ids == expected[0], name
        steps = [n for o in together for n in o.stats.acceptance_lengths[1:]]
        taus[name] = sum(steps) / len(steps)
    assert taus["itself"] == pytest.approx(block_size, abs=0.35)  # whole blocks, but for each answer's last step
    assert taus["itself"] > taus["perturbed"] and taus["another family"] < block_size / 2 + 0.5


def test_seeded_sampling_with_a_draft_model_is_the_target_alone(target):
    prompts = random_prompts(2, seed=32)
    config = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=5,
                              ignore_eos=True, block_size=4)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, config)]
    for draft in draft_models(target).values():
        engine = SpeculativeEngine(target, DraftModelProposer(draft, target, 4))
        assert [o.output_ids for o in engine.generate(prompts, config)] == plain


@torch.no_grad()
def test_a_sampled_draft_reports_the_distribution_each_token_was_drawn_from(target):
    """Rejection sampling is exact only if verification gets each draft token's own proposal distribution: the
    draft model's, after the prompt, the anchor and the draft tokens drawn before it."""
    draft = perturbed_copy(target, 0.5)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target, 6))
    config = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
    seq = engine.new_sequence(random_prompts(1, seed=33)[0], config)
    batch = engine.prefill(seq)
    engine.step(batch)  # the draft cache now holds rejected tokens to cut back
    proposal = batch.proposer.propose(batch.draft_state, batch.anchors, batch.anchor_positions, [seq])
    tokens, probs = proposal.tokens[0].tolist(), proposal.probs[0]  # (5,), (5, vocab)
    history = seq.prompt_ids + seq.output_ids
    logits = draft.model(torch.tensor([history + tokens])).logits[0, len(history) - 1:-1]  # (5, vocab)
    expected = to_probs(fit_vocabulary(logits, target.vocab_size), SamplingParams(temperature=1.0))
    assert torch.allclose(probs, expected, atol=1e-5)
    assert all(float(probs[t, token]) > 0 for t, token in enumerate(tokens))


def test_unseeded_sampling_runs_and_keeps_the_length(target):
    engine = SpeculativeEngine(target, DraftModelProposer(perturbed_copy(target, 0.5), target, 4))
    outs = engine.generate(random_prompts(3, seed=34),
                           GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.8, ignore_eos=True))
    assert all(len(o.output_ids) == MAX_NEW and o.stats.drafter_forwards > 0 for o in outs)


def test_a_smaller_draft_vocabulary_never_drafts_the_missing_ids():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    widened = fit_vocabulary(logits, 5)
    assert widened.shape == (1, 5) and widened.argmax().item() == 1 and torch.isinf(widened[0, 3:]).all()
    assert fit_vocabulary(torch.zeros(2, 7), 5).shape == (2, 5)


def test_a_draft_model_with_a_smaller_embedding_reads_the_targets_padding_ids_and_stays_lossless(target):
    """Qwen2.5-0.5B has 151,936 embedding rows and Qwen2.5-7B 152,064, with one tokenizer: a prompt or target token
    past the draft model's rows (the target's padding) must not crash its read, and the output stays the target's."""
    import copy

    small = copy.deepcopy(perturbed_copy(target, 0.3).model)
    small.resize_token_embeddings(target.vocab_size - 8)
    draft = TargetModel(small)
    prompts = [[5, 17, 33, target.vocab_size - 1], random_prompts(1, seed=33)[0]]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, config)]
    outs = SpeculativeEngine(target, DraftModelProposer(draft, target, 4)).generate(prompts, config)
    assert [o.output_ids for o in outs] == plain


def test_drafter_forwards_counts_a_draft_models_forwards(target, monkeypatch):
    """The forwards the draft model ran while drafting (a catch-up read, then one per draft token after the first;
    it read the prompt once before, at the prefill); it said one per step."""
    draft = perturbed_copy(target, 0.5)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target, 5))
    calls = []
    forward = draft.forward
    monkeypatch.setattr(draft, "forward", lambda *a, **kw: (calls.append(1), forward(*a, **kw))[1])
    out = engine.generate([random_prompts(1, seed=34)[0]], GenerationConfig(max_new_tokens=20, ignore_eos=True))[0]
    steps = out.stats.target_forwards - 1  # the prefill's forward drafts nothing
    assert steps > 1 and out.stats.drafter_forwards == len(calls) - 1  # all but the prompt's read


def test_draft_models_that_cannot_draft_for_the_target_are_refused(target):
    short = TargetModel(tiny_target_model("llama", seed=3, layers=1))
    short.model.config.max_position_embeddings = 16
    with pytest.raises(IncompatibleDrafterError, match="its context is 16 tokens"):
        DraftModelProposer(short, target)
    with pytest.raises(UserError, match="choose 2..32"):
        DraftModelProposer(target, target, 1)


def test_from_pretrained_takes_a_causal_lm_as_the_draft(draft_model_pair):
    target_dir, draft_dir = draft_model_pair
    pipe = DFlash.from_pretrained(target_dir, draft_dir)
    plain = DFlash.from_pretrained(target_dir, no_draft=True)
    assert isinstance(pipe.engine.proposer, DraftModelProposer) and pipe.engine.proposer.block_size == 5
    a, b = pipe.generate("How many clips?", max_new_tokens=24), plain.generate("How many clips?", max_new_tokens=24)
    assert a.output_ids == b.output_ids and a.stats.drafter_forwards > 0
    assert DFlash.from_pretrained(target_dir, draft_dir, block_size=3).engine.proposer.block_size == 3
    with pytest.raises(UserError, match="drafts without a mask token"):
        DFlash.from_pretrained(target_dir, draft_dir, mask_token_id=3)


def test_a_draft_model_whose_config_names_no_architecture_is_a_causal_lm_still(draft_model_pair, tmp_path):
    """Without `architectures` it was taken for a legacy DFlash drafter: 'does not name its mask token'."""
    import json
    import shutil

    target_dir, draft_dir = draft_model_pair
    bare = tmp_path / "bare"
    shutil.copytree(draft_dir, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["architectures"]
    (bare / "config.json").write_text(json.dumps(config))
    assert isinstance(DFlash.from_pretrained(target_dir, bare).engine.proposer, DraftModelProposer)


def test_a_gpt2_family_draft_model_is_a_causal_lm_too(tmp_path):
    """GPT-2's classes end in LMHeadModel, not ForCausalLM (gpt2 drafted by distilgpt2, transformers' own pair)."""
    target_dir, _ = save_tiny_pair(tmp_path, family="gpt2")
    target = TargetModel.from_pretrained(target_dir)
    perturbed_copy(target, 0.3).model.save_pretrained(tmp_path / "draft_model")
    target.tokenizer.save_pretrained(tmp_path / "draft_model")
    pipe = DFlash.from_pretrained(target_dir, tmp_path / "draft_model")
    assert isinstance(pipe.engine.proposer, DraftModelProposer)
    plain = DFlash.from_pretrained(target_dir, no_draft=True)
    a, b = pipe.generate("How many clips?", max_new_tokens=24), plain.generate("How many clips?", max_new_tokens=24)
    assert a.output_ids == b.output_ids and a.stats.drafter_forwards > 0


def test_a_draft_model_with_another_tokenizer_is_refused(draft_model_pair, tmp_path):
    target_dir, draft_dir = draft_model_pair
    other = tmp_path / "other"
    tokenizer = TargetModel.from_pretrained(draft_dir).tokenizer
    vocab = tokenizer.get_vocab()
    first, second = sorted(vocab, key=vocab.get)[10:12]  # swap two tokens' ids
    state = tokenizer.backend_tokenizer.to_str().replace(f'"{first}":', '"@@":').replace(f'"{second}":', f'"{first}":')
    state = state.replace('"@@":', f'"{second}":')
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(state), eos_token="<|im_end|>")
    TargetModel.from_pretrained(draft_dir).model.save_pretrained(other)
    swapped.save_pretrained(other)
    with pytest.raises(IncompatibleDrafterError, match="its tokenizer gives"):
        DFlash.from_pretrained(target_dir, other)


def test_generate_cli_with_a_draft_model(draft_model_pair, capsys):
    target_dir, draft_dir = draft_model_pair
    assert main(["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "How many clips?",
                 "--max-new-tokens", "16", "--compare"]) == 0
    captured = capsys.readouterr()
    assert "identical output" in captured.err and "DIFFERS" not in captured.err, captured.err


def test_rows_joining_leaving_and_compacted_mid_decode_stay_lossless(target, monkeypatch):
    """Continuous batching with a draft model: rows join a running batch with their prompt read (the draft model
    reads it at the prefill), leave when they finish, and the shared draft cache is compacted often (hidden slots
    of padding and rejected drafts)."""
    import dflash.decoding.slots as slots

    monkeypatch.setattr(slots, "COMPACT_MIN_SLOTS", 4)
    prompts = random_prompts(3, seed=35, low=3, high=30)
    lengths = [MAX_NEW, 12, MAX_NEW - 5]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, lengths)]
    proposer = DraftModelProposer(perturbed_copy(target, 0.5), target, 5)
    engine = SpeculativeEngine(target, proposer)
    seqs = [engine.new_sequence(p, GenerationConfig(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    compactions = []
    compact = proposer.compact
    monkeypatch.setattr(proposer, "compact", lambda state: (compactions.append(1), compact(state)))
    batch = engine.merge([engine.prefill(seqs[0]), engine.prefill(seqs[1])])
    for _ in range(3):
        engine.step(batch)
    batch = engine.merge([batch, engine.prefill(seqs[2])])  # joins with its prompt read
    while batch is not None:
        engine.step(batch)
        batch = engine.drop_finished(batch)  # the short row leaves first
        if batch is not None:
            assert len(batch.draft_state.rows) == len(batch) == batch.draft_state.valid.shape[0]
    assert [s.output_ids for s in seqs] == expected
    assert compactions  # the cache was compacted along the way
    assert any(n > 1 for s in seqs for n in s.stats.acceptance_lengths[1:])  # drafts were accepted


def test_a_batch_drafts_in_k_forwards_whatever_its_rows(target, monkeypatch):
    draft = perturbed_copy(target, 0.5)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target, 5))  # (one forward checks its cache)
    calls = []
    forward = draft.forward
    monkeypatch.setattr(draft, "forward", lambda ids, *a, **kw: (calls.append(ids.shape[0]), forward(ids, *a, **kw))[1])
    engine.generate(random_prompts(4, seed=36), GenerationConfig(max_new_tokens=6, ignore_eos=True))
    prefills, calls = calls[:4], calls[4:]
    assert prefills == [1, 1, 1, 1]  # each prompt is read alone, before its row joins the batch
    # 1 catch-up + 3 draft forwards a step, every one carrying the rows together (fewer forwards once the rows want
    # fewer tokens than a block, fewer rows once some have finished)
    assert calls[:4] == [4, 4, 4, 4] and all(n <= 4 for n in calls)


def test_drop_last_valid_hides_each_rows_last_valid_slots():
    valid = torch.tensor([[True, True, False, True, True],
                          [False, True, True, True, True],
                          [True, True, True, True, False]])
    hidden = drop_last_valid(valid, [2, 0, 3])
    assert hidden.tolist() == [[True, True, False, False, False],
                               [False, True, True, True, True],
                               [True, False, False, False, False]]
