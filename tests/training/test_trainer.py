"""The trainer end to end on a tiny pair: export/load, exact resume, DDP == single process, lossless use."""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dflash import DFlash
from dflash.cli.main import main
from dflash.errors import UserError
from dflash.model import load_drafter
from dflash.training import Trainer, load_config
from dflash.training.data import load_examples
from dflash.training.objective import build_blocks


@pytest.fixture(scope="module")
def train_data(tmp_path_factory, tiny_pair):
    """Conversations the tiny target 'answered', as `dflash datagen` writes them (ids included)."""
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(16):
            prompt = [rng.randrange(4, 120) for _ in range(rng.randint(4, 10))]
            response = [rng.randrange(4, 120) for _ in range(rng.randint(12, 30))]
            f.write(json.dumps({"id": i, "messages": [], "prompt_ids": prompt, "response_ids": response}) + "\n")
    return path


def config(tiny_pair, train_data, output, **overrides):
    values = dict(target=str(tiny_pair[0]), data=str(train_data), output=str(output), draft_layers=1, block_size=4,
                  anchors_per_sequence=6, max_steps=6, batch_size=4, lr=3e-3, eval_fraction=0.125, eval_every=0,
                  log_every=2, checkpoint_every=3, seed=0, device="cpu")
    if "init_from" in overrides:
        del values["draft_layers"]  # a fine-tune keeps the drafter's depth unless a test asks for more
    values.update(overrides)
    return load_config(None, values)


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "model.safetensors"))


def test_export_loads_with_the_same_outputs_and_decodes_losslessly(tiny_pair, train_data, tmp_path):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out")).setup()
    result = trainer.train()
    assert "eval_loss" in result and len(result["eval_accuracy_per_position"]) == 3
    loaded = load_drafter(tmp_path / "out", dtype="float32")
    for key, value in trainer.drafter.state_dict().items():
        if "rotary" not in key:
            assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.config.to_dict() == trainer.drafter_config.to_dict()
    pipe = DFlash.from_pretrained(tiny_pair[0], tmp_path / "out", device="cpu")
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    for prompt in ("How many clips", "Weng earns 12 dollars"):
        a = pipe.generate(prompt, max_new_tokens=24, stop_token_ids=[])
        assert a.output_ids == plain.generate(prompt, max_new_tokens=24, stop_token_ids=[]).output_ids
        assert a.stats.drafter_forwards > 0


def test_feature_cache_gives_the_same_training(tiny_pair, train_data, tmp_path):
    """Cached target features (memory or disk) train like features computed every step (up to float noise:
    a cached row was computed with another batch's padding)."""
    Trainer(config(tiny_pair, train_data, tmp_path / "plain", eval_every=3)).setup().train()
    for cache in ("memory", str(tmp_path / "features")):
        out = tmp_path / f"cached-{len(cache)}"
        Trainer(config(tiny_pair, train_data, out, eval_every=3, feature_cache=cache)).setup().train()
        a, b = weights(tmp_path / "plain"), weights(out)
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_interrupted_then_resumed_equals_uninterrupted(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "straight")).setup().train()

    class Interrupted(Exception):
        pass

    broken = Trainer(config(tiny_pair, train_data, tmp_path / "resumed")).setup()
    original = broken._train_step

    def step_then_die(indices, epoch):
        if broken.step == 4:  # after the step-3 checkpoint
            raise Interrupted
        return original(indices, epoch)

    broken._train_step = step_then_die
    with pytest.raises(Interrupted):
        broken.train()
    resumed = Trainer(config(tiny_pair, train_data, tmp_path / "resumed", resume=True)).setup()
    assert resumed.step == 3
    resumed.train()
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("anchor_policy", ["uniform", "decoding"])
def test_two_process_ddp_matches_one_process_with_the_doubled_batch(tiny_pair, train_data, tmp_path, anchor_policy):
    common = ["--target", str(tiny_pair[0]), "--data", str(train_data), "--draft-layers", "1", "--block-size", "4",
              "--anchors-per-sequence", "6", "--max-steps", "4", "--lr", "3e-3", "--eval-fraction", "0.125",
              "--eval-every", "0", "--checkpoint-every", "0", "--device", "cpu", "--anchor-policy", anchor_policy]
    assert main(["train", *common, "--batch-size", "4", "--output", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "dflash.cli.main", "train", *common, "--batch-size", "2", "--output", str(tmp_path / "two")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["world_size"] == 2
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=2e-5), (key, (a[key] - b[key]).abs().max())
    changed = weights(tmp_path / "one")["fc.weight"]
    assert changed.abs().sum() > 0


def test_fine_tuning_starts_from_the_given_drafter(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=2)).setup().train()
    tuned = Trainer(config(tiny_pair, train_data, tmp_path / "tuned", init_from=str(tmp_path / "first"),
                           max_steps=1, lr=1e-9)).setup()
    assert tuned.drafter_config.num_hidden_layers == 2  # the checkpoint's shape, not the default of 1
    start = weights(tmp_path / "first")
    assert all(torch.equal(start[k], v) for k, v in tuned.drafter.state_dict().items() if "rotary" not in k)
    tuned.train()
    assert all(torch.allclose(start[k], v, atol=1e-6) for k, v in weights(tmp_path / "tuned").items())


