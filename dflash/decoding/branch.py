"""A branch: a second path through the draft, verified in the same target forward as the block.

A drafted block is usually right up to some position and wrong from there. Where the drafter expects its first
miss, at draft position d, a branch offers its next-best token instead, and continues from it for `length`
tokens. The target forward takes the block and the branch together, with a tree-shaped attention mask inside
them: the branch sees the anchor and the draft tokens before d, never the block's own tokens from d on.

    block:   anchor  x1 x2 x3 x4 ... x(k-1)         draft tokens, verified as usual
    branch:                 y3 y4 ...                 starts at d = 2 (the place of x3), `length` tokens

If the block is accepted up to d exactly (x3 missed) and the target's token there is y3, the branch is
verified on: its accepted tokens, then the target's token after them, are the step's new tokens. Either way
every new token is the target's own choice given the ones before it, so the output is unchanged; only greedy
(and seeded) rows take branches, whose target tokens do not depend on which drafts were offered.

Measured on the embedded pair and a 2-core CPU (`benchmarks/branches.py`, 24 GSM8K test questions, one row):
a branch of 3 tokens raised the acceptance length at block 16 from 4.70 to 5.18 (5 tokens: 5.21, 8: 5.26), but
not the speed (0.99x, 0.96x, 0.95x): there a forward of 16 tokens is the cheapest past 8 (its matrix products
fill the CPU's vector width) and each token past 16 costs ~0.5 ms of a ~15 ms step. Where a forward of 20 tokens
costs what one of 16 does (a GPU), the acceptance length is the speedup. Within 16 tokens here, block 13 with a
branch of 3 against block 16: tau 5.07 against 4.72 and 1.03x the speed. Off by default (`branch_length` 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Branch:
    start: torch.Tensor  # (b,) the draft position it replaces (0 = the first draft token)
    tokens: torch.Tensor  # (b, length)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def most_likely_first_miss(confidence: torch.Tensor, limit: int) -> torch.Tensor:
    """confidence (b, k): the drafter's probability that each draft token is right given the ones before it ->
    (b,) the position d < limit where the first miss is likeliest: argmax_d (prod_{i<d} c_i) (1 - c_d)."""
    c = confidence[:, :limit].float()  # (b, limit)
    reach = torch.cat([torch.ones_like(c[:, :1]), c[:, :-1].cumprod(1)], dim=1)  # P(the tokens before d are right)
    return (reach * (1 - c)).argmax(1)


def block_visibility(block_size: int, branch_start: torch.Tensor, length: int) -> torch.Tensor:
    """(b, q, q) bool, q = block_size + length: which of the forward's tokens each one sees. The block is causal;
    branch token j sees the anchor, the draft tokens before its start d (block slots 0..d) and branch tokens
    0..j."""
    b, q = branch_start.shape[0], block_size + length
    device = branch_start.device
    slot = torch.arange(q, device=device)
    causal = slot[None, :] <= slot[:, None]  # (q, q)
    seen = causal[None].repeat(b, 1, 1)  # (b, q, q)
    in_branch = slot >= block_size  # (q,)
    block_cut = slot[None, :] <= branch_start[:, None]  # (b, q): block slots the branch sees
    seen[:, in_branch, :block_size] = block_cut[:, None, :block_size].expand(-1, length, -1)
    return seen


def accept_branch(num_accepted: torch.Tensor, target_tokens: torch.Tensor, branch: Branch,
                  block_size: int) -> tuple[list[list[int]], torch.Tensor]:
    """Verification of a block and its branch from the target's own tokens (greedy, or a seed's draws).

    num_accepted (b,): the block's accepted draft tokens; target_tokens (b, q): the target's token after each of the
    forward's q = block_size + length tokens. Returns each row's new tokens and kept (b, q) bool: the slots whose
    keys and values stay in the cache (the anchor and the accepted tokens, of the block or of the branch).
    """
    b, q = target_tokens.shape
    slot = torch.arange(q, device=target_tokens.device)
    start = branch.start
    on_branch = (num_accepted == start) & (branch.tokens[:, 0] == target_tokens.gather(1, start[:, None])[:, 0])
    after = target_tokens[:, block_size:]  # (b, length): the target's token after each branch token
    matches = (branch.tokens[:, 1:] == after[:, :-1]).int().cumprod(1).sum(1)  # (b,) accepted after the first
    branch_accepted = 1 + matches  # (b,)
    kept_block = slot[None, :block_size] <= torch.where(on_branch, start, num_accepted)[:, None]
    kept_branch = (slot[None, block_size:] - block_size < branch_accepted[:, None]) & on_branch[:, None]
    kept = torch.cat([kept_block, kept_branch], dim=1)  # (b, q)
    rows = zip(target_tokens.tolist(), branch.tokens.tolist(), num_accepted.tolist(), start.tolist(),
               on_branch.tolist(), branch_accepted.tolist())
    new_tokens = []
    for targets, branch_tokens, n, d, took_branch, m in rows:
        if took_branch:  # the block's tokens before d, the branch's accepted ones, the target's token after them
            new_tokens.append(targets[:d] + branch_tokens[:m] + [targets[block_size + m - 1]])
        else:
            new_tokens.append(targets[: n + 1])
    return new_tokens, kept
