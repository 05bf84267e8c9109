"""Regenerate responses with the target (REFERENCE section 4: the drafter learns the target's own text).

Each output line is one finished conversation, written whole and flushed; a rerun skips the prompts
already done and drops a half-written last line, so interrupted runs resume without duplicates. A rerun
must continue the same job: every record keeps a hash of its prompt and `OUTPUT.datagen.json` the
generation settings, and a rerun with another prompt file, order or settings is refused, never mixed in.

Under torchrun each process answers its share of the prompts (ids i with i % processes == its rank) into its own
part file beside the output, on its own GPU (LOCAL_RANK); when all are done, rank 0 appends the parts to the output
and deletes them. A rerun, with any number of processes or none, resumes from the output and the parts it finds.

A prompt too long for the target's context is skipped with a warning that names it. It is not recorded:
whether a prompt fits depends only on the prompt and the target, both pinned by the checks above, so a
rerun skips it again, at the cost of tokenizing it. Answers stop at the end of the target's context
(finish_reason "length"). A prompt the target gives no token (NaN logits: a float16 overflow on its text) is
named in a warning and not recorded either (a cut answer would teach the drafter an ending the target never
wrote); the prompts answered with it are kept, and a rerun tries it again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import IO, Iterator

from dflash import hub
from dflash.config_types import blank_option
from dflash.errors import UserError, in_brief
from dflash.extras import require
from dflash.records import (
    PROMPT_FIELDS,
    chat_messages,
    has_chat,
    prompt_field_of,
    read_json_object,
    read_jsonl,
    text_field,
    texts_field,
)
from dflash.training.lock import lock_or_refuse
from dflash.training.processes import process_device

RECORD_START = b'{"id": '  # how every output line starts: a half-written last line is recognised by it
MAX_WARNINGS = 20  # skipped prompts named one by one; the rest are counted
# A name ending like a file (prompts.jsonl, data.csv.gz) is a local path, never a hub dataset; a version such as
# teknium/OpenHermes-2.5 is not an extension (it starts with a digit)
FILE_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}$")


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
    split: str | None = None  # the dataset's split; None: "train" (`dataset_split`)
    subset: str | None = None  # the dataset's configuration, e.g. "main" for openai/gsm8k
    prompt_field: str | None = None  # for hub datasets: the column with the prompt (default: guess)
    prompt_suffix: str = ""  # appended to every user turn (e.g. the benchmark's answer-format sentence)
    enable_thinking: bool | None = None  # the chat template's enable_thinking, as it will be served; None: its own
    chat_template_kwargs: dict | None = None  # other chat template variables (enable_thinking goes over them)
    dtype: str | None = None
    device: str | None = None
    trust_remote_code: bool = False  # run the Python code the target ships (its config.json's auto_map)
    # an OpenAI-compatible server serving the target answers instead (`datagen_server`); the target's tokenizer and
    # chat template render the prompts here
    base_url: str | None = None
    model: str | None = None  # the model's name there (default: the first it serves)
    api_key: str | None = None
    request_timeout: float = 3600.0  # seconds one answer may take on the server (0: no limit)

    def validate(self) -> None:
        from dflash.api import make_config, refuse_greedy_ignores
        from dflash.chat import check_text

        # Path("") is ".", the current directory: the messages about it would name a path the user never gave
        if not self.prompts:
            raise UserError("--prompts is empty; give a JSONL file, a dataset directory or a Hugging Face dataset name "
                            "like openai/gsm8k")
        if not self.output:
            raise UserError("--output is empty; give the path of the .jsonl file to write the answers to")
        blank = blank_option({name: getattr(self, name)
                              for name in ("target", "split", "subset", "prompt_field", "dtype", "device")})
        if blank is not None:
            raise UserError(f"--{blank.replace('_', '-')} is empty; give a value or leave the flag out")
        if self.prompt_suffix:  # as dflash generate checks --prompt: before the model loads, not blamed on a record
            check_text(self.prompt_suffix, "--prompt-suffix")
        self.template_kwargs()  # checked: names a template may take, and one enable_thinking
        self._check_dataset_flags()
        if self.batch_size < 1:
            raise UserError(f"--batch-size is the number of prompts decoded together, >= 1; got {self.batch_size}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be >= 1 (leave it out for every prompt), got {self.limit}")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        make_config(temperature=self.temperature, top_p=self.top_p)  # their ranges, named
        # as dflash generate; --seed's default here is 0, not None
        refuse_greedy_ignores(dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed or None))
        self._check_server_flags()
        if self.device is not None:  # before the output and its settings file are created
            from dflash.model.loading import resolve_device

            resolve_device(self.device)
        output = Path(self.output).expanduser()
        if output.suffix == ".gz":
            raise UserError(f"--output {self.output}: dflash datagen writes plain JSONL (it appends as it goes, and a "
                            "rerun resumes the file); name it *.jsonl, and gzip it afterwards if you like (dflash "
                            "train reads *.jsonl.gz)")
        if output.is_dir():
            raise UserError(f"--output {self.output} is a directory; give the path of a .jsonl file")
        if output.exists() and not output.is_file():  # /dev/null would take every answer and keep none
            raise UserError(f"--output {self.output} is not a regular file (a device or a pipe); give the path of a "
                            ".jsonl file")
        blocking = next((p for p in output.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UserError(f"--output {self.output} cannot be written: {blocking} is a file, not a directory; give "
                            "the path of a .jsonl file in a directory (missing directories are created)")
        prompts = Path(self.prompts).expanduser()
        if output.exists() and output.resolve() == prompts.resolve():
            raise UserError(f"--output {self.output} is the --prompts file; give another path to write the answers to")
        if prompts.is_dir() and prompts.resolve() in output.resolve().parents:  # read back as the dataset's files
            raise UserError(f"--output {self.output} lies inside the --prompts directory {self.prompts}, which is read "
                            "as a dataset (the answers and their settings file would become part of it): write it "
                            "elsewhere")
        saved_settings(output)  # a file of that name that is not datagen's is refused before anything is written

    def _check_server_flags(self) -> None:
        """--model and --api-key are the server's; --dtype and --device load the target here, which a server run
        does not."""
        if self.base_url is None:
            given = [f for f, v in (("--model", self.model), ("--api-key", self.api_key)) if v is not None]
            if given:
                raise UserError(f"{' and '.join(given)} name the server of --base-url, which is not given: add "
                                "--base-url (the server's API root, e.g. http://127.0.0.1:8000/v1), or drop them")
            return
        if not (math.isfinite(self.request_timeout) and self.request_timeout >= 0):
            raise UserError(f"--request-timeout is the seconds one answer may take on the server, >= 0 (0: no "
                            f"limit), got {self.request_timeout}")
        if self.target is None:
            raise UserError("--base-url needs --target: the served model's directory or hub id, whose tokenizer and "
                            "chat template render the prompts here (the embedded target's would not be the server's)")
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"--base-url {self.base_url!r} is not a URL; give the server's API root, e.g. "
                            "http://127.0.0.1:8000/v1")
        loaded = [f for f, v in (("--dtype", None if self.dtype in (None, "auto") else self.dtype),
                                 ("--device", self.device)) if v is not None]
        if loaded:
            raise UserError(f"{' and '.join(loaded)} set how the target loads here, and with --base-url the server "
                            "decodes it: drop them (set them where the server starts)")

    def _check_dataset_flags(self) -> None:
        """--split and --subset pick part of a dataset; a file of prompts is read whole, so they would be ignored."""
        given = [flag for flag, value in (("--split", self.split), ("--subset", self.subset)) if value is not None]
        if given and Path(self.prompts).expanduser().is_file():
            flags = " and ".join(given)
            raise UserError(f"{flags} {'picks' if len(given) == 1 else 'pick'} part of a dataset (a hub dataset or a "
                            f"dataset directory), and --prompts {self.prompts} is a file, read whole: drop {flags}")

    def dataset_split(self) -> str:
        return self.split or "train"

    def settings(self) -> dict:
        """What decides the answers: a rerun that resumes an output must repeat these."""
        return {"target": target_name(self.target), "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "prompt_suffix": self.prompt_suffix, "chat_template_kwargs": self.template_kwargs(),
                # None: the checkpoint's own ("auto", the flag's default), and what a settings file from before reads
                "dtype": None if self.dtype in (None, "auto") else self.dtype}

    def template_kwargs(self) -> dict | None:
        """The chat template variables set; None (the template's defaults) reads the same as a settings file from
        before the flag, which lacks the entry."""
        from dflash.chat import merged_template_kwargs

        return merged_template_kwargs(self.chat_template_kwargs, self.enable_thinking)


def target_name(target: str | None) -> str:
    """The target as a rerun can compare it: a local directory's absolute path, else the hub id."""
    if target is None:
        from dflash.api import DEFAULT_TARGET

        return str(DEFAULT_TARGET.resolve())
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else str(target)


@dataclass
class Prompt:
    id: int  # its place among the prompts: the output record's id
    where: str  # "prompts.jsonl:12" or "openai/gsm8k row 11": where a message sends the user
    turns: list[list[dict]]  # the messages added before each answer, one entry per user turn

    @property
    def hash(self) -> str:
        text = json.dumps(self.turns, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class DatagenResult:
    written: int = 0  # new records in the output
    held: int = 0  # records the output holds now (a rerun with a lower --limit leaves the ones beyond it)
    skipped: list[str] = field(default_factory=list)  # prompts too long for the target's context: why, each
    cut: int = 0  # conversations ended early: a later turn did not fit in the target's context
    failed: int = 0  # prompts the target gave no token (NaN logits), named in warnings; under torchrun, all of them
    skipped_elsewhere: int = 0  # under torchrun: the other processes' skipped prompts (they named them)

    @property
    def skipped_count(self) -> int:
        return len(self.skipped) + self.skipped_elsewhere


def prompt_messages(record: dict, prompt_field: str | None = None) -> list[list[dict]]:
    """The user turns of a record, as the messages to add before each answer. System (and other non-user)
    messages go with the user message after them; the record's own assistant messages are dropped (the target
    writes every answer itself)."""
    if prompt_field:  # named, it wins over the record's other forms
        if prompt_field not in record:
            raise UserError(f"--prompt-field {prompt_field}: the record has no such field (its fields: "
                            f"{', '.join(sorted(record))})")
        return [[{"role": "user", "content": text_field(record, prompt_field)}]]
    if has_chat(record):
        return _message_turns(chat_messages(record))
    if "turns" in record:
        return [[{"role": "user", "content": t}] for t in texts_field(record, "turns")]
    name = prompt_field_of(record)
    if name is not None:
        content = text_field(record, name)
        extra = record.get("input") if name == "instruction" else None
        if isinstance(extra, str) and extra.strip():  # Alpaca: the instruction, then the text it is about
            content = f"{content}\n\n{extra}"
        return [[{"role": "user", "content": content}]]
    raise UserError(f"cannot find a prompt in record with fields {sorted(record)}; use `prompt`, `turns` or "
                    "`messages` (or ShareGPT `conversations`, or --prompt-field for a dataset column)")


def _guessed_fields_note(records: list[dict], prompt_field: str | None) -> str | None:
    """What to tell a user whose records give their prompts in a field other than the documented forms (`prompt`,
    `turns`, `messages`): which field was read, so that a wrong guess is seen before the target answers it."""
    if prompt_field:
        return None
    used = {prompt_field_of(r) for r in records if not has_chat(r) and "turns" not in r} - {None, "prompt"}
    if not used:
        return None
    alpaca = "instruction" in used and any(isinstance(r.get("input"), str) and r["input"].strip() for r in records)
    named = ", ".join(f"`{name}`" + (" (with `input` after it, as in Alpaca)" if name == "instruction" and alpaca
                                     else "") for name in PROMPT_FIELDS if name in used)
    fields = "field" if len(used) == 1 else "fields"
    return f"the prompts are read from the records' {named} {fields} (--prompt-field names another)"


def _message_turns(messages: list[dict]) -> list[list[dict]]:
    turns, pending = [], []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        if m["role"] == "user" and not m["content"].strip():
            raise UserError(f"message {i} of the conversation is an empty user message; remove it or the record")
        pending.append(dict(m))
        if m["role"] == "user":
            turns.append(pending)
            pending = []
    if not turns:
        raise UserError("the conversation (`messages` or `conversations`) has no user message to answer")
    if pending:
        raise UserError(f"the conversation has a {pending[-1]['role']} message after its last user message; end "
                        "with the user message to answer")
    return turns


def read_prompts(config: DatagenConfig) -> list[Prompt]:
    """Every prompt (up to --limit), checked before anything is generated; the bad records are named."""
    rows = _read_rows(config)
    note = _guessed_fields_note([record for _, record in rows], config.prompt_field)
    if note and os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"dflash datagen: {note}", file=sys.stderr, flush=True)
    prompts, problems = [], []
    for i, (where, record) in enumerate(rows):
        try:
            prompts.append(Prompt(i, where, prompt_messages(record, config.prompt_field)))
        except UserError as err:
            problems.append(f"{where}: {err}")
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise UserError(f"{len(problems)} prompt records cannot be used; fix or remove them:\n  "
                        + "\n  ".join(problems[:5]) + more)
    return prompts


def _read_rows(config: DatagenConfig) -> list[tuple[str, dict]]:
    path = Path(config.prompts).expanduser()
    if path.is_file() and path.suffix.lower() in DATASET_FILES:  # a hub dataset's own file, as downloaded
        rows = _load_dataset_file(path)[: config.limit]
        return [(f"{path} row {i}", dict(row)) for i, row in enumerate(rows)]
    if path.is_file():
        rows = read_jsonl(path, missing="give a JSONL file, a dataset directory or a Hugging Face dataset name",
                          limit=config.limit)
        return [(f"{path}:{n}", record) for n, record in rows]
    if path.is_dir() or is_hub_id(config.prompts):
        source = str(path) if path.is_dir() else config.prompts
        rows = _load_dataset(config, source, local=path.is_dir())[: config.limit]
        return [(f"{source} row {i}", dict(row)) for i, row in enumerate(rows)]
    raise UserError(f"--prompts {config.prompts}: there is no local file or directory {path}, and the name reads as "
                    "a path, so the hub was not asked; give an existing JSONL file, a dataset directory or a "
                    "Hugging Face dataset name like openai/gsm8k")


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub dataset ("name" or "org/name") rather than a path to a local file."""
    if name.startswith((".", "/", "~")) or "\\" in name or FILE_EXTENSION.search(name):
        return False
    parts = name.split("/")
    return len(parts) <= 2 and all(parts)


def _load_dataset(config: DatagenConfig, source: str, local: bool = False) -> list[dict]:
    """Rows of a hub dataset or a local dataset directory (`local`: data files, or a `save_to_disk` copy). A hub
    dataset comes from the local `datasets` cache alone when the hub cannot be reached (`hub.unreachable`)."""
    require(["datasets"], "reading a dataset instead of a JSONL file")
    import datasets
    if local and any((Path(source) / name).exists() for name in ("state.json", "dataset_dict.json")):
        return _saved_dataset(source, config)
    cache_only, refused = (None, None) if local else hub.look_up(source, repo_type="dataset",
                                                                 instead="pass a local JSONL file")
    unreachable = None if refused is not None or hub.offline() else cache_only  # the hub's own failure, if any
    try:
        with hub.datasets_offline(cache_only is not None):
            rows = list(datasets.load_dataset(source, config.subset, split=config.dataset_split()))
    except Exception as err:
        if refused is not None:
            raise UserError(f"--prompts {refused}") from None
        hint = (" (does it need --subset, e.g. --subset main for openai/gsm8k?)"
                if "config" in str(err).lower() and config.subset is None else
                " (pick one of its splits with --split)" if "unknown split" in str(err).lower() else "")
        reason = (f"the Hugging Face hub is not reachable ({unreachable}), and the local datasets cache could not "
                  f"serve it ({in_brief(err)})" if unreachable is not None else in_brief(err))
        offline = ("" if local else f"; there is no local file or directory named {source!r} either. Offline? Pass "
                   "a local JSONL file with `prompt`, `turns`, `messages` or `conversations`, or a downloaded dataset "
                   "directory")
        raise UserError(f"could not load dataset {source!r}, split {config.dataset_split()!r}: {reason}{hint}"
                        f"{offline}") from None
    if refused is not None:
        hub.warn_cached_copy(refused, source)
    return rows


# data files `datasets` reads (its builder for each) that are not JSONL
DATASET_FILES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _load_dataset_file(path: Path) -> list[dict]:
    """The rows of one parquet, CSV or Arrow file."""
    require(["datasets"], f"reading a {path.suffix} file instead of a JSONL file")
    import datasets

    try:
        with hub.datasets_offline(True):
            return list(datasets.load_dataset(DATASET_FILES[path.suffix.lower()], data_files=str(path), split="train"))
    except Exception as err:
        if "corresponds to no data" in str(err):  # the builder's word for a file of no rows (a CSV of its header)
            raise UserError(f"{path} has no records; give a file with one prompt per row") from None
        raise UserError(f"could not read --prompts {path} as a {path.suffix} file: {in_brief(err)}") from None


def _saved_dataset(source: str, config: DatagenConfig) -> list[dict]:
    """The rows of a `save_to_disk` directory: a Dataset (whole; --split, when given, must be the one it was saved
    from), or --split (default train) of a DatasetDict."""
    import datasets

    if config.subset is not None:
        raise UserError(f"--subset picks a configuration of a hub dataset, and --prompts {source} is a saved dataset, "
                        "which holds one: drop --subset")
    try:
        saved = datasets.load_from_disk(source)
    except Exception as err:
        raise UserError(f"could not read the saved dataset {source!r}: {in_brief(err)}") from None
    if isinstance(saved, datasets.DatasetDict):
        split = config.dataset_split()
        if split not in saved:
            raise UserError(f"--prompts {source} holds the splits {', '.join(saved)}, not {split!r}; pick one with "
                            "--split")
        saved = saved[split]
    elif config.split is not None and saved.split is not None and str(saved.split) != config.split:
        raise UserError(f"--prompts {source} holds one split, {str(saved.split)!r}, saved alone, not "
                        f"{config.split!r}: drop --split to read it whole")
    return list(saved)


# ---- the output: what is done, and whether a rerun continues the same job --------------------------------------
def settings_path(output: Path) -> Path:
    return output.with_name(output.name + ".datagen.json")


# in every settings file datagen has written (later versions added chat_template_kwargs and dtype)
SETTINGS_KEYS = ("target", "max_new_tokens", "temperature", "top_p", "seed", "prompt_suffix")


def saved_settings(output: Path) -> dict | None:
    """The settings file of `output` (None when there is none). A file of that name that is not one (the user's own
    file, say) is refused, never written over."""
    path = settings_path(output)
    if not path.exists():
        return None
    return read_json_object(path, "a dflash datagen settings file", f"dflash datagen keeps the settings of --output "
                            f"{output} there: move that file elsewhere, or pass another --output", SETTINGS_KEYS)


def done_ids(output: Path, cut: bool = True) -> dict[int, str | None]:
    """The ids already written, with their prompt hashes (None in records of older versions). A file that is not
    datagen output, or is broken before its last line, is refused; a half-written last line (an interrupted run)
    is cut off, or with `cut` False (a reader that does not hold the file's lock) only left out."""
    if not output.exists():
        return {}
    try:
        data = output.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read --output {output}: {err.strerror or err}; give the path of a .jsonl file you "
                        "can read and write") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    parsed = [(n, line, _output_record(_json(line))) for n, line in enumerate(lines, 1) if line.strip()]
    ours = any(record is not None for _, _, record in parsed)
    for n, line, record in parsed:
        if record is None and ours and line.startswith(RECORD_START):
            raise UserError(f"{output}:{n} is a broken record; only the last line can be half-written (by an "
                            f"interrupted run). Remove line {n} (its prompt is then generated again) and rerun")
        if record is None and ours:
            raise UserError(f"{output}:{n} is not a dflash datagen record, but the file's other lines are: remove "
                            f"line {n} (written there by something else) and rerun")
        if record is None:
            raise UserError(f"{output} is not dflash datagen output (line {n} is not a record); pass another "
                            "--output (a rerun of dflash datagen appends to its own output)")
    if tail.strip():
        whole = _json(tail)  # a whole line without its newline: written by something else, never half ours
        ours_so_far = tail.startswith(RECORD_START) or RECORD_START.startswith(tail)  # or stopped within its start
        if not ours_so_far or (whole is not _NOT_JSON and _output_record(whole) is None):
            raise UserError(f"{output} is not dflash datagen output (line {len(lines) + 1} is not a record); pass "
                            "another --output")
        if cut:
            with output.open("r+b") as f:  # the interrupted write of a record: it is generated again
                f.truncate(len(data) - len(tail))
    return {record["id"]: record.get("prompt_hash") for _, _, record in parsed}


_NOT_JSON = object()


def _json(line: bytes):
    """The line's JSON value, or _NOT_JSON (text that is not JSON, not UTF-8, or nested too deeply)."""
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return _NOT_JSON


def _output_record(value) -> dict | None:
    """A parsed output line (`_json`) as a record, or None when it is not one."""
    if isinstance(value, dict) and isinstance(value.get("id"), int) and "response_ids" in value:
        return value
    return None


def check_rerun(config: DatagenConfig, prompts: list[Prompt], done: dict[int, str | None], record: bool = True,
                ) -> None:
    """Refuse to add to an output made from other prompts or with other settings; record the settings of a new
    output (`OUTPUT.datagen.json`) unless `record` is False."""
    output = Path(config.output)
    _check_prompts(output, prompts, done, limited=config.limit is not None)
    path, settings = settings_path(output), config.settings()
    saved = saved_settings(output)  # with no records yet, those of a run stopped before its first are replaced
    if done and saved is not None:
        greedy = saved.get("temperature") == 0 and settings["temperature"] == 0
        moot = {"top_p", "seed"} if greedy else set()  # greedy answers depend on neither
        changed = [f"{k} {_setting(k, saved.get(k))}, now {_setting(k, v)}" for k, v in settings.items()
                   if saved.get(k) != v and k not in moot]
        if changed:
            raise UserError(f"{output} was generated with other settings ({'; '.join(changed)}); rerun with the "
                            "same ones to resume it, or pass another --output")
        return
    if not record:
        return
    if done:
        _warn(f"{output} has no {path.name} (written by an older dflash): this run's settings cannot be checked "
              "against the records it holds; writing them there now")
    _write_settings(output, settings)


def _write_settings(output: Path, settings: dict) -> None:
    """OUTPUT.datagen.json replaced whole (written aside, then moved in place)."""
    path = settings_path(output)
    tmp = path.with_name(path.name + ".tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(settings, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise _unwritable(output, err) from None


def mark_finished(output: Path, finished: bool) -> None:
    """Record in the output's settings file whether the run writing it has finished (`dflash train` warns of a
    stopped run's output). An output without a settings file (an older dflash's) is left as it is."""
    try:
        settings = json.loads(settings_path(output).read_text())
    except (OSError, ValueError):
        return
    if isinstance(settings, dict) and settings.get("finished") != finished:
        _write_settings(output, {**settings, "finished": finished})


def stopped_parts(output: Path) -> list[Path]:
    """The part files a torchrun run of dflash datagen stopped before joining left beside `output`."""
    found = output.parent.glob(glob.escape(output.name) + ".part-*-of-*")
    return sorted(path for path in found if re.fullmatch(r"part-\d+-of-\d+", path.name[len(output.name) + 1:]))


def _setting(name: str, value) -> str:
    """A setting as the flag took it: dtype None is the flag's default, auto (the checkpoint's own)."""
    return "auto (the checkpoint's own)" if name == "dtype" and value is None else repr(value)


def _unwritable(output: Path, err: OSError) -> UserError:
    """--output cannot be written (or the settings file next to it): the flag and what to give instead."""
    return UserError(f"cannot write --output {output}: {err.strerror or err}; give the path of a .jsonl file in a "
                     "directory you can write to")


def _check_prompts(output: Path, prompts: list[Prompt], done: dict[int, str | None], limited: bool) -> None:
    by_id = {p.id: p for p in prompts}
    for i, prompt_hash in sorted(done.items()):
        prompt = by_id.get(i)
        if prompt is None and not limited:
            raise UserError(f"{output} holds an answer to prompt {i}, but there are only {len(prompts)} prompts: it "
                            "was made from another prompt file; pass another --output")
        if prompt is not None and prompt_hash is not None and prompt_hash != prompt.hash:
            raise UserError(f"{output} holds an answer (id {i}) to another prompt than {prompt.where}: the prompts "
                            "changed since it was written (another file, order or --prompt-field); rerun with the "
                            "prompts it was made from, or pass another --output")


# ---- generation ----------------------------------------------------------------------------------------------
def run_datagen(config: DatagenConfig, progress=None, prompts: list[Prompt] | None = None) -> DatagenResult:
    """Generate what is missing from `output`. `progress(n)`: n more prompts are accounted for (done before,
    skipped or answered now); `prompts`: when the caller has read them already (`read_prompts`). Under torchrun,
    each process its share (`_run_shard`)."""
    config.validate()
    prompts = read_prompts(config) if prompts is None else prompts
    if config.enable_thinking:
        _refuse_thinking_without_template(config)
    shard = Shard.of_torchrun()
    if shard is not None:
        return _run_shard(config, prompts, progress, shard)
    with _claim(Path(config.output)) as f:  # before the target loads: a run must not end in an error about where
        done = _checked_output(config, prompts, f)  # answers go
        mark_finished(Path(config.output), False)
        result = _generate(config, prompts, f, progress, done)
        mark_finished(Path(config.output), True)
        return result


def _checked_output(config: DatagenConfig, prompts: list[Prompt], f: IO[str]) -> set[int]:
    """The ids `config.output` (open as `f`, claimed) holds, once it is checked as these prompts' answers with
    these settings (which a new output records) and the parts a stopped torchrun run left are joined to it."""
    done = done_ids(Path(config.output))
    check_rerun(config, prompts, done)
    done = set(done)
    _join_leftover_parts(f, config, prompts, done)
    return done


def _generate(config: DatagenConfig, prompts: list[Prompt], f: IO[str], progress, done: set[int]) -> DatagenResult:
    """Answer the prompts whose ids are not in `done` into `config.output` (open as `f`, claimed and checked)."""
    todo = [p for p in prompts if p.id not in done]
    if progress:
        progress(len(prompts) - len(todo))
    result = DatagenResult()
    if todo:
        _answer(config, todo, f, result, progress)
    result.held = len(done) + result.written
    return result


@dataclass
class Shard:
    """This process's place under torchrun: it answers the prompts whose id % world == rank. The processes meet
    over gloo (a rendezvous and a few sums, whatever the device; one share may take hours)."""

    rank: int
    world: int

    @staticmethod
    def of_torchrun() -> "Shard | None":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE is {world}, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                            "not set: run several processes with torchrun (torchrun --nproc_per_node N -m "
                            "dflash.cli.main datagen ...), or unset WORLD_SIZE for one")
        return Shard(int(os.environ["RANK"]), world)

    def part(self, output: Path, rank: int | None = None) -> Path:
        """The file the process of `rank` (default this one) writes its answers to, beside the output."""
        rank = self.rank if rank is None else rank
        return output.with_name(f"{output.name}.part-{rank}-of-{self.world}")

    def join(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            try:
                dist.init_process_group("gloo", timeout=timedelta(days=7))
            except (RuntimeError, ValueError) as err:
                raise UserError(f"the processes of this torchrun job could not meet ({in_brief(err)}); check "
                                "torchrun's --master-addr / --master-port and rerun") from None

    def leave(self) -> None:
        """Close the process group: left open, its gloo threads can abort the process as it exits ("terminate
        called without an active exception"); its last work is collected first."""
        import gc

        import torch.distributed as dist

        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    def agree(self, failure: UserError | None) -> None:
        """Every process learns whether any of them failed here: the one that did raises its error, the others
        one that points to it, so all stop at once."""
        failed = self.sum([failure is not None])[0]
        if failure is not None:
            raise failure
        if failed:
            raise UserError("another process of this torchrun job stopped (its error is above); nothing was generated")

    def sum(self, values: list[int]) -> list[int]:
        """The values summed over the processes; a process that died meanwhile (its error above) stops this one
        with a UserError, not gloo's traceback."""
        import torch
        import torch.distributed as dist

        total = torch.tensor(values, dtype=torch.long)
        try:
            dist.all_reduce(total)
        except RuntimeError as err:
            raise UserError(f"another process of this torchrun job stopped (its error is above; here: "
                            f"{in_brief(err)}); the answers written are kept: rerun the same command to resume"
                            ) from None
        return total.tolist()


def _run_shard(config: DatagenConfig, prompts: list[Prompt], progress, shard: Shard) -> DatagenResult:
    """This process's share into its part file; then rank 0 appends every part to the output (claimed by rank 0
    from the start, so no other job writes it meanwhile) and deletes them. Rank 0 checks the output's records and
    settings and joins a stopped run's parts before anyone starts (the others wait, and stop with it if it
    refuses); each part is checked against its own settings."""
    output = Path(config.output)
    shard.join()
    with contextlib.ExitStack() as claimed:
        claimed.callback(shard.leave)  # last: after the output's lock is let go
        failure, f, done = None, None, set()
        if shard.rank == 0:
            try:
                f = claimed.enter_context(_claim(output))
                done = _checked_output(config, prompts, f)
                mark_finished(output, False)
            except UserError as err:
                failure = err
        shard.agree(failure)
        if shard.rank != 0:  # as rank 0 left it; nobody writes it until the parts are done
            done = set(done_ids(output, cut=False))
        part_config = replace(config, output=str(shard.part(output)), device=process_device(config.device))
        share = [p for p in prompts if p.id % shard.world == shard.rank]
        with _claim(Path(part_config.output)) as part_file:
            in_part = done_ids(Path(part_config.output))
            check_rerun(part_config, share, in_part)
            result = _generate(part_config, share, part_file, progress, done | set(in_part))
        written, skipped, cut, failed = shard.sum([result.written, len(result.skipped), result.cut,
                                                   result.failed])  # all parts done
        if shard.rank == 0:
            result.held = _append_parts(f, output, [shard.part(output, r) for r in range(shard.world)], done)
            mark_finished(output, True)
        shard.sum([0])  # the processes leave together: none exits while another still uses the group
    result.written, result.cut, result.failed = written, cut, failed
    result.skipped_elsewhere = skipped - len(result.skipped)  # the other processes named theirs
    return result


def _join_leftover_parts(f: IO[str], config: DatagenConfig, prompts: list[Prompt], done: set[int]) -> None:
    """The part files a stopped torchrun run left beside the output (any number of processes), checked as its own
    answers to these prompts with these settings, appended to the output (open as `f`, holding the ids `done`,
    which grows); a settings file left without its part is deleted."""
    output = Path(config.output)
    found = output.parent.glob(glob.escape(output.name) + ".part-*-of-*")
    names = {path.name[len(output.name) + 1:]: path for path in found}
    parts = stopped_parts(output)
    for part in parts:
        try:
            check_rerun(replace(config, output=str(part)), prompts, done_ids(part), record=False)
        except UserError as err:
            raise UserError(f"{part} is taken for the part file of a stopped torchrun run of dflash datagen on "
                            f"{output.name}, and it cannot be joined to it: {err}. Move it out of "
                            f"{output.parent} (its answers are then generated again)") from None
    if parts:
        _append_parts(f, output, parts, done)
    for name, path in names.items():
        own = output.with_name(f"{output.name}.{name.removesuffix('.datagen.json')}")
        if re.fullmatch(r"part-\d+-of-\d+\.datagen\.json", name) and not own.exists():
            path.unlink(missing_ok=True)


def _append_parts(f: IO[str], output: Path, parts: list[Path], done: set[int]) -> int:
    """Append the parts' records that the output (open as `f`, holding the ids `done`, which grows) lacks, then
    delete the parts and their settings; how many records the output holds. The parts are checked datagen output
    (a stopped run's by `_join_leftover_parts`), and a run stopped in between appends nothing twice when it is run
    again. They go in in prompt order (the processes took every N-th prompt), as one process writes them: the
    held-out split and the training order follow the file's order, so they do not depend on how many processes
    answered."""
    try:
        where: dict[int, tuple[Path, int, int]] = {}  # id -> (part, offset, length): the lines stay on disk
        for part in parts:
            if not part.exists():
                continue
            with part.open("rb") as lines:
                offset = 0
                for line in lines:
                    record = _output_record(_json(line))
                    if record is not None and record["id"] not in done and record["id"] not in where:
                        where[record["id"]] = (part, offset, len(line))
                    offset += len(line)
        with contextlib.ExitStack() as opened:
            files = {part: opened.enter_context(part.open("rb")) for part in {w[0] for w in where.values()}}
            for record_id in sorted(where):
                part, offset, length = where[record_id]
                files[part].seek(offset)
                f.write(files[part].read(length).decode("utf-8"))
        done.update(where)
        f.flush()
        os.fsync(f.fileno())
        for part in parts:
            for path in (part, settings_path(part)):
                path.unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"could not join the processes' answers into {output} ({in_brief(err)}); they are kept in "
                        f"{parts[0].name} ... beside it: free some space and rerun the same command to join "
                        "them") from None
    return len(done)


def _refuse_thinking_without_template(config: DatagenConfig) -> None:
    """--enable-thinking for a target without a chat template (a base model), refused before the output and its
    settings are written (the tokenizer alone loads here)."""
    from transformers import AutoTokenizer

    from dflash.chat import THINKING_WITHOUT_TEMPLATE

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.target, trust_remote_code=config.trust_remote_code)
    except Exception:  # noqa: BLE001 - loading the target says what is wrong with it
        return
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(THINKING_WITHOUT_TEMPLATE)


