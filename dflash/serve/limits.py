"""Limits on what a request may ask: how long a sequence may grow (the one rule `dflash serve` and its hand-off
apply to `--max-model-len`) and how large a request body may be.

A request's prompt + max_tokens must fit `--max-model-len` (default: the target's context, `max_position_embeddings`,
or less where DFlash decodes within less: `TargetModel.context_length`), as in vLLM. The steps near the end of the
context verify shorter blocks, so a sequence may fill it exactly.
"""

from __future__ import annotations

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

