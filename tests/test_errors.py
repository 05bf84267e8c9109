"""The shared error helpers (dflash/errors.py)."""

from dflash.errors import in_brief


def test_in_brief_quotes_the_first_line_and_marks_a_long_one_as_cut():
    assert in_brief(OSError("no space left\nsecond line")) == "OSError: no space left"
    assert in_brief(ValueError("")) == "ValueError"
    long = ValueError("the hub could not be reached (" + "a host that answers nothing " * 10 + "and so on)")
    said = in_brief(long, limit=60)
    assert said == "ValueError: the hub could not be reached (a host that answers nothing a ..."
    assert len(said) <= len("ValueError: ") + 60 + 4
