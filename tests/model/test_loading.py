"""The public checkpoint format: written here by hand (not by our own saver), then loaded."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_drafter
from dflash.errors import DFlashWarning, UserError
from dflash.model import CheckpointError, IncompatibleDrafterError, load_drafter, loading
from dflash.model.loading import check_target_dir, resolve_device, resolve_model_dir
from dflash.model.target import check_compatible

H, INTER, HEADS, KV, D, V = 64, 128, 4, 2, 16, 128


def public_state_dict(num_layers: int, num_features: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    state = {"fc.weight": w(H, num_features), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(HEADS * D, H), p + "self_attn.k_proj.weight": w(KV * D, H),
            p + "self_attn.v_proj.weight": w(KV * D, H), p + "self_attn.o_proj.weight": w(H, HEADS * D),
            p + "self_attn.q_norm.weight": torch.ones(D), p + "self_attn.k_norm.weight": torch.ones(D),
            p + "mlp.gate_proj.weight": w(INTER, H), p + "mlp.up_proj.weight": w(INTER, H),
            p + "mlp.down_proj.weight": w(H, INTER),
            p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
        })
    return state


def public_config(**overrides) -> dict:
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": INTER,
        "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 1024, "vocab_size": V,
        "layer_types": ["full_attention", "full_attention"], "sliding_window": None, "tie_word_embeddings": False,
        "block_size": 16, "num_target_layers": 4, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [1, 2]},
    }
    config.update(overrides)
    return config


def write_checkpoint(directory, config: dict, state: dict, shards: int = 1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(state, directory / "model.safetensors")
        return
    keys = sorted(state)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[s::shards]}
        save_file(part, directory / name)
        weight_map.update({k: name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_public_format_loads_with_weights_in_place(tmp_path, shards):
    state = public_state_dict(2, 2 * H)
    write_checkpoint(tmp_path / "d", public_config(), state, shards)
    drafter = load_drafter(tmp_path / "d")
    assert drafter.config.target_layer_ids == [1, 2] and drafter.config.mask_token_id == 127
    assert next(drafter.parameters()).dtype == torch.bfloat16  # dtype from config
    loaded = drafter.state_dict()
    for key, value in state.items():
        assert torch.equal(loaded[key].float(), value.to(torch.bfloat16).float()), key
    assert load_drafter(tmp_path / "d", dtype="float32").fc.weight.dtype == torch.float32  # argument wins


def test_a_shard_missing_from_a_sharded_drafter_is_named(tmp_path):
    write_checkpoint(tmp_path / "d", public_config(), public_state_dict(2, 2 * H), shards=3)
    (tmp_path / "d" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"the shard model-00002-of-00003.safetensors listed in "
                                              r"model.safetensors.index.json is missing; copy or download"):
        load_drafter(tmp_path / "d")


def test_a_stray_copy_of_weights_beside_a_drafters_is_refused_not_mixed_in(tmp_path):
    """Without an index every *.safetensors file is read: one holding a name another holds replaced it, by the
    order of the file names."""
    write_checkpoint(tmp_path / "d", public_config(), public_state_dict(2, 2 * H))
    save_file({"norm.weight": torch.full((H,), 7.0)}, tmp_path / "d" / "zz-extra.safetensors")
    with pytest.raises(CheckpointError, match=r"zz-extra.safetensors holds weights that another \*.safetensors "
                                              r"file there holds too \(norm.weight\); keep one copy"):
        load_drafter(tmp_path / "d")
    assert public_config().get("hidden_act", "silu") == "silu"
    write_checkpoint(tmp_path / "s", public_config(hidden_act="swish"), public_state_dict(2, 2 * H))
    assert load_drafter(tmp_path / "s").config.to_dict()["hidden_act"] == "silu"  # transformers' other name


def test_a_hub_download_fetches_the_weights_the_model_loads_and_no_other_copy(tmp_path, monkeypatch):
    """A pattern's * matches "/" too: "*.safetensors" fetched gpt-oss's original/ copy of its weights (13 GB
    more) and Mistral's consolidated.safetensors beside the shards its index names."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    def hub(files: list[str], index: dict | None = None):
        repo = tmp_path / "repo"
        shutil.rmtree(repo, ignore_errors=True)
        for name in files:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text("{}")
        if index is not None:
            (repo / "model.safetensors.index.json").write_text(json.dumps(index))
        snapshot = tmp_path / "snapshot"
        shutil.rmtree(snapshot, ignore_errors=True)

        def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None,
                              local_files_only=False, **kwargs):
            names = [str(f.relative_to(repo)) for f in repo.rglob("*") if f.is_file()]
            for name in filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(repo / name, snapshot / name)
            return str(snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr("dflash.hub.unreachable", lambda *args, **kwargs: None)  # the hub answers
        got = loading.resolve_model_dir("someone/model")
        return sorted(str(f.relative_to(got)) for f in got.rglob("*.safetensors")) + sorted(
            str(f.relative_to(got)) for f in got.rglob("*.bin"))

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"weight_map": {"a": shards[0], "b": shards[1]}}
    assert hub(["config.json", *shards, "original/model.safetensors", "consolidated.safetensors"], index) == shards
    assert hub(["config.json", "model.safetensors", "original/model.safetensors"]) == ["model.safetensors"]
    assert hub(["config.json", "pytorch_model.bin", "original/pytorch_model.bin"]) == ["pytorch_model.bin"]


