"""Continuous batching: one decode thread owns the engine; requests join and leave between steps.

    HTTP handlers (event loop)              decode thread (the only one that touches torch)
    submit(seq) -> waiting queue   ---->    admit: take waiting requests while batch slots are free
                                            prefill each (first token), merge into the running batch
    await request.events           <----    step: draft + verify every row, send each row its kept tokens
    cancel() (disconnect, abort)   ---->    between steps: drop finished and cancelled rows, free their slots

Drafted and plain rows cannot share a batch (they run different proposers), so there is one running batch
per decoder; each loop steps both. Which decoder a request gets is the adaptive fallback's call; when its
verdict for a workload changes, that workload's decoding rows move to the other decoder between steps
(the target reads each row again for the new proposer), so the two batches run side by side only briefly.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dflash.decoding.block_policy import BlockSizePolicy
from dflash.decoding.engine import Batch, Sequence, SpeculativeEngine
from dflash.decoding.logprobs import TokenLogprob
from dflash.decoding.proposer import NoDraftProposer
from dflash.decoding.verify import RowsFailed
from dflash.errors import UserError
from dflash.serve.fallback import AdaptiveFallback, FallbackConfig
from dflash.serve.metrics import DECODERS, ServerMetrics

log = logging.getLogger("dflash.serve")

IDLE_WAKE_S = 0.5  # how often an idle decode loop wakes, so Ctrl-C and SIGTERM stop it within this time

DRAFT, PLAIN = DECODERS
SHUTTING_DOWN = "the server is shutting down; retry in a moment or against another replica"


class QueueFull(Exception):
    """Every batch slot and queue place is taken; the client should retry later (HTTP 429)."""


class SchedulerClosed(Exception):
    """The server is shutting down or its decode thread has stopped (HTTP 503)."""


@dataclass
class SchedulerConfig:
    max_batch_size: int = 8  # rows decoded together
    max_queue: int = 64  # requests waiting for a row beyond those decoding
    # prompt tokens prefilled between two decode steps while rows are decoding (at least one prompt): a burst of
    # long prompts would otherwise hold every running stream for the time of all their prefills
    max_prefill_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max batch size must be >= 1, got {self.max_batch_size}")
        if self.max_queue < 0:
            raise ValueError(f"max queue must be >= 0, got {self.max_queue}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max prefill tokens must be >= 1, got {self.max_prefill_tokens}")


@dataclass
class Event:
    """What the decode thread tells a request: tokens kept this step, then once `done`."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # the tokens', where the request asked for them
    done: bool = False
    finish_reason: str | None = None  # stop, length, abort, error
    error: str | None = None
    unavailable: bool = False  # the error is the server shutting down, not a failure (HTTP 503, not 500)


