"""The trainer end to end on a tiny pair: export/load, exact resume, DDP == single process, lossless use."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import THINKING_TEMPLATE, VOCAB, tiny_target_model
from dflash import DFlash
from dflash.chat import THINKING_IGNORED
from dflash.cli.main import main
from dflash.errors import DFlashWarning, UserError
from dflash.model import load_drafter
from dflash.training import Trainer, datagen, load_config
from dflash.training.checkpoints import CheckpointDir
from dflash.training.data import read_examples
from dflash.training.objective import build_blocks
from dflash.training.trainer import StopRequest


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


@pytest.fixture
def ctrl_c_interrupts():
    """Python's own Ctrl-C (KeyboardInterrupt), which a stop at once falls back to, for the test: a shell starts a
    background job with SIGINT ignored, and Python keeps it so (there, a second Ctrl-C has no at-once to act)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def signal_after_step(trainer: Trainer, at_step: int | None = None, signum: int = signal.SIGINT, times: int = 1):
    """Send the process `signum` (`times` in a row) once the trainer has trained step `at_step` (None: every
    step). raise_signal runs the handler at once, in this thread: two kill()s could reach Python as one."""
    original = trainer._train_step

    def step_then_signal(indices, epoch):
        stats = original(indices, epoch)
        if at_step is None or trainer.step == at_step:
            for _ in range(times):
                signal.raise_signal(signum)
        return stats

    trainer._train_step = step_then_signal


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "model.safetensors"))


def test_export_loads_with_the_same_outputs_and_decodes_losslessly(tiny_pair, train_data, tmp_path, capsys):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out")).setup()
    result = trainer.train()
    assert "eval_loss" in result and len(result["eval_accuracy_per_position"]) == 3
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    start = next(line for line in lines if line["event"] == "start")  # the run's size, before its first step
    assert start == {"event": "start", "steps": trainer.total_steps, "train_examples": len(trainer.train_examples),
                     "eval_examples": len(trainer.eval_examples), "world_size": 1}
    loaded = load_drafter(tmp_path / "out", dtype="float32")
    for key, value in trainer.drafter.state_dict().items():
        if "rotary" not in key:
            assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.config.to_dict() == trainer.drafter_config.to_dict()
    assert_decodes_as_the_target_alone(tiny_pair[0], tmp_path / "out")


def test_the_exported_config_names_local_paths_absolutely_and_reads_back_anywhere(tiny_pair, train_data, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(train_data.parent)
    extra = shutil.copy(train_data, train_data.parent / "extra.jsonl")  # the same file twice is refused
    relative = config(tiny_pair, train_data.name, "out", max_steps=1, extra_train_data=[extra.name])
    Trainer(relative).setup().train()
    exported = train_data.parent / "out" / "training_config.yaml"
    saved = yaml.safe_load(exported.read_text())
    assert saved["data"] == str(train_data) and saved["extra_train_data"] == [str(extra)]
    assert saved["output"] == str(train_data.parent / "out") and saved["target"] == str(tiny_pair[0].resolve())
    assert "resume" not in saved and "overwrite" not in saved  # what a run did to its output, not how it trained
    # a run stopped early, exported with --resume --max-steps STEP from another folder: the checkpoint's settings,
    # with paths that name the same files from anywhere (its own are relative to where it ran)
    monkeypatch.chdir(tmp_path)
    Trainer(config(tiny_pair, train_data, exported.parent, max_steps=1, extra_train_data=[str(extra)],
                   resume=True)).setup().train()
    saved = yaml.safe_load(exported.read_text())
    assert saved["data"] == str(train_data) and saved["extra_train_data"] == [str(extra)]
    assert "resume" not in saved and saved["output"] == str(exported.parent)
    monkeypatch.chdir(train_data.parent)
    monkeypatch.chdir(tmp_path)  # another folder: the same run's settings
    again = load_config(str(exported), {"output": str(tmp_path / "again")})
    assert (again.data, again.target) == (saved["data"], saved["target"])


def assert_decodes_as_the_target_alone(target_dir, draft_dir) -> None:
    """The exported drafter loads in the engine, drafts, and the output is the target's own."""
    pipe = DFlash.from_pretrained(target_dir, draft_dir, device="cpu")
    plain = DFlash.from_pretrained(target_dir, no_draft=True, device="cpu")
    for prompt in ("How many clips", "Weng earns 12 dollars"):
        out = pipe.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert out.output_ids == plain.generate(prompt, max_new_tokens=24, ignore_eos=True).output_ids
        assert out.stats.drafter_forwards > 0


def test_feature_cache_gives_the_same_training(tiny_pair, train_data, tmp_path):
    """Cached target features (memory or disk) train like features computed every step (up to float noise:
    a cached row was computed with another batch's padding)."""
    Trainer(config(tiny_pair, train_data, tmp_path / "plain", eval_every=3)).setup().train()
    for cache in ("memory", str(tmp_path / "features")):
        out = tmp_path / f"cached-{len(cache)}"
        Trainer(config(tiny_pair, train_data, out, eval_every=3, feature_cache=cache)).setup().train()
        a, b = weights(tmp_path / "plain"), weights(out)
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.parametrize("options", [{}, {"dflash2": True, "selector_rank": 8, "selector_top_k": 4, "eval_every": 3}])
def test_interrupted_then_resumed_equals_uninterrupted(tiny_pair, train_data, tmp_path, options):
    """Also for a DFlash2 drafter (whose kernel projections train at a share of the lr), evaluated at the
    checkpoint's step."""
    Trainer(config(tiny_pair, train_data, tmp_path / "straight", **options)).setup().train()

    class Interrupted(Exception):
        pass

    broken = Trainer(config(tiny_pair, train_data, tmp_path / "resumed", **options)).setup()
    original = broken._train_step

    def step_then_die(indices, epoch):
        if broken.step == 4:  # after the step-3 checkpoint
            raise Interrupted
        return original(indices, epoch)

    broken._train_step = step_then_die
    with pytest.raises(Interrupted):
        broken.train()
    resumed = Trainer(config(tiny_pair, train_data, tmp_path / "resumed", resume=True, **options)).setup()
    assert resumed.step == 3
    stored = torch.load(tmp_path / "resumed" / "checkpoints" / "step-00000003" / "training_state.pt",
                        weights_only=False)["train_time_s"]  # the broken run's time to its step-3 checkpoint
    assert resumed.earlier_train_time_s == stored > 0
    started = time.perf_counter()
    done = resumed.train()
    assert done["train_time_s"] >= round(stored + done["train_time_this_run_s"], 1) - 0.1 - 1e-9  # each rounded
    assert done["train_time_this_run_s"] <= time.perf_counter() - started + 0.1
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("anchor_policy, per_process", [("uniform", ["--batch-size", "2"]),
                                                        ("decoding", ["--batch-size", "2"]),
                                                        ("uniform", ["--batch-size", "1", "--grad-accum", "2"])])
def test_two_process_ddp_matches_one_process_with_the_doubled_batch(tiny_pair, train_data, tmp_path, anchor_policy,
                                                                    per_process):
    """Also with gradient accumulation, whose first forward of each step skips DDP's all-reduce (no_sync)."""
    common = ["--target", str(tiny_pair[0]), "--data", str(train_data), "--draft-layers", "1", "--block-size", "4",
              "--anchors-per-sequence", "6", "--max-steps", "4", "--lr", "3e-3", "--eval-fraction", "0.125",
              "--eval-every", "0", "--checkpoint-every", "0", "--device", "cpu", "--anchor-policy", anchor_policy]
    assert main(["train", *common, "--batch-size", "4", "--output", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "dflash.cli.main", "train", *common, *per_process, "--output", str(tmp_path / "two")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert next(r for r in log if r.get("event") == "start")["world_size"] == 2
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=2e-5), (key, (a[key] - b[key]).abs().max())
    changed = weights(tmp_path / "one")["fc.weight"]
    assert changed.abs().sum() > 0
    # the logged loss and tau are those of the whole global batch, not of rank 0's half
    one_log = [json.loads(line) for line in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    last_one, last_two = [[r for r in log if "loss" in r][-1] for log in (one_log, log)]
    assert last_one["step"] == last_two["step"] == 4
    assert last_two["loss"] == pytest.approx(last_one["loss"], abs=2e-4)
    assert last_two["tau_estimate"] == pytest.approx(last_one["tau_estimate"], abs=1e-3)
    # each process evaluates half the held-out split; the figures are the whole split's
    eval_one, eval_two = [[r for r in log if "eval_loss" in r][-1] for log in (one_log, log)]
    assert eval_one.keys() == eval_two.keys() and "eval_tau_decoding" in eval_one
    for key in ("eval_loss", "eval_tau_estimate", "eval_tau_decoding", "eval_accuracy_per_position"):
        assert eval_two[key] == pytest.approx(eval_one[key], abs=2e-3), key


@pytest.mark.parametrize("anchor_policy", ["uniform", "decoding"])
def test_gradient_accumulation_matches_one_forward_of_the_whole_batch(tiny_pair, train_data, tmp_path, anchor_policy):
    """--grad-accum 2 --batch-size 2 trains the same steps as --batch-size 4: the same sequences, the same
    anchors, the gradients of two halves averaged; the log reports the whole step."""
    whole = Trainer(config(tiny_pair, train_data, tmp_path / "whole", anchor_policy=anchor_policy)).setup()
    whole_result = whole.train()
    halves = Trainer(config(tiny_pair, train_data, tmp_path / "halves", batch_size=2, grad_accum=2,
                            anchor_policy=anchor_policy)).setup()
    halves_result = halves.train()
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "halves")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=2e-5), (key, (a[key] - b[key]).abs().max())
    assert halves_result["eval_loss"] == pytest.approx(whole_result["eval_loss"], abs=1e-4)
    logs = [[json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
            for name in ("whole", "halves")]
    last_whole, last_halves = [[r for r in log if "loss" in r and "step" in r][-1] for log in logs]
    assert last_halves["step"] == last_whole["step"] == 6
    assert last_halves["loss"] == pytest.approx(last_whole["loss"], abs=2e-4)
    assert last_halves["tau_estimate"] == pytest.approx(last_whole["tau_estimate"], abs=1e-3)
    assert last_halves["grad_norm"] == pytest.approx(last_whole["grad_norm"], rel=1e-3)  # (AdamW hides a scale)
    if anchor_policy == "decoding":
        assert last_halves["walk_tau"] == pytest.approx(last_whole["walk_tau"], abs=0.2)
    # and a step of one forward is not what two steps of the halves give
    two_steps = Trainer(config(tiny_pair, train_data, tmp_path / "two", batch_size=2, max_steps=12)).setup()
    two_steps.train()
    assert not torch.allclose(weights(tmp_path / "two")["fc.weight"], a["fc.weight"], atol=2e-5)


def test_a_resume_may_trade_batch_size_for_accumulation(tiny_pair, train_data, tmp_path, capsys):
    """The data order depends on the global batch only; a resume that changes it is refused by name."""
    Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=3)).setup().train()
    resumed = Trainer(config(tiny_pair, train_data, tmp_path / "out", batch_size=2, grad_accum=2, resume=True))
    resumed.setup().train()
    assert resumed.step == 6
    with pytest.raises(UserError, match=re.escape("global batch 4, now 8 (--batch-size x --grad-accum x processes)")):
        Trainer(config(tiny_pair, train_data, tmp_path / "out", grad_accum=2, max_steps=9, resume=True)).setup()


