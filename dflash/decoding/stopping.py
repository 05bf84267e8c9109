"""When a sequence stops: stop token ids, stop strings, max_new_tokens, and min_new_tokens (none of the others
before it: vLLM's min_tokens).

min_new_tokens = m holds the stop tokens back from the first m output tokens: the logits each of those tokens is
chosen from give the stop ids (the target's EOS unless ignore_eos, and stop_token_ids) no chance (`hold_stops`), at
every slot of a verify forward whose token would be one of the first m, so drafting stays lossless. A stop string
counts only where the token that completes it comes after the first m: one the first m tokens' text holds (or one
ending there) is text like any other (`stop_search_start`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.decoding.detokenizer import (
    REPLACEMENT,
    StopSearchStart,
    byte_tokens,
    decode,
    first_stop,
    tail_text,
    whole_characters_end,
)
from dflash.errors import GenerationError


@dataclass
class StopDecision:
    keep: int  # how many of the offered new tokens to keep
    reason: str | None  # "stop", "length" or None (go on)


class StopChecker:
    """Decides, for each batch of new tokens, how many to keep and whether the sequence ends."""

    def __init__(self, stop_token_ids: list[int], stop_strings: list[str], max_new_tokens: int, tokenizer=None,
                 min_new_tokens: int = 0):
        if stop_strings and tokenizer is None:
            raise GenerationError("stop strings are found in the decoded text, and this target has no tokenizer to "
                                  "decode it: give it one (TargetModel(model, tokenizer)), or stop at token ids "
                                  "(stop_token_ids)")
        self.stop_token_ids = set(stop_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        # U+FFFD is also what a character cut between two tokens decodes to: a step decoded whole has the character
        # whole, where one token at a time has it cut, so only the tokens one by one stop alike
        self._token_by_token = any(REPLACEMENT in s for s in self.stop_strings)
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.tokenizer = tokenizer
        self._bytes_of = byte_tokens(tokenizer) if self.stop_strings else {}  # read once, not at every token
        self._search_start = StopSearchStart(tokenizer, min_new_tokens, self._bytes_of)

    def check(self, output_ids: list[int], new_tokens: list[int]) -> StopDecision:
        """output_ids: tokens kept so far (before new_tokens). The new tokens are checked one at a time, in order,
        so that a step of several tokens stops where decoding them one at a time would: at the first token that
        is a stop token, completes a stop string, or goes past max_new_tokens."""
        ids = output_ids + new_tokens if self.stop_strings else []
        strings = self._step_may_complete_a_stop_string(ids, len(output_ids))
        for i, token in enumerate(new_tokens):
            if len(output_ids) + i + 1 > self.max_new_tokens:
                return StopDecision(i, "length")
            count = len(output_ids) + i + 1
            if token in self.stop_token_ids or (strings and count > self.min_new_tokens
                                                and self._completes_stop_string(ids, count)):
                return StopDecision(i + 1, "stop")
        keep = len(new_tokens)
        if len(output_ids) + keep >= self.max_new_tokens:
            return StopDecision(keep, "length")
        return StopDecision(keep, None)

    def _step_may_complete_a_stop_string(self, ids: list[int], since: int) -> bool:
        """Whether the text of the step's new tokens ids[since:], with the characters before it that a stop string
        could start in, holds one: one decode per step; the tokens are checked one by one only then."""
        if not self.stop_strings:
            return False
        if self._token_by_token:
            return True
        end = whole_characters_end(ids, self._bytes_of)  # a stop string is completed at a character's end
        text, _ = tail_text(self.tokenizer, ids, end, self._longest_stop, since=min(since, end),
                            bytes_of=self._bytes_of)
        return any(s in text for s in self.stop_strings)

    def _completes_stop_string(self, ids: list[int], end: int) -> bool:
        """Whether the output ids[:end] holds a stop string. This runs for every new token of every step, and the
        output before held none, so a stop string it holds ends in its last characters: only those are decoded
        (`tail_text`), and the whole output only to confirm a hit."""
        if not self.stop_strings:
            return False
        tail, whole = tail_text(self.tokenizer, ids, end, self._longest_stop, bytes_of=self._bytes_of)
        if not any(s in tail for s in self.stop_strings):
            return False
        return (whole and not self.min_new_tokens) or self.find_stop(ids[:end]) is not None

    def find_stop(self, output_ids: list[int]) -> int | None:
        """Character index where the first stop string that counts starts in the decoded output, if any."""
        text = decode(self.tokenizer, output_ids, self._bytes_of)
        first = first_stop(text, self.stop_strings, self.stop_search_start(output_ids))
        return None if first is None else first[0]

    def stop_search_start(self, output_ids: list[int]) -> int:
        """The characters a stop string must end past to count (`StopSearchStart`)."""
        return self._search_start(output_ids, lambda: len(decode(self.tokenizer, output_ids, self._bytes_of)))

    def ending(self, output_ids: list[int]) -> tuple[str, str | None]:
        """(The final text: the decoded output with a stop string and anything after it removed; the stop string it
        was cut at or None), from one decode of the output. The stop token that ended it adds no text (as in vLLM,
        where include_stop_str_in_output is off by default)."""
        if output_ids and output_ids[-1] in self.stop_token_ids:
            output_ids = output_ids[:-1]
        text = decode(self.tokenizer, output_ids)
        first = first_stop(text, self.stop_strings, self.stop_search_start(output_ids)) if self.stop_strings else None
        return (text, None) if first is None else (text[:first[0]], first[1])


def hold_stops(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
               sees: torch.Tensor | None = None, copy: bool = True) -> torch.Tensor:
    """logits (b, q, vocab) with each row's stop ids (`Sequence.held_stops`, (k,) or None) at -inf in every slot
    whose token would be one of the row's first min_new_tokens (a new tensor; the same one where no slot is held).
    tokens (b, q): a verify forward's, the first each row's anchor; slot i's token comes after the output so far and
    the draft tokens it sees (sees (b, q, q); None: the i before it). Without `tokens`, every slot is taken as the
    output so far stands (the prefill's). copy=False: the logits are changed in place."""
    held = [(r, row) for r, row in enumerate(rows)
            if getattr(row, "held_stops", None) is not None and len(row.output_ids) < row.config.min_new_tokens]
    if not held:
        return logits
    logits = logits.clone() if copy else logits
    q = logits.shape[1]
    for r, row in held:
        left = row.config.min_new_tokens - len(row.output_ids)  # the output tokens still held
        if tokens is None:
            slots = torch.arange(q, device=logits.device)
        elif sees is None:  # slot i's token is the output's (len + i + 1)-th: no wait on the device
            slots = torch.arange(min(q, left), device=logits.device)
        else:  # a branch's slots see fewer tokens than their place in the block
            slots = (sees[r, :, 1:].sum(-1) < left).nonzero()[:, 0]  # (held slots,)
        logits[r, slots[:, None], row.held_stops[None, :]] = float("-inf")  # (held slots, k)
    return logits