class Request:
    """A handler's handle on one sequence being decoded; events arrive on its asyncio queue.

    A streamed request gets an event per step with the tokens it kept; any other gets only the final event (the
    tokens are in `seq`), so the event loop is not woken to pass on tokens nobody reads yet.
    """

    def __init__(self, seq: Sequence, workload: str, loop: asyncio.AbstractEventLoop, scheduler: "Scheduler",
                 stream: bool = True):
        self.seq = seq
        self.workload = workload
        self.stream = stream
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.cancelled = False
        self.finished = False
        self.decoder: str | None = None  # set at prefill; changes when the fallback moves the row
        self.probe = 0  # drafting as the fallback's probe number `probe` (`AdaptiveFallback.probe`); 0: not a probe
        self._loop = loop
        self._scheduler = scheduler

    def cancel(self) -> None:
        """Abort decoding (no-op once finished); its batch slot is freed before the next step."""
        if not self.finished:
            self._scheduler.cancel(self)

    def emit(self, event: Event) -> None:  # decode thread
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, config: SchedulerConfig | None = None,
                 metrics: ServerMetrics | None = None, fallback: FallbackConfig | None = None,
                 block_policy: BlockSizePolicy | None = None):
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.metrics = metrics or ServerMetrics.for_proposer(engine.proposer)
        self.fallback = AdaptiveFallback(fallback or FallbackConfig(), self.metrics.record_fallback)
        if not self.fallback.config.auto:  # in auto mode it is unknown (NaN) until the first drafted step measures it
            self.metrics.fallback_threshold.set(self.fallback.threshold)
        self.has_drafter = not isinstance(engine.proposer, NoDraftProposer)
        self.block_policy = block_policy  # None: every drafted step uses the proposer's own block size
        self._proposers = {DRAFT: engine.proposer, PLAIN: NoDraftProposer()}
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._admitted = 0  # waiting + decoding; guarded by _cond
        self._running: dict[str, Batch] = {}  # decoder -> batch; decode thread only
        self._requests: dict[int, Request] = {}  # id(seq) -> request; decode thread only
        self._stopping = False
        # draining (`drain`): new requests are refused and the loop stops once those admitted are done or at this
        # time.monotonic(); set without the lock, as a signal handler on the decode thread sets it
        self._drain_deadline: float | None = None
        self._drain_told = False  # the decode thread has logged the drain
        self._thread: threading.Thread | None = None  # the decode thread, once running
        self._spawned: threading.Thread | None = None  # the decode thread when start() made it

    # ---- starting and stopping -----------------------------------------------------------------------
    def start(self) -> None:
        """Decode on a thread of its own (an app embedded in tests or in another program)."""
        self._spawned = self._thread = threading.Thread(target=self.run, name="dflash-decode", daemon=True)
        self._spawned.start()

    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """Decode in the calling thread until `stop()`; `on_start` runs once requests can be submitted.

        Run this in the thread that loaded and warmed up the models when you can (`dflash serve` does): torch
        keeps an OpenMP thread pool per thread that runs ops, and with two pools on a small CPU every op's
        workers sleep and wake instead of spinning; measured on 2 cores, drafted decoding ran 1.5x slower.
        """
        self._thread = threading.current_thread()
        try:
            if on_start is not None:
                on_start()
            self._loop()
        finally:
            with self._cond:
                self._stopping = True
            self._shutdown()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._spawned is not None and self._spawned is not threading.current_thread():
            self._spawned.join(timeout)

    def drain(self, timeout_s: float) -> None:
        """Stop taking requests, and stop decoding once every admitted one (decoding or queued) has finished or
        `timeout_s` from now, whichever is first; those left then fail as at a stop (HTTP 503). A later call can
        only bring the stop forward (`drain(0)`: after the step under way). Safe in a signal handler: it only sets
        a time, which the decode loop reads between steps (an idle one within IDLE_WAKE_S)."""
        deadline = time.monotonic() + timeout_s
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    # ---- the handlers' side ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether requests are taken: the decode thread runs, and it is neither stopping nor draining."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and not self.draining)

    def submit(self, seq: Sequence, workload: str, stream: bool = True) -> Request:
        """Queue a sequence (from the event loop); raises QueueFull when no slot or queue place is left.
        `stream=False`: no per-step token events, only the final one."""
        return self.submit_all([seq], workload, stream)[0]

    def submit_all(self, seqs: list[Sequence], workload: str, stream: bool = True) -> list[Request]:
        """Queue the sequences of one request (its n choices) together, or none of them (QueueFull)."""
        requests = [Request(seq, workload, asyncio.get_running_loop(), self, stream) for seq in seqs]
        with self._cond:
            if not self.alive:
                raise SchedulerClosed(SHUTTING_DOWN)
            if self._admitted + len(requests) > self.capacity:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(f"the server is at capacity ({self.config.max_batch_size} decoding, "
                                f"{self.config.max_queue} queued); retry later")
            self._admitted += len(requests)
            self._waiting.extend(requests)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return requests

    @property
    def capacity(self) -> int:
        """Sequences decoding and queued at most."""
        return self.config.max_batch_size + self.config.max_queue

    def cancel(self, request: Request) -> None:
        """A queued request leaves the queue now; a decoding one is dropped before the next step."""
        with self._cond:
            request.cancelled = True
            queued = request in self._waiting
            if queued:
                self._waiting.remove(request)
                self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        if queued:
            self._finish(request, "abort")

    def counts(self) -> dict[str, int]:
        with self._cond:
            waiting = len(self._waiting)
            return {"waiting": waiting, "running": self._admitted - waiting}

    # ---- the decode thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            new = self._admit()
            if new is None:
                break
            try:
                self._prefill(new)
                for decoder in list(self._running):
                    self._step_or_fail(decoder)
                self._move_rows()
            except Exception as err:  # a bug, not a client's mistake: fail what is decoding, keep serving
                log.exception("decode loop error; failing the running requests")
                self._fail_all(_failure(err, "internal error while decoding"))

    def _step_or_fail(self, decoder: str) -> None:
        """One step of a decoder's batch; an error in it fails that batch only (the other decoder's rows go on)."""
        try:
            self._step(decoder)
        except Exception as err:  # a bug, or the model's: not a client's mistake
            log.exception("decode step error; failing the %s batch's requests", decoder)
            self._fail_batch(decoder, _failure(err, "internal error while decoding"))

    def _fail_all(self, message: str) -> None:
        """Fail every request the decode thread holds: the batches' rows, and any row not in a batch yet (one
        whose merge into a batch failed), which would otherwise hold its slot and its client forever."""
        for decoder in list(self._running):
            self._fail_batch(decoder, message)
        for key, request in list(self._requests.items()):
            del self._requests[key]
            if not request.finished:
                self._finish(request, "error", message)
        self._update_running()

    def _admit(self) -> list[Request] | None:
        """Waiting requests that get a row now (cancelled ones are finished here); None to stop. While rows are
        decoding, their prompts add up to at most `max_prefill_tokens` (or are one prompt): the rest wait for the
        next turn, after a decode step."""
        with self._cond:
            while not self._stopping and not self._running and not self._waiting and not self.draining:
                # a timeout, not an endless wait: a signal the kernel hands to another thread (Ctrl-C, SIGTERM)
                # reaches Python's handler only when this thread runs Python code again
                self._cond.wait(timeout=IDLE_WAKE_S)
            if self._stopping or self._drained():
                return None
            decoding = self._running_rows()
            free = self.config.max_batch_size - decoding
            taken: list[Request] = []
            budget = self.config.max_prefill_tokens if decoding else math.inf
            while self._waiting and len(taken) < free:
                head = self._waiting[0]
                cost = 0 if head.cancelled else len(head.seq.prompt_ids)
                if taken and cost > budget:  # first come, first served: it goes first next turn
                    break
                budget -= cost
                taken.append(self._waiting.popleft())
            self.metrics.waiting.set(len(self._waiting))
        admitted = []
        for request in taken:
            if request.cancelled:
                self._finish(request, "abort")
            else:
                admitted.append(request)
        return admitted

    def _drained(self) -> bool:
        """Whether a drain ends now: every admitted request is done, or its time is up (those left then fail as at
        a stop). Logs what it does; called with the lock held."""
        if self._drain_deadline is None:
            return False
        left = self._running_rows() + len(self._waiting)
        if left == 0:
            if self._drain_told:
                log.warning("drained: every request finished")
            return True
        if time.monotonic() >= self._drain_deadline:
            log.warning("stopping: %d request(s) still decoding or queued end with HTTP 503%s", left,
                        "" if self._drain_told else " (--shutdown-timeout gives them time to finish)")
            return True
        if not self._drain_told:
            self._drain_told = True
            log.warning("draining: new requests are refused; %d decoding and %d queued get up to %.0f s to finish "
                        "(Ctrl-C or SIGTERM again stops them)", self._running_rows(), len(self._waiting),
                        self._drain_deadline - time.monotonic())
        return False

    def _prefill(self, requests: list[Request]) -> None:
        """Run each new prompt through the target and merge the new rows into the running batches."""
        joined: dict[str, list[Batch]] = {}
        for request in requests:
            decoder = DRAFT if self.has_drafter and self.fallback.should_draft(request.workload) else PLAIN
            request.decoder = decoder
            request.probe = self.fallback.probe(request.workload) if decoder == DRAFT else 0
            seq = request.seq
            try:
                batch = self.engine.prefill(seq, self._proposers[decoder])
            except Exception as err:
                log.exception("prefill failed")
                self._finish(request, "error", _failure(err, f"prefill failed: {type(err).__name__}"))
                continue
            self.metrics.decoded.labels(decoder=decoder).inc()
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
            self.metrics.ttft.observe(time.perf_counter() - request.arrival)
            self._send(request, list(seq.output_ids))
            if seq.finished:  # by its first token (a stop, max_tokens), or failed on it (its grammar: seq.error)
                self._finish(request, seq.finish_reason, seq.error)
                continue
            self._requests[id(seq)] = request
            joined.setdefault(decoder, []).append(batch)
        self._join(joined)

    def _join(self, joined: dict[str, list[Batch]]) -> None:
        for decoder, batches in joined.items():
            running = [self._running[decoder]] if decoder in self._running else []
            self._running[decoder] = self.engine.merge(running + batches)
        self._update_running()

    def _move_rows(self) -> None:
        """Rows whose decoder the fallback no longer wants for them rejoin the other decoder's batch."""
        if not (self.has_drafter and self.fallback.config.enabled):
            return
        moving: list[Request] = []
        for decoder in list(self._running):
            batch = self._running[decoder]
            keep = []
            for i, seq in enumerate(batch.sequences):
                request = self._requests[id(seq)]
                wanted = DRAFT if self.fallback.wants_draft(request.workload, request.probe) else PLAIN
                if wanted == decoder:
                    keep.append(i)
                else:
                    moving.append(request)
            if len(keep) < len(batch):
                rest = self.engine.select_rows(batch, keep)
                if rest is None:
                    del self._running[decoder]
                else:
                    self._running[decoder] = rest
        joined: dict[str, list[Batch]] = {}
        for request in moving:
            decoder = PLAIN if request.decoder == DRAFT else DRAFT
            try:
                batch = self.engine.rejoin(request.seq, self._proposers[decoder])
            except Exception as err:
                log.exception("moving a row to %s decoding failed", decoder)
                self._requests.pop(id(request.seq))
                self._finish(request, "error", _failure(err, f"moving the row to {decoder} decoding failed: "
                                                             f"{type(err).__name__}"))
                continue
            if request.decoder == DRAFT:
                self.fallback.finished(request.workload, request.probe)
                request.probe = 0
            request.decoder = decoder
            joined.setdefault(decoder, []).append(batch)
            self.metrics.decoder_moves.labels(to=decoder).inc()
        if joined:
            log.info("fallback: %s", ", ".join(f"{len(b)} decoding rows moved to {d} decoding"
                                               for d, b in joined.items()))
            self._join(joined)

    def _step(self, decoder: str) -> None:
        """Drop cancelled rows, run one draft-verify-accept step, send every row its tokens."""
        batch = self._running[decoder]
        for seq in batch.sequences:
            if self._requests[id(seq)].cancelled:
                seq.finish_reason = "abort"
        if not self._drop_finished(decoder):
            return
        started = time.perf_counter()  # the step's time as served: the engine's step and the bookkeeping around it
        batch = self._running[decoder]
        self.metrics.step_rows.observe(len(batch))
        choose = None
        if decoder == DRAFT and self.block_policy is not None:
            batch.proposer, choose = self.block_policy.plan(batch.sequences)
        rows = len(batch)
        try:
            kept = self.engine.step(batch, choose)
        except RowsFailed as failed:  # a row's NaN logits (a float16 overflow on its text): it alone fails
            log.error("a request failed: %s", failed)
            kept = failed.kept
        block_size = batch.block_size if decoder == DRAFT else 1
        if decoder == DRAFT:
            self.metrics.block_size.set(block_size)
            self._record_drafts(batch)
        for seq, tokens in zip(batch.sequences, kept):
            if tokens:
                self._send(self._requests[id(seq)], tokens)
        self._drop_finished(decoder)
        if decoder != DRAFT or batch.timed_like_its_block:
            self._time_step(decoder, rows, block_size, started, after_drafting=choose is not None)

    def _time_step(self, decoder: str, rows: int, block_size: int, started: float, after_drafting: bool) -> None:
        if self.block_policy is None or self.block_policy.plain_costs is None:
            return
        self.block_policy.observe_step(rows, block_size, time.perf_counter() - started, after_drafting=after_drafting)
        self.metrics.step_overhead.labels(decoder=decoder).set(self.block_policy.overhead.extra_s[decoder == DRAFT])

    def _record_drafts(self, batch: Batch) -> None:
        # What the target accepted of each row's draft (a branch's tokens included) + 1, before a stop or
        # max_tokens cut the row's tokens (as vLLM counts): a last step that keeps 1 of 15 accepted tokens still
        # judged the drafter's 15. A row that failed (`RowsFailed`) drafted nothing the target judged: it counts
        # nowhere
        rows = [r for r, seq in enumerate(batch.sequences) if seq.error is None]
        if not rows:
            return
        self.metrics.record_drafts([batch.produced[r] - 1 for r in rows], batch.verified - 1)
        if self.block_policy is not None:  # the block's own acceptance: a branch's tokens are not its positions'
            self.block_policy.observe([batch.accepted[r] for r in rows], batch.block_size - 1)
        if not self.fallback.config.enabled:
            return
        weight = self._fallback_weight(batch)
        if weight is None:
            return
        by_workload: dict[str, list[float]] = {}
        for r in rows:
            by_workload.setdefault(self._requests[id(batch.sequences[r])].workload, []).append(
                batch.produced[r] * weight)
        for workload, lengths in by_workload.items():
            self.fallback.observe(workload, lengths)

    def _fallback_weight(self, batch: Batch) -> float | None:
        """What a drafted step's acceptance lengths are multiplied by before the fallback judges them, so that
        judging them against the threshold judges whether the step paid at its own block and at the rows its
        workloads would draft with (`_drafting_rows`). A block of k yields at most k tokens and costs what a step
        of k costs: a step that paid as well as plain decoding counts as the threshold. In auto mode the threshold
        is the break-even of every running row at the block the policy would choose, so the weight is that over
        the break-even of the step's own block and rows; with a fixed threshold, the break-even of the block the
        policy would choose for the step's rows over that of its own (1 for a step at the chosen block). Steps
        that ran another block than the threshold's: one cut to what its rows still want (taken as they came, a
        drafter right every time fell back on requests of 2 tokens), a probe's one row (a block of 16, where 8 rows
        would draft 8: its longer lengths passed a threshold set for 8), one row choosing after drafting, and a
        workload drafting beside one that decodes plainly (fewer rows than the threshold's, each step cheaper).
        None: no verdict (no step costs to weigh a cut step by, or no draft token)."""
        policy = self.block_policy
        if policy is None or policy.plain_costs is None:
            return None if batch.cut_short else 1.0
        if batch.block_size < 2:
            return None
        rows = self._drafting_rows(batch)
        reference = self._update_auto_threshold(policy) if self.fallback.config.auto else policy.break_even(rows)
        return reference / policy.break_even(rows, batch.block_size)

    def _update_auto_threshold(self, policy) -> float:
        """Move the auto threshold towards the break-even of the batch drafting would get if it came back, every
        running row (a probe drafts one row while the rest decode plainly, and one row breaks even far sooner than
        eight); publish it, and return it. Once per drafted step, from `_fallback_weight`, whose reference it is."""
        self.fallback.set_threshold(policy.break_even(self._running_rows()))
        self.metrics.fallback_threshold.set(self.fallback.threshold)
        return self.fallback.threshold

    def _drafting_rows(self, batch: Batch) -> int:
        """The rows that would draft together if the workloads of this drafted batch drafted: its own, and a
        probing workload's rows that decode plainly (another workload's plain rows stay plain)."""
        plain = self._running.get(PLAIN)
        if plain is None:
            return len(batch)
        workloads = {self._requests[id(seq)].workload for seq in batch.sequences}
        return len(batch) + sum(self._requests[id(seq)].workload in workloads for seq in plain.sequences)

    def _drop_finished(self, decoder: str) -> bool:
        """Finish and remove done rows; False when the decoder's batch is empty (and removed)."""
        batch = self._running[decoder]
        for seq in batch.sequences:
            if seq.finished:
                self._finish(self._requests.pop(id(seq)), seq.finish_reason, seq.error)
        batch = self.engine.drop_finished(batch)
        if batch is None:
            del self._running[decoder]
        else:
            self._running[decoder] = batch
        self._update_running()
        return batch is not None

    def _fail_batch(self, decoder: str, message: str, unavailable: bool = False) -> None:
        batch = self._running.pop(decoder, None)
        if batch is None:  # the step that failed had dropped its last rows
            return
        for seq in batch.sequences:
            request = self._requests.pop(id(seq), None)
            if request is not None and not request.finished:
                self._finish(request, "error", message, unavailable)
        self._update_running()

    def _send(self, request: Request, tokens: list[int]) -> None:
        self.metrics.generation_tokens.inc(len(tokens))
        if request.stream:
            logprobs = request.seq.logprobs
            request.emit(Event(tokens=tokens, logprobs=logprobs[len(logprobs) - len(tokens):] if logprobs else None))

    def _finish(self, request: Request, reason: str, error: str | None = None, unavailable: bool = False) -> None:
        request.finished = True
        with self._cond:
            self._admitted -= 1
        if request.decoder == DRAFT:  # set only by the decode thread's prefill, which is where this runs then
            self.fallback.finished(request.workload, request.probe)
        self.metrics.finished.labels(finished_reason=reason).inc()
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(time.perf_counter() - request.arrival)
        request.emit(Event(done=True, finish_reason=reason, error=error, unavailable=unavailable))

    def _running_rows(self) -> int:
        return sum(len(b) for b in self._running.values())

    def _update_running(self) -> None:
        self.metrics.running.set(self._running_rows())

    def _shutdown(self) -> None:
        for decoder in list(self._running):
            self._fail_batch(decoder, SHUTTING_DOWN, unavailable=True)
        with self._cond:
            left = list(self._waiting)
            self._waiting.clear()
        for request in left:
            self._finish(request, "error", SHUTTING_DOWN, unavailable=True)


def _failure(err: Exception, internal: str) -> str:
    """What a failed request is told: a `UserError`'s own message (the model's NaN logits and how to load it),
    else that the failure was the server's own."""
    return str(err) if isinstance(err, UserError) else internal
