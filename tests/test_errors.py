"""The shared error helpers (dflash/errors.py)."""

import pytest

from dflash.errors import in_brief, why_not_written


def test_in_brief_quotes_the_first_line_and_marks_a_long_one_as_cut():
    assert in_brief(OSError("no space left\nsecond line")) == "OSError: no space left"
    assert in_brief(ValueError("")) == "ValueError"
    long = ValueError("the hub could not be reached (" + "a host that answers nothing " * 10 + "and so on)")
    said = in_brief(long, limit=60)
    assert said == "ValueError: the hub could not be reached (a host that answers nothing a ..."
    assert len(said) <= len("ValueError: ") + 60 + 4


def test_a_failed_write_is_given_the_cause_to_check(tmp_path):
    """A folder where train_log.jsonl goes was asked "is the disk full?"."""
    (tmp_path / "train_log.jsonl").mkdir()
    with pytest.raises(OSError) as folder:
        open(tmp_path / "train_log.jsonl", "a")
    assert why_not_written(folder.value) == "a folder stands where the file goes: move it away"
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError) as file:
        open(tmp_path / "file" / "inside", "w")
    assert why_not_written(file.value) == "a file stands where a folder of the path goes: move it away"
    assert why_not_written(PermissionError("denied")) == "can this user write there?"
    assert why_not_written(OSError(28, "No space left on device")) == "is the disk full?"
