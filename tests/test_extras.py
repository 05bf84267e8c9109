"""Optional packages: the core install decodes, benchmarks locally and prints a hand-off; a command that needs
the `serve` or `bench` extra says which package is missing and how to install it, before any work."""

from __future__ import annotations

import sys

import pytest

from dflash.cli.main import main
from dflash.extras import MissingExtraError, require

SERVE_MODULES = ["fastapi", "uvicorn", "prometheus_client"]
BENCH_MODULES = ["httpx", "matplotlib"]


def uninstall(monkeypatch, modules: list[str], ours: list[str]) -> None:
    """Make `modules` fail to import, and drop our modules that imported them, as in an install without them."""
    for name in list(sys.modules):
        if name.split(".")[0] in modules or name in ours:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_package_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(MissingExtraError, match=r"'httpx'.*pip install httpx.*pip install -e \"\.\[bench\]\""):
        require(["json", "httpx"], "benchmarking a server")
    require(["json"], "anything")  # installed: no error


def test_a_local_bench_needs_neither_httpx_nor_matplotlib(tiny_pair, monkeypatch, capsys):
    uninstall(monkeypatch, BENCH_MODULES, ["dflash.bench.server", "dflash.bench.runner", "dflash.cli.bench"])
    target, draft = tiny_pair
    code = main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--max-samples", "1",
                 "--max-new-tokens", "4", "--block-size", "4", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "gsm8k" in capsys.readouterr().out


def test_bench_plots_without_matplotlib_are_refused_before_the_run(tiny_pair, monkeypatch, capsys, tmp_path):
    uninstall(monkeypatch, BENCH_MODULES, ["dflash.bench.report", "dflash.bench.runner", "dflash.cli.bench"])
    target, draft = tiny_pair
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--max-samples", "1",
                 "--max-new-tokens", "4", "--output-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "'matplotlib'" in err and '".[bench]"' in err and "Traceback" not in err
    assert not out.exists()


def test_a_server_bench_without_httpx_is_refused(monkeypatch, capsys):
    uninstall(monkeypatch, BENCH_MODULES, ["dflash.bench.server", "dflash.bench.runner", "dflash.cli.bench"])
    code = main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--dataset", "gsm8k", "--max-samples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "benchmarking a server needs the Python package 'httpx'" in err


def test_a_hand_off_dry_run_needs_no_serve_extra(tiny_pair, monkeypatch, capsys):
    uninstall(monkeypatch, SERVE_MODULES, ["dflash.serve", "dflash.serve.app", "dflash.serve.handoff",
                                           "dflash.serve.limits", "dflash.serve.metrics", "dflash.cli.serve"])
    target, draft = tiny_pair
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--engine", "vllm", "--dry-run"]) == 0
    assert "vllm serve" in capsys.readouterr().out


def test_serve_without_the_serve_extra_says_what_to_install(tiny_pair, monkeypatch, capsys):
    uninstall(monkeypatch, SERVE_MODULES, ["dflash.serve", "dflash.serve.app", "dflash.cli.serve"])
    target, draft = tiny_pair
    code = main(["serve", "--target", str(target), "--draft", str(draft), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    # all three at once (it named one per run: three installs to find them)
    assert ("dflash serve needs the Python packages 'fastapi', 'uvicorn', 'prometheus_client', which are not "
            "installed: pip install fastapi uvicorn prometheus-client, or DFlash's 'serve' extra") in err
