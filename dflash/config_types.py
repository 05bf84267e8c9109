"""Does a value fit a typed configuration field? One check for every dataclass config a user fills in (a YAML
file, keyword arguments), so a wrong type is a clear error before it fails deep inside a run.

Annotations understood: int, float, str, bool, dict, dict[..., ...], list[...] (a list or tuple; a bare string for
list[str], one item), and unions with None. Integers and numbers include numpy / torch scalars; bool is never a number.
"""

from __future__ import annotations

import functools
import numbers
import types
import typing
from typing import Any

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "None",
          dict: "a mapping of names to values, like {enable_thinking: false}"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def type_mismatch(cls: type, name: str, value: Any) -> str | None:
    """What field `name` of dataclass `cls` expects, when `value` does not fit it; None when it fits (or `cls`
    has no such field: unknown names are the caller's to report)."""
    kind = _hints(cls).get(name)
    if kind is None or _fits(kind, value):
        return None
    return _describe(kind)


def _is_union(kind: Any) -> bool:
    return isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union


def _fits(kind: Any, value: Any) -> bool:
    if _is_union(kind):
        return any(_fits(k, value) for k in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if item is str and isinstance(value, str):  # one item for a list of strings
            return True
        return isinstance(value, (list, tuple)) and all(_fits(item, v) for v in value)
    if typing.get_origin(kind) is dict:
        key, item = typing.get_args(kind)
        return isinstance(value, dict) and all(_fits(key, k) and _fits(item, v) for k, v in value.items())
    if isinstance(value, bool):
        return kind is bool
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    if _is_union(kind):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return f"a list of {_describe(typing.get_args(kind)[0]).split(' ', 1)[-1]}s"
    if typing.get_origin(kind) is dict:
        key, item = (_describe(k).split(" ", 1)[-1] for k in typing.get_args(kind))
        return f"a mapping of {key}s to {item}s"
    return _NAMES.get(kind, getattr(kind, "__name__", str(kind)))


def blank_option(values: dict[str, Any]) -> str | None:
    """The first of `values` (option -> value) given as '' or spaces, also inside a list of them; None when none is.
    Such an option is refused, not taken as not given: --target "$T" with T unset would silently mean the default
    model (and --init-from '' a drafter from scratch)."""
    for name, value in values.items():
        if any(isinstance(item, str) and not item.strip() for item in (value if isinstance(value, list) else [value])):
            return name
    return None


def split_list(text: str) -> list[str]:
    """'4, 8,16' -> ['4', '8', '16'], as flags and config files write lists: a trailing comma is allowed, no value at
    all is [] (for the caller to name), and an empty item between two (a typo) is a ValueError."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        return []
    if len(items) > 1 and not items[-1]:
        items.pop()
    if not all(items):
        raise ValueError(f"an empty item in {text!r}")
    return items


def parse_int_list(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16] (`split_list`); anything that is not an integer is a ValueError."""
    return [int(x) for x in split_list(text)]
