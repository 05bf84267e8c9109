import json
import re
import shutil
import time

import pytest

from dflash import hub
from dflash.api import DFlash
from dflash.cli.main import main
from dflash.errors import DFlashWarning, UserError
from dflash.training import datagen
from dflash.training.datagen import (
    DatagenConfig,
    done_ids,
    is_hub_id,
    prompt_messages,
    read_prompts,
    run_datagen,
    settings_path,
)

SYSTEM_CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weng earns"},
                            {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "And then?"}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "How many clips?"}, {"turns": ["Weng earns", "And then?"]},
        {"messages": [{"role": "user", "content": "Natalia sold"}]}, {"question": "How much did she earn?"},
        SYSTEM_CHAT])


def variant(tiny_pair, tmp_path, context: int | None = None, chat_template: bool = True):
    """A copy of the tiny target with a shorter context, or without a chat template (a base model)."""
    target = tmp_path / "variant"
    shutil.copytree(tiny_pair[0], target)
    if context is not None:
        config = json.loads((target / "config.json").read_text())
        config["max_position_embeddings"] = context
        (target / "config.json").write_text(json.dumps(config))
    if not chat_template:
        (target / "chat_template.jinja").unlink()
    return str(target)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generates_all_turns_with_the_target_own_answers(tiny_pair, prompts, tmp_path):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=8,
                           batch_size=3, device="cpu")
    assert run_datagen(config).written == 5
    records = {r["id"]: r for r in read(out)}
    assert sorted(records) == [0, 1, 2, 3, 4]
    assert [m["role"] for m in records[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    # a system message stays in front, and each user turn gets its own answer (the record's own answer is dropped)
    assert [m["role"] for m in records[4]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert records[4]["messages"][0]["content"] == "Be brief." and "old answer" not in json.dumps(records[4])
    for r in records.values():
        assert 1 <= len(r["response_ids"]) <= 8 and r["prompt_ids"] and r["prompt_hash"]
    assert json.loads(settings_path(out).read_text())["max_new_tokens"] == 8
    assert json.loads(settings_path(out).read_text())["finished"] is True
    # each earlier turn keeps the ids it was answered from and with: turn 1 of "Weng earns" is what the target
    # answers to it alone, and the later prompt holds that answer's text
    assert [sorted(r) == sorted(records[0]) for r in records.values()] == [True, False, True, True, False]
    first = records[1]["earlier_turns"]
    assert len(first) == 1 and len(records[4]["earlier_turns"]) == 1
    pipe = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    asked = pipe.encode([{"role": "user", "content": "Weng earns"}])
    shared = first[0]["prompt_prefix_length"]  # stored as what it shares with the last prompt, and its own tail
    assert shared > 0 and records[1]["prompt_ids"][:shared] + first[0]["prompt_tail_ids"] == asked
    assert first[0]["response_ids"] == pipe.generate(asked, max_new_tokens=8).output_ids
    assert pipe.tokenizer.decode(first[0]["response_ids"], skip_special_tokens=True) == records[1]["messages"][1][
        "content"]


def torchrun_datagen(*flags: str, processes: int = 2):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(port),
         "-m", "dflash.cli.main", "datagen", *flags], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_under_torchrun_each_process_answers_its_share_and_rank_0_joins_them(tiny_pair, prompts, tmp_path):
    """Two processes write what one would (the same greedy records), into the one output, without duplicates: also
    when a stopped run left part of the output and a part file, which a rerun with another process count resumes."""
    common = ["--target", str(tiny_pair[0]), "--prompts", str(prompts), "--max-new-tokens", "8", "--batch-size", "2",
              "--device", "cpu"]
    one = tmp_path / "one.jsonl"
    assert main(["datagen", *common, "--output", str(one)]) == 0
    two = tmp_path / "two.jsonl"
    proc = torchrun_datagen(*common, "--output", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote 5 new records to") == 1 and "it holds 5" in proc.stdout  # rank 0's summary
    by_id = {r["id"]: r for r in read(one)}
    assert read(two) == [by_id[i] for i in range(5)]  # in one process's order: the held-out split follows it
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two")) == [
        "two.jsonl", "two.jsonl.datagen.json"]  # the parts are joined and gone
    assert json.loads(settings_path(two).read_text())["finished"] is True
    # a stopped 3-process run: ids 0 and 3 (rank 0's) in the output, id 1 in rank 1's part, with half a line
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text(json.dumps(by_id[0]) + "\n" + json.dumps(by_id[3]) + "\n")
    shutil.copy(settings_path(one), settings_path(stopped))
    part = tmp_path / "stopped.jsonl.part-1-of-3"
    part.write_text(json.dumps(by_id[1]) + "\n" + '{"id": 4, "prompt_ha')
    shutil.copy(settings_path(one), settings_path(part))
    proc = torchrun_datagen(*common, "--output", str(stopped))  # two processes now: the part is joined first
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote 2 new records to" in proc.stdout and "it holds 5" in proc.stdout
    assert sorted(read(stopped), key=lambda r: r["id"]) == [by_id[i] for i in range(5)]
    assert not part.exists() and not settings_path(part).exists()
    # a part made with other settings is refused, not joined: by rank 0, and the other process stops with it at
    # once (not when torchrun gives up on it after 30 s)
    alone = tmp_path / "alone.jsonl"
    part = tmp_path / "alone.jsonl.part-0-of-2"
    part.write_text(json.dumps(by_id[0]) + "\n" + json.dumps(by_id[2]) + "\n")
    settings_path(part).write_text(settings_path(one).read_text().replace('"max_new_tokens": 8', '"max_new_tokens": 9'))
    started = time.monotonic()
    proc = torchrun_datagen(*common, "--output", str(alone))
    assert proc.returncode != 0 and time.monotonic() - started < 25
    assert (f"[rank 0/2]: error: {part} is taken for the part file of a stopped torchrun run of dflash datagen on "
            "alone.jsonl, and it cannot be joined to it") in proc.stderr
    assert "(max_new_tokens 9, now 8)" in proc.stderr
    assert "[rank 1/2]: error: another process of this torchrun job stopped (its error is above)" in proc.stderr
    # one process resumes a stopped torchrun run too, and drops a settings file left without its part
    shutil.copy(settings_path(one), settings_path(part))
    orphan = settings_path(tmp_path / "alone.jsonl.part-1-of-2")
    shutil.copy(settings_path(one), orphan)
    result = run_datagen(DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(alone),
                                       max_new_tokens=8, batch_size=2, device="cpu"))
    assert (result.written, result.held) == (3, 5) and not part.exists() and not orphan.exists()
    assert sorted(read(alone), key=lambda r: r["id"]) == [by_id[i] for i in range(5)]


def test_a_world_size_without_torchrun_is_named(prompts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert ("WORLD_SIZE is 2, but MASTER_ADDR, MASTER_PORT are not set: run several processes with torchrun"
            in capsys.readouterr().err)


def test_a_sharegpt_record_is_asked_as_its_messages_would_be():
    from dflash.training.datagen import prompt_messages

    both = {"question": "Q?", "conversations": [{"from": "human", "value": "Tell me a joke"}]}
    assert prompt_messages(both, "question") == [[{"role": "user", "content": "Q?"}]]  # a named field wins

    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Weng earns"},
                                  {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "And then?"}]}
    assert prompt_messages(sharegpt) == prompt_messages(SYSTEM_CHAT) == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weng earns"}],
        [{"role": "user", "content": "And then?"}]]


