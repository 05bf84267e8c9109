"""What a benchmark measures, and the arithmetic behind each number.

Vocabulary (as in the engine): a verify step is one target forward over [anchor, draft tokens];
its acceptance length is the tokens it produced (accepted draft tokens + one recovered or bonus token),
1..B for block size B. tau (mean acceptance length) is their mean over verify steps, pooled over requests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

DRAFT_MODEL = "draft model"  # BenchResult.drafter of classic speculative decoding with a small causal LM
NO_DRAFT = "none"  # BenchResult.drafter of a server that says it drafts with nothing (`dflash serve --no-draft`)


@dataclass
class BenchResult:
    """One dataset at one setting (block size for the local backend, concurrency for a server)."""

    dataset: str
    backend: str  # "local" or "server"
    num_prompts: int  # conversations sent (an mt-bench conversation has two turns); a server: in each round
    num_requests: int  # generations: one per turn
    distinct_prompts: int | None = None  # distinct samples among the conversations (fewer: prompts repeated)
    baseline_num_prompts: int | None = None  # server: the baseline's conversations in each round (--duration: its own)
    drafter: str = "DFlash"  # what drafted: "DFlash", DRAFT_MODEL (classic) or, a server says so, NO_DRAFT
    block_size: int | str | None = None  # the widest block ("auto": chosen before every step); a server: its drafter's
    mean_block_size: float | None = None  # tokens per verify forward (anchor + draft tokens, a branch's too), averaged
    branch_length: int = 0  # local: the branch verified with each greedy block (0: none)
    concurrency: int | None = None
    temperature: float = 0.0
    max_new_tokens: int = 0
    baseline_tokens_per_s: float | None = None  # output tokens / generation time (TTFT + decode)
    dflash_tokens_per_s: float | None = None
    speedup: float | None = None  # dflash_tokens_per_s / baseline_tokens_per_s; with rounds, their median
    speedup_per_round: list[float] = field(default_factory=list)  # server backend with --rounds > 1
    mean_acceptance_length: float | None = None  # tau
    acceptance_histogram: list[int] = field(default_factory=list)  # [n] = verify steps producing n tokens, 0..B
    # [i] = the share of verify steps that accepted draft token i+1 (vLLM's accepted_per_pos / drafts); with blocks
    # of several sizes (auto, a server's adaptive block) steps too short to reach it count too
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    mismatches: int | None = None  # greedy requests whose DFlash output differs from the baseline's; None: not checked
    mismatched_prompts: list[str] = field(default_factory=list)
    skipped_turns: list[str] = field(default_factory=list)  # local: later turns past the target's context (id#turn)
    baseline_output_tokens: int = 0
    dflash_output_tokens: int = 0
    baseline_ttft_ms: float | None = None  # mean time to first token
    dflash_ttft_ms: float | None = None
    baseline_tpot_ms: float | None = None  # mean time per output token after the first
    dflash_tpot_ms: float | None = None
    baseline_latency_ms: dict[str, float] | None = None  # request latency mean/p50/p90/p99
    dflash_latency_ms: dict[str, float] | None = None
    requests_per_s: float | None = None
    errors: int = 0  # failed requests (a server: on the DFlash server, --base-url)
    baseline_errors: int = 0  # server: failed requests on the baseline server (--baseline-url)
    dflash_answers: int | None = None  # server: requests the DFlash server answered (num_requests less its failures)
    first_error: str | None = None
    baseline_first_error: str | None = None
    notes: list[str] = field(default_factory=list)  # what the backend saw that a reader of the numbers must know
    # server: the level was cut short (a server went away, Ctrl-C); its figures cover what had finished (notes: what)
    partial: bool = False
    baseline_cost_per_1m_tokens_usd: float | None = None
    dflash_cost_per_1m_tokens_usd: float | None = None

    def to_dict(self) -> dict:
        return {k: _rounded(v) for k, v in asdict(self).items()}


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# ---- acceptance -----------------------------------------------------------------------------------------
def acceptance_histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of verify steps by acceptance length, index 0..block_size (0 only when a stop cut a step)."""
    hist = [0] * (block_size + 1)
    for n in lengths:
        hist[min(n, block_size)] += 1
    return hist


def mean_acceptance_length(hist: list[int]) -> float | None:
    steps = sum(hist)
    return sum(n * c for n, c in enumerate(hist)) / steps if steps else None


def acceptance_rate_per_position(hist: list[int]) -> list[float]:
    """[i]: the share of verify steps that accepted draft token i+1 (acceptance length >= i+2)."""
    steps = sum(hist)
    if not steps:
        return []
    return [sum(hist[i + 2:]) / steps for i in range(len(hist) - 2)]


FEW_VERIFY_STEPS = 50  # fewer verify steps than this in a result: its tau and speedup rest on too little


def few_steps_note(steps: float, output_tokens: int, more: str = "--max-samples") -> str | None:
    """What to say when a result rests on few verify steps (None: it does not); `more`: the flag that sends more
    prompts (a server's: --num-prompts or --duration)."""
    if not 0 < steps < FEW_VERIFY_STEPS:
        return None
    one = round(steps) == 1
    return (f"only {steps:.0f} verify step{'' if one else 's'} ({output_tokens} output tokens) "
            f"{'was' if one else 'were'} measured, too few for a steady tau or speedup: raise {more} or "
            "--max-new-tokens")


def histogram_from_counters(drafts: float, accepted_per_pos: list[float]) -> list[int]:
    """Acceptance-length histogram from spec-decode counters: accepted_per_pos[i] counts drafts whose
    draft token i+1 was accepted, so drafts with exactly k accepted = per_pos[k-1] - per_pos[k]."""
    at_least = [drafts] + list(accepted_per_pos) + [0.0]  # at_least[k]: drafts with >= k accepted
    hist = [0] + [max(0, round(at_least[k] - at_least[k + 1])) for k in range(len(at_least) - 1)]
    return hist  # index = accepted + 1 = acceptance length


# ---- timing -------------------------------------------------------------------------------------------
def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """mean and nearest-rank percentiles, in the unit given."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    for q in qs:
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        out[f"p{q}"] = ordered[rank - 1]
    return out


def mean_ms(seconds: list[float | None]) -> float | None:
    """The mean of the known values, in milliseconds (None: none known)."""
    known = [v for v in seconds if v is not None]
    return 1000.0 * sum(known) / len(known) if known else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def cost_per_million_tokens(hourly_usd: float, tokens_per_s: float | None) -> float | None:
    """What 1M output tokens cost on a machine rented at `hourly_usd`, at this throughput."""
    if not tokens_per_s:
        return None
    return hourly_usd / 3600.0 / tokens_per_s * 1e6


def add_costs(results: list[BenchResult], hourly_usd: float | None) -> None:
    if hourly_usd is None:
        return
    for r in results:
        r.baseline_cost_per_1m_tokens_usd = cost_per_million_tokens(hourly_usd, r.baseline_tokens_per_s)
        r.dflash_cost_per_1m_tokens_usd = cost_per_million_tokens(hourly_usd, r.dflash_tokens_per_s)
