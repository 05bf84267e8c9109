"""JSONL files of records, and the checks of their fields, shared by `dflash bench`, `datagen` and `train`.

Every problem is a `UserError`. One with the file is named by its line ("data.jsonl:12 is not valid JSON");
one with a field (`RecordError`) says what the field must be, and the caller, who knows where the record came
from, puts that in front ("data.jsonl:12: `turns` must be a list of ...").
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from dflash.errors import UserError


class RecordError(UserError):
    """What is wrong with one record's fields; the caller adds where the record is."""


def read_jsonl(path: str | Path, missing: str, limit: int | None = None) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a JSONL file (gzipped when named *.gz), each a JSON
    object; `limit`: stop after that many. `missing` tells a user whose file does not exist what to pass."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist; {missing}")
    if path.is_dir():
        raise UserError(f"{path} is a directory; give a JSONL file (one JSON object per line)")
    opener = gzip.open if path.suffix == ".gz" else open
    records: list[tuple[int, dict]] = []
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if limit is not None and len(records) >= limit:
                    break
                record = _json_line(raw, path, number)
                if record is not None:
                    records.append((number, record))
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise UserError(f"{path} is not a readable gzip file ({err}); name an uncompressed file *.jsonl, "
                        "or compress it with gzip") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    if not records:
        raise UserError(f"{path} has no records; give a file with one JSON object per line")
    return records


def _json_line(raw: bytes, path: Path, number: int) -> dict | None:
    """One line as an object (None when blank); a line that is not one is an error naming it."""
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}:{number} is not UTF-8 text (byte {raw[err.start]:#04x} at column "
                        f"{err.start + 1}); save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line.rstrip("\r\n"))  # a string cut at the line's end is unterminated, not a control
    except json.JSONDecodeError as err:
        where = f"{err.msg.removesuffix(' at')} at column {err.colno}"  # some of json's messages end in "at"
        raise UserError(f"{path}:{number} is not valid JSON ({where}); {_jsonl_hint(raw, line, number)}") from None
    except RecursionError:
        raise UserError(f"{path}:{number} is nested too deeply to read (arrays or objects inside each other "
                        "beyond Python's recursion limit); fix or remove that line") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{number} is {shown(record)}, not a JSON object; each line must be one object "
                        'such as {"prompt": ...}')
    return record


def _jsonl_hint(raw: bytes, line: str, number: int) -> str:
    """What a line that is not JSON most likely is, and what to do about it."""
    start = line.strip()[:1]
    if not raw.endswith(b"\n") and start == "{":
        return ("it is the last line and ends without a newline, cut short: if `dflash datagen` wrote the file, it "
                "was stopped while writing, and a rerun finishes it (it continues where it stopped); otherwise "
                "complete or remove that line")
    if number == 1 and start == "[":
        return ("the file looks like one JSON array; JSONL holds one JSON object per line: write each element on a "
                "line of its own")
    if start not in ("{", '"') and "," in line:
        return "the file looks like CSV; JSONL holds one JSON object per line, such as {\"prompt\": \"...\"}"
    return "the file must be JSONL, one JSON object per line"


def shown(value, width: int = 60) -> str:
    """A value as a message quotes it: JSON, cut to `width` characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def text_field(record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"`{name}` must be a non-empty string, got {shown(value)}")
    return value


def texts_field(record: dict, name: str, allow_empty: bool = False) -> list[str]:
    """A list of non-empty strings; a bare string is an error here, never split into characters."""
    value = record.get(name)
    if isinstance(value, str):
        raise RecordError(f'`{name}` must be a list of strings, e.g. ["first", "second"], not one string; got '
                          f"{shown(value)}")
    if (not isinstance(value, list) or not (value or allow_empty)
            or not all(isinstance(t, str) and t.strip() for t in value)):
        raise RecordError(f"`{name}` must be a {'' if allow_empty else 'non-empty '}list of non-empty strings, "
                          f"got {shown(value)}")
    return value


def messages_field(record: dict, name: str = "messages") -> list[dict]:
    """A non-empty chat list of {"role": str, "content": str} objects."""
    value = record.get(name)
    if not isinstance(value, list) or not value:
        raise RecordError(f'`{name}` must be a non-empty list of {{"role": ..., "content": ...}} objects, got '
                          f"{shown(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RecordError(f'`{name}`[{i}] needs a string "role" and a string "content" (join the text of '
                              f"content parts), got {shown(m)}")
    return value


# ShareGPT's speakers (`conversations` of {"from", "value"}), as chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


PROMPT_FIELDS = ("prompt", "question", "instruction", "text")  # a prompt's field, in this order, without chat or turns


def prompt_field_of(record: dict) -> str | None:
    """The field a record without messages or turns has its prompt in (PROMPT_FIELDS, in order), or None."""
    return next((name for name in PROMPT_FIELDS if name in record), None)


def has_chat(record: dict) -> bool:
    return "messages" in record or "conversations" in record


def chat_messages(record: dict) -> list[dict]:
    """A record's chat as {"role", "content"} messages: its `messages`, or ShareGPT's `conversations` of
    {"from": "human" | "gpt" | "system", "value": text} (or of role/content messages)."""
    if "messages" in record and "conversations" in record:
        raise RecordError("the record has both `messages` and `conversations`; keep the one conversation it holds")
    if "messages" in record:
        return messages_field(record)
    value = record.get("conversations")
    if not isinstance(value, list) or not value:
        raise RecordError(f'`conversations` must be a non-empty list of {{"from": ..., "value": ...}} objects, got '
                          f"{shown(value)}")
    if all(isinstance(m, dict) and "role" in m for m in value):
        return messages_field(record, "conversations")
    messages = []
    for i, m in enumerate(value):
        speaker = m.get("from") if isinstance(m, dict) else None
        if not isinstance(speaker, str) or not isinstance(m.get("value"), str):
            raise RecordError(f'`conversations`[{i}] needs a string "from" and a string "value", got {shown(m)}')
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            raise RecordError(f'`conversations`[{i}] is from {speaker!r}; ShareGPT speakers are '
                              f"{', '.join(sorted(SHAREGPT_ROLES))}")
        messages.append({"role": role, "content": m["value"]})
    return messages


def read_json_object(path: Path, what: str, fix: str, keys: tuple[str, ...] = ()) -> dict:
    """A JSON file holding one object with at least `keys` (a manifest, a settings file, as dflash writes them);
    anything else, the user's own file of that name say, is an error saying it is not `what`, and `fix`."""
    try:
        value = json.loads(Path(path).read_text()) if Path(path).is_file() else None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}; {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        value = None
    if not isinstance(value, dict) or not set(keys) <= value.keys():
        raise UserError(f"{path} is not {what}; {fix}")
    return value