def test_legacy_checkpoint_without_dflash_config(tmp_path):
    config = public_config(num_target_layers=36)
    del config["dflash_config"]
    write_checkpoint(tmp_path / "legacy", config, public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match="mask"):
        load_drafter(tmp_path / "legacy")
    drafter = load_drafter(tmp_path / "legacy", mask_token_id=3)
    assert drafter.config.target_layer_ids == [1, 33] and drafter.config.mask_token_id == 3


def test_sliding_window_and_rope_scaling_are_honoured(tmp_path):
    config = public_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3, is_causal=False,
                           use_sliding_window=True,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})  # bidirectional: the window alone
    write_checkpoint(tmp_path / "s", config, public_state_dict(2, 2 * H))
    drafter = load_drafter(tmp_path / "s", dtype="float32")
    plain = load_drafter(tmp_path / "s", dtype="float32")
    plain.config.layer_types = ["full_attention"] * 2
    torch.manual_seed(0)
    ctx_len = 10
    args = dict(block_embeds=torch.randn(1, 4, H), block_positions=torch.arange(ctx_len, ctx_len + 4)[None],
                context=torch.randn(1, ctx_len, H), context_positions=torch.arange(ctx_len)[None])
    assert not torch.allclose(drafter(**args), plain(**args))  # the window hides old context
    inv = drafter.rotary_emb.inv_freq
    unscaled = 1.0 / (1000000 ** (torch.arange(0, D, 2).float() / D))
    assert torch.allclose(inv, unscaled / 2.0)  # linear scaling factor 2


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_causal_drafter_block_position_does_not_see_the_ones_after_it(tmp_path, is_causal):
    """A checkpoint's is_causal (or a sliding layer, `DrafterConfig.layer_attention`) makes its block attention
    causal, as vLLM runs it; the published drafters' blocks attend both ways."""
    write_checkpoint(tmp_path / "c", public_config(is_causal=is_causal), public_state_dict(2, 2 * H))
    drafter = load_drafter(tmp_path / "c", dtype="float32")
    torch.manual_seed(0)
    args = dict(block_embeds=torch.randn(1, 4, H), block_positions=torch.arange(6, 10)[None],
                context=torch.randn(1, 6, H), context_positions=torch.arange(6)[None])
    before = drafter(**args)
    args["block_embeds"][:, -1] += 1.0  # the last block position only
    after = drafter(**args)
    assert torch.equal(before[:, :-1], after[:, :-1]) == is_causal
    assert not torch.allclose(before[:, -1], after[:, -1])


DFLASH_CONFIG = {"mask_token_id": 127, "target_layer_ids": [1, 2]}


