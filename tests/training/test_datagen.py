import json

import pytest

from dflash.errors import UserError
from dflash.training.datagen import DatagenConfig, prompt_messages, run_datagen


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
