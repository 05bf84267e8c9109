import json

import pytest

from dflash.errors import UserError
from dflash.training.datagen import DatagenConfig, is_hub_id, prompt_messages, read_prompts, run_datagen


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "How many clips?"}, {"turns": ["Weng earns", "And then?"]},
            {"messages": [{"role": "user", "content": "Natalia sold"}]}, {"question": "How much did she earn?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generates_all_turns_with_the_target_own_answers(tiny_pair, prompts, tmp_path):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=8,
                           batch_size=3, device="cpu")
    assert run_datagen(config) == 4
    records = read(out)
    assert sorted(r["id"] for r in records) == [0, 1, 2, 3]
    two_turns = next(r for r in records if r["id"] == 1)
    assert [m["role"] for m in two_turns["messages"]] == ["user", "assistant", "user", "assistant"]
    for r in records:
        assert 1 <= len(r["response_ids"]) <= 8 and r["prompt_ids"]


def test_rerun_resumes_without_duplicates_after_a_half_written_line(tiny_pair, prompts, tmp_path):
    out = tmp_path / "data.jsonl"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=6,
                           batch_size=2, limit=2, device="cpu")
    assert run_datagen(config) == 2
    with out.open("a") as f:
        f.write('{"id": 2, "messages": [')  # interrupted mid-line
    config.limit = None
    assert run_datagen(config) == 2
    ids = [r["id"] for r in read(out)]
    assert sorted(ids) == [0, 1, 2, 3] and len(ids) == len(set(ids))
    assert run_datagen(config) == 0


def test_records_without_a_prompt_are_refused():
    with pytest.raises(UserError, match="cannot find a prompt"):
        prompt_messages({"answer": "42"})


def config_for(prompts, **kwargs):
    return DatagenConfig(target=None, prompts=prompts, output="unused.jsonl", **kwargs)


def test_hub_names_go_to_the_hub_with_their_subset_and_split(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"question": "q1"}, {"question": "q2"}, {"question": "q3"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = read_prompts(config_for("openai/gsm8k", subset="main", split="test", limit=2))
    assert calls == [("openai/gsm8k", "main", "test")]
    assert rows == [{"question": "q1"}, {"question": "q2"}]


def test_a_local_dataset_directory_is_read_with_datasets(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "train.jsonl").write_text('{"question": "a?"}\n{"question": "b?"}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "t?"}\n')
    assert [r["question"] for r in read_prompts(config_for(str(tmp_path), split="test"))] == ["t?"]
    assert [r["question"] for r in read_prompts(config_for(str(tmp_path)))] == ["a?", "b?"]


@pytest.mark.parametrize("missing", ["prompts.jsonl", "./prompts", "data/2024/prompts", "~/nowhere.json"])
def test_a_missing_file_is_named_and_not_looked_up_on_the_hub(missing, monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    assert not is_hub_id(missing)
    with pytest.raises(UserError, match="does not exist"):
        read_prompts(config_for(missing))


def test_an_unreachable_hub_dataset_says_what_to_pass_instead(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="could not load dataset 'openai/gsm8k'.*Offline"):
        read_prompts(config_for("openai/gsm8k"))
