"""Regenerate responses with the target (REFERENCE section 4: the drafter learns the target's own text).

Each output line is one finished conversation, written whole and flushed; a rerun skips the prompts
already done and drops a half-written last line, so interrupted runs resume without duplicates.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflash.errors import UserError


@dataclass
class DatagenConfig:
    target: str | None
    prompts: str  # JSONL file, a dataset directory, or a Hugging Face dataset name ("org/name")
    output: str
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    limit: int | None = None
    split: str = "train"
    subset: str | None = None  # the dataset's configuration, e.g. "main" for openai/gsm8k
    prompt_field: str | None = None  # for hub datasets: the column with the prompt (default: guess)
    prompt_suffix: str = ""  # appended to every user turn (e.g. the benchmark's answer-format sentence)
    dtype: str | None = None
    device: str | None = None


def prompt_messages(record: dict, prompt_field: str | None = None) -> list[list[dict]]:
    """User turns of a record, as the successive conversations to answer (one per turn)."""
    if "messages" in record:
        messages = [m for m in record["messages"] if m.get("role") != "assistant"]
        if not messages:
            raise UserError("a `messages` record has no user turn")
        return [[m] for m in messages] if all(m.get("role") == "user" for m in messages) else [messages]
    if "turns" in record:
        return [[{"role": "user", "content": t}] for t in record["turns"]]
    for field in ([prompt_field] if prompt_field else ["prompt", "question", "instruction", "text"]):
        if field in record and isinstance(record[field], str):
            return [[{"role": "user", "content": record[field]}]]
    raise UserError(f"cannot find a prompt in record with fields {sorted(record)}; use `prompt`, `turns` or "
                    "`messages` (or --prompt-field for a dataset column)")


def read_prompts(config: DatagenConfig) -> list[dict]:
    path = Path(config.prompts).expanduser()
    if path.is_file():
        from dflash.training.data import read_jsonl

        records = read_jsonl(path)
    elif path.is_dir() or is_hub_id(config.prompts):
        records = _load_dataset(config, str(path) if path.is_dir() else config.prompts)
    else:
        raise UserError(f"prompt file {config.prompts} does not exist; give a JSONL file, a dataset directory or a "
                        "Hugging Face dataset name like openai/gsm8k")
    return records[: config.limit] if config.limit else records


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub dataset ("name" or "org/name") rather than a path to a local file."""
    if name.startswith((".", "/", "~")) or name.endswith((".jsonl", ".json")) or "\\" in name:
        return False
    parts = name.split("/")
    return len(parts) <= 2 and all(parts)


def _load_dataset(config: DatagenConfig, source: str) -> list[dict]:
    """Rows of a hub dataset or a local dataset directory (data files, or a `save_to_disk` copy)."""
    try:
        import datasets
    except ImportError:
        raise UserError("reading a dataset needs `pip install datasets`; or pass a JSONL file") from None
    try:
        return list(datasets.load_dataset(source, config.subset, split=config.split))
    except Exception as err:
        hint = (" (does it need --subset, e.g. --subset main for openai/gsm8k?)"
                if "config" in str(err).lower() and config.subset is None else "")
        raise UserError(f"could not load dataset {source!r}, split {config.split!r}: {type(err).__name__}: "
                        f"{str(err).splitlines()[0][:200] if str(err) else ''}{hint}. Offline? Pass a local JSONL "
                        "file with `prompt`, `turns` or `messages`, or a downloaded dataset directory") from None


def done_ids(output: Path) -> set[int]:
    """Ids already written; a half-written last line (interrupted run) is cut off first."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        with output.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    return {json.loads(line)["id"] for line in data.decode().splitlines() if line.strip()}


def run_datagen(config: DatagenConfig, progress=None, records: list[dict] | None = None) -> int:
    """Generate what is missing from `output`; returns how many records were written. `records`: the prompts
    when the caller has read them already (`read_prompts`)."""
    from dflash.api import DFlash

    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    records = read_prompts(config) if records is None else records
    done = done_ids(output)
    todo = [(i, r) for i, r in enumerate(records) if i not in done]
    if not todo:
        return 0
    pipe = DFlash.from_pretrained(config.target, no_draft=True, dtype=config.dtype, device=config.device)
    written = 0
    with output.open("a") as f:
        for chunk in _chunks(todo, config.batch_size):
            for record in _generate_chunk(pipe, chunk, config):
                f.write(json.dumps(record) + "\n")
                f.flush()
                written += 1
            if progress:
                progress(len(chunk))
        os.fsync(f.fileno())
    return written


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start: start + size]


def _generate_chunk(pipe, chunk: list[tuple[int, dict]], config: DatagenConfig) -> list[dict]:
    """Answer every turn of every record in the chunk; a turn sees the target's own earlier answers."""
    conversations = {i: [] for i, _ in chunk}
    turns = {i: prompt_messages(r, config.prompt_field) for i, r in chunk}
    last: dict[int, tuple[list[int], list[int], str]] = {}
    for turn in range(max(len(t) for t in turns.values())):
        active = [i for i in conversations if turn < len(turns[i])]
        for i in active:
            new = [dict(m) for m in turns[i][turn]]
            if config.prompt_suffix and new[-1]["role"] == "user":
                new[-1]["content"] += config.prompt_suffix
            conversations[i].extend(new)
        prompt_ids = [pipe.encode(conversations[i]) for i in active]
        outputs = pipe.engine.generate(prompt_ids, [_config(config, seed=config.seed + i) for i in active])
        for i, ids, out in zip(active, prompt_ids, outputs):
            conversations[i].append({"role": "assistant", "content": out.text})
            last[i] = (ids, out.output_ids, out.finish_reason)
    return [{"id": i, "messages": conversations[i], "prompt_ids": last[i][0], "response_ids": last[i][1],
             "finish_reason": last[i][2]} for i, _ in chunk]


def _config(config: DatagenConfig, seed: int):
    from dflash.api import make_config

    return make_config(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                       seed=seed)