def test_runs_with_neighbouring_seeds_draw_independent_answers(tiny_pair, tmp_path):
    """Several sampled passes over the same prompts (seeds 0, 1, ...) are how a user gets more answers per prompt.
    With seed + id as each prompt's seed, prompt 0 of the pass seeded 1 drew what prompt 1 of the pass seeded 0
    drew, so two copies of a question got the same answer in both passes."""
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "How many clips?"}] * 4)

    def answers(seed: int) -> list[list[int]]:
        out = tmp_path / f"seed{seed}.jsonl"
        run_datagen(DatagenConfig(target=str(tiny_pair[0]), prompts=str(same), output=str(out), max_new_tokens=12,
                                  temperature=1.5, seed=seed, device="cpu"))
        return [r["response_ids"] for r in sorted(read(out), key=lambda r: r["id"])]

    first, second = answers(0), answers(1)
    assert answers(0) == first  # a seed still fixes the answers
    assert len({tuple(a) for a in first + second}) == 8  # eight draws of one question, all different


def test_rerun_resumes_without_duplicates_after_a_half_written_line(tiny_pair, prompts, tmp_path):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=6,
                           batch_size=2, limit=2, device="cpu")
    assert run_datagen(config).written == 2
    with out.open("a") as f:
        f.write('{"id": 2, "messages": [')  # interrupted mid-line
    config.limit = None
    assert run_datagen(config).written == 3
    ids = [r["id"] for r in read(out)]
    assert sorted(ids) == [0, 1, 2, 3, 4] and len(ids) == len(set(ids))
    assert run_datagen(config).written == 0


def test_a_second_run_on_an_output_being_written_is_refused_before_it_reads_it(tiny_pair, prompts, tmp_path):
    """Two runs appending to one file would answer every prompt twice (and cut each other's half-written lines)."""
    pytest.importorskip("fcntl")
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                           limit=2, device="cpu")
    assert run_datagen(config).written == 2
    with out.open("a") as f:
        f.write('{"id": 2, "messages": [')  # the first run is writing its next record
        f.flush()
        with datagen._claim(out):  # ... and holds the file
            config.limit = None
            with pytest.raises(UserError, match=f"another dflash datagen is writing {re.escape(str(out))}; let it "
                                                "finish"):
                run_datagen(config)
            assert out.read_text().endswith('{"id": 2, "messages": [')  # its half-written line left alone
    assert run_datagen(config).written == 3  # once it is gone
    ids = [r["id"] for r in read(out)]
    assert sorted(ids) == [0, 1, 2, 3, 4]


def test_system_message_goes_with_the_first_user_turn_and_every_user_turn_is_answered():
    system, first, second = SYSTEM_CHAT["messages"][0], SYSTEM_CHAT["messages"][1], SYSTEM_CHAT["messages"][3]
    assert prompt_messages(SYSTEM_CHAT) == [[system, first], [second]]
    user_only = {"messages": [first, second]}
    assert prompt_messages(user_only) == [[first], [second]]


