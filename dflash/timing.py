"""Timing on a shared machine: the fastest of interleaved runs.

Other work on the machine only ever adds time, and in bursts. So a variant's cost is the least time it took,
and variants measured against each other take turns, round by round, so that a burst slows them alike instead
of one of them. The start-up measurements that choose a weight layout (`model.cpu_layout`), the drafter's
precision (`model.cpu_precision`) and the step costs of the adaptive block size (`decoding.block_policy`) all
time this way.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Hashable, Mapping, TypeVar

Key = TypeVar("Key", bound=Hashable)


def fastest_times(variants: Mapping[Key, Callable[[], object]], rounds: int, repeats: int = 1,
                  warm_up_every_round: bool = False) -> dict[Key, float]:
    """Seconds of each variant's fastest call: `rounds` passes over the variants in turn, each pass calling a
    variant once untimed (in the first pass only, unless `warm_up_every_round`: when a call changes what the
    next one works on) and then `repeats` times timed."""
    fastest = {key: math.inf for key in variants}
    for round_ in range(rounds):
        for key, run in variants.items():
            if round_ == 0 or warm_up_every_round:
                run()
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                fastest[key] = min(fastest[key], time.perf_counter() - start)
    return fastest
