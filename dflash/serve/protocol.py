"""The OpenAI wire format: request models for /v1/chat/completions and /v1/completions, response bodies,
and OpenAI-style error objects `{"error": {"message", "type", "param", "code"}}`.

Requests are validated strictly (a string where a number belongs is a 400, never coerced); unknown fields
are ignored, as OpenAI clients send fields this server has no use for.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests -------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported; send text",
                               param="messages")
            parts.append(part.text)
        return "".join(parts)


class SamplingRequest(_Strict):
    """Fields both endpoints share. `ignore_eos` is an extension (as in vLLM) for fixed-length benchmarks."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: no top-k
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # the range torch generators take
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool | int | None = None
    echo: bool = False
    ignore_eos: bool = False
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse options this server would otherwise silently ignore."""
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name for max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("the prompt is empty")
            if isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ValueError("one prompt per request (this server answers n=1 only)")
                return prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def parse_request(raw: bytes, model: type[_Strict]) -> Any:
    """Body bytes -> a validated request; every problem becomes a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


# ---- responses -------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "dflash"}]}


class ResponseShape:
    """Builds the bodies and stream chunks of one endpoint, so the handlers don't branch on it."""

    def __init__(self, kind: Literal["chat", "completion"], model: str):
        self.kind, self.model = kind, model
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _envelope(self, object_name: str, choice: dict, extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": [choice]}
        body.update(extra or {})
        return body

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            name = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            name = "text_completion"
        return self._envelope(name, choice, {"usage": usage(prompt_tokens, completion_tokens)})

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", choice)
        return self._envelope("text_completion", {"index": 0, "text": text or "", "finish_reason": finish_reason,
                                                  "logprobs": None})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> str:
    """One server-sent event; the stream ends with `sse("[DONE]")`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
