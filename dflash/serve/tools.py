"""Tool calls: a chat request's `tools` and `tool_choice`, and its answers read as OpenAI's `tool_calls`.

How an answer becomes tool calls depends on `tool_choice`:

    "none":      never; the answer is text.
    "auto":      the model decides, and writes its calls as its chat template taught it. This server reads Hermes'
                 form, which Qwen's (2.5, 3) and Hermes' templates use: `<tool_call>{"name": ..., "arguments":
                 {...}}</tool_call>`, one block per call; the text before the first block is the message's content.
                 An answer whose blocks are not such JSON stays text, as vLLM leaves it.
    "required":  a grammar holds the answer to a JSON array of calls, [{"name": ..., "arguments": {...}}, ...],
                 each name a tool's and its arguments that tool's parameters (one call without
                 parallel_tool_calls).
    a function:  a grammar holds the answer to that function's arguments.

The grammars are structured output's (`dflash.decoding.structure`), so drafting stays lossless. A stream sends the
content as it comes, holds back what may begin a `<tool_call>` block, and sends each call whole once the answer ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def writes_hermes_calls(tokenizer) -> str | None:
    """None where the model writes its calls in Hermes' form as its chat template teaches it, and the text answers
    show holds them; else why auto cannot read its calls."""
    problem = hermes_template_problem(str(getattr(tokenizer, "chat_template", None) or ""))
    if problem is None and HERMES_START in (getattr(tokenizer, "all_special_tokens", None) or ()):
        return f"its tokenizer marks {HERMES_START} as a special token, which the answer's text leaves out"
    return problem


def hermes_template_problem(template: str) -> str | None:
    """None where a chat template teaches calls in Hermes' form (JSON in <tool_call> blocks); else what it teaches."""
    if HERMES_START not in template:
        return "its chat template teaches another form"
    if "<function=" in template:  # Qwen3-Coder's XML inside the block: <function=NAME><parameter=KEY>...
        return "its chat template writes XML inside the blocks (Qwen3-Coder's form: vLLM's qwen3_coder parser reads it)"
    return None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's form; with `index`, a stream delta's."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id; arguments (an object, or JSON text of one) as JSON text. A ValueError for arguments
    JSON cannot hold (a non-finite number)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


# llguidance's option for compact JSON: whitespace only where JSON needs it, as OpenAI's calls are written. With
# whitespace free, a weak model can fill its answer with blanks between the brackets (the tests' random one did).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a required answer: an array of calls, each naming a tool and holding its arguments. Each
    tool's parameters sit whole under $defs, their own references ("#", "#/$defs/X") moved there with them, so a
    schema with definitions (pydantic's nested models) or recursion means what it meant at its own root."""
    defs = {f"tool{i}": _rebased(_parameters(t), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    one_of = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
               "properties": {"name": {"const": t["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"}}}
              for i, t in enumerate(tools)]
    schema: dict[str, Any] = {**COMPACT, "$defs": defs, "type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, base: str) -> Any:
    """The schema with its document-local references ("#...") pointing under `base` instead of its root."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a named function's answer: its arguments."""
    return {**COMPACT, **_parameters(tool)}  # the tool's own x-guidance options, if any, win


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object"}


def hermes_calls(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """(content, calls) of an answer in Hermes' form, or None when it holds no call or a block is not one (the
    answer is text then). The content is the text before the first block; text after a block's end is dropped, as
    vLLM drops it. The last block may lack its closing tag (an answer cut at a stop)."""
    start = text.find(HERMES_START)
    if start < 0:
        return None
    calls = []
    for block in text[start:].split(HERMES_START)[1:]:
        call = _call(block.partition(HERMES_END)[0])
        if call is None:
            return None
        calls.append(call)
    return text[:start] or None, calls


def json_calls(text: str) -> list[ToolCall] | None:
    """The calls of a required answer (a JSON array of {"name", "arguments"}); None when it is not one (cut short)."""
    try:
        items = _loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_from_object(item) for item in items]
    return None if any(c is None for c in calls) else calls


def _call(body: str) -> ToolCall | None:
    try:
        return _from_object(_loads(body))
    except ValueError:
        return None


def _loads(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity (Python's extensions) are no JSON; a ValueError as for any text
    that is not JSON."""
    return json.loads(text, parse_constant=_not_json)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _from_object(item: Any) -> ToolCall | None:
    """A call from {"name": ..., "arguments": {...}} ("parameters" as some templates name them)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return new_call(item["name"], arguments)
    except ValueError:  # a number beyond a float's range (1e400): JSON cannot say it again
        return None


class ToolReader:
    """How one request's answers are read: `mode` is "none", "auto", "required" or "named" (then `name`)."""

    def __init__(self, mode: str, name: str | None = None, parallel: bool = True):
        self.mode, self.name, self.parallel = mode, name, parallel

    @property
    def holds_text(self) -> bool:
        """Whether a stream sends nothing until the answer ends (a grammar's JSON answer: all of it is calls)."""
        return self.mode in ("required", "named")

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; no calls: the text is the content."""
        if self.mode == "named":
            calls = _named(self.name, text)
            return (None, calls) if calls else (text, [])
        if self.mode == "required":
            calls = json_calls(text)
            return (None, calls[: 1 if not self.parallel else None]) if calls else (text, [])
        if self.mode == "auto":
            read = hermes_calls(text)
            if read is not None:
                content, calls = read
                return content, calls[: 1 if not self.parallel else None]
        return text, []

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _named(name: str | None, text: str) -> list[ToolCall]:
    try:
        arguments = _loads(text)
        return [new_call(name or "", arguments)] if isinstance(arguments, dict) else []
    except ValueError:
        return []


class ToolStream:
    """One streamed choice's text, read for calls: `add` passes on the content safe to send; `finish` gives the
    rest of the content and the calls. Without tools it passes every piece on and keeps none."""

    def __init__(self, reader: ToolReader):
        self.reader = reader
        self.parts: list[str] = []  # the answer's text so far, joined once at the end
        self.sent = 0  # characters of it sent as content
        self.held = ""  # auto: the last characters sent on, held while they may begin a block
        self.in_block = False  # auto: a block began; the rest waits for the end

    def add(self, piece: str) -> str:
        if self.reader.mode == "none":
            return piece
        self.parts.append(piece)
        if self.reader.holds_text or self.in_block:
            return ""
        window = self.held + piece
        start = window.find(HERMES_START)
        if start >= 0:
            self.in_block, self.held = True, ""
            return self._send(window[:start])
        keep = _partial_start(window, HERMES_START)
        self.held = window[len(window) - keep:]
        return self._send(window[:len(window) - keep])

    def finish(self, piece: str) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the answer ended, with its last piece."""
        if self.reader.mode == "none":
            return piece, []
        self.parts.append(piece)
        text = "".join(self.parts)
        content, calls = self.reader.read(text)
        # what went out is where the content starts: text before any block, which is the content when calls are read
        return ((content or "")[self.sent:], calls) if calls else (text[self.sent:], [])

    def _send(self, text: str) -> str:
        self.sent += len(text)
        return text


def _partial_start(text: str, marker: str) -> int:
    """How many of text's last characters begin `marker` (0: none), so that they wait for the next piece."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
