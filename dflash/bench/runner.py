"""One benchmark run: every dataset, at every block size (local) or concurrency (server).

Everything that can be checked is checked before the first measurement (block sizes, prompt lengths,
both servers). The output directory is written when the run starts and again after every finished
(dataset, setting), so it always describes this run alone and an interrupt or a later failure keeps
every finished measurement.
"""

from __future__ import annotations

import os
import platform
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterator

from rich.console import Console

from dflash.bench import report
from dflash.bench.datasets import DATA_DIR_ENV, DataOptions, Sample, data_source, load_samples, resolve_names
from dflash.bench.local import LocalBackend, LocalConfig
from dflash.bench.metrics import BenchResult, add_costs
from dflash.chat import PLAIN_CONVERSATION_NOTE
from dflash.decoding.engine import AUTO
from dflash.errors import UserError, in_brief
from dflash.model.target import TargetModel

if TYPE_CHECKING:  # the server backend needs httpx (the `bench` extra); a local run does not
    from dflash.bench.server import ServerBackend, ServerConfig


@dataclass
class BenchConfig:
    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    data: DataOptions = field(default_factory=DataOptions)
    backend: str = "local"  # "local" or "server"
    block_sizes: list[int | str | None] = field(default_factory=lambda: [None])  # local; None: the drafter's own
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None  # None: not given (off in this process; a server's own default); 0 or -1: off
    branch_length: int = 0  # local DFlash runs: a branch with each greedy block (`decoding.branch`)
    seed: int = 0
    warmup_tokens: int = 16
    server: ServerConfig | None = None  # required for the server backend
    output_dir: str | None = None
    gpu_hourly_usd: float | None = None
    show_progress: bool = True


def load_data(config: BenchConfig) -> dict[str, list[Sample]]:
    """Each dataset's samples (a UserError names a missing source, or the file and line of a bad record)."""
    return {config.data.labelled(name): load_samples(name, config.data) for name in resolve_names(config.datasets)}


def run_bench(config: BenchConfig, pipe=None, console: Console | None = None,
              stdout: Console | None = None, data: dict[str, list[Sample]] | None = None) -> list[BenchResult]:
    """Run, print the table (to `stdout`; progress and warnings to `console`, stderr), write the output
    directory; `pipe` (a `DFlash`) for the local backend; `data`: `load_data(config)` when the caller read it
    already (before loading the models)."""
    console = console or Console(stderr=True)
    stdout = stdout or Console()
    data = load_data(config) if data is None else data
    if config.backend == "server":
        runs = _server_runs(config, _server_backend(config, data, console), data, console)
    else:
        runs = _local_runs(config, _local_backend(config, data, pipe, console), data, console)
    info = setup(config, pipe, data)
    if config.output_dir:
        info["runs_finished"] = f"0 of {planned_runs(config)}"  # a run stopped before its first result says so
        _write([], config, info)  # this run's config; no stale results or plots
    results: list[BenchResult] = []
    written = 0  # results the output directory holds whole (its plots included)
    try:
        for result in runs:
            add_costs([result], config.gpu_hourly_usd)
            results.append(result)
            if config.output_dir:
                info["runs_finished"] = f"{_finished(results)} of {planned_runs(config)}"  # a stopped run says so
                _write(results, config, info)
                written = len(results)
    except (Exception, KeyboardInterrupt) as err:
        if isinstance(err, KeyboardInterrupt) and config.output_dir and written < len(results):
            if _write_again(results, config, info):  # Ctrl-C came while the files were written: plots lagged
                written = len(results)
        _show_partial(results, written, config, err, console, stdout)
        raise
    report.print_table(results, stdout)
    report.print_warnings(results, console)
    if config.output_dir:
        console.print(f"wrote results.json, results.md, config.json and plots to {config.output_dir}",
                      soft_wrap=True, highlight=False)
    return results


def _write(results: list[BenchResult], config: BenchConfig, info: dict) -> None:
    """The output directory rewritten; a failure to write it is a UserError that names it."""
    try:
        report.write_outputs(results, config.output_dir, info)
    except OSError as err:
        raise UserError(f"could not write the results into {config.output_dir} ({in_brief(err)}): free some space or "
                        "fix its permissions, or give another --output-dir") from None


