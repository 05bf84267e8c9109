"""`dflash bench` and `python -m dflash.benchmark` end to end on the tiny pair: table, JSON, markdown, plots."""

from __future__ import annotations

import json
import struct

import pytest

from dflash.bench.metrics import BenchResult, cost_per_million_tokens, percentiles
from dflash.bench.report import markdown, write_outputs
from dflash.benchmark import to_bench_argv
from dflash.cli.main import main
from dflash.errors import UserError

REQUIRED = ("dataset", "num_prompts", "baseline_tokens_per_s", "dflash_tokens_per_s", "speedup",
            "mean_acceptance_length", "acceptance_histogram", "mismatches", "acceptance_rate_per_position",
            "baseline_ttft_ms", "dflash_ttft_ms", "baseline_tpot_ms", "dflash_tpot_ms")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_local_bench_writes_json_markdown_and_plots(tiny_pair, data_dir, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "out"
    code = main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k,mt-bench",
                 "--data-dir", str(data_dir), "--max-samples", "1", "--max-new-tokens", "8", "--warmup-tokens", "2",
                 "--block-size", "4,8", "--gpu-hourly-usd", "3.6", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [(r["dataset"], r["block_size"]) for r in results] == [("gsm8k", 4), ("mt-bench", 4), ("gsm8k", 8),
                                                                  ("mt-bench", 8)]
    for r in results:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["mismatches"] == 0 and r["num_prompts"] == 1
        assert len(r["acceptance_histogram"]) == r["block_size"] + 1
        assert r["dflash_cost_per_1m_tokens_usd"] == pytest.approx(1e6 / 1000 / r["dflash_tokens_per_s"], rel=1e-3)
    assert results[1]["num_requests"] == 2  # mt-bench: two turns
    md = (out / "results.md").read_text()
    assert "| dataset |" in md and "| mt-bench | 8 |" in md
    setup = json.loads((out / "config.json").read_text())
    assert setup["block_sizes"] == [4, 8] and setup["draft"] == str(draft) and setup["target"]
    for name in ("acceptance_histogram.png", "speedup.png"):
        width, height = png_size(out / name)
        assert width > 200 and height > 200
    assert not (out / "throughput_vs_concurrency.png").exists()  # no concurrency sweep
    captured = capsys.readouterr()
    assert "dflash bench" in captured.out and "dflash bench" not in captured.err  # the table, on stdout
    assert "fewer than --max-samples" not in captured.err


def test_a_max_samples_above_a_datasets_size_is_noted(tiny_pair, data_dir, capsys):
    target, draft = tiny_pair
    code = main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir",
                 str(data_dir), "--max-samples", "50", "--max-new-tokens", "4", "--warmup-tokens", "2",
                 "--block-size", "4", "--no-progress"])
    assert code == 0
    held = sum(1 for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip())
    assert held < 50
    note = f"note: gsm8k holds {held} samples, fewer than --max-samples 50; all {held} are used"
    assert note in capsys.readouterr().err


def test_a_base_model_without_a_chat_template_is_benchmarked_on_plain_text(tiny_pair, data_dir, tmp_path, capsys):
    """As datagen gives it such a target: a conversation's turns (and answers) joined by blank lines."""
    import shutil

    target = tmp_path / "base"
    shutil.copytree(tiny_pair[0], target)
    (target / "chat_template.jinja").unlink()
    out = tmp_path / "out"
    code = main(["bench", "--target", str(target), "--draft", str(tiny_pair[1]), "--dataset", "gsm8k,mt-bench",
                 "--data-dir", str(data_dir), "--max-samples", "1", "--max-new-tokens", "8", "--warmup-tokens", "2",
                 "--block-size", "4", "--output-dir", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert [r["mismatches"] for r in results] == [0, 0] and results[1]["num_requests"] == 2
    assert "no chat template (a base model): prompts are sent as plain text" in capsys.readouterr().err
    code = main(["bench", "--target", str(target), "--draft", str(tiny_pair[1]), "--dataset", "gsm8k", "--data-dir",
                 str(data_dir), "--max-samples", "1", "--max-new-tokens", "8", "--enable-thinking", "--no-progress"])
    assert code == 2 and "tokenizer has no chat template (a base model) to read it" in capsys.readouterr().err


def test_an_earlier_runs_results_are_replaced_only_with_overwrite(tiny_pair, data_dir, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('[{"dataset": "gsm8k", "speedup": 2.0}]')
    args = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir", str(data_dir),
            "--max-samples", "1", "--max-new-tokens", "4", "--warmup-tokens", "2", "--output-dir", str(out),
            "--no-progress"]
    assert main(args) == 2
    assert (f"--output-dir {out} holds an earlier run's results (results.json); pass another --output-dir, or "
            "--overwrite to replace them") in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())[0]["speedup"] == 2.0  # kept
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())[0]["num_prompts"] == 1