@pytest.mark.parametrize("fields, named", [
    ({"is_neox_style": False}, "is_neox_style false"),
    ({"dflash_config": {**DFLASH_CONFIG, "use_aux_hidden_state": False}}, "use_aux_hidden_state false"),
    ({"dflash_config": {**DFLASH_CONFIG, "attention_sink_bias": True}}, "attention_sink_bias"),
    ({"add_swa_attention_sink_bias": True}, "attention_sink_bias"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "'gelu_pytorch_tanh' in its MLP"),  # drafted with silu, re-exported so
])
def test_a_drafter_vllm_reads_otherwise_is_refused_here_and_handed_over(tmp_path, fields, named):
    """vLLM's DFlash loader honours these fields; dflash's drafter would draft as if they were absent."""
    from dflash.model.config import DrafterConfig

    write_checkpoint(tmp_path / "v", public_config(**fields), public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match=f"{named}.*serve it with vLLM"):
        load_drafter(tmp_path / "v")
    assert DrafterConfig.from_dict(public_config(**fields)).not_run_here()  # the hand-off's own check reads it
    # vLLM reads use_aux_hidden_state in dflash_config (or eagle_config) only: at the top level it is no refusal
    assert DrafterConfig.from_dict(public_config(use_aux_hidden_state=False)).not_run_here() is None


def test_save_then_load_gives_the_same_outputs(tmp_path, target):
    drafter = tiny_drafter(target, layers=2)
    drafter.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and "dflash_config" in saved
    again = load_drafter(tmp_path / "out")
    torch.manual_seed(0)
    args = dict(block_embeds=torch.randn(2, 8, H), block_positions=torch.arange(5, 13).repeat(2, 1),
                context=torch.randn(2, 5, H), context_positions=torch.arange(5).repeat(2, 1))
    assert torch.equal(drafter(**args), again(**args))


def test_an_export_stopped_midway_leaves_the_earlier_one_whole(tmp_path, target, monkeypatch):
    """The weights and config.json are written beside their places and moved there: a stop while writing (a kill, a
    full disk) leaves the earlier export loadable, not half a file."""
    from dflash.model import loading

    tiny_drafter(target, layers=1).save_pretrained(tmp_path / "out")
    before = {name: (tmp_path / "out" / name).read_bytes() for name in ("model.safetensors", "config.json")}

    def stopped(state, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loading, "save_file", stopped)
    with pytest.raises(OSError):
        tiny_drafter(target, layers=2).save_pretrained(tmp_path / "out")
    assert {name: (tmp_path / "out" / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(before)  # no partial file left
    load_drafter(tmp_path / "out")


def test_mismatched_weights_are_refused(tmp_path):
    state = public_state_dict(1, 2 * H)  # config says 2 layers
    write_checkpoint(tmp_path / "bad", public_config(), state)
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(tmp_path / "bad")


def test_drafter_for_another_target_is_refused(tmp_path, target):
    write_checkpoint(tmp_path / "d", public_config(num_target_layers=36, vocab_size=200,
                                                   dflash_config={"mask_token_id": 150, "target_layer_ids": [1, 33]}),
                     public_state_dict(2, 2 * H))
    drafter = load_drafter(tmp_path / "d")
    with pytest.raises(IncompatibleDrafterError) as err:
        check_compatible(target, drafter.config)
    message = str(err.value)
    for expected in ("number of target layers", "out of range", "vocab size", "mask_token_id"):
        assert expected in message


def test_a_config_that_does_not_state_the_targets_depth_is_not_refused_for_a_guess_of_it(tmp_path, target):
    """Without num_target_layers the depth was guessed as max(target_layer_ids) + 1, and a drafter made for a deeper
    target was refused: "drafter was built for 2, target has N"."""
    config = public_config(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                           dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 1]})
    del config["num_target_layers"]
    write_checkpoint(tmp_path / "d", config, public_state_dict(2, 2 * target.hidden_size))
    drafter = load_drafter(tmp_path / "d")
    assert target.num_layers > 2 and drafter.config.num_target_layers is None
    check_compatible(target, drafter.config)  # no guess to refuse it for
    assert "num_target_layers" not in drafter.config.to_dict()  # written back as it came: unstated
    drafter.config.target_layer_ids = [0, target.num_layers]
    with pytest.raises(IncompatibleDrafterError, match="out of range"):  # the ids are still checked
        check_compatible(target, drafter.config)


