"""The server backend: load an OpenAI-compatible server (vLLM, SGLang, `dflash serve`, ...) at one or
several concurrencies and read its speculative-decoding counters from Prometheus `/metrics`.

Counters (scraped before and after each load; the difference is this load's):
    <prefix>spec_decode_num_drafts                verify steps that had a draft
    <prefix>spec_decode_num_draft_tokens          draft tokens proposed
    <prefix>spec_decode_num_accepted_tokens       draft tokens accepted
    <prefix>spec_decode_num_accepted_tokens_per_pos{position="i"}   drafts whose token i+1 was accepted
with prefix `dflash:` (ours) or `vllm:`, each possibly with a `_total` suffix.
Mean acceptance length = 1 + accepted / drafts.

With `baseline_url` (the same target served without a drafter) the same load runs there too, for the
speedup and, at temperature 0, a text comparison prompt by prompt. With `rounds` > 1 each concurrency level
runs that pair of loads several times, the servers taking turns to go first (DFlash, plain; plain, DFlash; ...)
so that a machine that speeds up or slows down over the level weighs on both alike; the speedup is then the
median of the rounds' speedups (one stalled round does not move it), and `speedup_per_round` lists them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import ipaddress
import json
import math
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

import httpx

from dflash.bench.datasets import Sample, request_seed
from dflash.bench.metrics import (
    NO_DRAFT,
    BenchResult,
    acceptance_rate_per_position,
    few_steps_note,
    histogram_from_counters,
    mean_ms,
    percentiles,
    ratio,
)
from dflash.errors import UserError, in_brief

PREFIXES = ("dflash:", "vllm:")
PER_POSITION = "num_accepted_tokens_per_pos"


@dataclass
class ServerConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1; a bare http://host:port gets /v1
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "chat"  # "chat" (/chat/completions) or "completions" (/completions)
    api_key: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: int | None = None  # conversations per concurrency level; None: each sample once
    duration_s: float | None = None  # keep the load up this long instead (prompts cycle); not with num_prompts
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None  # None: not sent (the server's default applies); 0 or -1: off, sent as -1
    seed: int = 0
    timeout_s: float = 600.0  # the whole request, first byte to last
    timeout_flag: str = "--request-timeout"  # named when it fires (python -m dflash.benchmark: --timeout-s)
    metrics_url: str | None = None  # None: /metrics at the server's root
    baseline_url: str | None = None
    rounds: int = 1  # passes over each level (servers alternating who goes first); speedup = their median
    chat_template_kwargs: dict | None = None  # sent with chat requests (vLLM, SGLang and dflash serve read it)
    stream: bool = True  # server-sent events: time to first token and per output token, as vLLM's bench reads them
    warmup_tokens: int = 16  # one untimed request of this many tokens to each server first (0: none)

    def __post_init__(self) -> None:
        self.base_url = api_base_url(self.base_url, "--base-url")
        if self.baseline_url:
            self.baseline_url = api_base_url(self.baseline_url, "--baseline-url")
        if self.metrics_url:
            _check_http(self.metrics_url, "--metrics-url", "http://127.0.0.1:8000/metrics")


@dataclass
class RequestRecord:
    sample_id: str
    turn: int
    latency_s: float
    output_tokens: int
    text: str
    error: str | None = None
    ttft_s: float | None = None  # streamed requests: until the first chunk holding text
    finish_reason: str | None = None  # as the server gave it: "stop", "length", ...
    content: str | None = None  # the answer without the reasoning a server split off (None: all of `text`)
    turned_away: int = 0  # HTTP 429 answers (server full) waited out before this answer; its latency holds the waits

    @property
    def reply(self) -> str:
        """What a client keeps of the answer in the conversation: its content, not its reasoning."""
        return self.text if self.content is None else self.content

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (streamed requests with 2+ tokens)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_s: float
    conversations: int = 0  # conversations sent (a sample sent twice counts twice)


@dataclass
class SpecDecodeCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def __sub__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0.0] * (width - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0.0] * (width - len(other.accepted_per_pos))
        return SpecDecodeCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                                  self.accepted_tokens - other.accepted_tokens,
                                  [a - b for a, b in zip(mine, theirs)])

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def mean_block_size(self) -> float | None:
        """Anchor + draft tokens per verified draft: below the drafter's width when the server shrinks blocks."""
        return 1.0 + self.draft_tokens / self.drafts if self.drafts > 0 else None


# ---- Prometheus text ----------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        samples.append((match.group(1), dict(_LABEL.findall(match.group(3) or "")), value))
    return samples


