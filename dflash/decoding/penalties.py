"""Penalties on repeated tokens, and the logits a token is chosen from.

    repetition (r > 0, 1 = off):  a token the prompt or the output so far holds has its logit divided by r where
                                  it is positive, multiplied by r where it is not (CTRL's, as transformers and vLLM
                                  apply it);
    frequency (-2..2, 0 = off):   subtracted from a token's logit once for each time the output so far holds it;
    presence (-2..2, 0 = off):    subtracted once from the logit of each token the output so far holds;

in this order, after the logit bias and before the temperature, min-p, top-k and top-p, as vLLM applies them. They
depend on the tokens before the one being chosen, which in a verify forward differ from slot to slot: the logits at a
slot choose the token after the tokens that slot sees, so its penalties count the output so far (the anchor
included) and the draft tokens the slot sees: the block's before it, and for a branch's slot the block's before
the branch's start and the branch's before it (`branch.block_visibility`). Every token is then chosen from the
logits the target alone would choose it from after the same tokens, so drafting stays lossless.

The drafters draft as without penalties (the logit bias aside). Penalizing drafts the same way was measured to
accept fewer of them (`benchmarks/penalties.py`, 2026-12-07d: repetition_penalty 1.1, tau 5.42 penalized against
5.69 not; 4.73 against 4.86 at presence_penalty 1.5), likely because a drafter is less sure than the target, so a
penalty flips its choice where it leaves the target's alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.decoding.sampling import add_logit_bias

MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: -2 to 2


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= MAX_PENALTY):
                raise ValueError(f"{name}_penalty must be a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g} "
                                 f"(0 = off), got {value}")
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off; above 1 discourages "
                             f"repeating a token), got {self.repetition}")

    @property
    def active(self) -> bool:
        return self != Penalties()


class TokenCounts:
    """What a row's penalties read: how often the output so far holds each token, and which tokens its prompt
    holds (the repetition penalty's)."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device | str = "cpu"):
        self.output = torch.zeros(vocab_size, device=device)  # (vocab,)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # (vocab,)
        self.in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def add(self, tokens: list[int]) -> None:
        if tokens:
            ids = torch.tensor(tokens, device=self.output.device)
            self.output.index_add_(0, ids, torch.ones_like(ids, dtype=self.output.dtype))


def choice_logits(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
                  sees: torch.Tensor | None = None) -> torch.Tensor:
    """What each row's tokens are chosen from: logits (b, q, vocab) with the row's logit bias and penalties (the
    same tensor where no row has either).

    tokens (b, q): a verify forward's tokens, the first each row's anchor (already in its output, so not counted
    again); sees (b, q, q): which of them each slot sees (None: those up to its own). Without `tokens`, every slot
    is penalized as the output so far stands (the prefill's)."""
    return penalize(add_logit_bias(logits, rows), rows, tokens, sees)


def penalize(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
             sees: torch.Tensor | None = None) -> torch.Tensor:
    """logits (b, q, vocab) with each row's penalties (`Sequence.penalties`, counting `Sequence.counts`) applied at
    every slot; see `choice_logits`."""
    if all(getattr(row, "penalties", None) is None for row in rows):
        return logits
    counts, in_prompt = _slot_counts(logits, rows, tokens, sees)  # (b, q, vocab) float, (b, 1, vocab) bool
    settings = [getattr(row, "penalties", None) or Penalties() for row in rows]
    repetition, frequency, presence = (logits.new_tensor([getattr(s, name) for s in settings])[:, None, None]
                                       for name in ("repetition", "frequency", "presence"))  # (b, 1, 1) each
    held = counts > 0
    repeated = held | in_prompt
    logits = torch.where(repeated, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * held.to(logits.dtype)


def _slot_counts(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None,
                 sees: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each slot's history holds each token (b, q, vocab): the row's output so far and the tokens past
    the anchor that the slot sees; and which tokens each row's prompt holds (b, 1, vocab)."""
    b, q, vocab = logits.shape
    zeros = logits.new_zeros(vocab)
    no_prompt = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
    held = [getattr(row, "counts", None) for row in rows]
    output = torch.stack([zeros if c is None else c.output.to(logits) for c in held])  # (b, vocab)
    in_prompt = torch.stack([no_prompt if c is None else c.in_prompt for c in held])[:, None]  # (b, 1, vocab)
    counts = output[:, None, :].expand(b, q, vocab)
    if tokens is None or q == 1:
        return counts, in_prompt
    if sees is None:  # slot i sees tokens 0..i
        sees = torch.ones(q, q, dtype=torch.bool, device=logits.device).tril().expand(b, q, q)
    after_anchor = tokens[:, None, 1:].expand(b, q, q - 1)  # (b, q, q - 1)
    counts = counts.clone().scatter_add_(2, after_anchor, sees[:, :, 1:].to(logits.dtype))
    return counts, in_prompt