@pytest.mark.parametrize("line, message", [
    ("5", "is 5, not a JSON object"),
    ('{"messages": "hello"}', "`messages` must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', '`messages`[0] needs a string "role" and a string "content"'),
    ('{"messages": [{"role": "system", "content": "x"}]}', "has no user message to answer"),
    ('{"conversations": [{"from": "human", "value": " "}]}', "message 0 of the conversation is an empty user message"),
    ('{"turns": []}', "`turns` must be a non-empty list of non-empty strings"),
    ('{"turns": "a string"}', "`turns` must be a list of strings, e.g."),
    ('{"prompt": "ok", "turns": 3}', "`turns` must be a non-empty list"),
    ('{"prompt": 5}', "`prompt` must be a non-empty string"),
    ('{"answer": "42"}', "cannot find a prompt"),
    ('{"prompt": ', "is not valid JSON"),
    ('{"prompt": ' + "[" * 100000, "is nested too deeply to read"),
])
def test_bad_prompt_records_are_named_with_their_line_before_anything_runs(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(UserError, match=f"prompts.jsonl:3.*{re.escape(message)}"):
        read_prompts(config_for(str(path)))


def test_every_bad_prompt_record_is_listed_at_once(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": "a"}, {"prompt": "fine"}, {"turns": []}])
    with pytest.raises(UserError, match=r"(?s)2 prompt records cannot be used.*prompts.jsonl:1: .*prompts.jsonl:3: "):
        read_prompts(config_for(str(path)))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match="prompts.jsonl:1 is not UTF-8"):
        read_prompts(config_for(str(path)))


def test_prompts_too_long_for_the_context_are_skipped_by_name_and_answers_stop_at_its_end(tiny_pair, tmp_path,
                                                                                         capsys):
    target = variant(tiny_pair, tmp_path, context=48)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "How many clips?"}, {"prompt": "Natalia sold clips to 48 of her friends in April " * 4},
        {"turns": ["Weng earns", "And then?", "More?"]}])
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=target, prompts=str(prompts), output=str(out), max_new_tokens=500, device="cpu")
    result = run_datagen(config)
    assert result.written == 2 and len(result.skipped) == 1 and result.cut == 1
    err = capsys.readouterr().err
    assert "prompts.jsonl:2 (output id 1)" in err and "context of 48 tokens" in err
    assert "prompts.jsonl:3 (output id 2): turn 2 of 3" in err  # a later turn that no longer fits ends the conversation
    records = {r["id"]: r for r in read(out)}
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records.values()]
    assert max(lengths) == 48  # an answer cut by the context fills it, as plain decoding would
    assert all(r["finish_reason"] == "length" or len(r["response_ids"]) < 500 for r in records.values())
    assert [m["role"] for m in records[2]["messages"]] == ["user", "assistant"]
    assert run_datagen(config).written == 0  # the rerun skips it again and generates nothing
    assert "prompts.jsonl:2 (output id 1)" in capsys.readouterr().err


def test_a_prompt_the_target_gives_no_token_has_no_record_and_the_others_are_kept(tiny_pair, prompts, tmp_path,
                                                                                  capsys, monkeypatch):
    """One prompt's NaN logits (a float16 overflow on its text) failed its whole batch, and the run: a rerun met
    the same prompt again, so no run could finish. Now that prompt is named and left out, and its batch's others
    are written."""
    from dflash.decoding.engine import SpeculativeEngine

    original = SpeculativeEngine.generate

    def generate(self, prompt_ids, config=None):  # the turns that hold "And then?" get no token, as NaN logits give
        outputs = original(self, prompt_ids, config)
        for ids, out in zip(prompt_ids, outputs):
            if "And then?" in self.target.tokenizer.decode(ids):
                out.finish_reason, out.error = "error", "the model's logits are NaN"
        return outputs

    monkeypatch.setattr(SpeculativeEngine, "generate", generate)
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=8,
                           batch_size=5, device="cpu")
    result = run_datagen(config)
    assert (result.written, result.failed) == (3, 2)
    assert sorted(r["id"] for r in read(out)) == [0, 2, 3]
    err = capsys.readouterr().err
    assert "prompts.jsonl:2 (output id 1): turn 2 of 2 got no answer, the model's logits are NaN" in err
    assert "(output id 4)" in err
    assert main(["datagen", "--target", str(tiny_pair[0]), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "8", "--batch-size", "5", "--device", "cpu"]) == 0
    assert "2 failed: the target gave no token" in capsys.readouterr().out
    monkeypatch.setattr(SpeculativeEngine, "generate", original)
    assert run_datagen(config).written == 2  # a rerun tries them again
    assert sorted(r["id"] for r in read(out)) == [0, 1, 2, 3, 4]


def test_a_target_without_chat_template_gets_plain_text(tiny_pair, tmp_path, capsys):
    target = variant(tiny_pair, tmp_path, chat_template=False)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "How many clips?"}])
    out = tmp_path / "data.jsonl"
    run_datagen(DatagenConfig(target=target, prompts=str(prompts), output=str(out), max_new_tokens=4, device="cpu"))
    assert "no chat template (a base model): prompts are sent as plain text" in capsys.readouterr().err
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(target)("How many clips?")["input_ids"]
    assert read(out)[0]["prompt_ids"] == plain
    with pytest.raises(UserError, match=r"enable_thinking \(--enable-thinking\) sets a chat template variable, and "
                                        "this target's tokenizer has no chat template"):  # as generate refuses it
        run_datagen(DatagenConfig(target=target, prompts=str(prompts), output=str(tmp_path / "thinking.jsonl"),
                                  max_new_tokens=4, device="cpu", enable_thinking=True))
    assert not (tmp_path / "thinking.jsonl").exists() and not settings_path(tmp_path / "thinking.jsonl").exists()


@pytest.fixture
def answered(tiny_pair, prompts, tmp_path):
    """An output with the first two prompts answered, and the config that made it."""
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                           limit=2, device="cpu")
    run_datagen(config)
    return config


def test_an_output_of_an_older_version_resumes_from_the_command_line(answered, tmp_path, capsys):
    """Settings files from before `dtype` was one of the settings lack it, and one made greedily with --top-p (then
    saved and ignored, now refused at temperature 0) holds a top_p and seed that greedy answers never used: the
    command line's defaults (--dtype auto, --top-p 1, --seed 0) resume both."""
    out = tmp_path / "data.jsonl"
    settings = json.loads(settings_path(out).read_text())
    del settings["dtype"]
    settings.update(top_p=0.9, seed=5)
    settings_path(out).write_text(json.dumps(settings))
    command = ["datagen", "--target", answered.target, "--prompts", answered.prompts, "--output", str(out),
               "--max-new-tokens", "4", "--device", "cpu"]
    assert main(command + ["--limit", "3"]) == 0
    assert len(read(out)) == 3
    assert main(command + ["--limit", "1"]) == 0  # a lower limit: what the file holds is said, not just the prompts
    assert capsys.readouterr().out.splitlines()[-1].endswith("(1 prompt in all; it holds 3)")


