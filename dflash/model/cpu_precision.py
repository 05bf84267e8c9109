"""The drafter's matrix products in bfloat16 on CPUs that multiply it natively.

A draft only proposes tokens: the target verifies every one in its own dtype, so the drafter's precision can
change how many draft tokens are accepted, never what is generated. On CPUs with AVX512-BF16 or AMX, oneDNN
multiplies bfloat16 blocks of rows much faster than MKL multiplies float32 ones (2-core AMD EPYC, torch 2.13:
16 rows x (256 -> 768) 43 us against 64 us, 128 rows 143 us against 317 us, 16 rows through the 4,096-token
LM head 149 us against 574 us), while elementwise bfloat16 ops are slower than float32 ones there (the whole
embedded drafter in bfloat16 drafted no faster). So only weights of the drafter's linear layers become
bfloat16, and a bfloat16 copy of the target's LM head serves the drafter's logits; activations, norms and
attention stay float32 (`CastingLinear` casts around each product).

Whether that is faster depends on the CPU and on the drafter's shapes (there, a product of 16 rows through a
weight smaller than 256 x 256 alone lost to its casts, while whole drafts won), so it is measured once, when a
pipeline is built, on one decode-time draft of the drafter itself; CPUs without native bfloat16, where it is
emulated, keep float32. `benchmarks/drafter_precision.py` measures what it is worth in decode steps and in
acceptance length.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash.timing import fastest_times

log = logging.getLogger("dflash")

_BATCH_ROWS = 8  # a bfloat16 draft of this many rows must take at most _GAIN of a float32 one
_GAIN = 0.85
_ONE_ROW_SLACK = 1.0  # ... and of one row at most this share
_ROUNDS = 7
_MAX_HEAD_BYTES = 256 * 2**20  # a larger LM head gets no bfloat16 copy (the drafter then keeps float32)

AUTO = "auto"
PRECISIONS = (AUTO, "float32", "bfloat16")  # a DFlash drafter's matrix products: measured, or as asked


class CastingLinear(nn.Linear):
    """`nn.Linear` that multiplies in its weight's dtype and answers in its input's: with float32 weights it is
    `nn.Linear`; with bfloat16 weights float32 activations go in and come out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), as oneDNN sees it."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _Weights:
    """The float32 weights of a drafter's `CastingLinear` layers and bfloat16 copies of them, to swap between."""

    def __init__(self, linears: list[CastingLinear]):
        self.linears = linears
        self.float32 = [m.weight for m in linears]
        self.bfloat16 = [nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False) for w in self.float32]

    def use(self, weights: list[nn.Parameter]) -> None:
        for m, w in zip(self.linears, weights):
            m.weight = w


def _draft_once(drafter: nn.Module, head: torch.Tensor, rows: int, new_context: int) -> Callable[[], None]:
    """One decode-time draft of `rows` rows: `new_context` new context tokens each, one block, its logits."""
    config = drafter.config
    block = config.block_size
    features = torch.randn(rows, new_context, config.num_features)
    embeds = torch.randn(rows, block, config.hidden_size)
    context_positions = torch.arange(new_context).expand(rows, -1)
    block_positions = torch.arange(new_context, new_context + block).expand(rows, -1)

    def draft() -> None:
        context = drafter.project_context(features)
        hidden = drafter(embeds, block_positions, context, context_positions, outputs=slice(1, block))
        F.linear(hidden.to(head.dtype), head).float()
    return draft


def _with_weights(weights: _Weights, linear_weights: list[nn.Parameter], draft: Callable[[], None]):
    def run() -> None:
        weights.use(linear_weights)  # a few attribute sets: nothing next to a draft
        draft()
    return run


def bfloat16_drafts_faster(drafter: nn.Module, weights: _Weights, head: torch.Tensor, head_bfloat16: torch.Tensor,
                           new_context: int = 4, rounds: int = _ROUNDS) -> bool:
    """Time drafts of one row and of `_BATCH_ROWS` rows with float32 and with bfloat16 products (fastest of
    `rounds` each, the two interleaved so bursts of other work hit both): bfloat16 must be clearly faster for
    the batch and not slower for one row. Leaves the float32 weights in place."""
    precisions = {"float32": (weights.float32, head), "bfloat16": (weights.bfloat16, head_bfloat16)}
    ratios = {}
    with torch.inference_mode():
        for rows in (1, _BATCH_ROWS):
            drafts = {name: _with_weights(weights, linear_weights, _draft_once(drafter, head_weight, rows, new_context))
                      for name, (linear_weights, head_weight) in precisions.items()}
            times = fastest_times(drafts, rounds)
            ratios[rows] = times["bfloat16"] / times["float32"]
    weights.use(weights.float32)
    return ratios[_BATCH_ROWS] <= _GAIN and ratios[1] <= _ONE_ROW_SLACK


def use_bfloat16_matmuls(drafter: nn.Module, head_weight: torch.Tensor, force: bool = False) -> bool:
    """Move the weights of the float32 CPU `drafter`'s `CastingLinear` layers to bfloat16 and give it a bfloat16
    copy of the target's LM head (`drafter.draft_head`), where a draft is measured faster so. With `force`,
    always, on any device. Returns whether it did (never for drafters whose weights are not float32)."""
    linears = [m for m in drafter.modules() if isinstance(m, CastingLinear)]
    devices = {head_weight.device} | {m.weight.device for m in linears}
    if (not linears or head_weight.dtype != torch.float32 or any(m.weight.dtype != torch.float32 for m in linears)
            or len(devices) > 1):
        return False
    if not force and (head_weight.device.type != "cpu" or head_weight.numel() * 2 > _MAX_HEAD_BYTES
                      or not native_bfloat16()):
        return False
    weights, head_bfloat16 = _Weights(linears), head_weight.detach().to(torch.bfloat16).contiguous()
    if not (force or bfloat16_drafts_faster(drafter, weights, head_weight.detach(), head_bfloat16)):
        return False
    weights.use(weights.bfloat16)
    drafter.draft_head = head_bfloat16
    log.info("the drafter multiplies in bfloat16 (%s; activations stay float32)",
             "as asked" if force else "a draft measured faster so on this CPU")
    return True