def _write_again(results: list[BenchResult], config: BenchConfig, info: dict) -> bool:
    """Finish the write an interrupt cut short (each file is replaced whole, but results.json could be one run ahead
    of the plots); a second Ctrl-C leaves them as they are. Whether it finished."""
    with suppress(Exception, KeyboardInterrupt):
        report.write_outputs(results, config.output_dir, info)
        return True
    return False


def planned_runs(config: BenchConfig) -> int:
    settings = config.server.concurrency if config.backend == "server" and config.server else config.block_sizes
    return len(resolve_names(config.datasets)) * len(settings)


def _finished(results: list[BenchResult]) -> int:
    """The finished runs among the results: a server level cut short (a server gone, Ctrl-C) yields a partial one."""
    return sum(not r.partial for r in results)


def _show_partial(results: list[BenchResult], written: int, config: BenchConfig, err: BaseException,
                  console: Console, stdout: Console) -> None:
    """What a stopped run had measured, and where it is (`written`: how many results the output directory holds
    whole); the CLI then names the interrupt or the error."""
    if not results:
        return
    report.print_table(results, stdout)
    report.print_warnings(results, console)
    stopped = "interrupted" if isinstance(err, KeyboardInterrupt) else "stopped by the error below"
    if not config.output_dir:
        where = "in the table above (--output-dir saves them as they finish)"
    elif written == len(results):
        where = f"saved in {config.output_dir} (results.json, results.md, plots)"
    else:
        where = (f"in the table above; {config.output_dir} was last written whole with the first {written} (writing "
                 "it again failed, so some of its files may hold more)" if written
                 else f"in the table above (writing {config.output_dir} failed partway, so its files may hold "
                 "some of them: the plots are written last)")
    whole = _finished(results)
    when = (f"in run {whole + 1} of {planned_runs(config)} (what it had measured is marked partial)"
            if whole < len(results) else f"after {whole} of {planned_runs(config)} runs")
    console.print(f"{stopped} {when}; the finished ones are {where}", style="bold yellow", highlight=False,
                  soft_wrap=True)


# ---- local ----------------------------------------------------------------------------------------------
def _local_config(config: BenchConfig, block_size: int | str | None) -> LocalConfig:
    return LocalConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature, block_size=block_size,
                       seed=config.seed, warmup_tokens=config.warmup_tokens, top_p=config.top_p,
                       top_k=config.top_k or 0, branch_length=config.branch_length)


def _local_backend(config: BenchConfig, data: dict[str, list[Sample]], pipe,
                   console: Console) -> LocalBackend:
    """The pair, with every block size and every first turn checked before any decoding."""
    backend = LocalBackend(pipe)
    if pipe.tokenizer is not None and not pipe.has_chat_template:
        console.print(f"warning: {PLAIN_CONVERSATION_NOTE}", style="yellow", highlight=False, soft_wrap=True)
    widest = max(config.block_sizes, key=backend.block_size)  # raises for a size the drafter cannot use
    backend.check_context(data, _local_config(config, widest))
    return backend


def _local_runs(config: BenchConfig, backend: LocalBackend, data: dict[str, list[Sample]],
                console: Console) -> Iterator[BenchResult]:
    for block_size in config.block_sizes:
        local = _local_config(config, block_size)
        for name, samples in data.items():
            turns = sum(len(s.turns) for s in samples)
            label = f"{name} B={block_size if block_size == AUTO else backend.block_size(block_size)}"
            with _progress(config, label, turns, console) as advance:
                result = backend.run(name, samples, local, on_turn=advance)
            yield result


# ---- server ---------------------------------------------------------------------------------------------
def _server_backend(config: BenchConfig, data: dict[str, list[Sample]], console: Console) -> ServerBackend:
    """Both servers checked and warmed up (a failed warm-up is a UserError before the output directory is
    touched)."""
    from dflash.bench.server import ServerBackend

    server = config.server
    server.max_new_tokens, server.temperature, server.seed = config.max_new_tokens, config.temperature, config.seed
    server.top_p, server.top_k = config.top_p, config.top_k
    backend = ServerBackend(server)  # both servers answer and serve the model, or a UserError
    server.model = backend.client.model  # config.json records the name sent, not None for "the first listed"
    for warning in backend.warnings:
        console.print(f"warning: {warning}", style="yellow", highlight=False, soft_wrap=True)
    if not backend.warmed_up:
        backend.warm_up(next(iter(data.values()))[0])  # the sample the first level would warm up with
    return backend