def test_a_stopped_runs_output_dir_says_so_and_a_new_run_clears_its_leftovers(tiny_pair, data_dir, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('[{"dataset": "gsm8k", "speedup": 2.0}]')
    (out / "config.json").write_text('{"runs_finished": "1 of 3"}')
    (out / ".speedup.png.partial").write_bytes(b"a plot a kill cut short")
    args = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir", str(data_dir),
            "--max-samples", "1", "--max-new-tokens", "4", "--warmup-tokens", "2", "--output-dir", str(out),
            "--no-progress"]
    assert main(args) == 2
    assert "holds an earlier run's results (results.json, of a run stopped after 1 of 3 runs)" in " ".join(
        capsys.readouterr().err.split())
    assert main([*args, "--overwrite"]) == 0
    assert not list(out.glob(".*.partial"))


def test_a_directory_of_other_files_is_not_written_over(tiny_pair, data_dir, tmp_path, capsys):
    """A model's directory (or a user's own results.md) had its config.json replaced by bench's: no results.json
    of an earlier bench said the directory was free."""
    import shutil

    target, draft = tiny_pair
    model = tmp_path / "model"
    shutil.copytree(target, model)
    before = (model / "config.json").read_bytes()
    for extra in ([], ["--overwrite"]):
        assert main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir",
                     str(data_dir), "--max-samples", "1", "--max-new-tokens", "4", "--output-dir", str(model),
                     "--no-progress", *extra]) == 2
        assert (f"--output-dir {model} holds config.json, which dflash bench would replace, and no results.json"
                in capsys.readouterr().err)
    assert (model / "config.json").read_bytes() == before


def test_a_second_bench_into_a_running_ones_output_dir_is_refused(tiny_pair, data_dir, tmp_path, capsys):
    """Two runs into one --output-dir rewrote each other's results.json, and the first one's were lost."""
    import fcntl
    import os

    target, draft = tiny_pair
    out = tmp_path / "out"
    out.mkdir()
    args = ["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir", str(data_dir),
            "--max-samples", "1", "--max-new-tokens", "4", "--warmup-tokens", "2", "--output-dir", str(out),
            "--no-progress"]
    running = os.open(out, os.O_RDONLY)  # what the first run holds while it writes
    try:
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(args) == 2
        assert f"another dflash bench is writing into --output-dir {out}; let it finish" in capsys.readouterr().err
        assert not (out / "results.json").exists()
        (out / "results.json").write_text("[{}]")  # its first result: the refusal still names the running run
        assert main(args) == 2
        assert f"another dflash bench is writing into --output-dir {out}" in capsys.readouterr().err
        (out / "results.json").unlink()
    finally:
        os.close(running)
    assert main(args) == 0  # once it has finished


def test_local_bench_with_branches_records_them(tiny_pair, data_dir, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "out"
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir",
                 str(data_dir), "--max-samples", "1", "--max-new-tokens", "8", "--warmup-tokens", "2", "--block-size",
                 "4", "--branch-length", "2", "--output-dir", str(out), "--no-progress"]) == 0
    result = json.loads((out / "results.json").read_text())[0]
    assert result["branch_length"] == 2 and result["mismatches"] == 0 and result["mean_block_size"] > 4
    assert json.loads((out / "config.json").read_text())["branch_length"] == 2
    assert "- branch_length: 2" in (out / "results.md").read_text()