def spec_decode_counters(text: str) -> SpecDecodeCounters | None:
    """The spec-decode counters of the first prefix the server exposes (ours, then vLLM's), summed over
    label sets (engines, models); None when it exposes none."""
    samples = parse_prometheus(text)
    for prefix in PREFIXES:
        def total(name: str, prefix: str = prefix) -> list[tuple[dict, float]]:
            base = f"{prefix}spec_decode_{name}"
            return [(labels, v) for n, labels, v in samples if n in (base, base + "_total")]

        drafts = total("num_drafts")
        if not drafts:
            continue
        per_pos: dict[int, float] = {}
        for labels, value in total(PER_POSITION):
            position = _position(labels)
            if position is not None:  # a label that is no position is left out (ServerBackend warns of it)
                per_pos[position] = per_pos.get(position, 0.0) + value
        return SpecDecodeCounters(
            drafts=sum(v for _, v in drafts),
            draft_tokens=sum(v for _, v in total("num_draft_tokens")),
            accepted_tokens=sum(v for _, v in total("num_accepted_tokens")),
            accepted_per_pos=[per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else [],
        )
    return None


def _position(labels: dict[str, str]) -> int | None:
    """A per-position counter's draft position (0, 1, ...); None when its label is not one."""
    text = labels.get("position", "0")
    return int(text) if text.isascii() and text.isdigit() else None


def bad_positions(exposition: str | None) -> list[str]:
    """The position labels of per-position counters that are no position (a server's bug, or another metric's)."""
    names = {f"{prefix}spec_decode_{PER_POSITION}{suffix}" for prefix in PREFIXES for suffix in ("", "_total")}
    return [labels.get("position", "") for name, labels, _ in parse_prometheus(exposition or "")
            if name in names and _position(labels) is None]


def api_base_url(url: str, flag: str) -> str:
    """The OpenAI API root: http://host:port -> http://host:port/v1 (what vLLM, SGLang and `dflash serve`
    serve); a URL with a path is taken as given (a proxy may mount the API anywhere)."""
    parts = _check_http(url, flag, "http://127.0.0.1:8000/v1")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _check_http(url: str, flag: str, example: str):
    try:
        parts = urlsplit(url.strip())
        _ = parts.port  # a port that is no number raises here, not at the first request
        httpx.URL(url.strip())  # what httpx refuses (a host it cannot encode, ...) is refused before the run too
    except (ValueError, httpx.InvalidURL) as err:
        raise UserError(f"{flag} {url!r} is no URL ({err}): give one like {example}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"{flag} must be an http:// or https:// URL like {example}, got {url!r}")
    return parts


def api_url(base_url: str, path: str) -> str:
    """An endpoint under the API root: the path goes before any query the root holds (a proxy's
    `?api-version=...` stays at the end, where it belongs)."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path, parts.query, ""))


def server_root(url: str) -> str:
    """http://HOST:PORT/v1/ -> http://host:port: where a server's /metrics is, and two spellings of one server
    compare equal."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, "", ""))


def same_server(url: str, other: str) -> bool:
    """Whether two API roots are one server: the same port and path on one host (http://h:8000 and
    http://h:8000/v1), or on two names for this machine (localhost and 127.0.0.1). Two names that share an address
    elsewhere may be two services behind one load balancer, told apart by name: they are not taken as one."""
    mine, theirs = urlsplit(server_root(url)), urlsplit(server_root(other))
    if (mine.scheme, _port(mine), mine.path) != (theirs.scheme, _port(theirs), theirs.path):
        return False
    if mine.hostname == theirs.hostname:
        return True
    here = [_addresses(mine.hostname), _addresses(theirs.hostname)]
    return all(here) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in here[0] | here[1])


def _port(parts) -> int | None:
    try:
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # not a number: list_models names the URL when it cannot connect
        return None


def _addresses(host: str | None) -> set[str]:
    """The addresses a host name resolves to (none: it does not resolve, and the connection check says so)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
    except (OSError, UnicodeError):
        return set()


def default_metrics_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port/metrics"""
    return server_root(base_url) + "/metrics"


def fetch_exposition(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> tuple[str | None, str | None]:
    """(the Prometheus text at `url`, None), or (None, what went wrong). A server that keeps its metrics behind
    the API key (401, 403) is asked again with it."""
    try:
        response = httpx.get(url, timeout=timeout_s)
        if response.status_code in (401, 403) and api_key:
            response = httpx.get(url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})
    except httpx.HTTPError as err:
        return None, f"cannot read {url} ({type(err).__name__})"
    if response.status_code != 200:
        return None, f"{url} answered HTTP {response.status_code}"
    return response.text, None


def fetch_metrics(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> tuple[SpecDecodeCounters | None,
                                                                                          str | None]:
    """(counters, None), or (None, what went wrong)."""
    return counters_in(url, *fetch_exposition(url, timeout_s, api_key))


def counters_in(url: str, exposition: str | None, problem: str | None) -> tuple[SpecDecodeCounters | None,
                                                                                  str | None]:
    """The counters of a fetched exposition (`fetch_exposition`'s answer), or (None, what went wrong)."""
    counters = spec_decode_counters(exposition) if exposition is not None else None
    if exposition is not None and counters is None:
        problem = (f"{url} has none of the spec-decode counters this bench reads (dflash serve's and vLLM's: "
                   "spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens; SGLang's gauges and vLLM "
                   "V0's counters are not read), or the server does not draft")
    return counters, problem


def served_drafter(exposition: str | None) -> str:
    """What drafts on the server, as its `dflash:drafter_info{kind=...}` says: "DFlash", "draft model" or "none";
    "DFlash" for a server that does not say (vLLM and SGLang serve DFlash drafters under the same checkpoints)."""
    return _said_drafter(exposition) or "DFlash"


def _said_drafter(exposition: str | None) -> str | None:
    for name, labels, _ in parse_prometheus(exposition or ""):
        if name == "dflash:drafter_info" and labels.get("kind"):
            return labels["kind"]
    return None


def drafts(exposition: str | None) -> bool:
    """Whether a server's metrics say it drafts: its dflash:drafter_info, else spec-decode counters at all (vLLM
    registers them only with a speculative config)."""
    said = _said_drafter(exposition)
    return said != NO_DRAFT if said is not None else spec_decode_counters(exposition or "") is not None


# ---- the client ---------------------------------------------------------------------------------------
class Client:
    """One OpenAI-compatible endpoint: a conversation's turns, each answered before the next is sent."""

    def __init__(self, base_url: str, config: ServerConfig, model: str, flag: str = "--base-url"):
        self.base_url = base_url.rstrip("/")
        self.config = config
        self.model = model
        self.flag = flag  # named in errors: which of the two servers failed
        self.headers = _headers(config)

    async def conversation(self, http: httpx.AsyncClient, sample: Sample, index: int) -> list[RequestRecord]:
        """Sample `index` of the level's samples (a repeat of a sample is sent with the same seeds)."""
        messages = list(sample.history)
        records = []
        for turn, text in enumerate(sample.turns):
            messages.append({"role": "user", "content": text})
            record = await self.request(http, messages, sample.id, turn, request_seed(self.config.seed, index, turn))
            records.append(record)
            if record.error is not None:
                break
            messages.append({"role": "assistant", "content": record.reply})
        return records

    async def request(self, http: httpx.AsyncClient, messages: list[dict], sample_id: str, turn: int,
                      seed: int) -> RequestRecord:
        url, body = self.payload(messages, seed)
        start = time.perf_counter()
        attempts = Attempts()  # 429s waited out so far, kept through a timeout
        try:  # httpx's timeout bounds each wait for bytes; this one bounds the whole request, as the flag says
            return await asyncio.wait_for(self._answer(http, url, body, sample_id, turn, start, attempts),
                                          self.config.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return RequestRecord(sample_id, turn, time.perf_counter() - start, 0, "", self._timed_out(attempts),
                                 turned_away=attempts.turned_away)
        except httpx.ConnectError:  # it answered before the run (ServerBackend checks): it went away since
            raise UserError(f"lost the connection to {url} ({self.flag}) during the run: did the server "
                            "stop?") from None
        except BadReply as err:
            return RequestRecord(sample_id, turn, time.perf_counter() - start, 0, "", str(err),
                                 turned_away=attempts.turned_away)
        except (httpx.HTTPError, ValueError) as err:
            return RequestRecord(sample_id, turn, time.perf_counter() - start, 0, "", f"{type(err).__name__}: {err}",
                                 turned_away=attempts.turned_away)

    def _timed_out(self, attempts: "Attempts") -> str:
        limit = f"{self.config.timeout_flag} {self.config.timeout_s:g} s"
        if attempts.waiting:  # still turned away when the time ran out: the server never took it
            return (f"the server turned it away with HTTP 429 {attempts.turned_away} time(s) within {limit} and "
                    "never took it (full all along): lower --concurrency to what the server takes at once "
                    "(dflash serve: --max-batch-size plus --max-queue), or give it room")
        if attempts.last_event is not None:  # the answer had ended, and the stream did not
            return (f"the stream sent its {attempts.last_event} and then neither 'data: [DONE]' nor the end of the "
                    f"response within {limit}: the server does not close its streams (run with --no-stream)")
        waits = f" (turned away with HTTP 429 {attempts.turned_away} time(s) first)" if attempts.turned_away else ""
        return (f"no whole answer within {limit}{waits}; raise {self.config.timeout_flag} for longer answers or a "
                "slower server")

    async def _answer(self, http: httpx.AsyncClient, url: str, body: dict, sample_id: str, turn: int, start: float,
                      attempts: "Attempts") -> RequestRecord:
        """The request sent until the server takes it: a 429 (every slot and queue place taken) is waited out for
        its Retry-After, at least a wait that doubles with each refusal (`Attempts.backoff_s`), and sent again, as a
        client would, so a full server slows the load instead of failing it."""
        while True:
            try:
                record = await (self._streamed if self.config.stream else self._whole)(http, url, body, sample_id,
                                                                                      turn, start, attempts)
            except TurnedAway as refusal:
                attempts.turned_away += 1
                attempts.waiting = True
                await asyncio.sleep(max(refusal.wait_s, attempts.backoff_s()))
                attempts.waiting = False
                continue
            record.turned_away = attempts.turned_away
            return record

    async def _whole(self, http: httpx.AsyncClient, url: str, body: dict, sample_id: str, turn: int,
                     start: float, attempts: "Attempts") -> RequestRecord:
        """One request answered as one JSON object (--no-stream)."""
        response = await http.post(url, json=body, headers=self.headers, timeout=self.config.timeout_s)
        latency = time.perf_counter() - start
        _raise_if_turned_away(response)
        if response.status_code != 200:
            return RequestRecord(sample_id, turn, latency, 0, "", _http_error(response.status_code, response.text))
        data = _json_object(_parsed(response.text, "an answer"), "an answer")
        tokens = _completion_tokens(data.get("usage"))
        (text, content), finish = _choice_text(data, self.config.endpoint), _finish_reason(data)
        if tokens is None:
            return RequestRecord(sample_id, turn, latency, 0, text, _no_usage(data.get("usage"), "answer"))
        problem = _implausible_count(tokens, text, body["max_tokens"])
        if problem:
            return RequestRecord(sample_id, turn, latency, 0, text, problem)
        return RequestRecord(sample_id, turn, latency, tokens, text, finish_reason=finish, content=content)

    async def _streamed(self, http: httpx.AsyncClient, url: str, body: dict, sample_id: str, turn: int,
                        start: float, attempts: "Attempts") -> RequestRecord:
        """One request as server-sent events; the token count comes from the usage chunk the stream ends with."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        pieces: list[str] = []
        contents: list[str] = []  # the pieces less the reasoning
        ttft = usage = finish = None
        events = EventStream()
        async with http.stream("POST", url, json=body, headers=self.headers, timeout=self.config.timeout_s) as response:
            _raise_if_turned_away(response)
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                return RequestRecord(sample_id, turn, time.perf_counter() - start, 0, "",
                                     _http_error(response.status_code, text))
            async for chunk in events.chunks(response):
                if "error" in chunk:
                    return RequestRecord(sample_id, turn, time.perf_counter() - start, 0, "".join(pieces),
                                         f"error event in the stream: {_cut(str(chunk['error']))}")
                piece, content = _chunk_text(chunk, self.config.endpoint)
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(piece)
                contents.append(content)
                usage = chunk["usage"] if isinstance(chunk.get("usage"), dict) else usage
                finish = _finish_reason(chunk) or finish
                if finish is not None and usage is not None:  # all of the answer is in: only the end is awaited
                    attempts.last_event = "finish reason and usage"
        latency = time.perf_counter() - start
        text = "".join(pieces)
        tokens = _completion_tokens(usage)
        if tokens is None:
            if events.count == 0:  # not one event: no stream at all
                return RequestRecord(sample_id, turn, latency, 0, "", _no_events(response, events.first_line))
            error = NO_STREAM_USAGE if usage is None or "completion_tokens" not in usage else _no_usage(usage, "stream")
            return RequestRecord(sample_id, turn, latency, 0, text, error)
        problem = _implausible_count(tokens, text, body["max_tokens"])
        if problem:
            return RequestRecord(sample_id, turn, latency, 0, text, problem)
        return RequestRecord(sample_id, turn, latency, tokens, text, ttft_s=ttft, finish_reason=finish,
                             content="".join(contents))

    def payload(self, messages: list[dict], seed: int) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": self.config.max_new_tokens,
                "temperature": self.config.temperature, "seed": seed}
        if self.config.temperature > 0:  # sent even at 1: a server's own default may be the model's (0.95 ...)
            body["top_p"] = self.config.top_p
        top_k = self.config.top_k  # not an OpenAI field: sent only when given (vLLM and SGLang take it; -1 is off
        if self.config.temperature > 0 and top_k is not None:  # to both); left out, the server's default applies
            body["top_k"] = top_k if top_k > 0 else -1
        if self.config.endpoint == "chat":
            if self.config.chat_template_kwargs:
                body["chat_template_kwargs"] = self.config.chat_template_kwargs
            return api_url(self.base_url, "/chat/completions"), {**body, "messages": messages}
        return api_url(self.base_url, "/completions"), {**body, "prompt": "\n\n".join(m["content"] for m in messages)}


class BadReply(ValueError):
    """A reply that is no OpenAI answer (the request's error, said as is)."""


def _json_object(data, what: str) -> dict:
    if not isinstance(data, dict):
        raise BadReply(f"the server sent {what} that is not a JSON object: {_cut(json.dumps(data))} (an "
                       "OpenAI-compatible server sends objects)")
    return data


def _completion_tokens(usage) -> int | None:
    """usage.completion_tokens, when it is a count."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    counted = isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and math.isfinite(tokens)
    return int(tokens) if counted and tokens >= 0 else None


def _no_usage(usage, where: str) -> str:
    return (f"the {where}'s usage gave no count of output tokens (usage: {_cut(json.dumps(usage))}), so its "
            "throughput is unknown: the server must report usage.completion_tokens")


def _first_choice(data: dict) -> dict:
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    return choice if isinstance(choice, dict) else {}


def _finish_reason(data: dict) -> str | None:
    reason = _first_choice(data).get("finish_reason")
    return reason if isinstance(reason, str) else None


def _message_text(message) -> tuple[str, str]:
    """A chat message's or delta's (text, content): the text is the reasoning a server's reasoning parser splits
    off (vLLM, SGLang: `reasoning_content`, or `reasoning`) and then the content, decoded tokens alike, timed and
    compared; the content alone goes back to the server in the conversation, as clients send it."""
    if not isinstance(message, dict):
        return "", ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    return (reasoning if isinstance(reasoning, str) else "") + content, content


def _choice_text(data: dict, endpoint: str) -> tuple[str, str]:
    choice = _first_choice(data)
    if endpoint == "chat":
        return _message_text(choice.get("message"))
    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    return text, text


def _chunk_text(chunk: dict, endpoint: str) -> tuple[str, str]:
    """The (text, content) a streamed chunk adds (the usage chunk at the end has no choices)."""
    choice = _first_choice(chunk)
    if endpoint == "chat":
        return _message_text(choice.get("delta"))
    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    return text, text


@dataclass
class Attempts:
    """What sending one request has met so far, for the error its timeout gives."""

    turned_away: int = 0  # HTTP 429s waited out
    waiting: bool = False  # waiting out a 429 now (the server has not taken the request)
    last_event: str | None = None  # a stream's last awaited event when all of the answer had come (None: not yet)

    def backoff_s(self) -> float:
        """The least wait after the n-th 429 in a row: MIN_RETRY_WAIT_S, doubling up to MAX_RETRY_WAIT_S, so a
        server that says Retry-After: 0 (or nothing) while it stays full is not asked again at once, over and over."""
        return min(MIN_RETRY_WAIT_S * 2 ** max(self.turned_away - 1, 0), MAX_RETRY_WAIT_S)


class EventStream:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`; it counts the events, and keeps the
    first other line seen (what a server that does not stream sent instead)."""

    def __init__(self):
        self.count = 0
        self.first_line: str | None = None

    async def chunks(self, response: httpx.Response):
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                if line.strip() and not line.startswith((":", "event:", "id:", "retry:")) and self.first_line is None:
                    self.first_line = line
                continue  # blank separators, comments, keep-alives and other fields
            self.count += 1
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            # a ValueError is the request's error, as for a broken non-streamed body
            yield _json_object(_parsed(data, "a stream event"), "a stream event")


def _parsed(text: str, what: str):
    """JSON text -> its value; what is no JSON (or nests too deep to read) is the request's BadReply."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        problem = "nests too deep to read" if isinstance(err, RecursionError) else f"is no JSON ({err})"
        raise BadReply(f"the server sent {what} that {problem}: {_cut(text)!r}") from None


def _implausible_count(tokens: int, text: str, max_tokens: int) -> str | None:
    """What is wrong with an answer's usage.completion_tokens that its request rules out (None: nothing): more
    tokens than max_tokens allowed, or none for an answer with text. Such a count would be the figures' lie."""
    if tokens > max_tokens:
        return (f"the server counted {tokens} output tokens (usage.completion_tokens) for an answer of at most "
                f"max_tokens {max_tokens}: its usage is wrong, so the answer's throughput is unknown")
    if tokens == 0 and text:
        return (f"the server counted 0 output tokens (usage.completion_tokens) for an answer with text "
                f"({_cut(text)!r}): its usage is wrong, so the answer's throughput is unknown")
    return None


def _no_events(response: httpx.Response, first_line: str | None) -> str:
    kind = response.headers.get("content-type") or "no content type"
    sent = f", beginning {_cut(first_line)!r}" if first_line else ", and nothing"
    return (f"the server answered the streamed request with {kind}{sent}: no server-sent event (data: ...) came; "
            "a server that does not stream is benchmarked with --no-stream")


class TurnedAway(Exception):
    """The server answered 429: full for now; send the request again after `wait_s`."""

    def __init__(self, wait_s: float):
        super().__init__(f"HTTP 429, retry after {wait_s:g} s")
        self.wait_s = wait_s


DEFAULT_RETRY_AFTER_S = 1.0  # a 429 without a readable Retry-After
MIN_RETRY_WAIT_S = 0.1  # the least wait after a first 429 (`Attempts.backoff_s`), whatever Retry-After says ...
MAX_RETRY_WAIT_S = 5.0  # ... doubling with each refusal in a row up to this
MAX_RETRY_AFTER_S = 30.0  # a longer Retry-After is waited this long (the request's own timeout still bounds it all)


def retry_after_s(value: str | None, now: float | None = None) -> float:
    """Seconds to wait for a Retry-After header: delay-seconds or an HTTP date (RFC 9110); unreadable or
    missing: DEFAULT_RETRY_AFTER_S; capped at MAX_RETRY_AFTER_S and never negative."""
    if value is None:
        return DEFAULT_RETRY_AFTER_S
    try:
        wait = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return DEFAULT_RETRY_AFTER_S
        if when is None or when.tzinfo is None:
            return DEFAULT_RETRY_AFTER_S
        wait = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(wait):
        return DEFAULT_RETRY_AFTER_S
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S)


def _raise_if_turned_away(response: httpx.Response) -> None:
    if response.status_code == 429:
        raise TurnedAway(retry_after_s(response.headers.get("retry-after")))


ERROR_CHARS = 600  # of a server's error, kept in a record (the whole message of an OpenAI error object, mostly)


def _http_error(status: int, text: str) -> str:
    """'HTTP 400: <the error's message>': an OpenAI error object's message, else the body, each cut where long."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, TypeError, KeyError):
        message = None
    return f"HTTP {status}: {_cut(message if isinstance(message, str) else text)}"


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


NO_STREAM_USAGE = ("the stream carried no usage chunk, so its output tokens are unknown: the server does not honour "
                   "stream_options.include_usage; run the benchmark with --no-stream")


def _headers(config: ServerConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


@dataclass
class ModelList:
    names: list[str] | None  # None when the server answers but lists none readable
    status: int


def list_models(base_url: str, config: ServerConfig, flag: str) -> ModelList:
    """The model names a server lists at /models. An unreachable server, or one that refuses the key, is a
    UserError naming `flag`, before any load is sent."""
    url = api_url(base_url, "/models")
    try:
        response = httpx.get(url, timeout=30, headers=_headers(config))
    except httpx.HTTPError as err:
        plain = "http://" + base_url.removeprefix("https://")
        tls = (f"; is it a plain http:// server? try {plain}"
               if base_url.startswith("https://") and "ssl" in str(err).lower() else "")
        raise UserError(f"cannot connect to {url} ({in_brief(err)}): is the server running? check "
                        f"{flag}{tls}") from None
    if response.is_redirect:  # a request to the new place would go out as a GET (301, 302): no answer to time
        raise UserError(f"{url} answered HTTP {response.status_code}, a redirect to "
                        f"{response.headers.get('location', '(no location given)')}: give {flag} the address the "
                        "server answers at itself")
    if response.status_code in (401, 403):
        fix = ("the server rejected the key given (--api-key, or $OPENAI_API_KEY): pass the key it was started with"
               if config.api_key else "the server wants an API key; pass --api-key (or set $OPENAI_API_KEY)")
        raise UserError(f"{url} answered HTTP {response.status_code}: {fix}")
    try:
        names = [str(m["id"]) for m in response.json()["data"]] if response.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        names = None
    return ModelList(names, response.status_code)


def resolve_model(base_url: str, config: ServerConfig, warnings: list[str]) -> str:
    """--model, checked against what the server lists; or the one model it lists. What is worth knowing about the
    choice goes to `warnings`."""
    listed = list_models(base_url, config, "--base-url")
    if listed.status == 404 and not config.model:  # no model list: the wrong root, or a server without one
        raise UserError(f"{base_url}/models answered HTTP 404: no OpenAI API answers there; --base-url is the API "
                        "root, e.g. http://127.0.0.1:8000/v1 (a server without a model list needs --model NAME)")
    if config.model:
        if listed.names and config.model not in listed.names:
            raise UserError(f"{base_url} serves {listed.names}, not {config.model!r}; fix --model")
        if listed.status == 404:  # the warm-up request tells whether the root is right
            warnings.append(f"{base_url}/models answered HTTP 404, so --model {config.model!r} is not checked")
        return config.model
    if not listed.names:
        raise UserError(f"could not read the model name from {base_url}/models (HTTP {listed.status}); pass "
                        "--model NAME")
    if len(listed.names) > 1:
        warnings.append(f"{base_url} serves {len(listed.names)} models {listed.names[:5]}; benchmarking the first, "
                        f"{listed.names[0]!r} (--model picks another)")
    return listed.names[0]


def check_baseline(baseline_url: str, config: ServerConfig, model: str) -> None:
    """The plain server must answer and serve the same model name, before any load is sent."""
    listed = list_models(baseline_url, config, "--baseline-url").names
    if listed and model not in listed:
        raise UserError(f"the baseline server {baseline_url} serves {listed}, not {model!r} (the model on "
                        "--base-url): serve the same target there under the same name (vLLM: --served-model-name)")


async def run_load(client: Client, samples: list[Sample], concurrency: int, num_prompts: int,
                   duration_s: float | None, load: LoadResult, on_request: Callable[[], None] | None = None) -> None:
    """`concurrency` workers take conversations in turn until `num_prompts` are done (or, with a
    duration, until the time is up; prompts cycle). The records go into `load` as they finish, so a caller
    whose load was cut short (the server went away: a UserError; Ctrl-C) still holds them, with the time until
    then."""
    start = time.perf_counter()
    deadline = start + duration_s if duration_s else None

    def take() -> int | None:
        if deadline is not None:
            if time.perf_counter() >= deadline:
                return None
        elif load.conversations >= num_prompts:
            return None
        load.conversations += 1
        return load.conversations - 1

    async def worker(http: httpx.AsyncClient) -> None:
        while (index := take()) is not None:
            sample = samples[index % len(samples)]
            for record in await client.conversation(http, sample, index % len(samples)):
                load.records.append(record)
                if on_request is not None:
                    on_request()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=client.config.timeout_s) as http:
            await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    finally:
        load.wall_s = time.perf_counter() - start


class LevelCut(Exception):
    """A level stopped partway (`error`: a server went away, or Ctrl-C); `result` is what it had measured, marked
    partial (None: nothing to report). The run reports it, then stops with the error."""

    def __init__(self, result: BenchResult | None, error: BaseException):
        super().__init__(str(error))
        self.result, self.error = result, error


class ServerBackend:
    """Checks both servers (reachable, same model) and the metrics endpoint before any load is sent;
    what is worth knowing but not fatal (no counters to read) is left in `warnings`."""

    def __init__(self, config: ServerConfig):
        _check_config(config)
        self.config = config
        self.warnings: list[str] = []
        model = resolve_model(config.base_url, config, self.warnings)
        if config.baseline_url:
            check_baseline(config.baseline_url, config, model)
        self.client = Client(config.base_url, config, model)
        self.baseline = Client(config.baseline_url, config, model, "--baseline-url") if config.baseline_url else None
        self.metrics_url = config.metrics_url or default_metrics_url(config.base_url)
        self.warmed_up = config.warmup_tokens == 0
        self.told: set[str] = set()  # topics a level's notes told once already (told again, they are noise)
        exposition, problem = fetch_exposition(self.metrics_url, api_key=config.api_key)
        self.drafter = served_drafter(exposition)
        self.dflash_server = _said_drafter(exposition) is not None  # dflash serve says what it drafts with
        baseline_exposition = (fetch_exposition(default_metrics_url(config.baseline_url), api_key=config.api_key)[0]
                               if self.baseline else None)
        # dflash serve with and without a drafter: seeded sampling gives the same tokens on both, so the texts are
        # compared at any temperature (other engines promise that at temperature 0 at most)
        self.seeded_pair = self.dflash_server and _said_drafter(baseline_exposition) == NO_DRAFT
        if self.drafter == NO_DRAFT:
            self.warnings.append(self._plain_server_warning(baseline_exposition))
        elif exposition is not None and drafts(baseline_exposition) and not drafts(exposition):
            self.warnings.append(f"the --baseline-url server's metrics ({default_metrics_url(config.baseline_url)}) "
                                 f"say it drafts, and the --base-url server's ({self.metrics_url}) do not: "
                                 "--base-url and --baseline-url look swapped (the DFlash server goes to --base-url)")
        elif drafts(baseline_exposition):
            self.warnings.append(f"the --baseline-url server's metrics ({default_metrics_url(config.baseline_url)}) "
                                 "say it drafts, so the speedup would compare two drafting servers: serve the baseline "
                                 "without a drafter (dflash serve --no-draft; vLLM without --speculative-config)")
        counters, problem = counters_in(self.metrics_url, exposition, problem)
        self.had_counters = counters is not None
        if problem:
            self.warnings.append(f"{problem}: tau and the acceptance histogram will be missing"
                                 + ("" if config.metrics_url else "; point --metrics-url at the server's metrics"))
        if bad_positions(exposition):
            self.warnings.append(f"{self.metrics_url} labels per-position acceptance counters with "
                                 f"position={bad_positions(exposition)[:3]}, not draft positions 0, 1, ...: those "
                                 "are left out of the acceptance histogram")

    def _plain_server_warning(self, baseline_exposition: str | None) -> str:
        """The --base-url server says it drafts with nothing (`dflash serve --no-draft`): its figures are plain
        decoding's, and a speedup would compare two plain servers, or the pair the wrong way round."""
        said = (f"the --base-url server says it drafts with nothing (dflash:drafter_info at {self.metrics_url}): "
                "its figures are plain decoding's, not DFlash's")
        if self.baseline is not None and served_drafter(baseline_exposition) != NO_DRAFT:
            return said + "; --base-url and --baseline-url look swapped: the DFlash server goes to --base-url"
        return said + "; point --base-url at a server that drafts (dflash serve without --no-draft)"

    def num_prompts(self, samples: list[Sample]) -> int:
        return self.config.num_prompts or len(samples)

    def run(self, dataset: str, samples: list[Sample],
            on_request: Callable[[], None] | None = None) -> list[BenchResult]:
        """One result per concurrency level."""
        return [self.run_level(dataset, samples, c, on_request) for c in self.config.concurrency]

    def run_level(self, dataset: str, samples: list[Sample], concurrency: int,
                  on_request: Callable[[], None] | None = None) -> BenchResult:
        cfg = self.config
        if not self.warmed_up:
            self.warm_up(samples[0])

        loads: list[LoadResult] = []
        bases: list[LoadResult] = []
        servers = [(self.client, loads)] + ([(self.baseline, bases)] if self.baseline is not None else [])
        before = fetch_metrics(self.metrics_url, api_key=cfg.api_key)  # only the DFlash server's loads move them
        for i in range(cfg.rounds):
            for client, into in servers if i % 2 == 0 else servers[::-1]:  # plain first in every other round
                load = LoadResult([], 0.0)
                try:
                    asyncio.run(run_load(client, samples, concurrency, self.num_prompts(samples), cfg.duration_s,
                                         load, on_request))
                except (UserError, KeyboardInterrupt) as err:
                    raise LevelCut(self._cut_level(dataset, concurrency, loads, bases, (client, load, i),
                                                   self.num_prompts(samples), before, err), err) from None
                into.append(load)
        return self._level_result(dataset, concurrency, loads, bases, before, self.num_prompts(samples))

    def _level_result(self, dataset: str, concurrency: int, loads: list[LoadResult], bases: list[LoadResult],
                      before: tuple[SpecDecodeCounters | None, str | None], conversations: int) -> BenchResult:
        """A level's row from its rounds' loads (the DFlash server's, the baseline's); `conversations`: a round's
        (`num_prompts`)."""
        cfg = self.config
        counters, lost = self._level_counters(before, fetch_metrics(self.metrics_url, api_key=cfg.api_key))
        result = summarize_load(dataset, pooled(loads), pooled(bases) if bases else None, counters, cfg,
                                concurrency, compare_sampled=self.seeded_pair)
        result.num_prompts = round(statistics.mean(load.conversations for load in loads))  # a round's, as asked
        if bases:
            result.baseline_num_prompts = round(statistics.mean(load.conversations for load in bases))
        result.drafter = self.drafter
        speedups = [ratio(_throughput(fast), _throughput(base)) for fast, base in zip(loads, bases)]
        if len(speedups) > 1 and None not in speedups and result.speedup is not None:  # a round without baseline
            result.speedup_per_round = speedups  # tokens keeps the pooled ratio; failed requests, none at all
            result.speedup = statistics.median(speedups)
        self._note(result, counters, conversations, loads + bases)
        if lost:
            result.notes.append(lost)
        if result.mismatches and not self.dflash_server:
            self._tell_once(result, "batch-variant", (
                "greedy answers differ between the servers: dflash serve's are batch-invariant, but other engines' "
                "(vLLM, SGLang, in bfloat16 above all) may change a late token with the batch and its kernels, "
                "drafting or not; run --concurrency 1 to tell that from a lossy drafter"))
        return result

    def _cut_level(self, dataset: str, concurrency: int, loads: list[LoadResult], bases: list[LoadResult],
                   cut: tuple[Client, LoadResult, int], conversations: int,
                   before: tuple[SpecDecodeCounters | None, str | None], error: BaseException) -> BenchResult | None:
        """The row of a level cut short, marked partial, or None when nothing had finished. `cut`: the client whose
        load was cut, the load (its finished requests) and the round (0-based); `loads`, `bases`: the finished
        loads. Whole rounds stand as measured and the cut round is left out; a level cut in its first round
        reports the requests that had finished, without a speedup."""
        client, cut_load, cut_round = cut
        why = (f"interrupted (Ctrl-C) during the load on {client.flag}" if isinstance(error, KeyboardInterrupt)
               else f"{client.flag} stopped answering")
        finished = sum(r.error is None for r in cut_load.records)
        if cut_round > 0:
            loads, bases = loads[:cut_round], bases[:cut_round]
            note = (f"partial: {why} in round {cut_round + 1} of {self.config.rounds}; the row stands on the "
                    f"{cut_round} whole round(s) before it, and that round's requests are left out")
        else:  # the first round: what each server had answered (the cut load's finished requests)
            loads = loads + [cut_load] if client is self.client else loads
            bases = bases + [cut_load] if client is not self.client else bases
            note = (f"partial: {why} after {finished} of its requests had finished; the row holds the requests that "
                    f"finished, and {client.flag}'s tokens/s counts their tokens over the time until then (answers "
                    "still in flight are lost, so it reads low)")
        loads, bases = [load for load in loads if load.records], [load for load in bases if load.records]
        if not any(r.error is None for load in loads for r in load.records):
            return None
        try:
            result = self._level_result(dataset, concurrency, loads, bases, before, conversations)
        except UserError:  # every request to the baseline had failed: nothing comparable to show
            return None
        if cut_round == 0 and result.speedup is not None:
            result.speedup, result.speedup_per_round = None, []
            note += "; the speedup is left out, as the two servers did unequal work"
        result.partial = True
        result.notes.insert(0, note)
        return result

    def _level_counters(self, before: tuple[SpecDecodeCounters | None, str | None],
                        after: tuple[SpecDecodeCounters | None, str | None]) -> tuple[SpecDecodeCounters | None,
                                                                                        str | None]:
        """The counters' movement over a level, or (None, why tau is missing) where the server had counters at the
        start and they could not be read around this level, or went backwards (a restart, another replica)."""
        if before[0] is not None and after[0] is not None:
            moved = after[0] - before[0]
            if min(moved.drafts, moved.draft_tokens, moved.accepted_tokens) >= 0:
                return moved, None
            return None, (f"the spec-decode counters at {self.metrics_url} went backwards during this level (did "
                          "the server restart, or do its metrics come from another replica?), so tau is '-'")
        problem = before[1] or after[1]
        if not self.had_counters or problem is None:
            return None, None  # said once at the start: the server has none
        return None, f"the spec-decode counters could not be read around this level ({problem}), so tau is '-'"

    def _note(self, result: BenchResult, counters: SpecDecodeCounters | None, conversations: int,
              loads: list[LoadResult]) -> None:
        """What the level's numbers do not show: fewer requests in flight than its concurrency, no drafting at all,
        answers cut short by the server."""
        level = result.concurrency
        if self.config.duration_s is None and level > conversations:
            result.notes.append(f"--concurrency {level} is above the level's {conversations} conversation(s), so at "
                                f"most {conversations} request(s) were in flight: give --num-prompts {level} or more "
                                f"to load the server at {level}")
        if result.dflash_answers and result.dflash_output_tokens <= result.dflash_answers:
            result.speedup, result.speedup_per_round = None, []  # the prefill's token alone: no decoding was timed
            why = ("raise --max-new-tokens" if self.config.max_new_tokens <= 1 else
                   "the model ended every answer at once (a chat model asked through --endpoint completions often "
                   "does: try --endpoint chat)")
            result.notes.append(f"every answer ended at its first token (the prefill's), so no decoding was measured "
                                f"and there is no speedup ('-'): {why}")
        elif counters is not None and counters.drafts == 0 and self.drafter != NO_DRAFT and result.dflash_answers:
            result.notes.append(f"the --base-url server did no drafted step during this level (its spec-decode "
                                f"counters at {self.metrics_url} did not move), so tau is '-' and the figures are "
                                "plain decoding's: dflash serve's adaptive fallback decodes plainly while drafting "
                                "does not pay (see dflash:fallback_active in its metrics)")
        if self.config.duration_s is not None and not self.dflash_server and result.distinct_prompts is not None \
                and result.num_prompts > result.distinct_prompts:
            baseline = (f", the baseline's {result.baseline_num_prompts}" if result.baseline_num_prompts is not None
                        else "")
            result.notes.append(f"--duration cycled {result.distinct_prompts} distinct samples ({result.num_prompts} "
                                f"conversations to --base-url{baseline}): a server with a prefix cache (vLLM, SGLang) "
                                "answers a repeated prompt's prefill from memory, and the faster one repeats more, "
                                "which flatters its TTFT and throughput; load more samples (--max-samples 0: all)")
        if counters is not None:
            note = few_steps_note(counters.drafts, result.dflash_output_tokens, "--num-prompts (or --duration)")
            if note:
                result.notes.append(note)
        self._tell_once(result, "capped", capped_answers_warning(loads, self.config))

    def _tell_once(self, result: BenchResult, topic: str, note: str | None) -> None:
        """A note about the servers rather than the level: on the first level it applies to, not on every one."""
        if note is not None and topic not in self.told:
            self.told.add(topic)
            result.notes.append(note)

    def warm_up(self, sample: Sample) -> None:
        """One short untimed request to each server before the first load, so that what a server does once
        (allocating its caches, compiling kernels, timing its block sizes) is not billed to the first level."""
        config = dataclasses.replace(self.config, max_new_tokens=self.config.warmup_tokens)
        for client in (self.client, self.baseline):
            if client is None:
                continue
            warm = Client(client.base_url, config, client.model, client.flag)
            record = asyncio.run(_one_request(warm, sample))
            if record.error is not None:
                raise UserError(f"the warm-up request to {client.base_url} ({client.flag}) failed: {record.error}"
                                + _warm_up_hint(record.error, config))
        self.warmed_up = True


def _warm_up_hint(error: str, config: ServerConfig) -> str:
    """How to fix what a failed warm-up says, where the bench can tell: a base model (no chat template) refuses chat
    requests (dflash serve: "send the text to /v1/completions"; vLLM: "you must provide a chat template")."""
    if config.endpoint == "chat" and ("chat template" in error.lower() or "/v1/completions" in error):
        return ("; the server's model has no chat template (a base model): benchmark it with --endpoint completions, "
                "which sends plain text")
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    other = "completions" if config.endpoint == "chat" else "chat"
    if error.startswith("HTTP 404"):
        return (f"; the server has no {path} there: --base-url is the API root (e.g. http://127.0.0.1:8000/v1), "
                f"and a server with only the other endpoint takes --endpoint {other}")
    if error.startswith(("HTTP 401", "HTTP 403")):
        return ("; the server wants an API key: pass --api-key (or set $OPENAI_API_KEY)" if not config.api_key
                else "; the server refused the key given (--api-key, or $OPENAI_API_KEY)")
    return ""


async def _one_request(client: Client, sample: Sample) -> RequestRecord:
    messages = list(sample.history) + [{"role": "user", "content": sample.turns[0]}]
    async with httpx.AsyncClient(timeout=client.config.timeout_s) as http:
        return await client.request(http, messages, f"{sample.id} (warm-up)", 0, client.config.seed)


def _check_config(config: ServerConfig) -> None:
    if config.baseline_url and same_server(config.baseline_url, config.base_url):
        raise UserError(f"--baseline-url and --base-url name the same server ({config.baseline_url} and "
                        f"{config.base_url}); the baseline is the same target served without a drafter (dflash serve "
                        "--no-draft) on another port")
    if config.duration_s is not None and config.num_prompts is not None:
        raise UserError("--duration and --num-prompts both say how long a level lasts (a time, or a count of "
                        "conversations): give one")
    if config.endpoint not in ("chat", "completions"):
        raise UserError(f"--endpoint must be 'chat' or 'completions', not {config.endpoint!r}")
    if not config.concurrency or any(c < 1 for c in config.concurrency):
        raise UserError(f"--concurrency takes values >= 1, like 1 or 1,4,8; got {config.concurrency}")
    if config.rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {config.rounds}")
    if config.duration_s is not None and not (math.isfinite(config.duration_s) and config.duration_s > 0):
        raise UserError(f"--duration must be a finite number of seconds > 0, got {config.duration_s}")
    if config.num_prompts is not None and config.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {config.num_prompts}")
    if not (math.isfinite(config.timeout_s) and config.timeout_s > 0):
        raise UserError(f"--request-timeout must be a finite number of seconds > 0, got {config.timeout_s}")
    if config.warmup_tokens < 0:
        raise UserError(f"--warmup-tokens must be >= 0 (0 = no warm-up), got {config.warmup_tokens}")


def pooled(loads: list[LoadResult]) -> LoadResult:
    """Several loads as one: every request, and the time they took together."""
    return LoadResult([r for load in loads for r in load.records], sum(load.wall_s for load in loads),
                      sum(load.conversations for load in loads))


def summarize_load(dataset: str, load: LoadResult, base: LoadResult | None, counters: SpecDecodeCounters | None,
                   config: ServerConfig, concurrency: int, compare_sampled: bool = False) -> BenchResult:
    """A level's row; the two servers' texts are compared at temperature 0, and when sampling too with
    `compare_sampled` (two dflash serve, whose seeded answers are the target's own with that seed)."""
    ok = [r for r in load.records if r.error is None]
    _check_some_answered(load, config.base_url, "--base-url", config.duration_s)
    if base is not None:
        _check_some_answered(base, config.baseline_url, "--baseline-url", config.duration_s)
    failed = [r for r in load.records if r.error is not None]
    fast_tps = _throughput(load)
    base_tps = _throughput(base) if base is not None else None
    result = BenchResult(
        dataset=dataset, backend="server", num_prompts=load.conversations,
        distinct_prompts=len({r.sample_id for r in load.records}),
        num_requests=len(load.records), concurrency=concurrency, temperature=config.temperature,
        max_new_tokens=config.max_new_tokens, dflash_tokens_per_s=fast_tps, baseline_tokens_per_s=base_tps,
        speedup=ratio(fast_tps, base_tps), dflash_output_tokens=sum(r.output_tokens for r in ok),
        dflash_latency_ms=_latency_ms(load), requests_per_s=len(ok) / load.wall_s if load.wall_s > 0 else None,
        dflash_ttft_ms=mean_ms([r.ttft_s for r in ok]), dflash_tpot_ms=mean_ms([r.tpot_s for r in ok]),
        errors=len(failed), first_error=failed[0].error if failed else None, dflash_answers=len(ok),
    )
    for flag, loaded in (("--base-url", load), ("--baseline-url", base)):
        note = _turned_away_note(loaded, flag) if loaded is not None else None
        if note:
            result.notes.append(note)
    if base is not None:
        base_failed = [r for r in base.records if r.error is not None]
        result.baseline_errors = len(base_failed)
        result.baseline_first_error = base_failed[0].error if base_failed else None
        if result.errors or result.baseline_errors:  # the two servers did unequal work: no ratio of their rates
            result.speedup = None
            result.notes.append(f"speedup left out ('-'): {result.errors} request(s) to --base-url and "
                                f"{result.baseline_errors} to --baseline-url failed, so the two servers did unequal "
                                "work; fix what failed and run again")
        answered = [r for r in base.records if r.error is None]
        result.baseline_output_tokens = sum(r.output_tokens for r in answered)
        result.baseline_latency_ms = _latency_ms(base)
        result.baseline_ttft_ms = mean_ms([r.ttft_s for r in answered])
        result.baseline_tpot_ms = mean_ms([r.tpot_s for r in answered])
        if config.temperature == 0 or compare_sampled:
            result.mismatched_prompts = _compare_texts(base.records, load.records)
            result.mismatches = len(result.mismatched_prompts)
    if counters is not None and counters.drafts > 0:
        hist = histogram_from_counters(counters.drafts, counters.accepted_per_pos)
        result.block_size = len(hist) - 1 if counters.accepted_per_pos else None
        result.mean_acceptance_length = counters.mean_acceptance_length
        result.mean_block_size = counters.mean_block_size
        result.acceptance_histogram = hist if counters.accepted_per_pos else []
        result.acceptance_rate_per_position = acceptance_rate_per_position(hist) if counters.accepted_per_pos else []
    return result


def _turned_away_note(load: LoadResult, flag: str) -> str | None:
    """What to say when the server answered 429 (full) and requests waited to be sent again (None: none did)."""
    waited = [r.turned_away for r in load.records if r.turned_away]
    if not waited:
        return None
    return (f"{flag}: {len(waited)} request(s) were turned away with HTTP 429 ({sum(waited)} time(s) in all) and sent "
            "again after the server's Retry-After; their latency holds the waits, so this level measured queueing "
            "as well as decoding: lower --concurrency to what the server takes at once (dflash serve: "
            "--max-batch-size plus --max-queue)")


def capped_answers_warning(loads: list[LoadResult], config: ServerConfig) -> str | None:
    """What to say when answers ended for length short of --max-new-tokens (None: none did): the server caps
    max_tokens itself, and a level then measures shorter answers than asked for."""
    capped = [r.output_tokens for load in loads for r in load.records
              if r.error is None and r.finish_reason == "length" and r.output_tokens < config.max_new_tokens]
    if not capped:
        return None
    return (f"answers ended for length at {max(capped)} tokens, short of --max-new-tokens {config.max_new_tokens}: "
            "the server caps max_tokens, likely at its model's generation_config.json max_new_tokens (dflash serve "
            "and vLLM do); start it with --generation-config vllm to lift the cap, or lower --max-new-tokens")


SHORT_ANSWERS = 2.0  # mean output tokens per answer below which a load measures requests, not decoding


def short_answers_warning(result: BenchResult, config: ServerConfig) -> str | None:
    """What to say when the answers were too short to measure decoding (None: they were not): the usual cause is a
    chat model given raw text by --endpoint completions, which may end its answer at once."""
    answered = result.dflash_answers  # the DFlash server's alone
    if not answered or result.dflash_output_tokens / answered >= SHORT_ANSWERS:
        return None
    why = (" --endpoint completions sends the prompt without the chat template, and a chat model may end its answer "
           "at once: --endpoint chat applies it" if config.endpoint == "completions" else
           " check --max-new-tokens and the server's own limits")
    return (f"the answers of {config.base_url} averaged {result.dflash_output_tokens / answered:.1f} tokens, too few "
            f"to measure decoding;{why}")


def _check_some_answered(load: LoadResult, url: str, flag: str, duration_s: float | None = None) -> None:
    if not load.records:  # only --duration can end a level before its first request
        ended = f"the level's --duration {duration_s:g} s was up" if duration_s else "the level ended"
        raise UserError(f"no request to {url} ({flag}) was sent: {ended} before the first; give a longer --duration")
    if all(r.error is not None for r in load.records):
        raise UserError(f"every request to {url} ({flag}) failed; the first: {load.records[0].error}")


def _throughput(load: LoadResult) -> float | None:
    tokens = sum(r.output_tokens for r in load.records if r.error is None)
    return tokens / load.wall_s if load.wall_s > 0 else None


def _latency_ms(load: LoadResult) -> dict[str, float]:
    return {k: 1000.0 * v for k, v in percentiles([r.latency_s for r in load.records if r.error is None]).items()}


def _compare_texts(baseline: list[RequestRecord], dflash: list[RequestRecord]) -> list[str]:
    """Keys (sample#turn) where any DFlash answer differs from the baseline's first answer (greedy: every
    repeat of a prompt, in every round, must give the same text)."""
    first: dict[str, str] = {}
    for r in baseline:
        if r.error is None:
            first.setdefault(f"{r.sample_id}#{r.turn}", r.text)
    differ: list[str] = []
    for r in dflash:
        key = f"{r.sample_id}#{r.turn}"
        if r.error is None and key in first and r.text != first[key] and key not in differ:
            differ.append(key)
    return differ
