"""scripts/embedded/pack_answers.py: the packed answer sets train on the same tokens as the full ones."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

from dflash.errors import UserError
from dflash.training.data import fingerprint, read_examples

SCRIPT = Path(__file__).parents[2] / "scripts" / "embedded" / "pack_answers.py"


@pytest.fixture(scope="module")
def pack():
    spec = importlib.util.spec_from_file_location("pack_answers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def answers(n: int, offset: int) -> list[dict]:
    return [{"id": i, "prompt_hash": "x", "finish_reason": "stop",
             "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
             "prompt_ids": [1, 5 + i, 6], "response_ids": [7 + offset, 8 + i, 9, 2]} for i in range(n)]


def test_packed_sets_hold_the_same_examples(pack, tmp_path):
    main = write(tmp_path / "main.jsonl", answers(5, 0))
    extra = write(tmp_path / "extra.jsonl", answers(3, 10))
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {main}\nextra_train_data:\n  - {extra}\noutput: {tmp_path / 'drafter'}\n")
    out = tmp_path / "gpu" / "answers.tgz"
    pack.pack(config, out)
    unpacked = tmp_path / "unpacked"
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["extra.jsonl", "main.jsonl"]
        tar.extractall(unpacked, filter="data")
    for original in (main, extra):
        packed = unpacked / original.name
        assert set(json.loads(packed.read_text().splitlines()[0])) == {"id", "prompt_ids", "response_ids"}
        assert (fingerprint(read_examples(packed, None, 64, 100).examples)
                == fingerprint(read_examples(original, None, 64, 100).examples))


def test_a_set_without_token_ids_is_refused_with_its_line_and_the_old_archive_kept(pack, tmp_path):
    records = answers(2, 0)
    del records[1]["response_ids"]
    path = write(tmp_path / "text.jsonl", records)
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {path}\noutput: {tmp_path / 'drafter'}\n")
    out = tmp_path / "answers.tgz"
    out.write_bytes(b"the archive of an earlier pack")
    with pytest.raises(UserError, match=r"text.jsonl:2 has no response_ids"):
        pack.pack(config, out)
    assert out.read_bytes() == b"the archive of an earlier pack"
