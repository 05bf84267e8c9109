"""What the terminal shows (the table on stdout, fitted to its width; warnings) and what the plots say."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from dflash.bench.metrics import DRAFT_MODEL, NO_DRAFT, BenchResult
from dflash.bench.report import markdown, plot_histograms, plot_speedup, plot_throughput, print_table, warnings


def local(dataset: str, block_size: int = 16, speedup: float = 2.5, tau: float = 4.4, **kw) -> BenchResult:
    hist = [0, 10, 20, 10, 5] + [0] * (block_size - 4)
    fields = dict(dataset=dataset, backend="local", num_prompts=20, num_requests=20, block_size=block_size,
                  mean_block_size=float(block_size), baseline_tokens_per_s=123.4, dflash_tokens_per_s=308.5,
                  speedup=speedup, mean_acceptance_length=tau, acceptance_histogram=hist, mismatches=0,
                  baseline_cost_per_1m_tokens_usd=8.1, dflash_cost_per_1m_tokens_usd=3.24, dflash_ttft_ms=12.5,
                  baseline_tpot_ms=3.61, dflash_tpot_ms=1.95)
    return BenchResult(**{**fields, **kw})


def server(dataset: str, concurrency: int, **fields) -> BenchResult:
    return BenchResult(dataset=dataset, backend="server", num_prompts=8, num_requests=8, concurrency=concurrency,
                       **fields,
                       baseline_tokens_per_s=100.0 * concurrency, dflash_tokens_per_s=210.0 * concurrency,
                       speedup=2.1, mean_acceptance_length=3.9, dflash_latency_ms={"p50": 800.0, "p99": 1200.0},
                       speedup_per_round=[2.0, 2.1, 2.3])


def rendered(results: list[BenchResult], width: int) -> str:
    out = io.StringIO()
    print_table(results, Console(file=out, width=width, force_terminal=True, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("results", [
    [local("gsm8k"), local("mt-bench", block_size=8, speedup=1.87, tau=3.51), local("humaneval")],
    [server("gsm8k", 1), server("mt-bench", 32)],
])
def test_an_80_column_terminal_shows_datasets_and_key_numbers_whole(results):
    text = rendered(results, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for r in results:
        assert r.dataset in text and f"{r.speedup:.2f}x" in text and f"{r.mean_acceptance_length:.2f}" in text
    assert "more column(s) in results.md" in text
    wide = rendered(results, 250)
    assert "DFlash tok/s" in wide and "more column(s)" not in wide


def test_columns_say_what_drafted_and_a_narrow_terminal_still_drops_them():
    draft_model = [local("gsm8k", drafter=DRAFT_MODEL), local("math500", drafter=DRAFT_MODEL)]
    wide = rendered(draft_model, 250)
    assert "draft model tok/s" in wide and "draft model $/1M" in wide and "DFlash" not in wide
    assert "speedup: draft model tok/s / baseline tok/s" in markdown(draft_model, {})
    narrow = rendered(draft_model, 80)
    assert "draft model $/1M" not in narrow and "more column(s) in results.md" in narrow
    mixed = rendered([local("gsm8k"), local("gsm8k", drafter=DRAFT_MODEL)], 250)
    assert "DFlash tok/s" in mixed  # one table of both: the usual names
    plain = [server("gsm8k", 1, drafter=NO_DRAFT), server("gsm8k", 4, drafter=NO_DRAFT)]  # dflash serve --no-draft
    assert "no-draft tok/s" in rendered(plain, 250) and "DFlash" not in rendered(plain, 250)


def test_a_file_or_pipe_gets_every_column():
    out = io.StringIO()
    print_table([local("gsm8k"), server("gsm8k", 4)], Console(file=out, width=80))  # not a terminal
    assert "DFlash $/1M" in out.getvalue() and "speedup range" in out.getvalue() and "…" not in out.getvalue()


def test_time_to_first_token_and_per_output_token_are_shown_when_measured():
    wide = rendered([local("gsm8k")], 250)
    header = next(line for line in wide.splitlines() if "dataset" in line)
    assert "TTFT ms" in header and "base TPOT ms" in header and "| 12.5 |" in markdown([local("gsm8k")], {})
    assert "3.61" in wide and "1.95" in wide
    unstreamed = server("gsm8k", 1)  # a server benchmark run with --no-stream measures neither
    assert "TTFT" not in markdown([unstreamed], {}).split("tok/s: output tokens")[0]
    alone = server("gsm8k", 1, dflash_ttft_ms=20.0, dflash_tpot_ms=2.0)  # streamed, no --baseline-url: an empty
    table = markdown([alone], {}).split("tok/s: output tokens")[0]  # base TPOT column was shown
    assert "| TTFT ms | TPOT ms |" in table and "base TPOT" not in table


def test_a_partial_level_is_marked_in_the_table_and_left_out_of_the_throughput_plot():
    from dflash.bench.report import plot_throughput

    whole, cut = server("gsm8k", 1), server("gsm8k", 2, partial=True)
    assert "| gsm8k (partial) | - | 2 |" in markdown([whole, cut], {})
    assert plot_throughput([whole, cut]) is None  # one level left to plot: no line
    assert plot_throughput([whole, server("gsm8k", 2)]) is not None


def test_a_speedup_above_tau_is_flagged_as_noise():
    honest, noisy = local("gsm8k", speedup=2.5, tau=4.4), local("math500", speedup=32.95, tau=4.4)
    [line] = warnings([honest, noisy])
    assert line.startswith("math500 (B=16): speedup 32.95x exceeds tau 4.40")
    assert "--max-samples" in line and "--rounds" not in line
    assert "## Warnings" in markdown([honest, noisy], {}) and "## Warnings" not in markdown([honest], {})


def test_mismatches_errors_and_skipped_turns_are_warnings():
    r = local("mt-bench", mismatches=1, mismatched_prompts=["81#0"], errors=2, first_error="HTTP 500: boom",
              skipped_turns=["90#1"])
    lines = warnings([r])
    assert any("1 output(s) differ from plain decoding: 81#0" in line for line in lines)
    assert any("2 request(s) failed; the first: HTTP 500: boom" in line for line in lines)
    assert any("1 later turn(s) left out" in line and "90#1" in line for line in lines)


def test_plots_have_titles_whole_number_ticks_and_a_label_for_every_line():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [local("gsm8k", block_size=8), local("mt-bench", block_size=8)]
    histograms = plot_histograms(results)
    assert histograms._suptitle.get_text()
    for ax in histograms.axes[:2]:
        assert ax.get_title() and all(float(t).is_integer() for t in ax.get_xticks())
    speedup = plot_speedup(results)
    [ax] = speedup.axes
    assert ax.get_title() and {t.get_text() for t in ax.get_legend().get_texts()} == {"B=8", "plain decoding (1x)"}
    throughput = plot_throughput([server("gsm8k", c) for c in (1, 2, 4, 8, 16)])
    [ax] = throughput.axes
    assert ax.get_title() and list(ax.get_xticks()) == [1, 2, 4, 8, 16]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["gsm8k, DFlash", "gsm8k, plain decoding"] and len(ax.get_lines()) == len(labels)
    drafted_by_a_model = plot_throughput([server("gsm8k", c, drafter="draft model") for c in (1, 2)])
    assert drafted_by_a_model.axes[0].get_legend().get_texts()[0].get_text() == "gsm8k, draft model"
    for figure in (histograms, speedup, throughput, drafted_by_a_model):
        plt.close(figure)


def test_the_histograms_title_sits_above_every_panel():
    """With many panels (20 results: a sweep over datasets and block sizes) the title overlapped the top row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [local(name, block_size=b) for name in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
               for b in (2, 4, 8, 16)]
    figure = plot_histograms(results)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    title = figure._suptitle.get_window_extent(renderer)
    assert all(ax.get_tightbbox(renderer).y1 <= title.y0 for ax in figure.axes[:3])
    plt.close(figure)


def test_the_legend_explains_the_speedup_range_only_where_rounds_give_one():
    plain = markdown([local("gsm8k")], {})
    assert "speedup: DFlash tok/s / baseline tok/s; tau" in plain and "min-max" not in plain
    rounds = local("gsm8k")
    rounds.speedup_per_round = [1.9, 2.1, 2.0]
    assert ("(with rounds, the median of the rounds' speedups; speedup range: their min-max; prompts: a round's "
            "conversations, errors: those of every round)") in markdown([rounds], {})


def test_results_md_of_a_run_before_its_first_result_says_so_instead_of_an_empty_table():
    text = markdown([], {"datasets": "gsm8k", "runs_finished": "0 of 2"})
    assert "- runs_finished: 0 of 2" in text and "No run has finished yet" in text
    assert "| dataset |" not in text and "tok/s: output tokens" not in text
    assert "No run has finished yet" not in markdown([local("gsm8k")], {})
