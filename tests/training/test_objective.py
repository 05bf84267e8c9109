"""The objective's invariants: no context leak, block isolation, same-position labels, decay weights,
anchors inside the response."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import MASK_TOKEN_ID, dflash2_drafter, tiny_drafter
from dflash.training.drafting_head import DraftingHead
from dflash.training.objective import (
    block_loss,
    build_blocks,
    loss_gamma,
    position_weights,
    sample_anchors,
)

B = 4


def toy_batch(T=24, response_start=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, T), generator=g)
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, 20:] = False  # second row is padded
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[:, response_start:] = True
    loss_mask &= real
    return ids, real, loss_mask


def test_anchors_fall_inside_the_response_with_a_label_after_them():
    ids, real, loss_mask = toy_batch()
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 2 + r) for r in range(2)]
        anchors, valid = sample_anchors(loss_mask, 6, gens)
        for r in range(2):
            for a in anchors[r][valid[r]].tolist():
                assert loss_mask[r, a] and loss_mask[r, a + 1], (r, a)
            assert anchors[r][valid[r]].tolist() == sorted(anchors[r][valid[r]].tolist())


def test_a_batch_drafts_no_more_blocks_than_its_fullest_row_fills():
    """An anchor place no candidate fills still costs a whole block of drafter compute: with --anchors-per-sequence
    above what a batch's responses hold (512 in the published recipe), the batch gets as many places as its
    fullest row fills, and every candidate of each row is an anchor all the same."""
    ids, real, loss_mask = toy_batch()  # rows' candidates: 8..22 (15) and 8..18 (11)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    anchors, valid = sample_anchors(loss_mask, 512, gens)
    assert anchors.shape == (2, 15) and valid.sum(1).tolist() == [15, 11]
    assert anchors[0].tolist() == list(range(8, 23)) and anchors[1][valid[1]].tolist() == list(range(8, 19))
    nothing = torch.zeros_like(loss_mask)
    anchors, valid = sample_anchors(nothing, 512, gens)
    assert anchors.shape == (2, 1) and not valid.any()


def test_labels_are_same_position_and_weights_decay():
    ids, real, loss_mask = toy_batch()
    anchors = torch.tensor([[8, 12], [10, 17]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    blocks = build_blocks(ids, loss_mask, real, anchors, valid, B, MASK_TOKEN_ID, gamma=7.0)
    tokens, labels = blocks.tokens.view(2, 2, B), blocks.labels.view(2, 2, B)
    assert tokens[0, 0].tolist() == [int(ids[0, 8])] + [MASK_TOKEN_ID] * (B - 1)
    assert labels[0, 0].tolist() == [-100] + ids[0, 9:12].tolist()  # position k predicts x[anchor + k]
    assert labels[1, 1].tolist() == [-100, int(ids[1, 18]), int(ids[1, 19]), -100]  # padding has no label
    w = blocks.weights.view(2, 2, B)[0, 0]
    assert w[0] == 0 and torch.allclose(w[1:], torch.exp(-torch.arange(B - 1) / 7.0))
    assert loss_gamma(16) == 7 and loss_gamma(10) == 5 and loss_gamma(8) == 4
    weights16 = position_weights(16, 7.0)
    assert weights16[1] == 1.0 and math.isclose(float(weights16[8]), math.exp(-1), rel_tol=1e-6)


def test_a_sequence_with_no_labelled_block_does_not_dilute_the_batch_loss():
    """Each sequence's loss is averaged over the sequences that have labels: a row whose anchors were all invalid
    (an answer too short to anchor) leaves the loss as the other row's alone."""
    ids, real, loss_mask = toy_batch()
    anchors = torch.tensor([[8, 12], [10, 15]])
    valid = torch.tensor([[True, True], [False, False]])
    blocks = build_blocks(ids, loss_mask, real, anchors, valid, B, MASK_TOKEN_ID, gamma=7.0)
    logits = torch.randn(2, 2 * B, 100, generator=torch.Generator().manual_seed(3))
    alone = build_blocks(ids[:1], loss_mask[:1], real[:1], anchors[:1], valid[:1], B, MASK_TOKEN_ID, gamma=7.0)
    assert float(blocks.weights[1].sum()) == 0
    assert torch.allclose(block_loss(logits, blocks, B).loss, block_loss(logits[:1], alone, B).loss)


