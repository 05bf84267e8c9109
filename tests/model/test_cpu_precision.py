"""Drafting with bfloat16 matrix products: which weights move, what stays float32, and that outputs do not change."""

from __future__ import annotations

import pytest
import torch

from conftest import dflash2_drafter, hf_greedy, random_prompts
from dflash.api import DFlash
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine
from dflash.errors import UserError
from dflash.model import cpu_precision
from dflash.model.cpu_precision import CastingLinear, use_bfloat16_matmuls

MAX_NEW = 40


def test_casting_linear_is_linear_in_float32_and_casts_around_bfloat16_weights():
    torch.manual_seed(0)
    layer = CastingLinear(32, 48, bias=False)
    reference = torch.nn.Linear(32, 48, bias=False)
    reference.weight = layer.weight
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), reference(x))
    layer.weight = torch.nn.Parameter(layer.weight.detach().to(torch.bfloat16), requires_grad=False)
    out = layer(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(x.bfloat16(), layer.weight).float())
    assert torch.allclose(out, reference(x), rtol=0.05, atol=0.05) and not torch.equal(out, reference(x))


def _head(target) -> torch.Tensor:
    return target.model.get_output_embeddings().weight


def test_forced_bfloat16_moves_every_linear_weight_and_copies_the_head(target):
    drafter = dflash2_drafter(target)
    assert use_bfloat16_matmuls(drafter, _head(target), force=True)
    linears = [m for m in drafter.modules() if isinstance(m, CastingLinear)]
    assert len(linears) > 10 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert drafter.draft_head.dtype == torch.bfloat16
    assert torch.allclose(drafter.draft_head.float(), _head(target), atol=0.01)
    assert _head(target).dtype == torch.float32  # the target's own head is untouched
    assert drafter.dtype == torch.float32 and drafter.norm.weight.dtype == torch.float32  # activations stay float32
    assert drafter.candidate_selector.predecessor_codebook.dtype == torch.float32
    assert not use_bfloat16_matmuls(drafter, _head(target), force=True)  # already moved


def test_the_measurement_decides_and_leaves_float32_weights_when_it_says_no(target, monkeypatch):
    drafter = dflash2_drafter(target)
    before = {name: p.clone() for name, p in drafter.named_parameters()}
    monkeypatch.setattr(cpu_precision, "native_bfloat16", lambda: True)
    monkeypatch.setattr(cpu_precision, "bfloat16_drafts_faster", lambda *args, **kwargs: False)
    assert not use_bfloat16_matmuls(drafter, _head(target))
    assert drafter.draft_head is None
    assert all(torch.equal(p, before[name]) for name, p in drafter.named_parameters())
    monkeypatch.setattr(cpu_precision, "native_bfloat16", lambda: False)  # emulated bfloat16 is never tried
    monkeypatch.setattr(cpu_precision, "bfloat16_drafts_faster", lambda *args, **kwargs: pytest.fail("measured"))
    assert not use_bfloat16_matmuls(drafter, _head(target))


@pytest.mark.parametrize("precision, measured, bfloat16", [
    ("auto", True, True), ("auto", False, False), ("float32", None, False), ("bfloat16", None, True)])
def test_the_pipelines_drafter_precision_measures_only_when_auto(target, monkeypatch, precision, measured, bfloat16):
    monkeypatch.setattr(cpu_precision, "native_bfloat16", lambda: True)
    if measured is None:
        monkeypatch.setattr(cpu_precision, "bfloat16_drafts_faster", lambda *a, **k: pytest.fail("measured"))
    else:
        monkeypatch.setattr(cpu_precision, "bfloat16_drafts_faster", lambda *a, **k: measured)
    pipe = DFlash(target, dflash2_drafter(target), drafter_precision=precision)
    assert (pipe.drafter.draft_head is not None) == bfloat16
    assert pipe.drafter.fc.weight.dtype == (torch.bfloat16 if bfloat16 else torch.float32)


def test_a_drafter_precision_that_is_not_one_is_a_user_error(target):
    with pytest.raises(UserError, match="not one of auto, float32, bfloat16"):
        DFlash(target, dflash2_drafter(target), drafter_precision="fp8")
    with pytest.raises(UserError, match="not one of"):
        DFlash.from_pretrained(drafter_precision="half")  # before anything loads


def test_forced_bfloat16_with_a_head_it_cannot_copy_says_what_to_use(target, monkeypatch):
    head = torch.nn.Linear(target.hidden_size, target.vocab_size, bias=True)  # a head with a bias
    monkeypatch.setattr(target.model, "get_output_embeddings", lambda: head)
    with pytest.raises(UserError, match="use drafter precision auto or float32"):
        DFlash(target, dflash2_drafter(target), drafter_precision="bfloat16")


def test_measuring_restores_the_float32_weights(target):
    drafter = dflash2_drafter(target)
    linears = [m for m in drafter.modules() if isinstance(m, CastingLinear)]
    weights = cpu_precision._Weights(linears)
    head = _head(target).detach()
    cpu_precision.bfloat16_drafts_faster(drafter, weights, head, head.bfloat16(), rounds=1)
    assert all(m.weight is w for m, w in zip(linears, weights.float32))


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_with_a_bfloat16_drafter_is_lossless(target, block_size):
    prompts = random_prompts(3, seed=31)
    drafter = dflash2_drafter(target)
    use_bfloat16_matmuls(drafter, _head(target), force=True)
    engine = SpeculativeEngine(target, DFlashProposer(drafter, target))
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True)
    outs = engine.generate(prompts, config)
    assert [o.output_ids for o in outs] == [hf_greedy(target, p, MAX_NEW) for p in prompts]


def test_the_proposer_drafts_with_the_drafters_head_copy(target):
    drafter = dflash2_drafter(target)
    proposer = DFlashProposer(drafter, target)
    hidden = torch.randn(2, 3, target.hidden_size)
    own = proposer.draft_logits(hidden)
    drafter.draft_head = torch.zeros_like(_head(target))  # a head the target does not have: its logits are 0
    assert own.abs().sum() > 0 and proposer.draft_logits(hidden).abs().sum() == 0


@pytest.mark.parametrize("seed", [None, 7])
def test_the_embedded_pair_with_a_bfloat16_drafter_decodes_as_the_target_alone(seed):
    """A trained drafter, so that most draft tokens are accepted and bfloat16 changes which are."""
    drafted = DFlash.from_pretrained(drafter_precision="bfloat16")
    assert drafted.drafter.draft_head is not None and drafted.drafter.draft_head.dtype == torch.bfloat16
    plain = DFlash.from_pretrained(no_draft=True)
    question = "A baker makes 24 rolls in the morning and twice as many in the afternoon. How many rolls in all?"
    options = dict(max_new_tokens=64) if seed is None else dict(max_new_tokens=64, temperature=0.8, seed=seed)
    a, b = drafted.generate(question, **options), plain.generate(question, **options)
    assert a.output_ids == b.output_ids and len(a.output_ids) > 8
    if seed is None:
        assert a.stats.mean_acceptance_length > 1.5
