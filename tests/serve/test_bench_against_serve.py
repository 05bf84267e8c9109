"""`dflash bench --base-url` against the project's own server: load, counters and files end to end."""

import json

from dflash.api import DFlash
from dflash.cli.main import main
from dflash.serve import ServeConfig

from .conftest import LiveServer


def test_bench_reads_our_server_counters(start_server, tmp_path):
    server = start_server()
    before = server.metrics()
    code = main(["bench", "--base-url", f"{server.url}/v1", "--dataset", "gsm8k", "--max-samples", "3",
                 "--max-new-tokens", "8", "--concurrency", "1,2", "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        assert r["errors"] == 0 and r["num_requests"] == 3 and r["dflash_tokens_per_s"] > 0
        assert r["mean_acceptance_length"] is not None and r["mean_acceptance_length"] >= 1.0
        assert r["drafter"] == "DFlash"
    drafts = "dflash:spec_decode_num_drafts_total"
    assert server.metrics()[drafts] > before.get(drafts, 0.0)


def test_a_draft_model_server_is_labelled_so(draft_model_pair, tmp_path, capsys):
    """The server names what drafts in its metrics (dflash:drafter_info), and the report's columns follow."""
    target_dir, draft_dir = draft_model_pair
    server = LiveServer(DFlash.from_pretrained(str(target_dir), str(draft_dir), device="cpu"),
                        ServeConfig(served_model_name="tiny"))
    try:
        assert server.metrics()['dflash:drafter_info{kind="draft model"}'] == 1.0
        code = main(["bench", "--base-url", f"{server.url}/v1", "--dataset", "gsm8k", "--max-samples", "2",
                     "--max-new-tokens", "8", "--concurrency", "1", "--output-dir", str(tmp_path), "--no-progress"])
    finally:
        server.stop()
    assert code == 0
    assert [r["drafter"] for r in json.loads((tmp_path / "results.json").read_text())] == ["draft model"]
    assert "draft model tok/s" in (tmp_path / "results.md").read_text()


def test_sampled_answers_of_two_dflash_servers_are_compared_and_a_different_target_is_caught(
        start_server, tiny_pair, draft_model_pair, tmp_path):
    """dflash serve's seeded answers are the target's own, drafted or not, so two of them are compared when
    sampling too (mismatches was '-' above temperature 0); a baseline serving another target differs."""
    from dflash.serve.fallback import FallbackConfig

    from .conftest import MODEL, load_pipe

    server = start_server()
    plain = LiveServer(load_pipe(tiny_pair, no_draft=True), ServeConfig(served_model_name=MODEL,
                                                                        fallback=FallbackConfig(0.0)))
    other = LiveServer(DFlash.from_pretrained(str(draft_model_pair[1]), no_draft=True, device="cpu"),
                       ServeConfig(served_model_name=MODEL, fallback=FallbackConfig(0.0)))
    try:
        found = {}
        for name, baseline in (("same", plain), ("other", other)):
            out = tmp_path / name
            main(["bench", "--base-url", f"{server.url}/v1", "--baseline-url", f"{baseline.url}/v1", "--dataset",
                  "gsm8k", "--max-samples", "3", "--max-new-tokens", "12", "--temperature", "0.9", "--output-dir",
                  str(out), "--no-progress"])
            found[name] = json.loads((out / "results.json").read_text())[0]["mismatches"]
    finally:
        plain.stop()
        other.stop()
    assert found["same"] == 0 and found["other"] > 0
