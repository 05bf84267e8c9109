"""A run that stops early keeps what it measured; the output directory describes this run alone."""

from __future__ import annotations

import json

import pytest

from dflash.bench import local, server
from dflash.cli.main import main

from .conftest import fail_requests_of, write_jsonl


def local_argv(tiny_pair, data_dir, out, *extra) -> list[str]:
    target, draft = tiny_pair
    return ["bench", "--target", str(target), "--draft", str(draft), "--data-dir", str(data_dir), "--max-samples",
            "1", "--max-new-tokens", "4", "--warmup-tokens", "0", "--output-dir", str(out), "--no-progress", *extra]


def test_ctrl_c_keeps_the_finished_datasets(tiny_pair, data_dir, tmp_path, monkeypatch, capsys):
    real, calls = local.LocalBackend.run, []

    def interrupted_on_the_second(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(local.LocalBackend, "run", interrupted_on_the_second)
    out = tmp_path / "out"
    assert main(local_argv(tiny_pair, data_dir, out, "--dataset", "gsm8k,humaneval,math500")) == 130
    assert [r["dataset"] for r in json.loads((out / "results.json").read_text())] == ["gsm8k"]
    assert "| gsm8k |" in (out / "results.md").read_text() and (out / "acceptance_histogram.png").exists()
    captured = capsys.readouterr()
    assert "gsm8k" in captured.out  # the table of what was finished
    assert f"interrupted after 1 of 3 runs; the finished ones are saved in {out}" in captured.err
    assert captured.err.rstrip().endswith("dflash bench: interrupted")


def test_ctrl_c_while_the_plots_are_drawn_leaves_them_as_the_results(tiny_pair, data_dir, tmp_path, monkeypatch,
                                                                      capsys):
    """Drawing the plots takes seconds once there are many results: a Ctrl-C then left results.json a run ahead of
    them, while the message said they were saved."""
    from dflash.bench import report

    real, drawn = report.write_plots, []

    def interrupted_while_drawing_the_second(results, out):
        drawn.append(len(results))
        if drawn == [0, 1, 2]:  # the run's start (no results yet), gsm8k, then humaneval
            raise KeyboardInterrupt
        return real(results, out)

    monkeypatch.setattr(report, "write_plots", interrupted_while_drawing_the_second)
    out = tmp_path / "out"
    assert main(local_argv(tiny_pair, data_dir, out, "--dataset", "gsm8k,humaneval,math500")) == 130
    assert [r["dataset"] for r in json.loads((out / "results.json").read_text())] == ["gsm8k", "humaneval"]
    assert drawn == [0, 1, 2, 2]  # drawn again, whole, after the interrupt


def test_a_server_lost_midway_keeps_the_finished_levels(openai_server, data_dir, tmp_path, monkeypatch, capsys):
    running = openai_server()
    real = server.ServerBackend.run_level

    def stop_after_the_first(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        running.__exit__(None, None, None)
        return result

    monkeypatch.setattr(server.ServerBackend, "run_level", stop_after_the_first)
    out = tmp_path / "out"
    code = main(["bench", "--base-url", running.base_url, "--data-dir", str(data_dir), "--max-samples", "1",
                 "--max-new-tokens", "4", "--concurrency", "1,2", "--output-dir", str(out), "--no-progress"])
    assert code == 2
    assert [r["concurrency"] for r in json.loads((out / "results.json").read_text())] == [1]
    err = capsys.readouterr().err
    assert f"stopped by the error below after 1 of 2 runs; the finished ones are saved in {out}" in err
    assert "dflash bench: error: lost the connection to" in err and "(--base-url) during the run" in err


def test_a_stop_by_a_failed_write_does_not_claim_the_results_are_saved(openai_server, data_dir, tmp_path,
                                                                       monkeypatch, capsys):
    from dflash.bench import report

    real_write, calls = report.write_outputs, []

    def fails_from_the_second_result(results, *args, **kwargs):
        calls.append(len(results))
        if len(results) >= 2:
            raise PermissionError(13, "Permission denied")
        return real_write(results, *args, **kwargs)

    monkeypatch.setattr(report, "write_outputs", fails_from_the_second_result)
    running = openai_server()
    out = tmp_path / "out"
    code = main(["bench", "--base-url", running.base_url, "--data-dir", str(data_dir), "--max-samples", "1",
                 "--max-new-tokens", "4", "--concurrency", "1,2,4", "--output-dir", str(out), "--no-progress"])
    assert code == 2 and calls == [0, 1, 2]
    err = " ".join(capsys.readouterr().err.split())
    assert (f"stopped by the error below after 2 of 3 runs; the finished ones are in the table above; {out} was last "
            "written whole with the first 1 (writing it again failed, so some of its files may hold more)") in err
    assert (f"error: could not write the results into {out} (PermissionError: [Errno 13] Permission denied): free "
            "some space or fix its permissions, or give another --output-dir") in err  # was the raw errno


def test_a_first_write_that_fails_partway_does_not_say_nothing_was_written(openai_server, data_dir, tmp_path,
                                                                           monkeypatch, capsys):
    """A full disk failed the plots after results.json and results.md were written, and the message said the
    results were in the table only."""
    from dflash.bench import report

    real_plots = report.write_plots

    def plots_fail(results, out):  # the run's start writes no result and its plots go through
        if results:
            raise OSError(28, "No space left on device")
        return real_plots(results, out)

    monkeypatch.setattr(report, "write_plots", plots_fail)
    out = tmp_path / "out"
    code = main(["bench", "--base-url", openai_server().base_url, "--data-dir", str(data_dir), "--max-samples", "1",
                 "--max-new-tokens", "4", "--concurrency", "1", "--output-dir", str(out), "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and (out / "results.json").exists()
    assert (f"the finished ones are in the table above (writing {out} failed partway, so its files may hold some of "
            "them: the plots are written last)") in err


def test_a_write_that_fails_leaves_no_half_written_file_beside_the_whole_one(tmp_path, monkeypatch):
    from dflash.bench import report

    report.write_outputs([], tmp_path, {})
    real_replace = report.os.replace

    def refuse(source, target):
        if str(target).endswith("results.md"):
            raise PermissionError(1, "Operation not permitted")
        return real_replace(source, target)

    monkeypatch.setattr(report.os, "replace", refuse)
    with pytest.raises(PermissionError):
        report.write_outputs([], tmp_path, {"runs_finished": "0 of 1"})
    assert not list(tmp_path.glob(".*.partial"))  # was: .results.md.partial left behind


def test_failed_requests_make_the_command_fail(openai_server, data_dir, monkeypatch, capsys):
    fail_requests_of(monkeypatch, "1", "HTTP 503: overloaded")
    code = main(["bench", "--base-url", openai_server().base_url, "--data-dir", str(data_dir), "--max-samples", "0",
                 "--max-new-tokens", "4", "--no-progress"])
    assert code == 1
    assert "1 request(s) to the DFlash server (--base-url) failed; the first: HTTP 503: overloaded" in (
        capsys.readouterr().err)


def test_a_prompt_past_the_context_fails_before_decoding_and_names_it(tiny_pair, data_dir, tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setattr(local.LocalBackend, "run", lambda *a, **k: pytest.fail("decoded before checking lengths"))
    data = tmp_path / "long.jsonl"
    write_jsonl(data, [{"prompt": "short"}, {"id": "huge", "prompt": "count the words " * 60}])
    out = tmp_path / "out"
    argv = local_argv(tiny_pair, data_dir, out, "--data-file", str(data), "--max-samples", "0", "--max-new-tokens",
                      "256")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "1 prompt(s) do not fit the target's context of 1024 tokens with --max-new-tokens 256" in err
    assert "long sample huge (" in err and "lower --max-new-tokens to" in err and "Traceback" not in err
    assert not (out / "results.json").exists()


def test_the_output_dir_records_the_data_and_drops_stale_files(tiny_pair, data_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("[]\n")  # an earlier bench's directory, of a run that measured nothing
    for stale in ("throughput_vs_concurrency.png", "speedup.png"):
        (out / stale).write_bytes(b"an earlier run's plot")
    (out / "notes.txt").write_text("mine")
    data = tmp_path / "mine.jsonl"
    write_jsonl(data, [{"id": "q1", "prompt": "What is 2+2?"}, {"id": "q2", "prompt": "Name a color."}])
    assert main(local_argv(tiny_pair, data_dir, out, "--data-file", str(data), "--max-samples", "0")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["data_file"] == str(data) and config["data_dir"] == str(data_dir)
    assert config["data_sources"] == {"mine": str(data)} and config["sample_ids"] == {"mine": ["q1", "q2"]}
    assert config["datasets"] == ["mine"]  # named after the file: its records need not be GSM8K's
    from dflash.cli.bench import _file_label

    assert [_file_label(p) for p in ("d/share.jsonl.gz", "x.v2.jsonl", ".hidden.jsonl")] == [
        "share", "x", ".hidden.jsonl"]
    md = (out / "results.md").read_text()
    assert f"- data_file: {data}" in md and "- sample ids, mine (2): q1, q2" in md
    assert not (out / "throughput_vs_concurrency.png").exists()  # not measured in this run
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"  # this run's, not the stale one
    assert (out / "notes.txt").read_text() == "mine"  # not a file this tool names
    assert not list(out.glob(".*partial"))


def test_the_setup_names_the_draft_and_bfloat16_drafting(tiny_pair, monkeypatch):
    from dflash.api import DFlash
    from dflash.bench.runner import BenchConfig, setup

    target_dir, draft_dir = tiny_pair
    info = setup(BenchConfig(), DFlash.from_pretrained(target_dir, draft_dir, drafter_precision="float32"))
    assert info["draft"] == str(draft_dir) and "drafter_products" not in info
    pipe = DFlash.from_pretrained(target_dir, draft_dir, drafter_precision="bfloat16")
    assert setup(BenchConfig(), pipe)["drafter_products"] == "bfloat16"
