"""Weight layout for the few-row matrix products of speculative decoding on a CPU.

`nn.Linear` keeps its weight (out, in) row-major and computes `x @ W.T`. Verifying a block multiplies 8 to
32 rows at a time, and there the CPU kernels can be far slower for that transposed operand than for the
same weight stored column-major: on the 2-core Xeon this project is measured on (torch 2.13, MKL), 16 rows
x (256 -> 768) took 167 us against 39 us, and the 4,096-token LM head 704 us against 208 us, while one row
(plain decoding) took the same either way. Which layout wins depends on the CPU and the BLAS library, so
it is measured, once per weight shape, when a pipeline is built: a weight is stored column-major where
that is clearly faster for a block of rows and not slower for one row. Values and shapes stay the same; only
the memory order changes (a tied LM head gets a column-major copy of its own). GPUs are left alone.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dflash.timing import fastest_times

log = logging.getLogger("dflash")

_BLOCK_ROWS = 16  # rows of a typical verify forward
_GAIN = 0.85  # column-major must take at most this share of the row-major time for a block of rows
_ONE_ROW_SLACK = 1.10  # ... and at most this much more for one row
_ROUNDS = 7
_MAX_UNTIED_BYTES = 256 * 2**20  # a tied LM head larger than this keeps its shared row-major weight


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values stored column-major: `.T` of the result is contiguous."""
    return weight.t().contiguous().t()


def column_major_is_faster(weight: torch.Tensor, rows: int = _BLOCK_ROWS, rounds: int = _ROUNDS) -> bool:
    """Time `x @ W.T` for both layouts of `weight` at `rows` rows and at one row (fastest of `rounds` each,
    the two layouts interleaved so bursts of other work hit both)."""
    layouts = {"row": weight.detach().contiguous(), "col": column_major(weight.detach())}
    times: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for n in (rows, 1):
            x = torch.randn(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
            products = {(name, n): partial(F.linear, x, w) for name, w in layouts.items()}
            times.update(fastest_times(products, rounds))
    return (times["col", rows] <= _GAIN * times["row", rows]
            and times["col", 1] <= _ONE_ROW_SLACK * times["row", 1])


def use_fast_layout(modules: Iterable[nn.Module], rows: int = _BLOCK_ROWS) -> int:
    """Store the weights of the CPU `nn.Linear` layers in `modules` in the layout measured faster for blocks of
    `rows` rows; returns how many weights were changed.

    A Linear whose weight is also an embedding's (a tied LM head) gets its own column-major copy instead, up to
    `_MAX_UNTIED_BYTES`: embedding lookups keep their rows contiguous, and transformers can still save the
    model (it cannot follow storage shared by a strided tensor)."""
    modules = list(modules)
    embeddings = {id(m.weight) for module in modules for m in module.modules() if isinstance(m, nn.Embedding)}
    linears = [m for module in modules for m in module.modules()
               if isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dim() == 2]
    verdicts: dict[tuple, bool] = {}
    changed = 0
    for linear in {id(m): m for m in linears}.values():
        weight = linear.weight
        key = (tuple(weight.shape), weight.dtype)
        if key not in verdicts:
            verdicts[key] = column_major_is_faster(weight, rows)
        if not verdicts[key] or weight.t().is_contiguous():
            continue
        if id(weight) in embeddings:
            if weight.numel() * weight.element_size() > _MAX_UNTIED_BYTES:
                continue
            linear.weight = nn.Parameter(column_major(weight.data), requires_grad=weight.requires_grad)
        else:
            weight.data = column_major(weight.data)
        changed += 1
    if changed:
        log.info("stored %d weight matrices column-major (faster for %d-row products on this CPU): %s", changed,
                 rows, ", ".join(f"{list(k[0])}" for k, v in verdicts.items() if v))
    return changed
