"""What DFlash2 adds to the drafter (REFERENCE section 3): the in-block convolution and the candidate selector.

In-block convolution. Around every attention and MLP sublayer of every layer, a depthwise convolution along the
block with `conv_kernel_size` taps: out_t = sum_j k_{t,j} * x_{t-j}, where x_{t-j} is zero before the block's
first position (a tap never reads across a block boundary: position 1 reads the anchor, position 0 reads
nothing). Each coefficient is a learned base kernel plus a correction predicted from the sublayer's (normed)
input by one projection and shared by `conv_group_size` channels. One projection gives two kernels: the first
convolves the sublayer's input, the second its output before the residual add. It starts as the identity (base
kernel 1 at tap 0, 0 elsewhere; a zero projection), so a DFlash drafter extended with it drafts unchanged.

Candidate selector. DFlash keeps each draft position's top-1 token on its own; the selector keeps each
position's `selector_top_k` candidates and walks one path through them from the anchor, position by position:

    S_t(a, b) = U_t(b) + < A(a) * H(h_t), B(b) >

U_t(b) is the drafter's logit for candidate b at position t, a the token chosen at t-1 (the anchor at t = 1),
h_t the drafter's final hidden state there, A and B token codebooks (vocab x rank) and H a projection
(hidden -> rank). Greedy drafting takes the best-scoring b; sampled drafting draws b from softmax(S_t(a, .) / T),
which is the proposal distribution verification then corrects for. It starts with H = 0, where the walk takes
every position's top-1: DFlash's own draft.

The conv's exact placement (on the normed sublayer input, and on the sublayer output before the residual add)
and the selector's zero-initialised projection are this package's reading of the published description.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.config import DFlash2Options
from dflash.model.cpu_precision import CastingLinear


class GroupedDynamicConv(nn.Module):
    """The two kernels (input side, output side) of one sublayer, from that sublayer's normed input."""

    # Training steps the kernel projection at this share of the learning rate: each correction sums hidden_size
    # products, so a step that moves every weight by lr moves a coefficient by up to hidden_size * lr. At the full
    # rate (4e-4) the embedded drafter, grown from DFlash, lost 0.33 of its acceptance length in 100 steps.
    projection_lr_scale = 0.1

    def __init__(self, hidden_size: int, options: DFlash2Options):
        super().__init__()
        self.taps, self.group = options.conv_kernel_size, options.conv_group_size
        self.groups = hidden_size // self.group
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden_size))  # [input side, output side]
        self.kernel_projection = CastingLinear(hidden_size, 2 * self.taps * self.groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, q, h) -> kernels (b, q, 2, taps, h): base + the group's correction, per position."""
        b, q, _ = x.shape
        correction = self.kernel_projection(x).view(b, q, 2, self.taps, self.groups)
        return self.base_kernel + correction.repeat_interleave(self.group, dim=-1)


def block_conv(x: torch.Tensor, kernel: torch.Tensor, block_width: int) -> torch.Tensor:
    """x (b, q, h), kernel (b, q, taps, h) -> (b, q, h): out_t = sum_j kernel[t, j] * x_{t-j}, within blocks of
    `block_width` consecutive positions (q is a whole number of blocks)."""
    out = kernel[:, :, 0] * x
    for j in range(1, kernel.shape[2]):
        earlier = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]  # x_{t-j}, zero before the sequence
        out = out + kernel[:, :, j] * earlier * _inside(x.shape[1], block_width, j, x.device, x.dtype)
    return out


