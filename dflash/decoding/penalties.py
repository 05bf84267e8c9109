"""Penalties on repeated tokens.

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
from collections import Counter
from dataclasses import dataclass

import torch

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
    """What a row's penalties read: how often the output so far holds each token, and which tokens its prompt holds
    (the repetition penalty's). Only the tokens a row holds are penalized, so the work is theirs, not the
    vocabulary's."""

    def __init__(self, prompt_ids: list[int]):
        self.output: Counter[int] = Counter()
        self.in_prompt = frozenset(prompt_ids)
        self._prompt_index: dict[torch.device, torch.Tensor] = {}  # (distinct prompt tokens,), made once per device

    def prompt_index(self, device: torch.device) -> torch.Tensor:
        """The prompt's distinct tokens as an index on `device`, made once (not at every step)."""
        if device not in self._prompt_index:
            self._prompt_index[device] = torch.tensor(sorted(self.in_prompt), dtype=torch.long, device=device)
        return self._prompt_index[device]

    def add(self, tokens: list[int]) -> None:
        self.output.update(tokens)


def penalize(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
             sees: torch.Tensor | None = None, copy: bool = True) -> torch.Tensor:
    """logits (b, q, vocab) with each row's penalties (`Sequence.penalties`, counting `Sequence.counts`) applied at
    every slot (a new tensor; the same one where no row has penalties). tokens (b, q): a verify forward's tokens, the
    first each row's anchor (already in its output, so not counted again); sees (b, q, q): which of them each slot
    sees (None: those up to its own). Without `tokens`, every slot is penalized as the output so far stands (the
    prefill's). copy=False: the logits are changed in place (a copy of the target's already)."""
    penalized = [r for r, row in enumerate(rows) if getattr(row, "penalties", None) is not None]
    if not penalized:
        return logits
    logits = logits.clone() if copy else logits
    q = logits.shape[1]
    if tokens is not None and sees is None:  # slot i sees tokens 0..i
        sees = torch.ones(q, q, dtype=torch.bool, device=logits.device).tril().expand(tokens.shape[0], q, q)
    for r in penalized:
        drafted = [] if tokens is None else tokens[r, 1:].tolist()
        _penalize_row(logits[r], rows[r].penalties, rows[r].counts, drafted,
                      None if tokens is None else sees[r, :, 1:])
    return logits


def _penalize_row(logits: torch.Tensor, penalties: Penalties, counts: TokenCounts, drafted: list[int],
                  sees: torch.Tensor | None) -> None:
    """One row's logits (q, vocab), penalized in place over the tokens its slots may hold: the prompt's, for the
    repetition penalty (an index made once), then the output's and the draft tokens' (drafted, the q - 1 after the
    anchor; sees (q, q - 1): which each slot sees), counted per slot."""
    r = penalties.repetition
    if r != 1 and counts.in_prompt:  # every slot: a prompt token is repeated whatever the slot sees
        index = counts.prompt_index(logits.device)  # (p,)
        sub = logits[:, index]  # (q, p)
        logits[:, index] = torch.where(sub > 0, sub / r, sub * r)
    ids = sorted(set(counts.output) | set(drafted))
    if not ids:
        return
    column = {token: i for i, token in enumerate(ids)}
    device = logits.device
    index = torch.tensor(ids, device=device)  # (n,)
    times = torch.tensor([float(counts.output[t]) for t in ids], device=device).expand(logits.shape[0], -1)  # (q, n)
    if drafted:  # slot i adds the draft tokens it sees
        seen = torch.zeros(len(drafted), len(ids), device=device)  # (q - 1, n)
        seen[torch.arange(len(drafted)), torch.tensor([column[t] for t in drafted])] = 1.0
        times = times + sees.to(seen.dtype) @ seen
    sub = logits[:, index]  # (q, n)
    if r != 1:  # the repeated tokens the prompt does not hold (those were penalized above)
        in_prompt = torch.tensor([t in counts.in_prompt for t in ids], device=device)  # (n,)
        sub = torch.where((times > 0) & ~in_prompt, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - penalties.frequency * times - penalties.presence * (times > 0).to(sub.dtype)
    logits[:, index] = sub
