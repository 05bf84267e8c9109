"""The FastAPI app: OpenAI-compatible endpoints in front of the continuous-batching scheduler.

    GET  /v1/models             the one served model (GET /v1/models/{id}: that model, or 404)
    POST /v1/chat/completions   chat messages -> chat template -> decode (stream or not)
    POST /v1/completions        raw text or token ids -> decode
    GET  /health                200 while requests are taken (with running / waiting counts); 503 draining or down
    GET  /metrics               Prometheus exposition (see `metrics`)

Every client mistake is answered as an OpenAI error object with a 4xx status; the handlers never let one
reach the decode thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dflash.chat import ToolsUnshown, check_template_kwargs, check_tools_shown
from dflash.decoding.block_policy import BlockSizePolicy
from dflash.decoding.detokenizer import TextDeltas, decode
from dflash.decoding.engine import SEED_RANGE, GenerationConfig, GenerationOutput, Sequence, check_token_ids
from dflash.decoding.logprobs import TokenLogprob
from dflash.decoding.proposer import NoDraftProposer
from dflash.decoding.structure import StructureError
from dflash.errors import UserError
from dflash.serve.fallback import AUTO_NEEDS_STEP_COSTS, FallbackConfig
from dflash.serve.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_model_len
from dflash.serve.logprobs import LogprobFormat, LogprobPieces, joined, vllm_prompt_logprobs
from dflash.serve.metrics import ServerMetrics
from dflash.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    SamplingRequest,
    check_content_type,
    model_card,
    model_list,
    parse_request,
    sse,
)
from dflash.serve.sampling_defaults import sampling_defaults
from dflash.serve.scheduler import Event, QueueFull, Scheduler, SchedulerClosed, SchedulerConfig
from dflash.serve.scheduler import Request as Decoding
from dflash.serve.tools import HERMES_START, arguments_schema, writes_hermes_calls

log = logging.getLogger("dflash.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
RETRY_AFTER_S = 1  # what a 429 (every batch slot and queue place taken) tells the client to wait


@dataclass
class ServeConfig:
    served_model_name: str = "dflash"
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); "*" for any; none: no CORS
    max_model_len: int | None = None  # None: the target's context
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies are answered 413 before they are parsed
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    adaptive_block_size: bool = False  # measure step costs at start-up, then pick each step's block size
    # what a request that leaves out temperature, top_p or top_k gets (`sampling_defaults`): auto (the target's
    # generation_config.json, as vLLM and SGLang), vllm / openai (OpenAI's), or a directory with such a file
    generation_config: str = "auto"
    decode_thread: bool = True  # the app starts a decode thread; False: the caller runs `scheduler.run()`


class Server:
    """What the handlers share: the pipeline, the scheduler, the limits."""

    def __init__(self, pipe, config: ServeConfig):
        self.pipe = pipe
        self.config = config
        self.engine = pipe.engine
        target_context = self.engine.context_length
        why = self.engine.target.context_note or " (max_position_embeddings in its config.json)"
        self.max_model_len = check_max_model_len(config.max_model_len, target_context, why)  # prompt + max_tokens
        self.sampling = sampling_defaults(config.generation_config,
                                          getattr(self.engine.target.model, "generation_config", None))
        self.metrics = ServerMetrics.for_proposer(self.engine.proposer)
        self.logprob_format = LogprobFormat(pipe.tokenizer)
        drafting = not isinstance(self.engine.proposer, NoDraftProposer)
        if drafting and config.fallback.auto and not config.adaptive_block_size:
            raise UserError(AUTO_NEEDS_STEP_COSTS)
        policy = None
        if drafting and config.adaptive_block_size:
            policy = BlockSizePolicy.calibrate(self.engine, config.scheduler.max_batch_size)
        self.scheduler = Scheduler(self.engine, config.scheduler, self.metrics, config.fallback, policy)
        log.info("sampling defaults: %s", self.sampling.describe())
        if warning := self.sampling.unapplied_warning():
            log.warning("%s", warning)
        self.created = int(time.time())

    # ---- request -> sequence ----------------------------------------------------------------------------
    async def read_request(self, http: Request, model: type):
        """The validated request of a JSON body, parsed on a worker thread: a body of megabytes takes a second to
        read, and the event loop must go on answering /health and streaming other requests meanwhile."""
        check_content_type(http.headers.get("content-type"), http.headers.get("content-encoding"))
        return await run_in_threadpool(parse_request, await self.read_body(http), model)

    async def read_body(self, http: Request) -> bytes:
        """The request body, refused with a 413 as soon as it is known to exceed --max-request-bytes."""
        limit = self.config.max_request_bytes
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        try:
            async for chunk in http.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
        except ClientDisconnect:  # the client left mid-body: its mistake (or its choice), not the server's error
            log.info("a client disconnected before sending its whole request body")
            raise APIError(400, "the client disconnected before sending its whole request body") from None
        return bytes(body)

    async def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        """Template and tokenise on a worker thread: a long prompt takes a while, and the event loop must go on
        answering /health and streaming other requests meanwhile. The request's `chat_template_kwargs` update the
        server's own (`--enable-thinking`)."""
        if not self.pipe.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template (a base model), so chat messages "
                                "cannot be turned into its prompt; send the text to /v1/completions instead",
                           param="messages")
        try:
            check_template_kwargs(req.chat_template_kwargs)
        except UserError as err:
            raise APIError(400, str(err), param="chat_template_kwargs") from None
        self.check_tool_calls_read(req)
        try:
            return await run_in_threadpool(partial(self.pipe.encode, req.chat(), False, req.chat_template_kwargs,
                                                   continue_final_message=req.continue_final_message,
                                                   add_generation_prompt=req.add_generation_prompt,
                                                   tools=req.tool_dicts()))
        except ToolsUnshown as err:
            raise APIError(400, str(err), param="tools") from None
        except UserError as err:  # a conversation the template refuses (roles, order), text that is not Unicode
            raise APIError(400, str(err), param="messages") from None

    def check_tool_calls_read(self, req: ChatCompletionRequest) -> None:
        """Tools the template never shows are refused; tool_choice auto reads calls in Hermes' form, and is refused
        where the model writes them otherwise."""
        try:
            check_tools_shown(self.pipe.tokenizer, req.tool_dicts())
        except ToolsUnshown as err:
            raise APIError(400, str(err), param="tools") from None
        if req.tool_reader().mode != "auto" or (why := writes_hermes_calls(self.pipe.tokenizer)) is None:
            return
        raise APIError(400, f"tool_choice auto (the default with tools) reads the calls a model writes as Hermes' "
                            f"{HERMES_START} blocks of JSON, as Qwen's chat templates teach them, and for this model "
                            f"{why}; send tool_choice \"required\" or {{\"type\": \"function\", \"function\": "
                            "{\"name\": ...}} (a grammar then holds the answer to a call this server reads), "
                            "tool_choice \"none\", or serve the model with vLLM and its tool parser (dflash serve "
                            "--engine vllm)", param="tool_choice")

    async def encode_text(self, prompt: str | list[int], index: int = 0, prompts: int = 1) -> list[int]:
        """Tokenise text, or check token ids, on a worker thread (a long prompt's ids are many to check); a problem
        names the prompt (`index`) when the request has several."""
        def encode() -> list[int]:
            if isinstance(prompt, list):
                check_token_ids(prompt, self.pipe.target.vocab_size)
            return self.pipe.encode(prompt, True)

        try:
            return await run_in_threadpool(encode)
        except UserError as err:  # token ids outside the vocabulary, text the tokenizer cannot take
            raise APIError(400, f"prompt {index}: {err}" if prompts > 1 else str(err), param="prompt") from None

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.served_model_name:  # "" is no name, as vLLM reads it
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r} (see GET /v1/models)",
                           param="model", code="model_not_found")

    def token_budget(self, req: SamplingRequest, prompt_len: int, kind: str, default_max: int | None) -> int:
        """max_tokens for this request: the one asked for, or the default, within the context."""
        room = self.max_model_len - prompt_len
        if room < (0 if req.scores_prompt else 1):  # a prompt alone may fill the context
            raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room for new tokens in the context of "
                                f"{self.max_model_len} tokens; shorten it",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        field, asked = req.token_limit_field, req.token_limit
        cap = self.sampling.max_tokens or room  # generation_config's max_new_tokens, as in vLLM
        if asked is None and default_max is None:
            return min(room, cap)
        default = asked is None
        asked = default_max if default else asked
        if asked > room:
            named = f"{field} ({asked}, the default for completions)" if default else f"{field} ({asked})"
            raise APIError(400, f"prompt ({prompt_len} tokens) + {named} exceeds the context of "
                                f"{self.max_model_len} tokens; shorten the prompt or set {field} to at most {room}",
                           param=field, code="context_length_exceeded")
        return min(asked, cap)

    def generation_config(self, req: SamplingRequest, prompt_len: int, kind: str,
                          default_max: int | None) -> GenerationConfig:
        max_tokens = self.token_budget(req, prompt_len, kind, default_max)
        defaults = self.sampling
        json_schema, regex, _ = req.structure()
        return GenerationConfig(
            max_new_tokens=max_tokens, min_new_tokens=self.min_tokens(req, max_tokens),
            temperature=_given(req.temperature, defaults.temperature),
            top_p=_given(req.top_p, defaults.top_p), top_k=_given(req.top_k, defaults.top_k),
            min_p=_given(req.min_p, defaults.min_p), presence_penalty=_given(req.presence_penalty, 0.0),
            frequency_penalty=_given(req.frequency_penalty, 0.0),
            repetition_penalty=_given(req.repetition_penalty, defaults.repetition_penalty),
            seed=req.seed, stop_token_ids=self.stop_token_ids(req), ignore_eos=req.ignore_eos,
            stop_strings=req.stop_strings, branch_length=getattr(self.pipe, "branch_length", 0),
            logprobs=req.top_logprobs_asked, prompt_logprobs=_prompt_scores(req), logit_bias=self.logit_bias(req),
            json_schema=json_schema, regex=regex,
        )

    def min_tokens(self, req: SamplingRequest, max_tokens: int) -> int:
        """The request's min_tokens (0: none), within the answer's token limit and without a grammar."""
        if not req.min_tokens:
            return 0
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} is more than this answer's token limit, {max_tokens} "
                                f"({req.token_limit_field}, or what the context and the server's cap leave); send "
                                f"min_tokens up to {max_tokens}", param="min_tokens")
        if (structured_by := req.structure()[2]) is not None:
            raise APIError(400, f"min_tokens with {structured_by}: a structured answer ends where its grammar does, "
                                "and min_tokens would hold its end back; send one of them", param="min_tokens")
        return req.min_tokens

    def logit_bias(self, req: SamplingRequest) -> dict[int, float] | None:
        """The request's logit_bias by token id, each a token of the vocabulary."""
        bias = req.bias_by_token()
        try:
            check_token_ids(list(bias or ()), self.pipe.target.vocab_size, "logit_bias token ids")
        except UserError as err:
            raise APIError(400, str(err), param="logit_bias") from None
        return bias

    def stop_token_ids(self, req: SamplingRequest) -> list[int] | None:
        """The request's stop_token_ids (the engine stops at the target's EOS ids besides, unless ignore_eos), each
        checked to be a token of the vocabulary."""
        try:
            check_token_ids(req.stop_token_ids or [], self.pipe.target.vocab_size, "stop_token_ids")
        except UserError as err:
            raise APIError(400, str(err), param="stop_token_ids") from None
        return req.stop_token_ids

    async def submit(self, req: SamplingRequest, prompts: list[Prompted], kind: str,
                     default_max: int | None) -> list[Decoding]:
        """The request's n choices of each prompt (prompt by prompt), queued together; with a seed, choice i of
        each prompt samples with seed + i (as vLLM)."""
        rows = req.n * len(prompts)
        if rows > self.scheduler.capacity:
            asked = f"n={req.n} choices" if len(prompts) == 1 else f"{len(prompts)} prompts x n={req.n} choices"
            raise APIError(400, f"{asked} are more than this server decodes and queues at once "
                                f"({self.scheduler.capacity}: --max-batch-size + --max-queue); send at most that",
                           param="n" if len(prompts) == 1 else "prompt")
        if req.seed is not None and req.seed + req.n > SEED_RANGE[1]:
            raise APIError(400, f"seed={req.seed} with n={req.n}: choice i samples with seed + i, and seeds stop "
                                f"below 2**64; send a seed below {SEED_RANGE[1] - req.n + 1}", param="seed")
        configs = [self.prompt_config(req, p, i, len(prompts), kind, default_max) for i, p in enumerate(prompts)]
        rows = [(p.ids, _choice_config(config, i)) for p, config in zip(prompts, configs) for i in range(req.n)]
        seqs = await run_in_threadpool(self.new_sequences, req, rows)
        workload = f"{kind}/{'greedy' if configs[0].temperature == 0 else 'sampled'}"
        return self.scheduler.submit_all(seqs, workload, stream=req.stream)

    def prompt_config(self, req: SamplingRequest, prompt: Prompted, index: int, prompts: int, kind: str,
                      default_max: int | None) -> GenerationConfig:
        """`generation_config` for one prompt of a request; a problem names the prompt when there are several."""
        try:
            return self.generation_config(req, len(prompt.ids), kind, default_max)
        except APIError as err:
            if prompts == 1:
                raise
            raise APIError(err.status, f"prompt {index}: {err.message}", err.type, err.param, err.code) from None

    def new_sequences(self, req: SamplingRequest, rows: list[tuple[list[int], GenerationConfig]]) -> list:
        """The rows of the request's choices, built on a worker thread: compiling a grammar (json_schema, regex,
        tools) can take a while (`a{100000}`: 0.8 s), and the event loop must go on serving meanwhile."""
        try:
            return [self.engine.new_sequence(prompt_ids, config) for prompt_ids, config in rows]
        except StructureError as err:  # (other GenerationErrors, UserErrors, are 400s too, naming no field)
            if req.structure()[2] == "tool_choice":
                self.check_tool_parameters(req)
            raise APIError(400, str(err), param=req.structure()[2]) from None

    def check_tool_parameters(self, req: ChatCompletionRequest) -> None:
        """A 400 naming the first tool whose parameters no grammar can be made of (its call's grammar failed)."""
        for i, tool in enumerate(req.tools or ()):
            try:
                self.engine.grammar_for(GenerationConfig(json_schema=arguments_schema(tool.function.model_dump())),
                                        keep=False)
            except StructureError as err:
                message = str(err).replace("the json_schema cannot be used", "these parameters cannot hold a call")
                raise APIError(400, message, param=f"tools.{i}.function.parameters") from None

    # ---- answers ----------------------------------------------------------------------------------------------
    async def answer(self, http: Request, req: SamplingRequest, prompts: list[Prompted], kind: str,
                     default_max: int | None) -> Response:
        """The answer to a request of one or more prompts (a completions batch), with n choices each: choice
        index p * n + i is prompt p's i-th, as OpenAI numbers them; usage counts each prompt once."""
        decodings = await self.submit(req, prompts, kind, default_max)
        answer = _Answer(decodings, [p for p in prompts for _ in range(req.n)], sum(len(p.ids) for p in prompts))
        shape = ResponseShape(kind, self.config.served_model_name, include_usage=req.stream and req.include_usage)
        if req.stream:
            return StreamingResponse(self._stream(answer, shape, req), media_type="text/event-stream")
        return await self._complete(http, answer, shape, req)

    def stop_reason(self, result: GenerationOutput, req: SamplingRequest) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the answer (the earliest in its text), or the request's
        own stop token id it ended at; None when it ended otherwise (the target's EOS, its length)."""
        if result.finish_reason != "stop" or not result.output_ids:
            return None
        last = result.output_ids[-1]
        if last in (req.stop_token_ids or ()) and (req.ignore_eos or last not in self.pipe.target.eos_token_ids()):
            return last  # as vLLM: an EOS id that the request names stops as its own id once EOS is ignored
        return result.stop_string

    async def _complete(self, http: Request, answer: _Answer, shape: ResponseShape, req: SamplingRequest) -> Response:
        decodings = answer.decodings
        watcher = asyncio.create_task(_cancel_on_disconnect(http, decodings))
        try:
            async for _, event in _merged_events(decodings):  # each sends its final event only
                if event.done and event.error:  # the answer fails now; the other choices stop (finally)
                    raise _decode_error(event)
        finally:
            watcher.cancel()
            for decoding in decodings:
                decoding.cancel()
        choices = [self._choice(i, d.seq, shape, req, answer.prompts[i]) for i, d in enumerate(decodings)]
        extra: dict = {}
        if req.prompt_logprobs is not None:  # vLLM's: each completions choice's, and chat's answer's once
            scores = [vllm_prompt_logprobs(self.logprob_format, d.seq.prompt_logprobs or []) for d in decodings]
            extra.update(self._per_prompt(shape, choices, "prompt_logprobs", scores))
        if req.return_token_ids:  # vLLM's: the ids each choice read and wrote
            choices = [{**c, "token_ids": list(d.seq.output_ids)} for c, d in zip(choices, decodings)]
            extra.update(self._per_prompt(shape, choices, "prompt_token_ids", [d.seq.prompt_ids for d in decodings]))
        return JSONResponse(shape.full(choices, answer.prompt_tokens, answer.completion_tokens, extra))

    @staticmethod
    def _per_prompt(shape: ResponseShape, choices: list[dict], key: str, values: list) -> dict:
        """A field of each choice's prompt (vLLM's): set in each completions choice (in place), or returned for the
        chat answer's top level (its one prompt)."""
        if shape.kind == "chat":
            return {key: values[0]}
        for choice, value in zip(choices, values):
            choice[key] = value
        return {}

    def _choice(self, index: int, seq: Sequence, shape: ResponseShape, req: SamplingRequest,
                prompt: Prompted) -> dict:
        result = seq.result()
        text = self.echoed_prompt(prompt) + (result.text or "") if req.echoes else result.text or ""
        content, calls = req.tool_reader().read(text)
        logprobs = None
        if req.top_logprobs_asked is not None:
            logprobs = self.answer_logprobs(req, seq, shape.kind, result.logprobs or [], prompt)
        return shape.choice(index, content, result.finish_reason, self.stop_reason(result, req), logprobs,
                            [call.body() for call in calls])

    def answer_logprobs(self, req: SamplingRequest, seq: Sequence, kind: str, entries: list[TokenLogprob],
                        prompt: Prompted) -> dict:
        """A whole answer's `logprobs` object; an echo's starts with the prompt's tokens."""
        pieces = LogprobPieces(self.logprob_format, kind)
        scores = self.prompt_logprobs(pieces, seq, prompt) if req.echoes else None
        pieces.add(entries)
        answer = pieces.take() or self.logprob_format.body(kind, [])
        return joined(scores, answer) if scores else answer

    def prompt_logprobs(self, pieces: LogprobPieces, seq: Sequence, prompt: Prompted) -> dict:
        """An echoed prompt's `logprobs` object, its first token unscored; `pieces` goes on after it."""
        pieces.add(seq.prompt_logprobs, unscored=tuple(seq.prompt_ids[:1]))
        return pieces.take(sent=prompt.text)

    def echoed_prompt(self, prompt: Prompted) -> str:
        """The prompt as an echo shows it: the text the client sent, or its token ids' text."""
        return prompt.text if prompt.text is not None else decode(self.pipe.tokenizer, prompt.ids)

    async def _stream(self, answer: _Answer, shape: ResponseShape, req: SamplingRequest):
        """Server-sent events, each choice's chunks as its tokens come (`index` tells them apart); leaving early
        (a disconnect cancels this generator) frees the rows."""
        decodings = answer.decodings
        choices = [_StreamedChoice(self, i, d.seq, shape, req, answer.prompts[i]) for i, d in enumerate(decodings)]
        try:
            if shape.kind == "chat":
                calls_only = req.tool_reader().holds_text
                for choice in choices:
                    yield sse(shape.chunk(None, first=True, index=choice.index, calls_only=calls_only,
                                          so_far=choice.so_far()))
            async for index, event in _merged_events(decodings):
                if event.done and event.error:
                    yield sse(_decode_error(event).body())
                    break
                for chunk in choices[index].chunks(event):
                    yield sse(chunk)
            else:
                if req.include_usage:
                    yield sse(shape.usage_chunk(answer.prompt_tokens, answer.completion_tokens))
            yield sse("[DONE]")
        finally:
            for decoding in decodings:
                decoding.cancel()


class _StreamedChoice:
    """One choice of a streamed answer: its text deltas (held back where a stop string or a tool call may begin),
    its log-probabilities, an echo of the prompt before its first tokens, and its tool calls at the end."""

    def __init__(self, server: Server, index: int, seq: Sequence, shape: ResponseShape, req: SamplingRequest,
                 prompt: Prompted):
        self.server, self.index, self.seq, self.shape, self.req = server, index, seq, shape, req
        self.prompt = prompt
        self.deltas = TextDeltas(server.pipe.tokenizer, req.stop_strings, seq.stop.stop_token_ids,
                                 seq.stop.min_new_tokens)
        self.logprobs = LogprobPieces(server.logprob_format, shape.kind)
        self.echo = req.echoes
        self.tools = req.tool_reader().stream()
        self.completion_tokens = 0  # sent so far, for vLLM's continuous_usage_stats

    def chunks(self, event: Event) -> list[dict]:
        """The chunks an event (not a failure) sends: text as it is safe, then the choice's ending."""
        out = []
        if self.echo:  # the prompt first, once the prefill has scored it
            self.echo = False
            scores = None
            if self.req.top_logprobs_asked is not None:
                scores = self.server.prompt_logprobs(self.logprobs, self.seq, self.prompt)
            out.append(self._chunk(self.server.echoed_prompt(self.prompt), logprobs=scores))
        piece = self.deltas.add(event.tokens) if event.tokens else ""
        self.completion_tokens += len(event.tokens or ())
        self.logprobs.add(event.logprobs)
        if not event.done:
            piece = self.tools.add(piece)
            return out + ([self._chunk(piece, logprobs=self.logprobs.take())] if piece else [])
        result = self.seq.result()
        piece, calls = self.tools.finish(piece + self.deltas.finish(result.text or ""))
        if piece or self.logprobs.pending:
            out.append(self._chunk(piece, logprobs=self.logprobs.take()))
        if calls:
            out.append(self._chunk(None, tool_calls=[call.body(i) for i, call in enumerate(calls)]))
        finish = "tool_calls" if calls else result.finish_reason
        return out + [self._chunk(None, finish_reason=finish, stop_reason=self.server.stop_reason(result, self.req))]

    def _chunk(self, text: str | None, **fields) -> dict:
        return self.shape.chunk(text, index=self.index, so_far=self.so_far(), **fields)

    def so_far(self) -> tuple[int, int] | None:
        """(prompt tokens, completion tokens) of this choice so far, with vLLM's continuous_usage_stats."""
        return (len(self.prompt.ids), self.completion_tokens) if self.req.continuous_usage else None


@dataclass
class Prompted:
    """One prompt of a request: its token ids, and the text the client sent (an echo shows it as sent; None: token
    ids, or chat messages)."""

    ids: list[int]
    text: str | None = None


@dataclass
class _Answer:
    """A request's rows: the decodings of its choices (prompt by prompt), the prompt of each, and the prompt tokens
    usage counts (each prompt once)."""

    decodings: list[Decoding]
    prompts: list[Prompted]
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return sum(len(d.seq.output_ids) for d in self.decodings)


def _prompt_scores(req: SamplingRequest) -> int | None:
    """The alternatives per prompt token the engine lists (`GenerationConfig.prompt_logprobs`): vLLM's
    prompt_logprobs, or an echo's with logprobs (None: the prompt is not scored)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.top_logprobs_asked if req.echoes else None


def _choice_config(config: GenerationConfig, index: int) -> GenerationConfig:
    """Choice `index`'s config: with a seed, seed + index (as vLLM seeds a request's choices)."""
    return config if config.seed is None or index == 0 else dataclasses.replace(config, seed=config.seed + index)


def _given(value, default):
    """A request's sampling value, or the server's default where the request left it out."""
    return default if value is None else value


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes, this server's limit "
                         "(dflash serve --max-request-bytes); send a shorter prompt", code="request_too_large")


def _decode_error(event: Event) -> APIError:
    """A request the decoder could not finish: 503 when the server is shutting down (retry elsewhere or
    later, as for a request arriving then), 500 for a failure of its own."""
    if event.unavailable:
        return APIError(503, event.error, type="server_error", code="unavailable")
    return APIError(500, event.error, type="server_error")


async def _events(decoding: Decoding):
    while True:
        event = await decoding.events.get()
        yield event
        if event.done:
            return


async def _merged_events(decodings: list[Decoding]):
    """(choice index, event) of several decodings as they come, until each has finished."""
    if len(decodings) == 1:
        async for event in _events(decodings[0]):
            yield 0, event
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, decoding: Decoding) -> None:
        async for event in _events(decoding):
            merged.put_nowait((index, event))

    tasks = [asyncio.create_task(forward(i, d)) for i, d in enumerate(decodings)]
    try:
        running = len(decodings)
        while running:
            index, event = await merged.get()
            running -= event.done
            yield index, event
    finally:
        for task in tasks:
            task.cancel()


async def _cancel_on_disconnect(http: Request, decodings: list[Decoding]) -> None:
    """For non-streamed answers: the body is read, so the next ASGI message can only be a disconnect."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            for decoding in decodings:
                decoding.cancel()
            return