def _answer(config: DatagenConfig, todo: list[Prompt], f, result: DatagenResult, progress) -> None:
    """Have the target answer `todo`, appending each record to `f` as it is done."""
    generator = _generator(config)
    try:
        _answer_with(generator, config, todo, f, result, progress)
    finally:
        generator.close()


def _generator(config: DatagenConfig) -> Generator:
    """The target, loaded here, or the server of --base-url (`datagen_server`)."""
    if config.base_url is not None:
        from dflash.training.datagen_server import ServerGenerator

        return ServerGenerator(config)
    from dflash.api import DFlash

    pipe = DFlash.from_pretrained(config.target, no_draft=True, dtype=config.dtype, device=config.device,
                                  chat_template_kwargs=config.template_kwargs(),
                                  trust_remote_code=config.trust_remote_code)
    return Generator(pipe, config)


def _answer_with(generator: Generator, config: DatagenConfig, todo: list[Prompt], f, result: DatagenResult,
                 progress) -> None:
    first_ids = generator.first_turns(todo, result)
    if progress:
        progress(len(todo) - len(first_ids))
    try:
        for chunk in _chunks([p for p in todo if p.id in first_ids], config.batch_size):
            for record in generator.answer(chunk, first_ids, result):
                f.write(json.dumps(record) + "\n")
                f.flush()
                result.written += 1
            if (failure := generator.failed()) is not None:  # once the answers finished beside it are written
                raise UserError(f"{failure}; the {result.written} answers written this run are kept: rerun the same "
                                "command to continue")
            if progress:
                progress(len(chunk))
        os.fsync(f.fileno())
    except OSError as err:  # a full disk: what is written stays, and a rerun cuts a half-written last line
        raise UserError(f"could not write to {config.output} ({in_brief(err)}); the {result.written} answers written "
                        "this run are kept: free some space and rerun the same command to continue") from None


