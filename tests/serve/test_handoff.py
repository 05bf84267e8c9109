"""`dflash serve --engine vllm|sglang`: the pair is checked from its files, then the exact command is built."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from dflash.cli.main import Terminated, main
from dflash.serve import handoff


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)


def dry_run(capsys, *args) -> list[str]:
    assert main(["serve", *args, "--dry-run"]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_vllm_command(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--port", "9000",
                   "--max-model-len", "512", "--max-batch-size", "16")
    assert argv[:3] == ["vllm", "serve", target]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    # block size 8; the drafter's block attends both ways, and its backend is named where vLLM gives it the drafter
    assert spec == {"method": "dflash", "model": draft, "num_speculative_tokens": 7, "attention_backend": "FLASH_ATTN"}
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--port"] == "9000" and flags["--host"] == "127.0.0.1" and "--api-key" not in flags
    assert flags["--max-model-len"] == "512" and flags["--max-num-seqs"] == "16"
    assert "--attention-backend" not in flags  # the target's backend is vLLM's own choice
    assert "--attention-backend" not in dry_run(capsys, "--target", target, "--no-draft", "--engine", "vllm")


def backends(argv: list[str]) -> tuple[str | None, str | None]:
    """The target's backend (--attention-backend) and the drafter's (vLLM's speculative config) in a command."""
    target = argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else None
    spec = json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else {}
    return target, spec.get("attention_backend")


@pytest.mark.parametrize("engine,given,expected", [
    ("vllm", [], (None, "FLASH_ATTN")), ("vllm", ["--attention-backend", "auto"], (None, None)),
    ("vllm", ["--attention-backend", "FLEX_ATTENTION"], ("FLEX_ATTENTION", "FLASH_ATTN")),
    ("sglang", [], (None, None)), ("sglang", ["--attention-backend", "fa3"], ("fa3", None))])
def test_vllms_drafter_gets_flash_attn_in_its_speculative_config_and_the_flag_sets_the_targets(
        tiny_pair, capsys, engine, given, expected):
    """vLLM (since PR 39930) gives the drafter the speculative config's attention_backend alone, and its own choice
    without one, whatever --attention-backend says: the flag alone no longer reached the drafter."""
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", engine, *given)
    assert backends(argv) == expected


def test_without_vllm_here_the_dry_run_says_which_releases_its_command_is_for(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", "--dry-run"]) == 0
    assert "an older vLLM refuses attention_backend there: drop it and add --attention-backend flash_attn" in \
        capsys.readouterr().err


@pytest.mark.parametrize("latent", [False, True])
def test_an_older_vllm_here_gets_the_drafters_backend_as_the_flag_but_for_a_latent_attention_target(
        tiny_pair, tmp_path, capsys, monkeypatch, latent):
    """Before PR 39930 vLLM refused attention_backend in the speculative config and gave the drafter the target's
    --attention-backend; DeepSeek's latent attention (kv_lora_rank) has backends of its own, so it keeps vLLM's."""
    target, draft = tiny_pair
    if latent:
        target = broken_copy(tmp_path, target, lambda c: c.update(kv_lora_rank=16))
    monkeypatch.setattr(handoff, "vllm_takes_draft_attention_backend", lambda: False)
    argv = dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", "vllm")
    assert backends(argv) == (None if latent else "flash_attn", None)
    monkeypatch.setattr(handoff, "vllm_takes_draft_attention_backend", lambda: True)
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--engine", "vllm", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert backends(shlex.split(out)) == (None, "FLASH_ATTN") and "vLLM is not installed here" not in err


@pytest.mark.parametrize("source,expected", [(None, None), ("class SpeculativeConfig:\n    method: str\n", False),
                                             ("    attention_backend: AttentionBackendEnum | None = None\n", True)])
def test_whether_the_installed_vllm_takes_the_drafters_backend_is_read_from_its_source(
        tmp_path, monkeypatch, source, expected):
    if source is not None:
        (tmp_path / "vllm" / "config").mkdir(parents=True)
        (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('vLLM must not be imported')\n")
        (tmp_path / "vllm" / "config" / "speculative.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    assert handoff.vllm_takes_draft_attention_backend() is expected


def test_the_attention_backend_flag_is_for_a_hand_off(capsys):
    assert main(["serve", "--attention-backend", "flash_attn"]) == 2
    assert "use it with --engine vllm or --engine sglang" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_api_key_is_never_printed(tiny_pair, capsys, engine):
    """--dry-run reads the key from $DFLASH_API_KEY in the printed command; vLLM gets it from VLLM_API_KEY."""
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", engine, "--api-key", "s3cret",
                 "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert "s3cret" not in line
    if engine == "vllm":
        assert line.startswith('VLLM_API_KEY="$DFLASH_API_KEY" vllm serve') and "--api-key" not in line
    else:
        assert '--api-key "$DFLASH_API_KEY"' in line  # SGLang reads the key from its command line only


def test_vllm_gets_the_api_key_from_its_environment(tiny_pair, monkeypatch, capsys):
    """Launched, vLLM reads VLLM_API_KEY: the key stays off its command line (visible in ps) and the log."""
    target, draft = map(str, tiny_pair)
    launched = {}
    monkeypatch.setattr(handoff, "ensure_installed", lambda engine: None)
    monkeypatch.setattr(handoff.subprocess, "Popen", lambda argv, env: launched.update(argv=argv, env=env) or
                        FakeEngine())
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", "--api-key", "s3cret"]) == 0
    assert launched["env"]["VLLM_API_KEY"] == "s3cret" and "s3cret" not in launched["argv"]
    assert "s3cret" not in capsys.readouterr().err


class FakeEngine:
    """A launched engine: exits at once, or is stopped by our SIGTERM while it runs."""

    def __init__(self, stops: bool = False):
        self.stops, self.signals, self.waits = stops, [], []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.stops and not self.signals:
            raise Terminated  # our SIGTERM, arriving while we wait for the engine
        return 0

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")


def test_a_sigterm_to_the_hand_off_stops_the_engine_too(tiny_pair, monkeypatch, capsys):
    """Ctrl-C reaches the engine with us (one process group); a SIGTERM to our process alone would leave it
    running without us: it is passed on."""
    target, draft = map(str, tiny_pair)
    engine = FakeEngine(stops=True)
    monkeypatch.setattr(handoff, "ensure_installed", lambda engine: None)
    monkeypatch.setattr(handoff.subprocess, "Popen", lambda argv, env: engine)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm"]) == 143
    assert engine.signals == ["TERM"]
    assert "dflash serve: terminated" in capsys.readouterr().err


def test_the_shutdown_timeout_goes_to_vllm_and_the_engine_gets_it_before_being_killed(tiny_pair, monkeypatch,
                                                                                     capsys):
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--shutdown-timeout", "44.2")
    assert argv[argv.index("--shutdown-timeout") + 1] == "45"  # whole seconds, rounded up
    assert "--shutdown-timeout" not in dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm")
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "sglang", "--shutdown-timeout", "30",
                 "--dry-run"]) == 2
    assert "--shutdown-timeout has no SGLang server flag" in capsys.readouterr().err
    engine = FakeEngine(stops=True)  # SIGTERM while it runs: it drains, and is killed only past its drain
    monkeypatch.setattr(handoff, "ensure_installed", lambda engine: None)
    monkeypatch.setattr(handoff.subprocess, "Popen", lambda argv, env: engine)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", "--shutdown-timeout",
                 "60"]) == 143
    assert engine.signals == ["TERM"] and engine.waits[-1] == 60 + handoff.ENGINE_STOP_S


