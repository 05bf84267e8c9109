"""Training options: out-of-range values are refused with the option's name and range."""

from __future__ import annotations

import math
import re

import pytest

from dflash.errors import UserError
from dflash.training import load_config

REQUIRED = {"target": "t", "data": "d.jsonl", "output": "o"}


@pytest.mark.parametrize("option, value, message", [
    ("max_steps", -3, "--max-steps must be >= 1, got -3; leave it out to train for --epochs"),
    ("max_steps", 0, "--max-steps must be >= 1, got 0"),
    ("warmup_ratio", 2.0, "--warmup-ratio is the share of the steps spent warming up, in [0, 1), got 2.0"),
    ("eval_fraction", 1.5, "--eval-fraction is the share of --data held out for evaluation, in [0, 1)"),
    ("eval_fraction", -0.1, "--eval-fraction is the share"),
    ("grad_clip", -1.0, "--grad-clip is the largest gradient norm kept, >= 0 (0: no clipping), got -1.0"),
    ("epochs", 0.0, "--epochs must be a finite number > 0, got 0.0"),
    ("epochs", math.inf, "--epochs must be a finite number > 0"),
    ("lr", math.inf, "--lr must be a finite number > 0, got inf"),
    ("lr", math.nan, "--lr must be a finite number > 0, got nan"),
    ("lr", 0.0, "--lr must be a finite number > 0, got 0.0"),
    ("target_layer_ids", [], "--target-layer-ids needs at least one layer id"),
    ("selector_rank", 64, "--selector-rank and --selector-top-k (selector_rank and selector_top_k in a config file) "
                            "shape a DFlash2 drafter's selector: add --dflash2 (dflash2: true)"),
    ("selector_top_k", 8, "--selector-rank and --selector-top-k (selector_rank and selector_top_k in a config file) "
                            "shape a DFlash2 drafter's selector: add --dflash2 (dflash2: true)"),
    ("log_every", 0, "--log-every must be >= 1, got 0"),
    ("checkpoint_every", -1, "--checkpoint-every must be >= 0"),
    ("keep_checkpoints", 0, "--keep-checkpoints must be >= 1, got 0"),
    ("weight_decay", -0.1, "--weight-decay must be a finite number >= 0"),
    ("weight_decay", math.inf, "--weight-decay must be a finite number >= 0, got inf"),
    ("loss_gamma", 0.0, "--loss-gamma must be > 0"),
    ("max_length", 1, "--max-length must be >= 2"),
    ("batch_size", 0, "--batch-size must be >= 1, got 0"),
    ("overwrite", True, "--resume continues the checkpoints that --overwrite would delete; pass one of them"),
])
def test_out_of_range_options_are_refused_by_name(option, value, message):
    values = {**REQUIRED, option: value}
    if option == "overwrite":
        values["resume"] = True
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, values)


@pytest.mark.parametrize("epochs", [0.0, -1.0, math.nan])
def test_invalid_epochs_are_refused_with_max_steps_too(epochs):
    """--max-steps decides the length, and an --epochs that could never be right is a typo all the same."""
    with pytest.raises(UserError, match=re.escape(f"--epochs must be a finite number > 0, got {epochs}; --max-steps "
                                                  "sets the length of this run, so leave --epochs out")):
        load_config(None, {**REQUIRED, "max_steps": 5, "epochs": epochs})


@pytest.mark.parametrize("extra, again", [(["d.jsonl"], "--data"), (["./d.jsonl"], "--data"),
                                          (["DIR/d.jsonl"], "--data"), (["link.jsonl"], "--data"),
                                          (["more.jsonl", "x/../more.jsonl"], "--extra-train-data")])