def test_local_bench_with_a_draft_model(draft_model_pair, data_dir, tmp_path):
    """Classic speculative decoding measured like DFlash: the same table and JSON, no mismatches."""
    target, draft = draft_model_pair
    out = tmp_path / "out"
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir",
                 str(data_dir), "--max-samples", "2", "--max-new-tokens", "12", "--warmup-tokens", "2",
                 "--block-size", "3", "--output-dir", str(out), "--no-progress"]) == 0
    [result] = json.loads((out / "results.json").read_text())
    assert result["mismatches"] == 0 and result["block_size"] == 3 and len(result["acceptance_histogram"]) == 4
    assert result["mean_acceptance_length"] > 1.0  # the noisy copy agrees with the target now and then
    assert result["drafter"] == "draft model"
    assert json.loads((out / "config.json").read_text())["draft"] == str(draft)
    table = (out / "results.md").read_text()
    assert "draft model tok/s" in table and "DFlash" not in table  # its columns say what drafted


def test_server_bench_with_a_concurrency_sweep_plots_throughput(openai_server, data_dir, tmp_path):
    server = openai_server()
    out = tmp_path / "out"
    code = main(["bench", "--base-url", server.base_url, "--dataset", "gsm8k", "--data-dir", str(data_dir),
                 "--max-samples", "2", "--max-new-tokens", "6", "--concurrency", "1,2", "--output-dir", str(out),
                 "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["concurrency"] for r in results] == [1, 2]
    assert all(r["backend"] == "server" and r["mean_acceptance_length"] >= 1 for r in results)
    assert all(k in results[0] for k in REQUIRED)
    png_size(out / "throughput_vs_concurrency.png")
    png_size(out / "acceptance_histogram.png")


def test_server_bench_rounds_against_a_baseline(openai_server, data_dir, tmp_path):
    dflash_server, plain_server = openai_server(), openai_server()
    out = tmp_path / "out"
    code = main(["bench", "--base-url", dflash_server.base_url, "--baseline-url", plain_server.base_url,
                 "--rounds", "2", "--dataset", "gsm8k", "--data-dir", str(data_dir), "--max-samples", "1",
                 "--max-new-tokens", "6", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    [result] = json.loads((out / "results.json").read_text())
    assert len(result["speedup_per_round"]) == 2 and result["mismatches"] == 0
    setup = json.loads((out / "config.json").read_text())
    assert setup["rounds"] == 2
    assert setup["metrics_url"] == dflash_server.base_url.removesuffix("/v1") + "/metrics"  # the one read, not null
    assert "speedup range" in (out / "results.md").read_text()
    warm_up, *load = plain_server.app.state.requests  # a 16-token warm-up, then one request per round
    assert warm_up["max_tokens"] == 16 and [r["max_tokens"] for r in load] == [6, 6]


def test_mismatches_make_the_command_fail(tiny_pair, data_dir, monkeypatch, tmp_path):
    from dflash.bench import local

    real = local.summarize

    def planted(*args, **kwargs):
        result = real(*args, **kwargs)
        result.mismatches, result.mismatched_prompts = 1, ["0#0"]
        return result

    monkeypatch.setattr(local, "summarize", planted)
    target, draft = tiny_pair
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--data-dir", str(data_dir),
                 "--max-samples", "1", "--max-new-tokens", "4", "--no-progress"]) == 1


SERVER = ["--base-url", "http://127.0.0.1:9/v1"]  # nothing listens there: every check below comes first


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "gsmk"], "unknown dataset 'gsmk'"),
    (["--dataset", ","], "no dataset given"),
    (["--dataset", ""], "no dataset given"),
    (["--block-size", "99"], "--block-size 99 is not usable with this drafter"),
    (["--block-size", "8,1"], "--block-size 1 is too small: a block holds the anchor and at least one draft token"),
    (["--block-size", ","], "--block-size was given no value"),
    (["--no-draft"], "drop --no-draft"),
    (["--backend", "server"], "needs --base-url"),
    (SERVER + ["--rounds", "0"], "--rounds must be >= 1"),
    (SERVER + ["--concurrency", ","], "--concurrency was given no value"),
    (SERVER + ["--concurrency", "0"], "--concurrency takes values >= 1"),
    (["--data-file", "x.jsonl", "--dataset", "gsm8k", "mbpp"], "--data-file holds one dataset"),
    (["--gpu-hourly-usd", "-1"], "--gpu-hourly-usd must be a price per hour > 0 and at most 1e+09"),
    (["--gpu-hourly-usd", "nan"], "--gpu-hourly-usd must be a price per hour > 0"),
    (["--gpu-hourly-usd", "1.7e308"], "--gpu-hourly-usd must be a price per hour > 0"),  # wrote Infinity: no JSON
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k must be a number of tokens >= 1, or 0 or -1 (off), got -2"),
    (["--top-p", "0.5"], "--top-p shapes sampling, and --temperature 0 (the default) decodes greedily"),  # as generate
    (["--output-dir", ""], "--output-dir is empty; give a value or leave the flag out"),  # was [Errno 2]
    (["--base-url", " "], "--base-url is empty"),  # was "--base-url only applies to a server benchmark"
    (["--target", ""], "--target is empty"),  # measured the embedded pair, an unset shell variable's value
    (SERVER + ["--revision", "v1"], "--revision only applies to the local backend"),
    (["--warmup-tokens", "-3"], "--warmup-tokens must be >= 0"),
    (SERVER + ["--duration", "0"], "--duration must be a finite number of seconds > 0"),
    (SERVER + ["--duration", "inf"], "--duration must be a finite number of seconds > 0"),
    (SERVER + ["--request-timeout", "nan"], "--request-timeout must be a finite number of seconds > 0"),
    (SERVER + ["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (SERVER + ["--duration", "5", "--num-prompts", "4"], "--duration and --num-prompts both say how long a level"),
    (["--base-url", "127.0.0.1:8000"], "--base-url must be an http:// or https:// URL"),
    # flags the chosen backend would not read
    (["--num-prompts", "4"], "--num-prompts only applies to a server benchmark"),
    (["--concurrency", "1,4", "--rounds", "3"], "--concurrency, --rounds only apply to a server benchmark"),
    (["--duration", "10"], "--duration only applies to a server benchmark"),
    (["--baseline-url", "http://127.0.0.1:9/v1"], "--baseline-url only applies to a server benchmark"),
    (["--model", "m"], "locally, --target names the model"),
    (SERVER + ["--block-size", "8"], "--block-size only applies to the local backend"),
    (SERVER + ["--branch-length", "4"], "--branch-length only applies to the local backend"),
    (["--branch-length", "-1"], "--branch-length must be >= 0"),
    (SERVER + ["--warmup-tokens", "-1"], "--warmup-tokens must be >= 0"),
    (["--no-stream"], "--no-stream only applies to a server benchmark"),
    (["--backend", "local", "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k"],
     "--base-url, --api-key only apply to a server benchmark"),
    (SERVER + ["--dtype", "bfloat16"], "--dtype only applies to the local backend"),
    (SERVER + ["--drafter-precision", "bfloat16"], "--drafter-precision only applies to the local backend"),
    (SERVER + ["--trust-remote-code"], "--trust-remote-code only applies to the local backend"),
])
def test_user_errors_are_one_line(tiny_pair, data_dir, capsys, argv, message):
    target, draft = tiny_pair
    base = ["bench", "--data-dir", str(data_dir), "--max-new-tokens", "4", "--no-progress"]
    local = not any(flag in argv for flag in ("--base-url", "--backend"))
    base += ["--target", str(target)] + ([] if "--no-draft" in argv else ["--draft", str(draft)]) if local else []
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_an_output_dir_that_cannot_be_written_fails_before_measuring(tiny_pair, data_dir, tmp_path, capsys,
                                                                     monkeypatch):
    from dflash.bench import runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("measured before checking --output-dir"))
    target, draft = tiny_pair
    taken = tmp_path / "results"
    taken.write_text("a file")
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--data-dir", str(data_dir),
                 "--output-dir", str(taken), "--no-progress"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_reference_flags_map_onto_dflash_bench():
    assert to_bench_argv(["--backend", "transformers", "--model", "T", "--draft-model", "D", "--dataset", "gsm8k",
                          "math500", "--max-samples", "5", "--block-size", "16", "--max-new-tokens", "64",
                          "--temperature", "0.0", "--output-dir", "o"]) == [
        "--backend", "local", "--dataset", "gsm8k", "math500", "--target", "T", "--draft", "D", "--max-samples",
        "5", "--block-size", "16", "--max-new-tokens", "64", "--temperature", "0.0", "--no-enable-thinking",
        "--output-dir", "o"]
    assert to_bench_argv(["--backend", "vllm", "--base-url", "http://h/v1", "--model", "M", "--draft-model", "D",
                          "--num-prompts", "8", "--concurrency", "1,8", "--enable-thinking", "--block-size", "16"]) == [
        "--backend", "server", "--model", "M", "--num-prompts", "8", "--concurrency", "1,8",
        "--base-url", "http://h/v1", "--enable-thinking"]  # the server's drafter and block are its own (notes say so)
    # as in the reference, thinking is off unless asked for; raw completions have no chat template to tell
    assert "--no-enable-thinking" not in to_bench_argv(["--backend", "vllm", "--endpoint", "completions"])


