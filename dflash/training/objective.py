"""The DFlash training objective (REFERENCE section 4).

For each sequence, anchors are sampled inside the response (a conversation's sequence holds one per answer, and a
block stops at the end of its anchor's). Anchor a starts the block
`[x_a, MASK x (B-1)]` at positions a..a+B-1. The block sees the target's context features of positions
strictly before a, all of its own block (bidirectional; a drafter whose config makes a layer causal or windowed
narrows that layer's view, `DrafterConfig.layer_attention`) and no other block. Block position k (1..B-1)
is labelled with x_{a+k} (same-position labels) and weighted by exp(-(k-1)/gamma); position 0 has no loss.
Many blocks of one sequence are trained in a single drafter forward. Optionally (distillation) part of
each position's loss is the KL from the target's own distribution for that token.

A DFlash2 drafter adds a second term for its candidate selector (`selector_loss`): at each labelled position, a
cross-entropy over the position's top candidates, scored after the true previous token, towards the label
when it is among them; the same decay weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Published decay constants: gamma = 7 for B=16, 5 for B=10, 4 for B=8.
_PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def loss_gamma(block_size: int) -> float:
    """Decay constant for a block size: the published values, linearly interpolated in between."""
    if block_size in _PUBLISHED_GAMMA:
        return _PUBLISHED_GAMMA[block_size]
    points = sorted(_PUBLISHED_GAMMA.items())
    lo = max((p for p in points if p[0] < block_size), default=points[0])
    hi = min((p for p in points if p[0] > block_size), default=points[-1])
    if lo == hi:
        (lo, hi) = (points[-2], points[-1]) if block_size > points[-1][0] else (points[0], points[1])
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    return max(1.0, lo[1] + slope * (block_size - lo[0]))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) loss weight per block position: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """(b, T) bool: positions inside the response whose next token is labelled, where a block may start."""
    has_label = torch.zeros_like(loss_mask)
    has_label[:, :-1] = loss_mask[:, 1:]
    return loss_mask & has_label


def sample_anchors(
    loss_mask: torch.Tensor,  # (b, T) bool: response tokens
    num_anchors: int,
    generators: list[torch.Generator],  # one per row, so a row's anchors do not depend on its batch
    preferred: torch.Tensor | None = None,  # (b, T) bool: candidates taken before any other
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchor positions inside each response, with at least one label after them. With `preferred`
    (e.g. greedy decoding's anchors, `walk_decoding_anchors`), those are taken first (a random subset of them
    when there are more than num_anchors) and random other candidates fill the remaining places.

    Returns anchors (b, n) sorted and anchor_valid (b, n) bool (rows with short responses get fewer); n is
    num_anchors, or the most candidates a row of the batch has when that is fewer.
    """
    b, T = loss_mask.shape
    candidates = anchor_candidates(loss_mask)
    # up to each row's last response token; read once (a mask on a GPU: one host sync, not two a row)
    lengths = (loss_mask.long().cumsum(1).argmax(1) + 1).tolist()
    scores = torch.full((b, T), 2.0)
    for r, g in enumerate(generators):
        scores[r, : lengths[r]] = torch.rand(lengths[r], generator=g)
    scores = scores.to(loss_mask.device)
    if preferred is not None:
        scores = torch.where(preferred, scores - 1.0, scores)  # preferred in [-1, 0), the others in [0, 1)
    scores = scores.masked_fill(~candidates, 2.0)
    # no more places than the row with the most candidates fills: an empty one still costs a whole block
    n = max(1, min(num_anchors, int(candidates.sum(1).max())))
    chosen_scores, chosen = torch.topk(scores, n, dim=1, largest=False)  # n random candidates per row
    valid = chosen_scores < 2.0
    anchors = torch.where(valid, chosen, torch.zeros_like(chosen))
    order = torch.argsort(anchors + (~valid).long() * T, dim=1)  # sorted, invalid ones last
    return anchors.gather(1, order), valid.gather(1, order)