def test_distillation_mixes_cross_entropy_and_kl_from_the_target_distribution():
    ids, real, loss_mask = toy_batch()
    anchors, valid = torch.tensor([[8, 12], [10, 15]]), torch.ones(2, 2, dtype=torch.bool)
    blocks = build_blocks(ids, loss_mask, real, anchors, valid, B, MASK_TOKEN_ID, gamma=7.0)
    logits = torch.randn(2, 2 * B, 100, generator=torch.Generator().manual_seed(1))
    hard = block_loss(logits, blocks, B).loss
    sure = torch.nn.functional.one_hot(blocks.labels.clamp_min(0), 100).float() * 50.0  # a certain target
    assert torch.allclose(block_loss(logits, blocks, B, sure, distill_weight=1.0).loss, hard, atol=1e-4)
    assert torch.equal(block_loss(logits, blocks, B, sure, distill_weight=0.0).loss, hard)
    assert torch.allclose(soft_label_kl(logits, logits), torch.zeros(2, 2 * B), atol=1e-5)
    unsure = torch.randn(2, 2 * B, 100, generator=torch.Generator().manual_seed(2))
    kl = soft_label_kl(logits, unsure)
    assert (kl > 0).all()
    weights = blocks.weights
    expected = ((0.5 * (hard_per_position(logits, blocks) + kl) * weights).sum(1) / weights.sum(1)).mean()
    assert torch.allclose(block_loss(logits, blocks, B, unsure, distill_weight=0.5).loss, expected, atol=1e-5)


def soft_label_kl(logits, target_logits):
    """The definition, written out: sum over the vocabulary of p_target * (log p_target - log p_drafter)."""
    target_log_probs = torch.log_softmax(target_logits, -1)
    return (target_log_probs.exp() * (target_log_probs - torch.log_softmax(logits, -1))).sum(-1)


def hard_per_position(logits, blocks):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), blocks.labels.clamp_min(0), reduction="none")


@pytest.fixture(params=["dflash", "dflash2"])
def head(target, request):
    """DFlash2's in-block convolution must not open a path around the block mask either."""
    if request.param == "dflash2":
        drafter = dflash2_drafter(target, block_size=B)
    else:
        drafter = tiny_drafter(target, layers=2, block_size=B)
    return DraftingHead(drafter, target), drafter


def logits_for(head_and_drafter, features, ids, real, loss_mask, anchors):
    head, drafter = head_and_drafter
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blocks = build_blocks(ids, loss_mask, real, anchors, valid, B, MASK_TOKEN_ID, 7.0)
    with torch.no_grad():
        logits = head(features, blocks.tokens, blocks.positions, real, blocks.attn_mask).logits
    return logits.view(ids.shape[0], -1, B, 128)


def test_no_context_leak_features_at_or_after_the_anchor_are_invisible(head):
    ids, real, loss_mask = toy_batch()
    ids, real, loss_mask = ids[:1] % 100, real[:1], loss_mask[:1]
    F = head[1].config.num_features
    features = torch.randn(1, ids.shape[1], F)
    anchors = torch.tensor([[10, 15]])
    base = logits_for(head, features, ids, real, loss_mask, anchors)
    changed = features.clone()
    changed[:, 10:] += 3.0  # at and after the first anchor
    after = logits_for(head, changed, ids, real, loss_mask, anchors)
    assert torch.allclose(base[0, 0], after[0, 0], atol=1e-5)  # block at anchor 10 unchanged
    assert not torch.allclose(base[0, 1], after[0, 1], atol=1e-3)  # block at 15 sees positions 10..14
    before = features.clone()
    before[:, 9] += 3.0  # strictly before the anchor: visible
    assert not torch.allclose(base[0, 0], logits_for(head, before, ids, real, loss_mask, anchors)[0, 0], atol=1e-3)


