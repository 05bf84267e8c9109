"""The OpenAI wire format: request models for /v1/chat/completions and /v1/completions, response bodies,
and OpenAI-style error objects `{"error": {"message", "type", "param", "code"}}`.

Requests are validated strictly (a string where a number belongs is a 400, never coerced); null means the
default, as in OpenAI's API. Unknown fields are ignored, as OpenAI clients send fields this server has no use
for; known options it cannot honour (the deprecated functions, ..., and vLLM's own sampling and guided-decoding
extensions but min_p, min_tokens, repetition_penalty and guided_json / guided_regex / guided_choice) are refused with
a 400 naming the field unless left at their defaults. A chat request's tools are shown to the model through its chat
template, and its answers read back as tool calls (`dflash.serve.tools`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash.decoding.detokenizer import check_utf8
from dflash.decoding.engine import SEED_RANGE
from dflash.decoding.logprobs import MAX_TOP_LOGPROBS, check_top
from dflash.decoding.penalties import MAX_PENALTY
from dflash.decoding.sampling import MAX_LOGIT_BIAS
from dflash.errors import UserError
from dflash.records import shown
from dflash.serve.tools import ToolReader, arguments_schema, calls_schema

log = logging.getLogger("dflash.serve")

MAX_STOP_STRINGS = 16
# Characters in one stop string: every decode step looks for each in the text's tail, on the thread that decodes every
# request, so one request's huge stop strings would slow them all.
MAX_STOP_STRING_CHARS = 1000


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests -------------------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant", "tool")

# What a union-typed field must be, for the error when a value fits none of its forms (pydantic would list
# one complaint per form instead).
_UNION_FIELDS = {
    "content": "a string, a list of text parts like {\"type\": \"text\", \"text\": \"...\"}, or null",
    "prompt": "a string, a list of token ids (integers), or a batch: a list of strings or a list of token id lists",
    "stop": f"a string, a list of up to {MAX_STOP_STRINGS} strings, or null",
    "logprobs": "a boolean, an integer or null",
    "tool_choice": '"none", "auto", "required", {"type": "function", "function": {"name": ...}} or null',
    "arguments": "JSON text of an object, or an object",
}


class _Strict(BaseModel):
    """Strict types; unknown fields ignored; null for an optional field means its default, as in OpenAI's API."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; this server reads text "
                             "only: send parts like {\"type\": \"text\", \"text\": \"...\"}")
        if self.text is None:
            raise ValueError("a content part of type 'text' needs its text: {\"type\": \"text\", \"text\": \"...\"}")
        return self


# A function's name: OpenAI's rule (letters, digits, _ and -) with the dots and colons that tools bridged from other
# protocols carry (MCP's server.tool), as vLLM takes them
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _function_name(name: str) -> str:
    if not FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{shown(name)} is not a function name: 1 to 128 letters, digits, underscores, dashes, dots "
                         "or colons")
    return name