def test_cli_refuses_a_mismatched_drafter_without_traceback(tmp_path, tiny_pair):
    target_dir, _ = tiny_pair
    write_checkpoint(tmp_path / "d", public_config(hidden_size=H, num_target_layers=36,
                                                   dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 33]}),
                     public_state_dict(2, 2 * H))
    proc = subprocess.run([sys.executable, "-m", "dflash.cli.main", "generate", "--target", str(target_dir),
                           "--draft", str(tmp_path / "d"), "--prompt", "hi"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "does not fit this target" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nowhere" / "x")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file; give the checkpoint directory"):
        resolve_model_dir(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_dir("not a hub id!")  # neither a path nor an id: the hub is not asked
    with pytest.raises(CheckpointError, match="not int"):
        resolve_model_dir(7)


def test_weights_of_another_shape_than_config_json_says_are_named(tmp_path):
    write_checkpoint(tmp_path / "d", public_config(intermediate_size=96), public_state_dict(2, 2 * H))
    with pytest.raises(CheckpointError, match=r"mlp.down_proj.weight: file \[64, 128\], config \[64, 96\]"):
        load_drafter(tmp_path / "d")


def test_damaged_weights_are_named_not_a_traceback(tmp_path):
    write_checkpoint(tmp_path / "d", public_config(), public_state_dict(2, 2 * H))
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="damaged or incomplete"):
        load_drafter(tmp_path / "d")


def test_a_bad_config_value_names_the_drafter_directory(tmp_path):
    write_checkpoint(tmp_path / "d", public_config(hidden_size="64"), public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match=f"drafter in {tmp_path / 'd'}: .*hidden_size '64'"):
        load_drafter(tmp_path / "d")


def test_a_target_directory_needs_a_tokenizer_and_must_not_be_a_drafter(tmp_path):
    write_checkpoint(tmp_path / "d", public_config(), public_state_dict(2, 2 * H))
    with pytest.raises(CheckpointError, match="is a DFlash drafter, not a target model"):
        check_target_dir(tmp_path / "d")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        check_target_dir(tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    check_target_dir(tmp_path / "t")


@pytest.mark.parametrize("device, message", [
    ("bogus", "unknown device 'bogus'"), ("meta", "holds no data"), (3, "must be a string"),
    pytest.param("cuda", "'cuda' is not available", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                            reason="a machine without CUDA")),
])
def test_devices_this_machine_lacks(device, message):
    with pytest.raises(UserError, match=message):
        resolve_device(device)
    assert resolve_device("cpu") == torch.device("cpu")


def _within(seconds: float, fn):
    """fn's exception, or a failure when it has not returned after `seconds` (instead of hanging the suite)."""
    outcome = []

    def call():
        try:
            fn()
            outcome.append(None)
        except Exception as err:
            outcome.append(err)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still waiting for the hub after {seconds} s"
    return outcome[0]


def test_a_hub_id_when_the_hub_does_not_answer_is_a_clear_error_in_seconds(silent_hub):
    start = time.monotonic()
    err = _within(20, lambda: resolve_model_dir("Qwen/Qwen3-8B"))
    assert isinstance(err, CheckpointError), err
    message = str(err)
    assert "hub is not reachable (no answer in " in message and " s, 0.5 s a try" in message
    assert "local checkpoint directory" in message and "HF_HUB_OFFLINE=1" in message
    start = time.monotonic()
    err = _within(20, lambda: resolve_model_dir("z-lab/Qwen3-8B-DFlash-b16"))  # the drafter: no second wait
    assert isinstance(err, CheckpointError) and time.monotonic() - start < 0.5


def test_a_hub_id_with_hf_hub_offline_goes_to_the_cache_only(silent_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) is set, and the local "
                                              "cache"):
        resolve_model_dir("Qwen/Qwen3-8B")


def test_the_embedded_tokenizer_config_is_readable_by_transformers_4():
    """The package supports transformers>=4.57: the shipped tokenizer must not name transformers 5's own class
    (`TokenizersBackend`) or list its extra special tokens the 5.x way, which 4.x cannot load
    (`scripts/embedded/train_tokenizer.save_portable` writes it so)."""
    from dflash.api import ASSETS

    config = json.loads((ASSETS / "target" / "tokenizer_config.json").read_text())
    assert loading.portable_tokenizer_config(config) == (config, [])
    assert config["additional_special_tokens"] == ["<|endoftext|>", "<|im_start|>"]