def test_thinking_goes_with_chat_requests_only():
    from dflash.bench.server import Client, ServerConfig

    config = ServerConfig(base_url="http://h/v1", chat_template_kwargs={"enable_thinking": False})
    _, body = Client("http://h/v1", config, "m").payload([{"role": "user", "content": "hi"}], seed=0)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    _, body = Client("http://h/v1", ServerConfig(base_url="http://h/v1"), "m").payload([], seed=0)
    assert "chat_template_kwargs" not in body  # the template's own default unless asked


def test_a_sampled_request_says_its_top_p_so_the_servers_default_does_not_apply_unseen():
    from dflash.bench.server import Client, ServerConfig

    _, body = Client("http://h/v1", ServerConfig(base_url="http://h/v1", temperature=0.7), "m").payload([], seed=0)
    assert body["top_p"] == 1.0 and "top_k" not in body
    _, body = Client("http://h/v1", ServerConfig(base_url="http://h/v1", temperature=0.7, top_k=20), "m").payload(
        [], seed=0)
    assert body["top_k"] == 20
    for off in (0, -1):  # --top-k 0 given: off on the server too, whatever its default (-1: off to vLLM and SGLang)
        _, body = Client("http://h/v1", ServerConfig(base_url="http://h/v1", temperature=0.7, top_k=off),
                         "m").payload([], seed=0)
        assert body["top_k"] == -1
    _, body = Client("http://h/v1", ServerConfig(base_url="http://h/v1"), "m").payload([], seed=0)
    assert body["temperature"] == 0 and "top_p" not in body  # greedy: top_p changes nothing