def test_a_rerun_with_other_prompts_or_settings_is_refused(answered, prompts, tmp_path):
    rows = read(prompts)
    reordered = write_jsonl(tmp_path / "reordered.jsonl", [rows[1], rows[0]] + rows[2:])
    before = (tmp_path / "data.jsonl").read_bytes()
    with pytest.raises(UserError, match="answer \\(id 0\\) to another prompt than .*reordered.jsonl:1"):
        run_datagen(DatagenConfig(**{**vars(answered), "prompts": str(reordered)}))
    with pytest.raises(UserError, match="other settings \\(temperature 0.0, now 0.7; seed 0, now 3\\)"):
        run_datagen(DatagenConfig(**{**vars(answered), "temperature": 0.7, "seed": 3}))
    with pytest.raises(UserError, match="other settings \\(chat_template_kwargs None, now \\{'enable_thinking': False"):
        run_datagen(DatagenConfig(**{**vars(answered), "enable_thinking": False}))
    with pytest.raises(UserError, match="other settings \\(dtype auto \\(the checkpoint's own\\), now 'bfloat16'\\)"):
        run_datagen(DatagenConfig(**{**vars(answered), "dtype": "bfloat16"}))
    with pytest.raises(UserError, match="answer to prompt 1, but there are only 1 prompts"):
        run_datagen(DatagenConfig(**{**vars(answered), "prompts": str(write_jsonl(tmp_path / "one.jsonl", rows[:1])),
                                     "limit": None}))
    assert (tmp_path / "data.jsonl").read_bytes() == before


def test_an_output_of_an_older_version_resumes_with_a_warning(answered, capsys, tmp_path):
    out = tmp_path / "data.jsonl"
    old = [{k: v for k, v in r.items() if k != "prompt_hash"} for r in read(out)]
    write_jsonl(out, old)
    settings_path(out).unlink()
    assert run_datagen(DatagenConfig(**{**vars(answered), "limit": 3})).written == 1
    assert "has no data.jsonl.datagen.json" in capsys.readouterr().err
    assert settings_path(out).exists()


@pytest.mark.parametrize("content", [b'{"prompt": "mine"}\n', b'{"prompt": "mine, no newline"}', b"notes\n",
                                     b"\xff\xfe\n", b"[" * 100000 + b"\n",
                                     b'{"id": 7, "prompt": "my only copy, no newline"}'])  # whole: not half-written
def test_an_output_that_is_not_datagen_output_is_refused_and_left_alone(tiny_pair, prompts, tmp_path, content):
    out = tmp_path / "notes.jsonl"
    out.write_bytes(content)
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), device="cpu")
    with pytest.raises(UserError, match="is not dflash datagen output"):
        run_datagen(config)
    assert out.read_bytes() == content


def test_a_broken_line_before_the_last_is_an_error_naming_it(answered, tmp_path):
    out = tmp_path / "data.jsonl"
    lines = out.read_text().splitlines(True)
    out.write_text(lines[0][:30] + "\n" + lines[1])
    with pytest.raises(UserError, match="data.jsonl:1 is a broken record; only the last line can be half-written"):
        done_ids(out)
    assert out.read_text() == lines[0][:30] + "\n" + lines[1]


def test_a_foreign_line_among_records_is_named(answered, tmp_path):
    out = tmp_path / "data.jsonl"
    lines = out.read_text().splitlines(True)
    out.write_text(lines[0] + "# a note\n" + "".join(lines[1:]))
    with pytest.raises(UserError, match="data.jsonl:2 is not a dflash datagen record, but the file's other lines "
                                        "are: remove line 2"):
        done_ids(out)


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size is the number of prompts decoded together, >= 1; got 0"),
    (["--batch-size", "-1"], "got -1"),
    (["--limit", "0"], "--limit must be >= 1 (leave it out for every prompt), got 0"),
    (["--limit", "-2"], "got -2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "0.9"], "--top-p shapes sampling, and --temperature 0 (the default) decodes greedily"),
    (["--seed", "3"], "--seed shapes sampling, and --temperature 0 (the default) decodes greedily"),  # was ignored
    (["--device", "bogus"], "unknown device 'bogus'"),  # before the output and its settings file exist
])
def test_datagen_cli_refuses_bad_numbers_without_a_traceback(prompts, tmp_path, capsys, flags, message):
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.datagen.json").exists()