def test_a_tokenizer_config_written_by_transformers_5_is_made_portable():
    written = {"eos_token": "<|im_end|>", "extra_special_tokens": ["<|a|>"], "tokenizer_class": "TokenizersBackend"}
    config, edits = loading.portable_tokenizer_config(written)
    assert config == {"eos_token": "<|im_end|>", "additional_special_tokens": ["<|a|>"],
                      "tokenizer_class": "PreTrainedTokenizerFast"}
    assert len(edits) == 2 and written["tokenizer_class"] == "TokenizersBackend"  # the caller's dict is left alone


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_that_does_not_parse_is_named_as_damaged(tmp_path, name):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    # both parse, and tokenizers cannot read that tokenizer.json (no model): said so, not transformers' own error
    assert "cannot read its tokenizer.json" in str(loading.tokenizer_failure(tmp_path, ValueError("anything")))
    (tmp_path / name).write_text('{"version": "1.0", "model": {"vocab": {"a"')
    explained = loading.tokenizer_failure(tmp_path, ImportError("requires the protobuf library"))
    assert isinstance(explained, CheckpointError)
    assert f"tokenizer ({name})" in str(explained) and "damaged or incomplete" in str(explained)


def test_a_tokenizer_saved_by_transformers_5_loads_there_and_is_explained_before(tmp_path):
    """A target saved by transformers 5 names its tokenizer class `TokenizersBackend`: 5.x loads it, and 4.x (the
    package accepts 4.57) refuses it with a message that says how to go on (CI's transformers 4.57 pass)."""
    import shutil

    import transformers

    from dflash.api import ASSETS, load_target

    target = tmp_path / "target"
    shutil.copytree(ASSETS / "target", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "TokenizersBackend"
    config["extra_special_tokens"] = config.pop("additional_special_tokens")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert load_target(target).tokenizer.eos_token_id == 2
    else:
        with pytest.raises(CheckpointError, match="saved by transformers 5.*PreTrainedTokenizerFast.*additional_spec"):
            load_target(target)


def test_a_training_checkpoint_given_as_a_model_says_where_the_drafter_is(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step-00000120"
    step.mkdir(parents=True)
    (step / "training_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"is a checkpoint of `dflash train` .*--output directory "
                                              f"\\({tmp_path / 'run'}\\).*--resume --max-steps 120$"):
        load_drafter(step)


def test_a_run_that_stopped_before_its_export_says_how_to_export(tmp_path):
    """What --draft gets after a training run was stopped: only checkpoints/ in its --output."""
    for step in ("step-00000040", "step-00000080"):
        (tmp_path / "run" / "checkpoints" / step).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="stopped before its export was complete .*--resume --max-steps 80,"):
        load_drafter(tmp_path / "run")


@pytest.mark.parametrize("written", ["model.safetensors", "config.json"])
def test_an_export_stopped_halfway_says_how_to_export(tmp_path, written):
    """An export killed between its two renames leaves the weights without the config (or, from an older export
    order, the config without the weights) beside the checkpoints: the same advice, not a bare missing file."""
    (tmp_path / "run" / "checkpoints" / "step-00000040").mkdir(parents=True)
    source = Path(__file__).resolve().parents[2] / "dflash" / "assets" / "drafter" / written
    shutil.copy(source, tmp_path / "run" / written)
    with pytest.raises(CheckpointError, match="stopped before its export was complete .*--resume --max-steps 40,"):
        load_drafter(tmp_path / "run")


def test_a_mistyped_path_inside_a_local_folder_names_the_folder_first(silent_hub, monkeypatch, tmp_path):
    """"drafters/lama" reads as a hub id too; when the hub has no such model, the local folder is the likelier
    meaning."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "drafters" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^drafters/lama is not in the local folder drafters \(it holds "
                                              r"llama\), and as a hub id: .*HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) "
                                              "is set"):
        resolve_model_dir("drafters/lama")
    with pytest.raises(CheckpointError, match="^Qwen/Qwen3-8B is not a local directory"):  # no such folder: the hub's
        resolve_model_dir("Qwen/Qwen3-8B")


def test_a_hub_id_with_a_trailing_slash_is_told_to_leave_it_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="^org/name/ is no local directory; for the hub id, leave the trailing "
                                              "slash out: org/name$"):
        resolve_model_dir("org/name/")


def test_a_model_the_hub_does_not_have_is_a_checkpoint_error(empty_hub):
    with pytest.raises(CheckpointError, match="^org/no-such-model is neither a local path nor a repository on the "
                                              "Hugging Face hub .*, or pass a local directory$"):
        resolve_model_dir("org/no-such-model")


def test_a_target_without_tokenizer_files_says_so(tiny_pair, tmp_path):
    import shutil

    from dflash.model.target import TargetModel

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=f"{target} holds no tokenizer \\(tokenizer.json, tokenizer.model, "
                                              "vocab.json, ...\\): copy the tokenizer files"):
        TargetModel.from_pretrained(target)


def test_a_target_whose_weights_lack_tensors_its_config_describes_is_refused(tiny_pair, tmp_path):
    """transformers started the missing tensors at random and said so in a report dflash silences: the target
    loaded, and decoded text that changed from run to run."""
    import shutil

    from safetensors.torch import load_file

    from dflash.model.target import TargetModel

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    weights = load_file(target / "model.safetensors")
    dropped = sorted(k for k in weights if "layers.0.mlp.up_proj" in k)
    save_file({k: v for k, v in weights.items() if k not in dropped}, target / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"^the weights in {target} lack 1 tensor\(s\) its config.json "
                                              rf"describes: {dropped[0]}; transformers would start them at random"):
        TargetModel.from_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    save_file(weights, target / "model.safetensors")
    deeper = {**config, "num_hidden_layers": config["num_hidden_layers"] + 1}
    deeper.pop("layer_types", None)  # one per layer: the class would refuse the new depth
    (target / "config.json").write_text(json.dumps(deeper))
    with pytest.raises(CheckpointError, match=r"lack \d+ tensor\(s\) its config.json describes: "):
        TargetModel.from_pretrained(target)  # a config deeper than its weights


@pytest.mark.parametrize("fields, named", [  # rope_scaling: what transformers 4 and 5 both read
    ({"rope_theta": "abc"}, "TypeError: unsupported operand"),
    ({"rope_scaling": {"rope_type": "nonsense"}}, "KeyError: 'nonsense'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
])
def test_a_drafter_config_transformers_cannot_build_a_rotary_embedding_from_is_a_clear_error(tmp_path, fields,
                                                                                             named):
    """Each came out as the traceback of transformers' rotary embedding."""
    write_checkpoint(tmp_path / "d", public_config(**fields), public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match=f"^cannot use the drafter in {tmp_path / 'd'}: drafter config: transformers "
                                        r"cannot build its rotary embedding from it \(.*"
                                        f"{re.escape(named)}"):
        load_drafter(tmp_path / "d")


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(hidden_size=str(c["hidden_size"])), "Error: "),  # 5: the field's validation; 4: torch's
    (lambda c: (c.pop("rope_parameters", None), c.update(rope_scaling={"rope_type": "nonsense"})),
     "KeyError: 'nonsense'"),
])
def test_a_target_config_transformers_cannot_build_from_is_a_clear_error(tiny_pair, tmp_path, edit, named):
    import shutil

    from dflash.model.target import TargetModel

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"^could not load {target} as a causal LM: transformers cannot build it "
                                              rf"from its config.json \(.*{re.escape(named)}"):
        TargetModel.from_pretrained(target)


