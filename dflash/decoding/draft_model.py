"""Classic speculative decoding behind the same proposer interface: a small causal LM drafts one token at a time.

A draft model (any Hugging Face causal LM with the target's tokenizer, e.g. Qwen3-0.6B for Qwen3-8B) proposes
`block_size - 1` draft tokens autoregressively from the anchor; the target verifies them in one forward, as it
does DFlash's, so the output is the target's own (greedy, seeded or rejection-sampled). It is the baseline
DFlash is measured against: k dependent draft forwards where DFlash drafts a block in one.

The rows of a batch share one draft cache, in the engine's slot layout (`dflash.decoding.slots`): a row holds its
confirmed tokens (read and since accepted, up to the last anchor), then the draft tokens it read after them.
Before drafting, each row keeps the draft tokens the target accepted, hides the slots of the rest, and reads the
tokens it has not seen (the bonus token, and the last draft token if it was accepted): a few tokens per step,
whatever the length, all rows in one forward (left-padded with hidden slots). Then every row drafts in the same
k - 1 forwards of one token each: a batch costs k forwards, whatever its rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from dflash.decoding.proposer import Draft, PendingContext
from dflash.decoding.sampling import add_logit_bias, sample, to_probs
from dflash.decoding.slots import compact_cache, merge_caches, pad_and_concat, select_cache_rows, worth_compacting
from dflash.errors import GenerationError
from dflash.model.target import IncompatibleDrafterError, TargetModel

DEFAULT_BLOCK_SIZE = 5  # 4 draft tokens: the usual setting for a draft model
MAX_BLOCK_SIZE = 32


@dataclass
class DraftRow:
    """One row's place in the draft cache: its `confirmed` tokens (its own, read and since accepted, up to the last
    anchor), then the `drafted` tokens it read after them, in its last valid slots."""

    confirmed: int = 0
    drafted: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.confirmed + len(self.drafted)


@dataclass
class DraftBatch:
    """The draft model's cache for every row of a batch, in one slot layout (`dflash.decoding.slots`)."""

    cache: object
    rows: list[DraftRow]
    valid: torch.Tensor | None = None  # (b, slots) bool; None before the first read (the cache is empty)


