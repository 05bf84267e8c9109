from dataclasses import dataclass

import pytest

from dflash.config_types import type_mismatch


@dataclass
class Example:
    count: int = 1
    rate: float = 0.5
    name: str = ""
    flag: bool = False
    ids: list[int] | None = None
    files: list[str] | None = None


@pytest.mark.parametrize("name, value", [
    ("count", 3), ("rate", 2), ("rate", 0.25), ("name", "x"), ("flag", True), ("ids", None), ("ids", [1, 2]),
    ("ids", (1, 2)), ("files", "one.jsonl"), ("files", ["a", "b"]), ("unknown", object()),
])
def test_values_that_fit(name, value):
    assert type_mismatch(Example, name, value) is None


@pytest.mark.parametrize("name, value, expected", [
    ("count", "3", "an integer"), ("count", 2.5, "an integer"), ("count", True, "an integer"),
    ("rate", "fast", "a number"), ("flag", 1, "true or false"), ("name", 5, "a string"),
    ("ids", 3, "a list of integers or None"), ("ids", [1, "2"], "a list of integers or None"),
    ("files", [1], "a list of strings or None"),
])
def test_values_that_do_not_fit_say_what_is_expected(name, value, expected):
    assert type_mismatch(Example, name, value) == expected


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    assert type_mismatch(Example, "count", np.int64(3)) is None
    assert type_mismatch(Example, "rate", np.float32(0.5)) is None