def test_fine_tuning_starts_from_the_given_drafter(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", draft_layers=2)).setup().train()
    tuned = Trainer(config(tiny_pair, train_data, tmp_path / "tuned", init_from=str(tmp_path / "first"),
                           max_steps=1, lr=1e-9)).setup()
    assert tuned.drafter_config.num_hidden_layers == 2  # the checkpoint's shape, not the default of 1
    start = weights(tmp_path / "first")
    assert all(torch.equal(start[k], v) for k, v in tuned.drafter.state_dict().items() if "rotary" not in k)
    tuned.train()
    assert all(torch.allclose(start[k], v, atol=1e-6) for k, v in weights(tmp_path / "tuned").items())


def test_fine_tuning_keeps_the_drafters_block_size_unless_told(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", max_steps=1)).setup().train()  # block size 4
    kept = Trainer(config(tiny_pair, train_data, tmp_path / "kept", init_from=str(tmp_path / "first"),
                          block_size=None)).setup()
    assert kept.config.block_size == kept.drafter_config.block_size == 4  # not the default 16 of a new drafter
    changed = Trainer(config(tiny_pair, train_data, tmp_path / "changed", init_from=str(tmp_path / "first"),
                             block_size=8)).setup()
    assert changed.drafter_config.block_size == 8
    fresh = Trainer(config(tiny_pair, train_data, tmp_path / "fresh", block_size=None)).setup()
    assert fresh.drafter_config.block_size == 16


@pytest.mark.parametrize("options, message", [
    ({"mask_token_id": 5}, "--mask-token-id 5: the drafter in .* learnt with mask token 3, and --init-from's drafter "
                           "keeps its own; leave the flag out"),
    ({"selector_rank": 8}, "--selector-rank shape a DFlash2 drafter's selector, and the drafter in .* is a DFlash "
                           "drafter: add --dflash2 to grow one into it, or leave them out"),
])
def test_fine_tuning_refuses_options_the_drafter_would_ignore(tiny_pair, train_data, tmp_path, options, message):
    Trainer(config(tiny_pair, train_data, tmp_path / "first", max_steps=1)).setup().train()
    assert load_drafter(tmp_path / "first").config.mask_token_id == 3
    with pytest.raises(UserError, match=message):
        Trainer(config(tiny_pair, train_data, tmp_path / "tuned", init_from=str(tmp_path / "first"),
                       **options)).setup()


def test_records_left_out_by_max_length_are_named(tiny_pair, train_data, tmp_path, capsys):
    long_prompt = tmp_path / "data.jsonl"
    rows = train_data.read_text().splitlines(True)
    record = json.loads(rows[2])
    record["prompt_ids"] = record["prompt_ids"] * 20  # past --max-length 60 with its prompt alone
    long_prompt.write_text("".join(rows[:2]) + json.dumps(record) + "\n" + "".join(rows[3:]))
    trainer = Trainer(config(tiny_pair, long_prompt, tmp_path / "out", max_length=60)).setup()
    assert len(trainer.train_examples) + len(trainer.eval_examples) == 15
    err = capsys.readouterr().err
    assert (f"--data {long_prompt}: 1 of 16 records are left out, their responses empty or cut below 2 tokens by "
            "--max-length 60 (lines 3)") in err


def test_extra_train_data_never_trains_on_a_held_out_prompt(tiny_pair, train_data, tmp_path, capsys):
    plain = Trainer(config(tiny_pair, train_data, tmp_path / "a")).setup()
    copy = shutil.copy(train_data, tmp_path / "copy.jsonl")  # the same records (the same file is refused)
    more = Trainer(config(tiny_pair, train_data, tmp_path / "b", extra_train_data=str(copy))).setup()
    held = len(plain.eval_examples)
    assert held == 2 and len(more.train_examples) == 2 * len(plain.train_examples)
    held_prompts = {tuple(e.input_ids[: e.response_start]) for e in plain.eval_examples}
    assert not any(tuple(e.input_ids[: e.response_start]) in held_prompts for e in more.train_examples)
    assert (f"--extra-train-data {copy}: {held} records answer a prompt or the questions of the held-out "
            "split of --data, and those answers are left out of training (the held-out") in capsys.readouterr().err


def test_no_held_out_question_trains_and_cut_turns_are_named(tiny_pair, tmp_path, capsys):
    """A second datagen pass (sampled) answers a held-out conversation's first turn differently, so its second
    turn's prompt differs from the held-out one's, and it asks the held-out user's question all the same. Other
    conversations that merely open alike ("Hello") keep their own second turns."""
    def conversations(path, seed_answers):
        prompts, answers = random.Random(1), random.Random(seed_answers)
        hello = [4, 5, 6, 7, 8, 9]
        with path.open("w") as f:
            for i in range(8):
                reply = [answers.randrange(4, 120) for _ in range(12)]
                last = hello + reply + [prompts.randrange(4, 120) for _ in range(3 if i else 50)]  # line 1: long
                texts = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                         {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer"}]
                f.write(json.dumps({"messages": texts, "prompt_ids": last,
                                    "response_ids": [answers.randrange(4, 120) for _ in range(14)],
                                    "earlier_turns": [{"prompt_ids": hello, "response_ids": reply}]}) + "\n")
        return path

    data = conversations(tmp_path / "data.jsonl", 0)
    again = conversations(tmp_path / "again.jsonl", 1)  # the same questions, other answers
    trainer = Trainer(config(tiny_pair, data, tmp_path / "o", eval_fraction=0.25, max_length=60,
                             extra_train_data=str(again))).setup()
    held = {question for e in trainer.eval_examples for question in e.asked}
    assert not any(question in held for e in trainer.train_examples for question in e.asked)
    # each conversation is one sequence; its "Hello" answer stays as the context of its second turn, untrained
    second_turns = [e for e in trainer.train_examples if len(e.responses) == 1 and e.response_start > 6]
    assert len(trainer.train_examples) == len(second_turns) == 10  # 5 of each file: line 1's turn 2 is cut
    assert all(e.input_ids[:6] == [4, 5, 6, 7, 8, 9] for e in second_turns)
    err = " ".join(capsys.readouterr().err.split())
    assert (f"--extra-train-data {again}: 8 records (10 answers) answer a prompt or the questions of the held-out "
            "split of --data, and those answers are left out of training; 5 of these records train on their other "
            "answers") in err
    assert f"--data {data}: 1 turns of conversations are left out" in err  # line 1's second turn, cut by 60


def test_a_conversation_trains_its_first_turn_as_that_turn_alone_would(tiny_pair, tmp_path):
    """Turns that continue one another are one sequence (the target computes it once); a block of the first
    answer sees the same context, and drafts the same logits, as in a sequence of that turn alone: what comes
    after it in the conversation changes nothing."""
    rng = random.Random(3)
    prompt, answer = [rng.randrange(4, 120) for _ in range(6)], [rng.randrange(4, 120) for _ in range(14)]
    later = prompt + answer + [rng.randrange(4, 120) for _ in range(4)]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": later, "response_ids": [rng.randrange(4, 120) for _ in range(12)],
                                "earlier_turns": [{"prompt_ids": prompt, "response_ids": answer}]}) + "\n"
                    + json.dumps({"prompt_ids": prompt, "response_ids": answer}) + "\n")
    trainer = Trainer(config(tiny_pair, data, tmp_path / "o", eval_fraction=0, batch_size=2)).setup()
    conversation, alone = trainer.train_examples
    assert len(conversation.responses) == 2 and alone.responses == conversation.responses[:1]
    batch = trainer._batch("train", [0, 1])
    features, _ = trainer._features(batch)  # (2, T, F)
    anchors = torch.tensor([[6, 10, 16], [6, 10, 16]])  # in the first answer (tokens 6..19)
    blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.attention_mask, anchors,
                          torch.ones_like(anchors).bool(), 4, trainer.drafter_config.mask_token_id, 7.0)
    assert torch.equal(blocks.labels[0], blocks.labels[1]) and torch.equal(blocks.weights[0], blocks.weights[1])
    with torch.no_grad():
        logits = trainer._draft(batch, features, blocks).logits  # (2, 12, vocab)
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_eval_decoding_examples_counts_held_out_answers_not_sequences(tiny_pair, tmp_path, monkeypatch):
    """A held-out conversation is one sequence of several answers: --eval-decoding-examples N replays N answers."""
    rng = random.Random(4)
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for _ in range(8):
            first, answer = [rng.randrange(4, 120) for _ in range(5)], [rng.randrange(4, 120) for _ in range(10)]
            second = first + answer + [rng.randrange(4, 120) for _ in range(3)]
            f.write(json.dumps({"prompt_ids": second, "response_ids": [rng.randrange(4, 120) for _ in range(10)],
                                "earlier_turns": [{"prompt_ids": first, "response_ids": answer}]}) + "\n")
    trainer = Trainer(config(tiny_pair, data, tmp_path / "o", eval_fraction=0.25, batch_size=2)).setup()
    assert [len(e.responses) for e in trainer.eval_examples] == [2, 2]
    walked_masks = []
    walk = trainer._walk
    monkeypatch.setattr(trainer, "_walk", lambda ids, real, mask, features: walked_masks.append(mask.clone())
                        or walk(ids, real, mask, features))

    def answers_replayed(n: int) -> int:
        walked_masks.clear()
        trainer._decoding_walk(n)
        starts = [m[0, 1:] & ~m[0, :-1] for m in walked_masks]  # each answer's first token (none at 0 here)
        return sum(int(s.sum()) for s in starts)

    assert [answers_replayed(n) for n in (1, 2, 3, 64)] == [1, 2, 3, 4]


@pytest.mark.parametrize("dflash2", [False, True])
def test_each_process_evaluates_its_share_and_reports_the_whole_splits_figures(tiny_pair, train_data, tmp_path,
                                                                              monkeypatch, dflash2):
    """Under torchrun every process evaluated the whole held-out split; now each takes every world-th batch and
    response, and the added sums give each the figures one process gets alone."""
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "o", eval_fraction=0.375, batch_size=2,
                             dflash2=dflash2)).setup()
    alone = trainer.evaluate()
    assert len(trainer.eval_examples) == 6 and "eval_tau_decoding" in alone
    evaluated, walked, sums = {0: [], 1: []}, {0: 0, 1: 0}, {}
    loss, walk = trainer._loss, trainer._walk

    def counting_loss(batch, epoch, **kw):
        evaluated[trainer.rank] += batch.indices
        return loss(batch, epoch, **kw)

    def counting_walk(*args):
        walked[trainer.rank] += 1
        return walk(*args)

    monkeypatch.setattr(trainer, "_loss", counting_loss)
    monkeypatch.setattr(trainer, "_walk", counting_walk)
    monkeypatch.setattr(trainer, "_sum_over_processes", lambda values: sums.setdefault(trainer.rank, values))
    trainer.world = 2
    for rank in (0, 1):
        trainer.rank = rank
        trainer.evaluate()
    assert evaluated == {0: [0, 1, 4, 5], 1: [2, 3]} and walked == {0: 3, 1: 3}
    added = [a + b for a, b in zip(sums[0], sums[1])]
    monkeypatch.setattr(trainer, "_sum_over_processes", lambda values: added)
    together = trainer.evaluate()
    assert together.keys() == alone.keys()
    for key, value in alone.items():
        assert together[key] == pytest.approx(value, abs=1e-4), key


def test_a_held_out_split_of_nothing_is_warned_of(tiny_pair, tmp_path, capsys):
    """Turns of a record stay together, so --data of one conversation holds nothing out."""
    turns = [{"prompt_ids": [5 + k, 6, 7], "response_ids": list(range(20, 32))} for k in range(4)]
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({**turns[-1], "earlier_turns": turns[:-1]}) + "\n")
    trainer = Trainer(config(tiny_pair, data, tmp_path / "o", eval_fraction=0.25)).setup()
    assert len(trainer.train_examples) == 4 and not trainer.eval_examples
    assert "--eval-fraction 0.25 holds nothing out" in capsys.readouterr().err


def test_a_record_listed_twice_in_data_never_trains_on_its_held_out_copy(tiny_pair, train_data, tmp_path, capsys):
    """Two datagen runs on one file once wrote every answer twice; the split then held out copies of training
    records, and the held-out figures measured what training saw."""
    twice = tmp_path / "twice.jsonl"
    twice.write_text(train_data.read_text() * 2)
    trainer = Trainer(config(tiny_pair, twice, tmp_path / "out", eval_fraction=0.25)).setup()
    held_prompts = {tuple(e.input_ids[: e.response_start]) for e in trainer.eval_examples}
    assert len(trainer.eval_examples) == 8
    assert not any(tuple(e.input_ids[: e.response_start]) in held_prompts for e in trainer.train_examples)
    left_out = 32 - 8 - len(trainer.train_examples)
    assert left_out > 0 and (f"--data {twice}: {left_out} records answer a prompt or the questions of the held-out "
                             "split of --data, and those answers are left out of training (the held-out figures"
                             ) in capsys.readouterr().err