def test_a_missing_target_is_named_before_any_progress_bar_or_output(prompts, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert main(["datagen", "--target", str(tmp_path / "llamaa"), "--prompts", str(prompts), "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path / 'llamaa'} does not exist" in captured.err
    assert "datagen" not in captured.out.replace("dflash datagen", "") and not out.exists()


def test_a_refused_rerun_draws_no_progress_bar(answered, capsys):
    """The bar starts once the output and its settings are checked: a refusal was preceded by an empty one."""
    args = ["datagen", "--target", answered.target, "--prompts", answered.prompts, "--output", answered.output,
            "--device", "cpu"]
    assert main(args + ["--max-new-tokens", "8"]) == 2
    captured = capsys.readouterr()
    assert "was generated with other settings" in captured.err and "datagen" not in captured.out
    assert main(args + ["--max-new-tokens", "4", "--limit", "3"]) == 0
    assert "datagen" in capsys.readouterr().out.replace("dflash datagen", "")  # the bar, once it runs


def test_datagen_cli_refuses_writing_over_its_prompts(prompts, capsys):
    assert main(["datagen", "--prompts", str(prompts), "--output", str(prompts)]) == 2
    assert "is the --prompts file" in capsys.readouterr().err


def test_records_without_a_prompt_are_refused():
    with pytest.raises(UserError, match="cannot find a prompt"):
        prompt_messages({"answer": "42"})


def config_for(prompts, **kwargs):
    return DatagenConfig(target=None, prompts=prompts, output="unused.jsonl", **kwargs)


@pytest.fixture
def hub_answers(monkeypatch):
    """The hub answers for every dataset (what `datasets.load_dataset` then does is each test's own)."""
    monkeypatch.setattr(hub, "unreachable", lambda *args, **kwargs: None)


def test_hub_names_go_to_the_hub_with_their_subset_and_split(monkeypatch, hub_answers):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"question": "q1"}, {"question": "q2"}, {"question": "q3"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = read_prompts(config_for("openai/gsm8k", subset="main", split="test", limit=2))
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [p.turns for p in rows] == [[[{"role": "user", "content": q}]] for q in ("q1", "q2")]
    assert rows[1].where == "openai/gsm8k row 1"


def test_a_local_dataset_directory_is_read_with_datasets(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "train.jsonl").write_text('{"question": "a?"}\n{"question": "b?"}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "t?"}\n')
    assert [p.turns[0][0]["content"] for p in read_prompts(config_for(str(tmp_path), split="test"))] == ["t?"]
    assert [p.turns[0][0]["content"] for p in read_prompts(config_for(str(tmp_path)))] == ["a?", "b?"]
    with pytest.raises(UserError, match=r"Unknown split \"dev\".+\(pick one of its splits with --split\)"):
        read_prompts(config_for(str(tmp_path), split="dev"))


def test_a_parquet_or_csv_file_of_prompts_is_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"question": "a?"}, {"question": "b?"}])
    rows.to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    rows.to_csv(str(tmp_path / "prompts.csv"), index=False)
    for name in ("train-00000-of-00001.parquet", "prompts.csv"):
        read = read_prompts(config_for(str(tmp_path / name)))
        assert [p.turns[0][0]["content"] for p in read] == ["a?", "b?"] and read[1].where.endswith(f"{name} row 1")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match=r"could not read --prompts .+broken.parquet as a .parquet file"):
        read_prompts(config_for(str(tmp_path / "broken.parquet")))
    (tmp_path / "header.csv").write_text("question\n")  # was `Instruction "train" corresponds to no data!`
    with pytest.raises(UserError, match=r"header.csv has no records; give a file with one prompt per row"):
        read_prompts(config_for(str(tmp_path / "header.csv")))


def test_a_dataset_saved_with_save_to_disk_is_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"question": "a?"}, {"question": "b?"}])
    rows.save_to_disk(str(tmp_path / "one"))
    assert [p.turns[0][0]["content"] for p in read_prompts(config_for(str(tmp_path / "one")))] == ["a?", "b?"]
    datasets.DatasetDict(train=rows, test=rows.select([1])).save_to_disk(str(tmp_path / "both"))
    assert [p.turns[0][0]["content"] for p in read_prompts(config_for(str(tmp_path / "both"), split="test"))] == ["b?"]
    with pytest.raises(UserError, match=r"holds the splits train, test, not 'dev'; pick one with --split"):
        read_prompts(config_for(str(tmp_path / "both"), split="dev"))


def test_a_saved_single_split_is_read_whole_and_split_or_subset_flags_that_it_cannot_honour_are_refused(tmp_path):
    """--split on a saved Dataset was not checked (the saved test split read as 'train'), and --subset was ignored."""
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"question": "a?"}, {"question": "b?"}], split="test")
    rows.save_to_disk(str(tmp_path / "test-only"))
    where = str(tmp_path / "test-only")
    for split in (None, "test"):
        assert [p.turns[0][0]["content"] for p in read_prompts(config_for(where, split=split))] == ["a?", "b?"]
    with pytest.raises(UserError, match=r"test-only holds one split, 'test', saved alone, not 'train': drop --split"):
        read_prompts(config_for(where, split="train"))
    with pytest.raises(UserError, match=r"--subset picks a configuration of a hub dataset, and --prompts .*test-only "
                                        r"is a saved dataset, which holds one: drop --subset"):
        read_prompts(config_for(where, subset="main"))


@pytest.mark.parametrize("missing", ["prompts.jsonl", "./prompts", "data/2024/prompts", "~/nowhere.json", "nope.txt",
                                     "org/prompts.csv"])
def test_a_missing_file_is_named_and_not_looked_up_on_the_hub(missing, monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    assert not is_hub_id(missing)
    with pytest.raises(UserError, match=f"--prompts {re.escape(missing)}: there is no local file or directory"):
        read_prompts(config_for(missing))


@pytest.mark.parametrize("name", ["nope", "openai/gsm8k"])
def test_a_name_that_no_dataset_has_says_there_is_no_local_file_of_that_name_either(name, monkeypatch, tmp_path,
                                                                                   hub_answers):
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)

    def not_found(*args, **kwargs):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", not_found)
    assert is_hub_id(name) and is_hub_id("teknium/OpenHermes-2.5")  # a version is no file extension
    with pytest.raises(UserError, match=f"could not load dataset '{name}'.*there is no local file or directory named "
                                        f"'{name}' either"):
        read_prompts(config_for(name))


def test_an_unreachable_hub_dataset_says_what_to_pass_instead(monkeypatch, hub_answers):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="could not load dataset 'openai/gsm8k'.*Offline"):
        read_prompts(config_for("openai/gsm8k"))