def create_app(pipe, config: ServeConfig | None = None) -> FastAPI:
    """The ASGI app for a loaded `DFlash` pipeline; the decode loop runs for the app's lifespan, on a thread the
    app starts, or (`decode_thread=False`) in the caller's `app.state.server.scheduler.run()`."""
    server = Server(pipe, config or ServeConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if server.config.decode_thread:
            server.scheduler.start()
        log.info("serving %r (drafter: %s), up to %d rows per batch, %d queued", server.config.served_model_name,
                 server.engine.proposer.kind, server.config.scheduler.max_batch_size,
                 server.config.scheduler.max_queue)
        yield
        server.scheduler.stop()

    app = FastAPI(title="DFlash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_AnswersUnexpectedErrors)
    app.add_middleware(_WithoutTrailingSlash)
    if server.config.allowed_origins:  # outermost: a browser's preflight is answered before authorization
        app.add_middleware(_CORS, allow_origins=list(server.config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.state.server = server
    _add_error_handlers(app)

    def authorize(http: Request) -> None:
        key = server.config.api_key
        if key is not None and not _bearer_matches(http.headers.get("authorization", ""), key):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    def card() -> dict:
        return model_card(server.config.served_model_name, server.created, server.max_model_len)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(http: Request):
        authorize(http)
        return model_list(card())

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(http: Request, model: str):
        authorize(http)
        server.check_model(model)
        return card()

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        authorize(http)
        req = await server.read_request(http, ChatCompletionRequest)
        server.check_model(req.model)
        req.check_supported()
        prompt_ids = await server.encode_chat(req)
        return await server.answer(http, req, [Prompted(prompt_ids)], "chat", default_max=None)

    @app.post("/v1/completions")
    async def completions(http: Request):
        authorize(http)
        req = await server.read_request(http, CompletionRequest)
        server.check_model(req.model)
        req.check_supported()
        prompts = [Prompted(await server.encode_text(p, i, len(req.prompts)), p if isinstance(p, str) else None)
                   for i, p in enumerate(req.prompts)]
        return await server.answer(http, req, prompts, "completion", default_max=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        counts = server.scheduler.counts()
        if not server.scheduler.alive:  # draining: a load balancer stops sending requests, the running ones finish
            status = "draining" if server.scheduler.draining else "down"
            return JSONResponse({"status": status, **counts}, status_code=503)
        return {"status": "ok", **counts}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(server.metrics.exposition(), media_type=server.metrics.content_type)

    return app


def _bearer_matches(header: str, key: str) -> bool:
    """`Authorization: Bearer KEY`; the scheme is case-insensitive (RFC 9110), the key compared in constant time."""
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key.encode())


class _WithoutTrailingSlash:
    """/v1/chat/completions/ is /v1/chat/completions. Starlette would answer 307 to the path without the slash, and
    a client that does not follow a POST's redirect would see an empty answer."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


class _AnswersUnexpectedErrors:
    """A bug answers 500 with an error object, and the connection serves the client's next request.

    Starlette's handler for `Exception` sends its response and then raises the error again, for the server to log;
    uvicorn then drops the keep-alive connection without a `Connection: close`, and the client's next request on it
    fails with a reset. Here the error is logged and answered, and goes no further. A response that has started
    (a stream) cannot be answered again: that error goes on, and the connection closes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as err:
            if started:
                raise
            log.exception("unexpected error answering a request")
            answer = _error_response(APIError(500, f"internal server error ({type(err).__name__})",
                                              type="server_error"))
            await answer(scope, receive, send)


class _CORS(CORSMiddleware):
    """Starlette's CORS, answering a refused preflight with an OpenAI error object (it sends plain text), as every
    other error of this server."""

    def preflight_response(self, request_headers):
        answer = super().preflight_response(request_headers)
        if answer.status_code != 400:
            return answer
        refused = answer.body.decode("utf-8", "replace")  # e.g. "Disallowed CORS origin"
        why = ("this server answers browsers from the origins --allowed-origins names" if "origin" in refused
               else "the browser asked for what this server's CORS settings do not allow")
        err = APIError(400, f"{refused}: {why}", code="cors_refused")
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
        return _error_response(err, headers)


def _error_response(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    sent = dict(headers or {})  # an HTTP error's own, e.g. a 405's Allow (RFC 9110 requires it)
    if err.status == 401:
        sent["WWW-Authenticate"] = "Bearer"
    elif err.status == 429:
        sent["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(err.body(), status_code=err.status, headers=sent or None)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return _error_response(err)

    @app.exception_handler(UserError)
    async def user_error(_, err: UserError):
        return _error_response(APIError(400, str(err)))

    @app.exception_handler(QueueFull)
    async def queue_full(_, err: QueueFull):
        return _error_response(APIError(429, str(err), type="rate_limit_error", code="queue_full"))

    @app.exception_handler(SchedulerClosed)
    async def closed(_, err: SchedulerClosed):
        return _error_response(APIError(503, str(err), type="server_error", code="unavailable"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        # OpenAI's type for an unknown route as for an unknown model; its clients read the status for the rest
        return _error_response(APIError(err.status_code, str(err.detail), type="invalid_request_error"), err.headers)