def test_a_tokenizer_this_tokenizers_release_cannot_read_is_a_clear_error(tiny_pair, tmp_path):
    """tokenizers' own `Exception: data did not match any variant of untagged enum ModelUntagged` escaped."""
    import shutil

    from dflash.model.target import TargetModel

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["model"]["type"] = "FromTheFuture"
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match=rf"^could not load the tokenizer in {target}: tokenizers [\d.]+ "
                                              r"cannot read its tokenizer.json \(Exception: .+\): it was saved by a "
                                              "newer tokenizers"):
        TargetModel.from_pretrained(target)


def test_a_dflash2_drafter_whose_config_lost_its_architecture_is_told_what_to_add(tmp_path):
    import shutil

    from dflash.api import DEFAULT_DRAFT

    drafter = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFT, drafter)
    config = json.loads((drafter / "config.json").read_text())
    del config["architectures"]
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r'its config.json needs "architectures": \["DFlash2DraftModel"\]'):
        load_drafter(drafter)


def cached_copy(cache: Path, repo_id: str, source: Path, files: list[str] | None = None, ref: str = "main") -> Path:
    """`source`'s files (or `files` of them) as the Hugging Face cache's snapshot of `repo_id` at `ref`."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in files or [f.name for f in source.iterdir()]:
        shutil.copy(source / file, snapshot / file)
    return snapshot


def test_a_cached_copy_served_while_the_hub_is_unreachable_is_said_to_be_one(silent_hub, tiny_pair, monkeypatch):
    """The cache may hold an older revision than the hub's: a run on it was silent about that."""
    from huggingface_hub import constants

    monkeypatch.setattr(loading, "_stale_warned", set())

    snapshot = cached_copy(Path(constants.HF_HUB_CACHE), "someone/drafter", tiny_pair[1])
    with pytest.warns(DFlashWarning, match=r"the Hugging Face hub is not reachable \(no answer in .* s, 0.5 s a "
                                           r"try.*\): someone/drafter is the local cache's copy, which may be older"):
        assert resolve_model_dir("someone/drafter") == snapshot
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_model_dir("someone/drafter")  # said once