@contextlib.contextmanager
def _claim(output: Path) -> Iterator[IO[str]]:
    """`output` open for appending, locked against a second datagen on the same file (which would answer every
    prompt a second time into it) until the run ends."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        f = output.open("a")
    except OSError as err:
        raise _unwritable(output, err) from None
    try:
        lock_or_refuse(f.fileno(), f"another dflash datagen is writing {output}; let it finish (a rerun then "
                                   "continues where it stopped) or pass another --output")
        yield f
    except BaseException:
        with contextlib.suppress(OSError):  # closing flushes what a full disk refused: the error that stopped the run
            f.close()                       # says more than a second one
        raise
    try:
        f.close()
    except OSError as err:
        raise _unwritable(output, err) from None


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start: start + size]


class Generator:
    """The target answering prompts: their tokens (the chat template, or plain text for a target without one) and
    every turn's answer within the target's context."""

    def __init__(self, pipe, config: DatagenConfig):
        self.pipe, self.config = pipe, config
        self.context_words = pipe.engine.target.context_words  # for the messages of prompts that do not fit
        if pipe.tokenizer is not None:
            self.note_plain_text(pipe.tokenizer)

    @staticmethod
    def note_plain_text(tokenizer) -> None:
        """Say so where the target's tokenizer has no chat template: the turns go as plain text then."""
        if not getattr(tokenizer, "chat_template", None):
            from dflash.chat import PLAIN_CONVERSATION_NOTE

            _warn(PLAIN_CONVERSATION_NOTE)

    def encode_turn(self, prompt: Prompt, conversation: list[dict]) -> list[int]:
        """`encode`, with an error that names the prompt's record when the chat template refuses it."""
        try:
            return self.encode(conversation)
        except UserError as err:  # the template's refusal (`TemplateRefusal`), or the pipeline's check of the messages
            message = str(err)
        except Exception as err:  # the template's other checks (e.g. roles it does not take) raise anything
            message = f"the model's chat template cannot render these messages: {type(err).__name__}: {err}"
        raise UserError(f"{prompt.where} (output id {prompt.id}): {message}; fix this record where it is (answers "
                        "already written are kept, and a rerun resumes them)")

    def encode(self, conversation: list[dict]) -> list[int]:
        """A turn's token ids: the target's chat template (`DFlash.encode`)."""
        return self.pipe.encode(conversation)

    def room(self, prompt_ids: list[int]) -> int:
        """How many tokens an answer to this prompt can have: --max-new-tokens, or less at the context's end."""
        room = self.pipe.engine.room(len(prompt_ids))
        return self.config.max_new_tokens if room is None else min(self.config.max_new_tokens, room)

    def first_turns(self, prompts: list[Prompt], result: DatagenResult) -> dict[int, list[int]]:
        """The first turn's tokens of every prompt that leaves room for an answer; the others are skipped (named
        in a warning, counted in `result.skipped`)."""
        ids = {}
        for p in prompts:
            prompt_ids = self.encode_turn(p, self._with_suffix(p.turns[0]))
            if self.room(prompt_ids) >= 1:
                ids[p.id] = prompt_ids
                continue
            result.skipped.append(f"{p.where} (output id {p.id}): its prompt of {len(prompt_ids)} tokens leaves no "
                                  f"room for an answer in the target's context of {self.context_words}")
            warn_capped(len(result.skipped), f"skipped {result.skipped[-1]}",
                         "more prompts are too long for the target's context: the summary counts them")
        return ids

    def answer(self, chunk: list[Prompt], first_ids: dict[int, list[int]], result: DatagenResult) -> list[dict]:
        """Answer every turn of every prompt in the chunk; a turn sees the target's own earlier answers. A turn
        that no longer fits in the target's context ends its conversation there (a warning says so); a prompt
        the target gives no token has no record (`_failed`)."""
        conversations: dict[int, list[dict]] = {p.id: [] for p in chunk}
        answered: dict[int, list[tuple[list[int], list[int], str]]] = {p.id: [] for p in chunk}  # ids of each turn
        ended: set[int] = set()  # conversations whose next turn does not fit
        failed: set[int] = set()  # prompts the target gave no token
        for turn in range(max(len(p.turns) for p in chunk)):
            asked, prompt_ids = [], []
            for p in chunk:
                if turn >= len(p.turns) or p.id in ended:
                    continue
                messages = conversations[p.id] + self._with_suffix(p.turns[turn])
                ids = first_ids.pop(p.id) if turn == 0 else self.encode_turn(p, messages)
                if self.room(ids) < 1:
                    result.cut += 1
                    warn_capped(result.cut, f"{p.where} (output id {p.id}): turn {turn + 1} of {len(p.turns)} "
                                 f"({len(ids)} tokens) leaves no room for an answer in the target's context of "
                                 f"{self.context_words}; its record keeps the first {turn}",
                                 "more conversations end early, their later turns too long for the target's "
                                 "context: the summary counts them")
                    ended.add(p.id)
                    continue
                conversations[p.id] = messages
                asked.append(p)
                prompt_ids.append(ids)
            if not asked:
                break
            configs = [self._generation_config(p, ids) for p, ids in zip(asked, prompt_ids)]
            for p, ids, out in zip(asked, prompt_ids, self.pipe.engine.generate(prompt_ids, configs)):
                if out.error is not None:
                    self._failed(p, turn, out.error, result)
                    ended.add(p.id)
                    failed.add(p.id)
                    continue
                conversations[p.id].append({"role": "assistant", "content": out.text})
                answered[p.id].append((ids, out.output_ids, out.finish_reason))
        return [output_record(p, conversations[p.id], answered[p.id]) for p in chunk if p.id not in failed]

    @staticmethod
    def _failed(prompt: Prompt, turn: int, error: str, result: DatagenResult) -> None:
        result.failed += 1
        which = f"turn {turn + 1} of {len(prompt.turns)}" if len(prompt.turns) > 1 else "its prompt"
        warn_capped(result.failed, f"no record for {prompt.where} (output id {prompt.id}): {which} got no answer, "
                     f"{error}", "more prompts got no answer (NaN logits): the summary counts them")

    def _with_suffix(self, messages: list[dict]) -> list[dict]:
        new = [dict(m) for m in messages]
        if self.config.prompt_suffix and new[-1]["role"] == "user":
            new[-1]["content"] += self.config.prompt_suffix
        return new

    def close(self) -> None:
        """Nothing to let go of here (the server's generator closes its connections)."""

    def failed(self) -> UserError | None:
        """What stops the run after the chunk's records are written (the server's generator); None here."""
        return None

    def _generation_config(self, prompt: Prompt, prompt_ids: list[int]):
        from dflash.decoding.engine import GenerationConfig
        from dflash.decoding.sampling import derive_seed

        c = self.config  # checked by validate(); the derived seed is the run's, for every prompt, greedy or not
        return GenerationConfig(max_new_tokens=self.room(prompt_ids), temperature=c.temperature, top_p=c.top_p,
                                seed=derive_seed(c.seed, prompt.id))


def output_record(prompt: Prompt, conversation: list[dict], answered: list[tuple[list[int], list[int], str]]) -> dict:
    """A prompt's output record: the last turn's exact prompt and answer ids, and each earlier turn's in
    `earlier_turns` (a later turn's prompt holds the earlier answers as the chat template renders their text,
    which need not be the ids the target produced, so each turn keeps its own; `earlier_turn_record`)."""
    (prompt_ids, response_ids, finish_reason), earlier = answered[-1], answered[:-1]
    record = {"id": prompt.id, "prompt_hash": prompt.hash, "messages": conversation, "prompt_ids": prompt_ids,
              "response_ids": response_ids, "finish_reason": finish_reason}
    if earlier:
        from dflash.training.data import earlier_turn_record

        record["earlier_turns"] = [earlier_turn_record(ids, out, prompt_ids) for ids, out, _ in earlier]
    return record


def warn_capped(count: int, message: str, more: str) -> None:
    """The `count`-th warning of a kind: named up to MAX_WARNINGS, then `more` once (the summary counts them)."""
    if count <= MAX_WARNINGS:
        _warn(message)
    elif count == MAX_WARNINGS + 1:
        _warn(more)


def _warn(message: str) -> None:
    print(f"dflash datagen: warning: {message}", file=sys.stderr, flush=True)