def test_a_block_does_not_see_other_blocks(head):
    ids, real, loss_mask = toy_batch()
    ids, real, loss_mask = ids[:1], real[:1], loss_mask[:1]
    features = torch.randn(1, ids.shape[1], head[1].config.num_features)
    base = logits_for(head, features, ids, real, loss_mask, torch.tensor([[10, 15]]))
    other = logits_for(head, features, ids, real, loss_mask, torch.tensor([[10, 18]]))  # move the 2nd block
    alone = logits_for(head, features, ids, real, loss_mask, torch.tensor([[10]]))
    assert torch.allclose(base[0, 0], other[0, 0], atol=1e-5)
    assert torch.allclose(base[0, 0], alone[0, 0], atol=1e-5)
    # and the other way: a later block does not see an earlier one (the earlier one moved, or gone)
    second_alone = logits_for(head, features, ids, real, loss_mask, torch.tensor([[15]]))
    second_after_another = logits_for(head, features, ids, real, loss_mask, torch.tensor([[12, 15]]))
    assert torch.allclose(base[0, 1], second_alone[0, 0], atol=1e-5)
    assert torch.allclose(base[0, 1], second_after_another[0, 1], atol=1e-5)


def _blocks_with_known_hits(leading_correct: list[int], B: int = 4, vocab: int = 10):
    """One sequence, one block per entry; block j's first `leading_correct[j]` draft tokens are right."""
    from dflash.training.objective import Blocks

    n = len(leading_correct)
    labels = torch.full((1, n, B), 7)
    labels[:, :, 0] = -100  # the anchor has no label
    logits = torch.zeros(1, n, B, vocab)
    logits[..., 3] = 1.0  # wrong everywhere ...
    for j, k in enumerate(leading_correct):
        logits[0, j, 1: 1 + k, 7] = 2.0  # ... except the leading k draft positions
        if 1 + k < B - 1:
            logits[0, j, 2 + k, 7] = 2.0  # a later hit after a miss does not count
    weights = (labels >= 0).float()
    zeros = torch.zeros(1, n * B, dtype=torch.long)
    blocks = Blocks(tokens=zeros, positions=zeros, labels=labels.view(1, -1), weights=weights.view(1, -1),
                    attn_mask=torch.ones(1, n * B, n * B).bool())
    return logits.view(1, n * B, vocab), blocks


def test_leading_correct_stops_at_the_first_miss():
    from dflash.training.objective import block_hits, block_loss, estimated_acceptance_length, leading_correct

    logits, blocks = _blocks_with_known_hits([3, 0, 1])
    leading, has_labels = leading_correct(*block_hits(logits, blocks, block_size=4))
    assert leading.tolist() == [[3, 0, 1]] and has_labels.all()
    out = block_loss(logits, blocks, block_size=4)
    assert int(out.accepted) == 4 and int(out.blocks) == 3
    assert estimated_acceptance_length(float(out.accepted), float(out.blocks)) == pytest.approx(1 + 4 / 3)


def walk_with_table(loss_mask, table):
    """walk_decoding_anchors where the block at response token i of row r is accepted table[r][i]."""
    from dflash.training.objective import walk_decoding_anchors

    starts = loss_mask.long().argmax(1)
    asked = []

    def acceptance_lengths(rows, anchors):
        asked.extend(zip(rows.tolist(), anchors.tolist()))
        return torch.tensor([table[r][a - int(starts[r])] for r, a in zip(rows.tolist(), anchors.tolist())])

    walked, tokens = walk_decoding_anchors(loss_mask, acceptance_lengths)
    return walked, tokens, asked