def test_a_hub_dataset_when_the_hub_does_not_answer_is_a_clear_error_in_seconds(silent_hub):
    """`datasets` alone retries for half a minute; the hub is asked once, bounded, and then only the cache."""
    datasets = pytest.importorskip("datasets")
    offline_before = datasets.config.HF_HUB_OFFLINE
    start = time.monotonic()
    with pytest.raises(UserError, match=r"could not load dataset 'dflash-tests/no-such-set', split 'train': the "
                                        r"Hugging Face hub is not reachable \(no answer in .* s, 0.5 s a try.*\), "
                                        r"and the local datasets cache could not serve it \(.*no-such-set.*Offline\? "
                                        "Pass a local JSONL file"):  # datasets' own reason: no copy, another split ...
        read_prompts(config_for("dflash-tests/no-such-set"))
    assert time.monotonic() - start < 15
    assert datasets.config.HF_HUB_OFFLINE == offline_before


def test_a_dataset_the_hub_refuses_is_named_or_read_from_the_local_cache(empty_hub, monkeypatch):
    """The hub's refusal is the error, and `datasets` is asked for its local cache alone (no retries of the hub):
    a copy there serves, with a warning (a token the hub no longer takes, a dataset it no longer has)."""
    datasets = pytest.importorskip("datasets")
    cached: list[dict] = []

    def load_dataset(*args, **kwargs):
        assert datasets.config.HF_HUB_OFFLINE, "asked the hub again"
        if not cached:
            raise FileNotFoundError("not in the cache")
        return cached

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(UserError, match="^--prompts dflash-tests/no-such-set is neither a local path nor a dataset on "
                                        "the Hugging Face hub .*, or pass a local JSONL file$"):
        read_prompts(config_for("dflash-tests/no-such-set"))
    cached.append({"question": "How many clips?"})
    with pytest.warns(DFlashWarning, match="Using the local cache's copy of dflash-tests/no-such-set"):
        prompts = read_prompts(config_for("dflash-tests/no-such-set"))
    assert "How many clips?" in repr(prompts[0]) and len(prompts) == 1


def test_thinking_off_reaches_the_chat_template(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    target = variant(tiny_pair, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not "
                               "enable_thinking %} <think></think>{% endif %}{% endif %}")
    tokenizer.save_pretrained(target)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "How many clips?"}])
    lengths = {}
    for name, options in (("default", {}), ("off", {"enable_thinking": False}),
                          ("kwargs", {"chat_template_kwargs": {"enable_thinking": False}})):
        out = tmp_path / f"data_{name}.jsonl"
        run_datagen(DatagenConfig(target=target, prompts=str(prompts), output=str(out), max_new_tokens=2,
                                  device="cpu", **options))
        lengths[name] = len(read(out)[0]["prompt_ids"])
        recorded = json.loads(datagen.settings_path(out).read_text())["chat_template_kwargs"]
        assert recorded == (None if name == "default" else {"enable_thinking": False})
    assert lengths["off"] == lengths["kwargs"] > lengths["default"]


@pytest.mark.parametrize("output, message", [
    ("a_file/o.jsonl", "a_file is a file, not a directory"),
    ("o.jsonl", "cannot write --output"),  # its settings file cannot be written: not named, it is no flag
])
def test_an_output_that_cannot_be_written_names_the_flag(prompts, tmp_path, capsys, monkeypatch, output, message):
    import dflash.api

    monkeypatch.setattr(dflash.api.DFlash, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded"))
    (tmp_path / "a_file").write_text("")
    (tmp_path / "o.jsonl.datagen.json.tmp").mkdir()  # where the settings file is written first
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / output)]) == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / output}" in err and message in err and ".tmp" not in err


def test_a_stopped_run_is_recorded_as_not_finished_until_a_rerun_finishes_it(tiny_pair, prompts, tmp_path,
                                                                             monkeypatch):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                           batch_size=2, device="cpu")
    answer, calls = datagen.Generator.answer, []

    def stopping_answer(self, *args, **kwargs):  # Ctrl-C after the first batch's records
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        yield from answer(self, *args, **kwargs)

    monkeypatch.setattr(datagen.Generator, "answer", stopping_answer)
    with pytest.raises(KeyboardInterrupt):
        run_datagen(config)
    assert 0 < len(read(out)) < 5 and json.loads(settings_path(out).read_text())["finished"] is False
    monkeypatch.undo()
    assert run_datagen(config).held == 5
    assert json.loads(settings_path(out).read_text())["finished"] is True


def test_ctrl_c_says_how_to_resume(prompts, tmp_path, capsys, monkeypatch):
    import dflash.cli.datagen

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.cli.datagen, "run_datagen", interrupted)
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    # under torchrun the answers are in the processes' part files, and the job says so once, not once per process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    for rank, told in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]) == 130
        err = capsys.readouterr().err
        assert ("the answers written are kept in o.jsonl.part-*-of-2 beside" in err) is told, err
        assert "the answers written to" not in err


def test_a_chat_template_that_refuses_a_later_turn_names_the_record_and_keeps_earlier_answers(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    target = variant(tiny_pair, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['content'] == 'refuse me' %}{{ raise_exception("
                               "'I refuse') }}{% endif %}{% endfor %}" + tokenizer.chat_template)
    tokenizer.save_pretrained(target)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "How many clips?"},
                                                       {"turns": ["Weng earns", "refuse me"]}])
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=target, prompts=str(prompts), output=str(out), max_new_tokens=2, batch_size=1,
                           device="cpu")
    with pytest.raises(UserError, match=re.escape("prompts.jsonl:2 (output id 1): the model's chat template refused "
                                                  "these messages: I refuse")):
        run_datagen(config)
    assert [r["id"] for r in read(out)] == [0]