def test_an_empty_api_key_variable_means_no_key(tiny_pair, capsys, monkeypatch):
    target, draft = map(str, tiny_pair)
    monkeypatch.setenv("DFLASH_API_KEY", "")
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm")
    assert "--api-key" not in argv and not argv[0].startswith("VLLM_API_KEY")


def test_max_model_len_beyond_the_targets_context_is_refused(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    code = main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", "--max-model-len", "4096",
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "exceeds the target's context of 1024 tokens" in err and "Traceback" not in err


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_config_that_is_not_json_is_a_clear_error(tiny_pair, tmp_path, capsys, which):
    target, draft = tiny_pair
    broken = tmp_path / which
    shutil.copytree(target if which == "target" else draft, broken)
    (broken / "config.json").write_text("{oops")
    pair = {"target": target, "draft": draft, which: broken}
    code = main(["serve", "--target", str(pair["target"]), "--draft", str(pair["draft"]), "--engine", "vllm",
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "config.json is not valid JSON" in err and "Traceback" not in err


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
    ("not_a_drafter", "a draft model for classic speculative decoding"),
    ("unknown_architecture", "architectures"),
    ("no_mask", "mask token"),
    ("no_weights", "safetensors"),
    ("block_too_big", "--block-size 32 is not usable"),
    ("target_as_draft", "a draft model for classic speculative decoding"),
    ("no_hidden_size", "hidden_size"),
    ("dflash2", "serve it with `dflash serve`"),
    # each below printed a command, or a traceback, where loading the pair refuses it
    ("damaged_weights", "model.safetensors are damaged or incomplete (SafetensorError: "),
    ("wrong_shape", "do not fit its config.json: layers.0.mlp.down_proj.weight: file "),
    ("extra_weights", "do not fit its config.json: unexpected ['embed_tokens.weight']"),
    ("bad_rope", "transformers cannot build its rotary embedding from it (TypeError: "),
    ("missing_shard", "the shard model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing"),
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
    elif case == "unknown_architecture":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(architectures=["SomethingElse"]))
    elif case == "no_mask":
        draft = broken_copy(tmp_path, draft, lambda c: (c.pop("dflash_config"), c.pop("mask_token_id", None)))
    elif case == "no_weights":
        draft = broken_copy(tmp_path, draft, drop_weights=True)
    elif case == "no_hidden_size":
        draft = broken_copy(tmp_path, draft, lambda c: c.pop("hidden_size"))
    elif case == "dflash2":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(architectures=["DFlash2DraftModel"]))
    elif case == "block_too_big":
        extra = ["--block-size", "32"]
    elif case == "damaged_weights":
        draft = broken_copy(tmp_path, draft)
        weights = draft / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:300])
    elif case in ("wrong_shape", "extra_weights"):
        from safetensors.torch import load_file, save_file

        draft = broken_copy(tmp_path, draft, (lambda c: c.update(intermediate_size=c["intermediate_size"] + 8))
                            if case == "wrong_shape" else None)
        weights = load_file(draft / "model.safetensors")
        if case == "extra_weights":
            weights["embed_tokens.weight"] = weights["fc.weight"].clone()
        save_file(weights, draft / "model.safetensors")
    elif case == "bad_rope":
        draft = broken_copy(tmp_path, draft, lambda c: c.update(rope_theta="abc"))
    elif case == "missing_shard":  # a sharded drafter whose second shard did not arrive
        from safetensors.torch import load_file, save_file

        draft = broken_copy(tmp_path, draft)
        weights = load_file(draft / "model.safetensors")
        (draft / "model.safetensors").unlink()
        names = sorted(weights)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        save_file({k: weights[k] for k in names[::2]}, draft / "model-00001-of-00002.safetensors")
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        draft = target
    code = main(["serve", "--target", str(target), "--draft", str(draft), "--engine", "vllm", "--dry-run", *extra])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err and "?." not in err


