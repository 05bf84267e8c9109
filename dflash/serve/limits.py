"""Limits on what a request may ask: how long a sequence may grow (the one rule `dflash serve` and its hand-off
apply to `--max-model-len`) and how large a request body may be.

A request's prompt + max_tokens must fit the usable context: `--max-model-len` (default: the target's context,
`max_position_embeddings`), but never closer to the target's context than one block. A decode step writes the
anchor and its draft tokens, `block_size` positions from the row's last token on (1 without a drafter), and
the engine keeps every position it writes within the target's context.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.errors import UserError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # --max-request-bytes: ~1M tokens of text, past any context we serve


def check_max_model_len(max_model_len: int | None, target_context: int | None,
                        why: str = " (max_position_embeddings in its config.json)") -> int:
    """The context to serve: `--max-model-len`, which may not exceed the target's; by default the target's. `why`
    says where the target's context comes from (`TargetModel.context_note` when DFlash decodes within less)."""
    if max_model_len and target_context and max_model_len > target_context:
        raise UserError(f"--max-model-len {max_model_len} exceeds the target's context of {target_context} tokens"
                        f"{why}; use at most {target_context}")
    limit = max_model_len or target_context
    if limit is None:
        raise UserError("the target's config.json has no max_position_embeddings; give --max-model-len")
    return limit


@dataclass(frozen=True)
class ContextLimit:
    configured: int  # --max-model-len, or the target's context
    target_context: int | None  # the target's max_position_embeddings
    engine_room: int | None  # the most prompt + new tokens the engine decodes (`SpeculativeEngine.room(0)`)

    @property
    def usable(self) -> int:
        """The most tokens prompt + max_tokens may add up to."""
        if self.engine_room is None:
            return self.configured
        return max(min(self.configured, self.engine_room), 0)

    def describe(self) -> str:
        """'the context of N tokens', saying why when a decode step's room makes it less than configured."""
        if self.usable == self.configured:
            return f"the context of {self.usable} tokens"
        kept = self.target_context - self.engine_room
        positions = f"{kept} position{'s' if kept != 1 else ''}"
        return (f"the usable context of {self.usable} tokens (the target's {self.target_context}, less the "
                f"{positions} a decode step writes past a sequence's last token)")
