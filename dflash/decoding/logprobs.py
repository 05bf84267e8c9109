"""Log-probabilities of the output tokens (`GenerationConfig.logprobs`) and of the prompt's (`prompt_logprobs`),
for callers that ask for them.

Each output token's log-probability is read from the target's logits at the position that chose it: the verify
forward's for accepted draft tokens and the recovered or bonus token, the prefill's for the first token; a prompt
token's from the prefill's logits at the position before it. They are the target's own distribution, before
temperature, top-k, top-p, min-p and logit bias (vLLM's default, its "raw" log-probabilities), so a greedy and a
sampled answer of the same text get the same figures. Drafting changes none of them beyond float rounding: a
token's logits come from the same target forward with more or fewer tokens beside it.
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
    rank: int | None = None  # 1 + the tokens likelier than it (`token_logprobs(ranks=True)`; vLLM's rank)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, rows: int = 512,
                   ranks: bool = False) -> list[TokenLogprob]:
    """The log-probabilities of `tokens`, token i read from logits[i] (n, vocab), and each position's `top` most
    likely tokens (and with `ranks`, each token's rank: 1 + the tokens likelier than it); `rows` positions at a
    time, so that a long prompt's scores take little more memory than its logits."""
    result = []
    for start in range(0, len(tokens), rows):
        chunk = tokens[start : start + rows]
        logprobs = torch.log_softmax(logits[start : start + len(chunk)].float(), dim=-1)  # (rows, vocab)
        ids = torch.tensor(chunk, dtype=torch.long, device=logits.device)[:, None]
        picked = logprobs.gather(1, ids)  # (rows, 1)
        chosen = picked[:, 0].tolist()
        ranked = ((logprobs > picked).sum(-1) + 1).tolist() if ranks else [None] * len(chunk)  # (rows,)
        if top > 0:
            values, best = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # (rows, top)
            alternatives = [tuple(zip(i, v)) for i, v in zip(best.tolist(), values.tolist())]
        else:
            alternatives = [()] * len(chunk)
        result += [TokenLogprob(t, p, a, r) for t, p, a, r in zip(chunk, chosen, alternatives, ranked)]
    return result


def check_top(top: object) -> str | None:
    """What is wrong with a number of alternatives per token (None: nothing)."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        return (f"the number of most likely tokens to list beside each token, 0 to {MAX_TOP_LOGPROBS} (None: no "
                f"log-probabilities), got {top!r}")
    return None