@pytest.mark.parametrize("case, expected", [
    ("masked_lm", "declares architectures ['BertForMaskedLM'], heads for other tasks than generating text"),
    ("encoder_decoder", "is an encoder-decoder model (T5ForConditionalGeneration); DFlash drafts for a decoder-only"),
    ("no_tokenizer", "has no tokenizer"),
    ("size_as_text", "gives hidden_size '64': each must be a whole number >= 1"),
])
def test_targets_loading_refuses_are_refused_by_the_dry_run_too(tiny_pair, tmp_path, capsys, case, expected):
    """Each printed a command for the engine to refuse after its start-up (hidden_size "64": 'drafter 64, target
    64')."""
    target, draft = tiny_pair
    fields = {"masked_lm": {"architectures": ["BertForMaskedLM"]},
              "encoder_decoder": {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True},
              "size_as_text": {"hidden_size": "64"}}.get(case, {})
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    config = json.loads((copy / "config.json").read_text())
    if case == "size_as_text":
        fields["hidden_size"] = str(config["hidden_size"])
        expected = expected.replace("'64'", repr(fields["hidden_size"]))
    (copy / "config.json").write_text(json.dumps({**config, **fields}))
    if case == "no_tokenizer":
        (copy / "tokenizer.json").unlink()
        (copy / "tokenizer_config.json").unlink()
    code = main(["serve", "--target", str(copy), "--draft", str(draft), "--engine", "vllm", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err


def legacy_form(config: dict, keep_layer_ids: bool = False) -> None:
    """A drafter config.json of the legacy form: no dflash_config, the mask token id at the top level."""
    dflash = config.pop("dflash_config")
    config["mask_token_id"] = dflash["mask_token_id"]
    if keep_layer_ids:
        config["target_layer_ids"] = dflash["target_layer_ids"]


@pytest.mark.parametrize("keep_layer_ids,unnamed", [(False, "target_layer_ids and mask_token_id"),
                                                    (True, "target_layer_ids and mask_token_id")])
def test_vllm_is_refused_a_drafter_whose_config_leaves_it_to_guess(tiny_pair, tmp_path, capsys, keep_layer_ids,
                                                                   unnamed):
    """Without layer ids vLLM taps its model's default layers, not the formula dflash and SGLang derive; its older
    releases read the mask token id from dflash_config only. The refusal gives the fields to write; SGLang, which
    reads the legacy form as dflash does, takes the same drafter."""
    target, draft = tiny_pair
    expected = json.loads((draft / "config.json").read_text())["dflash_config"]
    legacy = broken_copy(tmp_path, draft, lambda c: legacy_form(c, keep_layer_ids))
    assert main(["serve", "--target", str(target), "--draft", str(legacy), "--engine", "vllm", "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"does not name {unnamed} in its dflash_config" in err and "Traceback" not in err
    fields = json.loads(err[err.index("{"):err.rindex("}") + 1])["dflash_config"]
    assert fields["target_layer_ids"] == expected["target_layer_ids"]
    assert fields["mask_token_id"] == expected["mask_token_id"]
    argv = dry_run(capsys, "--target", str(target), "--draft", str(legacy), "--engine", "sglang")
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(legacy)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("layer_ids, refusal", [
    ([1, 1], "target_layer_ids [1, 1]: they name layer 1 more than once"),
    ([2, 1], "target_layer_ids [2, 1]: they are not in ascending order"),
    ([1, 3], "target_layer_ids [1, 3]: they include the target's last layer (3)"),
])
def test_both_engines_are_refused_feature_layers_they_cannot_tap(tiny_pair, tmp_path, capsys, engine, layer_ids,
                                                                 refusal):
    """vLLM and SGLang tap layer l's output as layer l + 1's input, each layer once, and concatenate the taps in
    layer order, while the drafter's fc takes one slice per listed id in its order."""
    target, draft = tiny_pair
    edited = broken_copy(tmp_path, draft, lambda c: c["dflash_config"].update(target_layer_ids=layer_ids))
    assert main(["serve", "--target", str(target), "--draft", str(edited), "--engine", engine, "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert refusal in err and "serve it with `dflash serve` (without --engine)" in err and "Traceback" not in err


@pytest.mark.parametrize("taps, refused", [([2], True), ([3], False), (3, True)])  # it reads layer 2: tap 3
def test_vllm_is_refused_eagle_taps_that_are_not_the_drafters_layers(tiny_pair, tmp_path, capsys, taps, refused):
    """vLLM takes eagle_aux_hidden_state_layer_ids, when a config names them, before dflash_config's layer ids."""
    target, draft = tiny_pair
    edited = broken_copy(tmp_path, draft, lambda c: c.update(eagle_aux_hidden_state_layer_ids=taps))
    code = main(["serve", "--target", str(target), "--draft", str(edited), "--engine", "vllm", "--dry-run"])
    assert code == (2 if refused else 0)
    err = capsys.readouterr().err
    assert ("which vLLM taps instead" in err or "must be a list of layer ids, got 3" in err) == refused
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def two_layer_pair(tmp_path_factory):
    from conftest import save_tiny_pair

    target, draft = save_tiny_pair(tmp_path_factory.mktemp("two_layers"), drafter_layers=2)
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 2]  # the formula's [1, 1] on 4 target layers, tapped once each
    (draft / "config.json").write_text(json.dumps(config))
    return target, draft


SLIDING_FIRST = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                 "use_sliding_window": True}


@pytest.mark.parametrize("fields, v2_runner", [
    (SLIDING_FIRST, True),
    ({**SLIDING_FIRST, "layer_types": ["sliding_attention"] * 2}, False),
    ({}, False),
])
def test_vllm_gets_its_v2_runner_for_a_drafter_of_sliding_and_full_layers(two_layer_pair, tmp_path, capsys, fields,
                                                                          v2_runner):
    """vLLM's DFlash loader raises for mixed sliding and full draft layers unless VLLM_USE_V2_MODEL_RUNNER=1."""
    target, draft = two_layer_pair
    edited = broken_copy(tmp_path, draft, lambda c: c.update(fields))
    argv = dry_run(capsys, "--target", str(target), "--draft", str(edited), "--engine", "vllm", "--api-key", "k")
    assert argv[:2] == (["VLLM_API_KEY=$DFLASH_API_KEY", "VLLM_USE_V2_MODEL_RUNNER=1"] if v2_runner
                        else ["VLLM_API_KEY=$DFLASH_API_KEY", "vllm"])
    assert "VLLM_USE_V2_MODEL_RUNNER=1" not in " ".join(dry_run(capsys, "--target", str(target), "--draft",
                                                                 str(edited), "--engine", "sglang"))


@pytest.mark.parametrize("top, dflash, refusal", [
    ({}, {"causal": True}, "SGLang would run draft layer 0 both ways, and it was trained causally"),
    ({}, {"use_swa": True, "swa_window_size": 6}, "draft layer 0 both ways, and it was trained both ways within a "
                                                   "window of 6"),
    (SLIDING_FIRST, {"causal": False}, "draft layer 0 causally within a window of 8, and it was trained both ways "
                                       "within a window of 8"),
    ({"is_causal": True}, {"causal": False}, None),  # is_causal first, for all three readers
    (SLIDING_FIRST, {}, None),
    ({**SLIDING_FIRST, "is_causal": False}, {}, None),
])
def test_sglang_is_refused_attention_it_would_read_otherwise(two_layer_pair, tmp_path, capsys, top, dflash, refusal):
    """SGLang reads is_causal and layer_types, not dflash_config's causal, use_swa or swa_window_size; vLLM reads
    them all, as dflash does."""
    target, draft = two_layer_pair

    def edit(config):
        config.update(top)
        config["dflash_config"].update(dflash)

    edited = broken_copy(tmp_path, draft, edit)
    args = ["serve", "--target", str(target), "--draft", str(edited), "--dry-run"]
    assert main([*args, "--engine", "sglang"]) == (0 if refusal is None else 2)
    err = " ".join(capsys.readouterr().err.split())
    assert refusal is None or (refusal in err and "or hand it to vLLM (--engine vllm)" in err), err
    assert main([*args, "--engine", "vllm"]) == 0


def test_a_target_whose_config_names_its_fields_its_own_way_is_read(tmp_path, capsys):
    """GPT-2's config.json says n_embd and n_layer, which transformers maps to hidden_size and num_hidden_layers."""
    from conftest import save_tiny_pair

    target, draft = save_tiny_pair(tmp_path / "gpt2", family="gpt2")
    assert "n_layer" in json.loads((target / "config.json").read_text())
    argv = dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", "vllm")
    assert argv[:3] == ["vllm", "serve", str(target)]
    wrong = broken_copy(tmp_path, draft, lambda c: c.update(num_target_layers=8))
    assert main(["serve", "--target", str(target), "--draft", str(wrong), "--engine", "vllm", "--dry-run"]) == 2
    assert "number of target layers" in capsys.readouterr().err


def warnings_of(capsys, *args) -> str:
    """What a dry run says on stderr: the hand-off's warnings, as the command prints them."""
    assert main(["serve", *args, "--dry-run"]) == 0
    return capsys.readouterr().err


def test_weights_named_under_model_are_warned_of_for_vllm(tiny_pair, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    target, draft = tiny_pair
    prefixed = broken_copy(tmp_path, draft)
    for file in prefixed.glob("*.safetensors"):
        save_file({f"model.{k}": v for k, v in load_file(file).items()}, file)
    assert dry_run(capsys, "--target", str(target), "--draft", str(prefixed), "--engine", "vllm")[0] == "vllm"
    assert "names its weights model.*" in warnings_of(capsys, "--target", str(target), "--draft", str(prefixed),
                                                      "--engine", "vllm")
    assert "model.*" not in warnings_of(capsys, "--target", str(target), "--draft", str(prefixed), "--engine", "sglang")
    assert "model.*" not in warnings_of(capsys, "--target", str(target), "--draft", str(draft), "--engine", "vllm")


def test_a_gemma_target_on_sglang_is_warned_of_its_scaled_embeddings(tmp_path, capsys):
    """SGLang's Gemma 3 embedding module multiplies by sqrt(hidden) (Gemma 2 scales in its forward, which the drafter
    does not run); dflash and vLLM draft from the table's rows. The warning reads as the command's own."""
    from conftest import save_tiny_pair

    target, draft = save_tiny_pair(tmp_path, family="gemma3_text")
    assert "sqrt(hidden size)" not in warnings_of(capsys, "--target", str(target), "--draft", str(draft),
                                                  "--engine", "vllm")
    said = warnings_of(capsys, "--target", str(target), "--draft", str(draft), "--engine", "sglang")
    assert "dflash serve: warning: SGLang embeds a Gemma 3 target's tokens times sqrt(hidden size)" in said
    assert said.count("SGLang embeds") == 1


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
                           (["--port", "99999"], "at most 65535"), (["--port", "-1"], "--port"),
                           (["--max-request-bytes", "0"], "--max-request-bytes"),
                           (["--fallback-min-acceptance", "nan"], "--fallback-min-acceptance must be a number"),
                           (["--served-model-name", " "], "--served-model-name is empty"),
                           (["--served-model-name", " x "], "--served-model-name ' x ' starts or ends with spaces"),
                           (["--shutdown-timeout", "-1"], "--shutdown-timeout is the seconds requests get"),
                           (["--shutdown-timeout", "inf"], "a number >= 0 (0: stop at once), got inf")]:
        assert main(["serve", *args]) == 2
        assert expected in capsys.readouterr().err


def test_thinking_carries_over_to_vllm_and_is_refused_for_sglang(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--no-enable-thinking")
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == {"enable_thinking": False}
    assert "--default-chat-template-kwargs" not in dry_run(capsys, "--target", target, "--draft", draft,
                                                           "--engine", "vllm")
    argv = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--no-enable-thinking",
                   "--chat-template-kwargs", '{"reasoning_effort": "low"}')
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == {"reasoning_effort": "low",
                                                                                "enable_thinking": False}
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "sglang", "--enable-thinking",
                 "--dry-run"]) == 2
    assert "chat_template_kwargs" in capsys.readouterr().err


def test_the_default_hand_off_is_the_embedded_pair_with_its_dflash_drafter(capsys):
    """The embedded drafter is DFlash2, which the engines' DFlash method cannot load: --engine without --target
    and --draft hands over the embedded target with the DFlash drafter trained for it."""
    from dflash.api import DEFAULT_TARGET, HANDOFF_DRAFT

    argv = dry_run(capsys, "--engine", "vllm")
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert argv[2] == str(DEFAULT_TARGET)
    assert argv[argv.index("--served-model-name") + 1] == "dflash"  # the name dflash serve gives it, not a path
    assert spec == {"method": "dflash", "model": str(HANDOFF_DRAFT), "num_speculative_tokens": 15,
                    "attention_backend": "FLASH_ATTN"}
    argv = dry_run(capsys, "--engine", "sglang")
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(HANDOFF_DRAFT)


def test_the_embedded_dflash2_drafter_is_refused_with_the_way_to_its_sibling(capsys):
    from dflash.api import DEFAULT_DRAFT, DEFAULT_TARGET, HANDOFF_DRAFT

    code = main(["serve", "--target", str(DEFAULT_TARGET), "--draft", str(DEFAULT_DRAFT), "--engine", "vllm",
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and f"DFlash drafter is {HANDOFF_DRAFT}" in err and "Traceback" not in err


def test_a_branch_length_with_a_hand_off_is_refused(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    code = main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", "--branch-length", "4",
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "--branch-length is this package's engine's; vllm" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, named", [
    (["--device", "cpu"], "--device is this server's own and does"),
    (["--max-queue", "5", "--no-adaptive-block-size"],
     "--max-queue, --no-adaptive-block-size are this server's own and do"),
    (["--fallback-min-acceptance", "2", "--drafter-precision", "bfloat16"],
     "--drafter-precision, --fallback-min-acceptance are this server's own and do"),
    (["--allowed-origins", "*"], "--allowed-origins is this server's own and does"),
])
def test_flags_only_this_server_reads_are_refused_not_dropped(tiny_pair, capsys, flags, named):
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "vllm", *flags, "--dry-run"]) == 2
    assert f"dflash serve: error: {named} not carry over to vllm" in capsys.readouterr().err
    assert dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--max-queue", "64")  # defaults


def test_a_dry_run_says_where_the_key_comes_from_and_an_open_address_is_warned_of(tiny_pair, capsys):
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "sglang", "--api-key", "k",
                 "--dry-run"]) == 0
    assert "the command reads the API key from $DFLASH_API_KEY; export it" in capsys.readouterr().err
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "sglang", "--host", "0.0.0.0",
                 "--dry-run"]) == 0
    assert "warning: listening on 0.0.0.0 without --api-key" in capsys.readouterr().err