def test_datagens_prompt_suffix_and_the_thinking_mode_reach_the_records_reader(tiny_pair, train_data, tmp_path,
                                                                                 monkeypatch):
    from dflash.training import trainer as trainer_module

    data = tmp_path / "answers.jsonl"
    shutil.copy(train_data, data)
    datagen.settings_path(data).write_text(json.dumps({"target": str(tiny_pair[0].resolve()), "prompt_suffix": "!"}))
    seen, read = [], trainer_module.read_examples
    monkeypatch.setattr(trainer_module, "read_examples", lambda *a: seen.append(a[-2:]) or read(*a))
    Trainer(config(tiny_pair, data, tmp_path / "o", enable_thinking=False)).setup()
    assert seen == [({"enable_thinking": False}, "!")]


def test_the_thinking_mode_is_refused_for_a_base_model_and_named_where_no_record_is_text(tiny_pair, train_data,
                                                                                         tmp_path, capsys):
    """--enable-thinking renders text records with the chat template: a target without one cannot think (refused,
    as generate, datagen and bench refuse it), and datagen's records already hold their ids (a warning)."""
    Trainer(config(tiny_pair, train_data, tmp_path / "o", enable_thinking=False)).setup()
    assert ("--no-enable-thinking renders text records, and this data holds none" in capsys.readouterr().err)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": f"How many clips, {i}?", "response": f"There are {i}."}) + "\n"
                            for i in range(8)))
    Trainer(config(tiny_pair, text, tmp_path / "t", enable_thinking=False, eval_fraction=0)).setup()
    assert "renders text records" not in capsys.readouterr().err
    base = tmp_path / "base"
    shutil.copytree(tiny_pair[0], base)
    (base / "chat_template.jinja").unlink()
    with pytest.raises(UserError, match="tokenizer has no chat template \\(a base model\\) to read it"):
        Trainer(config((base, tiny_pair[1]), train_data, tmp_path / "o2", enable_thinking=True)).setup()


def thinking_target(tiny_pair, tmp_path) -> Path:
    target = tmp_path / "thinking_target"
    shutil.copytree(tiny_pair[0], target)
    (target / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return target


def made_with(tmp_path, name, source, settings) -> Path:
    data = tmp_path / name
    shutil.copy(source, data)
    datagen.settings_path(data).write_text(json.dumps(settings))
    return data


def test_text_records_render_in_the_thinking_mode_datagen_made_the_answers_in(tiny_pair, train_data, tmp_path,
                                                                             monkeypatch, capsys):
    """One drafter, one way of rendering prompts: datagen's --no-enable-thinking reaches the text records beside its
    answers and the exported training_config.yaml (which decoding checks), with no flag given to train."""
    from dflash.training import trainer as trainer_module

    target = thinking_target(tiny_pair, tmp_path)
    made = {"enable_thinking": False, "reasoning_effort": "low"}  # the latter, as --chat-template-kwargs gives it
    data = made_with(tmp_path, "answers.jsonl", train_data, {"target": str(target.resolve()),
                                                            "chat_template_kwargs": made})
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": f"How many clips, {i}?", "response": f"There are {i}."}) + "\n"
                            for i in range(8)))
    seen, read = [], trainer_module.read_examples
    monkeypatch.setattr(trainer_module, "read_examples", lambda *a: seen.append(a[-2]) or read(*a))
    trainer = Trainer(config((target, tiny_pair[1]), data, tmp_path / "o", extra_train_data=[str(text)],
                             max_steps=1)).setup()
    assert seen == [made] * 2
    err = capsys.readouterr().err
    assert ("dflash train: warning: 8 text records render with enable_thinking false, reasoning_effort 'low', as "
            "dflash datagen made the data's answers (its settings files say); pass --chat-template-kwargs '{}' for "
            "the template's defaults") in err
    assert "differ" not in err and "but dflash datagen made" not in err, err
    trainer.train()
    exported = yaml.safe_load((tmp_path / "o" / "training_config.yaml").read_text())
    assert (exported["enable_thinking"], exported["chat_template_kwargs"]) == (False, {"reasoning_effort": "low"})
    with pytest.warns(DFlashWarning, match="trained on prompts rendered with reasoning_effort 'low', enable_thinking "
                                           "false .*pass --no-enable-thinking --chat-template-kwargs "
                                           "'{\"reasoning_effort\": \"low\"}'"):
        DFlash.from_pretrained(target, tmp_path / "o", device="cpu")
    seen.clear()  # and '{}' asks for the template's defaults, whatever the data say
    Trainer(config((target, tiny_pair[1]), data, tmp_path / "d", extra_train_data=[str(text)], max_steps=1,
                   chat_template_kwargs={})).setup()
    assert seen == [None] * 2


@pytest.mark.parametrize("flag, other, said", [
    (None, {"enable_thinking": True}, "dflash datagen made the data's answers with different chat template settings "
                                      "(--data {data}: enable_thinking false; --extra-train-data {extra}: "
                                      "enable_thinking true)"),
    (True, {"enable_thinking": False}, "enable_thinking true (given to dflash train by flag or --config), but dflash "
                                       "datagen made the data's answers with enable_thinking false (--data {data}, "
                                       "--extra-train-data {extra}): text records render otherwise"),
])
def test_answers_made_in_other_thinking_modes_are_named_in_a_warning(tiny_pair, train_data, tmp_path, capsys, flag,
                                                                       other, said):
    target = thinking_target(tiny_pair, tmp_path)
    data = made_with(tmp_path, "a.jsonl", train_data, {"target": str(target.resolve()),
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    extra = made_with(tmp_path, "b.jsonl", train_data, {"target": str(target.resolve()), "chat_template_kwargs": other})
    Trainer(config((target, tiny_pair[1]), data, tmp_path / "o", extra_train_data=[str(extra)],
                   enable_thinking=flag)).setup()
    assert said.format(data=data, extra=extra) in capsys.readouterr().err.replace("\n", " ")


def test_a_thinking_mode_the_template_ignores_is_no_mismatch_and_the_flag_is_said_to_change_nothing(
        tiny_pair, train_data, tmp_path, capsys):
    """The tiny target's own template reads no enable_thinking: datagen's False and the template's defaults render
    alike, so no mismatch is named; the flag itself changes nothing, and that is said."""
    data = made_with(tmp_path, "a.jsonl", train_data, {"target": str(tiny_pair[0].resolve())})
    extra = made_with(tmp_path, "b.jsonl", train_data, {"target": str(tiny_pair[0].resolve()),
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    Trainer(config(tiny_pair, data, tmp_path / "o", extra_train_data=[str(extra)], enable_thinking=True,
                   eval_fraction=0)).setup()
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == [f"dflash train: warning: {THINKING_IGNORED}"]


def test_another_targets_answers_are_named_in_a_warning(tiny_pair, train_data, tmp_path, capsys):
    data = tmp_path / "answers.jsonl"
    shutil.copy(train_data, data)
    settings = datagen.settings_path(data)
    settings.write_text(json.dumps({"target": str(tiny_pair[0].resolve()), "max_new_tokens": 8}))
    Trainer(config(tiny_pair, data, tmp_path / "same")).setup()
    err = capsys.readouterr().err
    assert "another target" not in err and "no dflash datagen settings" not in err
    settings.unlink()  # answers from elsewhere: whose they are is unknown, and said (a public trainers' pitfall)
    Trainer(config(tiny_pair, data, tmp_path / "elsewhere")).setup()
    assert (f"--data {data} has no dflash datagen settings beside it, so whose answers it holds is unknown" in
            capsys.readouterr().err)
    settings.write_text(json.dumps({"target": "/models/other-target", "max_new_tokens": 8}))
    Trainer(config(tiny_pair, data, tmp_path / "other")).setup()
    assert (f"--data {data} holds the answers of another target (/models/other-target, says answers.jsonl.datagen"
            f".json), and this drafter is trained for {tiny_pair[0].resolve()}") in capsys.readouterr().err
    import gzip  # gzipped afterwards: datagen's settings file still sits beside the name without .gz

    zipped = tmp_path / "answers.jsonl.gz"
    zipped.write_bytes(gzip.compress(data.read_bytes()))
    Trainer(config(tiny_pair, zipped, tmp_path / "zipped")).setup()
    assert f"--data {zipped} holds the answers of another target" in capsys.readouterr().err


def test_tokens_per_s_leaves_evaluation_and_checkpoints_out(tiny_pair, train_data, tmp_path, monkeypatch):
    """The step after an evaluation logged a fraction of the others' tokens/s: its window held the evaluation."""
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=6, log_every=1, eval_every=2,
                             checkpoint_every=3)).setup()
    evaluate, save = trainer.evaluate, trainer.save_checkpoint
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: (time.sleep(1.0), evaluate(*a, **k))[1])
    monkeypatch.setattr(trainer, "save_checkpoint", lambda *a, **k: (time.sleep(1.0), save(*a, **k))[1])
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
    steps = [r["step"] for r in log if "tokens_per_s" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    # steps 3, 4 and 5 follow an evaluation or a checkpoint of a second or more; a step of this pair is far shorter
    assert min(rates[2:5]) > 0.1 * max(rates[0], rates[1]), rates  # with the pauses counted: ~0.01


def test_a_stopped_datagen_runs_output_is_warned_of_and_its_unjoined_parts_refused(tiny_pair, train_data, tmp_path,
                                                                                   capsys):
    """Training on a stopped datagen run's output went ahead without a word, and on a stopped torchrun run's
    (whose answers are in part files) said the output 'has no records'."""
    data = tmp_path / "answers.jsonl"
    shutil.copy(train_data, data)
    settings = datagen.settings_path(data)
    settings.write_text(json.dumps({"target": str(tiny_pair[0].resolve()), "max_new_tokens": 8, "finished": True}))
    Trainer(config(tiny_pair, data, tmp_path / "finished")).setup()
    assert "stopped" not in capsys.readouterr().err
    settings.write_text(json.dumps({"target": str(tiny_pair[0].resolve()), "max_new_tokens": 8, "finished": False}))
    Trainer(config(tiny_pair, data, tmp_path / "stopped")).setup()
    assert (f"--data {data} is the output of a dflash datagen run that was stopped before it finished: training on "
            "what it holds so far") in capsys.readouterr().err
    data.write_text("")  # a stopped torchrun run: rank 0 had written nothing to the output yet
    shutil.copy(train_data, tmp_path / "answers.jsonl.part-0-of-2")
    with pytest.raises(UserError, match=r"a torchrun run of dflash datagen on it was stopped before joining its "
                                        r"processes' answers, which are in answers.jsonl.part-0-of-2 beside it: rerun"):
        Trainer(config(tiny_pair, data, tmp_path / "parts")).setup()


def test_answer_ids_of_another_tokenizer_are_warned_of_without_a_settings_file(tiny_pair, train_data, tmp_path,
                                                                              capsys):
    """Datagen output of another target, copied without its settings file, trained without a word (every id was
    below the vocabulary size): the answers' ids are now decoded and compared with the answers' text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    records = [json.loads(line) for line in train_data.read_text().splitlines()]

    def write(name: str, text_of) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({**r, "messages": [
            {"role": "user", "content": f"q{r['id']}"},
            {"role": "assistant", "content": text_of(r["response_ids"])}]}) + "\n" for r in records))
        return path

    ours = write("ours.jsonl", lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    Trainer(config(tiny_pair, ours, tmp_path / "ours")).setup()
    assert "another tokenizer" not in capsys.readouterr().err
    # the text another tokenizer made of the same ids: here, this one's of other ids
    theirs = write("theirs.jsonl", lambda ids: tokenizer.decode([(t * 7 + 3) % 120 + 4 for t in ids],
                                                                skip_special_tokens=True))
    Trainer(config(tiny_pair, theirs, tmp_path / "theirs")).setup()
    assert (f"--data {theirs}: the answer token ids of 16 of the 16 records checked do not decode, with this target's "
            "tokenizer, to the answer text beside them") in capsys.readouterr().err


@pytest.mark.parametrize("eval_every, evaluated_at", [(3, [3, 6]), (4, [4, 6])])
def test_the_last_step_is_evaluated_once_and_logged_as_a_step(tiny_pair, train_data, tmp_path, eval_every,
                                                              evaluated_at):
    """The last step was evaluated twice when --eval-every divided the steps (the loop's, then the final one), and
    otherwise its evaluation was missing from the step records (only in the done record)."""
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=6, eval_every=eval_every)).setup()
    evaluate, calls = trainer.evaluate, []
    trainer.evaluate = lambda *a, **k: (calls.append(trainer.step), evaluate(*a, **k))[1]
    done = trainer.train()
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert calls == evaluated_at
    assert [r["step"] for r in log if "eval_loss" in r and "event" not in r] == evaluated_at
    assert log[-1]["event"] == "done" and log[-1]["eval_loss"] == done["eval_loss"] == log[-2]["eval_loss"]


def test_a_missing_extra_file_names_its_own_flag(tiny_pair, train_data, tmp_path):
    with pytest.raises(UserError, match="nothing.jsonl does not exist; create it with `dflash datagen` or pass "
                                        "another --extra-train-data"):
        Trainer(config(tiny_pair, train_data, tmp_path / "o", extra_train_data=str(tmp_path / "nothing.jsonl"))).setup()


def check_soft_labels(trainer: Trainer) -> None:
    """The trainer's soft labels at each labelled block position are the target's own logits one position back."""
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


@pytest.mark.parametrize("family", ["gemma2", "cohere2", "granite"])
def test_soft_labels_take_the_targets_own_transform_of_its_head(family, train_data, tmp_path):
    """Gemma's soft-capping, Cohere's and Granite's scaling come after the LM head in their forwards."""
    from conftest import save_tiny_pair

    pair = save_tiny_pair(tmp_path / "pair", family=family)
    check_soft_labels(Trainer(config(pair, train_data, tmp_path / "soft", distill_weight=0.5)).setup())


def test_soft_labels_are_the_target_logits_of_the_previous_position(tiny_pair, train_data, tmp_path):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "soft", distill_weight=0.5)).setup()
    check_soft_labels(trainer)
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


@pytest.mark.parametrize("init_from", [False, True])
def test_a_drafter_deeper_than_its_target_is_refused_before_it_is_built(tiny_pair, train_data, tmp_path, init_from):
    if init_from:
        Trainer(config(tiny_pair, train_data, tmp_path / "first", max_steps=1)).setup().train()
    options = {"init_from": str(tmp_path / "first")} if init_from else {}
    layers = Trainer(config(tiny_pair, train_data, tmp_path / "o", **options)).setup().target.num_layers
    assert Trainer(config(tiny_pair, train_data, tmp_path / "deep", draft_layers=layers,
                          **options)).setup().drafter_config.num_hidden_layers == layers
    with pytest.raises(UserError, match=rf"^--draft-layers {layers + 1}: the target has {layers} layers, .* give at "
                                        rf"most {layers}$"):
        Trainer(config(tiny_pair, train_data, tmp_path / "deeper", draft_layers=layers + 1, **options)).setup()
    assert not (tmp_path / "deeper").exists()  # set-up leaves the output as it found it


def test_extra_train_data_trains_without_changing_the_held_out_split(tiny_pair, train_data, tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(train_data.read_text().splitlines(True)[:5]))  # any records: training only
    plain = Trainer(config(tiny_pair, train_data, tmp_path / "a")).setup()
    more = Trainer(config(tiny_pair, train_data, tmp_path / "b", extra_train_data=str(extra))).setup()
    assert [e.input_ids for e in more.eval_examples] == [e.input_ids for e in plain.eval_examples]
    assert [e.input_ids for e in more.train_examples] == [e.input_ids for e in plain.train_examples] + [
        e.input_ids for e in read_examples(extra, plain.tokenizer, plain.config.max_length).examples]


def test_yaml_config_and_flag_override(tmp_path, tiny_pair, train_data):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(f"target: {tiny_pair[0]}\ndata: {train_data}\noutput: {tmp_path}\nblock_size: 8\nlr: 0.001\n")
    loaded = load_config(str(yaml_path), {"lr": 0.01, "epochs": None})
    assert loaded.block_size == 8 and loaded.lr == 0.01
    yaml_path.write_text("bogus_option: 1\n")
    with pytest.raises(ValueError, match="unknown training option"):
        load_config(str(yaml_path), {})
    yaml_path.write_text("max_step: 10\nlearning_rate: 0.1\nbogus_option: 1\n")
    with pytest.raises(UserError, match=re.escape(
            f"unknown training option(s) in {yaml_path}: bogus_option, learning_rate (did you mean lr?), max_step "
            "(did you mean max_steps?); the options are the flags of `dflash train --help`, with _ for -")):
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
            response = plain.generate(prompt, max_new_tokens=rng.randint(16, 40), ignore_eos=True).output_ids
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
                            ignore_eos=True)
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