@pytest.mark.parametrize("flags", [["--no-enable-thinking"], ["--chat-template-kwargs", '{"reasoning_effort": "low"}']])
def test_template_variables_with_raw_completions_are_refused(capsys, flags):
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--endpoint", "completions", *flags]) == 2
    assert "set chat template variables, and --endpoint completions sends raw text" in capsys.readouterr().err


def test_python_m_dflash_benchmark_runs(tiny_pair, data_dir, tmp_path, capsys):
    from dflash.benchmark import main as benchmark_main

    target, draft = tiny_pair
    assert benchmark_main(["--backend", "transformers", "--model", str(target), "--draft-model", str(draft),
                           "--dataset", "humaneval", "--max-samples", "1", "--max-new-tokens", "4",
                           "--data-dir", str(data_dir), "--output-dir", str(tmp_path), "--no-progress"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())[0]["dataset"] == "humaneval"
    assert benchmark_main(["--backend", "tgi"]) == 2
    assert "unknown --backend 'tgi'" in capsys.readouterr().err


def test_costs_percentiles_and_markdown_without_numbers(tmp_path):
    assert cost_per_million_tokens(3.6, 100.0) == pytest.approx(10.0)  # $0.001/s over 10,000 s
    assert cost_per_million_tokens(3.6, None) is None
    assert percentiles([4.0, 1.0, 3.0, 2.0]) == {"mean": 2.5, "p50": 2.0, "p90": 4.0, "p99": 4.0}
    empty = BenchResult(dataset="gsm8k", backend="server", num_prompts=0, num_requests=0)
    assert "| gsm8k | - |" in markdown([empty], {})
    written = write_outputs([empty], tmp_path, {"backend": "server"})
    assert [p.name for p in written] == ["results.json", "config.json", "results.md"]  # nothing to plot


def test_missing_embedded_pair_is_a_clear_error(monkeypatch, tmp_path, capsys):
    import dflash.api

    monkeypatch.setattr(dflash.api, "DEFAULT_TARGET", tmp_path / "target")
    assert main(["bench", "--max-samples", "1"]) == 2
    assert "embedded pair is not installed" in capsys.readouterr().err


def test_reference_num_prompts_timeout_and_sampling_flags():
    assert to_bench_argv(["--model", "T", "--num-prompts", "8"]) == [
        "--backend", "local", "--target", "T", "--max-samples", "8", "--no-enable-thinking"]  # gsm8k: bench's default
    assert to_bench_argv(["--num-prompts", "8", "--max-samples", "8"])[-3:-1] == ["--max-samples", "8"]
    assert to_bench_argv(["--backend", "sglang", "--base-url", "http://h:30000", "--timeout-s", "30", "--top-p",
                          "0.9", "--top-k", "20", "--temperature", "0.6", "--enable-thinking"]) == [
        "--backend", "server", "--base-url", "http://h:30000", "--temperature", "0.6",
        "--top-p", "0.9", "--top-k", "20", "--request-timeout", "30.0", "--enable-thinking"]
    with pytest.raises(UserError, match="--num-prompts 8 and --max-samples 5 both set the number of samples"):
        to_bench_argv(["--num-prompts", "8", "--max-samples", "5"])
    with pytest.raises(UserError, match="--timeout-s is the per-request timeout of a server backend"):
        to_bench_argv(["--timeout-s", "30"])


def test_python_m_dflash_benchmark_against_a_server_root(openai_server, data_dir, tmp_path):
    from dflash.benchmark import main as benchmark_main

    server = openai_server()
    root = server.base_url.removesuffix("/v1")  # the reference takes the server's root
    assert benchmark_main(["--backend", "vllm", "--base-url", root, "--model", "tiny-dflash", "--num-prompts", "2",
                           "--max-new-tokens", "4", "--timeout-s", "60", "--data-dir", str(data_dir),
                           "--output-dir", str(tmp_path), "--no-progress"]) == 0
    [result] = json.loads((tmp_path / "results.json").read_text())
    assert result["num_requests"] == 2 and result["errors"] == 0
    assert json.loads((tmp_path / "config.json").read_text())["base_url"] == server.base_url


def test_python_m_dflash_benchmark_errors_are_under_its_own_name(tiny_pair, capsys):
    from dflash.benchmark import main as benchmark_main

    target, draft = tiny_pair
    assert benchmark_main(["--model", str(target), "--draft-model", str(draft), "--concurrency", "4"]) == 2
    assert capsys.readouterr().err.startswith("python -m dflash.benchmark: error: --concurrency only applies to a "
                                              "server benchmark")
    assert benchmark_main(["--backend", "hf", "--model", str(target)]) == 2  # errors name the flags as typed
    assert capsys.readouterr().err.startswith("python -m dflash.benchmark: error: --model needs --draft-model")
    assert benchmark_main(["--backend", "transformers", "--base-url", "http://127.0.0.1:9"]) == 2
    assert ("--base-url is a server's address, and --backend transformers decodes in this process: benchmark the "
            "server with --backend vllm or sglang") in capsys.readouterr().err
    assert benchmark_main(["--backend", "vllm", "--base-url", "http://127.0.0.1:9", "--timeout-s", "-1"]) == 2
    assert "error: --timeout-s must be a finite number of seconds > 0" in capsys.readouterr().err
    for count in ("0", "-1"):  # in process 0 became --max-samples 0, every sample: a run of hours
        assert benchmark_main(["--model", str(target), "--draft-model", str(draft), "--num-prompts", count]) == 2
        assert f"error: --num-prompts must be >= 1, got {count}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark_main(["--model", str(target), "--frobnicate"])
    assert "python -m dflash.benchmark: error: unrecognized arguments: --frobnicate" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--data-file", "/nonexistent/q.jsonl"], "is not a file"),
                                            (["--data-dir", "/nonexistent/dir"], "does not exist")])