def test_a_file_given_as_data_twice_is_refused(tmp_path, monkeypatch, extra, again):
    """The same file (however its path is written) would train its records twice, --data's held-out ones too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "d.jsonl")
    extra = [path.replace("DIR", str(tmp_path)) for path in extra]
    with pytest.raises(UserError, match=re.escape(f"--extra-train-data {extra[-1]} is the {again} file again: its "
                                                  "records would train twice; give each file once")):
        load_config(None, {**REQUIRED, "extra_train_data": extra})
    assert load_config(None, {**REQUIRED, "extra_train_data": ["more.jsonl"]}).extra_train_data == ["more.jsonl"]


def test_grad_clip_zero_is_allowed():
    assert load_config(None, {**REQUIRED, "grad_clip": 0.0}).grad_clip == 0.0


def test_yaml_numbers_without_a_dot_are_numbers(tmp_path):
    """YAML 1.1 reads `6e-4` as a string; it is the number the user meant."""
    path = tmp_path / "train.yaml"
    path.write_text("target: t\ndata: d.jsonl\noutput: o\nlr: 6e-4\nwarmup_ratio: 4e-2\nweight_decay: 1e-2\n")
    loaded = load_config(str(path), {})
    assert loaded.lr == 6e-4 and loaded.warmup_ratio == 0.04 and loaded.weight_decay == 0.01
    path.write_text("target: t\ndata: d.jsonl\noutput: o\nblock_size: 1e1\n")
    with pytest.raises(UserError, match="`block_size: '1e1'` should be an integer"):  # only float options read them
        load_config(str(path), {})


def test_the_target_defaults_to_the_embedded_one_and_data_is_required():
    from dflash.api import DEFAULT_TARGET

    loaded = load_config(None, {"data": "d.jsonl", "output": "o"})
    assert loaded.target == str(DEFAULT_TARGET)
    assert load_config(None, REQUIRED).target == "t"
    with pytest.raises(UserError, match=re.escape("--data is required (or set `data:` in the YAML config)")):
        load_config(None, {"output": "o"})


@pytest.mark.parametrize("text, message", [
    ("lr: " + "[" * 10000 + "\n", "train.yaml is nested too deeply to read"),
    (b"lr: caf\xe9\n", "train.yaml is not UTF-8 text"),
])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, text, message):
    path = tmp_path / "train.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(str(path), {})


def test_a_config_directory_is_refused_by_flag(tmp_path):
    with pytest.raises(UserError, match=re.escape(f"--config {tmp_path} is a directory; give the YAML file")):
        load_config(str(tmp_path), {})


@pytest.mark.parametrize("option, value, expected", [("lr", "abc", "a number"), ("epochs", "3", "a number"),
                                                     ("block_size", "16", "an integer")])
def test_options_given_in_python_are_type_checked_like_yaml_ones(option, value, expected):
    with pytest.raises(UserError, match=f"the options given: `{option}: '{value}'` should be {expected}"):
        load_config(None, {**REQUIRED, option: value})


@pytest.mark.parametrize("text", ["data: d.jsonl\noutput: o\nlr: 1e-3\nlr: 2e-3\n",
                                  "data: d.jsonl\noutput: o\nblock-size: 8\nblock_size: 16\n"])
def test_an_option_set_twice_in_the_yaml_file_is_refused(tmp_path, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="is set twice"):
        load_config(str(path), {})


def test_a_config_file_cannot_delete_checkpoints(tmp_path):
    """training_config.yaml files exported before 2026-12-05 hold `overwrite: true` after an --overwrite run: read
    back with --config, they deleted the new run's checkpoints unasked."""
    path = tmp_path / "train.yaml"
    path.write_text("target: t\ndata: d.jsonl\noutput: o\noverwrite: true\n")
    with pytest.raises(UserError, match=r"sets overwrite: true.+taken only as the --overwrite flag: drop it"):
        load_config(str(path))
    assert load_config(str(path), {"overwrite": True}).overwrite  # asked for on the command line too
    path.write_text("target: t\ndata: d.jsonl\noutput: o\noverwrite: false\n")
    assert load_config(str(path)).overwrite is False


def test_flags_override_the_options_of_the_file_they_exclude(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("target: t\ndata: d.jsonl\noutput: o\nmax_steps: 3\nresume: true\n")
    assert load_config(str(path)).max_steps == 3
    by_epochs = load_config(str(path), {"epochs": 2.0})
    assert by_epochs.max_steps is None and by_epochs.epochs == 2.0  # the file's max_steps would have won
    assert load_config(str(path), {"epochs": 2.0, "max_steps": 5}).max_steps == 5
    fresh = load_config(str(path), {"overwrite": True})
    assert fresh.overwrite and not fresh.resume  # not "--resume continues what --overwrite would delete"
    assert not load_config(str(path), {"resume": False}).resume  # --no-resume


def test_no_resume_and_no_dflash2_flags_reach_the_config():
    import argparse

    from dflash.cli.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--no-resume", "--no-dflash2", "--no-tf32"])
    assert args.resume is False and args.dflash2 is False and args.tf32 is False
    assert parser.parse_args([]).resume is None and parser.parse_args([]).tf32 is None  # the file's value stands


def test_trust_remote_code_is_a_flag_never_read_from_a_file(tmp_path):
    """An exported training_config.yaml read back with --config must not run a checkpoint's code unasked."""
    from dflash.training.config import load_config, portable_settings

    assert "trust_remote_code" not in portable_settings({"trust_remote_code": True, "lr": 1e-3})
    path = tmp_path / "run.yaml"
    path.write_text("data: d.jsonl\noutput: out\ntrust_remote_code: true\n")
    with pytest.raises(UserError, match="trust_remote_code: true, which runs the target's own Python code"):
        load_config(str(path))
    assert load_config(str(path), {"trust_remote_code": True}).trust_remote_code is True


@pytest.mark.parametrize("text, expected", [('"1,9,17"', [1, 9, 17]), ("'1, 9,'", [1, 9]), ("[1, 9, 17]", [1, 9, 17])])
def test_target_layer_ids_may_be_written_in_the_yaml_as_the_flag_takes_them(tmp_path, text, expected):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"target: t\ndata: d.jsonl\noutput: o\ntarget_layer_ids: {text}\n")
    assert load_config(str(yaml_path), {}).target_layer_ids == expected


