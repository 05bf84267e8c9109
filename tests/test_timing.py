"""The fastest of interleaved runs, on a fake clock."""

import types

import pytest

import dflash.timing
from dflash.timing import fastest_times


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(dflash.timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_each_variant_keeps_its_fastest_call_and_the_variants_take_turns(clock):
    calls = []

    def variant(name: str, seconds: float):
        def run():
            calls.append(name)
            clock[0] += seconds * (50 if len(calls) % 4 == 0 else 1)  # every fourth call hit by a burst
        return run

    times = fastest_times({"a": variant("a", 1.0), "b": variant("b", 3.0)}, rounds=3)
    assert times == {"a": 1.0, "b": 3.0}
    assert calls == ["a", "a", "b", "b", "a", "b", "a", "b"]  # warm-ups in the first round only


def test_warming_up_every_round_and_repeats(clock):
    calls = []

    def run():
        calls.append(clock[0])
        clock[0] += 2.0

    assert fastest_times({"x": run}, rounds=2, repeats=3, warm_up_every_round=True) == {"x": 2.0}
    assert len(calls) == 2 * (1 + 3)