# ---- runs that must not lose or mix work ---------------------------------------------------------------------
def checkpoint_names(output) -> list[str]:
    return sorted(p.name for p in (output / "checkpoints").iterdir())


def test_a_fresh_run_into_an_earlier_runs_output_is_refused_unless_told_to_overwrite(tiny_pair, train_data,
                                                                                       tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out)).setup().train()
    before = checkpoint_names(out)
    with pytest.raises(UserError, match="holds checkpoints of an earlier run .newest: step-00000006.; pass --resume "
                                        "to continue that run, --overwrite to delete them and start afresh, or "
                                        "another --output"):
        Trainer(config(tiny_pair, train_data, out, seed=1)).setup()
    assert checkpoint_names(out) == before
    with pytest.raises(UserError, match="another shape .block_size 4, now 8.*or --overwrite to delete its "
                                        "checkpoints"):  # the advice leads to a clean start, not into the above
        Trainer(config(tiny_pair, train_data, out, block_size=8, resume=True)).setup()
    Trainer(config(tiny_pair, train_data, out, seed=1, max_steps=3, overwrite=True)).setup().train()
    assert checkpoint_names(out) == ["step-00000003"]  # the earlier run's step 6 is gone, not kept as the newest
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in log if r.get("event") == "start"] == ["start"]  # a fresh log
    resumed = Trainer(config(tiny_pair, train_data, out, seed=1, max_steps=3, resume=True)).setup()
    assert resumed.step == 3


def test_an_output_that_holds_a_model_is_refused_unless_told_to_overwrite(tiny_pair, train_data, tmp_path):
    out = tmp_path / "a_model"
    shutil.copytree(tiny_pair[0], out)  # e.g. a drafter exported earlier, its checkpoints deleted
    before = (out / "config.json").read_bytes()
    with pytest.raises(UserError, match=r"--output .*a_model already holds a model \(config.json, "
                                        r"model.safetensors\) and no checkpoints of a run to resume: .*pass another "
                                        r"--output, or --overwrite to replace it"):
        Trainer(config(tiny_pair, train_data, out)).setup()
    assert (out / "config.json").read_bytes() == before
    Trainer(config(tiny_pair, train_data, out, overwrite=True, max_steps=1)).setup().train()
    assert load_drafter(out, dtype="float32").config.block_size == 4  # replaced, as asked


@pytest.mark.parametrize("flag", ["target", "init_from"])
def test_the_output_is_never_the_model_trained_from(tiny_pair, train_data, tmp_path, flag):
    models = {"target": tmp_path / "target", "init_from": tmp_path / "drafter"}
    shutil.copytree(tiny_pair[0], models["target"])
    shutil.copytree(tiny_pair[1], models["init_from"])
    before = sorted(p.name for p in models[flag].iterdir())
    options = {"target": str(models["target"]), "overwrite": True}
    if flag == "init_from":
        options["init_from"] = str(models["init_from"])
    with pytest.raises(UserError, match=f"is the --{flag.replace('_', '-')} directory: the trained drafter would be "
                                        "written over that model; pass another --output"):
        Trainer(config(tiny_pair, train_data, models[flag], **options)).setup()
    assert sorted(p.name for p in models[flag].iterdir()) == before  # not even a checkpoints/ made there


def test_the_output_and_the_feature_cache_stay_out_of_the_models_and_of_a_config_kept_there(tiny_pair, train_data,
                                                                                             tmp_path):
    """--init-from naming a new --output was blamed on a run that never happened; a feature cache in the target's
    directory wrote its files into that checkpoint; a training_config.yaml of one's own was replaced by the export."""
    with pytest.raises(UserError, match="is the --init-from directory: the trained drafter would be written over"):
        Trainer(config(tiny_pair, train_data, tmp_path / "new", init_from=str(tmp_path / "new"))).setup()
    assert not (tmp_path / "new").exists()
    for cache, said in ((tiny_pair[0], "is inside the --target directory"),
                        (tiny_pair[0] / "features", "is inside the --target directory"),
                        (tmp_path / "out", "is the --output directory, where the drafter is exported")):
        with pytest.raises(UserError, match=f"--feature-cache .*{said}"):
            Trainer(config(tiny_pair, train_data, tmp_path / "out", feature_cache=str(cache))).setup()
    assert not (tiny_pair[0] / "features").exists() and not (tiny_pair[0] / "manifest.json").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "training_config.yaml").write_text("# my settings\nlr: 0.001\n")
    with pytest.raises(UserError, match="holds a training_config.yaml, which the export writes: keep your own "
                                        "elsewhere"):
        Trainer(config(tiny_pair, train_data, kept)).setup()
    assert (kept / "training_config.yaml").read_text() == "# my settings\nlr: 0.001\n"


def test_a_stray_step_directory_is_not_taken_for_a_checkpoint(tiny_pair, train_data, tmp_path, capsys):
    stray = tmp_path / "out" / "checkpoints" / "step-notes"
    stray.mkdir(parents=True)
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out", resume=True, keep_checkpoints=1)).setup()
    assert trainer.step == 0 and "no checkpoint found" in capsys.readouterr().err
    trainer.train()
    assert checkpoint_names(tmp_path / "out") == ["step-00000006", "step-notes"]  # not pruned either


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(tiny_pair, train_data, tmp_path, capsys):
    Trainer(config(tiny_pair, train_data, tmp_path / "straight", checkpoint_every=0)).setup().train()
    stopped = Trainer(config(tiny_pair, train_data, tmp_path / "stopped", checkpoint_every=0)).setup()
    original = stopped._train_step

    def step_then_ctrl_c(indices, epoch):
        stats = original(indices, epoch)
        if stopped.step == 4:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of step 4: the step finishes first
        return stats

    stopped._train_step = step_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    assert "stopped at step 4 and saved" in capsys.readouterr().err
    assert checkpoint_names(tmp_path / "stopped") == ["step-00000004"]
    resumed = Trainer(config(tiny_pair, train_data, tmp_path / "stopped", checkpoint_every=0, resume=True)).setup()
    assert resumed.step == 4
    resumed.train()
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_data_order_and_names_changed_settings(tiny_pair, train_data, tmp_path, capsys):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out)).setup().train()
    with pytest.raises(UserError, match="cannot be resumed with this data order: global batch 4, now 2"):
        Trainer(config(tiny_pair, train_data, out, resume=True, batch_size=2, max_steps=9)).setup()
    # no step left to train: the order does not matter, and a run stopped after its last step exports with other
    # processes (the advice for one stopped before its export)
    assert Trainer(config(tiny_pair, train_data, out, resume=True, batch_size=2)).setup().train()["step"] == 6
    # ... but an --epochs run stopped half-way is not finished because a larger batch makes fewer steps of them
    halfway = tmp_path / "halfway"
    stopped = Trainer(config(tiny_pair, train_data, halfway, max_steps=None, epochs=2, batch_size=2,
                             checkpoint_every=1)).setup()
    assert stopped.total_steps > 4
    signal_after_step(stopped, stopped.total_steps // 2)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    with pytest.raises(UserError, match="cannot be resumed with this data order: global batch 2, now 4"):
        Trainer(config(tiny_pair, train_data, halfway, max_steps=None, epochs=2, batch_size=4, resume=True)).setup()
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(train_data.read_text().splitlines(True)[::-1]))
    with pytest.raises(UserError, match="the training or held-out examples differ"):
        Trainer(config(tiny_pair, shuffled, out, resume=True)).setup()
    longer = Trainer(config(tiny_pair, train_data, out, resume=True, lr=1e-3, max_steps=8)).setup()
    assert "lr 0.003 -> 0.001; max_steps 6 -> 8" in capsys.readouterr().err  # the schedule now ends at step 8
    assert longer.scheduler.base_lrs == [1e-3]  # the new value, not the one in the optimizer state
    assert all(g["initial_lr"] == 1e-3 for g in longer.optimizer.param_groups)
    longer.cleanup()  # a trainer set up holds its output until it has trained, or until this
    Trainer(config(tiny_pair, train_data, out, resume=True, max_steps=3)).setup()
    assert "newest checkpoint is at step 6, past the last step of this run (3" in capsys.readouterr().err
    done = Trainer(config(tiny_pair, train_data, out, resume=True, lr=1e-3)).setup()  # step 6 of 6: nothing to run
    assert "lr 0.003 -> 0.001" in capsys.readouterr().err
    done.train()
    assert yaml.safe_load((out / "training_config.yaml").read_text())["lr"] == 3e-3  # what trained the export


