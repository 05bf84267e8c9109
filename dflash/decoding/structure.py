"""Structured output: an answer held to a JSON schema or a regular expression, by masking the target's logits.

A row's grammar (llguidance's matcher, as vLLM and SGLang use it) says which tokens may come next. In a verify
forward the logits at slot i choose the token after the anchor and the draft tokens 1..i, so slot i is masked with
what the grammar allows after those tokens: the matcher reads the draft tokens one by one, giving each slot's mask,
then rolls back. Past the first draft token the grammar refuses, no slot is masked: the target's choice at the slot
before it cannot be that token, so nothing after it is accepted (but for an EOS after a complete answer, which the
matcher does not read and the mask allows: it ends the answer). Every token is chosen from what the target alone
would choose it from, so drafting stays lossless. The drafters draft unconstrained; a draft token the grammar
refuses is turned down. A batch holding a row with a grammar verifies no branch.

llguidance is an optional dependency: `pip install 'dflash[structured]'`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from dflash.errors import GenerationError

INSTALL = "pip install 'dflash[structured]'"  # llguidance: structured output's one dependency
COMPILED_KEPT = 64  # compiled grammars kept for reuse, the least recently used dropped first


class StructureError(GenerationError):
    """A json_schema or regex that cannot hold an answer here (invalid, or llguidance missing)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise StructureError(f"structured output (json_schema, regex) needs llguidance: {INSTALL}") from None
    return llguidance


def grammar_text(json_schema: dict | None, regex: str | None) -> str:
    """llguidance's grammar for a JSON schema or a regular expression (one of them)."""
    llg = _llguidance()
    if json_schema is None:
        return llg.LLMatcher.grammar_from_regex(regex)
    try:
        text = json.dumps(json_schema)
    except (TypeError, ValueError) as err:  # values JSON cannot hold (a set, an object)
        raise StructureError(f"the json_schema is not JSON ({err}); give a schema of JSON values") from None
    return llg.LLMatcher.grammar_from_json_schema(text)


class GrammarCompiler:
    """Builds each row's `Grammar` over one tokenizer (the target's; llguidance reads it once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]):
        if tokenizer is None:
            raise StructureError("structured output masks tokens by their text, and this target has no tokenizer: "
                                 "give it one (TargetModel(model, tokenizer))")
        llg = _llguidance()
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids or None)
        except (ValueError, RuntimeError) as err:  # a slow (Python) tokenizer, or a decoder llguidance lacks
            raise StructureError(f"llguidance cannot read this tokenizer for structured output ({err}); it reads fast "
                                 "tokenizers (tokenizer.json) with byte-level (GPT-2, Llama 3, Qwen) or byte-fallback "
                                 "(Llama 2, Mistral, Gemma) decoders") from None
        self.vocab_size = vocab_size
        # grammar text -> a matcher compiled from it and never advanced, copied for each row: a request's n choices,
        # and clients that send the same schema (the same tools) turn after turn, compile it once
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # a server builds rows on worker threads

    def grammar(self, json_schema: dict | None, regex: str | None, keep: bool = True) -> "Grammar":
        """A row's grammar: a copy of the compiled one, compiled here the first time (outside the lock, so that
        one heavy grammar holds up no other row's); `keep=False`: compiled without being kept (a check)."""
        text = grammar_text(json_schema, regex)
        with self._lock:
            compiled = self._compiled.get(text)
            if compiled is not None:
                self._compiled.move_to_end(text)
                return Grammar(compiled.deep_copy(), self.vocab_size)
        compiled = _llguidance().LLMatcher(self.tokenizer, text, log_level=0)
        if compiled.is_error():  # the grammar is compiled here: a bad one leaves the matcher in error
            what = "json_schema" if json_schema is not None else "regex"
            raise StructureError(f"the {what} cannot be used: {first_line(compiled.get_error())}; fix it")
        if keep:
            with self._lock:
                self._compiled[text] = compiled
                self._compiled.move_to_end(text)
                if len(self._compiled) > COMPILED_KEPT:
                    self._compiled.popitem(last=False)
        return Grammar(compiled.deep_copy(), self.vocab_size)


class Grammar:
    """One row's matcher: the tokens allowed next, after the output so far and after draft tokens."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the tokens the grammar allows next; all of them once the matcher has failed (its row fails
        when it records its next tokens: `advance`)."""
        if self.matcher.is_error():
            return torch.ones(self.vocab_size, dtype=torch.bool)
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)[: self.vocab_size]
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[: bias.shape[0]] = bias > 0
        return allowed

    def slot_masks(self, tokens: list[int]) -> torch.Tensor:
        """(q, vocab) bool for a forward's q tokens (the anchor, then draft tokens): slot i's mask after draft tokens
        1..i; all True past the first draft token the grammar refuses (no slot there is ever used)."""
        drafts = tokens[1:]
        valid = self.matcher.validate_tokens(drafts)
        masks = torch.ones(len(tokens), self.vocab_size, dtype=torch.bool)
        read = 0
        for i in range(valid + 1):
            masks[i] = self.allowed()
            if i == valid or self.matcher.is_stopped():  # a complete answer allows its EOS alone, and reads no more
                break
            if not self.matcher.consume_token(drafts[i]):  # llguidance's own limits: the matcher has failed
                break
            read += 1
        self.matcher.rollback(read)
        return masks

    def advance(self, tokens: list[int]) -> str | None:
        """Read the output's new tokens, each one the grammar allowed (after a complete answer, the EOS that ends it,
        which the matcher does not read). Returns why the matcher failed, or None: a grammar within llguidance's
        checks can still pass its limits on the way ("too many expressions"), and that fails its row alone."""
        for token in tokens:
            if self.matcher.is_stopped():  # a complete answer, or a failed matcher
                break
            self.matcher.consume_token(token)
        if self.matcher.is_error():
            return (f"the answer's grammar failed in llguidance ({first_line(self.matcher.get_error())}); simplify "
                    "the json_schema or regex")
        return None


def first_line(text: str, limit: int = 300) -> str:
    """llguidance's errors hold its state and grammar after their first line: that line alone, for a person."""
    line = text.strip().splitlines()[0] if text.strip() else "no reason given"
    return line if len(line) <= limit else line[:limit] + "..."


def constrain(logits: torch.Tensor, rows: list, tokens: torch.Tensor | None = None,
              copy: bool = True) -> torch.Tensor:
    """logits (b, q, vocab) with -inf where a row's grammar refuses the token (a new tensor; the same one where no
    row has a grammar); tokens (b, q): a verify forward's (the anchor first), whose draft tokens the slots after them
    follow; None: every slot masked as the output stands. copy=False: the logits are changed in place."""
    grammars = [getattr(row, "grammar", None) for row in rows]
    if all(g is None for g in grammars):
        return logits
    logits = logits.clone() if copy else logits
    for r, grammar in enumerate(grammars):
        if grammar is None:
            continue
        allowed = grammar.allowed()[None] if tokens is None else grammar.slot_masks(tokens[r].tolist())  # (q, vocab)
        logits[r] = logits[r].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits
