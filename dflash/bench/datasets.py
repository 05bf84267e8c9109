"""The benchmark datasets and their usual DFlash prompt formats.

A `Sample` is one conversation to decode: fixed `history` messages (usually none) and the user `turns`,
answered one after another by the model itself (mt-bench has two turns; the others one).

Where a dataset comes from, first found wins:
    1. --data-file FILE.jsonl      the dataset's own records, or any records with `prompt`, `turns` or `messages`
    2. --data-dir DIR / $DFLASH_DATA_DIR   laid out like the bundled copies (gsm8k/test.jsonl, ...)
    3. the copies bundled with the package (all five; see dflash/bench/data/README.md)
    4. the Hugging Face Hub through `datasets`
"""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from dflash import hub
from dflash.config_types import split_list
from dflash.errors import DFlashWarning, UserError, in_brief
from dflash.extras import require
from dflash.records import RecordError, chat_messages, has_chat, read_jsonl, text_field, texts_field

BUNDLED_DIR = Path(__file__).parent / "data"
DATA_DIR_ENV = "DFLASH_DATA_DIR"

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


@dataclass(frozen=True)
class Sample:
    id: str
    turns: tuple[str, ...]  # user turns; each is answered by the model before the next is sent
    history: tuple[dict, ...] = ()  # fixed chat messages before the first turn


@dataclass(frozen=True)
class Record:
    fields: dict
    where: str  # "FILE:LINE" or "HUB_ID row N": named in every error about this record


@dataclass(frozen=True)
class HubSource:
    path: str
    config: str | None
    split: str


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    files: tuple[str, ...]  # candidate paths inside a data directory, first found is used
    native_fields: tuple[str, ...]  # a record with all of these is in the dataset's own format
    format: Callable[[dict], tuple[str, ...]]  # native record -> user turns (raises RecordError)
    hub: HubSource | None = None
    id_field: str | None = None


def _gsm8k(record: dict) -> tuple[str, ...]:
    return (text_field(record, "question") + MATH_SUFFIX,)


def _math500(record: dict) -> tuple[str, ...]:
    return (text_field(record, "problem") + MATH_SUFFIX,)


def humaneval_prompt(code: str) -> str:
    """HumanEval's usual prompt: the function stub (signature and docstring) in a fenced block."""
    return CODE_PREFIX + code + "\n```"


def mbpp_prompt(task: str, tests: list[str]) -> str:
    """MBPP's usual prompt: the task, then the assert lines the solution must pass."""
    return (f"You are an expert Python programmer, and here is your task: {task} "
            "Your code should pass these tests:\n\n" + "\n".join(tests))


def _humaneval(record: dict) -> tuple[str, ...]:
    return (humaneval_prompt(text_field(record, "prompt")),)


def _mbpp(record: dict) -> tuple[str, ...]:
    tests = list(texts_field(record, "test_list", allow_empty=True))
    if "prompt" not in record and "text" not in record:
        raise RecordError("an mbpp record needs the task in 'prompt' (sanitized MBPP) or 'text' (full MBPP)")
    return (mbpp_prompt(text_field(record, "prompt" if "prompt" in record else "text"), tests),)


def _mt_bench(record: dict) -> tuple[str, ...]:
    return tuple(texts_field(record, "turns"))


DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", ("gsm8k/test.jsonl",), ("question",), _gsm8k,
                         HubSource("openai/gsm8k", "main", "test")),
    "math500": DatasetSpec("math500", ("math500/test.jsonl", "MATH-500/test.jsonl"), ("problem",), _math500,
                           HubSource("HuggingFaceH4/MATH-500", None, "test"), id_field="unique_id"),
    "humaneval": DatasetSpec("humaneval", ("humaneval/HumanEval.jsonl.gz", "humaneval/HumanEval.jsonl"),
                             ("prompt", "entry_point"), _humaneval,
                             HubSource("openai/openai_humaneval", None, "test"), id_field="task_id"),
    "mbpp": DatasetSpec("mbpp", ("mbpp/test.jsonl", "mbpp/sanitized-mbpp.jsonl"), ("test_list",), _mbpp,
                        HubSource("google-research-datasets/mbpp", "full", "test"), id_field="task_id"),
    "mt-bench": DatasetSpec("mt-bench", ("mt-bench/question.jsonl",), ("turns",), _mt_bench,
                            id_field="question_id"),
}
ALIASES = {"math-500": "math500", "math": "math500", "mt_bench": "mt-bench", "mtbench": "mt-bench",
           "human_eval": "humaneval", "openai_humaneval": "humaneval"}


@dataclass
class DataOptions:
    data_file: str | None = None
    data_dir: str | None = None  # None: $DFLASH_DATA_DIR, if set
    max_samples: int | None = None  # None or 0: every sample
    seed: int = 0
    use_hub: bool = True
    extra_dirs: list[Path] = field(default_factory=lambda: [BUNDLED_DIR])
    label: str | None = None  # the name a --data-file's results go by; None: the dataset's

    def labelled(self, name: str) -> str:
        """What a dataset's results are called: `label` for the data file's, else its name."""
        return self.label if self.label and self.data_file else name


def resolve_names(names: Iterable[str]) -> list[str]:
    """Dataset names from flags (`all`, aliases, comma lists), validated, in the order given."""
    out: list[str] = []
    for raw in names:
        try:
            parts = split_list(raw)  # as the number lists read theirs
        except ValueError:
            raise UserError(f"--dataset {raw!r} holds an empty name between commas; write the names as gsm8k,mbpp") \
                from None
        for name in (n.lower() for n in parts):
            if name == "all":
                out.extend(DATASETS)
                continue
            name = ALIASES.get(name, name)
            if name not in DATASETS:
                file = " (a file of prompts goes to --data-file)" if any(c in name for c in "./\\") else ""
                raise UserError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)} or 'all'{file}")
            out.append(name)
    if not out:
        raise UserError(f"no dataset given: pass --dataset with one of {', '.join(DATASETS)}, or 'all'")
    return list(dict.fromkeys(out))


def load_samples(name: str, options: DataOptions) -> list[Sample]:
    """The samples of one dataset, from the first source that has it, subset by max_samples/seed."""
    spec = DATASETS[resolve_names([name])[0]]
    source = find_source(spec, options)
    _warn_if_not_in_the_given_dir(spec, options, source)
    samples = [_to_sample(spec, record, i) for i, record in enumerate(_read(source, spec))]
    if not samples:
        raise UserError(f"{spec.name}: {describe(source)} has no records; give a file with one JSON object per line")
    return subset(_distinct_ids(samples), options.max_samples, options.seed)


def _distinct_ids(samples: list[Sample]) -> list[Sample]:
    """Samples whose ids repeat an earlier one's get ' (2)', ' (3)', ...: answers are matched by id."""
    seen: set[str] = set()
    # the last suffix each id got: the next search starts there (counting from 2 each time took the square of the
    # repeats, minutes for a file of 100,000 records of one id)
    last: dict[str, int] = {}
    out = []
    for sample in samples:
        sample_id, n = sample.id, last.get(sample.id, 1)
        while sample_id in seen:
            n += 1
            sample_id = f"{sample.id} ({n})"
        last[sample.id] = n
        seen.add(sample_id)
        out.append(sample if sample_id == sample.id else replace(sample, id=sample_id))
    return out


def data_source(name: str, options: DataOptions) -> str:
    """Where `load_samples` reads a dataset from: a file path, or the hub dataset's id."""
    return describe(find_source(DATASETS[resolve_names([name])[0]], options))


def subset(samples: list[Sample], max_samples: int | None, seed: int) -> list[Sample]:
    """A deterministic subset: the same `seed` picks the same samples, kept in dataset order."""
    if not max_samples or max_samples >= len(samples):
        return samples
    picked = sorted(random.Random(seed).sample(range(len(samples)), max_samples))
    return [samples[i] for i in picked]


def request_seed(seed: int, sample_index: int, turn: int) -> int:
    """The seed a bench run seeded `seed` samples turn `turn` of its sample `sample_index` with (the same for plain
    decoding and DFlash, locally and on both servers): a hash (`derive_seed`), so that no two turns share one (with
    seed + index + turn, a sample's second turn drew what the next sample's first did), in [0, 2**31) so that any
    server takes it."""
    from dflash.decoding.sampling import derive_seed

    return derive_seed(derive_seed(seed, sample_index), turn) % 2**31


# ---- sources ----------------------------------------------------------------------------------------
def find_source(spec: DatasetSpec, options: DataOptions) -> Path | HubSource:
    if options.data_file:
        return Path(options.data_file)
    for directory in _data_dirs(options):
        for relative in spec.files:
            path = directory / relative
            if path.is_file():
                return path
    if spec.hub is not None and options.use_hub:
        return spec.hub
    raise UserError(_missing_message(spec))


def _warn_if_not_in_the_given_dir(spec: DatasetSpec, options: DataOptions, source: Path | HubSource) -> None:
    """A warning when the user gave a data directory and the dataset comes from elsewhere: a wrong directory
    would otherwise measure the bundled copy unnoticed."""
    given = _given_data_dir(options)
    if options.data_file or not given or (isinstance(source, Path) and source.is_relative_to(given)):
        return
    flag = "--data-dir" if options.data_dir else f"${DATA_DIR_ENV}"
    warnings.warn(f"{flag} {given} has no {' or '.join(spec.files)}; {spec.name} comes from {describe(source)}",
                  DFlashWarning, stacklevel=3)