def _server_runs(config: BenchConfig, backend: ServerBackend, data: dict[str, list[Sample]],
                 console: Console) -> Iterator[BenchResult]:
    from dflash.bench.server import LevelCut, short_answers_warning

    server = config.server
    warned = False
    for name, samples in data.items():
        repeats = repeated_prompts_warning(name, backend.num_prompts(samples), len(samples), config)
        if repeats:
            console.print(f"warning: {repeats}", style="yellow", highlight=False, soft_wrap=True)
        for concurrency in server.concurrency:
            total = sum(len(s.turns) for s in samples) * backend.num_prompts(samples) // len(samples)
            total *= (2 if server.baseline_url else 1) * server.rounds
            try:
                with _progress(config, f"{name} c={concurrency}", total, console) as advance:
                    result = backend.run_level(name, samples, concurrency, on_request=advance)
            except LevelCut as cut:  # what the level had measured is reported (and saved), then the run stops
                if cut.result is not None:
                    yield cut.result
                raise cut.error from None
            warning = None if warned else short_answers_warning(result, server)
            if warning:
                console.print(f"warning: {warning}", style="yellow", highlight=False, soft_wrap=True)
                warned = True
            yield result


def repeated_prompts_warning(name: str, conversations: int, distinct: int, config: BenchConfig) -> str | None:
    """What to say when a level sends some samples more than once (None: it does not, or --duration cycles them
    by design): a server's prefix cache answers a repeated prompt's prefill from memory."""
    if conversations <= distinct or config.server.duration_s is not None:
        return None
    why = (f"--max-samples {config.data.max_samples} loads no more; raise it"
           if config.data.max_samples and distinct == config.data.max_samples else f"{name} holds no more")
    return (f"{name}: {conversations} conversations per level from {distinct} distinct samples ({why}): prompts "
            "repeat, and a server's prefix cache answers a repeated prompt's prefill from memory, which flatters "
            "TTFT and throughput")


def _progress(config: BenchConfig, label: str, total: int, console: Console):
    if config.show_progress:
        return report.progress_bar(label, total, console)
    return nullcontext(lambda: None)


# ---- what was measured --------------------------------------------------------------------------------
def setup(config: BenchConfig, pipe=None, data: dict[str, list[Sample]] | None = None) -> dict:
    """What was measured, on what, from which data: saved next to the results."""
    import torch

    info = {
        "backend": config.backend,
        "datasets": [config.data.labelled(name) for name in resolve_names(config.datasets)],
        "data_file": config.data.data_file,
        "data_dir": config.data.data_dir or os.environ.get(DATA_DIR_ENV),
        "data_sources": {config.data.labelled(name): data_source(name, config.data)
                         for name in resolve_names(config.datasets)},
        "max_samples": config.data.max_samples,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p if config.top_p != 1.0 else None,
        "top_k": config.top_k,  # None: not given (against a server, its own default applied)
        "gpu_hourly_usd": config.gpu_hourly_usd,
        "machine": platform.platform(),
        "torch": torch.__version__,
    }
    if config.backend == "server" and config.server is not None:
        info.update({k: v for k, v in asdict(config.server).items() if k != "api_key" and k not in info})
        from dflash.bench.server import default_metrics_url

        info["metrics_url"] = config.server.metrics_url or default_metrics_url(config.server.base_url)  # the one read
    if pipe is not None:
        info["target"] = str(getattr(pipe.target.model.config, "_name_or_path", "") or "")
        info["draft"] = _draft_source(pipe.drafter)
        if getattr(pipe.drafter, "draft_head", None) is not None:  # measured faster on this CPU, or asked for
            info["drafter_products"] = "bfloat16"
        info["device"] = str(pipe.target.device)
        info["dtype"] = str(pipe.target.dtype)
        info["block_sizes"] = [b or pipe.engine.proposer.block_size for b in config.block_sizes]
        info["branch_length"] = config.branch_length or None  # results.md lists it when a run verified branches
        info["warmup_tokens"] = config.warmup_tokens
        info["chat_template_kwargs"] = pipe.chat_template_kwargs or None
    if data is not None:
        info["sample_ids"] = {name: [s.id for s in samples] for name, samples in data.items()}
    return info


def _draft_source(drafter) -> str | None:
    """Where the pipeline's drafter came from: a DFlash drafter's directory or hub id, a draft model's name."""
    if isinstance(drafter, TargetModel):  # a draft model
        return getattr(drafter.model.config, "_name_or_path", None) or None
    return getattr(drafter, "source", None)