def test_a_checkpoint_of_an_older_version_is_checked_by_its_options(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out)).setup().train()
    path = out / "checkpoints" / "step-00000006" / "training_state.pt"
    state = torch.load(path, weights_only=False)
    del state["data"], state["world_size"]
    state["config"]["max_length"] = 3072  # the default, not yet capped at the target's context
    torch.save(state, path)
    assert Trainer(config(tiny_pair, train_data, out, resume=True, max_steps=8)).setup().step == 6
    with pytest.raises(UserError, match="eval_fraction 0.125, now 0.25"):
        Trainer(config(tiny_pair, train_data, out, resume=True, eval_fraction=0.25)).setup()


def test_a_fine_tune_checkpointed_before_config_extras_were_kept_resumes(tiny_pair, train_data, tmp_path):
    """Checkpoints before 2026-12-06 kept none of a drafter's config fields that this package did not own (vLLM's
    `use_sliding_window`, `dflash_config` extras): a resume of such a fine-tune found "another shape", or, for a
    sliding drafter, no window. Fields that set how layers attend are not filled in: missing, they are a change."""
    first = tmp_path / "first"
    shutil.copytree(tiny_pair[1], first)
    raw = json.loads((first / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=64, max_window_layers=0, layer_types=["sliding_attention"])
    raw["dflash_config"].update(engine_option=1, causal=True)
    (first / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "tuned"
    Trainer(config(tiny_pair, train_data, out, init_from=str(first), max_steps=2)).setup().train()
    step2 = out / "checkpoints" / "step-00000002" / "training_state.pt"

    def forget(*keys, dflash_keys=()):
        def edit(state):
            for key in keys:
                del state["drafter_config"][key]
            for key in dflash_keys:
                del state["drafter_config"]["dflash_config"][key]
        return edit

    _edit_state(step2, forget("use_sliding_window", "max_window_layers", dflash_keys=("engine_option",)))
    resumed = Trainer(config(tiny_pair, train_data, out, init_from=str(first), max_steps=3, resume=True)).setup()
    assert resumed.step == 2 and resumed.drafter_config.extra["max_window_layers"] == 0
    assert resumed.drafter_config.layer_attention(0).window == 64
    resumed.train()
    exported = json.loads((out / "config.json").read_text())  # written back
    assert (exported["max_window_layers"], exported["dflash_config"]["engine_option"]) == (0, 1)
    step3 = out / "checkpoints" / "step-00000003" / "training_state.pt"
    _edit_state(step3, lambda state: state["drafter_config"].update(max_window_layers=1))
    with pytest.raises(UserError, match="another shape .max_window_layers 1, now 0"):  # a recorded one still counts
        Trainer(config(tiny_pair, train_data, out, init_from=str(first), max_steps=4, resume=True)).setup()
    _edit_state(step3, lambda state: state["drafter_config"].update(max_window_layers=0))
    _edit_state(step3, forget(dflash_keys=("causal",)))  # trained both ways, resumed causal: not the same training
    with pytest.raises(UserError, match="another shape .dflash_config"):
        Trainer(config(tiny_pair, train_data, out, init_from=str(first), max_steps=4, resume=True)).setup()


def test_a_feature_cache_directory_serves_only_the_setup_it_was_made_for(tiny_pair, train_data, tmp_path):
    cache = tmp_path / "features"
    Trainer(config(tiny_pair, train_data, tmp_path / "a", feature_cache=str(cache), max_steps=2)).setup().train()
    assert json.loads((cache / "manifest.json").read_text())["examples"]
    same = Trainer(config(tiny_pair, train_data, tmp_path / "b", feature_cache=str(cache))).setup()
    same.target.context_features = lambda *a, **k: pytest.fail("cached features were computed again")
    same._features(same._batch("eval", [0, 1]))  # the final evaluation of the first run cached these
    with pytest.raises(UserError, match=r"holds the features of another setup \(feature layers \[.*\], now \[0, 3\]"):
        Trainer(config(tiny_pair, train_data, tmp_path / "c", feature_cache=str(cache),
                       target_layer_ids=[0, 3])).setup()
    with pytest.raises(UserError, match="the examples differ"):
        Trainer(config(tiny_pair, train_data, tmp_path / "d", feature_cache=str(cache), max_length=20)).setup()
    copy = tmp_path / "copy"  # `cp -r`: the same bytes, new modification times
    shutil.copytree(tiny_pair[0], copy, copy_function=shutil.copy)
    with pytest.raises(UserError, match=r"differ in size or modification time: a copy made without keeping the times"):
        Trainer(config((copy, tiny_pair[1]), train_data, tmp_path / "f", feature_cache=str(cache))).setup()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(torch.zeros(3, 64), legacy / "train-0.pt")
    with pytest.raises(UserError, match="holds features but no manifest.json"):
        Trainer(config(tiny_pair, train_data, tmp_path / "e", feature_cache=str(legacy))).setup()


def test_a_feature_cache_inside_the_checkpoints_folder_is_refused(tiny_pair, train_data, tmp_path):
    """--overwrite deleted the folder whole after the manifest was written: the features came back without it, and
    the next run was told an older dflash wrote them."""
    out = tmp_path / "out"
    for inside in (out / "checkpoints", out / "checkpoints" / "features"):
        with pytest.raises(UserError, match=f"--feature-cache {inside} lies in {out / 'checkpoints'}, which holds this "
                                            "run's checkpoints alone"):
            Trainer(config(tiny_pair, train_data, out, feature_cache=str(inside))).setup()
    Trainer(config(tiny_pair, train_data, out, feature_cache=str(out / "features"), max_steps=1)).setup()


@pytest.mark.parametrize("content", ['{"project": "mine"}', "my notes", '{"target": null}'])
def test_a_feature_cache_directory_with_a_manifest_dflash_did_not_write_is_refused_as_such(tiny_pair, train_data,
                                                                                         tmp_path, content):
    """Not "the features of another setup (target None, ...)": the directory is the user's, not a feature cache."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "manifest.json").write_text(content)
    with pytest.raises(UserError, match=re.escape(f"{theirs / 'manifest.json'} is not a dflash feature cache's "
                                                  f"manifest; --feature-cache {theirs} holds something else: pass "
                                                  "another directory")):
        Trainer(config(tiny_pair, train_data, tmp_path / "o", feature_cache=str(theirs))).setup()
    assert (theirs / "manifest.json").read_text() == content and not list(theirs.glob("*.pt"))


def test_grad_clip_zero_means_no_clipping(tiny_pair, train_data, tmp_path):
    Trainer(config(tiny_pair, train_data, tmp_path / "zero", grad_clip=0.0)).setup().train()
    Trainer(config(tiny_pair, train_data, tmp_path / "huge", grad_clip=1e9)).setup().train()
    first = Trainer(config(tiny_pair, train_data, tmp_path / "none", max_steps=1)).setup()
    zero, huge = weights(tmp_path / "zero"), weights(tmp_path / "huge")
    assert all(torch.allclose(zero[k], huge[k]) for k in zero)
    assert not torch.allclose(zero["fc.weight"], first.drafter.fc.weight.detach())  # it learnt


def test_max_length_is_capped_at_the_target_context(tiny_pair, train_data, tmp_path):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "o", max_length=3072)).setup()
    assert trainer.config.max_length == 1024
    assert any("beyond the target's context of 1024" in r.get("message", "") for r in trainer.history)


@pytest.fixture(scope="module")
def tokens(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.mark.parametrize("choice, message", [
    (lambda t: 99999, "(99999) cannot be the mask token: it is outside the target's vocabulary (0..127)"),
    (lambda t: t.eos_token_id, "cannot be the mask token: it is an end-of-sequence token"),
    (lambda t: t.pad_token_id, "cannot be the mask token: it is the padding token"),
    (lambda t: t.convert_tokens_to_ids("▁clips"), "cannot be the mask token: it is '▁clips', a token of ordinary "
                                                   "text"),
])
def test_a_mask_token_that_aliases_a_real_token_is_refused(tiny_pair, train_data, tmp_path, tokens, choice, message):
    with pytest.raises(UserError, match=re.escape(message) + ".*never occur in text"):
        Trainer(config(tiny_pair, train_data, tmp_path / "o", mask_token_id=choice(tokens))).setup()


def test_a_mask_token_in_the_responses_is_a_loud_warning(tiny_pair, tmp_path, tokens, capsys):
    mask = tokens.convert_tokens_to_ids("<|mask|>")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7 + i], "response_ids": [8, 9, mask, 10, 11]}) + "\n"
                            for i in range(8)))
    Trainer(config(tiny_pair, data, tmp_path / "o", batch_size=2)).setup()
    assert f"the mask token ({mask}) occurs 8 times in the responses" in capsys.readouterr().err


def test_a_run_that_fails_in_setup_leaves_no_empty_directories(tiny_pair, tmp_path):
    out = tmp_path / "runs" / "new"
    with pytest.raises(UserError, match="does not exist"):
        Trainer(config(tiny_pair, tmp_path / "missing.jsonl", out)).setup()
    assert not (tmp_path / "runs").exists()  # what it created, the folder above --output too
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    with pytest.raises(UserError, match="does not exist"):
        Trainer(config(tiny_pair, tmp_path / "missing.jsonl", kept)).setup()
    assert (kept / "notes").is_dir() and not (kept / "checkpoints").exists()


def test_bad_devices_are_clear_errors(tiny_pair, train_data, tmp_path):
    with pytest.raises(UserError, match="--device 'foo' is not a device; use cpu, cuda or cuda:N"):
        Trainer(config(tiny_pair, train_data, tmp_path / "o", device="foo")).setup()
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--device cuda, but torch sees no CUDA GPU here"):
            Trainer(config(tiny_pair, train_data, tmp_path / "o", device="cuda")).setup()


@pytest.mark.parametrize("flags, message", [
    (["--mask-token-id", "99999"], "outside the target's vocabulary"),
    (["--max-steps", "-3"], "--max-steps must be >= 1, got -3"),
    (["--device", "foo"], "is not a device"),
])
def test_train_cli_refuses_mistakes_without_a_traceback(tiny_pair, train_data, tmp_path, capsys, flags, message):
    assert main(["train", "--target", str(tiny_pair[0]), "--data", str(train_data), "--output", str(tmp_path / "o"),
                 "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err


# ---- bad input: damaged files, paths that cannot be written, a diverging run ------------------------------------
@pytest.mark.parametrize("damage", [
    lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),  # truncated
    lambda path: path.write_bytes(b"not a checkpoint"),
    lambda path: path.unlink(),
    lambda path: torch.save({"step": 2}, path),
])
def test_a_damaged_checkpoint_names_itself_and_how_to_go_on(tiny_pair, train_data, tmp_path, damage):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=2, checkpoint_every=1, eval_fraction=0.0)).setup().train()
    newest = out / "checkpoints" / "step-00000002"
    damage(newest / "training_state.pt")
    with pytest.raises(UserError, match=re.escape(f"checkpoint {newest} is damaged or incomplete") + ".*delete that "
                                        "step directory to resume from the previous checkpoint.*--overwrite"):
        Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True, eval_fraction=0.0)).setup()
    shutil.rmtree(newest)  # as the message says
    assert Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True, eval_fraction=0.0)).setup().step == 1


def _edit_state(path: Path, edit) -> None:
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


@pytest.mark.parametrize("edit", [
    lambda state: state["drafter"].popitem(),  # a weight removed
    lambda state: state["drafter"].update({k: v[:1] for k, v in state["drafter"].items()}),  # other shapes
    lambda state: state.update(optimizer={"state": {}}),  # no param_groups
    lambda state: state.update(drafter_config="qwen3"),  # not a config
    lambda state: state.update(config=None),
])
def test_a_checkpoint_that_reads_but_does_not_fit_names_itself_and_how_to_go_on(tiny_pair, train_data, tmp_path,
                                                                                 edit):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=2, checkpoint_every=1, eval_fraction=0.0)).setup().train()
    newest = out / "checkpoints" / "step-00000002"
    _edit_state(newest / "training_state.pt", edit)
    with pytest.raises(UserError, match=re.escape(f"checkpoint {newest} does not hold a training state this version "
                                                  "can resume") + ".*delete that step directory.*--overwrite"):
        Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True, eval_fraction=0.0)).setup()
    shutil.rmtree(newest)  # as the message says
    assert Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True, eval_fraction=0.0)).setup().step == 1


def test_resume_without_a_checkpoint_says_it_starts_from_scratch(tiny_pair, train_data, tmp_path, capsys):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out", resume=True)).setup()
    assert trainer.step == 0
    assert (f"warning: --resume: no checkpoint found in {tmp_path / 'out' / 'checkpoints'}, so training starts from "
            "scratch") in capsys.readouterr().err


@pytest.mark.parametrize("damage", [lambda path: path.write_bytes(b"garbage"),
                                    lambda path: torch.save(torch.zeros(3, 5), path)])
def test_a_damaged_feature_cache_file_is_computed_again_with_a_warning(tiny_pair, train_data, tmp_path, capsys,
                                                                       damage):
    cache = tmp_path / "features"
    Trainer(config(tiny_pair, train_data, tmp_path / "a", feature_cache=str(cache), max_steps=1)).setup().train()
    good = torch.load(cache / "eval-0.pt", weights_only=True)
    damage(cache / "eval-0.pt")
    again = Trainer(config(tiny_pair, train_data, tmp_path / "b", feature_cache=str(cache))).setup()
    features, _ = again._features(again._batch("eval", [0]))
    assert torch.equal(features[0, : len(good)], good.float())
    assert torch.equal(torch.load(cache / "eval-0.pt", weights_only=True), good)  # rewritten
    assert f"the feature cache file {cache / 'eval-0.pt'} is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--output", "{a_file}"], "--output {a_file} is a file; give a directory"),
    (["--output", "{a_file}/x"], "--output {a_file}/x cannot be created: {a_file} is a file, not a directory"),
    (["--feature-cache", "{a_file}"], "--feature-cache {a_file} is a file; give a directory (it is created if "
                                      "missing), or 'memory'"),
    (["--config", "{tmp}"], "--config {tmp} is a directory; give the YAML file"),
])
def test_train_paths_that_cannot_be_used_name_their_flag_before_the_target_loads(tiny_pair, train_data, tmp_path,
                                                                                 capsys, monkeypatch, flags, message):
    from dflash.model.target import TargetModel

    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("target loaded"))
    (tmp_path / "a_file").write_text("")
    names = {"a_file": tmp_path / "a_file", "tmp": tmp_path}
    flags = ["--output", str(tmp_path / "o")] + [f.format(**names) for f in flags]  # a later --output wins
    assert main(["train", "--target", str(tiny_pair[0]), "--data", str(train_data), "--device", "cpu", *flags]) == 2
    assert message.format(**names) in capsys.readouterr().err


def test_target_layer_ids_that_are_not_integers_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--target-layer-ids", "1,a"])
    assert "expected integers separated by commas, got '1,a'" in capsys.readouterr().err


def test_a_diverging_run_stops_and_keeps_its_checkpoints(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    options = dict(max_steps=6, checkpoint_every=1, eval_fraction=0.0)
    trainer = Trainer(config(tiny_pair, train_data, out, **options)).setup()
    original = trainer._train_step

    def nan_at_step_4(indices, epoch):
        stats = original(indices, epoch)
        return {**stats, "loss": math.nan} if trainer.step == 4 else stats

    trainer._train_step = nan_at_step_4
    newest = out / "checkpoints" / "step-00000003"
    with pytest.raises(UserError, match=re.escape("the training loss became nan at step 4: training diverged and "
                                                  f"stopped; the newest checkpoint, {newest}, is kept")
                                        + ".*lower --lr .now 0.003.*--resume"):
        trainer.train()
    assert checkpoint_names(out) == ["step-00000002", "step-00000003"]

    poisoned = Trainer(config(tiny_pair, train_data, out, resume=True, lr=1e-3, **options)).setup()
    assert poisoned.step == 3  # the advice works
    original = poisoned._train_step

    def nan_weights_at_step_5(indices, epoch):  # a finite loss, then weights that are not: never saved
        stats = original(indices, epoch)
        if poisoned.step == 5:
            with torch.no_grad():
                poisoned.drafter.fc.weight.fill_(math.inf)
        return stats

    poisoned._train_step = nan_weights_at_step_5
    with pytest.raises(UserError, match="the drafter's weights are no longer finite numbers at step 5"):
        poisoned.train()
    assert checkpoint_names(out) == ["step-00000003", "step-00000004"]


def test_weights_the_last_step_broke_are_neither_exported_nor_kept(tiny_pair, train_data, tmp_path):
    """--weight-decay 1e30 left huge but finite weights after the last step: the held-out loss was NaN, and they were
    exported with exit status 0. The advice named --lr alone."""
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out, max_steps=4, checkpoint_every=2, weight_decay=1e30)).setup()
    original = trainer._train_step

    def decay_at_the_last_step_only(indices, epoch):
        for group in trainer.optimizer.param_groups:
            group["weight_decay"] = 1e30 if trainer.step == 3 else 0.0
        return original(indices, epoch)

    trainer._train_step = decay_at_the_last_step_only
    newest = out / "checkpoints" / "step-00000002"
    with pytest.raises(UserError, match=re.escape("the held-out loss became nan after the last step (step 4): "
                                                  f"training diverged and stopped; the newest checkpoint, {newest}, is "
                                                  "kept (nothing was saved from the diverged steps); lower "
                                                  "--weight-decay (now 1e+30: with --lr 0.003 it takes all of every "
                                                  "weight, or more)")):
        trainer.train()
    assert checkpoint_names(out) == ["step-00000002"] and not (out / "model.safetensors").exists()


# ---- interruptions, a second run, a full disk ----------------------------------------------------------------
def test_an_interrupt_in_the_final_evaluation_keeps_the_last_step(tiny_pair, train_data, tmp_path, monkeypatch):
    """The last step is saved before the final evaluation, which can take long: a stop there (a second Ctrl-C, a
    job's time limit) loses no step, and the run resumes from it."""
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out)).setup()  # checkpoints at step 3; 6 steps

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.checkpoints.all()[-1].name == "step-00000006"
    resumed = Trainer(config(tiny_pair, train_data, out, resume=True)).setup()  # the lock went with the run
    assert resumed.step == 6


def test_a_second_run_on_the_same_output_is_refused_until_the_first_ends(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    first = Trainer(config(tiny_pair, train_data, out, max_steps=2)).setup()
    with pytest.raises(UserError, match=f"another dflash train is writing {out}; let it finish"):
        Trainer(config(tiny_pair, train_data, out, max_steps=2)).setup()
    first.train()
    assert [json.loads(line).get("event") for line in (out / "train_log.jsonl").read_text().splitlines()].count(
        "start") == 1
    Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True)).setup()  # free again