def describe(source: Path | HubSource) -> str:
    return f"{source.path} (Hugging Face Hub)" if isinstance(source, HubSource) else str(source)


def _read(source: Path | HubSource, spec: DatasetSpec) -> list[Record]:
    if isinstance(source, HubSource):
        return [Record(r, f"{source.path} row {i}") for i, r in enumerate(load_from_hub(spec))]
    rows = read_jsonl(source, missing="pass an existing JSONL file to --data-file")
    return [Record(fields, f"{source}:{number}") for number, fields in rows]


def _given_data_dir(options: DataOptions) -> str | None:
    return options.data_dir or os.environ.get(DATA_DIR_ENV)


def _data_dirs(options: DataOptions) -> list[Path]:
    dirs = []
    given = _given_data_dir(options)
    if given:
        if not Path(given).is_dir():
            what = "is a file, not a directory" if Path(given).is_file() else "does not exist"
            raise UserError(f"data directory {given} {what}; fix --data-dir or ${DATA_DIR_ENV} (a directory holding "
                            "gsm8k/test.jsonl, ...; a single file goes to --data-file)")
        dirs.append(Path(given))
    return dirs + list(options.extra_dirs)


def load_from_hub(spec: DatasetSpec) -> list[dict]:
    """The dataset from the Hugging Face Hub, or the local `datasets` cache alone when the hub cannot be reached
    (`hub.unreachable`, asked once with a bounded wait)."""
    require(["datasets"], f"{_missing_message(spec)}; reading it from the hub")
    import datasets
    cache_only, refused = hub.look_up(spec.hub.path, repo_type="dataset",
                                      instead="give the data with --data-file or --data-dir")
    try:
        with hub.datasets_offline(cache_only is not None):
            data = datasets.load_dataset(spec.hub.path, spec.hub.config, split=spec.hub.split)
    except Exception as err:  # offline, gated repo, a cache without it: all mean "give the data another way"
        if refused is not None:
            raise UserError(f"{_missing_message(spec)} ({refused})") from None
        cause = (None if cache_only is None else cache_only if hub.offline()
                 else f"the hub is not reachable ({cache_only})")
        why = (f"{cause}, and the local datasets cache has no copy of {spec.hub.path} ({in_brief(err)})" if cause
               else f"Hugging Face `datasets` could not load {spec.hub.path}: {in_brief(err)}")
        raise UserError(f"{_missing_message(spec)} ({why})") from None
    if refused is not None:
        hub.warn_cached_copy(refused, spec.hub.path)
    return [dict(r) for r in data]


def _missing_message(spec: DatasetSpec) -> str:
    return (f"no data for {spec.name}: pass --data-file FILE.jsonl (one JSON object per line, with "
            f"{'/'.join(repr(f) for f in spec.native_fields)} or 'prompt'/'turns'/'messages'), or put "
            f"{spec.files[0]} under --data-dir DIR (or ${DATA_DIR_ENV})"
            + (f", or connect to the Hugging Face Hub ({spec.hub.path})" if spec.hub else ""))


# ---- records -> samples -----------------------------------------------------------------------------
def _to_sample(spec: DatasetSpec, record: Record, index: int) -> Sample:
    try:
        return _sample(spec, record.fields, index)
    except RecordError as err:
        raise UserError(f"{record.where}: {err}") from None


def _sample(spec: DatasetSpec, fields: dict, index: int) -> Sample:
    sample_id = str(fields.get(spec.id_field or "", fields.get("id", index)))
    if all(f in fields for f in spec.native_fields):
        return Sample(sample_id, spec.format(fields))
    if has_chat(fields):
        history, turn = _split_messages(fields)
        return Sample(sample_id, (turn,), history)
    if "turns" in fields:
        return Sample(sample_id, tuple(texts_field(fields, "turns")))
    if "prompt" in fields:
        return Sample(sample_id, (text_field(fields, "prompt"),))
    raise RecordError(f"a {spec.name} record needs the field(s) {'/'.join(repr(f) for f in spec.native_fields)}, "
                    f"or 'prompt', 'turns', 'messages' or 'conversations'; it has none of the fields (it has "
                    f"{sorted(fields)[:8]})")


def _split_messages(fields: dict) -> tuple[tuple[dict, ...], str]:
    """Fixed history and the last user turn; trailing assistant messages (reference answers) are dropped."""
    messages = list(chat_messages(fields))
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        last = messages[-1]["role"] if messages else None
        spelled = (f"; roles are lowercase: its last role is {last!r}, not 'user'"
                   if isinstance(last, str) and last.lower() == "user" and last != "user" else "")
        raise RecordError("the conversation must end with a non-empty user message to answer (assistant messages "
                          f"after it are dropped){spelled}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages[:-1]), messages[-1]["content"]
