"""Proposers: one interface for every way of drafting (DFlash, none).

A proposer keeps its own per-batch state (for DFlash, the drafter's context cache) and is told, after
each target forward, the features of the tokens that were accepted; it injects them on its next draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from dflash.decoding.sampling import add_logit_bias, sample, to_probs
from dflash.decoding.slots import compaction_index, pad_and_concat, padded_width
from dflash.errors import GenerationError, UserError
from dflash.model.dflash2 import Lattice, path_confidence, walk
from dflash.model.drafter import DFlashDraftModel, DrafterCache
from dflash.model.slot_buffer import spare_room
from dflash.model.target import TargetModel, check_drafter_fits


@dataclass
class Draft:
    tokens: torch.Tensor  # (b, k) draft tokens; k = block_size - 1 (0 without a drafter)
    probs: list[torch.Tensor | None]  # per row: (k, vocab) proposal distribution; None for greedy and seeded rows
    # computes `confidence` when asked: only a row that chooses its block size after drafting asks, and a DFlash
    # drafter's costs a softmax over the vocabulary at every position (0.5 ms a step at 8 rows on this CPU)
    confidence_fn: Callable[[], torch.Tensor] | None = None
    # branch_fn(start (b,), length) -> (b, length): a second path leaving the draft at each row's draft position
    # `start`, with the drafter's next-best token there (`branch`); None: the proposer has none
    branch_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    forwards: int = 1  # the drafter's forwards this draft took (a draft model's: one per draft token)

    @property
    def confidence(self) -> torch.Tensor | None:
        """(b, k) the drafter's probability that each draft token is right, given the ones before it were; None
        when the proposer does not say."""
        return None if self.confidence_fn is None else self.confidence_fn()

    def first(self, n: int) -> "Draft":
        """The same draft cut to its first n draft tokens: verifying a prefix of a draft is as lossless as
        verifying all of it (each target distribution depends only on the tokens before it)."""
        full = self.confidence_fn
        return Draft(tokens=self.tokens[:, :n], probs=[None if p is None else p[:n] for p in self.probs],
                     confidence_fn=None if full is None else (lambda: full()[:, :n]), branch_fn=self.branch_fn,
                     forwards=self.forwards)


@dataclass
class PendingContext:
    """Target features of newly accepted tokens, not yet injected into the drafter."""

    features: torch.Tensor  # (b, c, num_features)
    positions: torch.Tensor  # (b, c)
    valid: torch.Tensor  # (b, c) bool


class Proposer(Protocol):
    kind: str  # what drafts: "DFlash", "draft model" (classic speculative decoding) or "none"
    block_size: int  # tokens per verify forward: the anchor + draft tokens
    # one forward drafts the whole block and says how sure it is of each token (`Draft.confidence`): the block
    # size to verify can then be chosen after drafting, at almost no cost for the draft tokens left unverified
    drafts_in_one_forward: bool
    feature_layer_ids: list[int]  # target layers whose outputs the proposer needs

    def new_state(self) -> object: ...

    def observe(self, state: object, context: PendingContext) -> None: ...

    def prefill(self, state: object, tokens: list[int]) -> None:
        """A new one-row state reads what its prefill gave it (`tokens`, the features observed) before the row
        joins a batch: alone, where the batch's next draft would read it padded to every row's width."""

    def propose(self, state: object, anchors: torch.Tensor, anchor_positions: torch.Tensor, rows: list) -> Draft:
        """anchors (b,), anchor_positions (b,); rows: the batch's `Sequence`s (tokens, sampling params)."""

    def with_block_size(self, block_size: int | None) -> "Proposer": ...

    def select_rows(self, state: object, rows: torch.Tensor) -> None: ...

    def compact(self, state: object) -> None: ...

    def merge(self, states: list[object], batch_sizes: list[int]) -> object: ...


def check_proposer(proposer: object) -> None:
    """Refuse a proposer that lacks part of the `Proposer` interface, naming what it lacks, before it is used."""
    members = [name for name in Proposer.__annotations__] + [
        name for name, value in vars(Proposer).items() if callable(value) and not name.startswith("_")]
    missing = [name for name in members if not hasattr(proposer, name)]
    if missing:
        raise UserError(f"{type(proposer).__name__} is not a complete proposer: it lacks {', '.join(missing)}; "
                        "implement every member of dflash.decoding.proposer.Proposer (or subclass DFlashProposer "
                        "or NoDraftProposer and override what differs)")