def test_soft_labels_are_the_target_logits_of_the_previous_position(tiny_pair, train_data, tmp_path):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "soft", distill_weight=0.5)).setup()
    batch = trainer._batch("train", [0, 1])
    features, final_hidden = trainer._features(batch)
    assert final_hidden.shape[-1] == trainer.target.hidden_size
    anchors = torch.tensor([[9, 12], [10, 14]])
    blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.attention_mask, anchors,
                          torch.ones_like(anchors).bool(), 4, trainer.drafter_config.mask_token_id, 7.0)
    soft = trainer._soft_targets(final_hidden, blocks)  # (2, 8, vocab)
    for row in range(2):
        length = int(batch.attention_mask[row].sum())
        ids = batch.input_ids[row: row + 1, :length]
        with torch.no_grad():
            logits = trainer.target.model(input_ids=ids).logits[0]  # (T, vocab)
        for slot, position in enumerate(blocks.positions[row].tolist()):
            if blocks.labels[row, slot] >= 0:
                assert torch.allclose(soft[row, slot], logits[position - 1], atol=1e-4), (row, slot)
    result = trainer.train()
    assert math.isfinite(result["eval_loss"])
    Trainer(config(tiny_pair, train_data, tmp_path / "hard")).setup().train()
    assert not torch.allclose(weights(tmp_path / "soft")["fc.weight"], weights(tmp_path / "hard")["fc.weight"])


def test_fine_tuning_can_add_feature_layers_without_changing_the_drafter(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=2)).setup().train()
    first = load_drafter(tmp_path / "first", dtype="float32")
    old_ids = first.config.target_layer_ids
    new_ids = old_ids + [first.config.num_target_layers - 1]  # the last layer's output as well
    wide = Trainer(config(tiny_pair, train_data, tmp_path / "wide", init_from=str(tmp_path / "first"),
                          target_layer_ids=new_ids)).setup()
    assert wide.drafter_config.target_layer_ids == new_ids
    batch = wide._batch("train", [0, 1])
    features, no_soft_labels = wide._features(batch)  # (b, T, len(new_ids) * h)
    assert no_soft_labels is None
    h = wide.target.hidden_size
    old_features = features[..., : len(old_ids) * h]
    with torch.no_grad():
        assert torch.allclose(wide.drafter.project_context(features), first.project_context(old_features), atol=1e-6)
    with pytest.raises(UserError, match="can add layers, not drop them"):
        Trainer(config(tiny_pair, train_data, tmp_path / "narrow", init_from=str(tmp_path / "first"),
                       target_layer_ids=new_ids[1:])).setup()  # one of the drafter's layers left out


def assert_same_outputs(drafter, reference) -> None:
    """Both drafters give the same block hidden states for the same random block and context."""
    b, q, h = 2, 4, reference.config.hidden_size
    inputs = dict(block_embeds=torch.randn(b, q, h), block_positions=torch.arange(10, 10 + q).expand(b, q),
                  context=torch.randn(b, 10, h), context_positions=torch.arange(10).expand(b, 10))
    with torch.no_grad():
        assert torch.allclose(drafter(**inputs), reference(**inputs), atol=1e-6)


