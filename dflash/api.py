"""The one-call Python API: load a target + drafter pair, generate from text, chat messages or token ids.

    from dflash import DFlash
    pipe = DFlash.from_pretrained()                       # the embedded pair
    out = pipe.generate("What is 12 * 7?", max_new_tokens=64)
    print(out.text, out.stats.mean_acceptance_length)
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Union

import torch

from dflash.decoding.detokenizer import TextDeltas
from dflash.decoding.engine import AUTO, GenerationConfig, GenerationError, GenerationOutput, SpeculativeEngine
from dflash.decoding.proposer import DFlashProposer, NoDraftProposer
from dflash.errors import UserError
from dflash.model.cpu_layout import use_fast_layout
from dflash.model.loading import load_drafter
from dflash.model.target import TargetModel

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFT = ASSETS / "drafter"

Prompt = Union[str, list[dict[str, str]], list[int]]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class DFlash:
    """A target, an optional DFlash drafter, their tokenizer, and the engine that decodes with them."""

    def __init__(self, target: TargetModel, drafter=None, block_size: int | str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        """`block_size`: tokens verified per step (at most the drafter's), None for the drafter's own, or "auto"
        to choose it before every step from timed step costs and the acceptance seen so far.
        `chat_template_kwargs`: variables for the chat template on every chat prompt, e.g.
        `{"enable_thinking": False}` for Qwen3 (default: the template's own defaults)."""
        self.target = target
        self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs)
        self.drafter = drafter
        self.tokenizer = target.tokenizer
        if target.device.type == "cpu":
            use_fast_layout([target.model] + ([drafter] if drafter is not None else []))
        self.block_size = make_config(block_size=block_size).block_size  # validated: a number, None or "auto"
        fixed = None if block_size == AUTO else block_size
        proposer = DFlashProposer(drafter, target, fixed) if drafter is not None else NoDraftProposer()
        self.engine = SpeculativeEngine(target, proposer)

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = None,
        *,
        no_draft: bool = False,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        block_size: int | str | None = None,
        mask_token_id: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> "DFlash":
        """Paths or hub ids. With neither given, the embedded pair; `no_draft=True` decodes plainly."""
        device = device or default_device()
        if target is None:
            target = DEFAULT_TARGET
            draft = draft if draft is not None else (None if no_draft else DEFAULT_DRAFT)
            missing = [p for p in (target, draft) if p is not None and not (Path(p) / "config.json").exists()]
            if missing:
                raise UserError(f"the embedded model pair is missing ({', '.join(map(str, missing))}); reinstall "
                                "dflash from a full checkout, or pass --target/--draft")
        target_model = TargetModel.from_pretrained(target, dtype=dtype, device=device)
        drafter = None
        if draft is not None and not no_draft:
            drafter = load_drafter(draft, mask_token_id=mask_token_id, dtype=target_model.dtype, device=device)
        return cls(target_model, drafter, block_size, chat_template_kwargs)

    # ---- prompts ------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, raw: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids for a prompt: ids as given; chat messages and (unless raw) text via the chat template, with
        the pipeline's template variables updated by `chat_template_kwargs`."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if self.tokenizer is None:
            raise GenerationError("this target has no tokenizer; pass token ids instead of text")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if isinstance(prompt, list):
            _check_messages(prompt)
            if not has_template:
                raise GenerationError("the tokenizer has no chat template; send plain text with raw=True")
            variables = {**self.chat_template_kwargs, **check_template_kwargs(chat_template_kwargs)}
            return _as_ids(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                              **variables))
        if not isinstance(prompt, str):
            raise GenerationError("a prompt is text, a list of chat messages or a list of token ids, "
                                  f"not {type(prompt).__name__}")
        if has_template and not raw:
            return self.encode([{"role": "user", "content": prompt}], chat_template_kwargs=chat_template_kwargs)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    # ---- generation -----------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, raw: bool = False, **options: Any) -> GenerationOutput:
        """Options are `GenerationConfig` fields: max_new_tokens, temperature, top_p, top_k, seed, ..."""
        return self.generate_batch([prompt], raw=raw, **options)[0]

    def generate_batch(self, prompts: list[Prompt], raw: bool = False, **options: Any) -> list[GenerationOutput]:
        config = self._config(options)
        return self.engine.generate([self.encode(p, raw) for p in prompts], config)

    def stream(self, prompt: Prompt, raw: bool = False, **options: Any) -> "TextStream":
        """Iterate over text pieces as they are decoded; `.result` holds the output afterwards."""
        config = self._config(options)
        return TextStream(self, self.engine.stream(self.encode(prompt, raw), config), config.stop_strings)

    def _config(self, options: dict[str, Any]) -> GenerationConfig:
        """The generation options, with the pipeline's block size unless they name one."""
        return make_config(**{"block_size": self.block_size if self.block_size == AUTO else None, **options})


class TextStream:
    """Text pieces of a generation; they add up to the final text (never containing a stop string)."""

    def __init__(self, pipe: DFlash, tokens, stop_strings: list[str]):
        self._tokens = tokens
        self._deltas = TextDeltas(pipe.tokenizer, stop_strings)
        self.result: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        for new in self._tokens:
            piece = self._deltas.add(new)
            if piece:
                yield piece
        self.result = self._tokens.result
        tail = self._deltas.finish(self.result.text or "")
        if tail:
            yield tail


def make_config(**options: Any) -> GenerationConfig:
    known = {f.name for f in fields(GenerationConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise GenerationError(f"unknown generation option(s) {unknown}; known: {sorted(known)}")
    return GenerationConfig(**options)


def _check_messages(messages: list) -> None:
    if not messages:
        raise GenerationError("messages is empty; send at least one {'role': 'user', 'content': ...}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise GenerationError(f"each message needs string 'role' and 'content', got {m!r}")


def _as_ids(encoded) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)


# variables a caller may not set: apply_chat_template's own arguments, which the engine decides
_RESERVED_TEMPLATE_VARIABLES = {"add_generation_prompt", "tokenize", "conversation", "messages", "return_dict",
                                "return_tensors", "continue_final_message", "chat_template", "tools", "documents"}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Chat template variables, checked: a mapping of names (e.g. enable_thinking) to values."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise GenerationError("chat_template_kwargs must be a JSON object of template variables, e.g. "
                              '{"enable_thinking": false}')
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise GenerationError(f"chat_template_kwargs may not set {', '.join(reserved)}: dflash sets "
                              f"{'it' if len(reserved) == 1 else 'them'} itself")
    return dict(kwargs)