def test_a_hub_id_without_the_hub_fails_at_once_saying_how_to_get_it(capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", "/nonexistent-hub-cache")
    assert main(["serve", "--target", "org/target-model", "--draft", "org/drafter", "--engine", "vllm",
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert ("org/target-model is not a local directory, and it cannot be downloaded: HF_HUB_OFFLINE (or "
            "TRANSFORMERS_OFFLINE) is set") in err
    assert "`hf download org/target-model`" in err


def test_the_log_level_carries_over_and_a_block_size_without_a_drafter_is_refused(tiny_pair, capsys):
    """--log-level was dropped without a word, and --block-size with --no-draft too (the native server refuses it)."""
    target, draft = map(str, tiny_pair)
    vllm = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "vllm", "--log-level", "debug")
    assert vllm[vllm.index("--uvicorn-log-level") + 1] == "debug"
    sglang = dry_run(capsys, "--target", target, "--draft", draft, "--engine", "sglang", "--log-level", "warning")
    assert sglang[sglang.index("--log-level") + 1] == "warning"
    for engine, flag in (("vllm", "--uvicorn-log-level"), ("sglang", "--log-level")):  # info: the engines' default
        assert flag not in dry_run(capsys, "--target", target, "--draft", draft, "--engine", engine)
        assert main(["serve", "--target", target, "--no-draft", "--block-size", "4", "--engine", engine,
                     "--dry-run"]) == 2
        assert "--no-draft hands over the target alone" in capsys.readouterr().err


def test_a_local_path_that_does_not_exist_is_said_not_to_exist(tiny_pair, tmp_path, capsys):
    """./nope was 'not a directory'."""
    target, _ = tiny_pair
    for missing in ("./nope", str(tmp_path / "nope")):
        assert main(["serve", "--target", str(target), "--draft", missing, "--engine", "vllm", "--dry-run"]) == 2
        assert f"{missing} does not exist; give a checkpoint directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["serve", "--target", str(target), "--draft", str(tmp_path / "file"), "--engine", "vllm",
                 "--dry-run"]) == 2
    assert "file is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("target_dtype,draft_dtype,given,expected", [
    ("bfloat16", "float32", [], "bfloat16"), ("float16", None, [], "float16"), ("bfloat16", "bfloat16", [], None),
    ("float32", "float32", [], None), ("bfloat16", "float32", ["--dtype", "float16"], "float16")])