def test_a_run_refused_by_the_lock_removes_no_directory_of_the_run_that_holds_it(tiny_pair, train_data, tmp_path,
                                                                               monkeypatch):
    """Two runs started in the same instant on a new --output may both create its directories; the one refused by
    the lock must not remove them as its own failed set-up's (the first would lose its checkpoints/ folder)."""
    out = tmp_path / "out"
    first = Trainer(config(tiny_pair, train_data, out, max_steps=3, checkpoint_every=1)).setup()
    second = Trainer(config(tiny_pair, train_data, out, max_steps=3))
    made = second._check_directories
    monkeypatch.setattr(second, "_check_directories", lambda: [out, out / "checkpoints"] if made() == [] else [])
    with pytest.raises(UserError, match="another dflash train is writing"):
        second.setup()
    assert (out / "checkpoints").is_dir()
    first.train()
    assert checkpoint_names(out)[-1] == "step-00000003" and (out / "model.safetensors").is_file()


def test_overwrite_deletes_nothing_when_the_new_run_cannot_start(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out)).setup().train()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 0}\n')
    with pytest.raises(UserError, match="bad.jsonl"):
        Trainer(config(tiny_pair, bad, out, overwrite=True)).setup()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "train_log.jsonl").is_file()
    log = (out / "train_log.jsonl").read_text()
    layers = Trainer(config(tiny_pair, train_data, tmp_path / "probe")).setup().target.num_layers
    # the range was checked at the first step, after --overwrite had cleared the earlier run
    with pytest.raises(UserError, match=rf"--target-layer-ids \[{layers}\] are outside the target's {layers} layers"):
        Trainer(config(tiny_pair, train_data, out, overwrite=True, target_layer_ids=[layers])).setup()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "train_log.jsonl").read_text() == log
    Trainer(config(tiny_pair, train_data, out, overwrite=True, max_steps=2)).setup().train()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_new_drafter_feeds_on_each_target_layer_once():
    """The published formula names a layer twice on a target of fewer than draft layers + 4 layers; vLLM takes each
    layer's output once and sizes fc by the list, so a new drafter lists each once, and repeats asked for are
    refused."""
    from conftest import tiny_target_model
    from dflash.model import TargetModel
    from dflash.model.config import default_target_layer_ids
    from dflash.training.config import TrainConfig
    from dflash.training.drafter_setup import drafter_config_for

    target = TargetModel(tiny_target_model("qwen3", layers=4))
    assert default_target_layer_ids(4, 2) == [1, 1]
    train = dict(target="t", data="d.jsonl", output="o", block_size=4)
    assert drafter_config_for(target, TrainConfig(**train, draft_layers=2), 0).target_layer_ids == [1]
    assert drafter_config_for(target, TrainConfig(**train, draft_layers=1), 0).target_layer_ids == [2]
    wide = TargetModel(tiny_target_model("qwen3", layers=8))
    assert drafter_config_for(wide, TrainConfig(**train, draft_layers=3), 0).target_layer_ids == [1, 3, 5]
    with pytest.raises(UserError, match="--target-layer-ids 2,1,2: they name layer 2 more than once"):
        TrainConfig(**train, target_layer_ids=[2, 1, 2]).validate()  # a fine-tune's (--init-from) too
    # the engines hand the drafter its layers in layer order
    with pytest.raises(UserError, match="--target-layer-ids 2,1: they are not in ascending order, and vLLM and SGLang"):
        TrainConfig(**train, target_layer_ids=[2, 1]).validate()
    TrainConfig(**train, target_layer_ids=[1, 2]).validate()
    TrainConfig(**train).validate()


def test_a_drafter_fed_by_the_targets_last_layer_is_warned_of(tiny_pair, train_data, tmp_path, capsys):
    """vLLM and SGLang tap a layer's output as the next layer's input, which the last layer has not."""
    Trainer(config(tiny_pair, train_data, tmp_path / "a", target_layer_ids=[1, 2])).setup()
    assert "feature layers" not in capsys.readouterr().err
    Trainer(config(tiny_pair, train_data, tmp_path / "b", target_layer_ids=[1, 3])).setup()
    assert ("feature layers [1, 3]: they include the target's last layer (3), and vLLM and SGLang read a layer's"
            in " ".join(capsys.readouterr().err.split()))