class DraftModelProposer:
    """Drafts `block_size - 1` tokens with a small causal LM, one forward per draft token after the first, every
    row of a batch in the same forwards."""

    kind = "draft model"
    drafts_in_one_forward = False  # one forward per draft token: the block size is chosen before drafting

    feature_layer_ids: list[int] = []  # the draft model reads tokens, not the target's features

    def __init__(self, draft: TargetModel, target: TargetModel, block_size: int | None = None):
        check_draft_model(draft, target)
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        check_block_size(block_size)
        self.draft = draft
        self.target = target
        self.block_size = block_size
        self.vocab_size = target.vocab_size
        # ids it can read: a draft model's embedding may have fewer rows than the target's (Qwen2.5-0.5B's 151,936
        # against Qwen2.5-7B's 152,064, one tokenizer); the target's padding rows are never text
        self.readable = draft.model.get_input_embeddings().weight.shape[0]

    def with_block_size(self, block_size: int | None) -> "DraftModelProposer":
        if block_size is None or block_size == self.block_size:
            return self
        check_block_size(block_size)
        other = copy.copy(self)  # the pair was checked once (a tokenizer comparison reads every token)
        other.block_size = block_size
        return other

    def new_state(self) -> DraftBatch:
        return DraftBatch(self.draft.new_cache(), [DraftRow()])  # the engine starts every batch with one row

    def observe(self, state: DraftBatch, context: PendingContext) -> None:
        pass  # the rows' own tokens tell the draft cache what to read

    @torch.inference_mode()
    def prefill(self, state: DraftBatch, tokens: list[int]) -> None:
        """The draft model reads the prompt now, for this row alone: in the first draft of the batch the row
        joins, it would be read padded to every row's width. The anchor (the prefill's token) is read then."""
        state.rows[0].confirmed += len(tokens)
        self._read(state, [tokens])

    @torch.inference_mode()
    def propose(self, state: DraftBatch, anchors, anchor_positions, rows) -> Draft:
        """k draft tokens after each row's anchor (its last token), and their proposal distributions (k, vocab)
        for rows that sample without a seed."""
        k = self.block_size - 1
        logits = self._read(state, self._catch_up(state, rows))  # (b, vocab) after each anchor
        tokens: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        for t in range(k):
            chosen = self._choose(logits, rows, t)
            for r, (token, dist) in enumerate(chosen):
                tokens[r].append(token)
                if dist is not None:
                    dists[r].append(dist)
            if t < k - 1:  # the last draft token is read at the next step, if the target accepts it
                for row, (token, _) in zip(state.rows, chosen):
                    row.drafted.append(token)
                logits = self._read(state, [[token] for token, _ in chosen])
        if state.valid is not None and worth_compacting(state.valid):  # padding and rejected drafts pile up
            self.compact(state)
        probs = [torch.stack(d) if d else None for d in dists]
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=anchors.device).view(len(rows), k),
                     probs=probs, forwards=k)  # the catch-up read and one per draft token after the first

    def _catch_up(self, state: DraftBatch, rows) -> list[list[int]]:
        """Keep each row's draft tokens the target accepted and hide the slots of the others; the tokens each row
        has yet to read (the bonus token, the new anchor, at least)."""
        reads, dropped = [], []
        for row, seq in zip(state.rows, rows):
            new = unseen_tokens(seq, row.confirmed)  # accepted draft tokens, then the bonus token: the new anchor
            kept = 0
            while kept < min(len(row.drafted), len(new) - 1) and row.drafted[kept] == new[kept]:
                kept += 1
            dropped.append(len(row.drafted) - kept)
            row.confirmed += kept
            row.drafted.clear()
            reads.append(new[kept:])
        if any(dropped):
            state.valid = drop_last_valid(state.valid, dropped)
        for row, read in zip(state.rows, reads):
            row.confirmed += len(read)  # `_read` reads them next
        return reads

    def _read(self, state: DraftBatch, reads: list[list[int]]) -> torch.Tensor:
        """Every row reads its tokens after its cached ones, in one forward: rows with fewer are left-padded with
        hidden slots, so each row's last token sits in the last column. Returns the draft model's logits for
        each row's next token, (b, vocab), over the target's vocabulary. The caller has counted the reads in each
        row's length already."""
        device = self.draft.device
        width = max(len(read) for read in reads)
        ids = torch.zeros(len(reads), width, dtype=torch.long)  # (b, n)
        positions = torch.zeros(len(reads), width, dtype=torch.long)
        new_valid = torch.zeros(len(reads), width, dtype=torch.bool)
        for r, (row, read) in enumerate(zip(state.rows, reads)):
            start = row.length - len(read)  # the row's length already counts what it reads now
            ids[r, width - len(read):] = torch.tensor(read)
            positions[r] = start  # the padding's, never seen
            positions[r, width - len(read):] = torch.arange(start, start + len(read))
            new_valid[r, width - len(read):] = True
        if self.readable < self.vocab_size:  # an id past its embedding (a target's padding row) reads as id 0: it
            ids[ids >= self.readable] = 0  # only changes what the draft model proposes after it
        ids, positions, new_valid = ids.to(device), positions.to(device), new_valid.to(device)
        valid = new_valid if state.valid is None else torch.cat([state.valid, new_valid], dim=1)
        mask = None if bool(valid.all()) else valid.long()
        out = self.draft.forward(ids, positions, state.cache, attention_mask=mask, logits_to_keep=1)
        state.valid = valid
        return fit_vocabulary(out.logits[:, -1].to(self.target.device), self.vocab_size)

    def _choose(self, logits: torch.Tensor, rows, t: int) -> list[tuple[int, torch.Tensor | None]]:
        """Each row's draft token at its t-th draft position: the argmax (greedy rows), the row's noise on the
        draft distribution (seeded rows: verification compares with the target's own draw), or a draw whose
        distribution is kept."""
        logits = add_logit_bias(logits[:, None], rows)[:, 0]  # (b, vocab), as the target chooses
        greedy = logits.argmax(-1).tolist() if any(seq.params.greedy for seq in rows) else []  # one host sync
        chosen = []
        for r, seq in enumerate(rows):
            if seq.params.greedy:
                chosen.append((greedy[r], None))
                continue
            dist = to_probs(logits[r : r + 1], seq.params, proposal=True)  # (1, vocab)
            if seq.noise is not None:
                chosen.append((int(seq.noise.choose(dist, seq.next_position + t)[0]), None))
            else:
                chosen.append((int(sample(dist, seq.generator)[0]), dist[0]))
        return chosen

    def select_rows(self, state: DraftBatch, rows: torch.Tensor) -> None:
        state.rows = [state.rows[i] for i in rows.tolist()]
        if state.valid is not None:
            select_cache_rows(state.cache, rows)
            state.valid = state.valid[rows]

    def compact(self, state: DraftBatch) -> None:
        if state.valid is not None and not bool(state.valid.all()):
            state.valid = compact_cache(state.cache, state.valid)

    def merge(self, states: list[DraftBatch], batch_sizes: list[int]) -> DraftBatch:
        """One state with the rows of all `states`, slot layouts left-padded to equal width (a row that has read
        nothing yet gets only hidden slots)."""
        rows = [row for s in states for row in s.rows]
        if all(s.valid is None for s in states):
            return DraftBatch(states[0].cache, rows)
        cache = merge_caches([None if s.valid is None else s.cache for s in states], batch_sizes)
        return DraftBatch(cache, rows, pad_and_concat([s.valid for s in states], batch_sizes, 1).bool())