def test_sglang_runs_a_float32_drafter_in_the_dtype_of_a_16_bit_target(tiny_pair, tmp_path, capsys, target_dtype,
                                                                         draft_dtype, given, expected):
    """SGLang loads a float32 config in float16 and hands the drafter the target's hidden states as they are: a
    float32 drafter (dflash train's export) beside a bfloat16 target would fail at its first draft."""
    target, draft = tiny_pair

    def declare(dtype):
        def edit(config):
            config.pop("dtype", None)
            config.pop("torch_dtype", None)
            if dtype is not None:
                config["torch_dtype"] = dtype
        return edit

    target = broken_copy(tmp_path / "t", target, declare(target_dtype))
    draft = broken_copy(tmp_path / "d", draft, declare(draft_dtype))
    argv = dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", "sglang", *given)
    assert (argv[argv.index("--dtype") + 1] if "--dtype" in argv else None) == expected
    argv = dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", "vllm", *given)
    assert "--dtype" not in argv or given  # vLLM runs the drafter in the target's dtype itself


def test_sglang_is_refused_a_drafter_without_num_target_layers_whose_layers_it_would_count_wrong(tiny_pair, tmp_path,
                                                                                               capsys):
    target, draft = tiny_pair
    config = json.loads((draft / "config.json").read_text())
    layers, taps = config["num_hidden_layers"], config["dflash_config"]["target_layer_ids"]
    assert max(taps) >= layers  # else SGLang's count would do
    lacking = broken_copy(tmp_path, draft, lambda c: c.pop("num_target_layers"))
    assert main(["serve", "--target", str(target), "--draft", str(lacking), "--engine", "sglang", "--dry-run"]) == 2
    target_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    assert f'SGLang then counts the target\'s layers as the drafter\'s {layers}, so it refuses target layer ' \
           f'{max(taps)}; add "num_target_layers": {target_layers} to the file' in capsys.readouterr().err
    dry_run(capsys, "--target", str(target), "--draft", str(lacking), "--engine", "vllm")  # vLLM reads the target's
    dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", "sglang")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_target_that_writes_hermes_calls_keeps_tool_choice_auto_after_the_hand_off(tiny_pair, tmp_path, capsys,
                                                                                      engine):
    """vLLM reads Hermes' <tool_call> blocks, as dflash serve does, only with its hermes parser named; SGLang's
    parser is named per model family, so the dry run says which to add."""
    target, draft = tiny_pair
    plain = dry_run(capsys, "--target", str(target), "--draft", str(draft), "--engine", engine)
    assert "--tool-call-parser" not in plain  # the tiny target's template shows no tools
    hermes = tmp_path / "target"
    shutil.copytree(target, hermes)
    (hermes / "chat_template.jinja").write_text("{% for tool in tools or [] %}{{ tool | tojson }}{% endfor %}"
                                                "{% for m in messages %}{{ m.content }}<tool_call>{% endfor %}")
    assert main(["serve", "--target", str(hermes), "--draft", str(draft), "--engine", engine, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    argv = shlex.split(out.strip())
    if engine == "vllm":
        at = argv.index("--tool-call-parser")
        assert argv[at - 1: at + 2] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    else:
        assert "--tool-call-parser" not in argv and "--tool-call-parser qwen25" in err