def test_a_gzip_output_name_is_refused_before_anything_is_written(prompts, tmp_path):
    with pytest.raises(UserError, match=r"dflash datagen writes plain JSONL .*name it \*\.jsonl"):
        DatagenConfig(target=None, prompts=str(prompts), output=str(tmp_path / "answers.jsonl.gz")).validate()
    assert not (tmp_path / "answers.jsonl.gz").exists()


def test_a_prompt_field_the_record_lacks_is_named_with_the_fields_it_has(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "How many clips?", "id": 3}])
    with pytest.raises(UserError, match=r"--prompt-field bar: the record has no such field \(its fields: id, "
                                        r"prompt\)"):
        read_prompts(DatagenConfig(target=None, prompts=str(path), output=str(tmp_path / "o.jsonl"),
                                   prompt_field="bar"))


def test_a_guessed_prompt_field_is_named_and_an_alpaca_input_follows_its_instruction(tmp_path, capsys):
    """An Alpaca record's `input` (the text its instruction is about) was dropped without a word: the target was
    asked only 'Summarize the following text.'."""
    records = [{"instruction": "Summarize the following text.", "input": "The cat sat on the mat all day."},
               {"instruction": "Name a colour.", "input": ""}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", records)
    prompts = read_prompts(DatagenConfig(target=None, prompts=str(path), output=str(tmp_path / "o.jsonl")))
    assert [p.turns[0][-1]["content"] for p in prompts] == [
        "Summarize the following text.\n\nThe cat sat on the mat all day.", "Name a colour."]
    assert ("the prompts are read from the records' `instruction` (with `input` after it, as in Alpaca) field "
            "(--prompt-field names another)") in capsys.readouterr().err
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "How many clips?"}, {"prompt": "Hi"}])
    read_prompts(DatagenConfig(target=None, prompts=str(path), output=str(tmp_path / "o.jsonl")))
    assert "read from the records' `question` field" in capsys.readouterr().err
    for documented in ({"prompt": "Hi"}, {"turns": ["Hi", "And?"]}, {"messages": [{"role": "user", "content": "Hi"}]}):
        read_prompts(DatagenConfig(target=None, prompts=str(write_jsonl(tmp_path / "d.jsonl", [documented])),
                                   output=str(tmp_path / "o.jsonl")))
        assert capsys.readouterr().err == ""
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "How many clips?"}])
    read_prompts(DatagenConfig(target=None, prompts=str(path), output=str(tmp_path / "o.jsonl"),
                               prompt_field="question"))
    assert capsys.readouterr().err == ""


def test_a_local_dataset_directory_that_fails_does_not_blame_the_network(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def no_such_split(*args, **kwargs):
        raise ValueError('Unknown split "test". Should be one of [\'train\'].')

    monkeypatch.setattr(datasets, "load_dataset", no_such_split)
    (tmp_path / "dsdir").mkdir()
    with pytest.raises(UserError) as err:
        read_prompts(DatagenConfig(target=None, prompts=str(tmp_path / "dsdir"), output=str(tmp_path / "o.jsonl"),
                                   split="test"))
    assert 'Unknown split "test". Should be one of [\'train\']' in str(err.value)
    assert "Offline" not in str(err.value)


def test_an_output_in_a_missing_folder_is_created(tiny_pair, prompts, tmp_path):
    out = tmp_path / "new" / "sub" / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                           limit=1, device="cpu")
    assert run_datagen(config).written == 1 and len(read(out)) == 1


def test_a_full_disk_keeps_the_answers_written_and_says_a_rerun_continues(tiny_pair, prompts, tmp_path, monkeypatch):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                           batch_size=1, device="cpu")
    real_dumps, written = json.dumps, []

    def full_after_two(record, *args, **kwargs):
        if isinstance(record, dict) and "response_ids" in record:
            if len(written) == 2:
                raise OSError(28, "No space left on device")
            written.append(record)
        return real_dumps(record, *args, **kwargs)

    monkeypatch.setattr(datagen.json, "dumps", full_after_two)
    with pytest.raises(UserError, match=r"could not write to .*data.jsonl \(OSError: \[Errno 28\] No space left "
                                        r"on device\); the 2 answers written this run are kept: free some space"):
        run_datagen(config)
    monkeypatch.undo()
    assert len(read(out)) == 2
    assert run_datagen(config).written == 3 and len(read(out)) == 5


def test_warnings_of_a_kind_are_named_up_to_the_cap_then_counted(capsys, monkeypatch):
    monkeypatch.setattr(datagen, "MAX_WARNINGS", 2)
    for count in range(1, 6):
        datagen.warn_capped(count, f"conversation {count} ends early", "more conversations end early")
    err = capsys.readouterr().err
    assert "conversation 2 ends early" in err and "conversation 3" not in err
    assert err.count("more conversations end early") == 1


