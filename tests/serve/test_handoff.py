"""`dflash serve --engine vllm|sglang`: the pair is checked from its files, then the exact command is built."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from dflash.cli.main import main


def dry_run(capsys, *args) -> list[str]:
    assert main(["serve", *args, "--dry-run"]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_vllm_command(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--port", "9000",
                   "--api-key", "k", "--max-model-len", "512", "--max-batch-size", "16")
    assert argv[:3] == ["vllm", "serve", target]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": draft, "num_speculative_tokens": 7}  # block size 8
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--port"] == "9000" and flags["--host"] == "127.0.0.1" and flags["--api-key"] == "k"
    assert flags["--max-model-len"] == "512" and flags["--max-num-seqs"] == "16"


def test_sglang_command(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "sglang", "--block-size", "4")
    assert argv[:9] == ["python", "-m", "sglang.launch_server", "--model-path", target,
                        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft]
    assert argv[9:11] == ["--speculative-num-draft-tokens", "4"]
    assert "--speculative-num-draft-tokens" not in dry_run(capsys, "--target", target, "--no-draft",
                                                           "--engine", "sglang")


def broken_copy(tmp_path, draft, edit=None, drop_weights=False):
    copy = tmp_path / "draft"
    shutil.copytree(draft, copy)
    if edit:
        config = json.loads((copy / "config.json").read_text())
        edit(config)
        (copy / "config.json").write_text(json.dumps(config))
    if drop_weights:
        for f in copy.glob("*.safetensors"):
            f.unlink()
    return copy


@pytest.mark.parametrize("case,expected", [
    ("wrong_hidden", "hidden size"),
    ("wrong_layers", "number of target layers"),
    ("not_a_drafter", "architectures"),
    ("no_mask", "mask token"),
    ("no_weights", "safetensors"),
    ("block_too_big", "block size"),
    ("target_as_draft", "architectures"),
])
def test_bad_pairs_are_refused(tiny_pair, tmp_path, capsys, case, expected):
    target, draft = tiny_pair
    extra = []
    if case == "wrong_hidden":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(hidden_size=32))
    elif case == "wrong_layers":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(num_target_layers=36))
    elif case == "not_a_drafter":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(architectures=["Qwen3ForCausalLM"]))
    elif case == "no_mask":
        draft = broken_copy(tmp_path, draft, lambda c: (c.pop("dflash_config"), c.pop("mask_token_id", None)))
    elif case == "no_weights":
        draft = broken_copy(tmp_path, draft, drop_weights=True)
    elif case == "block_too_big":
        extra = ["--block-size", "32"]
    else:
        draft = target
    code = main(["serve", "--target", str(target), "--draft", str(draft), "--engine", "vllm", "--dry-run", *extra])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err


@pytest.mark.skipif(shutil.which("vllm") is not None, reason="vLLM is installed here")
def test_missing_engine_is_a_clear_error(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "vLLM" in err and "not installed" in err and "--dry-run" in err


def test_flag_mistakes(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    for args, expected in [(["--dry-run"], "--engine"), (["--max-batch-size", "0"], "--max-batch-size"),
                           (["--max-queue", "-1"], "--max-queue"), (["--draft", draft], "--target"),
                           (["--fallback-probe-window", "0"], "--fallback-probe-window"),
                           (["--fallback-hysteresis", "1"], "--fallback-hysteresis"),
                           (["--port", "99999"], "at most 65535"), (["--port", "-1"], "--port")]:
        assert main(["serve", *args]) == 2
        assert expected in capsys.readouterr().err