def test_a_missing_data_source_fails_before_any_model_loads(tiny_pair, capsys, monkeypatch, flags, message):
    import dflash.cli.bench

    monkeypatch.setattr(dflash.cli.bench, "_load_pair", lambda args: pytest.fail("loaded the models first"))
    target, draft = tiny_pair
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--dataset", "gsm8k", *flags,
                 "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_record_fails_before_any_model_loads(tiny_pair, tmp_path, capsys, monkeypatch):
    """The data file's records were read only after the models had loaded (minutes, for a real model)."""
    import dflash.cli.bench

    monkeypatch.setattr(dflash.cli.bench, "_load_pair", lambda args: pytest.fail("loaded the models first"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    target, draft = tiny_pair
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--data-file", str(bad),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and len(err.strip().splitlines()) == 1


def test_a_target_without_a_drafter_is_not_told_to_use_no_draft(tiny_pair, capsys):
    """bench refuses --no-draft, so its hint for --target alone must not suggest it."""
    target, _ = tiny_pair
    assert main(["bench", "--target", str(target), "--no-progress", "--max-samples", "1"]) == 2
    err = capsys.readouterr().err
    assert "--target needs --draft" in err and "--no-draft" not in err


def test_a_run_that_measured_nothing_does_not_block_the_next(tiny_pair, data_dir, tmp_path, capsys):
    """A run that failed before measuring left results.json = [], and the next run into that directory was
    refused as holding an earlier run's results."""
    from dflash.cli.bench import _check_earlier_results

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("[]")
    _check_earlier_results(out, overwrite=False)  # no error
    (out / "results.json").write_text('[{"dataset": "gsm8k"}]')
    with pytest.raises(UserError, match="holds an earlier run's results"):
        _check_earlier_results(out, overwrite=False)
    (out / "results.json").write_text("{truncated")
    with pytest.raises(UserError, match="holds an earlier run's results"):
        _check_earlier_results(out, overwrite=False)


def test_repeated_sweep_values_are_measured_once(tiny_pair, data_dir):
    import argparse

    from dflash.cli.bench import add_arguments, bench_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = bench_config(parser.parse_args(["--data-dir", str(data_dir), "--block-size", "auto,8,auto,8,16"]))
    assert config.block_sizes == ["auto", 8, 16]


@pytest.mark.parametrize("argv, flag", [(["--dataset", "gsm8k", "--dataset", "mbpp"], "--dataset"),
                                        (["--block-size", "4", "--block-size", "8"], "--block-size"),
                                        (SERVER + ["--concurrency", "1", "--concurrency", "4"], "--concurrency")])
def test_a_sweep_flag_given_twice_is_refused_not_cut_to_its_last_list(capsys, argv, flag):
    from dflash.benchmark import main as benchmark_main

    with pytest.raises(SystemExit):
        main(["bench", *argv])
    assert f"error: {flag} was given twice; give it once, with every value in one list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark_main(argv)  # the reference's flags too
    assert f"{flag} was given twice" in capsys.readouterr().err


def test_num_prompts_loads_that_many_distinct_samples_and_reports_conversations(scripted_server, data_dir, tmp_path,
                                                                               capsys):
    """--num-prompts 24 sent the 20 samples --max-samples' default loads, 4 of them twice, and reported 20 prompts;
    config.json said "model": null."""
    import argparse

    from dflash.cli.bench import add_arguments, bench_config

    from .conftest import chat_chunks

    server = scripted_server(lambda body: chat_chunks("a ", "b"))
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(30)))
    out = tmp_path / "out"
    assert main(["bench", "--base-url", server.base_url, "--data-file", str(many), "--num-prompts", "24",
                 "--max-new-tokens", "2", "--warmup-tokens", "0", "--output-dir", str(out), "--no-progress"]) == 0
    [result] = json.loads((out / "results.json").read_text())
    assert (result["num_prompts"], result["distinct_prompts"]) == (24, 24)
    assert len({r["messages"][-1]["content"] for r in server.app.state.requests}) == 24
    assert json.loads((out / "config.json").read_text())["model"] == "fake"
    assert main(["bench", "--base-url", server.base_url, "--data-dir", str(data_dir), "--num-prompts", "6",
                 "--max-new-tokens", "2", "--warmup-tokens", "0", "--output-dir", str(out), "--overwrite",
                 "--no-progress"]) == 0
    assert "gsm8k: 6 conversations per level from 4 distinct samples (gsm8k holds no more): prompts repeat" in (
        capsys.readouterr().err)
    [result] = json.loads((out / "results.json").read_text())
    assert (result["num_prompts"], result["distinct_prompts"]) == (6, 4)
    assert "| distinct |" in (out / "results.md").read_text()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    reference = bench_config(parser.parse_args(to_bench_argv(["--backend", "vllm", "--base-url", "http://h:8000",
                                                              "--num-prompts", "24"])))
    assert reference.data.max_samples == 24
    assert bench_config(parser.parse_args(["--data-dir", str(data_dir)])).data.max_samples == 20  # locally


