"""The logits a token is chosen from: the target's, with each row's logit bias, penalties, held-back stops and
grammar."""

from __future__ import annotations

import torch

from dflash.decoding.penalties import penalize
from dflash.decoding.sampling import add_logit_bias
from dflash.decoding.stopping import hold_stops
from dflash.decoding.structure import constrain


def choice_logits(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
                  sees: torch.Tensor | None = None) -> torch.Tensor:
    """What each row's tokens are chosen from: logits (b, q, vocab) with the row's logit bias, penalties
    (`penalties`), stop ids held back before min_new_tokens (`stopping`) and grammar (`structure`); the same tensor
    where no row has any.

    tokens (b, q): a verify forward's tokens, the first each row's anchor; sees (b, q, q): which of them each slot
    sees (None: those up to its own; a row with a grammar takes no branch). Without `tokens`, every slot is taken
    as the output so far stands (the prefill's)."""
    chosen = add_logit_bias(logits, rows)  # a new tensor where a row has a bias; then the others change it in place,
    chosen = penalize(chosen, rows, tokens, sees, copy=chosen is logits)  # copying the target's logits once at most
    chosen = hold_stops(chosen, rows, tokens, sees, copy=chosen is logits)  # (log-probabilities read them unchanged)
    return constrain(chosen, rows, tokens, copy=chosen is logits)