@pytest.mark.parametrize("status, code, said", [
    (401, None, r"the Hugging Face hub refused the token sent for someone/drafter \(HF_TOKEN, or the one `hf auth "
                r"login` saved\): log in again, or for a public repository unset HF_TOKEN \(`hf auth logout`"),
    (403, "GatedRepo", r"someone/drafter is a gated repository on the Hugging Face hub"),
    (404, "RepoNotFound", r"someone/drafter is neither a local path nor a repository on the Hugging Face hub"),
])
def test_a_repository_the_hub_refuses_is_loaded_from_the_cache_when_it_holds_a_copy(refusing_hub, tiny_pair,
                                                                                      monkeypatch, status, code, said):
    """A job run without the token its download had (a private or gated repository), or with an expired one: the
    hub refuses, and a copy in the cache was refused with it (a token the hub did not take was called "the hub is
    not reachable", with advice to download elsewhere). transformers loads the copy; so does dflash, and says so."""
    from huggingface_hub import constants

    monkeypatch.setattr(loading, "_stale_warned", set())
    refusing_hub(status, code, "Invalid credentials in Authorization header" if status == 401 else "refused")
    with pytest.raises(CheckpointError, match=f"^{said}"):
        resolve_model_dir("someone/drafter")
    snapshot = cached_copy(Path(constants.HF_HUB_CACHE), "someone/drafter", tiny_pair[1])
    with pytest.warns(DFlashWarning, match=f"^{said}.*Using the local cache's copy of someone/drafter"):
        assert resolve_model_dir("someone/drafter") == snapshot


