"""One benchmark run: every dataset, at every block size (local) or concurrency (server)."""

from __future__ import annotations

import platform
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

from rich.console import Console

from dflash.bench import report
from dflash.bench.datasets import DataOptions, Sample, load_samples, resolve_names
from dflash.bench.local import LocalBackend, LocalConfig
from dflash.bench.metrics import BenchResult, add_costs
from dflash.bench.server import ServerBackend, ServerConfig
from dflash.decoding.engine import AUTO


@dataclass
class BenchConfig:
    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    data: DataOptions = field(default_factory=DataOptions)
    backend: str = "local"  # "local" or "server"
    block_sizes: list[int | str | None] = field(default_factory=lambda: [None])  # local; None: the drafter's own
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    warmup_tokens: int = 16
    server: ServerConfig | None = None  # required for the server backend
    output_dir: str | None = None
    gpu_hourly_usd: float | None = None
    show_progress: bool = True


def run_bench(config: BenchConfig, pipe=None, console: Console | None = None) -> list[BenchResult]:
    """Run, print the table, write the output directory; `pipe` (a `DFlash`) for the local backend."""
    console = console or Console(stderr=True)
    names = resolve_names(config.datasets)
    data = {name: load_samples(name, config.data) for name in names}  # every dataset checked before any run
    if config.backend == "server":
        results = _run_server(config, data, console)
    else:
        results = _run_local(config, data, pipe, console)
    add_costs(results, config.gpu_hourly_usd)
    report.print_table(results, console)
    if config.output_dir:
        written = report.write_outputs(results, config.output_dir, setup(config, pipe))
        console.print(f"wrote {', '.join(p.name for p in written)} to {config.output_dir}")
    return results


def _run_local(config: BenchConfig, data: dict[str, list[Sample]], pipe, console: Console) -> list[BenchResult]:
    backend = LocalBackend(pipe)
    for block_size in config.block_sizes:
        backend.block_size(block_size)  # every size checked before any run
    results = []
    for block_size in config.block_sizes:
        local = LocalConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                            block_size=block_size, seed=config.seed, warmup_tokens=config.warmup_tokens)
        for name, samples in data.items():
            turns = sum(len(s.turns) for s in samples)
            label = f"{name} B={block_size if block_size == AUTO else backend.block_size(block_size)}"
            with _progress(config, label, turns, console) as advance:
                results.append(backend.run(name, samples, local, on_turn=advance))
    return results


def _run_server(config: BenchConfig, data: dict[str, list[Sample]], console: Console) -> list[BenchResult]:
    server = config.server
    server.max_new_tokens, server.temperature, server.seed = config.max_new_tokens, config.temperature, config.seed
    backend = ServerBackend(server)
    results = []
    for name, samples in data.items():
        for concurrency in server.concurrency:
            total = sum(len(s.turns) for s in samples) * backend.num_prompts(samples) // len(samples)
            total *= (2 if server.baseline_url else 1) * server.rounds
            with _progress(config, f"{name} c={concurrency}", total, console) as advance:
                results.append(backend.run_level(name, samples, concurrency, on_request=advance))
    return results


def _progress(config: BenchConfig, label: str, total: int, console: Console):
    if config.show_progress:
        return report.progress_bar(label, total, console)
    return nullcontext(lambda: None)


def setup(config: BenchConfig, pipe=None) -> dict:
    """What was measured, on what: saved next to the results."""
    import torch

    info = {
        "backend": config.backend,
        "datasets": resolve_names(config.datasets),
        "max_samples": config.data.max_samples,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "gpu_hourly_usd": config.gpu_hourly_usd,
        "machine": platform.platform(),
        "torch": torch.__version__,
    }
    if config.backend == "server" and config.server is not None:
        info.update({k: v for k, v in asdict(config.server).items() if k != "api_key"})
    if pipe is not None:
        info["target"] = str(getattr(pipe.target.model.config, "_name_or_path", "") or "")
        info["device"] = str(pipe.target.device)
        info["dtype"] = str(pipe.target.dtype)
        info["block_sizes"] = [b or pipe.engine.proposer.block_size for b in config.block_sizes]
    return info
