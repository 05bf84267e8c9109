"""A checkpoint that ships its own Python code (config.json's auto_map, for an architecture transformers lacks):
refused with the flag that loads it, never an interactive question; loaded and decoded losslessly with it."""

from __future__ import annotations

import json

import pytest

from conftest import make_tokenizer, tiny_drafter, tiny_target_model
from dflash import DFlash
from dflash.cli.main import main
from dflash.model.loading import CheckpointError
from dflash.model.target import TargetModel
from dflash.serve.handoff import HandoffOptions, sglang_command, vllm_command

CONFIG_CODE = '''from transformers import LlamaConfig


class ShippedConfig(LlamaConfig):
    model_type = "shipped_llama"
'''
MODEL_CODE = '''from transformers import LlamaForCausalLM

from .configuration_shipped import ShippedConfig


class ShippedForCausalLM(LlamaForCausalLM):
    config_class = ShippedConfig
'''


@pytest.fixture(scope="module")
def custom_code_target(tmp_path_factory):
    """A tiny llama saved as a model with code of its own, and a random DFlash drafter for it."""
    root = tmp_path_factory.mktemp("remote_code")
    target_dir = root / "shipped_model"
    model, tokenizer = tiny_target_model("llama"), make_tokenizer()
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    (target_dir / "configuration_shipped.py").write_text(CONFIG_CODE)
    (target_dir / "modeling_shipped.py").write_text(MODEL_CODE)
    config = json.loads((target_dir / "config.json").read_text())
    config.update(model_type="shipped_llama", architectures=["ShippedForCausalLM"],
                  auto_map={"AutoConfig": "configuration_shipped.ShippedConfig",
                            "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM"})
    (target_dir / "config.json").write_text(json.dumps(config))
    drafter = tiny_drafter(TargetModel(model, tokenizer), block_size=8)
    drafter.config.mask_token_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    drafter.save_pretrained(root / "draft")
    return target_dir, root / "draft"


def test_without_the_flag_it_is_refused_with_the_flag_named(custom_code_target, capsys, monkeypatch):
    target, _ = custom_code_target
    with pytest.raises(CheckpointError, match="needs the Python code it ships .* --trust-remote-code"):
        DFlash.from_pretrained(target, no_draft=True)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)  # transformers asks a terminal otherwise
    assert main(["generate", "--target", str(target), "--no-draft", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and "Traceback" not in err and "[y/N]" not in err


def test_with_the_flag_it_decodes_losslessly(custom_code_target, capsys):
    target, draft = custom_code_target
    pipe = DFlash.from_pretrained(target, draft, trust_remote_code=True)
    assert type(pipe.target.model).__name__ == "ShippedForCausalLM"
    plain = DFlash.from_pretrained(target, no_draft=True, trust_remote_code=True)
    ids = [5, 6, 7, 8, 9]
    assert pipe.generate(ids, max_new_tokens=24).output_ids == plain.generate(ids, max_new_tokens=24).output_ids
    assert main(["generate", "--target", str(target), "--no-draft", "--trust-remote-code", "--raw", "--prompt", "hi",
                 "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_output_tokens"] == 3


def test_the_hand_off_passes_the_flag_on():
    options = HandoffOptions(trust_remote_code=True)
    assert "--trust-remote-code" in vllm_command("t", "d", 16, options).argv
    assert "--trust-remote-code" in sglang_command("t", "d", 16, options).argv
    assert "--trust-remote-code" not in vllm_command("t", "d", 16, HandoffOptions()).argv


def test_datagen_takes_the_flag(custom_code_target, tmp_path):
    from dflash.training.datagen import DatagenConfig, run_datagen

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "How many clips?"}) + "\n")
    config = DatagenConfig(target=str(custom_code_target[0]), prompts=str(prompts), output=str(tmp_path / "o.jsonl"),
                           max_new_tokens=3, device="cpu")
    with pytest.raises(CheckpointError, match="--trust-remote-code"):
        run_datagen(config)
    config.trust_remote_code = True
    assert run_datagen(config).written == 1


def test_a_hub_checkpoint_brings_its_code_along(custom_code_target, tmp_path, monkeypatch):
    """A hub download fetches the checkpoint's .py files too: without them transformers finds no code to run."""
    import fnmatch
    import shutil

    import huggingface_hub

    def snapshot_download(repo_id, revision=None, allow_patterns=(), local_files_only=False, **kwargs):
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for file in custom_code_target[0].iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("dflash.hub.unreachable", lambda *args, **kwargs: None)  # the hub answers
    pipe = DFlash.from_pretrained("someone/shipped-model", no_draft=True, trust_remote_code=True)
    assert type(pipe.target.model).__name__ == "ShippedForCausalLM"


def test_a_hub_repository_with_pytorch_weights_alone_brings_them(tiny_pair, tmp_path, monkeypatch):
    """An older repository has pytorch_model.bin and no safetensors: the weights were never fetched, and transformers
    then said the snapshot had no pytorch_model.bin."""
    import fnmatch
    import shutil

    import huggingface_hub
    import torch
    from safetensors.torch import load_file

    repo = tmp_path / "repo"  # the hub's copy: the tiny target with its weights pickled
    shutil.copytree(tiny_pair[0], repo)
    torch.save(load_file(repo / "model.safetensors"), repo / "pytorch_model.bin")
    (repo / "model.safetensors").unlink()
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=(), local_files_only=False, **kwargs):
        asked.append(list(allow_patterns))
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for file in repo.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("dflash.hub.unreachable", lambda *args, **kwargs: None)
    pipe = DFlash.from_pretrained("someone/older-model", no_draft=True, device="cpu")
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    assert (pipe.generate([5, 6, 7], max_new_tokens=4).output_ids
            == plain.generate([5, 6, 7], max_new_tokens=4).output_ids)
    assert asked[1:] == [["*.safetensors"], ["pytorch_model*.bin"]]  # config and tokenizer first
