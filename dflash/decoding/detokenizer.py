"""Text deltas for a stream: the pieces always add up to the final (non-streamed) text.

Text that may be the start of a stop string is held back until it is clear, and so is half a multi-byte
character, so nothing sent ever has to be taken back.
"""

from __future__ import annotations


class TextDeltas:
    def __init__(self, tokenizer, stop_strings: list[str]):
        self._tokenizer = tokenizer
        self._stops = [s for s in stop_strings if s]
        self._ids: list[int] = []
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        """The new text that is safe to send after these tokens ('' when nothing is)."""
        self._ids.extend(tokens)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
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

    def _safe_length(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            return min(hits)
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
        for stop in self._stops:  # a tail that could begin a stop string waits for the next tokens
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:n]):
                    safe -= n
                    break
        return safe
