"""Showing and saving results: a rich table (stdout) and progress bars (stderr) in the terminal;
results.json, config.json, results.md and PNG plots (matplotlib, Agg) in an output directory."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from rich.cells import cell_len
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash.bench.metrics import DRAFT_MODEL, NO_DRAFT, BenchResult

PLOTS = ("acceptance_histogram.png", "speedup.png", "throughput_vs_concurrency.png")
OUTPUT_FILES = ("results.json", "config.json", "results.md", *PLOTS)  # what `write_outputs` writes (or removes)
SAMPLE_IDS_SHOWN = 50  # in results.md; config.json has them all


@dataclass(frozen=True)
class Column:
    """One column of the terminal table and of results.md."""

    header: str
    get: Callable[[BenchResult], object]
    fmt: str = "{}"
    key: bool = False  # never dropped, never cut: what a run is about


COLUMNS: list[Column] = [
    Column("dataset", lambda r: r.dataset + (" (partial)" if r.partial else ""), key=True),
    Column("B", lambda r: r.block_size, key=True),
    Column("mean B", lambda r: r.mean_block_size, "{:.1f}"),
    Column("prompts", lambda r: r.num_prompts),
    Column("base tok/s", lambda r: r.baseline_tokens_per_s, "{:.1f}"),
    Column("DFlash tok/s", lambda r: r.dflash_tokens_per_s, "{:.1f}"),
    Column("speedup", lambda r: r.speedup, "{:.2f}x", key=True),
    Column("tau", lambda r: r.mean_acceptance_length, "{:.2f}", key=True),
    Column("mismatch", lambda r: r.mismatches, key=True),
]
TIMING_COLUMNS: list[Column] = [  # when measured: local decoding, or streamed server requests
    Column("TTFT ms", lambda r: r.dflash_ttft_ms, "{:.1f}"),
    Column("TPOT ms", lambda r: r.dflash_tpot_ms, "{:.2f}"),
]
BASELINE_TPOT = Column("base TPOT ms", lambda r: r.baseline_tpot_ms, "{:.2f}")  # before TPOT, when measured
COST_COLUMNS: list[Column] = [
    Column("base $/1M", lambda r: r.baseline_cost_per_1m_tokens_usd, "{:.2f}"),
    Column("DFlash $/1M", lambda r: r.dflash_cost_per_1m_tokens_usd, "{:.2f}"),
]
CONCURRENCY = Column("conc.", lambda r: r.concurrency, key=True)  # server: after B
SERVER_COLUMNS: list[Column] = [
    Column("p50 ms", lambda r: (r.dflash_latency_ms or {}).get("p50"), "{:.0f}"),
    Column("p99 ms", lambda r: (r.dflash_latency_ms or {}).get("p99"), "{:.0f}"),
    Column("errors", lambda r: r.errors, key=True),
]
BASELINE_ERRORS = Column("base errors", lambda r: r.baseline_errors, key=True)  # with --baseline-url
DISTINCT = Column("distinct", lambda r: r.distinct_prompts)  # after prompts, when some repeated
ROUNDS_COLUMNS: list[Column] = [Column("speedup range", lambda r: _spread(r.speedup_per_round))]
# a narrow terminal drops these first (results.md keeps every column)
DROP_ORDER = ("DFlash $/1M", "base $/1M", "base TPOT ms", "TPOT ms", "TTFT ms", "speedup range",
              "p99 ms", "p50 ms", "mean B", "distinct", "prompts", "base tok/s",
              "DFlash tok/s")


def _spread(values: list[float]) -> str | None:
    """min-max of the rounds' speedups (the speedup column holds their median)."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else None


def drafted_by(results: list[BenchResult]) -> str:
    """What the results' drafting is called: "DFlash"; "draft model" when every run drafted with one, "no-draft"
    when every server said it drafts with nothing (the --base-url server was a plain one)."""
    for drafter, label in ((DRAFT_MODEL, DRAFT_MODEL), (NO_DRAFT, "no-draft")):
        if results and all(r.drafter == drafter for r in results):
            return label
    return "DFlash"