def test_decoding_walk_steps_from_each_accepted_end_and_has_no_bonus_past_the_text():
    loss_mask = torch.zeros(3, 14, dtype=torch.bool)
    loss_mask[0, 2:10] = True  # an 8-token response
    loss_mask[1, 5:10] = True  # a 5-token response (then padding)
    loss_mask[2, 13:] = True  # a 1-token response: nothing to draft
    # row 0: decoding visits 0 (tau 3) -> 3 (tau 1) -> 4 (tau 4, capped to 3: no bonus past the last token)
    table = [[3, 9, 9, 1, 4, 9, 9], [1, 1, 1, 1], []]
    walked, tokens, asked = walk_with_table(loss_mask, table)
    assert walked[0].nonzero().flatten().tolist() == [2, 5, 6] and tokens[0] == 7
    assert walked[1].nonzero().flatten().tolist() == [5, 6, 7, 8] and tokens[1] == 4
    assert not walked[2].any() and tokens[2] == 0
    assert all(loss_mask[r, a] and loss_mask[r, a + 1] for r, a in asked)  # only drafted where a label follows


def test_a_block_ends_with_its_response_and_never_labels_the_next_turns():
    """A conversation of several turns is one sequence: a block anchored near the end of one response labels
    only what is left of it, not the next turn's prompt nor, past a short one, the next response."""
    ids = torch.arange(20)[None]  # (1, 20)
    real = torch.ones(1, 20, dtype=torch.bool)
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 3:9] = True  # the first answer
    loss_mask[0, 11:20] = True  # the second, after a 2-token prompt
    anchors, valid = torch.tensor([[7, 11]]), torch.ones(1, 2, dtype=torch.bool)
    blocks = build_blocks(ids, loss_mask, real, anchors, valid, 6, MASK_TOKEN_ID, gamma=7.0)
    labels = blocks.labels.view(2, 6)
    assert labels[0].tolist() == [-100, 8, -100, -100, -100, -100]  # 11 and 12 would be the next answer's
    assert labels[1].tolist() == [-100, 12, 13, 14, 15, 16]
    assert (blocks.weights.view(2, 6)[0, 2:] == 0).all()


def test_decoding_walk_goes_on_at_each_response_of_a_conversation():
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 2:7] = True  # 5 tokens
    loss_mask[0, 9] = True  # one token: nothing to draft
    loss_mask[0, 12:18] = True  # 6 tokens
    accepted = {2: 3, 5: 4, 12: 2, 14: 9}  # 5: capped at the end of its response, 14: at the end of the next
    from dflash.training.objective import walk_decoding_anchors

    asked = []

    def acceptance_lengths(rows, anchors):
        asked.extend(anchors.tolist())
        return torch.tensor([accepted[a] for a in anchors.tolist()])

    walked, tokens = walk_decoding_anchors(loss_mask, acceptance_lengths)
    assert asked == [2, 5, 12, 14] and walked[0].nonzero().flatten().tolist() == asked
    assert tokens.tolist() == [(5 - 1) + (6 - 1)]  # each response's first token came from its prompt's prefill


def test_preferred_anchors_come_first_and_random_ones_fill_up():
    ids, real, loss_mask = toy_batch()
    preferred = torch.zeros_like(loss_mask)
    preferred[:, [3, 9, 12, 23]] = True  # 3 is in the prompt, 23 the last token of row 0 and padding in row 1
    for seed in range(10):
        gens = [torch.Generator().manual_seed(seed * 2 + r) for r in range(2)]
        anchors, valid = sample_anchors(loss_mask, 6, gens, preferred=preferred)
        for r in range(2):
            chosen = anchors[r][valid[r]].tolist()
            assert {9, 12} <= set(chosen) and 3 not in chosen and 23 not in chosen and len(chosen) == 6
        many = torch.zeros_like(loss_mask)
        many[:, 8:18] = True  # 10 preferred candidates for 6 places: a random subset of them
        anchors, valid = sample_anchors(loss_mask, 6, gens, preferred=many)
        assert valid.all() and all(8 <= a < 18 for a in anchors.flatten().tolist())


