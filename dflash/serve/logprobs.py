"""OpenAI's `logprobs` objects, from the engine's log-probabilities of output tokens (`TokenLogprob`).

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}, where each
position's dictionary holds its `logprobs` most likely tokens and the chosen one (OpenAI's "up to logprobs + 1").

A token's text is what it adds to the text before it, special tokens included (an answer's EOS shows as itself):
decoded after a plain token, so that a SentencePiece token keeps the space a decoder drops at the start of a
text. Its bytes are the token's own where a byte-level or byte-fallback tokenizer splits a character across tokens
(the text is then U+FFFD). Log-probabilities are floored at -9999.0, as vLLM's are, since JSON has no -Infinity.
"""

from __future__ import annotations

import codecs
from functools import lru_cache

from dflash.decoding.detokenizer import REPLACEMENT, byte_tokens
from dflash.decoding.logprobs import TokenLogprob

FLOOR = -9999.0


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2, Qwen, Llama 3): each byte is written as one printable character, the
    printable Latin-1 bytes as themselves and the others as code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class LogprobFormat:
    """Formats one tokenizer's tokens; each token's text and bytes are worked out once."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._bytes_of = byte_tokens(tokenizer)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._before = tokenizer.encode("a", add_special_tokens=False)[-1:]  # a plain token to decode after

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its bytes."""
        if token_id not in self._cache:
            text = self._text(token_id)
            self._cache[token_id] = (text, self._raw_bytes(token_id, text))
        return self._cache[token_id]

    def _text(self, token_id: int) -> str:
        def decode(ids: list[int]) -> str:
            return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        before = decode(self._before)
        after = decode(self._before + [token_id])
        return after[len(before):] if self._before and after.startswith(before) else decode([token_id])

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        if REPLACEMENT not in text:
            return list(text.encode("utf-8"))
        if token_id in self._bytes_of:
            return [self._bytes_of[token_id]]
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        alphabet = _byte_level_alphabet()
        if isinstance(piece, str) and piece and all(c in alphabet for c in piece):
            return [alphabet[c] for c in piece]
        return list(text.encode("utf-8"))

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": [{**self._chat_token(e.token_id, e.logprob),
                             "top_logprobs": [self._chat_token(i, p) for i, p in e.top]} for e in entries]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": raw}

    def completion(self, entries: list[TokenLogprob], offsets: TextOffsets, unscored: tuple[int, ...] = (),
                   sent: str | None = None) -> dict:
        """The object for these tokens, after the tokens `unscored` (a prompt's first, which nothing before it
        scores: null, as in OpenAI's echo); `offsets` goes on through them. `sent`: the text they stand for, where
        it is the client's own (a prompt echoed as sent), which holds the special tokens the client wrote but not
        those the tokenizer added (a BOS); decoded text holds none."""
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in [(t, None) for t in unscored] + [(e.token_id, e) for e in entries]:
            text, raw = self.token(token_id)
            body["tokens"].append(text)
            body["token_logprobs"].append(None if entry is None else max(entry.logprob, FLOOR))
            body["top_logprobs"].append(None if entry is None else self._top_dict(entry))
            shown = token_id not in self._special or (sent is not None and sent.startswith(text, offsets.chars))
            body["text_offset"].append(offsets.add(raw) if shown else offsets.chars)
        return body

    def _top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        """{text: log-probability} of the most likely tokens and the chosen one; of tokens with the same text
        (several partial characters are U+FFFD) the likeliest's."""
        top: dict[str, float] = {}
        for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob)):
            top.setdefault(self.token(token_id)[0], max(logprob, FLOOR))
        return top

    def body(self, kind: str, entries: list[TokenLogprob], offsets: TextOffsets | None = None,
             unscored: tuple[int, ...] = (), sent: str | None = None) -> dict:
        """The `logprobs` object of a chat or a completion choice (see `completion`)."""
        if kind == "chat":
            return self.chat(entries)
        return self.completion(entries, offsets or TextOffsets(), unscored, sent)


def joined(*bodies: dict) -> dict:
    """Completions' objects of consecutive tokens (an echoed prompt's, then the answer's) as one."""
    return {key: [item for body in bodies for item in body[key]] for key in bodies[0]}


class TextOffsets:
    """Where each token's text starts in a completion's text, in characters: the tokens' bytes added up, so a
    character split across tokens counts once, at the token that completes it."""

    def __init__(self):
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds half a character until it completes

    def add(self, raw: list[int]) -> int:
        """A token's bytes: the offset where its text starts."""
        start = self.chars
        self.chars += len(self._utf8.decode(bytes(raw)))
        return start


class LogprobPieces:
    """Log-probabilities handed out a piece at a time, their text offsets running on: a stream's chunks, each with
    those of the tokens decoded since the chunk before it (text that may begin a stop string is held back, so a
    chunk's tokens and its text can differ by a few), or an echoed prompt's and then its answer's."""

    def __init__(self, fmt: LogprobFormat, kind: str):
        self._fmt, self._kind = fmt, kind
        self._pending: list[TokenLogprob] = []
        self._unscored: tuple[int, ...] = ()
        self._offsets = TextOffsets()

    def add(self, entries: list[TokenLogprob] | None, unscored: tuple[int, ...] = ()) -> None:
        """Tokens decoded since the last chunk; `unscored`: an echoed prompt's first token, sent before them."""
        self._unscored += unscored
        self._pending += entries or []

    @property
    def pending(self) -> bool:
        return bool(self._pending or self._unscored)

    def take(self, sent: str | None = None) -> dict | None:
        """The object for the tokens not sent yet (None: none); `sent` as in `LogprobFormat.completion`."""
        if not self.pending:
            return None
        body = self._fmt.body(self._kind, self._pending, self._offsets, self._unscored, sent)
        self._pending, self._unscored = [], ()
        return body


def vllm_prompt_logprobs(fmt: LogprobFormat, entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing before it to score it), then per token
    {token id: {"logprob", "rank", "decoded_token"}} for it and its position's most likely tokens."""
    out: list[dict | None] = [None]
    for entry in entries:
        position = {str(entry.token_id): _vllm_logprob(fmt, entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            position.setdefault(str(token_id), _vllm_logprob(fmt, token_id, logprob, rank))
        out.append(position)
    return out


def _vllm_logprob(fmt: LogprobFormat, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": max(logprob, FLOOR), "rank": rank, "decoded_token": fmt.token(token_id)[0]}