@dataclass
class Blocks:
    """The training blocks of a batch, flattened to (b, n * B)."""

    tokens: torch.Tensor  # (b, n*B) block token ids: x_anchor then mask tokens
    positions: torch.Tensor  # (b, n*B) real sequence positions
    labels: torch.Tensor  # (b, n*B) token at the same position, -100 where there is none
    weights: torch.Tensor  # (b, n*B) loss weight (decay x label validity)
    attn_mask: torch.Tensor  # (b, n*B, T + n*B) bool: context strictly before the anchor + own block


def build_blocks(
    input_ids: torch.Tensor,  # (b, T)
    loss_mask: torch.Tensor,  # (b, T) bool
    context_valid: torch.Tensor,  # (b, T) bool: real (non-padding) tokens
    anchors: torch.Tensor,  # (b, n)
    anchor_valid: torch.Tensor,  # (b, n)
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    b, T = input_ids.shape
    n, B = anchors.shape[1], block_size
    device = input_ids.device
    offsets = torch.arange(B, device=device)
    positions = anchors[:, :, None] + offsets  # (b, n, B)
    in_range = positions < T
    safe = positions.clamp(max=T - 1)
    targets = input_ids.gather(1, safe.view(b, -1)).view(b, n, B)
    in_response = in_range & loss_mask.gather(1, safe.view(b, -1)).view(b, n, B)
    # up to the anchor's response's end: a block never runs on into a later turn's response
    labelled = in_response.long().cumprod(-1).bool() & anchor_valid[:, :, None]
    labelled[:, :, 0] = False  # the anchor itself is given, not predicted
    tokens = torch.full((b, n, B), mask_token_id, dtype=input_ids.dtype, device=device)
    tokens[:, :, 0] = input_ids.gather(1, anchors)
    labels = torch.where(labelled, targets, torch.full_like(targets, -100))
    weights = position_weights(B, gamma).to(device)[None, None, :] * labelled

    # attention: block j sees context t < anchor_j (and real), and every position of block j only
    t = torch.arange(T, device=device)
    sees_context = (t[None, None, :] < anchors[:, :, None]) & context_valid[:, None, :]  # (b, n, T)
    sees_context = sees_context[:, :, None, :].expand(b, n, B, T).reshape(b, n * B, T)
    block_id = torch.arange(n, device=device).repeat_interleave(B)  # (n*B,)
    same_block = (block_id[:, None] == block_id[None, :])[None].expand(b, -1, -1)
    attn_mask = torch.cat([sees_context, same_block], dim=2)
    return Blocks(tokens.view(b, -1), positions.view(b, -1), labels.view(b, -1), weights.view(b, -1), attn_mask)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: mean over sequences of the decay-weighted cross-entropy
    correct: torch.Tensor  # (B,) correct predictions per block position (summed over the batch)
    counted: torch.Tensor  # (B,) labelled predictions per block position
    accepted: torch.Tensor  # () sum over blocks of leading correct draft tokens
    blocks: torch.Tensor  # () number of blocks with at least one label
    selector_recall: float | None = None  # DFlash2: share of labelled positions whose label is a candidate


def block_loss(logits: torch.Tensor, blocks: Blocks, block_size: int, soft_targets: torch.Tensor | None = None,
               distill_weight: float = 0.0, drafted: torch.Tensor | None = None) -> LossOutput:
    """logits (b, n*B, vocab). Each sequence's loss is normalised by its weight sum, then averaged over
    sequences, so a batch split across processes averages to the same value.

    soft_targets (b, n*B, vocab): the target's logits for the same positions (the distribution it drew each
    label from); with them a position's loss is (1 - w) * CE + w * KL(target || drafter), w = distill_weight.
    drafted (b, n*B): the draft tokens the counts judge (DFlash2: the selector's path); default each argmax."""
    labels = blocks.labels.clamp_min(0)
    if soft_targets is not None and distill_weight > 0:
        per_position = mixed_label_loss(logits, labels, soft_targets, distill_weight)
    else:
        per_position = position_cross_entropy(logits, labels)  # (b, n*B)
    weighted = (per_position * blocks.weights).sum(1)
    weight_sum = blocks.weights.sum(1)
    has_labels = weight_sum > 0
    per_sequence = weighted / weight_sum.clamp_min(1e-9)
    loss = (per_sequence * has_labels).sum() / max(int(has_labels.sum()), 1)

    with torch.no_grad():
        hit, labelled = block_hits(logits, blocks, block_size, drafted)
        correct = (hit & labelled).sum((0, 1))
        counted = labelled.sum((0, 1))
        leading, has_labels = leading_correct(hit, labelled)
    return LossOutput(loss, correct, counted, leading.sum(), has_labels.sum())


def position_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per position, (b, n*B), of logits (b, n*B, C) against class ids (b, n*B) or probabilities
    (b, n*B, C). Computed over the flattened positions: the class dimension stays last and contiguous (with it
    moved to dim 1, as F.cross_entropy wants 3-d input, the softmax and its gradient ran 4x slower on a CPU)."""
    b = logits.shape[0]
    flat = targets.flatten(0, 1) if targets.dim() == 3 else targets.flatten()
    return F.cross_entropy(logits.float().flatten(0, 1), flat, reduction="none").view(b, -1)


def mixed_label_loss(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor, weight: float,
                     ) -> torch.Tensor:
    """(1 - w) * CE(label) + w * KL(target || drafter) per position, (b, n*B), as one cross-entropy against the
    mixed distribution (1 - w) * onehot(label) + w * p_target minus w * H(p_target): the same value and
    gradient, with one softmax of the drafter's logits instead of separate CE and KL passes."""
    with torch.no_grad():
        target_log_probs = F.log_softmax(target_logits.float(), dim=-1)  # (b, n*B, vocab)
        target_probs = target_log_probs.exp()
        entropy = -(target_probs * target_log_probs).sum(-1)  # (b, n*B)
        mixed = target_probs.mul_(weight).scatter_add_(
            -1, labels[..., None], torch.full_like(labels[..., None], 1 - weight, dtype=target_probs.dtype))
    return position_cross_entropy(logits, mixed) - weight * entropy


def block_hits(logits: torch.Tensor, blocks: Blocks, block_size: int, drafted: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (b, n*B, vocab) -> hit (b, n, B): draft token == label, and labelled (b, n, B). The draft tokens
    are `drafted` (b, n*B) when given, else the greedy prediction of each position."""
    b = logits.shape[0]
    drafted = logits.argmax(-1) if drafted is None else drafted
    hit = (drafted == blocks.labels).view(b, -1, block_size)
    return hit, (blocks.labels >= 0).view(b, -1, block_size)


def true_predecessors(blocks: Blocks, block_size: int) -> torch.Tensor:
    """(b, n*B): the token before each block position had every earlier draft token been right: the anchor
    before position 1, the label of t-1 before t >= 2 (0 before the anchor and where there is no label)."""
    b = blocks.tokens.shape[0]
    tokens = blocks.tokens.view(b, -1, block_size)
    labels = blocks.labels.view(b, -1, block_size).clamp_min(0)
    previous = torch.zeros_like(tokens)
    previous[:, :, 1] = tokens[:, :, 0]
    previous[:, :, 2:] = labels[:, :, 1:-1]
    return previous.view(b, -1)


@dataclass
class SelectorLoss:
    loss: torch.Tensor  # scalar: per sequence the decay-weighted CE over candidates, averaged over sequences
    recall: torch.Tensor  # () labelled positions whose label is among the candidates (summed)
    labelled: torch.Tensor  # () labelled positions


def selector_loss(scores: torch.Tensor, candidates: torch.Tensor, blocks: Blocks) -> SelectorLoss:
    """scores, candidates (b, n*B, K): the selector's score of each candidate after the true previous token.
    A position whose label is not a candidate has nothing to select and no loss."""
    target = candidates == blocks.labels[..., None]  # (b, n*B, K); unlabelled (-100) positions match nothing
    found = target.any(-1)  # (b, n*B)
    ce = position_cross_entropy(scores, target.float().argmax(-1))  # (b, n*B)
    weights = blocks.weights * found
    per_sequence = (ce * weights).sum(1) / weights.sum(1).clamp_min(1e-9)  # (b,) 0 where no label was found
    # averaged over the sequences the block loss averages over (those with labels), so a sequence none of whose
    # labels is a candidate counts as 0 whether the batch is split (--grad-accum, processes) or not
    has_labels = blocks.weights.sum(1) > 0
    loss = (per_sequence * has_labels).sum() / max(int(has_labels.sum()), 1)
    return SelectorLoss(loss, found.sum().detach(), (blocks.labels >= 0).sum())


def leading_correct(hit: torch.Tensor, labelled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the draft tokens a greedy verify would accept on the target's own text: the leading
    correct ones. hit, labelled (b, n, B) -> leading (b, n) and has_labels (b, n) bool."""
    hit, labelled = hit[:, :, 1:], labelled[:, :, 1:]  # (b, n, B-1): the anchor is given, not drafted
    leading = ((hit | ~labelled).int().cumprod(-1) * labelled).sum(-1)  # a block ends at its last label
    return leading, labelled.any(-1)


def walk_decoding_anchors(
    loss_mask: torch.Tensor,  # (b, T) bool: response tokens
    acceptance_lengths: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where greedy decoding of each response would start its blocks, found by drafting them in turn.

    Decoding anchors its first block at the first response token (the prefill produced it) and each next one
    where the last one's accepted tokens end (its bonus token); it stops when no label follows, and goes on at
    the next response's first token (a later turn's prefill). Every anchor but a response's first sits after a
    miss, and these are the blocks decoding's acceptance length is measured on.
    `acceptance_lengths(rows (r,), anchors (r,)) -> (r,)` drafts one block per row at the given
    anchors and returns 1 + its leading correct draft tokens (`leading_correct`).

    Returns walked (b, T) bool, the anchors, and tokens (b,), the accepted tokens plus bonus tokens per row:
    tokens / walked.sum(1) is the acceptance length decoding would measure on that response.
    """
    b, T = loss_mask.shape
    candidates = anchor_candidates(loss_mask)
    last, next_first = _response_bounds(loss_mask, candidates)
    walked = torch.zeros_like(loss_mask)
    tokens = torch.zeros(b, dtype=torch.long, device=loss_mask.device)
    anchor = next_first[:, 0].clone()  # (b,) the first response's first token (T: none)
    active = anchor < T
    while bool(active.any()):
        rows = active.nonzero().flatten()  # (r,)
        walked[rows, anchor[rows]] = True
        accepted = acceptance_lengths(rows, anchor[rows]).to(anchor)  # (r,) >= 1
        accepted = torch.minimum(accepted, last[rows, anchor[rows]] - anchor[rows])  # no bonus token past the text
        tokens[rows] += accepted
        anchor[rows] += accepted
        at = anchor[rows].clamp(max=T - 1)
        ended = (anchor[rows] >= T) | ~candidates[rows, at]  # this response is done: on to the next one's first
        anchor[rows] = torch.where(ended, next_first[rows, at], anchor[rows])
        active[rows] = anchor[rows] < T
    return walked, tokens


def _response_bounds(loss_mask: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position (b, T): the last token of the response it is in, and the first token at or after it of
    a response that has a label to draft (T where there is none)."""
    b, T = loss_mask.shape
    t = torch.arange(T, device=loss_mask.device).expand(b, T)
    never = torch.full_like(t, T)
    ends = loss_mask & ~torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    last = torch.where(ends, t, never).flip(1).cummin(1).values.flip(1)  # (b, T) next response end at or after
    starts = candidates & ~torch.cat([torch.zeros_like(loss_mask[:, :1]), loss_mask[:, :-1]], dim=1)
    next_first = torch.where(starts, t, never).flip(1).cummin(1).values.flip(1)  # (b, T)
    return last, next_first


def estimated_acceptance_length(accepted: float, blocks: float) -> float:
    """tau over uniformly drawn anchors: 1 + mean leading correct draft tokens per block. Decoding measures
    less (see `walk_decoding_anchors`)."""
    return 1.0 + accepted / blocks if blocks else math.nan
