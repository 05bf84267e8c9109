"""Showing and saving results: a rich table and progress bars in the terminal; results.json, results.md
and PNG plots (matplotlib, Agg) in an output directory."""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash.bench.metrics import BenchResult

# (header, getter, format) of the columns shown in the terminal and in results.md
Column = tuple[str, Callable[[BenchResult], object], str]
COLUMNS: list[Column] = [
    ("dataset", lambda r: r.dataset, "{}"),
    ("B", lambda r: r.block_size, "{}"),
    ("mean B", lambda r: r.mean_block_size, "{:.1f}"),
    ("prompts", lambda r: r.num_prompts, "{}"),
    ("base tok/s", lambda r: r.baseline_tokens_per_s, "{:.1f}"),
    ("DFlash tok/s", lambda r: r.dflash_tokens_per_s, "{:.1f}"),
    ("speedup", lambda r: r.speedup, "{:.2f}x"),
    ("tau", lambda r: r.mean_acceptance_length, "{:.2f}"),
    ("mismatch", lambda r: r.mismatches, "{}"),
]
COST_COLUMNS: list[Column] = [
    ("base $/1M", lambda r: r.baseline_cost_per_1m_tokens_usd, "{:.2f}"),
    ("DFlash $/1M", lambda r: r.dflash_cost_per_1m_tokens_usd, "{:.2f}"),
]
SERVER_COLUMNS: list[Column] = [
    ("conc.", lambda r: r.concurrency, "{}"),
    ("p50 ms", lambda r: (r.dflash_latency_ms or {}).get("p50"), "{:.0f}"),
    ("p99 ms", lambda r: (r.dflash_latency_ms or {}).get("p99"), "{:.0f}"),
    ("errors", lambda r: r.errors, "{}"),
]
ROUNDS_COLUMNS: list[Column] = [("speedup range", lambda r: _spread(r.speedup_per_round), "{}")]


def _spread(values: list[float]) -> str | None:
    """min-max of the rounds' speedups (the speedup column holds their median)."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else None


def columns_for(results: list[BenchResult]) -> list[Column]:
    columns = list(COLUMNS)
    if any(r.backend == "server" for r in results):
        columns += SERVER_COLUMNS
    if any(r.speedup_per_round for r in results):
        columns += ROUNDS_COLUMNS
    if any(r.dflash_cost_per_1m_tokens_usd is not None for r in results):
        columns += COST_COLUMNS
    return columns


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(results: list[BenchResult]) -> Table:
    columns = columns_for(results)
    out = Table(title="dflash bench")
    for header, _, _ in columns:
        out.add_column(header, justify="left" if header == "dataset" else "right")
    for r in results:
        out.add_row(*(cell(get(r), fmt) for _, get, fmt in columns))
    return out


def print_table(results: list[BenchResult], console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    console.print(table(results))
    bad = [r for r in results if r.mismatches]
    for r in bad:
        console.print(f"[bold red]{r.dataset}: {r.mismatches} output(s) differ from plain decoding: "
                      f"{', '.join(r.mismatched_prompts[:10])}[/]")


@contextmanager
def progress_bar(description: str, total: int, console: Console | None = None) -> Iterator[Callable[[], None]]:
    """A progress bar; yields the function to call once per finished request."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


# ---- files --------------------------------------------------------------------------------------------
def write_outputs(results: list[BenchResult], output_dir: str | Path, setup: dict) -> list[Path]:
    """results.json (a list, one object per dataset and setting), config.json, results.md, plots."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "config.json", out / "results.md"]
    written[0].write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    written[1].write_text(json.dumps(setup, indent=2, default=str) + "\n")
    written[2].write_text(markdown(results, setup))
    return written + write_plots(results, out)


def markdown(results: list[BenchResult], setup: dict) -> str:
    columns = columns_for(results)
    lines = ["# dflash bench", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items() if v not in (None, "", [])]
    lines += ["", "| " + " | ".join(h for h, _, _ in columns) + " |",
              "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(get(r), fmt) for _, get, fmt in columns) + " |" for r in results]
    lines += ["", "tok/s: output tokens per second of generation time; speedup: DFlash tok/s / baseline tok/s "
              "(with rounds, the median of the rounds' speedups; speedup range: their min-max); "
              "tau: mean acceptance length (tokens per verify step); mismatches: greedy outputs that differ "
              "from plain decoding (must be 0).", ""]
    return "\n".join(lines)


def write_plots(results: list[BenchResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, plot in (("acceptance_histogram.png", plot_histograms), ("speedup.png", plot_speedup),
                       ("throughput_vs_concurrency.png", plot_throughput)):
        figure = plot(results)
        if figure is not None:
            figure.savefig(out / name, dpi=120, bbox_inches="tight")
            written.append(out / name)
            import matplotlib.pyplot as plt

            plt.close(figure)
    return written


def _label(r: BenchResult) -> str:
    setting = f"B={r.block_size}" if r.backend == "local" else f"c={r.concurrency}"
    return f"{r.dataset} ({setting})"


def plot_histograms(results: list[BenchResult]):
    import matplotlib.pyplot as plt

    shown = [r for r in results if sum(r.acceptance_histogram)]
    if not shown:
        return None
    cols = min(3, len(shown))
    rows = (len(shown) + cols - 1) // cols
    figure, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, r in zip(axes.flat, shown):
        total = sum(r.acceptance_histogram)
        ax.bar(range(len(r.acceptance_histogram)), [c / total for c in r.acceptance_histogram], color="tab:blue")
        ax.set_title(f"{_label(r)}  tau={r.mean_acceptance_length:.2f}", fontsize=9)
        ax.set_xlabel("acceptance length (tokens per verify step)")
        ax.set_ylabel("share of verify steps")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    figure.tight_layout()
    return figure


def plot_speedup(results: list[BenchResult]):
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.speedup is not None]
    if not shown:
        return None
    datasets = list(dict.fromkeys(r.dataset for r in shown))
    settings = list(dict.fromkeys(_label(r).split(" ", 1)[1] for r in shown))
    width = 0.8 / len(settings)
    figure, ax = plt.subplots(figsize=(max(5, 1.6 * len(datasets)), 3.5))
    for j, setting in enumerate(settings):
        values = {r.dataset: r.speedup for r in shown if _label(r).split(" ", 1)[1] == setting}
        xs = [i + j * width for i, d in enumerate(datasets) if d in values]
        ax.bar(xs, [values[d] for d in datasets if d in values], width, label=setting.strip("()"))
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over plain decoding")
    if len(settings) > 1:
        ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_throughput(results: list[BenchResult]):
    import matplotlib.pyplot as plt

    by_dataset: dict[str, list[BenchResult]] = defaultdict(list)
    for r in results:
        if r.backend == "server" and r.concurrency is not None:
            by_dataset[r.dataset].append(r)
    if not any(len({r.concurrency for r in rs}) > 1 for rs in by_dataset.values()):
        return None
    figure, ax = plt.subplots(figsize=(5.5, 3.5))
    for dataset, rs in by_dataset.items():
        rs = sorted(rs, key=lambda r: r.concurrency)
        line = ax.plot([r.concurrency for r in rs], [r.dflash_tokens_per_s or 0 for r in rs], marker="o",
                       label=f"{dataset}")
        if any(r.baseline_tokens_per_s for r in rs):
            ax.plot([r.concurrency for r in rs], [r.baseline_tokens_per_s or 0 for r in rs], marker="x",
                    linestyle="--", color=line[0].get_color(), label=f"{dataset} baseline")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure
