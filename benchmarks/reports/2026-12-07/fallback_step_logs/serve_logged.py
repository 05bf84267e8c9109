"""Run `dflash serve` with a per-drafted-step log of the auto threshold's inputs (JSON lines to $FBLOG)."""

import json
import os
import sys
import time

from dflash.decoding import block_policy as bp
from dflash.serve import scheduler as sch

LOG = open(os.environ.get("FBLOG", "/tmp/fbwork/steps.jsonl"), "w", buffering=1)
orig_record = sch.Scheduler._record_drafts
orig_observe_step = bp.BlockSizePolicy.observe_step
T0 = time.monotonic()


def observe_step(self, rows, block_size, seconds, now=None, after_drafting=False):
    drafted = block_size > 1
    costs = self.after_drafting_costs if after_drafting else self.costs
    cal = costs(rows, block_size) if drafted else self.plain_costs(rows, 1)
    LOG.write(
        json.dumps(
            dict(ev="time", t=time.monotonic() - T0, rows=rows, k=block_size, ad=after_drafting, s=seconds, cal=cal)
        )
        + "\n"
    )
    return orig_observe_step(self, rows, block_size, seconds, now, after_drafting)


def record(self, batch):
    pol = self.block_policy
    now = time.monotonic()
    running = self._running_rows()
    info = {}
    if pol is not None:
        k = pol.choose(running, now)
        ov = pol.overhead
        info = dict(
            k_be=k,
            drafted_cal=pol.costs(running, k),
            plain_cal=pol.plain_costs(running, 1),
            xd=ov.extra_s.get(True),
            xp=ov.extra_s.get(False),
            fd=ov.fresh(True, now),
            fp=ov.fresh(False, now),
            be=pol.break_even(running, None, now),
        )
    before = self.fallback.threshold
    orig_record(self, batch)
    wl = {}
    for seq in batch.sequences:
        r = self._requests.get(id(seq))
        if r is not None:
            wl[r.workload] = self.fallback._get(r.workload).rolling()
    LOG.write(
        json.dumps(
            dict(
                ev="draft",
                t=now - T0,
                running=running,
                drows=len(batch),
                k=batch.block_size,
                cut=batch.cut_short,
                acc=[batch.produced[i] for i in range(len(batch))],
                thr_before=before,
                thr=self.fallback.threshold,
                rolling=wl,
                plain_rows=len(self._running.get("plain").sequences) if "plain" in self._running else 0,
                **info,
            )
        )
        + "\n"
    )


sch.Scheduler._record_drafts = record
orig_step = sch.Scheduler._step


def step(self, decoder):
    b = self._running.get(decoder)
    rows = len(b) if b is not None else 0
    t = time.perf_counter()
    orig_step(self, decoder)
    s = time.perf_counter() - t
    LOG.write(
        json.dumps(
            dict(
                ev="step",
                t=time.monotonic() - T0,
                dec=decoder,
                rows=rows,
                s=s,
                running=self._running_rows(),
                thr=self.fallback.threshold,
            )
        )
        + "\n"
    )


sch.Scheduler._step = step
bp.BlockSizePolicy.observe_step = observe_step

from dflash.cli.main import main  # noqa: E402 (after the patches above)

sys.exit(main(sys.argv[1:]))
