"""The checkpoint files on their own: atomic writes, pruning, damaged reads (the trainer's resume tests cover the
rest)."""

import pytest
import torch

from dflash.errors import UserError
from dflash.training.checkpoints import CHECKPOINT_KEYS, CheckpointDir, step_of


def state(step: int) -> dict:
    return {key: step for key in CHECKPOINT_KEYS}


def test_write_keeps_the_newest_and_lists_them_oldest_first(tmp_path):
    checkpoints = CheckpointDir(tmp_path / "checkpoints")
    assert checkpoints.all() == []
    for step in (3, 12, 6, 9):
        checkpoints.write(step, state(step), keep=2)
    (checkpoints.path / "step-7").mkdir()  # not a name the trainer writes
    (checkpoints.path / "step-00000010").write_text("a file")
    assert [step_of(p) for p in checkpoints.all()] == [9, 12]
    assert checkpoints.read(checkpoints.step_path(12), torch.device("cpu"))["step"] == 12


def test_a_failed_write_leaves_no_step_and_says_what_is_kept(tmp_path, monkeypatch):
    checkpoints = CheckpointDir(tmp_path / "checkpoints")
    checkpoints.write(1, state(1), keep=3)

    def full_disk(obj, path):
        open(path, "wb").write(b"half")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match="could not write checkpoint step 2 .*; the newest checkpoint, .*step-00000001, "
                                        "is kept: fix that and rerun with --resume"):
        checkpoints.write(2, state(2), keep=3)
    assert sorted(p.name for p in checkpoints.path.iterdir()) == ["step-00000001"]


@pytest.mark.parametrize("content, problem", [
    (b"not a pickle", "training_state.pt: "),
    (None, "it lacks optimizer"),
])
def test_a_damaged_checkpoint_says_how_to_go_on(tmp_path, content, problem):
    checkpoints = CheckpointDir(tmp_path)
    step = checkpoints.step_path(4)
    step.mkdir()
    if content is None:
        torch.save({k: 0 for k in CHECKPOINT_KEYS if k != "optimizer"}, step / "training_state.pt")
    else:
        (step / "training_state.pt").write_bytes(content)
    with pytest.raises(UserError, match=f"checkpoint {step} is damaged or incomplete .*{problem}.*delete that step "
                                        "directory to resume from the previous checkpoint"):
        checkpoints.read(step, torch.device("cpu"))


def test_clear_deletes_every_checkpoint_and_keeps_the_directory(tmp_path):
    checkpoints = CheckpointDir(tmp_path / "checkpoints")
    checkpoints.write(5, state(5), keep=3)
    checkpoints.clear()
    assert checkpoints.path.is_dir() and checkpoints.all() == []