def test_fine_tuning_can_widen_the_mlp_without_changing_the_drafter(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=2)).setup().train()
    first = load_drafter(tmp_path / "first", dtype="float32")
    width = first.config.intermediate_size * 2
    wide = Trainer(config(tiny_pair, train_data, tmp_path / "wide", init_from=str(tmp_path / "first"),
                          intermediate_size=width, max_steps=2)).setup()
    assert wide.drafter_config.intermediate_size == width
    assert wide.drafter.layers[0].mlp.gate_proj.weight.shape[0] == width
    assert_same_outputs(wide.drafter, first)
    wide.train()  # the new units learn, and the export loads with its new width
    tuned = load_drafter(tmp_path / "wide", dtype="float32")
    assert tuned.config.intermediate_size == width
    new_columns = tuned.layers[0].mlp.down_proj.weight[:, first.config.intermediate_size:]
    assert new_columns.abs().sum() > 0
    with pytest.raises(UserError, match="can widen its MLP, not narrow it"):
        Trainer(config(tiny_pair, train_data, tmp_path / "narrow", init_from=str(tmp_path / "first"),
                       intermediate_size=width // 4)).setup()


def test_fine_tuning_can_add_drafter_layers_without_changing_the_drafter(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=1)).setup().train()
    first = load_drafter(tmp_path / "first", dtype="float32")
    deep = Trainer(config(tiny_pair, train_data, tmp_path / "deep", init_from=str(tmp_path / "first"),
                          draft_layers=3, max_steps=2)).setup()
    assert len(deep.drafter.layers) == deep.drafter_config.num_hidden_layers == 3
    assert_same_outputs(deep.drafter, first)
    deep.train()  # the new layers learn, and the export loads with three layers
    tuned = load_drafter(tmp_path / "deep", dtype="float32")
    assert tuned.config.num_hidden_layers == len(tuned.config.layer_types) == 3
    assert tuned.layers[2].self_attn.o_proj.weight.abs().sum() > 0
    same = Trainer(config(tiny_pair, train_data, tmp_path / "same", init_from=str(tmp_path / "first"))).setup()
    assert len(same.drafter.layers) == 1  # without --draft-layers the drafter keeps its own depth
    with pytest.raises(UserError, match="can add layers, not remove them"):
        Trainer(config(tiny_pair, train_data, tmp_path / "shallow", init_from=str(tmp_path / "deep"),
                       draft_layers=2)).setup()


def test_extra_train_data_trains_without_changing_the_held_out_split(tiny_pair, train_data, tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(train_data.read_text().splitlines(True)[:5]))  # any records: training only
    plain = Trainer(config(tiny_pair, train_data, tmp_path / "a")).setup()
    more = Trainer(config(tiny_pair, train_data, tmp_path / "b", extra_train_data=str(extra))).setup()
    assert [e.input_ids for e in more.eval_examples] == [e.input_ids for e in plain.eval_examples]
    assert [e.input_ids for e in more.train_examples] == [e.input_ids for e in plain.train_examples] + [
        e.input_ids for e in load_examples(extra, plain.tokenizer, plain.config.max_length)]


def test_yaml_config_and_flag_override(tmp_path, tiny_pair, train_data):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"target: {tiny_pair[0]}\ndata: {train_data}\noutput: {tmp_path}\nblock_size: 8\nlr: 0.001\n")
    loaded = load_config(str(yaml_path), {"lr": 0.01, "epochs": None})
    assert loaded.block_size == 8 and loaded.lr == 0.01
    yaml_path.write_text("bogus_option: 1\n")
    with pytest.raises(ValueError, match="unknown training option"):
        load_config(str(yaml_path), {})


@pytest.mark.parametrize("text, message", [
    ("lr: [0.1\n", "not valid YAML"),
    ("lr: fast\n", "`lr: 'fast'` should be a number"),
    ("block_size: 8.5\n", "`block_size: 8.5` should be an integer"),
    ("target_layer_ids: 3\n", "`target_layer_ids: 3` should be a list of integers or None"),
    ("resume: 1\n", "`resume: 1` should be true or false"),
])
def test_yaml_mistakes_are_user_errors_naming_the_option(tmp_path, text, message):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(text)
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(str(yaml_path), {})


def test_yaml_values_of_the_right_types_load(tmp_path):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("target: t\ndata: d.jsonl\noutput: o\nlr: 1\ntarget_layer_ids: [1, 5]\n"
                         "extra_train_data: more.jsonl\nmax_steps: null\nresume: true\n")
    loaded = load_config(str(yaml_path), {})
    assert loaded.lr == 1 and loaded.target_layer_ids == [1, 5] and loaded.resume is True
    assert loaded.extra_train_data == ["more.jsonl"]