def test_distillation_is_refused_for_a_target_whose_logits_it_cannot_reproduce(tiny_pair, train_data, tmp_path,
                                                                               monkeypatch):
    from dflash.model.target import TargetModel

    monkeypatch.setattr(TargetModel, "distillation_problem", lambda self: "its logits are its own")
    with pytest.raises(UserError, match="--distill-weight 0.5: its logits are its own, .+ train without"):
        Trainer(config(tiny_pair, train_data, tmp_path / "out", distill_weight=0.5)).setup()
    Trainer(config(tiny_pair, train_data, tmp_path / "out")).setup()  # without distillation it is not asked


def test_a_checkpoint_that_cannot_be_written_is_a_clear_error_keeping_the_last_one(tiny_pair, train_data, tmp_path,
                                                                                   monkeypatch):
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out)).setup()
    real_save = torch.save

    def disk_full_at_step_6(obj, path, *args, **kwargs):
        if "step-00000006" in str(path):  # what torch's writer raises when the disk fills
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4288 vs 4176")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_6)
    with pytest.raises(UserError, match=r"could not write checkpoint step 6 .*is the disk full\?\); the newest "
                                        r"checkpoint, .*step-00000003, is kept: fix that and rerun with "
                                        r"--resume"):
        trainer.train()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003"]  # no half-written one


def test_an_export_safetensors_cannot_write_is_a_clear_error(tiny_pair, train_data, tmp_path, monkeypatch):
    """safetensors reports a full disk or a denied write with an error of its own (neither OSError nor
    RuntimeError): it printed a traceback."""
    from safetensors import SafetensorError

    from dflash.model import loading

    def refused(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 13, kind: PermissionDenied, message: "
                              "\"Permission denied\" })")

    monkeypatch.setattr(loading, "save_file", refused)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"could not export the drafter into .*Permission denied.*can this user write "
                                        r"there\?\); step 3 is saved in .*--resume to export it"):
        Trainer(config(tiny_pair, train_data, out, max_steps=3, checkpoint_every=3)).setup().train()
    assert not list(out.glob("*.tmp"))


def test_a_log_line_a_stopped_write_left_unfinished_is_cut_before_the_next(tiny_pair, train_data, tmp_path,
                                                                           monkeypatch):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=3, checkpoint_every=3)).setup().train()
    log = out / "train_log.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 4, "loss": 1.2, "lr": 0.00')  # a full disk stopped this record
    Trainer(config(tiny_pair, train_data, out, max_steps=4, checkpoint_every=3, resume=True)).setup().train()
    lines = log.read_text().splitlines()
    assert log.read_text().startswith(whole) and all(json.loads(line) for line in lines)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trainer = Trainer(config(tiny_pair, train_data, out, max_steps=6, checkpoint_every=3, resume=True)).setup()
    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(UserError, match=r"could not write the training log .*train_log.jsonl .*is the disk full\?\); "
                                        r"the newest checkpoint, .*step-00000004, is kept"):
        trainer.train()


def test_a_target_with_damaged_weights_is_a_clear_error(tiny_pair, train_data, tmp_path):
    damaged = tmp_path / "target"
    shutil.copytree(tiny_pair[0], damaged)
    (damaged / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=re.escape(str(damaged))):
        Trainer(config(tiny_pair, train_data, tmp_path / "out", target=str(damaged))).setup()


def test_resuming_with_another_target_names_it(tiny_pair, train_data, tmp_path, capsys):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=3)).setup().train()
    other = tmp_path / "other_target"
    shutil.copytree(tiny_pair[0], other)
    Trainer(config(tiny_pair, train_data, out, max_steps=4, resume=True, target=str(other))).setup()
    assert f"target {str(tiny_pair[0])!r} -> {str(other)!r} (the drafter now learns another model's" in \
        capsys.readouterr().err


def test_the_exported_weights_are_readable_as_other_new_files_are(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=1)).setup().train()
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777


def test_each_logged_step_shows_the_learning_rate_it_took(tiny_pair, train_data, tmp_path):
    """The log read the rate after the scheduler had moved on: every line showed the next step's, and the last
    step, which trained at a small rate, showed 0."""
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out, log_every=1, max_steps=5, checkpoint_every=0)).setup()
    trainer.train()
    rule = trainer.scheduler.lr_lambdas[0]  # step s (1-based) trains at lr * rule(s - 1)
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in logged if "lr" in r and "step" in r}
    assert sorted(rates) == [1, 2, 3, 4, 5]
    for step, rate in rates.items():
        assert rate == pytest.approx(3e-3 * rule(step - 1))
    assert rates[5] > 0


def test_data_that_dflash_datagen_is_still_writing_is_refused(tiny_pair, train_data, tmp_path):
    """A run on part of a datagen output trains on what happened to be written, and cannot be resumed once the
    file has grown: datagen's lock on the file says it is not done."""
    from dflash.training.lock import lock_or_refuse

    with open(train_data, "a") as writing:
        lock_or_refuse(writing.fileno(), "busy")
        with pytest.raises(UserError, match=r"--data .+ is still being written by dflash datagen; let it finish"):
            Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=1)).setup()
    Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=1)).setup().cleanup()  # done: it trains


def test_max_length_is_capped_at_the_context_decoding_reaches(tiny_pair, train_data, tmp_path, monkeypatch, capsys):
    """A longrope target decodes within its switch (`TargetModel.context_length`): training on longer sequences
    would learn features, rotated with the long factors, that decoding never shows the drafter."""
    from dflash.model.target import TargetModel

    monkeypatch.setattr(TargetModel, "context_length", property(lambda self: 20))
    monkeypatch.setattr(TargetModel, "context_note", property(lambda self: " (its longrope rotary switches ...)"))
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out", max_length=64)).setup()
    assert trainer.config.max_length == 20
    assert "beyond the target's context of 20 tokens (its longrope rotary switches ...)" in capsys.readouterr().out
    trainer.cleanup()


# ---- a refusal on every process, --overwrite's old export, a stop at once, a failed setup --------------------
def test_a_process_that_loses_another_mid_run_says_so_in_a_line(tiny_pair, train_data, tmp_path):
    """Another rank died (its own error above): this one's collective failed with gloo's 50-line traceback."""
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "out")).setup()
    trainer.world = 2  # as under torchrun; the step below is where the collective fails

    def lost_peer(indices, epoch):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    trainer._train_step = lost_peer
    with pytest.raises(UserError, match=r"^another process of this torchrun job stopped \(its error is above; here: "
                                        r".*Connection closed by peer.*\); no earlier checkpoint was written"):
        trainer.train()
    trainer.world = 1
    trainer._train_step = lambda indices, epoch: (_ for _ in ()).throw(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):  # one process: no peer to blame
        trainer.train()


def test_a_refusal_on_rank_0_reaches_every_process(tiny_pair, train_data, tmp_path):
    """The output lock is rank 0's: its refusal is every process's, each with the message (rank 1 waited at a
    barrier for a process that had stopped, and died with a traceback that buried it)."""
    from dflash.training.lock import DirectoryLock

    out = tmp_path / "out"
    out.mkdir()
    held = DirectoryLock(out, "busy")  # another dflash train writing it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "dflash.cli.main", "train", "--target", str(tiny_pair[0]), "--data", str(train_data), "--output",
         str(out), "--device", "cpu", "--max-steps", "1"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    held.release()
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"dflash train [rank {rank}/2]: error: another dflash train is writing {out}" in proc.stderr
    assert "Connection closed" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_overwrite_removes_the_earlier_export_so_a_stopped_run_cannot_load_it(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=1)).setup().train()
    stopped = Trainer(config(tiny_pair, train_data, out, overwrite=True, seed=1, checkpoint_every=0)).setup()
    assert not any((out / name).exists() for name in ("config.json", "model.safetensors", "training_config.yaml"))
    signal_after_step(stopped)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    with pytest.raises(UserError, match="stopped before its export was complete .*--resume --max-steps 1"):
        load_drafter(out)  # not the earlier run's drafter, silently


def test_ctrl_c_after_the_last_step_finishes_the_run_and_says_so(tiny_pair, train_data, tmp_path, capsys,
                                                                  monkeypatch):
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out, max_steps=2)).setup()
    evaluate = trainer.evaluate

    def ctrl_c_then_evaluate():
        signal.raise_signal(signal.SIGINT)
        return evaluate()

    monkeypatch.setattr(trainer, "evaluate", ctrl_c_then_evaluate)
    assert "eval_loss" in trainer.train()
    assert "the last step has trained; finishing the run (its checkpoint, the final evaluation and the export" in \
        capsys.readouterr().err
    assert load_drafter(out).config.block_size == 4


@pytest.mark.parametrize("at_step, said", [
    (4, "the newest checkpoint is {out}/checkpoints/step-00000003 (step 3): run the same command with --resume to "
        "continue from it"),
    (2, "stopped at once, before the first checkpoint: nothing is saved to resume from; run the same command again "
        "to start afresh"),
])
def test_a_second_ctrl_c_stops_at_once_and_names_the_checkpoint_to_resume_from(tiny_pair, train_data, tmp_path,
                                                                                 capsys, at_step, said, monkeypatch,
                                                                                 ctrl_c_interrupts):
    monkeypatch.setattr(StopRequest, "REPEAT_WINDOW_S", 0.0)  # a second later, as a person presses it again
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out)).setup()  # checkpoints at step 3; 6 steps
    signal_after_step(trainer, at_step, times=2)  # the second acts at once
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert said.format(out=out) in capsys.readouterr().err
    if at_step == 2:  # as it says (it said --overwrite, which the same command did not need)
        assert Trainer(config(tiny_pair, train_data, out, max_steps=1)).setup().train()["step"] == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_delivered_twice_at_once_still_saves_a_checkpoint_after_the_step(tiny_pair, train_data, tmp_path,
                                                                              capsys, signum):
    """A job scheduler signals every process of a job, and torchrun forwards its own copy to its workers a few
    milliseconds later: each worker took the copy for a second Ctrl-C and stopped at once, losing the steps since
    its last checkpoint."""
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out, checkpoint_every=0)).setup()
    signal_after_step(trainer, 2, signum, times=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [path.name for path in CheckpointDir(out / "checkpoints").all()] == ["step-00000002"]
    assert "stopped at once" not in capsys.readouterr().err


def test_a_second_ctrl_c_in_the_final_evaluation_says_resume_exports_the_last_step(tiny_pair, train_data, tmp_path,
                                                                                    capsys, monkeypatch,
                                                                                    ctrl_c_interrupts):
    monkeypatch.setattr(StopRequest, "REPEAT_WINDOW_S", 0.0)
    out = tmp_path / "out"
    trainer = Trainer(config(tiny_pair, train_data, out, max_steps=2)).setup()

    def two_ctrl_cs():  # raise_signal runs the handler at once, in this thread: two kill()s could come as one
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the second Ctrl-C did not stop the run at once")

    monkeypatch.setattr(trainer, "evaluate", two_ctrl_cs)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (f"the newest checkpoint is {out}/checkpoints/step-00000002 (step 2): run the same command with --resume "
            "to evaluate and export it") in capsys.readouterr().err


def test_a_resume_names_a_changed_selector_weight_and_logs_the_new_rate(tiny_pair, train_data, tmp_path, capsys):
    options = dict(dflash2=True, selector_rank=8, selector_top_k=4, checkpoint_every=0, log_every=1)
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=3, **options)).setup().train()
    resumed = Trainer(config(tiny_pair, train_data, out, max_steps=5, lr=1e-3, selector_loss_weight=0.5, resume=True,
                             **options)).setup()
    assert "selector_loss_weight 1.0 -> 0.5" in capsys.readouterr().err
    resumed.train()
    rule = resumed.scheduler.lr_lambdas[0]  # the new schedule: 5 steps at 1e-3
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in logged if "lr" in r and "step" in r}
    assert rates[4] == pytest.approx(1e-3 * rule(3)) and rates[5] == pytest.approx(1e-3 * rule(4))


