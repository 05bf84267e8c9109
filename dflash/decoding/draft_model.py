"""Classic speculative decoding behind the same proposer interface: a small causal LM drafts one token at a time.

A draft model (any Hugging Face causal LM with the target's tokenizer, e.g. Qwen3-0.6B for Qwen3-8B) proposes
`block_size - 1` draft tokens autoregressively from the anchor; the target verifies them in one forward, as it
does DFlash's, so the output is the target's own (greedy, seeded or rejection-sampled). It is the baseline
DFlash is measured against: k dependent draft forwards where DFlash drafts a block in one.

Each row keeps its own draft cache: the row's tokens it has confirmed (read and since accepted, up to the last
anchor), then the draft tokens it read after them. Before drafting, the row keeps the draft tokens the target
accepted, drops the rest (a crop) and reads the tokens it has not seen (the bonus token, and the last draft token
if it was accepted): a few tokens per step, whatever the length. Rows draft one after another: a batch costs
rows x k small forwards, which suits a benchmark or a single stream, not batched serving of many requests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from dflash.decoding.proposer import Draft, PendingContext
from dflash.decoding.sampling import sample, to_probs
from dflash.errors import UserError
from dflash.model import hf_compat
from dflash.model.target import IncompatibleDrafterError, TargetModel

DEFAULT_BLOCK_SIZE = 5  # 4 draft tokens: the usual setting for a draft model
MAX_BLOCK_SIZE = 32


@dataclass
class DraftRow:
    """One row's draft cache: `confirmed` tokens of the row's own, then the `drafted` tokens read after them."""

    cache: object
    confirmed: int = 0
    drafted: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.confirmed + len(self.drafted)


class DraftModelProposer:
    """Drafts `block_size - 1` tokens with a small causal LM, one forward per draft token after the first."""

    feature_layer_ids: list[int] = []  # the draft model reads tokens, not the target's features

    def __init__(self, draft: TargetModel, target: TargetModel, block_size: int | None = None):
        check_draft_model(draft, target)
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        check_block_size(block_size)
        self.draft = draft
        self.target = target
        self.block_size = block_size
        self.vocab_size = target.vocab_size

    def with_block_size(self, block_size: int | None) -> "DraftModelProposer":
        if block_size is None or block_size == self.block_size:
            return self
        check_block_size(block_size)
        other = copy.copy(self)  # the pair was checked once (a tokenizer comparison reads every token)
        other.block_size = block_size
        return other

    def new_state(self) -> list[DraftRow]:
        return [DraftRow(self.draft.new_cache())]  # the engine starts every batch with one row (prefill or rejoin)

    def observe(self, state: list[DraftRow], context: PendingContext) -> None:
        pass  # the rows' own tokens tell each draft cache what to read

    @torch.inference_mode()
    def propose(self, state: list[DraftRow], anchors, anchor_positions, rows) -> Draft:
        k = self.block_size - 1
        tokens = anchors.new_zeros(len(rows), k)  # (b, k)
        probs: list[torch.Tensor | None] = [None] * len(rows)
        for r, (row, seq) in enumerate(zip(state, rows)):
            tokens[r], probs[r] = self._draft_row(row, seq, k)
        return Draft(tokens=tokens, probs=probs)

    def _draft_row(self, row: DraftRow, seq, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens after the row's anchor (its last token), and their proposal distributions (k, vocab)
        for rows that sample without a seed (None otherwise)."""
        logits = self._catch_up(row, seq)  # (vocab,) after the anchor
        drafted, dists = [], []
        for t in range(k):
            token, dist = self._choose(logits, seq, seq.next_position + t)
            drafted.append(token)
            dists.append(dist)
            if t < k - 1:  # the last draft token is read at the next step, if the target accepts it
                logits = self._read(row, [token])
                row.drafted.append(token)
        probs = torch.stack(dists) if dists[0] is not None else None
        return torch.tensor(drafted, device=self.target.device), probs

    def _catch_up(self, row: DraftRow, seq) -> torch.Tensor:
        """Keep the draft tokens the target accepted, drop the others, read the row's tokens since; the logits
        after its anchor."""
        new = unseen_tokens(seq, row.confirmed)  # accepted draft tokens, then the bonus token: the new anchor
        kept = 0
        while kept < min(len(row.drafted), len(new) - 1) and row.drafted[kept] == new[kept]:
            kept += 1
        row.confirmed += kept
        row.drafted.clear()
        hf_compat.crop_cache(row.cache, row.confirmed)
        logits = self._read(row, new[kept:])
        row.confirmed += len(new) - kept
        return logits

    def _read(self, row: DraftRow, new: list[int]) -> torch.Tensor:
        """The draft model reads `new` after the row's cached tokens; returns its logits for the next one
        (vocab,), over the target's vocabulary. The caller records `new` as confirmed or drafted."""
        device = self.draft.device
        start = row.length
        ids = torch.tensor([new], device=device)  # (1, n)
        positions = torch.arange(start, start + len(new), device=device)[None]
        out = self.draft.forward(ids, positions, row.cache, logits_to_keep=1)
        return fit_vocabulary(out.logits[0, -1].to(self.target.device), self.vocab_size)

    def _choose(self, logits: torch.Tensor, seq, position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at `position`: the argmax (greedy rows), the row's noise on the draft distribution
        (seeded rows: verification compares with the target's own draw), or a draw whose distribution is kept."""
        if seq.params.greedy:  # a host sync per draft token: the next draft forward takes it as input anyway
            return int(logits.argmax()), None
        dist = to_probs(logits[None], seq.params)  # (1, vocab)
        if seq.noise is not None:
            return int(seq.noise.choose(dist, position)[0]), None
        return int(sample(dist, seq.generator)[0]), dist[0]

    def select_rows(self, state: list[DraftRow], rows: torch.Tensor) -> None:
        state[:] = [state[i] for i in rows.tolist()]

    def compact(self, state: list[DraftRow]) -> None:
        pass  # each row's cache holds only its own tokens: no holes to squeeze out

    def merge(self, states: list[list[DraftRow]], batch_sizes: list[int]) -> list[DraftRow]:
        return [row for state in states for row in state]


def check_block_size(block_size: int) -> None:
    if not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise UserError(f"block size {block_size} is not usable with a draft model: choose 2..{MAX_BLOCK_SIZE} "
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