def test_train_cli_errors_are_clear(tmp_path, tiny_pair, capsys):
    assert main(["train", "--target", str(tiny_pair[0]), "--data", str(tmp_path / "missing.jsonl"),
                 "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def greedy_data(tmp_path_factory, tiny_pair):
    """Responses the tiny target gave greedily, the kind of data `eval_tau_decoding` replays."""
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    path = tmp_path_factory.mktemp("greedy") / "data.jsonl"
    rng = random.Random(1)
    with path.open("w") as f:
        for i in range(24):
            prompt = [rng.randrange(4, 120) for _ in range(rng.randint(4, 10))]
            response = plain.generate(prompt, max_new_tokens=rng.randint(16, 40), stop_token_ids=[]).output_ids
            f.write(json.dumps({"id": i, "messages": [], "prompt_ids": prompt, "response_ids": response}) + "\n")
    return path


def test_eval_tau_decoding_is_what_greedy_decoding_measures(tiny_pair, greedy_data, tmp_path):
    trainer = Trainer(config(tiny_pair, greedy_data, tmp_path / "out", max_steps=40, anchors_per_sequence=16)).setup()
    trainer.train()
    trainer.eval_examples = trainer.train_examples[:8]  # texts the drafter has learnt: a varied acceptance
    result = trainer.evaluate()
    pipe = DFlash.from_pretrained(tiny_pair[0], tmp_path / "out", device="cpu", block_size=4)
    tokens = steps = 0
    for example in trainer.eval_examples:
        response = example.input_ids[example.response_start:]
        out = pipe.generate(example.input_ids[: example.response_start], max_new_tokens=len(response),
                            stop_token_ids=[])
        assert out.output_ids == response  # the data is the target's own greedy text
        tokens, steps = tokens + sum(out.stats.acceptance_lengths[1:]), steps + len(out.stats.acceptance_lengths) - 1
    measured = tokens / steps
    assert measured > 1.3, "the drafter must accept something for this test to tell estimates apart"
    assert result["eval_tau_decoding"] == pytest.approx(measured, abs=1e-3)
    assert result["eval_tau_estimate"] > measured  # uniform anchors over-weight the easy stretches


def test_decoding_anchor_policy_trains_where_greedy_decoding_starts_its_blocks(tiny_pair, greedy_data, tmp_path,
                                                                                monkeypatch):
    import dflash.training.trainer as trainer_module

    trainer = Trainer(config(tiny_pair, greedy_data, tmp_path / "out", max_steps=30, anchors_per_sequence=12,
                             anchor_policy="decoding")).setup()
    trainer.train()
    logged = [r["walk_tau"] for r in trainer.history if "walk_tau" in r]
    assert len(logged) == 15 and all(t >= 1.0 for t in logged)

    built = []
    real_build_blocks = trainer_module.build_blocks
    monkeypatch.setattr(trainer_module, "build_blocks", lambda *a: built.append(a[3:5]) or real_build_blocks(*a))
    batch = trainer._batch("train", list(range(8)))
    features, _ = trainer._features(batch)
    walked, tokens = trainer._walk(batch.input_ids, batch.attention_mask, batch.loss_mask, features)
    built.clear()
    _, walk_tau = trainer._loss(batch, epoch=0, decoding_anchors=True)
    assert walk_tau == pytest.approx(float(tokens.sum()) / float(walked.sum()))
    anchors, valid = built[-1]  # the training blocks, after the walk's one-block drafts
    both_cases = set()
    for r in range(8):
        walk, chosen = set(walked[r].nonzero().flatten().tolist()), set(anchors[r][valid[r]].tolist())
        if len(walk) <= 12:
            assert walk <= chosen  # every decoding anchor trains, random ones fill up
        else:
            assert chosen <= walk and len(chosen) == 12  # a random subset of them
        both_cases.add(len(walk) <= 12)
    assert both_cases == {True, False}, "responses with fewer and with more decoding anchors than places"


def test_unknown_anchor_policy_is_a_clear_error(tiny_pair, train_data, tmp_path):
    with pytest.raises(UserError, match="--anchor-policy must be one of uniform, decoding"):
        config(tiny_pair, train_data, tmp_path / "o", anchor_policy="random")