class FunctionCall(_Strict):
    """A call an earlier assistant turn made. Its arguments (JSON text, as OpenAI sends them) reach the chat template
    as an object, as the templates read them (Qwen's, Llama's: `arguments | tojson`) and vLLM passes them."""

    name: str
    arguments: str | dict[str, Any]

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments):
        if isinstance(arguments, dict):
            return arguments
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError(f"must be JSON text of an object, as OpenAI sends a call's arguments; got "
                             f"{shown(arguments)}") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be JSON text of an object (a call's arguments by name), got {shown(arguments)}")
        return value


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: any object
    strict: bool | None = None  # a grammar holds a required or named call's arguments to the schema either way

    @field_validator("name")
    @classmethod
    def _named_as_openai_names(cls, name: str) -> str:
        return _function_name(name)

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters):
        kind = parameters.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(f"must be the JSON schema of an object (the arguments by name: {{\"type\": \"object\", "
                             f"\"properties\": {{...}}}}), not of type {shown(kind)}")
        return parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    # passed on to the chat template, which may render them (a speaker's name, an earlier turn's tool calls)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning (vLLM's reasoning parsers return it)
    reasoning: str | None = None  # the same, as newer vLLM names it

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"{role!r} is not a role; use one of {', '.join(ROLES)}")
        return role

    @model_validator(mode="after")
    def _content_unless_calling_tools(self):
        if self.content is None and self.role != "assistant":  # an assistant turn may hold tool calls only
            raise ValueError(f"a {self.role} message needs its content (a string or a list of text parts)")
        return self

    def for_template(self) -> dict[str, Any]:
        message = {"role": self.role, "content": self.text()}  # a developer role is the template's (chat.py)
        calls = None if self.tool_calls is None else [c.model_dump(exclude_none=True) for c in self.tool_calls]
        extras = {"name": self.name, "tool_calls": calls, "tool_call_id": self.tool_call_id,
                  "reasoning_content": self.reasoning_content, "reasoning": self.reasoning}
        return {**message, **{k: v for k, v in extras.items() if v is not None}}

    def text(self) -> str:
        """The message's text; text parts are joined with newlines, as other OpenAI-compatible servers do."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the schema binds either way
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"name": ..., "schema": {...}}')
        return self


_ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any JSON object
# field -> (is the value the default?, what to send instead): options refused with a 400 rather than ignored
Refusals = dict[str, tuple[Callable[[Any], bool], str]]


def _unset(value: Any) -> bool:
    """None, False, 0, "", [] and {}: an option left at its default."""
    return not value


class SamplingRequest(_Strict):
    """Fields both endpoints share. `ignore_eos` is an extension (as in vLLM) for fixed-length benchmarks."""

    model: str | None = None
    max_tokens: int | None = None  # >= 0 here (`_tokens_not_negative`); 0 is refused after the options
    # (see `check_supported`)
    # None (left out): the server's default (`sampling_defaults`: the target's generation_config.json, or OpenAI's)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: no top-k
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)  # as in vLLM; 0: no min-p
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])  # the range torch generators take
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # as in vLLM: stop at these ids too (besides EOS unless ignore_eos)
    user: str | None = None
    n: int = Field(default=1, ge=1)  # choices, decoded together (a seed gives choice i seed + i, as vLLM does)
    logprobs: bool | int | None = None
    echo: bool = False
    # OpenAI's penalties (`dflash.decoding.penalties`); None: 0
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    # vLLM's (and transformers'); None: the server's default (`sampling_defaults`: the target's generation config's)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON keys) -> bias in [-100, 100]
    # vLLM's sampling and output extensions; a client moving from vLLM sends them, and ignoring one would change
    # the answer unseen (any type: the refusal names the field whatever its value)
    min_tokens: int | None = Field(default=None, ge=0)  # no stop (EOS, stop ids or strings) before this many tokens
    bad_words: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_token_ids: bool = False  # vLLM's: each choice's token_ids (its stop token included) and prompt_token_ids
    # vLLM's: the prompt tokens' log-probabilities, with this many alternatives each (`logprobs.vllm_prompt_logprobs`)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's structured output: a JSON schema (or its text),
    guided_regex: str | None = None  # a regular expression,
    guided_choice: list[str] | None = Field(default=None, min_length=1)  # or one of these strings
    guided_grammar: Any = None
    structured_outputs: Any = None
    response_format: ResponseFormat | None = None

    _UNSUPPORTED: ClassVar[Refusals] = {
        "bad_words": (_unset, "this server bans no words; leave bad_words out"),
        "allowed_token_ids": (_unset, "this server does not restrict the vocabulary; leave allowed_token_ids out"),
        "logits_processors": (_unset, "this server runs no logits processors; leave logits_processors out"),
        "use_beam_search": (_unset, "this server does not search beams; leave use_beam_search out"),
        "length_penalty": (lambda v: v in (None, 1), "this server does not search beams; leave length_penalty out"),
        "truncate_prompt_tokens": (lambda v: v is None, "this server does not cut prompts; shorten the prompt "
                                   "yourself and leave truncate_prompt_tokens out"),
        "include_stop_str_in_output": (_unset, "this server cuts the answer before the stop string; leave "
                                       "include_stop_str_in_output out and add the stop string yourself"),
        "skip_special_tokens": (lambda v: v in (None, True), "this server's text leaves special tokens out; leave "
                                "skip_special_tokens out"),
        "spaces_between_special_tokens": (lambda v: v in (None, True), "this server's text leaves special tokens "
                                          "out; leave spaces_between_special_tokens out"),
        "guided_grammar": (lambda v: v is None, "this server holds an answer to a JSON schema or a regex, not a "
                           "grammar; leave guided_grammar out and send response_format, guided_json, guided_regex or "
                           "guided_choice"),
        "structured_outputs": (lambda v: v is None, "this server takes structured output as response_format, "
                               "guided_json, guided_regex or guided_choice; leave structured_outputs out and send "
                               "one of those"),
    }

    def check_supported(self) -> None:
        """Refuse options this server would otherwise silently ignore, then a limit of no new tokens where the
        endpoint has no use for one (`scores_prompt`)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true (as in OpenAI's API and vLLM); leave "
                                "it out or send stream=true", param="stream_options")
        for name, (at_default, advice) in self._UNSUPPORTED.items():
            value = getattr(self, name)
            if not at_default(value):
                raise APIError(400, f"{name}={_show(value)} is not supported: {advice}", param=name)
        self.check_logprobs()
        if self.return_token_ids and self.stream:
            raise APIError(400, "return_token_ids is returned with the whole answer here, not in a stream; send "
                                "stream=false, or leave return_token_ids out", param="return_token_ids")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is returned with the whole answer, not in a stream (as in vLLM); "
                                "send stream=false, or leave prompt_logprobs out", param="prompt_logprobs")
        if self.prompt_logprobs is not None and self.echoes and self.top_logprobs_asked is not None:
            raise APIError(400, "prompt_logprobs and echo with logprobs both score the prompt; send one of them",
                           param="prompt_logprobs")
        if self.token_limit == 0 and not self.scores_prompt:
            raise APIError(400, f"{self.token_limit_field}: must be at least 1 (the number of new tokens to "
                                f"generate){self.no_tokens_hint}", param=self.token_limit_field)

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)  # the latter: chat requests only
    @classmethod
    def _tokens_not_negative(cls, value):
        """A negative token limit, said as a limit of 0 is (`check_supported`)."""
        if value is not None and value < 0:
            raise ValueError(f"must be at least 1 (the number of new tokens to generate), got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("a stop string is empty (every answer would stop before its first token); drop it")
        stops = [stop] if isinstance(stop, str) else stop or []
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string of {longest} characters; this server takes up to "
                             f"{MAX_STOP_STRING_CHARS} per stop string")
        for text in stops:  # here, so that the error names `stop` (the engine refuses it too, naming no field)
            try:
                check_utf8(text, f"the stop string {text!r}")
            except UserError as err:
                raise ValueError(str(err)) from None
        return stop

    def tool_reader(self) -> ToolReader:
        """How the answers are read for tool calls: never, but on chat with tools."""
        return ToolReader("none")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The request field that sets how many tokens to generate, for error messages."""
        return "max_tokens"

    def check_logprobs(self) -> None:
        """Refuse a logprobs request this endpoint reads otherwise (`top_logprobs_asked`)."""

    def structure(self) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """(json_schema, regex, the field that set them) for the answer's structure; (None, None, None) without one.
        Two fields that each set one are a 400 naming them."""
        given = {name: value for name, value in (("response_format", self._format_schema()),
                                                 ("guided_json", self._guided_schema()),
                                                 ("guided_regex", self.guided_regex),
                                                 ("guided_choice", self.guided_choice)) if value is not None}
        if len(given) > 1:
            raise APIError(400, f"{' and '.join(given)} each set the answer's structure; send one of them",
                           param=list(given)[1])
        if not given:
            return None, None, None
        field, value = next(iter(given.items()))
        if field == "guided_regex":
            return None, value, field
        if field == "guided_choice":
            return None, "|".join(f"({re.escape(choice)})" for choice in value), field
        return value, None, field

    def _format_schema(self) -> dict[str, Any] | None:
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return _ANY_OBJECT
        return self.response_format.json_schema.schema_ or {}

    def _guided_schema(self) -> dict[str, Any] | None:
        if not isinstance(self.guided_json, str):
            return self.guided_json
        try:
            schema = json.loads(self.guided_json)
        except ValueError as err:
            raise APIError(400, f"guided_json is a JSON schema, as an object or its JSON text; this text is not "
                                f"JSON ({err})", param="guided_json") from None
        if not isinstance(schema, dict):
            raise APIError(400, "guided_json is a JSON schema: an object", param="guided_json")
        return schema

    def bias_by_token(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids; a 400 naming logit_bias for a key that is no id or a bias
        outside OpenAI's range."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit() or not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
                raise APIError(400, f"logit_bias maps token ids (as strings, like \"50256\") to a bias from "
                                    f"-{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}; got {shown(key)}: {shown(value)}",
                               param="logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives to list beside each output token's log-probability; None: no log-probabilities."""
        return None

    @property
    def echoes(self) -> bool:
        """Whether the answer's text (and log-probabilities) start with the prompt's."""
        return False

    @property
    def scores_prompt(self) -> bool:
        """A request for the prompt alone (echo with max_tokens=0: lm-eval's log-likelihood requests)."""
        return self.echoes and self.token_limit == 0

    @property
    def no_tokens_hint(self) -> str:
        return ""