def test_exporting_a_run_stopped_early_keeps_its_settings_and_says_nothing_trains(tiny_pair, train_data, tmp_path,
                                                                                  capsys):
    out = tmp_path / "out"
    stopped = Trainer(config(tiny_pair, train_data, out, max_steps=8)).setup()  # a checkpoint at step 3
    original = stopped._train_step

    def stop_at_step_4(indices, epoch):
        if stopped.step == 3:
            raise KeyboardInterrupt
        return original(indices, epoch)

    stopped._train_step = stop_at_step_4
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    state = out / "checkpoints" / "step-00000003" / "training_state.pt"
    capsys.readouterr()
    for _ in range(2):  # exported twice: the same settings, the checkpoint untouched
        Trainer(config(tiny_pair, train_data, out, max_steps=3, resume=True)).setup().train()
        err = capsys.readouterr().err
        assert "continues with the new values" not in err and "max_steps" not in err
        assert yaml.safe_load((out / "training_config.yaml").read_text())["max_steps"] == 8
        assert torch.load(state, weights_only=False)["config"]["max_steps"] == 8
    Trainer(config(tiny_pair, train_data, out, max_steps=3, lr=1e-3, resume=True)).setup().train()
    assert ("other settings than the checkpoint's: lr 0.003 -> 0.001; no step is left to train, so they change "
            "nothing") in capsys.readouterr().err
    # an evaluation setting changes what the final evaluation measures: said, and recorded with the export
    Trainer(config(tiny_pair, train_data, out, max_steps=3, eval_decoding_examples=1, resume=True)).setup().train()
    assert ("evaluating with other settings than the checkpoint's: eval_decoding_examples 64 -> 1; the held-out "
            "figures logged from here on use the new values") in capsys.readouterr().err
    assert yaml.safe_load((out / "training_config.yaml").read_text())["eval_decoding_examples"] == 1
    # another target (here a copy elsewhere): the export names the one that trained the drafter, and says so
    trained_by = yaml.safe_load((out / "training_config.yaml").read_text())["target"]
    other = tmp_path / "other_target"
    shutil.copytree(tiny_pair[0], other)
    Trainer(config((other, tiny_pair[1]), train_data, out, max_steps=3, resume=True)).setup().train()
    assert "training_config.yaml keeps the checkpoint's target" in capsys.readouterr().err
    assert yaml.safe_load((out / "training_config.yaml").read_text())["target"] == trained_by


def test_a_refused_setup_leaves_the_output_as_it_found_it(tiny_pair, train_data, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    empty = {"id": 99, "messages": [], "prompt_ids": [5, 6, 7], "response_ids": []}
    data.write_text(train_data.read_text() + json.dumps(empty) + "\n")  # a warning, written before the refusal
    out = tmp_path / "fresh"
    with pytest.raises(UserError, match="only 14 training examples"):
        Trainer(config(tiny_pair, data, out, batch_size=16)).setup()
    assert "records are left out" in capsys.readouterr().err
    assert not out.exists()
    earlier = tmp_path / "earlier"
    Trainer(config(tiny_pair, data, earlier, max_steps=1)).setup().train()
    log = (earlier / "train_log.jsonl").read_text()
    with pytest.raises(UserError, match="only 14 training examples"):
        Trainer(config(tiny_pair, data, earlier, batch_size=16, max_steps=1, resume=True)).setup()
    assert (earlier / "train_log.jsonl").read_text() == log
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="--feature-cache .*cannot be created"):
        Trainer(config(tiny_pair, train_data, out, feature_cache=str(tmp_path / "a_file" / "x"))).setup()
    assert not out.exists()


def test_every_tuning_flag_shows_its_default_and_the_help_says_what_a_resume_needs(capsys):
    from dflash.cli.main import build_parser

    actions = {a.dest: a for a in build_parser().commands["train"]._actions}
    for name in ("anchors_per_sequence", "lr", "weight_decay", "warmup_ratio", "loss_gamma", "dtype", "seed",
                 "eval_fraction", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints"):
        assert "default" in (actions[name].help or ""), name
    assert "(default 0.0006)" in actions["lr"].help
    assert "global batch" in actions["resume"].help
    assert "--target-layer-ids=-1,3" in actions["target_layer_ids"].help
    assert main(["train", "--data", "d.jsonl", "--output", "o", "--keep-checkpoints", "0"]) == 2
    assert "--keep-checkpoints must be >= 1, got 0" in capsys.readouterr().err


def test_any_failure_of_rank_0s_work_stops_the_other_processes_saying_where_to_look(monkeypatch):
    """Only a UserError was shared: a disk that filled during rank 0's checkpoint left the others waiting in the
    broadcast until the collective's timeout (30 minutes on gloo)."""
    import types

    from dflash.training import trainer as trainer_module

    shared_messages = []

    def broadcast(objects, src, device=None):
        shared_messages.append(objects[0])
        objects[0] = shared_messages[0]  # what rank 0 sent

    monkeypatch.setattr(trainer_module.dist, "broadcast_object_list", broadcast)

    def full_disk():
        raise OSError(28, "No space left on device")

    process = types.SimpleNamespace(rank=0, world=2, device=torch.device("cpu"),
                                    config=types.SimpleNamespace(output="out"))
    with pytest.raises(OSError, match="No space left"):  # rank 0: the failure as it is
        Trainer._on_rank_0(process, full_disk)
    assert "process 0 failed while writing out (OSError" in shared_messages[0]
    other = types.SimpleNamespace(**{**vars(process), "rank": 1})
    with pytest.raises(UserError, match="process 0 failed while writing out"):  # the others: told, at once
        Trainer._on_rank_0(other, full_disk)


def test_no_dflash2_with_a_dflash2_drafter_to_start_from_is_refused_and_the_config_says_what_trained(
        tiny_pair, train_data, tmp_path):
    """--no-dflash2 was the default's False: ignored, the DFlash2 drafter fine-tuned as it was, and
    training_config.yaml said dflash2: false beside a DFlash2DraftModel."""
    grown = tmp_path / "grown"
    Trainer(config(tiny_pair, train_data, grown, max_steps=1, dflash2=True, selector_rank=8, selector_top_k=4,
                   checkpoint_every=0)).setup().train()
    with pytest.raises(UserError, match=f"--no-dflash2: the drafter in {grown} is a DFlash2 drafter, whose "
                                        "convolutions and selector cannot be taken out"):
        Trainer(config(tiny_pair, train_data, tmp_path / "no", max_steps=1, init_from=str(grown),
                       dflash2=False)).setup()
    tuned = tmp_path / "tuned"
    Trainer(config(tiny_pair, train_data, tuned, max_steps=1, init_from=str(grown), checkpoint_every=0)).setup().train()
    assert yaml.safe_load((tuned / "training_config.yaml").read_text())["dflash2"] is True
    assert json.loads((tuned / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**7])
def test_any_whole_number_seeds_a_run(tiny_pair, train_data, tmp_path, seed):
    """--seed 2**63 and beyond (or 10**7, through the anchors' generator seeds) overflowed torch's seed: a
    traceback."""
    result = Trainer(config(tiny_pair, train_data, tmp_path / "out", max_steps=1, seed=seed)).setup().train()
    assert math.isfinite(result["eval_loss"])


def test_a_resume_without_the_drafter_it_started_from_says_to_give_it_again(tiny_pair, train_data, tmp_path):
    out = tmp_path / "out"
    Trainer(config(tiny_pair, train_data, out, max_steps=1, init_from=str(tiny_pair[1]))).setup().train()
    with pytest.raises(UserError, match=rf"another shape .*; resume with the options it was trained with \(it started "
                                        rf"from --init-from {re.escape(str(tiny_pair[1]))}: give that again\)"):
        Trainer(config(tiny_pair, train_data, out, max_steps=2, resume=True)).setup()


@pytest.mark.parametrize("api", ["fp32_precision", "allow_tf32"])  # torch 2.9 and later; before
def test_tf32_turns_cuda_float32_matmuls_to_tensor_cores_and_back(monkeypatch, api):
    from types import SimpleNamespace

    from dflash.training.trainer import use_tf32

    matmul = SimpleNamespace(**({"fp32_precision": "ieee"} if api == "fp32_precision" else {"allow_tf32": False}))
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    use_tf32(True)
    assert getattr(matmul, api) == ("tf32" if api == "fp32_precision" else True)
    use_tf32(False)
    assert getattr(matmul, api) == ("ieee" if api == "fp32_precision" else False)
    assert set(vars(matmul)) == {api}  # the other API is left alone: torch refuses the two mixed


def test_the_learning_rate_warms_up_from_above_zero_then_decays_to_zero(tiny_pair, train_data, tmp_path):
    trainer = Trainer(config(tiny_pair, train_data, tmp_path / "o", max_steps=20, warmup_ratio=0.2)).setup()
    rule = trainer.scheduler.lr_lambdas[0]  # 4 warm-up steps: the first step trains at a quarter, not at 0
    assert [rule(s) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert rule(12) == pytest.approx(0.5) and rule(19) < 0.01 and rule(20) == pytest.approx(0.0, abs=1e-12)
    assert all(rule(s) >= rule(s + 1) for s in range(4, 20))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.25 * trainer.config.lr)


@pytest.fixture(scope="module")
def gpt2_layout(tmp_path_factory):
    """A target with GPT-2's layout: one special token, EOS, no pad, and an embedding row for every token and no
    more, so no id is free for the mask; and datagen-style records that never hold the last token, 'zz'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("gpt2_layout")
    words = ["<|endoftext|>"] + [f"w{i}" for i in range(VOCAB - 2)] + ["zz"]  # VOCAB ids, the last 'zz'
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    model = tiny_target_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = 0
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    rng = random.Random(1)
    with (root / "data.jsonl").open("w") as f:
        for i in range(16):
            prompt = [rng.randrange(1, VOCAB - 2) for _ in range(6)]
            response = [rng.randrange(1, VOCAB - 2) for _ in range(20)]
            f.write(json.dumps({"id": i, "messages": [], "prompt_ids": prompt, "response_ids": response}) + "\n")
    assert len(tokenizer) == VOCAB
    return root / "target", root / "data.jsonl"


def test_a_tokenizer_with_no_id_to_spare_is_told_which_token_of_text_to_mask_with(gpt2_layout, tmp_path):
    """GPT-2's layout left no way through: no mask token could be chosen, and every id given was refused."""
    target, data = gpt2_layout
    with pytest.raises(UserError, match=re.escape("cannot pick a mask token") + ".*no special token to spare.*"
                       + re.escape(f"such as --mask-token-id {VOCAB - 1} ('zz')")):
        Trainer(config((target, None), data, tmp_path / "o")).setup()


def test_there_a_token_of_text_the_data_never_holds_masks_with_a_warning(gpt2_layout, tmp_path, capsys):
    target, data = gpt2_layout
    Trainer(config((target, None), data, tmp_path / "o", mask_token_id=VOCAB - 1, max_steps=2)).setup().train()
    assert load_drafter(tmp_path / "o").config.mask_token_id == VOCAB - 1
    assert f"--mask-token-id {VOCAB - 1}: it is 'zz', a token of ordinary text, which none of the 16 training" \
        in capsys.readouterr().err.replace("\n", " ")
    Trainer(config((target, None), data, tmp_path / "tuned", init_from=str(tmp_path / "o"))).setup()
    assert "aliases a real token" not in capsys.readouterr().err  # a fine-tune keeps it without a second word
    eos_too = tmp_path / "eos_too"  # a token of text that is also an end-of-sequence id is refused as such
    shutil.copytree(target, eos_too)
    generation = json.loads((eos_too / "generation_config.json").read_text())
    (eos_too / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [0, VOCAB - 1]}))
    with pytest.raises(UserError, match="it is an end-of-sequence token"):
        Trainer(config((eos_too, None), data, tmp_path / "e", mask_token_id=VOCAB - 1)).setup()
    with pytest.raises(UserError, match=r"\(5\) cannot be the mask token: it is 'w4', a token of ordinary text, held "
                                        r"by \d+ of the 16 training sequences.*such as --mask-token-id 127"):
        Trainer(config((target, None), data, tmp_path / "p", mask_token_id=5)).setup()
    with pytest.raises(UserError, match="it is an end-of-sequence token"):
        Trainer(config((target, None), data, tmp_path / "q", mask_token_id=0)).setup()
