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
