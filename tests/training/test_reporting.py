"""`dflash train --report-to tensorboard`: every number of the training log's step and evaluation records reaches
TensorBoard at its step, under train/ and eval/; without the package the run is refused before it sets up."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dflash.errors import UserError
from dflash.training import Trainer
from dflash.training.reporting import scalars

from .test_trainer import config, train_data  # noqa: F401 - the train_data fixture

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_the_training_logs_numbers_reach_tensorboard(tiny_pair, train_data, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, report_to="tensorboard", eval_every=3)).setup().train()
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "event" not in r]
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "eval/loss",
            "eval/accuracy_per_position/0"} <= tags
    for tag in ("train/loss", "eval/loss", "eval/accuracy_per_position/2"):
        key, index = {"train/loss": ("loss", None), "eval/loss": ("eval_loss", None),
                      "eval/accuracy_per_position/2": ("eval_accuracy_per_position", 2)}[tag]
        want = [(r["step"], r[key] if index is None else r[key][index]) for r in steps if key in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want] and want  # train: 2, 4, 6; eval: 3, 6
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_scalars_name_eval_and_train_numbers_and_leave_the_rest():
    record = {"step": 4, "epoch": 0.5, "loss": 2.5, "eval_loss": 3.0, "eval_accuracy_per_position": [0.5, 0.25],
              "flag": True, "note": "x", "tau": float("nan")}
    assert dict(scalars(record)) == {"train/epoch": 0.5, "train/loss": 2.5, "eval/loss": 3.0,
                                     "eval/accuracy_per_position/0": 0.5, "eval/accuracy_per_position/1": 0.25}


def test_without_tensorboard_the_run_is_refused_before_it_sets_up(tiny_pair, train_data, tmp_path,  # noqa: F811
                                                                   monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else found(name, *a))
    with pytest.raises(UserError, match=r"--report-to tensorboard needs the tensorboard package: pip install"):
        config(tiny_pair, train_data, tmp_path / "out", report_to="tensorboard")
    assert not (tmp_path / "out").exists()
