"""Text of a growing output without decoding all of it again for every token.

Decoding the whole output for every new token (to look for stop strings) or every step (to stream) costs time in
proportion to its length, so a long answer pays for its length once per token. Both decode only its last tokens
instead: `tail_text` for stop strings, `TextDeltas` for a stream. A tokenizer's decoding is local, except at the
start of what it decodes (a leading space dropped, half a multi-byte character), so a window that reaches a few
tokens further back than needed gives the end of the text exactly.

Text deltas for a stream: the pieces always add up to the final (non-streamed) text. Text that may be the start
of a stop string is held back until it is clear, and so is half a multi-byte character, so nothing sent ever has
to be taken back.
"""

from __future__ import annotations

import re
import weakref
from itertools import groupby
from typing import Callable, Sequence

from dflash.errors import GenerationError

REPLACEMENT = "\ufffd"  # what bytes that do not (yet) make a whole UTF-8 character decode to
# What decoding a window from one of the output's tokens gets wrong is its first few characters (a dropped
# leading space, up to three replacement characters for half a character); a window reaches this much further.
TAIL_MARGIN_CHARS = 16
OVERLAP_TOKENS = 8  # tokens decoded again before a stream's new ones, to find where the new text starts


def decode(tokenizer, ids: Sequence[int], bytes_of: dict[int, int] | None = None) -> str:
    """The text of `ids` as this package shows it, streamed or whole: special tokens skipped, and spaces as the
    tokens hold them. transformers' clean_up_tokenization_spaces (on for some tokenizers) rewrites " ," as "," and
    " 'm" as "'m" once the next token has come, so text already streamed, or checked for a stop string, would change
    after the fact, and a stop string would be found at one step size and not another (vLLM leaves it off too).
    Bytes that are not UTF-8 become U+FFFD one bad part at a time, whatever the tokenizer (`utf8_runs`);
    `bytes_of`: the tokenizer's `byte_tokens`, looked up when not given."""
    bytes_of = byte_tokens(tokenizer) if bytes_of is None else bytes_of
    ids = list(ids)
    if bytes_of:  # skipped before the byte runs are read, as the decoder skips them before it joins bytes
        specials = _special_ids(tokenizer)
        ids = [i for i in ids if i not in specials]
    return tokenizer.decode(utf8_runs(ids, bytes_of), skip_special_tokens=True, clean_up_tokenization_spaces=False)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_byte_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer) -> dict[int, int]:
    """{id: byte} of a byte-fallback tokenizer's byte tokens (`<0xE4>`: Llama 2, Mistral, Gemma), which its decoder
    turns into text a whole run at a time: a run that is not UTF-8 as a whole becomes one U+FFFD per byte, so a
    window that starts inside a character decodes it otherwise than the whole text does. Empty for other
    tokenizers (and for one whose vocabulary cannot be listed)."""
    def read() -> dict[int, int]:
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # noqa: BLE001 - transformers' base class raises NotImplementedError; a duck type may lack it
            vocab = {}
        return {i: int(match[1], 16) for token, i in vocab.items()
                if isinstance(token, str) and (match := _BYTE_TOKEN.fullmatch(token))}

    return _once_per_tokenizer(_byte_tokens, tokenizer, read)


_specials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _special_ids(tokenizer) -> frozenset[int]:
    """The ids decode() skips (a tokenizer's special tokens)."""
    return _once_per_tokenizer(_specials, tokenizer,
                               lambda: frozenset(getattr(tokenizer, "all_special_ids", None) or ()))


def _once_per_tokenizer(cache: weakref.WeakKeyDictionary, tokenizer, read):
    """read() once per tokenizer; again at every call for one that cannot be weakly referenced."""
    try:
        return cache[tokenizer]
    except (KeyError, TypeError):
        pass
    found = read()
    try:
        cache[tokenizer] = found
    except TypeError:
        pass
    return found