@pytest.mark.parametrize("room", [4, 40])  # bytes left: within the record's opening, or past it
def test_a_write_the_file_size_limit_stops_is_named_and_a_rerun_continues(answered, tmp_path, room):
    """A real short write (the process's file size limit, as a full disk): the run's message survives the close
    that flushes the refused bytes again, and the rerun cuts the half-written line, however short."""
    import subprocess
    import sys

    out = tmp_path / "data.jsonl"
    limit = out.stat().st_size + room
    script = (f"import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
              "from dflash.cli.main import main; sys.exit(main(sys.argv[1:]))")
    command = ["datagen", "--target", answered.target, "--prompts", answered.prompts, "--output", str(out),
               "--max-new-tokens", "4", "--limit", "3", "--device", "cpu"]
    run = subprocess.run([sys.executable, "-c", script, *command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "the 0 answers written this run are kept: free some space and rerun" in run.stderr
    assert "Traceback" not in run.stderr and out.stat().st_size == limit  # a half-written line at the end
    assert main(command) == 0
    assert [r["id"] for r in read(out)] == [0, 1, 2]


@pytest.mark.parametrize("content", [b"user sidecar data\n", b'{"notes": "mine"}\n', b"[1, 2]\n", b"\xff\xfe\n"])
def test_a_file_where_the_settings_go_that_datagen_did_not_write_is_refused_and_kept(prompts, tmp_path, capsys,
                                                                                   monkeypatch, content):
    import dflash.api

    monkeypatch.setattr(dflash.api.DFlash, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded"))
    out = tmp_path / "new.jsonl"
    settings_path(out).write_bytes(content)
    assert main(["datagen", "--prompts", str(prompts), "--output", str(out)]) == 2
    assert (f"{settings_path(out)} is not a dflash datagen settings file; dflash datagen keeps the settings of "
            f"--output {out} there: move that file elsewhere, or pass another --output") in capsys.readouterr().err
    assert settings_path(out).read_bytes() == content and not out.exists()


@pytest.mark.parametrize("settings", [dict(max_new_tokens=8), dict(temperature=0.5, dtype="float16"), "old"])
def test_a_run_stopped_before_its_first_record_is_rerun_with_any_settings(tiny_pair, prompts, tmp_path, settings):
    """Killed before its first answer, a run leaves an empty output and its settings file: no answer depends on
    those settings, so a rerun (with them or others, or of a version whose file lacked some) writes its own."""
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=2,
                           limit=1, device="cpu")
    saved = config.settings()
    if settings == "old":  # before chat_template_kwargs and dtype were settings
        del saved["chat_template_kwargs"], saved["dtype"]
    else:
        saved.update(settings)
    out.write_text("")
    settings_path(out).write_text(json.dumps(saved))
    assert run_datagen(config).written == 1
    assert json.loads(settings_path(out).read_text()) == {**config.settings(), "finished": True}


@pytest.mark.parametrize("flags, message", [
    (["--output", "/dev/null"], "--output /dev/null is not a regular file (a device or a pipe); give the path of a "
                                ".jsonl file"),
    (["--output", "FIFO"], "is not a regular file (a device or a pipe)"),
    (["--prompt-suffix", "\udcff"], "--prompt-suffix is not valid text: character 0 ('\\udcff') stands for a byte "
                                    "that was not UTF-8; pass UTF-8 text"),
    (["--prompt-suffix", " Answer: \udcff"], "--prompt-suffix is not valid text: character 9"),
    (["--output", ""], "--output is empty; give the path of the .jsonl file to write the answers to"),
    (["--prompts", ""], "--prompts is empty; give a JSONL file, a dataset directory or a Hugging Face dataset name"),
    (["--split", "test"], "--split picks part of a dataset (a hub dataset or a dataset directory), and --prompts"),
    (["--split", "train", "--subset", "main"], "--split and --subset pick part of a dataset"),
])
def test_datagen_cli_refuses_bad_flags_before_the_model_loads(prompts, tmp_path, capsys, monkeypatch, flags, message):
    import os

    import dflash.api

    monkeypatch.setattr(dflash.api.DFlash, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded"))
    os.mkfifo(tmp_path / "fifo")
    flags = [str(tmp_path / "fifo") if flag == "FIFO" else flag for flag in flags]
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.datagen.json").exists()
    assert not list(tmp_path.glob("fifo.*"))


def test_a_prompt_that_leaves_room_for_one_token_gets_a_one_token_answer(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    from dflash.chat import as_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    question = [{"role": "user", "content": "How many clips?"}]
    length = len(as_ids(tokenizer.apply_chat_template(question, add_generation_prompt=True)))
    target = variant(tiny_pair, tmp_path, context=length + 1)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "How many clips?"}])
    out = tmp_path / "data.jsonl"
    result = run_datagen(DatagenConfig(target=target, prompts=str(prompts), output=str(out), max_new_tokens=8,
                                       device="cpu"))
    assert result.written == 1 and not result.skipped
    [record] = read(out)
    assert len(record["prompt_ids"]) == length and len(record["response_ids"]) == 1


def test_sampling_options_reach_every_answer(prompts, tiny_pair, tmp_path, monkeypatch):
    from dflash.decoding.engine import SpeculativeEngine

    seen, original = [], SpeculativeEngine.generate

    def generate(self, prompt_ids, configs=None):  # a config per prompt (each its own seed)
        seen.extend((c.temperature, c.top_p) for c in configs)
        return original(self, prompt_ids, configs)

    monkeypatch.setattr(SpeculativeEngine, "generate", generate)
    run_datagen(DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(tmp_path / "o.jsonl"),
                              max_new_tokens=4, temperature=0.8, top_p=0.5, seed=3, device="cpu"))
    assert seen and set(seen) == {(0.8, 0.5)}


def test_empty_flags_and_an_output_inside_the_prompts_directory_are_refused(tmp_path):
    """--target '' loaded '.', named as a path the user never gave; an output inside a dataset directory was read
    back as part of the dataset, and the rerun failed with a datasets error that said nothing of it."""
    from dflash.training.datagen import DatagenConfig

    prompts = tmp_path / "ds"
    prompts.mkdir()
    (prompts / "train.jsonl").write_text('{"prompt": "hi"}\n')
    output = str(tmp_path / "out.jsonl")
    for flag in ("target", "prompt_field", "device", "split"):
        with pytest.raises(UserError, match=f"^--{flag.replace('_', '-')} is empty; give a value or leave the flag"):
            DatagenConfig(**{"target": None, "prompts": str(prompts), "output": output, flag: ""}).validate()
    with pytest.raises(UserError, match="lies inside the --prompts directory .*, which is read as a dataset"):
        DatagenConfig(target=None, prompts=str(prompts), output=str(prompts / "out.jsonl")).validate()
    assert not (prompts / "out.jsonl").exists()