def test_target_layer_ids_that_are_not_integers_say_how_to_write_them(tmp_path):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("target: t\ndata: d.jsonl\noutput: o\ntarget_layer_ids: 1,a\n")
    with pytest.raises(UserError, match=re.escape("`target_layer_ids: '1,a'` should be a list of integers or None "
                                                  '(e.g. [1, 9, 17], or "1,9,17" as the flag takes it)')):
        load_config(str(yaml_path), {})


def test_the_thinking_mode_for_text_records_comes_from_the_flag_or_the_file(tmp_path):
    from dflash.cli.main import build_parser

    args = vars(build_parser().parse_args(["train", "--no-enable-thinking"]))
    overrides = {k: v for k, v in args.items() if k not in ("config", "command", "module")}
    assert load_config(None, {**overrides, **REQUIRED}).enable_thinking is False
    path = tmp_path / "train.yaml"
    path.write_text("enable_thinking: true\n")
    assert load_config(str(path), REQUIRED).enable_thinking is True
    assert load_config(None, REQUIRED).enable_thinking is None  # the template's own default


@pytest.mark.parametrize("file, flags, expected", [
    ("enable_thinking: false\n", {"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
    ("chat_template_kwargs: {enable_thinking: false, reasoning_effort: low}\n", {"enable_thinking": True},
     {"reasoning_effort": "low", "enable_thinking": True}),
    ("enable_thinking: false\nchat_template_kwargs: {reasoning_effort: low}\n", {},
     {"reasoning_effort": "low", "enable_thinking": False}),
])
def test_the_flags_spelling_of_enable_thinking_wins_over_the_files(tmp_path, file, flags, expected):
    """An exported training_config.yaml keeps the thinking mode in either spelling; a flag in the other one is
    what the user asks for now, not a disagreement."""
    path = tmp_path / "train.yaml"
    path.write_text(file)
    assert load_config(str(path), {**REQUIRED, **flags}).template_kwargs() == expected


@pytest.mark.parametrize("flag", ["target", "init_from", "device", "feature_cache", "data"])
def test_an_option_given_empty_is_refused_not_taken_as_not_given(tmp_path, flag):
    """--target "$TARGET" with the variable unset trained a drafter for the embedded target, and --init-from ''
    one from scratch, without a word."""
    options = {"data": "d.jsonl", "output": "o", flag: ""}
    with pytest.raises(UserError, match=f"^--{flag.replace('_', '-')} is empty; give a value or leave the flag out$"):
        load_config(None, options)
    with pytest.raises(UserError, match="^--extra-train-data is empty"):
        load_config(None, {"data": "d.jsonl", "output": "o", "extra_train_data": ["e.jsonl", " "]})
    file = tmp_path / "train.yaml"
    lines = {"data": "d.jsonl", "output": "o", flag: '""'}
    file.write_text("".join(f"{key}: {value}\n" for key, value in lines.items()))
    with pytest.raises(UserError, match=f"in {re.escape(str(file))}: {flag} is empty; give a value or leave the option "
                                        "out"):
        load_config(str(file))


@pytest.mark.parametrize("option", ["data", "extra_train_data"])
def test_a_data_path_that_is_a_directory_is_refused_before_it_is_read(tmp_path, option):
    """`--data .` ended in a ValueError traceback (a path without a name) before the files were checked."""
    values = {"data": str(tmp_path / "d.jsonl"), "output": str(tmp_path / "o"), option: "."}
    with pytest.raises(UserError, match=f"^--{option.replace('_', '-')} \\. is a directory; give a JSONL file"):
        load_config(None, values)
