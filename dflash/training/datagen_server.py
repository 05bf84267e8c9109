"""`dflash datagen --base-url`: the target answers through an OpenAI-compatible server already serving it (vLLM,
SGLang, `dflash serve`), with that server's batching and kernels instead of loading the target here.

Each turn is rendered here, with the target's own tokenizer and chat template (and the run's template variables), and
sent as token ids to `/v1/completions`, so the record's `prompt_ids` are exactly what the server read. The answer's
`response_ids` are the ids the server sampled, its stop token included, where it returns them (vLLM's and dflash
serve's `return_token_ids`); from a server that does not, they are the answer text's tokens with the end token it
stopped at (a re-tokenized text need not be the sampled ids: a SentencePiece tokenizer adds a leading space, and a
text can be spelled two ways). Prompts are sent `--batch-size` at a time, each turn of a conversation after the one
before. A prompt the server refuses (a 400: too long for its context) is skipped with a warning; a transient
failure (a timeout, a 5xx, a dropped connection) is tried again a few times; anything else stops the run once the
answers finished beside it are written, and Ctrl-C stops it at once, keeping every record written.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import httpx

from dflash.decoding.sampling import derive_seed
from dflash.errors import UserError
from dflash.training.datagen import Generator, output_record, warn_capped

if TYPE_CHECKING:
    from dflash.training.datagen import DatagenConfig, DatagenResult, Prompt

RETRIES = 4  # tries of one request past a transient failure, waiting 1, 2, 4 ... seconds between them
CONNECT_TIMEOUT_S = 30.0  # reaching the server, and /v1/models's answer


class ServerError(UserError):
    """The server failed a request in a way trying again will not mend, or kept failing it."""


class Refused(ServerError):
    """The server refused one prompt (a 400 or 422: e.g. too long for its context); the others go on."""


class CompletionsClient:
    """An OpenAI-compatible server's /v1/completions, and what /v1/models says of the model it serves."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, connections: int,
                 timeout: float | None):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # a connection per conversation (--batch-size): none waits for one, which the timeout would count
        # an answer is read whole (not streamed): `timeout` bounds its time on the server (None: no bound)
        self.client = httpx.Client(base_url=self.base_url, headers=headers, limits=httpx.Limits(
            max_connections=connections), timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
        self.stopping = False  # Ctrl-C: the client is closed under the requests in flight, which end without retries
        card = self._model_card(model)
        self.model = card["id"]
        context = card.get("max_model_len")  # vLLM's and dflash serve's; None: the server does not say
        self.max_model_len = context if isinstance(context, int) and not isinstance(context, bool) else None

    def _model_card(self, model: str | None) -> dict:
        try:
            response = self.client.get("/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise ServerError(f"cannot reach the server at {self.base_url} ({type(err).__name__}: {err}); start it, "
                              "or fix --base-url (its OpenAI API root, e.g. http://127.0.0.1:8000/v1)") from None
        if response.status_code in (401, 403):
            raise ServerError(f"the server at {self.base_url} refused the API key ({response.status_code}); give "
                              "the key it was started with in --api-key")
        body = response.json() if _is_json(response) and response.status_code == 200 else None
        cards = body.get("data") if isinstance(body, dict) else None
        if isinstance(cards, list):
            cards = [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if not cards:
            raise ServerError(f"{self.base_url}/models answered {response.status_code} without a model list: is "
                              f"--base-url an OpenAI-compatible server's API root (ending in /v1)?")
        if model is None:
            return cards[0]
        named = [c for c in cards if c.get("id") == model]
        if not named:
            served = ", ".join(repr(c.get("id")) for c in cards)
            raise ServerError(f"the server at {self.base_url} does not serve --model {model!r}; it serves {served}")
        return named[0]

    def complete(self, prompt_ids: list[int], body: dict) -> dict:
        """One answer: the completions choice for these prompt ids, tried again past transient failures."""
        request = {"model": self.model, "prompt": prompt_ids, **body}
        for attempt in range(RETRIES + 1):
            try:
                response = self.client.post("/completions", json=request)
            except (httpx.TimeoutException, httpx.TransportError, RuntimeError) as err:  # RuntimeError: closed
                if self.stopping:
                    raise KeyboardInterrupt from None
                failure = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    return _choice(response, self.base_url)
                failure = f"{response.status_code}: {_error_message(response)}"
                if response.status_code in (400, 422):  # this prompt's fault
                    raise Refused(failure)
                if response.status_code < 500 and response.status_code != 429:  # the run's (a key, a model): stop
                    raise ServerError(f"the server at {self.base_url} refused a request ({failure})")
            if attempt < RETRIES and not self.stopping:
                time.sleep(2 ** attempt)
        raise ServerError(f"the server at {self.base_url} failed a request {RETRIES + 1} times (last: {failure})")

    def close(self) -> None:
        self.client.close()


def _is_json(response: httpx.Response) -> bool:
    try:
        response.json()
    except ValueError:
        return False
    return True


def _choice(response: httpx.Response, base_url: str) -> dict:
    body = response.json() if _is_json(response) else None
    choices = body.get("choices") if isinstance(body, dict) else None
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
        raise ServerError(f"{base_url}/completions answered 200 without a completion ({response.text[:200]!r}); is "
                          "--base-url an OpenAI-compatible server's API root?")
    return choices[0]


def _error_message(response: httpx.Response) -> str:
    """The message of OpenAI's error object ({"error": {"message"}}) or vLLM's ({"object": "error", "message"})."""
    body = response.json() if _is_json(response) else None
    if isinstance(body, dict):
        error = body.get("error") if isinstance(body.get("error"), dict) else body
        if error.get("message"):
            return str(error["message"])
    return response.text[:300]


class ServerGenerator(Generator):
    """The target answering prompts through a server: the local generator's turns and room, each turn rendered here
    and decoded there, `--batch-size` conversations at a time."""

    def __init__(self, config: DatagenConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        target = target_source(config)
        self.tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=config.trust_remote_code)
        self.server = CompletionsClient(config.base_url, config.model,
                                        config.api_key or os.environ.get("OPENAI_API_KEY"), config.batch_size,
                                        config.request_timeout or None)
        context = self.server.max_model_len
        if context is None:  # the server does not say: the target's own
            text_config = AutoConfig.from_pretrained(target, trust_remote_code=config.trust_remote_code)
            context = getattr(text_config.get_text_config(), "max_position_embeddings", None)
        self.context = context
        self.context_words = f"{context} tokens" if context else "unknown size"
        self.end_id = self._end_id(target)
        self.failure: UserError | None = None  # what stops the run, once the chunk's other answers are written
        self._lock = threading.Lock()  # the run's counts and warnings, from the conversations' threads
        self.note_plain_text(self.tokenizer)

    def _end_id(self, target: str) -> int | None:
        """The token an answer that stopped at the end of its text ends with: the tokenizer's end-of-text token (a
        chat model's end of turn), else the first the target's generation config names."""
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(target).eos_token_id
        except (OSError, ValueError):
            return None
        return eos[0] if isinstance(eos, list) and eos else eos

    def encode(self, conversation: list[dict]) -> list[int]:
        """A turn's token ids, as `DFlash.encode` renders them, from the tokenizer alone."""
        from dflash.chat import encode_conversation

        return encode_conversation(self.tokenizer, conversation, self.config.template_kwargs())

    def room(self, prompt_ids: list[int]) -> int:
        if self.context is None:
            return self.config.max_new_tokens
        return min(self.config.max_new_tokens, self.context - len(prompt_ids))

    def answer(self, chunk: list[Prompt], first_ids: dict[int, list[int]], result: DatagenResult) -> list[dict]:
        """Every turn of every prompt of the chunk, the conversations side by side on the server (a daemon thread
        each: Ctrl-C need not wait for a request in flight); the records in the chunk's order. A failure that stops
        the run waits for the others to finish (`failed` then says it, once their records are written)."""
        done: queue.Queue = queue.Queue()

        def converse(index: int, prompt: Prompt, ids: list[int]) -> None:
            try:
                done.put((index, self._conversation(prompt, ids, result), None))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                done.put((index, None, err))

        for index, prompt in enumerate(chunk):
            threading.Thread(target=converse, args=(index, prompt, first_ids.pop(prompt.id)), daemon=True).start()
        records: list[dict | None] = [None] * len(chunk)
        try:
            for _ in chunk:
                index, record, error = done.get()
                if isinstance(error, UserError):
                    self.failure = self.failure or error
                elif error is not None:
                    raise error
                records[index] = record
        except BaseException:  # Ctrl-C (SIGTERM), or a bug: the connections close under the requests in flight
            self.server.stopping = True
            self.server.close()
            raise
        return [r for r in records if r is not None]

    def failed(self) -> UserError | None:
        return self.failure

    def _conversation(self, prompt: Prompt, first_ids: list[int], result: DatagenResult) -> dict | None:
        """One prompt's turns, each after the one before (it sees the target's own earlier answers)."""
        conversation: list[dict] = []
        answered: list[tuple[list[int], list[int], str]] = []
        for turn, messages in enumerate(prompt.turns):
            messages = conversation + self._with_suffix(messages)
            ids = first_ids if turn == 0 else self.encode_turn(prompt, messages)
            if self.room(ids) < 1:
                self._cut(prompt, turn, ids, result)
                break
            try:
                choice = self.server.complete(ids, self._sampling(prompt, ids))
            except Refused as err:
                self._refused(prompt, turn, err, result)
                break
            text = choice.get("text") or ""
            conversation = messages + [{"role": "assistant", "content": text}]
            answered.append((ids, self._response_ids(choice, text), choice.get("finish_reason") or "length"))
        return output_record(prompt, conversation, answered) if answered else None

    def _response_ids(self, choice: dict, text: str) -> list[int]:
        """The ids the server sampled (return_token_ids), else the text's tokens and the end token it stopped at:
        its stop_reason where that is a token id (vLLM's, for an end token other than the tokenizer's), else the
        tokenizer's."""
        sampled = choice.get("token_ids")
        if isinstance(sampled, list) and all(isinstance(t, int) for t in sampled):
            return sampled
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if choice.get("finish_reason") == "stop":
            reason = choice.get("stop_reason")  # a string: a stop string, which the text ends before
            if isinstance(reason, int) and not isinstance(reason, bool):
                ids.append(reason)
            elif reason is None and self.end_id is not None:
                ids.append(self.end_id)
        return ids

    def _cut(self, prompt: Prompt, turn: int, ids: list[int], result: DatagenResult) -> None:
        with self._lock:
            result.cut += 1
            warn_capped(result.cut, f"{prompt.where} (output id {prompt.id}): turn {turn + 1} of "
                         f"{len(prompt.turns)} ({len(ids)} tokens) leaves no room for an answer in the target's "
                         f"context of {self.context_words}; its record keeps the first {turn}",
                         "more conversations end early, their later turns too long for the target's context: the "
                         "summary counts them")

    def _refused(self, prompt: Prompt, turn: int, err: Refused, result: DatagenResult) -> None:
        """A turn the server refused: the first turn's prompt is skipped (as one too long for the context), a
        later turn ends its conversation there."""
        which = f"turn {turn + 1} of {len(prompt.turns)}" if turn else "its prompt"
        if turn:
            with self._lock:
                result.cut += 1
                warn_capped(result.cut, f"{prompt.where} (output id {prompt.id}): the server refused {which} "
                             f"({err}); its record keeps the first {turn}",
                             "more conversations end early: the summary counts them")
            return
        with self._lock:
            result.skipped.append(f"{prompt.where} (output id {prompt.id}): the server refused {which} ({err})")
            warn_capped(len(result.skipped), f"skipped {result.skipped[-1]}",
                         "more prompts are skipped: the summary counts them")

    def _sampling(self, prompt: Prompt, prompt_ids: list[int]) -> dict:
        """The request's sampling fields: the local run's (`_generation_config`), its seed as the int64 of the same
        bits (what servers take; the same noise)."""
        c = self.config
        seed = derive_seed(c.seed, prompt.id)
        return {"max_tokens": self.room(prompt_ids), "temperature": c.temperature, "top_p": c.top_p,
                "seed": seed - 2**64 if seed >= 2**63 else seed, "return_token_ids": True}

    def close(self) -> None:
        self.server.close()


def target_source(config: DatagenConfig) -> str:
    """Where the target's tokenizer and configuration are read: --target, else the embedded target."""
    from dflash.api import DEFAULT_TARGET

    return config.target or str(DEFAULT_TARGET)