@pytest.mark.parametrize("sizes", ["8,,16", ",8"])
def test_a_block_size_list_with_an_empty_item_is_a_typo_refused(sizes, capsys):
    """--concurrency 1,,2 was refused while --block-size 8,,16 ran 8 and 16 without a word."""
    with pytest.raises(SystemExit) as exit_code:
        main(["bench", "--block-size", sizes])
    assert exit_code.value.code == 2
    assert f"expected block sizes separated by commas (like auto,8,16), got '{sizes}'" in capsys.readouterr().err


def test_a_server_dying_in_a_level_leaves_that_level_saved_as_partial(scripted_server, data_dir, tmp_path, capsys,
                                                                     monkeypatch):
    """The level under way when the server went away was dropped, with everything it had measured."""
    from .conftest import chat_chunks
    from .test_bench_server import going_away_after

    server = scripted_server(lambda body: chat_chunks("a ", "b"))
    going_away_after(monkeypatch, 4 + 2)  # level c=2: 4 samples; c=1: 2 of them, then the server is gone
    out = tmp_path / "out"
    code = main(["bench", "--base-url", server.base_url, "--data-dir", str(data_dir), "--concurrency", "2,1,4",
                 "--max-new-tokens", "2", "--warmup-tokens", "0", "--output-dir", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2
    results = json.loads((out / "results.json").read_text())
    assert [(r["concurrency"], r["partial"], r["dflash_answers"]) for r in results] == [(2, False, 4), (1, True, 2)]
    assert ("stopped by the error below in run 2 of 3 (what it had measured is marked partial); the finished ones "
            f"are saved in {out}") in captured.err
    assert "did the server stop?" in captured.err and "gsm8k (partial)" in captured.out
    assert "partial: --base-url stopped answering after 2 of its requests had finished" in (
        out / "results.md").read_text()
    # the level cut short is no finished run: config.json said "2 of 3", and a rerun then took the run as whole
    assert json.loads((out / "config.json").read_text())["runs_finished"] == "1 of 3"


def test_a_failed_warm_up_leaves_an_earlier_runs_results_alone_even_with_overwrite(scripted_server, data_dir,
                                                                                   tmp_path, capsys):
    """--overwrite emptied the output directory before the warm-up, and then the warm-up failed: nothing measured,
    and the earlier results gone."""
    from fastapi.responses import JSONResponse

    server = scripted_server(lambda body: JSONResponse({"error": {"message": "no such model"}}, status_code=400))
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('[{"dataset": "gsm8k", "speedup": 2.0}]')
    code = main(["bench", "--base-url", server.base_url, "--data-dir", str(data_dir), "--max-new-tokens", "2",
                 "--output-dir", str(out), "--overwrite", "--no-progress"])
    assert code == 2 and "the warm-up request to" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())[0]["speedup"] == 2.0