def columns_for(results: list[BenchResult]) -> list[Column]:
    columns = list(COLUMNS)
    if any(r.backend == "server" for r in results):
        columns.insert(2, CONCURRENCY)
        columns += SERVER_COLUMNS
        if any(r.baseline_tokens_per_s is not None or r.baseline_errors for r in results):
            columns.append(BASELINE_ERRORS)
    if any(r.distinct_prompts is not None and r.distinct_prompts < r.num_prompts for r in results):
        columns.insert([c.header for c in columns].index("prompts") + 1, DISTINCT)
    if any(r.dflash_ttft_ms is not None for r in results):
        columns += TIMING_COLUMNS
        if any(r.baseline_tpot_ms is not None for r in results):
            columns.insert(len(columns) - 1, BASELINE_TPOT)
    if any(r.speedup_per_round for r in results):
        columns += ROUNDS_COLUMNS
    if any(r.dflash_cost_per_1m_tokens_usd is not None for r in results):
        columns += COST_COLUMNS
    label = drafted_by(results)
    return [replace(c, header=c.header.replace("DFlash", label)) for c in columns]


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


# ---- terminal -----------------------------------------------------------------------------------------
def fit_columns(columns: list[Column], results: list[BenchResult], width: int | None) -> list[Column]:
    """The columns that fit `width` terminal cells: secondary ones are dropped (DROP_ORDER) until the
    table fits; key columns always stay. None: no limit."""
    kept = list(columns)
    label = drafted_by(results)
    for header in DROP_ORDER:
        if width is None or table_width(kept, results) <= width:
            break
        kept = [c for c in kept if c.header != header.replace("DFlash", label)]
    return kept


def table_width(columns: list[Column], results: list[BenchResult]) -> int:
    """Cells of a rich table with edges and one space of padding each side: |_a_|_b_|."""
    return sum(_width(c, results) + 3 for c in columns) + 1


def _width(column: Column, results: list[BenchResult]) -> int:
    return max([cell_len(column.header)] + [cell_len(cell(column.get(r), column.fmt)) for r in results])


def table(results: list[BenchResult], width: int | None = None) -> Table:
    columns = fit_columns(columns_for(results), results, width)
    dropped = len(columns_for(results)) - len(columns)
    caption = f"{dropped} more column(s) in results.md, or widen the terminal" if dropped else None
    out = Table(title="dflash bench", caption=caption)
    fits = width is None or table_width(columns, results) <= width
    for c in columns:  # a key column keeps its width; on a terminal too narrow even for those, cells fold
        out.add_column(c.header, justify="left" if c.header == "dataset" else "right", overflow="fold",
                       min_width=_width(c, results) if c.key and fits else None)
    for r in results:
        out.add_row(*(cell(c.get(r), c.fmt) for c in columns))
    return out


def print_table(results: list[BenchResult], console: Console | None = None) -> None:
    """To a terminal: as many columns as fit. Elsewhere (a file, a pipe): every column."""
    console = console or Console()
    if console.is_terminal:
        console.print(table(results, console.width))
        return
    width = max(console.width, table_width(columns_for(results), results))
    Console(file=console.file, width=width, color_system=None).print(table(results))


