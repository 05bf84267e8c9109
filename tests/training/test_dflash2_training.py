"""Training a DFlash2 drafter: the selector's objective, a fresh run and a DFlash drafter grown into one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.api import DFlash
from dflash.model import load_drafter
from dflash.training import Trainer
from dflash.training.objective import Blocks, selector_loss, true_predecessors

from .test_trainer import (  # noqa: F401
    assert_decodes_as_the_target_alone,
    assert_same_outputs,
    config,
    greedy_data,
    train_data,
)


def blocks_of(tokens, labels, weights) -> Blocks:
    tokens, labels = torch.tensor([tokens]), torch.tensor([labels])
    return Blocks(tokens, tokens.clone(), labels, torch.tensor([weights]), torch.ones(1, 1, 1, dtype=torch.bool))


def test_true_predecessors_are_the_anchor_then_the_labels():
    blocks = blocks_of([7, 99, 99, 99, 8, 99, 99, 99], [-100, 11, 12, 13, -100, 21, -100, -100], [0.0] * 8)
    assert true_predecessors(blocks, 4).tolist() == [[0, 7, 11, 12, 0, 8, 21, 0]]


def test_the_selector_loss_is_a_weighted_cross_entropy_over_candidates_holding_the_label():
    blocks = blocks_of([7, 99, 99], [-100, 11, 12], [0.0, 1.0, 0.5])
    candidates = torch.tensor([[[1, 2, 3], [30, 11, 31], [40, 41, 42]]])  # 12 is not among position 2's
    scores = torch.randn(1, 3, 3)
    out = selector_loss(scores, candidates, blocks)
    assert out.loss.item() == pytest.approx(F.cross_entropy(scores[0, 1:2], torch.tensor([1])).item(), abs=1e-6)
    assert (int(out.recall), int(out.labelled)) == (1, 2)


def test_the_selector_loss_of_a_batch_is_the_mean_of_its_halves():
    """A sequence none of whose labels is among its candidates counts as 0, in a whole batch as in a batch split in
    two (--grad-accum 2, or two processes): it used to drop out of the whole batch's mean only, so one process
    and two trained differently."""
    tokens, labels, weights = [[7, 99, 99]] * 4, [[-100, 11, 12]] * 4, [[0.0, 1.0, 0.5]] * 4
    blocks = Blocks(torch.tensor(tokens), torch.tensor(tokens), torch.tensor(labels), torch.tensor(weights),
                    torch.ones(4, 1, 1, dtype=torch.bool))
    candidates = torch.tensor([[[1, 2, 3], [30, 11, 31], [12, 41, 42]]]).repeat(4, 1, 1)
    candidates[2, 1, 1] = candidates[2, 2, 0] = 5  # the third sequence's labels are not candidates
    scores = torch.randn(4, 3, 3)

    def half(rows):
        part = Blocks(*(t[rows] for t in (blocks.tokens, blocks.positions, blocks.labels, blocks.weights,
                                          blocks.attn_mask)))
        return selector_loss(scores[rows], candidates[rows], part).loss

    whole = selector_loss(scores, candidates, blocks).loss
    assert whole.item() == pytest.approx(((half(slice(0, 2)) + half(slice(2, 4))) / 2).item(), abs=1e-6)


def test_a_dflash2_drafter_trains_exports_and_decodes_losslessly(tiny_pair, train_data, tmp_path):  # noqa: F811
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "d2", dflash2=True, selector_rank=8,
                             selector_top_k=4, draft_layers=2)).setup()
    result = trainer.train()
    assert 0 <= result["eval_candidate_recall"] <= 1 and math.isfinite(result["eval_loss"])
    loaded = load_drafter(tmp_path / "d2", dtype="float32")
    assert loaded.config.architecture == "DFlash2DraftModel" and loaded.config.dflash2.selector_rank == 8
    assert loaded.candidate_selector.hidden_projection.weight.abs().sum() > 0  # the selector learnt
    assert loaded.layers[0].mlp_conv.kernel_projection.weight.abs().sum() > 0  # and the convolutions
    assert_decodes_as_the_target_alone(tiny_pair[0], tmp_path / "d2")


def test_a_dflash_drafter_grown_into_dflash2_starts_unchanged(tiny_pair, train_data, tmp_path):  # noqa: F811
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=2)).setup().train()
    first = load_drafter(tmp_path / "first", dtype="float32").eval()
    grown = Trainer(config(tiny_pair, train_data, tmp_path / "grown", init_from=str(tmp_path / "first"),
                           dflash2=True, selector_rank=8, max_steps=2)).setup()
    assert grown.drafter_config.dflash2 is not None
    grown.drafter.eval()
    assert_same_outputs(grown.drafter, first)
    before = Trainer(config(tiny_pair, train_data, tmp_path / "same", init_from=str(tmp_path / "first"),
                            max_steps=1)).setup()
    with torch.no_grad():  # the same held-out tau as the DFlash drafter: its path is each position's top-1
        assert grown.evaluate()["eval_tau_decoding"] == before.evaluate()["eval_tau_decoding"]


def test_the_selector_loss_trains_the_selector_only_and_projections_learn_slower(tiny_pair, train_data,  # noqa: F811
                                                                                 tmp_path):
    from dflash.model.dflash2 import GroupedDynamicConv
    from dflash.training.objective import build_blocks, sample_anchors
    from dflash.training.trainer import _example_generator

    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "d2", dflash2=True, selector_rank=8,
                             selector_top_k=4, draft_layers=2)).setup()
    batch = trainer._batch("train", [0, 1])
    features, _ = trainer._features(batch)
    anchors, valid = sample_anchors(batch.loss_mask, 4, [_example_generator(0, 0, i) for i in batch.indices])
    blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.attention_mask, anchors, valid, 4,
                          trainer.drafter_config.mask_token_id, 7.0)
    out = trainer._draft(batch, features, blocks)
    selector_loss(out.selector_scores, out.candidates, blocks).loss.backward()
    grads = {name: p.grad for name, p in trainer.drafter.named_parameters()}
    assert grads["candidate_selector.hidden_projection.weight"].abs().sum() > 0  # (the codebooks: once it is not 0)
    assert all(g is None for name, g in grads.items() if not name.startswith("candidate_selector"))
    rates = {len(group["params"]): group["lr"] for group in trainer.optimizer.param_groups}
    projections = 2 * len(trainer.drafter.layers)  # one per sublayer
    assert rates[projections] == pytest.approx(trainer.config.lr * GroupedDynamicConv.projection_lr_scale
                                               * trainer.scheduler.get_last_lr()[0] / trainer.config.lr)


def test_the_held_out_replay_anchors_blocks_where_the_engine_does(tiny_pair, greedy_data, tmp_path):  # noqa: F811
    """eval_tau_decoding of a DFlash2 drafter walks its selector's path like the engine: on each response the
    replay's anchors are the engine's verify steps, one for one."""
    trainer = Trainer(config(tiny_pair, greedy_data, tmp_path / "d2", dflash2=True, selector_rank=8,
                             selector_top_k=4, draft_layers=2, max_steps=40, anchors_per_sequence=16)).setup()
    trainer.train()
    trainer.drafter.eval()
    torch.manual_seed(0)
    with torch.no_grad():  # a selector with opinions of its own: its path leaves the positions' top-1 tokens
        for p in trainer.drafter.candidate_selector.parameters():
            p.normal_(0.0, 0.5)
    trainer.export()
    pipe = DFlash.from_pretrained(tiny_pair[0], tmp_path / "d2", device="cpu", block_size=4)
    accepted = 0
    trainer.eval_examples = trainer.train_examples[:8]  # texts it learnt: blocks of varied acceptance
    for i, example in enumerate(trainer.eval_examples):
        batch = trainer._batch("eval", [i])
        with torch.no_grad():
            features, _ = trainer._features(batch)
            walked, _ = trainer._walk(batch.input_ids, batch.attention_mask, batch.loss_mask, features)
        response = example.input_ids[example.response_start:]
        out = pipe.generate(example.input_ids[: example.response_start], max_new_tokens=len(response),
                            ignore_eos=True)
        assert out.output_ids == response  # the data is the target's own greedy text
        steps = out.stats.acceptance_lengths[1:]
        engine_anchors = [example.response_start + sum(steps[:j]) for j in range(len(steps))]
        assert walked[0].nonzero().flatten().tolist() == engine_anchors
        accepted += sum(steps) - len(steps)
    assert accepted > 8, "the drafter must accept something for the anchors to tell drafters apart"
