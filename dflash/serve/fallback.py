"""Adaptive fallback: stop drafting for a workload whose drafts are mostly rejected, and try again later.

Speculation pays only when enough draft tokens are accepted: every drafted step costs a drafter forward and
a verify forward over the whole block. For each workload (a request kind, e.g. "chat/greedy") the server
keeps the acceptance lengths of its last `window` drafts (one per row of a drafted step, so 8 rows fill a
window of 64 in 8 steps). When their mean falls below
`min_acceptance_length` (or, in auto mode, the break-even acceptance length the server measures: a drafted
step's cost over a plain step's), new requests of that workload decode without the drafter. After
`probe_after` such requests it probes: one request at a time drafts (the others stay plain) until
`probe_window` drafts decide whether drafting comes back (fewer than a full window: while a probe
runs, its one drafted row and the plain rows step apart, which costs a whole target forward more per round;
once drafting is back the full window judges it again). A probe that fails, or a comeback the full window turns
down, doubles the wait before the next probe, up to `MAX_PROBE_BACKOFF` times `probe_after`, until a full window
keeps drafting: a probe judges the first drafts of one answer, which a drafter often gets right where it misses
the rest, and each probe and each short comeback costs target forwards (measured: sampled requests at 8 rows,
where a probe passed about one time in four and the full window turned it down within a second, decoded at 0.90x
plain speed without the back-off, 0.99x with it). When a verdict changes, the scheduler moves the workload's rows
that are decoding to the other decoder (`AdaptiveFallback.wants_draft`), so drafted and plain steps do not
alternate for long: each costs a whole target forward, and together they are slower than either alone.

A verdict changes only past a band around the threshold (`hysteresis`): drafting stops below
threshold x (1 - h) and comes back above threshold x (1 + h). Near break-even either decoder is about as fast,
but every change costs a target read of each moved row; without the band, noise flipped the verdict back and
forth under load (measured: 8 concurrent requests at 0.78x plain speed, against 0.94x drafting throughout).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("dflash.serve")


MAX_PROBE_BACKOFF = 8  # failed probes double the wait before the next one, up to this many times probe_after

AUTO_NEEDS_STEP_COSTS = ("the automatic fallback threshold needs the step costs the adaptive block size measures: "
                         "drop --no-adaptive-block-size, or give --fallback-min-acceptance a number (0 never falls "
                         "back)")


@dataclass
class FallbackConfig:
    min_acceptance_length: float = 0.0  # tokens per verify forward; 0 disables the fallback
    window: int = 64  # drafts (a row's drafted step each) in the rolling mean
    probe_after: int = 32  # requests decoded without the drafter before drafting is tried again
    probe_window: int = 16  # drafts of the probe before its verdict (at most `window`)
    auto: bool = False  # the threshold is the break-even acceptance length measured by the server (set_threshold)
    hysteresis: float = 0.0  # verdicts change only this fraction below (stop) or above (resume) the threshold

    def __post_init__(self) -> None:
        if self.min_acceptance_length < 0:
            raise ValueError(f"the fallback threshold must be >= 0, got {self.min_acceptance_length}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"the fallback hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.window < 1 or self.probe_after < 1 or self.probe_window < 1:
            raise ValueError("the fallback window, probe interval and probe window must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.auto or self.min_acceptance_length > 0


@dataclass
class _Workload:
    lengths: deque = field(default_factory=deque)
    drafting: bool = True
    plain_requests: int = 0  # since drafting was switched off
    probing: bool = False  # off, but one request at a time drafts until a fresh window gives a verdict
    probe_in_flight: bool = False
    probes: int = 0  # probe requests sent so far: the one in flight is number `probes`
    failed_probes: int = 0  # probes (or comebacks) turned down since a full window last kept drafting
    confirmed: bool = True  # drafting was kept by a full window since it last came back from a probe
    drafts_since_comeback: int = 0  # a comeback is confirmed by a window of drafts after the probe's own

    def probe_wait(self, probe_after: int) -> int:
        """Plain requests before the next probe: `probe_after`, doubled by each failed probe (at most 8x)."""
        return probe_after * min(2 ** self.failed_probes, MAX_PROBE_BACKOFF)

    def rolling(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None


# listener(workload, drafting, rolling mean acceptance length or None)
Listener = Callable[[str, bool, "float | None"], None]


class AdaptiveFallback:
    """Decides per new request whether it drafts. Used from the scheduler's one decode thread only."""

    def __init__(self, config: FallbackConfig, listener: Listener | None = None):
        self.config = config
        self._listener = listener or (lambda *_: None)
        self._workloads: dict[str, _Workload] = {}
        self.threshold = config.min_acceptance_length

    def set_threshold(self, break_even: float) -> None:
        """Auto mode: the acceptance length at which the latest drafted step broke even with plain decoding
        (its cost over a plain step's at the same batch size); the threshold follows it smoothly."""
        self.threshold = break_even if self.threshold <= 0 else 0.9 * self.threshold + 0.1 * break_even

    def _get(self, workload: str) -> _Workload:
        if workload not in self._workloads:
            self._workloads[workload] = _Workload(lengths=deque(maxlen=self.config.window))
        return self._workloads[workload]

    def should_draft(self, workload: str) -> bool:
        """Called once per new request."""
        if not self.config.enabled:
            return True
        state = self._get(workload)
        if state.drafting:
            return True
        if state.probing:  # one probe request drafts at a time; the others stay plain until the verdict
            if state.probe_in_flight:
                return False
            state.probe_in_flight, state.probes = True, state.probes + 1
            return True
        state.plain_requests += 1
        if state.plain_requests <= state.probe_wait(self.config.probe_after):
            return False
        state.probing, state.probe_in_flight, state.plain_requests = True, True, 0
        state.probes += 1
        state.lengths.clear()
        log.info("fallback: probing drafting again for workload %r with one request", workload)
        return True

    def probe(self, workload: str) -> int:
        """The number of the probe request `should_draft` has just let draft (0: the workload drafts anyway). A
        request keeps it: only the probe in flight drafts while the workload does not."""
        if not self.config.enabled:
            return 0
        state = self._get(workload)
        return state.probes if state.probing and not state.drafting else 0

    def finished(self, workload: str, probe: int) -> None:
        """Probe request number `probe` of this workload stopped drafting (it finished, or its probe's verdict
        moved it to plain decoding): a probe that has no verdict yet sends another. An older probe's request
        changes nothing."""
        state = self._get(workload)
        if self.config.enabled and probe and probe == state.probes:
            state.probe_in_flight = False

    def observe(self, workload: str, acceptance_lengths: list[int]) -> None:
        """Acceptance lengths (tokens per verify forward) of one drafted step's rows of this workload: a draft
        each."""
        if not self.config.enabled or not acceptance_lengths:
            return
        state = self._get(workload)
        state.lengths.extend(acceptance_lengths)
        rolling = state.rolling()
        band = self.config.hysteresis
        resume_at, stop_below = self.threshold * (1 + band), self.threshold * (1 - band)
        if state.probing and len(state.lengths) >= min(self.config.probe_window, self.config.window):
            state.probing, state.plain_requests = False, 0
            state.drafting = rolling >= resume_at
            if state.drafting:
                state.confirmed, state.drafts_since_comeback = False, 0  # until a window of its own keeps it
            else:
                state.failed_probes += 1
            log.info("fallback: the probe of workload %r measured mean acceptance length %.3f against %.3f; %s",
                     workload, rolling, resume_at, "drafting again" if state.drafting else
                     f"staying without the drafter (next probe after "
                     f"{state.probe_wait(self.config.probe_after)} requests)")
        elif state.drafting:
            state.drafts_since_comeback += len(acceptance_lengths)
            if len(state.lengths) >= self.config.window:
                self._judge_window(workload, state, rolling, stop_below)
        self._listener(workload, state.drafting, rolling)

    def _judge_window(self, workload: str, state: _Workload, rolling: float, stop_below: float) -> None:
        """A drafting workload's full window: keep drafting, or stop. A comeback from a probe is kept (and the
        wait before probes starts over) only by a window of its own drafts, not the probe's first ones, which a
        drafter gets right more often than the rest of an answer."""
        if rolling >= stop_below:
            if state.drafts_since_comeback >= self.config.window:
                state.confirmed, state.failed_probes = True, 0
            return
        state.drafting, state.plain_requests = False, 0
        state.failed_probes = 0 if state.confirmed else state.failed_probes + 1  # a comeback turned down
        log.warning("fallback: workload %r has mean acceptance length %.3f < %.3f%s over its last %d drafts; new "
                    "requests decode without the drafter (probe after %d)", workload, rolling, stop_below,
                    " (break-even with plain decoding, less the hysteresis)" if self.config.auto else "",
                    len(state.lengths), state.probe_wait(self.config.probe_after))

    def drafting(self, workload: str) -> bool:
        return self._get(workload).drafting if self.config.enabled else True

    def wants_draft(self, workload: str, probe: int) -> bool:
        """Whether a request of this workload that is decoding should draft now: every one while the workload
        drafts; only the probe in flight (`probe`: the request's number from `probe`) while a probe runs, not a
        request of an earlier probe that is still decoding."""
        if not self.config.enabled:
            return True
        state = self._get(workload)
        return state.drafting or (state.probing and probe == state.probes != 0)