@functools.lru_cache(maxsize=64)
def _inside(q: int, block_width: int, j: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(1, q, 1): 1 where position t - j lies in t's own block, else 0 (made once per shape: a decode step
    applies four convolutions per layer to the same block)."""
    offset = torch.arange(q, device=device) % block_width  # position within its block
    return (offset >= j).to(dtype)[None, :, None]


@dataclass
class Lattice:
    """Every draft position's candidates and the score of each (predecessor, candidate) pair."""

    candidates: torch.Tensor  # (b, k, K) token ids, best unary logit first
    unary: torch.Tensor  # (b, k, K) the drafter's logits for them
    scores: torch.Tensor  # (b, k, K, K): [t, a, c] = S_t(candidate a of t-1, candidate c of t); row a is unused
    #                       at t = 0, where the predecessor is the anchor (every row holds its scores)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, options: DFlash2Options):
        super().__init__()
        self.top_k, rank = options.selector_top_k, options.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = CastingLinear(hidden_size, rank, bias=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Codebooks random, projection zero: the walk starts as top-1 per position, and learns from there."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.successor_codebook, std=std)
        nn.init.zeros_(self.hidden_projection.weight)

    def lattice(self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor) -> Lattice:
        """logits (b, k, vocab), hidden (b, k, h) of draft positions 1..k; anchors (b,) -> the lattice."""
        unary, candidates = logits.topk(self.top_k, dim=-1)  # (b, k, K)
        previous = torch.cat([anchors[:, None, None].expand(-1, 1, self.top_k), candidates[:, :-1]], dim=1)
        return Lattice(candidates, unary, self.pair_scores(unary, candidates, previous, hidden))

    def pair_scores(self, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        """unary, candidates (..., K); previous (..., P) predecessor tokens; hidden (..., h) ->
        (..., P, K) scores S(previous p, candidate c)."""
        gate = self.hidden_projection(hidden.to(self.predecessor_codebook.dtype))  # (..., r)
        left = codebook_rows(self.predecessor_codebook, previous) * gate[..., None, :]  # (..., P, r)
        right = codebook_rows(self.successor_codebook, candidates)  # (..., K, r)
        return unary[..., None, :].float() + (left @ right.transpose(-1, -2)).float()


def codebook_rows(codebook: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """codebook (vocab, r), tokens (...) -> (..., r). index_select, not codebook[tokens]: the same rows, and in
    training its gradient adds them up 2.7x faster on a CPU than advanced indexing's index_put."""
    return codebook.index_select(0, tokens.flatten()).view(*tokens.shape, codebook.shape[-1])


def walk(lattice: Lattice) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy path: at each position the best candidate after the one chosen before.
    Returns tokens (b, k) and the chosen candidate indices (b, k).

    The best successor of every (position, predecessor) is found in one argmax; the walk then only follows
    pointers, on the host (b x k x K small integers), instead of k dependent device operations."""
    best = lattice.scores.argmax(-1).tolist()  # [b][t][a]: the best candidate at t after candidate a at t-1
    chosen_rows = []
    for row in best:
        previous, chosen = 0, []  # any predecessor row at t = 0 holds the anchor's scores
        for after in row:
            previous = after[previous]
            chosen.append(previous)
        chosen_rows.append(chosen)
    chosen = torch.tensor(chosen_rows, dtype=torch.long, device=lattice.candidates.device).view(
        lattice.candidates.shape[:2])
    return lattice.candidates.gather(2, chosen[..., None])[..., 0], chosen


def walk_on_device(lattice: Lattice) -> tuple[torch.Tensor, torch.Tensor]:
    """`walk`'s path, followed on the lattice's device by k dependent gathers instead of on the host: for the
    thousands of blocks of a training batch, whose b x k x K integers cost a GPU more to bring to the host (a sync,
    then a Python loop) than its whole step."""
    best = lattice.scores.argmax(-1)  # (b, k, K): the best candidate at t after each candidate at t-1
    previous = torch.zeros(best.shape[0], 1, dtype=torch.long, device=best.device)  # row 0 at t = 0: the anchor's
    chosen = []
    for t in range(best.shape[1]):
        previous = best[:, t].gather(1, previous)  # (b, 1)
        chosen.append(previous)
    chosen = torch.cat(chosen, dim=1)  # (b, k)
    return lattice.candidates.gather(2, chosen[..., None])[..., 0], chosen


def path_confidence(lattice: Lattice, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (b, k), a path through the lattice's candidates -> (b, k): at each position, the softmax of the
    scores after the path's token at the position before, at the path's token. The selector's own estimate
    that the token is right given the ones before it were, which `block_policy` calibrates against what the
    target accepts."""
    chosen = (lattice.candidates == tokens[..., None]).int().argmax(-1)  # (b, k) the candidates are distinct
    previous = torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], dim=1)  # row 0 at t = 0: the anchor's
    k_top = lattice.scores.shape[-1]
    rows = lattice.scores.gather(2, previous[..., None, None].expand(-1, -1, 1, k_top))[:, :, 0]  # (b, k, K)
    return rows.softmax(-1).gather(-1, chosen[..., None])[..., 0]