def utf8_runs(ids: list[int], bytes_of: dict[int, int]) -> list[int]:
    """`ids`, with each run of byte tokens that is not UTF-8 as a whole written again as the UTF-8 of its text with
    one U+FFFD per bad part (Python's errors="replace", and byte-level BPE decoders', e.g. GPT-2's or Qwen's).
    A byte-fallback decoder writes such a run as U+FFFD throughout, the characters already streamed or checked for
    a stop string included, so one bad byte in a model's output used to change the text before it and end its
    stream there; a run cut inside its last character (a window's end) decodes to its whole characters and one
    U+FFFD. Tokenizers without byte tokens, and runs that are UTF-8, are left as they are."""
    if not bytes_of:
        return ids
    out: list[int] = []
    for is_byte, group in groupby(ids, key=bytes_of.__contains__):
        run = list(group)
        out += _utf8_run(run, bytes_of) if is_byte else run
    return out


def _utf8_run(run: list[int], bytes_of: dict[int, int]) -> list[int]:
    raw = bytes(bytes_of[i] for i in run)
    try:
        raw.decode("utf-8")
        return run
    except UnicodeDecodeError:
        pass
    id_of = {byte: i for i, byte in bytes_of.items()}
    fixed = raw.decode("utf-8", errors="replace").encode("utf-8")
    if not all(byte in id_of for byte in fixed):  # a vocabulary without the bytes of U+FFFD: as its decoder writes it
        return run
    return [id_of[byte] for byte in fixed]


def character_start(ids: Sequence[int], start: int, bytes_of: dict[int, int]) -> int:
    """`start`, or the token that begins the character it falls inside: at most 3 byte tokens back over UTF-8
    continuation bytes (0x80-0xBF). A window from there decodes its characters as the whole text does."""
    for _ in range(3):
        if not 0 < start < len(ids) or not 0x80 <= bytes_of.get(ids[start], 0) <= 0xBF:
            break
        start -= 1
    return start


def whole_characters_end(ids: Sequence[int], bytes_of: dict[int, int]) -> int:
    """How many of `ids` end in a whole character: all of them, or, for a byte-fallback tokenizer, those before a
    last character whose byte tokens have not all come (it decodes to U+FFFD until they have)."""
    if not ids or ids[-1] not in bytes_of:
        return len(ids)
    lead = character_start(ids, len(ids) - 1, bytes_of)
    first = bytes_of.get(ids[lead], 0)
    size = 2 if 0xC0 <= first < 0xE0 else 3 if 0xE0 <= first < 0xF0 else 4 if 0xF0 <= first < 0xF8 else 1
    return lead if len(ids) - lead < size else len(ids)


def tail_text(tokenizer, ids: Sequence[int], end: int, min_chars: int, since: int | None = None,
              bytes_of: dict[int, int] | None = None) -> tuple[str, bool]:
    """The decoded text of the last tokens of ids[:end], and whether it is all of them. It holds the text of
    tokens ids[since:end] (default: none) and at least min_chars + TAIL_MARGIN_CHARS characters before it, unless
    it is all of them; all but its first TAIL_MARGIN_CHARS characters are those of the whole text. The window never
    starts inside a character's byte tokens (`character_start`; `bytes_of`: the tokenizer's `byte_tokens`)."""
    since = end if since is None else since
    want = min_chars + TAIL_MARGIN_CHARS
    count = want // 4 + 8  # tokens before `since`; most hold several characters
    bytes_of = byte_tokens(tokenizer) if bytes_of is None else bytes_of
    while True:
        start = character_start(ids, max(0, since - count), bytes_of)
        if start == 0:
            return decode(tokenizer, ids[:end], bytes_of), True
        if len(decode(tokenizer, ids[start:since], bytes_of)) >= want:
            return decode(tokenizer, ids[start:end], bytes_of), False
        count *= 2


class StopSearchStart:
    """The characters a stop string must end past to count (`stopping`, min_new_tokens): those the first
    min_new_tokens tokens' text holds whole (without the U+FFFD of a character a later token completes), or all of
    the text while there are fewer tokens; 0 without min_new_tokens. Worked out once the tokens are there."""

    def __init__(self, tokenizer, min_new_tokens: int, bytes_of: dict[int, int]):
        self.tokenizer, self.min_new_tokens, self.bytes_of = tokenizer, min_new_tokens, bytes_of
        self._start: int | None = None

    def __call__(self, ids: Sequence[int], text_length: Callable[[], int]) -> int:
        """ids: the output so far; text_length(): its text's length, asked for while it has fewer tokens."""
        if not self.min_new_tokens:
            return 0
        if len(ids) < self.min_new_tokens:
            return text_length()
        if self._start is None:
            first = decode(self.tokenizer, ids[: self.min_new_tokens], self.bytes_of)
            self._start = len(first.rstrip(REPLACEMENT))
        return self._start