def warnings(results: list[BenchResult]) -> list[str]:
    """What a reader of the numbers must know: lossy outputs, failed requests, skipped turns, a speedup
    that timing noise must have inflated, and what the backend noted (`BenchResult.notes`)."""
    out = []
    for r in results:
        where = f"{r.dataset} ({_setting(r)})"
        if r.mismatches:
            out.append(f"{where}: {r.mismatches} output(s) differ from plain decoding: "
                       f"{', '.join(r.mismatched_prompts[:10])}")
        if r.errors:
            server = " to the DFlash server (--base-url)" if r.backend == "server" else ""
            out.append(f"{where}: {r.errors} request(s){server} failed; the first: {r.first_error}")
        if r.baseline_errors:
            out.append(f"{where}: {r.baseline_errors} request(s) to the baseline server (--baseline-url) failed; the "
                       f"first: {r.baseline_first_error}")
        if r.skipped_turns:
            out.append(f"{where}: {len(r.skipped_turns)} later turn(s) left out, their conversation outgrew the "
                       f"target's context: {', '.join(r.skipped_turns[:10])} (lower --max-new-tokens to keep them)")
        if r.speedup is not None and r.mean_acceptance_length is not None and r.speedup > r.mean_acceptance_length:
            out.append(f"{where}: speedup {r.speedup:.2f}x exceeds tau {r.mean_acceptance_length:.2f}, which an "
                       "honest measurement cannot (a verify step costs at least a plain decoding step): timing "
                       "noise, likely a busy machine; measure more with --max-samples / --max-new-tokens"
                       + (" / --rounds" if r.backend == "server" else ""))
        out += [f"{where}: {note}" for note in r.notes]
    return out


def print_warnings(results: list[BenchResult], console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    for line in warnings(results):
        console.print(f"warning: {line}", style="bold red" if "differ" in line else "yellow", highlight=False,
                      soft_wrap=True)


@contextmanager
def progress_bar(description: str, total: int, console: Console | None = None) -> Iterator[Callable[[], None]]:
    """A progress bar; yields the function to call once per finished request."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


# ---- files --------------------------------------------------------------------------------------------
def write_outputs(results: list[BenchResult], output_dir: str | Path, setup: dict) -> list[Path]:
    """results.json (a list, one object per dataset and setting), config.json, results.md, plots; plots
    this call does not draw are removed, so the directory never mixes two runs. Each file is replaced
    whole (written aside, then renamed): an interrupt never leaves half a file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for aside in out.glob(".*.partial"):  # what a killed write left beside its file
        aside.unlink(missing_ok=True)
    written = [out / "results.json", out / "config.json", out / "results.md"]
    _replace(written[0], lambda p: p.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n"))
    _replace(written[1], lambda p: p.write_text(json.dumps(setup, indent=2, default=str) + "\n"))
    _replace(written[2], lambda p: p.write_text(markdown(results, setup)))
    return written + write_plots(results, out)


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    aside = path.with_name(f".{path.name}.partial")
    try:
        write(aside)
        os.replace(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)  # no half-written file left beside the whole one
        raise


def markdown(results: list[BenchResult], setup: dict) -> str:
    columns = columns_for(results)
    lines = ["# dflash bench", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items() if v not in (None, "", [], {}) and k != "sample_ids"]
    lines += [f"- sample ids, {name} ({len(ids)}): {_ids(ids)}" for name, ids in setup.get("sample_ids", {}).items()]
    if not results:  # a run stopped (or still running) before its first result
        return "\n".join(lines + ["", "No run has finished yet: this file is rewritten as each one finishes.", ""])
    lines += ["", "| " + " | ".join(c.header for c in columns) + " |",
              "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(c.get(r), c.fmt) for c in columns) + " |" for r in results]
    label = drafted_by(results)
    rounds = (" (with rounds, the median of the rounds' speedups; speedup range: their min-max; prompts: a round's "
              "conversations, errors: those of every round)"
              if any(r.speedup_per_round for r in results) else "")
    lines += ["", f"tok/s: output tokens per second of generation time; speedup: {label} tok/s / baseline tok/s"
              f"{rounds}; "
              f"tau: mean acceptance length (tokens per verify step); TTFT: mean time to the first token ({label}); "
              "TPOT: mean time per output token after the first; mismatches: outputs (greedy, or sampled "
              "with the same seed) that differ "
              "from plain decoding (must be 0).", ""]
    notes = warnings(results)
    if notes:
        lines += ["## Warnings", ""] + [f"- {line}" for line in notes] + [""]
    return "\n".join(lines)


def _ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:SAMPLE_IDS_SHOWN])
    return shown + (f", ... (all {len(ids)} in config.json)" if len(ids) > SAMPLE_IDS_SHOWN else "")


def write_plots(results: list[BenchResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, plot in zip(PLOTS, (plot_histograms, plot_speedup, plot_throughput)):
        figure = plot(results)
        if figure is None:
            (out / name).unlink(missing_ok=True)  # an earlier run's plot of something this run did not measure
            continue
        _replace(out / name, lambda p, figure=figure: figure.savefig(p, format="png", dpi=120, bbox_inches="tight"))
        plt.close(figure)
        written.append(out / name)
    return written


def _setting(r: BenchResult) -> str:
    return f"B={r.block_size}" if r.backend == "local" else f"c={r.concurrency}"


def _label(r: BenchResult) -> str:
    return f"{r.dataset} ({_setting(r)})"


def plot_histograms(results: list[BenchResult]):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [r for r in results if sum(r.acceptance_histogram)]
    if not shown:
        return None
    cols = min(3, len(shown))
    rows = (len(shown) + cols - 1) // cols
    height = 3.2 * rows + 0.4
    figure, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, height), squeeze=False)
    for ax, r in zip(axes.flat, shown):
        total = sum(r.acceptance_histogram)
        ax.bar(range(len(r.acceptance_histogram)), [c / total for c in r.acceptance_histogram], color="tab:blue")
        ax.set_title(f"{_label(r)}  tau={r.mean_acceptance_length:.2f}", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # acceptance lengths are whole tokens
        ax.set_xlabel("acceptance length (tokens per verify step)")
        ax.set_ylabel("share of verify steps")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    figure.suptitle(f"{drafted_by(shown)} acceptance length per verify step")
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))  # the top 0.4 inch is the title's: no panel under it
    return figure


