"""Prometheus metrics of one server, in their own registry (so two servers in one process never collide).

Spec-decode counters are named like vLLM's `vllm:spec_decode_*` (the exposition adds `_total` to counters):
a draft is one row of one drafted verify step; it has `block_size - 1` draft tokens, of which the accepted
ones are the prefix kept before the recovered/bonus token. Mean acceptance length = 1 + accepted / drafts.
Gauges with no value yet (the mean acceptance length before the first draft, the automatic fallback threshold
before the first drafted step) read NaN rather than a 0 that would look measured.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

DECODERS = ("draft", "plain")  # a request decodes with DFlash (draft) or with the target alone (plain)
FINISH_REASONS = ("stop", "length", "abort", "error")

UNKNOWN = float("nan")  # a gauge with no value yet (Prometheus shows NaN; 0 would read as a measurement)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    @classmethod
    def for_proposer(cls, proposer) -> "ServerMetrics":
        """The metrics of a server drafting with `proposer` (a `decoding.Proposer`): its kind, its draft width."""
        return cls(num_draft_tokens=max(proposer.block_size - 1, 0), drafter=proposer.kind)

    def __init__(self, num_draft_tokens: int = 0, drafter: str = "DFlash"):
        r = self.registry = CollectorRegistry()
        Info("dflash:drafter", "What drafts: DFlash, draft model (classic speculative decoding) or none.",
             registry=r).info({"kind": drafter})
        # requests
        self.running = Gauge("dflash:num_requests_running", "Requests in the decoding batch (each of a request's n "
                             "choices is one).", registry=r)
        self.waiting = Gauge("dflash:num_requests_waiting", "Requests queued for a batch slot (each of a request's n "
                             "choices is one).", registry=r)
        self.step_rows = Histogram("dflash:step_batch_size", "Rows in each decode step's batch.",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.finished = Counter("dflash:request_success", "Finished requests, by finish reason "
                                "(stop, length, abort = client cancelled or disconnected, error).",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("dflash:request_rejected", "Requests refused before decoding, by reason.",
                                ["reason"], registry=r)
        self.decoded = Counter("dflash:request_decoder", "Requests started, by decoder: draft (DFlash) or plain.",
                               ["decoder"], registry=r)
        # every label a counter takes, at 0 from the start: a rate over a series that appears later reads "no data"
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason)
        self.rejected.labels(reason="queue_full")
        for decoder in DECODERS:
            self.decoded.labels(decoder=decoder)
        # tokens and latency
        self.prompt_tokens = Counter("dflash:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("dflash:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("dflash:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dflash:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # speculative decoding
        self.num_drafts = Counter("dflash:spec_decode_num_drafts", "Drafts verified (rows x drafted steps).",
                                  registry=r)
        self.num_draft_tokens = Counter("dflash:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter("dflash:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.accepted_per_pos = Counter("dflash:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the block (0 = first draft token).",
                                        ["position"], registry=r)
        self.mean_acceptance_length = Gauge("dflash:spec_decode_mean_acceptance_length",
                                            "1 + accepted tokens / drafts, since start (NaN before the first "
                                            "draft).", registry=r)
        self.mean_acceptance_length.set(UNKNOWN)
        self.block_size = Gauge("dflash:spec_decode_block_size",
                                "Block size (anchor + draft tokens) of the latest drafted step; it moves with "
                                "the batch under the adaptive block size.", registry=r)
        self.block_size.set(num_draft_tokens + 1 if num_draft_tokens else 0)
        for pos in range(num_draft_tokens):
            self.accepted_per_pos.labels(position=str(pos))
        # adaptive fallback
        self.fallback_active = Gauge("dflash:fallback_active",
                                     "1 while new requests of this workload decode without the drafter.",
                                     ["workload"], registry=r)
        self.fallback_rolling = Gauge("dflash:fallback_rolling_acceptance_length",
                                      "Mean acceptance length over the workload's recent drafts, as the fallback "
                                      "judges them (each step's weighed by what its block cost).",
                                      ["workload"], registry=r)
        self.decoder_moves = Counter("dflash:decoder_moves", "Decoding rows moved to the other decoder when the "
                                     "fallback's verdict changed.", ["to"], registry=r)
        self.fallback_threshold = Gauge("dflash:fallback_threshold_acceptance_length",
                                        "Mean acceptance length below which a workload stops drafting (in auto "
                                        "mode the measured break-even with plain decoding; NaN until the first "
                                        "drafted step measures it).", registry=r)
        self.fallback_threshold.set(UNKNOWN)
        self.step_overhead = Gauge("dflash:step_overhead_seconds",
                                   "Served step time beyond the step time measured at start-up, moving average.",
                                   ["decoder"], registry=r)
        self._drafts = 0
        self._accepted = 0

    def record_drafts(self, accepted: list[int], draft_tokens: int) -> None:
        """One drafted step: `accepted[i]` draft tokens accepted in row i, each row proposing `draft_tokens`. A step
        cut to no draft token (one token left to the context's end or to max_tokens) is no draft."""
        if not accepted or draft_tokens < 1:
            return
        self.num_drafts.inc(len(accepted))
        self.num_draft_tokens.inc(len(accepted) * draft_tokens)
        self.num_accepted_tokens.inc(sum(accepted))
        for n in accepted:
            for pos in range(n):
                self.accepted_per_pos.labels(position=str(pos)).inc()
        self._drafts += len(accepted)
        self._accepted += sum(accepted)
        self.mean_acceptance_length.set(1 + self._accepted / self._drafts)

    def record_fallback(self, workload: str, drafting: bool, rolling: float | None) -> None:
        self.fallback_active.labels(workload=workload).set(0 if drafting else 1)
        if rolling is not None:
            self.fallback_rolling.labels(workload=workload).set(rolling)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