def test_a_training_block_attends_both_ways(head):
    """Causal block attention (a public trainers' pitfall) was caught only through a trained drafter's acceptance:
    here the first draft position must see what the last one holds."""
    ids, real, loss_mask = toy_batch()
    ids, real, loss_mask = ids[:1] % 100, real[:1], loss_mask[:1]
    features = torch.randn(1, ids.shape[1], head[1].config.num_features)
    blocks = build_blocks(ids, loss_mask, real, torch.tensor([[10]]), torch.ones(1, 1, dtype=torch.bool), B,
                          MASK_TOKEN_ID, 7.0)
    changed = blocks.tokens.clone()
    changed[0, B - 1] = 7  # the block's last token
    with torch.no_grad():
        base, after = (head[0](features, tokens, blocks.positions, real, blocks.attn_mask).logits
                       for tokens in (blocks.tokens, changed))
    assert not torch.allclose(base[0, 1], after[0, 1], atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_training_block_gives_the_logits_decoding_gives_at_that_anchor(family):
    """Training and decoding run the drafter on the same inputs: the target's features before the anchor, the block
    at the anchor's positions. A shift, a leak or another mask on either side breaks this."""
    from conftest import tiny_target_model
    from dflash.decoding.proposer import DFlashProposer, PendingContext
    from dflash.decoding.sampling import SamplingParams
    from dflash.model.target import TargetModel

    target = TargetModel(tiny_target_model(family))
    drafter = tiny_drafter(target, layers=2, block_size=8)
    layers = drafter.config.target_layer_ids
    ids = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(3))
    real, loss_mask = torch.ones(1, 30, dtype=torch.bool), torch.arange(30)[None] >= 10
    anchors = torch.tensor([[12, 20]])
    blocks = build_blocks(ids, loss_mask, real, anchors, torch.ones_like(anchors).bool(), 8, MASK_TOKEN_ID, 7.0)
    with torch.no_grad():
        features = target.context_features(ids, real, layers).float()
        trained = DraftingHead(drafter, target)(features, blocks.tokens, blocks.positions, real,
                                                blocks.attn_mask).logits.view(1, 2, 8, -1)
        proposer = DFlashProposer(drafter, target)
        for j, anchor in enumerate(anchors[0].tolist()):
            seen = torch.arange(anchor)[None]
            out = target.forward(ids[:, :anchor], seen, target.new_cache(), feature_layer_ids=layers)
            state = proposer.new_state()
            proposer.observe(state, PendingContext(out.features, seen, torch.ones(1, anchor, dtype=torch.bool)))
            block = torch.tensor([[int(ids[0, anchor])] + [MASK_TOKEN_ID] * 7])
            hidden = drafter(block_embeds=target.embed(block), block_positions=anchor + torch.arange(8)[None],
                             context=drafter.project_context(out.features.float()), context_positions=seen,
                             cache=state.cache)
            assert torch.allclose(target.lm_head(hidden)[0], trained[0, j], atol=1e-4)
            # and through the proposer, as the engine drafts: its distribution of each draft token (a sampled row)
            state = proposer.new_state()
            proposer.observe(state, PendingContext(out.features, seen, torch.ones(1, anchor, dtype=torch.bool)))
            row = SimpleNamespace(params=SamplingParams(temperature=1.0), noise=None, generator=torch.Generator())
            draft = proposer.propose(state, ids[:, anchor], torch.tensor([anchor]), [row])
            assert torch.allclose(draft.probs[0], trained[0, j, 1:].softmax(-1), atol=1e-5)