def draft_per_position(logits: torch.Tensor, rows: list) -> Draft:
    """DFlash: each position's token on its own, from logits (b, k, vocab): the argmax (greedy rows), the row's
    noise on the drafter's distribution (seeded rows), or a draw from it (the rest, whose probs are kept)."""
    tokens = logits.max(-1).indices  # argmax's tokens (the first of tied ones); on CPUs 2-6x faster than argmax
    probs: list[torch.Tensor | None] = [None] * len(rows)
    for r, row in enumerate(rows):
        if row.params.greedy:
            continue
        if row.noise is not None:  # the position's own noise on the drafter's distribution (no probs needed)
            tokens[r] = row.noise.choose(to_probs(logits[r], row.params, proposal=True), row.next_position)
        else:
            probs[r] = to_probs(logits[r], row.params, proposal=True)
            tokens[r] = sample(probs[r], row.generator)
    return Draft(tokens=tokens, probs=probs,
                 confidence_fn=lambda: logits.softmax(-1).gather(-1, tokens[..., None])[..., 0],  # (b, k)
                 branch_fn=partial(branch_per_position, logits, tokens))


def branch_per_position(logits: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, length: int) -> torch.Tensor:
    """DFlash: the next-best token at each row's `start`, then the draft's own tokens after it (a DFlash drafter
    drafts each position on its own). logits (b, k, vocab), tokens (b, k) -> (b, length); past the k drafted
    positions the last token repeats (verification rejects it unless the target agrees)."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    top2 = logits[rows, start].topk(2, dim=-1).indices  # (b, 2)
    first = torch.where(top2[:, 0] == tokens[rows, start], top2[:, 1], top2[:, 0])
    at = (start[:, None] + torch.arange(1, length, device=tokens.device)).clamp(max=tokens.shape[1] - 1)
    return torch.cat([first[:, None], tokens.gather(1, at)], dim=1)


def draft_along_path(lattice: Lattice, rows: list, vocab_size: int) -> Draft:
    """DFlash2: one path through the positions' candidates, each position's token chosen after the one before:
    the best-scoring candidate (greedy rows), or from the distribution the scores give the candidates after the
    row's temperature, top-k and top-p (seeded rows with their noise; the rest by a draw, whose probs are kept)."""
    tokens, _ = walk(lattice)  # (b, k)
    probs: list[torch.Tensor | None] = [None] * len(rows)
    for r, row in enumerate(rows):
        if not row.params.greedy:
            tokens[r], probs[r] = _sample_path(lattice, r, row, vocab_size)
            if row.noise is not None:
                probs[r] = None  # verification matches the target's own draws; no proposal probabilities needed
    chosen = (lattice.candidates == tokens[..., None]).int().argmax(-1)  # (b, k) each token's candidate index
    return Draft(tokens=tokens, probs=probs, confidence_fn=partial(path_confidence, lattice, tokens),
                 branch_fn=partial(branch_along_lattice, lattice, chosen))


def branch_along_lattice(lattice: Lattice, chosen: torch.Tensor, start: torch.Tensor, length: int) -> torch.Tensor:
    """DFlash2: at each row's `start`, the best-scoring candidate after the path's token before it other than the
    path's own, then the best successor after each (the walk from there). chosen (b, k): the path's candidate
    indices -> (b, length); past the k drafted positions the last token repeats."""
    best = lattice.scores.argmax(-1).tolist()  # [b][t][a]
    candidates = lattice.candidates.tolist()  # [b][t][c]
    k = len(best[0])
    branches = []
    for r, (d, path) in enumerate(zip(start.tolist(), chosen.tolist())):
        scores = lattice.scores[r, d, path[d - 1] if d > 0 else 0].clone()  # (K,) after the path's token at d - 1
        scores[path[d]] = float("-inf")
        c = int(scores.argmax())
        tokens = [candidates[r][d][c]]
        for t in range(d + 1, min(d + length, k)):
            c = best[r][t][c]
            tokens.append(candidates[r][t][c])
        branches.append(tokens + tokens[-1:] * (length - len(tokens)))
    return torch.tensor(branches, dtype=torch.long, device=lattice.candidates.device)