def first_stop(text: str, stop_strings: list[str], after: int = 0) -> tuple[int, str] | None:
    """The first of `stop_strings` in `text` that ends past character `after`, and where it starts: (character
    index, string), or None."""
    hits = [(i, s) for s in stop_strings if (i := text.find(s, max(0, after - len(s) + 1))) >= 0]
    return min(hits) if hits else None


class TextDeltas:
    def __init__(self, tokenizer, stop_strings: list[str], stop_token_ids: Sequence[int] = (),
                 min_new_tokens: int = 0):
        self._tokenizer = tokenizer
        self._stops = [s for s in stop_strings if s]

        self._stop_ids = set(stop_token_ids)  # a stop token ends the output and adds no text (as vLLM leaves it out)
        # per stop string: its last character -> the lengths n (longest first) of its prefixes stop[:n] ending so,
        # so a text's tail is compared only with the prefixes it could be
        self._prefix_ends = [_prefix_lengths_by_last_char(stop) for stop in self._stops]
        self._bytes_of = byte_tokens(tokenizer)
        self._search_start = StopSearchStart(tokenizer, min_new_tokens, self._bytes_of)  # (min_new_tokens)
        self._ids: list[int] = []
        self._text, self._end = "", 0  # the decoded text of self._ids[:self._end]
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        """The new text that is safe to send after these tokens ('' when nothing is)."""
        self._ids.extend(t for t in tokens if t not in self._stop_ids)
        end = whole_characters_end(self._ids, self._bytes_of)
        if end > self._end:
            self._text, self._end = self._extended_text(self._end, end), end
        text = self._text
        safe = self._safe_length(text)
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece = text[len(self.sent):safe]
        self.sent += piece
        return piece

    def finish(self, final_text: str) -> str:
        """What is left to send once decoding ended; `final_text` is the sequence's result text."""
        piece = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent += piece
        return piece

    def _extended_text(self, old_end: int, end: int) -> str:
        """The text of ids[:end], given that of ids[:old_end] (self._text): the text so far plus what the new tokens
        add after the last few old ones. Half a character at the end of the text so far (replacement characters)
        is decoded again with the bytes that complete it. The whole output is decoded again only at the start, or
        when the overlap holds no whole character."""
        start = character_start(self._ids, old_end - OVERLAP_TOKENS, self._bytes_of)
        if start > 0:
            before = decode(self._tokenizer, self._ids[start:old_end], self._bytes_of).rstrip(REPLACEMENT)
            after = decode(self._tokenizer, self._ids[start:end], self._bytes_of)
            settled = before.lstrip(REPLACEMENT)  # the window may start in half a character too
            text = self._text.rstrip(REPLACEMENT)
            if settled and after.startswith(before) and text.endswith(settled):
                return text + after[len(before):]
        return decode(self._tokenizer, self._ids[:end], self._bytes_of)

    def _safe_length(self, text: str) -> int:
        first = first_stop(text, self._stops, self._search_start(self._ids, lambda: len(text)))
        if first is not None:
            return first[0]
        safe = len(text.rstrip(REPLACEMENT))  # half a character decodes to one replacement character per byte
        for stop, ends in zip(self._stops, self._prefix_ends):  # a tail that could begin a stop string waits
            for n in ends.get(text[safe - 1], ()) if safe else ():
                if n <= safe and text.endswith(stop[:n], 0, safe):
                    safe -= n
                    break
        return safe


def _prefix_lengths_by_last_char(stop: str) -> dict[str, list[int]]:
    """{c: [n, ...]}: the lengths n < len(stop) of stop's prefixes that end in c, longest first."""
    ends: dict[str, list[int]] = {}
    for n in range(len(stop) - 1, 0, -1):
        ends.setdefault(stop[n - 1], []).append(n)
    return ends


def check_utf8(text: str, what: str) -> None:
    """Refuse lone surrogates: Python's stand-ins for bytes that were not UTF-8 (e.g. in a command line), which no
    decoded text holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GenerationError(f"{what} is not valid text: character {err.start} ({text[err.start]!r}) stands for a "
                              "byte that was not UTF-8; pass UTF-8 text") from None