def drop_last_valid(valid: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """valid (b, slots) with each row's last `counts[r]` valid slots hidden."""
    from_end = valid.flip(1).cumsum(1).flip(1)  # (b, slots): valid slots at or after each slot
    return valid & (from_end > torch.tensor(counts, device=valid.device)[:, None])


def check_block_size(block_size: int) -> None:
    if not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise GenerationError(f"block_size {block_size} is not usable with a draft model: choose 2..{MAX_BLOCK_SIZE} "
                              "(the anchor + the draft tokens verified per step)")


def unseen_tokens(seq, start: int) -> list[int]:
    """The sequence's tokens (prompt, then output) from position `start` on, without copying the ones before."""
    prompt = len(seq.prompt_ids)
    return seq.prompt_ids[start:] + seq.output_ids[max(start - prompt, 0):]


def fit_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits (..., draft vocab) -> (..., vocab_size): rows a smaller draft vocabulary lacks get -inf (a model's
    embedding is often padded past its tokenizer), and ids past the target's are dropped."""
    extra = vocab_size - logits.shape[-1]
    if extra > 0:
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], extra), float("-inf"))], dim=-1)
    return logits[..., :vocab_size]


def check_draft_model(draft: TargetModel, target: TargetModel) -> None:
    """Refuse a draft model that does not speak the target's tokens, or whose context is shorter."""
    draft.check_decodable()
    problems = []
    if draft.tokenizer is not None and target.tokenizer is not None:
        mismatch = tokenizer_mismatch(draft.tokenizer, target.tokenizer)
        if mismatch:
            problems.append(mismatch)
    ours, theirs = (getattr(m.config, "max_position_embeddings", None) for m in (draft, target))
    if ours is not None and theirs is not None and ours < theirs:
        problems.append(f"its context is {ours} tokens, the target's {theirs}")
    if problems:
        raise IncompatibleDrafterError(
            "this draft model cannot draft for this target: " + "; ".join(problems)
            + ". Use a smaller model of the target's family (the same tokenizer), or a DFlash drafter."
        )


def tokenizer_mismatch(draft_tokenizer, target_tokenizer) -> str | None:
    """None when both tokenizers give every token the same id; else the first difference, in words."""
    ours, theirs = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    for token, index in theirs.items():
        if ours.get(token, index) != index:
            return f"its tokenizer gives {token!r} the id {ours[token]}, the target's {index}"
    missing = len(theirs) - sum(token in ours for token in theirs)
    if missing:
        return f"its tokenizer lacks {missing} of the target's {len(theirs)} tokens"
    return None