def test_a_revision_of_a_hub_id_is_loaded_as_asked(tiny_pair, tmp_path, monkeypatch, capsys):
    """What `hf download ID --revision v1.0` leaves in the cache: no main, a v1.0. Neither the API nor the CLI
    could ask for it (the cache was said to have no copy)."""
    from huggingface_hub import constants

    from dflash import DFlash
    from dflash.cli.main import main

    cached_copy(tmp_path / "hub", "someone/target", tiny_pair[0], ref="v1.0")
    cached_copy(tmp_path / "hub", "someone/drafter", tiny_pair[1], ref="v2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="has no copy of it"):
        DFlash.from_pretrained("someone/target", "someone/drafter", device="cpu")
    pipe = DFlash.from_pretrained("someone/target", "someone/drafter", revision="v1.0", draft_revision="v2",
                                  device="cpu")
    local = DFlash.from_pretrained(*tiny_pair, device="cpu")
    ids = [5, 6, 7]
    assert pipe.generate(ids, max_new_tokens=6).output_ids == local.generate(ids, max_new_tokens=6).output_ids
    assert main(["generate", "--target", "someone/target", "--revision", "v1.0", "--draft", "someone/drafter",
                 "--draft-revision", "v2", "--prompt", "Hi", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    with pytest.raises(UserError, match=r"revision \(--revision\) picks a version of a Hugging Face hub id, and .* "
                                        r"is a local directory: leave it out"):
        DFlash.from_pretrained(*tiny_pair, revision="v1.0")
    assert main(["generate", "--target", str(tiny_pair[0]), "--no-draft", "--draft-revision", "v2", "--prompt",
                 "Hi"]) == 2
    said = capsys.readouterr().err
    assert "--draft-revision picks a version of the hub id given as --draft: give --draft too" in said


def test_an_incomplete_copy_in_the_hub_cache_says_to_download_it_again(tiny_pair, tmp_path, monkeypatch):
    """A snapshot with config.json alone (single files fetched, or a download that stopped) was told to copy a
    tokenizer into the cache's folder by hand."""
    from huggingface_hub import constants

    from dflash import DFlash

    cached_copy(tmp_path / "hub", "someone/target", tiny_pair[0], ["config.json"])
    cached_copy(tmp_path / "hub", "someone/drafter", tiny_pair[1], ["config.json"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="has no tokenizer .*the Hugging Face cache's copy of someone/target, "
                                              "and incomplete .*`hf download someone/target` fetches the rest"):
        DFlash.from_pretrained("someone/target", no_draft=True, device="cpu")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights in .*; it is the Hugging Face cache's copy "
                                              "of someone/drafter"):
        load_drafter("someone/drafter")


def test_an_unreadable_generation_config_is_named(tiny_pair, tmp_path, caplog):
    """transformers falls back to config.json's values without a word: the model's stop tokens and sampling defaults
    were lost unseen."""
    from dflash.model.target import TargetModel

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "generation_config.json").write_text("{bad")
    with caplog.at_level("WARNING", logger="dflash.model.target"):
        TargetModel.from_pretrained(target)
    assert any(f"{target / 'generation_config.json'} is unreadable" in r.getMessage() and "fix the file"
               in r.getMessage() for r in caplog.records)


def test_config_values_of_the_wrong_kind_say_what_they_should_be(tmp_path):
    """A mask token id given as text was called 'outside the vocabulary'; a config dtype dflash does not load was
    'unknown' with no word of where it came from; a layer type no engine knows ran as full attention."""
    no_mask = public_config(dflash_config={"target_layer_ids": [1, 2]})
    write_checkpoint(tmp_path / "m", no_mask, public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match="mask token id '4' is not a token id: give a whole number"):
        load_drafter(tmp_path / "m", mask_token_id="4")
    write_checkpoint(tmp_path / "t", public_config(dtype="nonsense"), public_state_dict(2, 2 * H))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / 't' / 'config.json'))} gives the "
                                              r"drafter's dtype as 'nonsense', which is none dflash loads"):
        load_drafter(tmp_path / "t")
    assert load_drafter(tmp_path / "t", dtype="float32").dtype == torch.float32  # a dtype given wins
    write_checkpoint(tmp_path / "l", public_config(layer_types=["full_attention", "weird"]),
                     public_state_dict(2, 2 * H))
    with pytest.raises(UserError, match=r"layer_types holds \['weird'\]; a draft layer is full_attention or "
                                        "sliding_attention"):
        load_drafter(tmp_path / "l")


def test_looking_for_safetensors_in_a_repository_of_pickled_weights_says_nothing(caplog):
    """huggingface_hub warns "No files matched ..." when the safetensors pattern finds none (facebook/opt-350m)."""
    import logging

    snapshot_logger = logging.getLogger("huggingface_hub._snapshot_download")
    with caplog.at_level(logging.WARNING, logger="huggingface_hub._snapshot_download"):
        with loading._quiet_when_nothing_matches():
            snapshot_logger.warning("No files matched allow_patterns=['*.safetensors'].")
        snapshot_logger.warning("after it")
    assert [r.getMessage() for r in caplog.records] == ["after it"]