def _show(value: Any) -> str:
    return shown(value.model_dump() if isinstance(value, BaseModel) else value)


def _no_tool_choice(choice: Any) -> bool:
    return choice in (None, "none", "auto")  # without tools, "auto" has nothing to choose from


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens (checked with it, `_tokens_not_negative`)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None  # shown to the model through its chat template (`dflash.serve.tools`)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True  # False: one call at most
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, as in vLLM (e.g. enable_thinking)
    # as in vLLM: continue_final_message=true (with add_generation_prompt=false) continues the last assistant message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Any = None
    documents: Any = None

    _UNSUPPORTED: ClassVar[Refusals] = {
        **SamplingRequest._UNSUPPORTED,
        "functions": (_unset, "functions is the deprecated form of tools; send tools (and tool_choice) instead"),
        "function_call": (_no_tool_choice, "function_call is the deprecated form of tool_choice; send tools and "
                          "tool_choice instead"),
        "chat_template": (lambda v: v is None, "this server renders with the model's own chat template; leave "
                          "chat_template out, or start the server with a model whose template you want"),
        "documents": (_unset, "this server's chat template gets no documents; leave documents out and put "
                      "them in a message"),
        "echo": (_unset, "this server does not echo chat messages; leave echo out (/v1/completions echoes a prompt)"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message=true continues the last message, and add_generation_prompt="
                                "true would start a new one: send add_generation_prompt=false with it (as vLLM "
                                "requires)", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message=true continues the last message, which must then be the "
                                f"assistant's (it is the {self.messages[-1].role}'s)", param="continue_final_message")
        self.check_tools()

    def check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise APIError(400, f"tools names {', '.join(map(repr, twice))} more than once; give each function "
                                "one name of its own", param="tools")
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return
        asked = "required" if choice == "required" else f"the function {choice.function.name!r}"
        if not names:
            raise APIError(400, f"tool_choice asks for {asked}, and the request has no tools; send the functions "
                                "in tools", param="tool_choice")
        if choice != "required" and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                                f"tools ({', '.join(map(repr, names))})", param="tool_choice")
        if self.continue_final_message:
            raise APIError(400, f"tool_choice {self._tool_choice_words()} holds the whole answer to a call, and "
                                "continue_final_message=true continues an answer already begun; send one of them",
                           param="tool_choice")

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's form, as transformers passes them)."""
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_reader(self) -> ToolReader:
        if not self.tools or self.tool_choice == "none":
            return ToolReader("none")
        if self.tool_choice in (None, "auto"):
            return ToolReader("auto", parallel=self.parallel_tool_calls)
        if self.tool_choice == "required":
            return ToolReader("required", parallel=self.parallel_tool_calls)
        return ToolReader("named", name=self.tool_choice.function.name)

    def structure(self) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """A required or named tool_choice holds the answer to a call (`tools`); otherwise as for completions."""
        tool = self._tool_schema()
        given = super().structure()
        if tool is None:
            return given
        if given[2] is not None:
            raise APIError(400, f"tool_choice {self._tool_choice_words()} and {given[2]} each set the answer's "
                                "structure; send one of them", param=given[2])
        return tool, None, "tool_choice"

    def _tool_schema(self) -> dict[str, Any] | None:
        reader = self.tool_reader()
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools or ()]
        if reader.mode == "required":
            return calls_schema(functions, self.parallel_tool_calls)
        if reader.mode == "named":
            return arguments_schema(next(f for f in functions if f["name"] == reader.name))
        return None

    def _tool_choice_words(self) -> str:
        return '"required"' if self.tool_choice == "required" else f"naming {self.tool_choice.function.name!r}"

    def check_logprobs(self) -> None:
        """Chat's logprobs is a boolean (0 and 1 read as false and true, as vLLM's request model coerces them), and
        top_logprobs says how many alternatives."""
        if self.logprobs not in (None, False, True, 0, 1):
            raise APIError(400, f"logprobs={_show(self.logprobs)}: chat's logprobs is true or false; send "
                                f"logprobs=true and top_logprobs (0 to {MAX_TOP_LOGPROBS}) for the most likely tokens "
                                "beside each output token", param="logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs={self.top_logprobs} needs logprobs=true (as in OpenAI's API)",
                           param="top_logprobs")

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # OpenAI's four forms: text or token ids, one or a batch
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    _UNSUPPORTED: ClassVar[Refusals] = {
        **SamplingRequest._UNSUPPORTED,
        "suffix": (_unset, "this server does not insert text before a suffix; leave suffix out"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.n):  # the best n of n samples are all of them (OpenAI and vLLM take it)
            raise APIError(400, f"best_of={self.best_of} is not supported: this server returns the n samples it "
                                "draws, not the best of more; send n for several samples and leave best_of out (or "
                                "equal to n)", param="best_of")

    def check_logprobs(self) -> None:
        """Completions' logprobs is a number of alternatives per token (0: the chosen token's alone)."""
        if self.logprobs is True or (isinstance(self.logprobs, int) and check_top(self.logprobs)):
            raise APIError(400, f"logprobs={_show(self.logprobs)}: completions' logprobs is the number of most likely "
                                f"tokens to list beside each output token, 0 to {MAX_TOP_LOGPROBS} (0: the chosen "
                                "token's log-probability alone)", param="logprobs")

    @property
    def top_logprobs_asked(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    @property
    def echoes(self) -> bool:
        return self.echo

    @property
    def no_tokens_hint(self) -> str:
        return "; with echo=true, max_tokens=0 returns the prompt alone (with logprobs, its log-probabilities)"

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, prompt):
        prompts = _prompts(prompt)
        for i, one in enumerate(prompts):
            if not one:
                raise ValueError("the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch (OpenAI's list of strings or of id lists)."""
        return _prompts(self.prompt)


def _prompts(prompt: str | list) -> list:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def check_content_type(content_type: str | None, content_encoding: str | None = None) -> None:
    """Refuse a body not declared as JSON (415). A browser posts text/plain, form and untyped bodies to any site
    without asking it first (no CORS preflight), so taking them as JSON would let any web page a user visits make
    a server without --api-key decode for it. A compressed body is refused too (415): this server reads it as
    it is."""
    encoding = (content_encoding or "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"the request body is declared as Content-Encoding {encoding!r}, which this server does "
                            "not decode; send it uncompressed (without a Content-Encoding header)")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    declared = f"is declared as {media!r}" if media else "has no Content-Type"
    raise APIError(415, f"the request body {declared}; send it as JSON with the header Content-Type: "
                        "application/json (curl: -H 'Content-Type: application/json')")


def parse_request(raw: bytes, model: type[_Strict]) -> Any:
    """Body bytes -> a validated request; every problem becomes a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to read; send the request's fields as "
                            "OpenAI's API defines them") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    ignored = sorted(set(data) - known_fields(model)) + _ignored_inside(data)
    if ignored:  # accepted, as OpenAI's API does, but a typo (max_token) would change the answer unseen
        log.warning("request fields this server ignores: %s", _names(ignored))
    try:
        return model.model_validate(data)
    except ValidationError as err:
        param, message = _describe(err.errors())
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _names(names: list[str], most: int = 20, longest: int = 60) -> str:
    """Field names for one log line, as a client sent them: quoted and escaped (a newline in a key would forge a
    log line), each cut to `longest` characters, the first `most` of them."""
    shown = ", ".join(repr(n if len(n) <= longest else n[:longest] + "...") for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _ignored_inside(data: dict) -> list[str]:
    """Unknown keys of the objects inside a request (each message and its content parts, stream_options), as paths
    like messages[0].foo or messages[0].content[1].bar."""
    found = []
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            continue
        found += [f"messages[{i}].{k}" for k in sorted(set(message) - known_fields(ChatMessage) - MESSAGE_EXTRAS)]
        parts = message.get("content")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict):
                found += [f"messages[{i}].content[{j}].{k}" for k in sorted(set(part) - known_fields(ContentPart))]
    options = data.get("stream_options")
    if isinstance(options, dict):
        found += [f"stream_options.{k}" for k in sorted(set(options) - known_fields(StreamOptions))]
    return found


# message fields of OpenAI's API that a chat template has no use for here: no warning for them
MESSAGE_EXTRAS = {"refusal", "audio", "function_call"}


def known_fields(model: type[_Strict]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def _describe(errors: list[dict]) -> tuple[str | None, str]:
    """(param, message) for the first validation error, in the client's terms: the field's path without
    pydantic's type tags, and what the value must be."""
    loc = list(errors[0]["loc"])
    for i, key in enumerate(loc[:-1]):
        if key in _UNION_FIELDS and isinstance(loc[i + 1], str):  # loc[i + 1]: the tag of one of its forms
            return _describe_union(errors, loc[: i + 1])
    return _path(loc), _wording(errors[0])


def _describe_union(errors: list[dict], field: list) -> tuple[str, str]:
    """A value no form of a union field accepts fails once per form. When just one form got past the value's
    outer shape (a list whose item is wrong), its error is the one that says what to fix."""
    depth = len(field) + 1  # the field, then a form's tag
    tagged = [e for e in errors if list(e["loc"][: len(field)]) == field and len(e["loc"]) >= depth]
    deeper = [e for e in tagged if len(e["loc"]) > depth]
    if len({e["loc"][len(field)] for e in deeper}) == 1:
        inner = deeper[0]
        return _path(field + list(inner["loc"][depth:])), _wording(inner)
    return _path(field), f"must be {_UNION_FIELDS[field[-1]]}"


def _path(loc: list) -> str:
    return ".".join(str(p) for p in loc)


def _wording(error: dict) -> str:
    """Pydantic's message, said of the field ('must be ...'), without its prefixes and class names."""
    kind, message = error["type"], error["msg"]
    if kind == "missing":
        return "is required"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "must be a JSON object"
    if kind == "too_short":
        least = error.get("ctx", {}).get("min_length", 1)
        return f"must hold at least {least} item{'s' if least != 1 else ''}"
    message = message.removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
    return "must be " + message.removeprefix("Input should be ") if message.startswith("Input should be ") else message


# ---- responses -------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    """One model object; `max_model_len` (as vLLM reports it) is the most prompt + max_tokens may add up to."""
    return {"id": name, "object": "model", "created": created, "owned_by": "dflash", "max_model_len": max_model_len}


def model_list(*cards: dict) -> dict:
    return {"object": "list", "data": list(cards)}


class ResponseShape:
    """Builds the bodies and stream chunks of one endpoint, so the handlers don't branch on it.

    Each choice carries vLLM's `stop_reason` (the stop string or the request's own stop token id that ended it,
    else null), and with `include_usage` every stream chunk before the usage chunk carries `"usage": null`, as
    OpenAI's do."""

    def __init__(self, kind: Literal["chat", "completion"], model: str, include_usage: bool = False):
        self.kind, self.model, self.include_usage = kind, model, include_usage
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict], extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        body.update(extra or {})
        return body

    def choice(self, index: int, text: str | None, finish_reason: str, stop_reason: str | int | None = None,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One whole choice of an answer (`full`); with tool calls (chat), the text is the content beside them
        (None: none) and the finish reason is "tool_calls", as in OpenAI's API and vLLM."""
        if tool_calls:
            finish_reason = "tool_calls"
        ending = {"finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": logprobs}
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
            return {"index": index, "message": message, **ending}
        return {"index": index, "text": text, **ending}

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int, extra: dict | None = None) -> dict:
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(name, choices, {"usage": usage(prompt_tokens, completion_tokens), **(extra or {})})

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              stop_reason: str | int | None = None, logprobs: dict | None = None, index: int = 0,
              tool_calls: list[dict] | None = None, calls_only: bool = False,
              so_far: tuple[int, int] | None = None) -> dict:
        """One stream chunk; the first of a chat choice opens it with its role and an empty content (null for an
        answer that is calls alone: `calls_only`, as OpenAI's streams open one). `so_far`: (prompt tokens,
        completion tokens) of the choice so far, the chunk's usage (vLLM's continuous_usage_stats); else null."""
        ending = {"finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": logprobs}
        extra = {"usage": None if so_far is None else usage(*so_far)} if self.include_usage else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": None if calls_only else ""} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, **ending}], extra)
        return self._envelope("text_completion", [{"index": index, "text": text or "", **ending}], extra)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> str:
    """One server-sent event; the stream ends with `sse("[DONE]")`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
