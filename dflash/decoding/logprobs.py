"""Log-probabilities of the output tokens, for callers that ask for them (`GenerationConfig.logprobs`).

Each output token's log-probability is read from the target's logits at the position that chose it: the verify
forward's for accepted draft tokens and the recovered or bonus token, the prefill's for the first token. They are
the target's own distribution, before temperature, top-k and top-p (vLLM's default, its "raw" log-probabilities),
so a greedy and a sampled answer of the same text get the same figures. Drafting changes none of them beyond float
rounding: a token's logits come from the same target forward with more or fewer tokens beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API and vLLM's default allow


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target, and the `k` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of `tokens`, token i read from logits[i] (n, vocab), and each position's `top` most
    likely tokens."""
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # (n, vocab)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()  # (n,)
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (n, top)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(t, p, a) for t, p, a in zip(tokens, chosen, alternatives)]


def check_top(top: object) -> str | None:
    """What is wrong with a number of alternatives per token (None: nothing)."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        return (f"logprobs is the number of most likely tokens to list beside each output token, 0 to "
                f"{MAX_TOP_LOGPROBS} (None: no log-probabilities), got {top!r}")
    return None