def _sample_path(lattice: Lattice, r: int, row, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r's path, one position at a time: tokens (k,) and each position's proposal distribution (k, vocab). Each
    position draws among its K candidates (every other token's score is -inf), so the work is on K numbers, not the
    vocabulary's. The candidates are read in token-id order, as the vocabulary holds them: `to_probs` breaks top-p
    ties by token id, and the noise race takes the lowest id of tied ones."""
    candidates, order = lattice.candidates[r].sort(-1)  # (k, K) in token-id order, and each one's place before
    top = candidates.shape[1]
    predecessors = torch.cat([order[:1], order[:-1]])  # position t's predecessors are position t-1's candidates
    scores = (lattice.scores[r].gather(1, predecessors[:, :, None].expand(-1, -1, top))
              .gather(2, order[:, None, :].expand(-1, top, -1)))  # (k, K, K), both candidate axes in id order
    chosen = []  # each position's candidate (its index in id order)
    probs = []  # each position's distribution over its candidates, (K,)
    previous = 0  # any predecessor row at t = 0 holds the anchor's scores
    for t in range(candidates.shape[0]):
        q = to_probs(scores[t, previous], row.params, proposal=True)  # (K,)
        if row.noise is not None:  # the exponential race on the candidates' own noise (`PositionNoise.choose`)
            noise = row.noise.exponentials(row.next_position + t, vocab_size)[candidates[t]]  # (K,)
            previous = int((q / noise).argmax())
        else:
            previous = int(sample(q[None], row.generator)[0])
        chosen.append(previous)
        probs.append(q)
    index = torch.tensor(chosen, device=candidates.device)  # (k,)
    tokens = candidates.gather(1, index[:, None])[:, 0]  # (k,)
    full = lattice.scores.new_zeros(candidates.shape[0], vocab_size).scatter_(1, candidates, torch.stack(probs))
    return tokens, full  # (k,), (k, vocab)


class NoDraftProposer:
    """Plain autoregressive decoding through the same loop: no draft tokens, one token per forward."""

    kind = "none"
    drafts_in_one_forward = False

    block_size = 1
    feature_layer_ids: list[int] = []

    def new_state(self) -> None:
        return None

    def observe(self, state, context) -> None:
        pass

    def prefill(self, state, tokens) -> None:
        pass

    def propose(self, state, anchors, anchor_positions, rows) -> Draft:
        return Draft(tokens=anchors.new_zeros(anchors.shape[0], 0), probs=[None] * anchors.shape[0])

    def with_block_size(self, block_size: int | None) -> "NoDraftProposer":
        return self

    def select_rows(self, state, rows) -> None:
        pass

    def compact(self, state) -> None:
        pass

    def merge(self, states, batch_sizes) -> None:
        return None


@dataclass
class DFlashState:
    cache: DrafterCache
    pending: PendingContext | None = None


class DFlashProposer:
    """Drafts `block_size - 1` tokens in one drafter forward, conditioned on the target's features.

    The drafter always runs over the block it was trained on (its `block_size`, the draft width): its
    positions attend to each other, so the first draft tokens of a full block of masks are better than those
    of a shorter one (`dflash bench` on the embedded pair, gsm8k, block 8: tau 2.57 drafting 8 positions,
    2.90 drafting 16; `runs/report8` and `runs/report10`, one training round apart, which alone moved block 16
    from 2.87 to 2.95; with the round-12 drafter, `benchmarks/draft_width.py` on 40 gsm8k questions, block 4:
    2.38 drafting 4 positions, 2.80 drafting 16; block 8: 2.66 drafting 8, 3.21 drafting 16), while the whole
    drafter forward and its logits take 5-8 ms of a 19-25 ms step at 8 rows (block 4-8), of which a narrower
    draft saves a part. A smaller `block_size` verifies fewer of the draft tokens; only they get the drafter's
    last-layer queries, MLP and logits (the other positions feed keys and values).
    """

    kind = "DFlash"
    drafts_in_one_forward = True

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, block_size: int | None = None):
        if not isinstance(drafter, DFlashDraftModel) or not isinstance(target, TargetModel):
            raise UserError(f"DFlashProposer takes (drafter, target): a DFlashDraftModel and a TargetModel, not a "
                            f"{type(drafter).__name__} and a {type(target).__name__}")
        check_drafter_fits(target, drafter.config)
        trained = drafter.config.block_size
        if block_size is not None and not 2 <= block_size <= trained:
            raise GenerationError(f"block_size {block_size} is not usable with this drafter: choose 2..{trained} "
                                  "(a drafter works at or below the block size it was trained for)")
        self.drafter = drafter
        self.target = target
        self.block_size = block_size or trained  # tokens per verify forward: the anchor + draft tokens
        self.draft_width = trained  # positions in the drafter's forward
        self.feature_layer_ids = list(drafter.config.target_layer_ids)
        self.mask_token_id = drafter.config.mask_token_id

    def with_block_size(self, block_size: int | None) -> "DFlashProposer":
        if block_size is None or block_size == self.block_size:
            return self
        return DFlashProposer(self.drafter, self.target, block_size)

    def new_state(self) -> DFlashState:
        return DFlashState(cache=DrafterCache(len(self.drafter.layers)))

    def observe(self, state: DFlashState, context: PendingContext) -> None:
        state.pending = context  # injected by the next draft; the engine drafts after every observation

    @torch.inference_mode()
    def prefill(self, state: DFlashState, tokens: list[int]) -> None:
        """Put the prompt's context into the drafter's cache now. Left pending, it would be read in the first
        draft of the batch the row joins, padded to every row: a 1,000-token prompt joining 7 decoding rows
        made that draft read 8,000 context slots (7,000 of them padding) and left as many holes in every row's
        cache (`benchmarks/batch_membership.py`)."""
        p = state.pending
        context = self.drafter.project_context(p.features.to(self.drafter.dtype))  # (1, c, h)
        self.drafter.read_context(context, p.positions, p.valid, state.cache)
        state.pending = PendingContext(p.features[:, :0], p.positions[:, :0], p.valid[:, :0])  # nothing left

    @torch.inference_mode()
    def propose(self, state: DFlashState, anchors, anchor_positions, rows) -> Draft:
        pending = state.pending
        state.pending = None
        b, width = anchors.shape[0], self.draft_width
        offsets = torch.arange(width, device=anchors.device)
        block_tokens = torch.full((b, width), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block_tokens[:, 0] = anchors
        context = self.drafter.project_context(pending.features.to(self.drafter.dtype))
        hidden = self.drafter(
            block_embeds=self.target.embed(block_tokens).to(context.dtype),
            block_positions=anchor_positions[:, None] + offsets,
            context=context,
            context_positions=pending.positions,
            context_valid=pending.valid,
            cache=state.cache,
            outputs=slice(1, self.block_size),  # the draft tokens this block verifies
        )  # (b, k, h)
        # the rows' logit biases, as the target's logits get them: a draft without would be turned down wherever a
        # bias changes the target's choice
        logits = add_logit_bias(self.draft_logits(hidden), rows)  # (b, k, vocab)
        if self.drafter.selector is not None:
            return draft_along_path(self.drafter.selector.lattice(logits, hidden, anchors), rows, logits.shape[-1])
        return draft_per_position(logits, rows)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (b, k, h) -> float32 logits (b, k, vocab): the target's LM head, or the drafter's copy of it."""
        head = self.drafter.draft_head
        if head is None:
            return self.target.lm_head(hidden.to(self.target.dtype)).float()
        return F.linear(hidden.to(head.dtype), head).float()

    def select_rows(self, state: DFlashState, rows: torch.Tensor) -> None:
        state.cache.select_rows(rows.tolist())
        if state.pending is not None:
            p = state.pending
            state.pending = PendingContext(p.features[rows], p.positions[rows], p.valid[rows])

    def compact(self, state: DFlashState) -> None:
        """Squeeze the slots of rejected tokens out of the drafter's context cache."""
        if state.cache.valid is None or bool(state.cache.valid.all()):
            return
        state.cache.compact(*compaction_index(state.cache.valid))

    def merge(self, states: list[DFlashState], batch_sizes: list[int]) -> DFlashState:
        """One state holding the rows of all `states`, slot layouts left-padded to equal width."""
        def pad(tensors, dim):
            return pad_and_concat(tensors, batch_sizes, dim)

        merged = self.new_state()
        caches = [s.cache for s in states]
        width = padded_width([c.valid for c in caches], 1)
        room = spare_room(width)  # the next draft appends without copying these again
        for i in range(len(merged.cache.keys)):
            keys = pad_and_concat([c.keys[i] for c in caches], batch_sizes, 2, room)
            values = pad_and_concat([c.values[i] for c in caches], batch_sizes, 2, room)
            if keys is not None:
                merged.cache.set_layer(i, keys, values, length=width)
        merged.cache.valid = pad([c.valid for c in caches], 1)
        merged.cache.positions = pad([c.positions for c in caches], 1)
        pendings = [s.pending for s in states]
        if any(p is None for p in pendings):
            raise RuntimeError("merge batches only right after a prefill or a step (every row has new context)")
        merged.pending = PendingContext(
            pad([p.features for p in pendings], 1), pad([p.positions for p in pendings], 1),
            pad([p.valid for p in pendings], 1),
        )
        return merged
