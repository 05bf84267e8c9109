"""`dflash train --report-to tensorboard`: the training log's numbers as TensorBoard scalars, beside
train_log.jsonl (which keeps every record either way).

A step's record goes under `train/` (loss, grad_norm, lr, tau_estimate, tokens_per_s ...), an evaluation's under
`eval/` (loss, tau_estimate, accuracy_per_position/0, /1 ...), each at its step. The events are written to
OUTPUT/tensorboard; a run (fresh, --overwrite or --resume) hides what an earlier run there logged from its first
step on, so a resumed run's curves continue where its checkpoint left them. Weights & Biases reads the same
directory (`wandb sync --sync-tensorboard OUTPUT/tensorboard`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import UserError

REPORTERS = ("none", "tensorboard")
MISSING = "--report-to tensorboard needs the tensorboard package: pip install 'dflash[tensorboard]'"


class TensorBoardReport:
    """Scalars of the training log's step and evaluation records, in TensorBoard's event files."""

    def __init__(self, log_dir: Path, first_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(MISSING) from None
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step)

    def record(self, record: dict[str, Any]) -> None:
        """A training log record: its numbers at its step (events and records without a step are left out)."""
        step = record.get("step")
        if "event" in record or not isinstance(step, int):
            return
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) of a record's finite numbers: eval_x as eval/x, the others as train/x, a list's items as
    tag/i; its step is the x-axis, not a scalar."""
    for key, value in record.items():
        if key == "step":
            continue
        tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        values = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                yield (tag if i is None else f"{tag}/{i}"), float(v)


def reporter(report_to: str, output: Path, first_step: int) -> TensorBoardReport | None:
    """The report of --report-to (None for none)."""
    if report_to == "tensorboard":
        return TensorBoardReport(output / "tensorboard", first_step)
    return None
