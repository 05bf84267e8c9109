"""Verification: which draft tokens the target accepts, and the one token it adds.

Definitions used throughout:
- accepted tokens: the longest prefix of the draft tokens the target agrees with (greedy, and seeded
  sampling, where the target's token at each position is fixed by the seed: `sampling.PositionNoise`) or
  keeps under rejection sampling (sampling without a seed);
- recovered token: on the first rejection, the target's own token there (greedy, seeded), or a token drawn
  from normalize(max(p - q, 0)) at that position (rejection sampling);
- bonus token: when every draft token is accepted, a token drawn from the target at the next position;
- acceptance length: accepted + 1, the tokens one verify forward produces.
"""

from __future__ import annotations

import torch

from dflash.decoding.sampling import NAN_LOGITS, SamplingParams, sample, to_probs
from dflash.errors import NoTokenError

NO_TOKEN = -1  # the target's greedy choice where its logits hold a NaN: there is none


def target_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., vocab) -> the target's greedy tokens (...), NO_TOKEN where a row's logits hold a NaN (argmax
    would take the NaN's index for a token, and decoding would go on with garbage)."""
    values, tokens = logits.max(-1)  # argmax's tokens (the first of tied ones), and on CPUs 2-3x faster than argmax
    return tokens.masked_fill(torch.isnan(values), NO_TOKEN)


class RowsFailed(NoTokenError):
    """A step in which some rows got no token (their target logits were NaN): those rows finished with
    finish_reason 'error' (`Sequence.error`: NAN_LOGITS), and the step stands for the others, whose kept tokens
    are `kept` (the failed rows' are empty). The server and `SpeculativeEngine.generate` go on with them."""

    def __init__(self, message: str, kept: list[list[int]]):
        super().__init__(message)
        self.kept = kept


def refuse_no_token(new_tokens: list[list[int]]) -> list[list[int]]:
    """The rows' new tokens, unless a NaN logit left one without a token (`target_argmax`): then a NoTokenError
    that says how to load the model."""
    if any(NO_TOKEN in tokens for tokens in new_tokens):
        raise NoTokenError(NAN_LOGITS)
    return new_tokens


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens (b, k); target_logits (b, k + 1, vocab).

    Returns (num_accepted (b,), target_tokens (b, k + 1)). Row r's new tokens are
    target_tokens[r, : num_accepted[r] + 1]: accepted draft tokens equal the target's argmax, and the
    token after them is the target's argmax there (recovered or bonus); NO_TOKEN where its logits are NaN.
    """
    target_tokens = target_argmax(target_logits)  # (b, k + 1)
    return matching_prefix(draft_tokens, target_tokens), target_tokens


def matching_prefix(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """draft_tokens (b, k), target_tokens (b, k + 1): the target's own tokens at the block's positions ->
    num_accepted (b,), the length of the prefix where both agree."""
    matches = (draft_tokens == target_tokens[:, :-1]).int()  # (b, k)
    return matches.cumprod(dim=1).sum(dim=1)


def rejection_sample(
    draft_tokens: torch.Tensor,  # (k,)
    draft_probs: torch.Tensor,  # (k, vocab), the distribution each draft token was sampled from
    target_probs: torch.Tensor,  # (k + 1, vocab), after the same transform as the drafter
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative rejection sampling for one sequence: its new tokens (accepted + recovered or bonus).

    Draft token i is accepted with probability min(1, p_i(x) / q_i(x)); the output follows p exactly.
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k, device=draft_tokens.device)
    p = target_probs[idx, draft_tokens]
    q = draft_probs[idx, draft_tokens]
    uniforms = torch.rand(k, generator=generator, device=draft_tokens.device)
    accept = uniforms * q < p  # u < p/q without dividing by zero
    num_accepted = int(accept.int().cumprod(0).sum())  # host sync: the step's shape depends on it
    tokens = draft_tokens[:num_accepted].tolist()
    if num_accepted < k:
        residual = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[num_accepted]
    else:
        dist = target_probs[k]
    tokens.append(int(sample(dist[None], generator)))
    return tokens


def sample_target_only(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from the target alone (prefill, or a step without draft tokens). logits (vocab,)."""
    if params.greedy:
        return refuse_no_token([[int(target_argmax(logits))]])[0][0]
    return int(sample(to_probs(logits, params)[None], generator))
