"""Training checkpoints: `--output/checkpoints/step-N`, one `training_state.pt` each, written atomically and pruned to
the newest few; and the check that a checkpoint continues the training a --resume asks for.

The trainer decides when to save and what a state holds; this module owns the files and what makes one resumable.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import torch

from dflash.errors import UserError, in_brief, why_not_written
from dflash.model.config import ATTENTION_FIELDS, DFLASH_ATTENTION_FIELDS, DrafterConfig
from dflash.training.config import TrainConfig

CHECKPOINT_NAME = re.compile(r"step-\d{8}")
CHECKPOINT_KEYS = ("step", "drafter", "optimizer", "scheduler", "config", "drafter_config")
FRESH_START = "pass another --output, or --overwrite to delete its checkpoints and train from scratch"


def step_of(checkpoint: Path) -> int:
    """The training step a checkpoints/step-N directory holds."""
    return int(checkpoint.name.removeprefix("step-"))


class CheckpointDir:
    """The checkpoints/ directory of one --output."""

    def __init__(self, path: Path):
        self.path = path

    def step_path(self, step: int) -> Path:
        return self.path / f"step-{step:08d}"

    def all(self) -> list[Path]:
        """checkpoints/step-N, oldest first (only directories named as `step_path` names them)."""
        found = self.path.glob("step-*") if self.path.is_dir() else []
        return sorted(p for p in found if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir())

    def write(self, step: int, state: dict, keep: int) -> None:
        """Save `state` as step-N (temporary directory, then rename: a stopped write leaves no step-N), then keep the
        newest `keep`. A write the OS refuses is a UserError that says what the run keeps (`kept`)."""
        final, tmp = self.step_path(step), self.path / f".tmp-step-{step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            torch.save(state, tmp / "training_state.pt")
        except (OSError, RuntimeError) as err:  # a full disk fails inside torch's writer as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"could not write checkpoint step {step} into {self.path} ({in_brief(err)}; "
                            f"{why_not_written(err)}); {self.kept()}") from None
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.all()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def kept(self) -> str:
        """What a run stopped by a failed write keeps, and how to go on from it."""
        kept = self.all()
        return (f"the newest checkpoint, {kept[-1]}, is kept: fix that and rerun with --resume to continue from it"
                if kept else "no earlier checkpoint was written: fix that and rerun")

    def read(self, checkpoint: Path, device: torch.device) -> dict:
        """The training state of checkpoints/step-N; one that cannot be read (a truncated copy, a damaged disk, a
        file removed by hand) is an error that says how to go on."""
        path = checkpoint / "training_state.pt"
        try:
            state = torch.load(path, map_location=device, weights_only=False)
        except torch.cuda.OutOfMemoryError:  # not damage: let it say what it is
            raise
        except Exception as err:  # a damaged file fails in any of the unpickler's ways (or is missing)
            problem = in_brief(err)
        else:
            missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
            if not missing:
                return state
            problem = f"it lacks {', '.join(missing)}"
        raise UserError(f"checkpoint {checkpoint} is damaged or incomplete ({path.name}: {problem}); delete that "
                        "step directory to resume from the previous checkpoint, or run without --resume and with "
                        "--overwrite to start over")

    def remove(self, step: int) -> None:
        shutil.rmtree(self.step_path(step), ignore_errors=True)

    def clear(self) -> None:
        """Delete every checkpoint (--overwrite), keeping the directory."""
        if self.all():
            shutil.rmtree(self.path)
            self.path.mkdir()


def with_fields_it_dropped(saved: dict, current: DrafterConfig) -> dict:
    """A checkpoint's drafter config with the fields checkpoints before 2026-12-06 dropped (those this package did
    not own, e.g. use_sliding_window) taken from the drafter being trained: missing, they are its own, not another
    shape. The fields that set how layers attend are not filled in: a difference there is one."""
    if not isinstance(saved, dict):
        return saved
    raw = {**{k: v for k, v in current.extra.items() if k not in ATTENTION_FIELDS}, **saved}
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict):
        ours = {k: v for k, v in current.dflash_extra.items() if k not in DFLASH_ATTENTION_FIELDS}
        raw["dflash_config"] = {**ours, **dflash}
    return raw


def check_resumable(state: dict, checkpoint: Path, *, drafter_config: DrafterConfig, config: TrainConfig,
                    data_fingerprint: dict, global_batch: int, world: int, context: int | None,
                    trains_on: bool = True) -> None:
    """Refuse a resume that would not continue the same training: another drafter shape, other examples or another
    order of them (data, split, seed, global batch; the batch only where steps are left to train, `trains_on`:
    exporting a run stopped after its last step may take other processes)."""
    saved = DrafterConfig.from_dict(with_fields_it_dropped(state["drafter_config"], drafter_config)).to_dict()
    shape = [f"{k} {saved.get(k)!r}, now {v!r}" for k, v in drafter_config.to_dict().items() if saved.get(k) != v]
    old = state["config"]
    if shape:
        started = old.get("init_from")
        hint = (f" (it started from --init-from {started}: give that again)"
                if started and started != config.init_from else "")
        raise UserError(f"{checkpoint} holds a drafter of another shape ({'; '.join(shape)}); resume with the "
                        f"options it was trained with{hint}, or {FRESH_START}")
    order = []
    if old.get("seed") != config.seed:  # first: it also draws the held-out split, so the examples differ too
        order.append(f"seed {old.get('seed')}, now {config.seed}")
    if "data" in state and state["data"] != data_fingerprint:
        order.append("the training or held-out examples differ (--data, --extra-train-data, --max-length, "
                     "--eval-fraction, --enable-thinking, --chat-template-kwargs, or the files themselves; or the "
                     "version that wrote the checkpoint read them otherwise: since 2026-12-06 every answer of a "
                     "multi-turn record trains, and the turns of a conversation that continue one another train as "
                     "one sequence; since 2026-12-07 text records render with the chat template settings datagen's "
                     "settings files name, where --chat-template-kwargs '{}' renders them with the template's "
                     "defaults as before)")
    if "data" not in state:  # a checkpoint of an older version: compare the options
        then = {**old, "max_length": min(old.get("max_length", 0), context or math.inf)}  # it was not capped
        order += [f"{k} {then.get(k)!r}, now {getattr(config, k)!r}"
                  for k in ("data", "extra_train_data", "eval_fraction", "max_length")
                  if then.get(k) != getattr(config, k)]
    old_global = old.get("batch_size", 0) * old.get("grad_accum", 1) * state.get("world_size", world)
    if trains_on and old_global != global_batch:
        order.append(f"global batch {old_global}, now {global_batch} (--batch-size x --grad-accum x processes)")
    if order:
        raise UserError(f"{checkpoint} cannot be resumed with this data order: {'; '.join(order)}. Resume with "
                        f"the data and options it was trained with, or {FRESH_START}")