def plot_speedup(results: list[BenchResult]):
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.speedup is not None]
    if not shown:
        return None
    datasets = list(dict.fromkeys(r.dataset for r in shown))
    settings = list(dict.fromkeys(_setting(r) for r in shown))
    width = 0.8 / len(settings)
    figure, ax = plt.subplots(figsize=(max(5, 1.6 * len(datasets)), 3.5))
    for j, setting in enumerate(settings):
        values = {r.dataset: r.speedup for r in shown if _setting(r) == setting}
        xs = [i + j * width for i, d in enumerate(datasets) if d in values]
        ax.bar(xs, [values[d] for d in datasets if d in values], width, label=setting)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label="plain decoding (1x)")
    ax.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{drafted_by(shown)} speedup over plain decoding")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    figure.tight_layout()
    return figure


def plot_throughput(results: list[BenchResult]):
    import matplotlib.pyplot as plt

    by_dataset: dict[str, list[BenchResult]] = defaultdict(list)
    for r in results:
        if r.backend == "server" and r.concurrency is not None and not r.partial:  # a cut level reads low
            by_dataset[r.dataset].append(r)
    if not any(len({r.concurrency for r in rs}) > 1 for rs in by_dataset.values()):
        return None
    figure, ax = plt.subplots(figsize=(5.5, 3.5))
    for dataset, rs in by_dataset.items():
        rs = sorted(rs, key=lambda r: r.concurrency)
        line = ax.plot([r.concurrency for r in rs], [r.dflash_tokens_per_s or 0 for r in rs], marker="o",
                       label=f"{dataset}, {drafted_by(rs)}")
        if any(r.baseline_tokens_per_s for r in rs):
            ax.plot([r.concurrency for r in rs], [r.baseline_tokens_per_s or 0 for r in rs], marker="x",
                    linestyle="--", color=line[0].get_color(), label=f"{dataset}, plain decoding")
    levels = sorted({r.concurrency for rs in by_dataset.values() for r in rs})
    if levels[-1] >= 8 * levels[0]:
        ax.set_xscale("log", base=2)  # 1, 2, 4, ... 64 evenly spaced
        ax.minorticks_off()
    ax.set_xticks(levels, [str(c) for c in levels])  # the levels measured, whole numbers
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput by concurrency")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure
