"""The one-call Python API: load a target + drafter pair, generate from text, chat messages or token ids.

    from dflash import DFlash
    pipe = DFlash.from_pretrained()                       # the embedded pair
    out = pipe.generate("What is 12 * 7?", max_new_tokens=64)
    print(out.text, out.stats.mean_acceptance_length)

Every mistake a caller can make (a bad path, option or prompt) raises a `dflash.UserError` whose message says
what was wrong and how to fix it: `CheckpointError` for models that cannot be found or loaded, `GenerationError`
for prompts and options.
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Union

import torch
from safetensors import SafetensorError

from dflash.chat import (
    THINKING_IGNORED,
    THINKING_WITHOUT_TEMPLATE,
    check_template_kwargs,
    check_text,
    check_tools_shown,
    describe_template_kwargs,
    encode_conversation,
    encode_plain,
    ignores_thinking,
    renders_alike,
)
from dflash.decoding.detokenizer import TextDeltas
from dflash.decoding.draft_model import DraftModelProposer
from dflash.decoding.engine import (
    AUTO,
    GenerationConfig,
    GenerationError,
    GenerationOutput,
    SpeculativeEngine,
)
from dflash.decoding.proposer import DFlashProposer, NoDraftProposer
from dflash.errors import DFlashWarning, UserError
from dflash.model.config import is_causal_lm
from dflash.model.cpu_layout import use_fast_layout
from dflash.model.cpu_precision import PRECISIONS, use_bfloat16_matmuls
from dflash.model.drafter import DFlashDraftModel
from dflash.model.loading import (
    CheckpointError,
    load_drafter,
    load_failure,
    parse_dtype,
    read_config,
    resolve_device,
    resolve_model_dir,
    trained_for,
    trained_template_kwargs,
    weight_shapes,
)
from dflash.model.target import TargetModel, check_drafter_fits, warn_unapplied_generation_options

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFT = ASSETS / "drafter"  # DFlash2: what dflash generate, bench and serve draft with
HANDOFF_DRAFT = ASSETS / "drafter-dflash"  # DFlash, the format vLLM and SGLang read: what --engine hands over

# text (the chat template is applied unless raw), chat messages, or token ids as they are
Prompt = Union[str, list[dict[str, str]], list[int]]

_PROMPT_KINDS = "text, a list of chat messages [{'role': 'user', 'content': ...}] or a list of token ids"


class DFlash:
    """A target, an optional drafter (a DFlash drafter, or a draft model to compare with), the target's tokenizer,
    and the engine that decodes with them."""

    def __init__(self, target: TargetModel, drafter: DFlashDraftModel | TargetModel | None = None,
                 block_size: int | str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 drafter_precision: str = "auto", branch_length: int = 0):
        """`target`: a `TargetModel`; `drafter`: a `DFlashDraftModel` trained for it, a small causal LM of its
        family as a `TargetModel` (classic speculative decoding, one draft forward per draft token), or None to
        decode plainly (use `from_pretrained` to load them from paths or hub ids).
        `block_size`: tokens verified per step (at most a DFlash drafter's; a draft model's default is 5), None
        for the drafter's own, or "auto" to choose it every step from timed step costs and the acceptance seen so
        far (for one greedy or seeded row, after drafting, from how sure the drafter is of each token).
        `chat_template_kwargs`: variables for the chat template on every chat prompt, e.g.
        `{"enable_thinking": False}` for Qwen3 (default: the template's own defaults).
        `drafter_precision`: a float32 DFlash drafter's matrix products: "auto" (bfloat16 on a CPU where a draft
        is measured faster so), "float32" or "bfloat16" (always, on any device). Only the draft tokens can change
        with it, never the text: the target verifies every one.
        `branch_length`: > 0 verifies, with each greedy or seeded step's block, a branch of that many tokens where
        the draft's first miss is likeliest (`decoding.branch`; a higher acceptance length for more tokens per
        forward)."""
        _check_models(target, drafter)
        if isinstance(drafter, DFlashDraftModel):  # before the precision check below runs a draft on the target's head
            check_drafter_fits(target, drafter.config)
        check_drafter_precision(drafter_precision)
        if isinstance(drafter, TargetModel) and drafter_precision == "bfloat16":
            raise UserError("drafter precision bfloat16 sets a DFlash drafter's matrix products, and this drafter is "
                            "a draft model (classic drafting), which runs in its dtype: load it in bfloat16 (dtype) "
                            "instead, or leave the precision out")
        self.target = target
        self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs)
        self.drafter = drafter
        self.tokenizer = target.tokenizer
        thinking = self.chat_template_kwargs.get("enable_thinking")
        if thinking and self.tokenizer is not None and not self.has_chat_template:
            raise UserError(THINKING_WITHOUT_TEMPLATE)  # every command that builds a pipeline, and the API
        if thinking and self.tokenizer is not None and ignores_thinking(self.tokenizer):
            warnings.warn(DFlashWarning(THINKING_IGNORED), stacklevel=2)
        if target.device.type == "cpu":
            drafters = [] if drafter is None else [drafter.model if isinstance(drafter, TargetModel) else drafter]
            use_fast_layout([target.model] + drafters)
        if isinstance(drafter, DFlashDraftModel):
            _set_drafter_precision(drafter, target, drafter_precision)
        self.block_size = make_config(block_size=block_size).block_size  # validated: a number, None or "auto"
        self.branch_length = make_config(branch_length=branch_length).branch_length
        fixed = None if self.block_size == AUTO else self.block_size
        self.engine = SpeculativeEngine(target, _proposer(target, drafter, fixed))

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = None,
        *,
        no_draft: bool = False,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        block_size: int | str | None = None,
        mask_token_id: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        drafter_precision: str = "auto",
        branch_length: int = 0,
        trust_remote_code: bool = False,
        warn_unapplied: bool = True,
        revision: str | None = None,
        draft_revision: str | None = None,
    ) -> "DFlash":
        """Load a target and its drafter from local directories or Hugging Face hub ids.

        Neither given: the embedded pair. `target` needs `draft` (the drafter trained for it), or `no_draft=True` to
        decode with the target alone (whatever `draft` says). `dtype`: "auto" (the checkpoint's own), "float32",
        "float16", "bfloat16" or "float64" (or a torch.dtype); `device`: "cpu", "cuda", "cuda:N", ... (default: cuda
        when a GPU is visible, else cpu). A hub id is looked up once with a timeout (HF_HUB_ETAG_TIMEOUT, 10 s a try);
        when the hub cannot be reached, or HF_HUB_OFFLINE=1, only the local cache serves. `drafter_precision`: see
        `DFlash`.
        `trust_remote_code`: run the Python code a target (or draft model) ships for an architecture transformers lacks;
        only for checkpoints whose source you trust. `warn_unapplied`: log the target's generation_config.json options
        DFlash does not apply (False: the caller says it, as `dflash serve` does). `revision`, `draft_revision`: the
        branch, tag or commit of a hub id to load (default: main), as `hf download --revision` takes them.
        """
        target, draft = _pair_paths(target, draft, no_draft)
        _check_revisions(target, draft, revision, draft_revision)
        if no_draft:
            _refuse_drafting_options({"block_size": isinstance(block_size, int), "mask_token_id": mask_token_id
                                      is not None, "branch_length": bool(branch_length),
                                      "drafter_precision": drafter_precision not in (None, "auto"),
                                      "draft_revision": draft_revision is not None},
                                     "no_draft (--no-draft) decodes with the target alone: drop one or the other",
                                     with_flags=True)
        # the cheap checks first: a typo should not wait for a model to load
        torch_device = resolve_device(device)
        parse_dtype(dtype)
        make_config(block_size=block_size, branch_length=branch_length)
        check_template_kwargs(chat_template_kwargs)
        check_drafter_precision(drafter_precision)
        target_dir = resolve_model_dir(target, revision)  # both found (a hub id looked up once) before a model loads
        if draft is not None:
            draft = resolve_model_dir(draft, draft_revision)
        target_model = load_target(target_dir, dtype, torch_device, trust_remote_code=trust_remote_code)
        if warn_unapplied:
            warn_unapplied_generation_options(target_model)
        drafter = None
        if draft is not None and is_draft_model(draft):
            if mask_token_id is not None:
                raise UserError(f"{draft} is a causal LM, which drafts without a mask token: leave mask_token_id "
                                "(--mask-token-id) out")
            drafter = load_target(draft, dtype=target_model.dtype, device=torch_device, what="the draft model",
                                  trust_remote_code=trust_remote_code)
        elif draft is not None:
            drafter = load_drafter(draft, mask_token_id=mask_token_id, dtype=target_model.dtype, device=torch_device)
            _warn_if_trained_for_another(draft, target)
            _warn_if_trained_in_another_mode(draft, target_model.tokenizer, chat_template_kwargs)
        return cls(target_model, drafter, block_size, chat_template_kwargs, drafter_precision, branch_length)

    # ---- prompts ------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether the target's tokenizer has a chat template (a base model's has none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt, raw: bool = False, chat_template_kwargs: dict[str, Any] | None = None, *,
               continue_final_message: bool = False, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids for a prompt: ids as given; chat messages and (unless raw) text via the chat template, with
        the pipeline's template variables updated by `chat_template_kwargs`. A tokenizer without a chat template
        (a base model) gets text as it is, and messages as `plain_conversation`. `continue_final_message`: the
        messages end with the start of the assistant's answer, which generation continues (no new turn is
        opened). `add_generation_prompt=False`: the messages are rendered without the template's opening of the
        assistant's turn (as vLLM's request field). `tools`: functions the template shows the model (OpenAI's form,
        `{"type": "function", "function": {"name", "description", "parameters"}}`), with messages only."""
        if isinstance(raw, (dict, GenerationConfig)):
            raise GenerationError(f"generation options are keywords: generate(prompt, max_new_tokens=64, ...), or "
                                  f"generate(prompt, **options) for a dict of them{_FROM_CONFIG}")
        if not isinstance(raw, bool):
            raise GenerationError(f"raw is True or False, got {raw!r}")
        kind = _prompt_kind(prompt)
        if tools and kind != "messages":
            raise GenerationError("tools are shown to the model by the chat template, which renders messages: pass the "
                                  "prompt as messages ([{\"role\": \"user\", \"content\": ...}])")
        if raw and kind == "messages":
            raise GenerationError("raw=True sends text without the chat template, and messages are always rendered "
                                  "with it: pass the text itself, or leave raw out")
        if kind == "token ids":
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise GenerationError("this target has no tokenizer; pass token ids instead of text")
        has_template = self.has_chat_template
        variables = {**self.chat_template_kwargs, **check_template_kwargs(chat_template_kwargs)}
        if not has_template and not raw and variables.get("enable_thinking"):  # the call's own (the pipeline's were
            raise GenerationError(THINKING_WITHOUT_TEMPLATE)                   # refused when it was built)
        if kind == "messages":
            check_tools_shown(self.tokenizer if has_template else None, tools)
            variables = {**variables, **({"tools": tools} if tools else {})}
            return encode_conversation(self.tokenizer, list(prompt), variables,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message)
        check_text(prompt)
        if has_template and not raw:
            return self.encode([{"role": "user", "content": prompt}], chat_template_kwargs=chat_template_kwargs,
                               add_generation_prompt=add_generation_prompt)
        return encode_plain(self.tokenizer, prompt)

    # ---- generation -----------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, raw: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                 **options: Any) -> GenerationOutput:
        """Decode one prompt (`raw` and `chat_template_kwargs` as `encode` takes them). Options are
        `GenerationConfig` fields: max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids (besides the
        target's EOS ids), ignore_eos, stop_strings, block_size, branch_length. Returns a `GenerationOutput`:
        `output_ids` (the new tokens), `text`, `finish_reason` ("stop" or "length") and `stats`. A prompt the
        target gives no token (NaN logits: a float16 overflow) raises a NoTokenError that says how to load it."""
        _prompt_kind(prompt)  # what is wrong with a prompt that is none of the kinds, said about one prompt
        outputs = self.generate_batch([prompt], raw=raw, chat_template_kwargs=chat_template_kwargs, **options)
        return outputs[0].raise_for_error()

    def generate_batch(self, prompts: list[Prompt], raw: bool = False,
                       chat_template_kwargs: dict[str, Any] | None = None, **options: Any) -> list[GenerationOutput]:
        """Decode several prompts together (a ragged batch): one `GenerationOutput` per prompt, in order, each
        the same as `generate` gives for that prompt alone. A prompt the target gives no token (NaN logits: a
        float16 overflow on its text) finishes with finish_reason "error", its `error` saying why, and the
        others decode on; `out.raise_for_error()` turns it into the NoTokenError `generate` raises."""
        _check_batch(prompts)
        _refuse_options_as_template_variables(chat_template_kwargs)
        config = self._config(options)
        ids = [self._encode_row(i, p, raw, len(prompts), chat_template_kwargs) for i, p in enumerate(prompts)]
        return self.engine.generate(ids, config) if ids else []  # the engine names a row it refuses likewise

    def _encode_row(self, index: int, prompt: Prompt, raw: bool, rows: int,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The ids of prompt `index` of a batch of `rows`; a problem names the prompt when there are several."""
        try:
            return self.encode(prompt, raw, chat_template_kwargs)
        except GenerationError as err:
            if rows == 1:
                raise
            raise GenerationError(f"prompt {index}: {err}") from None

    def stream(self, prompt: Prompt, raw: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
               **options: Any) -> "TextStream":
        """Decode one prompt, yielding text pieces as they are decoded (iterate once); `.result` holds the
        `GenerationOutput` once the iteration ends."""
        _refuse_options_as_template_variables(chat_template_kwargs)
        config = self._config(options)
        ids = self.encode(prompt, raw, chat_template_kwargs)
        if self.tokenizer is None:
            raise GenerationError("stream() yields text, and this target has no tokenizer to decode it: give it one "
                                  "(TargetModel(model, tokenizer)), or read token ids as they come from "
                                  "pipe.engine.stream(ids, config)")
        return TextStream(self, self.engine.stream(ids, config), config.stop_strings, config.min_new_tokens)

    def _config(self, options: dict[str, Any]) -> GenerationConfig:
        """The generation options, with the pipeline's block size and branch length unless they name them. An
        option given as None names none, as in an OpenAI request ("stop": null): its default (for block_size, the
        pipeline's), as when it is left out."""
        options = {k: v for k, v in options.items() if v is not None}
        if self.drafter is None:  # as from_pretrained(no_draft=True, ...) refuses them ("auto" chooses nothing there)
            _refuse_drafting_options({"block_size": options.get("block_size") not in (None, AUTO),
                                      "branch_length": bool(options.get("branch_length"))},
                                     "this pipeline decodes with the target alone (no drafter): leave drafting "
                                     "options out of the call",
                                     GenerationError)
        return make_config(**{"block_size": self.block_size if self.block_size == AUTO else None,
                              "branch_length": self.branch_length, **options})


class TextStream:
    """Text pieces of a generation; they add up to the final text (never containing a stop string)."""

    def __init__(self, pipe: DFlash, tokens, stop_strings: list[str], min_new_tokens: int = 0):
        self._tokens = tokens
        self._deltas = TextDeltas(pipe.tokenizer, stop_strings, tokens.stop_token_ids, min_new_tokens)
        self._started = False
        self._result: GenerationOutput | None = None  # set when the iteration ends
        self._pieces: Iterator[str] | None = None  # the iteration `next(stream)` reads

    @property
    def result(self) -> GenerationOutput:
        """The `GenerationOutput`, once the stream has been iterated to its end."""
        if self._result is None and self._started:
            raise GenerationError("this stream has no result: it has not been read to its end (it is being read, "
                                  "was left at a break, or stopped with an error); a stream read to its end has one, "
                                  "and generate(...) gives the result alone")
        if self._result is None:
            raise GenerationError("a stream's result is there once it has been read to the end: iterate it first "
                                  "(for piece in stream: ...), or call generate(...) for the result alone")
        return self._result

    def __next__(self) -> str:
        """The next text piece, as iterating gives them (a stream is also read with next())."""
        if self._pieces is None:
            self._pieces = iter(self)
        return next(self._pieces)

    def __iter__(self) -> Iterator[str]:
        if self._started:
            done = "read its .result, or " if self._result is not None else "this one was read before; "
            raise GenerationError(f"a stream is iterated once; {done}call stream(...) again for a new generation")
        self._started = True
        for new in self._tokens:
            piece = self._deltas.add(new)
            if piece:
                yield piece
        self._result = self._tokens.result
        tail = self._deltas.finish(self._result.text or "")
        if tail:
            yield tail


def make_config(**options: Any) -> GenerationConfig:
    """A `GenerationConfig` from keyword options; an unknown option or a bad value is a GenerationError. Sampling
    options with temperature 0 decode greedily, as in vLLM (a program may forward an OpenAI request's seed and
    top_p with it); the commands refuse them from a user's flags (`refuse_greedy_ignores`)."""
    known = _OPTION_NAMES
    unknown = sorted(set(options) - known)
    if any(isinstance(options[name], GenerationConfig) for name in unknown):
        raise GenerationError(f"generation options are keywords, not a GenerationConfig{_FROM_CONFIG}")
    if unknown:
        meant = [_OTHER_NAMES.get(name) or next(iter(difflib.get_close_matches(name, known, 1)), None)
                 for name in unknown]
        hint = ", ".join(f"{name} -> {m}" for name, m in zip(unknown, meant) if m)
        raise GenerationError(f"unknown generation option(s) {unknown}{f' (did you mean: {hint}?)' if hint else ''}; "
                              f"known: {sorted(known)}")
    return GenerationConfig(**options)


_OPTION_NAMES = frozenset(f.name for f in fields(GenerationConfig))
_FROM_CONFIG = " (a GenerationConfig's: generate(prompt, **dataclasses.asdict(config)))"
# Other libraries' names for GenerationConfig's options (vLLM's and OpenAI's; transformers' are its own)
_OTHER_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                "min_tokens": "min_new_tokens", "stop": "stop_strings"}


def _refuse_options_as_template_variables(chat_template_kwargs: Any) -> None:
    """generate(prompt, False, {"max_new_tokens": 64}): an options dict in the template variables' place."""
    named = sorted(set(chat_template_kwargs) & _OPTION_NAMES) if isinstance(chat_template_kwargs, dict) else []
    if named:
        raise GenerationError(f"chat_template_kwargs {named} are generation options: pass them as keywords, "
                              "generate(prompt, max_new_tokens=64, ...), or generate(prompt, **options) for a dict "
                              "of them")


def refuse_greedy_ignores(options: dict[str, Any]) -> None:
    """Refuse sampling options (top_p, top_k, min_p, seed) given away from their neutral values with temperature 0,
    where decoding is greedy and they would change nothing: on a command line that is a forgotten --temperature (the
    commands name the options as their flags: cli.main's respelling)."""
    if options.get("temperature") not in (None, 0):
        return
    neutral = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "seed": (None,)}
    ignored = [name for name, values in neutral.items() if options.get(name) not in values]
    if ignored:
        one = len(ignored) == 1
        raise GenerationError(f"{', '.join(ignored)} {'shapes' if one else 'shape'} sampling, and temperature 0 (the "
                              "default) decodes greedily: pass a temperature above 0, e.g. temperature=0.7, or leave "
                              f"{'it' if one else 'them'} out")


def _refuse_drafting_options(given: dict[str, bool], why: str, error: type[UserError] = UserError,
                             with_flags: bool = False) -> None:
    """Refuse the options among `given` (name -> given) that only shape drafting, where there is none: `why`.
    `with_flags`: name each option's command-line flag too (the options of a pipeline, which the CLI sets)."""
    named = [f"{name} (--{name.replace('_', '-')})" if with_flags else name
             for name, was_given in given.items() if was_given]
    if named:
        raise error(f"{', '.join(named)} {'shapes' if len(named) == 1 else 'shape'} drafting, and {why}")


def _warn_if_trained_for_another(draft: Path, target: str | os.PathLike) -> None:
    """A drafter of the right shape but trained for another local target decodes losslessly and slowly: say so."""
    recorded, given = trained_for(draft), Path(target).expanduser()
    if recorded is not None and given.is_dir() and recorded.resolve() != given.resolve():
        warnings.warn(DFlashWarning(
            f"the drafter in {draft} was trained for the target in {recorded} (its training_config.yaml says so), "
            f"not {target}: the output stays the target's own, but a drafter drafts well only for the target whose "
            "answers trained it"), stacklevel=3)


def _warn_if_trained_in_another_mode(draft: Path, tokenizer, chat_template_kwargs: dict | None) -> None:
    """A drafter trained on prompts rendered in one chat template mode (Qwen3's enable_thinking) drafts worse for
    prompts rendered in another, losslessly: say so, and how to match it."""
    trained, given = trained_template_kwargs(draft), chat_template_kwargs or {}
    if trained is None or renders_alike(tokenizer, trained, given):
        return
    thinking = trained.get("enable_thinking")
    others = {k: v for k, v in trained.items() if k != "enable_thinking"}
    flags = ([] if thinking is None else ["--enable-thinking" if thinking else "--no-enable-thinking"]) + (
        [f"--chat-template-kwargs '{json.dumps(others)}'"] if others else [])
    fix = f"pass {' '.join(flags)}" if flags else "leave --enable-thinking and --chat-template-kwargs out"
    warnings.warn(DFlashWarning(
        f"the drafter in {draft} was trained on prompts rendered with {describe_template_kwargs(trained)} (its "
        f"training_config.yaml says so), and prompts here render with {describe_template_kwargs(given)}: the output "
        f"stays the target's own, but fewer draft tokens are accepted; {fix} (Python: chat_template_kwargs="
        f"{trained or None}) to serve it as it was trained"), stacklevel=3)


def load_target(path_or_id: str | os.PathLike, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu", what: str = "the target",
                trust_remote_code: bool = False) -> TargetModel:
    """A causal LM and its tokenizer (the target, or a draft model) from a directory or hub id; a checkpoint that
    is not one, or whose files cannot be read, is a CheckpointError naming the directory."""
    directory = resolve_model_dir(path_or_id)
    try:
        return TargetModel.from_pretrained(directory, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # transformers' and torch's load failures
        raise load_failure(what, directory, err) from None


# What only a DFlash drafter's config.json holds (the published forms, legacy ones included)
_DRAFTER_FIELDS = ("dflash_config", "target_layer_ids", "num_target_layers", "mask_token_id", "block_size")


def is_draft_model(path_or_id: str | os.PathLike) -> bool:
    """Whether the checkpoint directory `path_or_id` is a plain causal LM (a draft model for classic speculative
    decoding) rather than a DFlash drafter, by its config.json: a causal LM architecture and no `dflash_config`; or,
    naming no architecture, none of a drafter's fields and a causal LM's own weights (an embedding table)."""
    directory = Path(path_or_id)
    raw = read_config(directory, "a DFlash drafter or a causal LM checkpoint")
    if raw.get("architectures"):
        return "dflash_config" not in raw and is_causal_lm(raw["architectures"])
    return not any(field in raw for field in _DRAFTER_FIELDS) and _has_embedding_table(directory)


def _has_embedding_table(directory: Path) -> bool:
    """Whether the safetensors headers in `directory` name an embedding table (a drafter has none: it borrows the
    target's)."""
    try:
        names = weight_shapes(sorted(directory.glob("*.safetensors")))
    except CheckpointError:  # damaged weights: the loader that reads them names the damage
        return False
    return any(name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")) for name in names)


def check_drafter_precision(precision: Any) -> str:
    if precision not in PRECISIONS:
        raise UserError(f"drafter precision {precision!r} is not one of {', '.join(PRECISIONS)} (auto: bfloat16 "
                        "matrix products where they draft faster on this CPU)")
    return precision


def _set_drafter_precision(drafter: DFlashDraftModel, target: TargetModel, precision: str) -> None:
    """The drafter's matrix products in bfloat16 as `precision` asks: "auto" where this CPU does them faster
    (`cpu_precision`), "bfloat16" always; a drafter loaded in a half dtype has them so already."""
    if drafter.draft_head is not None:  # an earlier pipeline (auto, or bfloat16) moved its products already
        if precision == "float32":
            raise UserError("this drafter already multiplies in bfloat16 (an earlier DFlash with drafter precision "
                            "auto or bfloat16 moved its products there): load it again for float32 products")
        return
    if precision == "float32" or drafter.dtype != torch.float32:
        return
    head = target.model.get_output_embeddings()
    plain_head = isinstance(head, torch.nn.Linear) and head.bias is None
    if precision == "auto":
        if plain_head and target.device.type == "cpu":
            use_bfloat16_matmuls(drafter, head.weight)
    elif not (plain_head and use_bfloat16_matmuls(drafter, head.weight, force=True)):
        raise UserError(f"this drafter cannot draft with bfloat16 products ({_why_no_bfloat16(head, drafter)}): use "
                        "drafter precision auto or float32, or load the pair with dtype bfloat16")


def _why_no_bfloat16(head: torch.nn.Module, drafter: DFlashDraftModel) -> str:
    """Why a float32 drafter's products cannot be moved to bfloat16 beside this LM head of its target."""
    if not (isinstance(head, torch.nn.Linear) and head.bias is None):
        return f"its target's LM head is a {type(head).__name__}, not a linear layer without a bias"
    if head.weight.dtype != torch.float32:
        return (f"its target is in {str(head.weight.dtype).removeprefix('torch.')} and the drafter in float32; "
                "load the drafter in the target's dtype")
    return (f"the target's LM head is on {head.weight.device} and the drafter on "
            f"{next(drafter.parameters()).device}")


def _proposer(target: TargetModel, drafter: DFlashDraftModel | TargetModel | None, block_size: int | None):
    if drafter is None:
        return NoDraftProposer()
    if isinstance(drafter, TargetModel):
        return DraftModelProposer(drafter, target, block_size)
    return DFlashProposer(drafter, target, block_size)


def _check_revisions(target, draft, revision: str | None, draft_revision: str | None) -> None:
    """A revision names a version of a hub id: refused for a local directory (or the embedded pair), which has one."""
    for name, path, rev, flag in (("revision", target, revision, "--revision"),
                                  ("draft_revision", draft, draft_revision, "--draft-revision")):
        if rev is None or path is None:  # no drafter: no_draft refuses draft_revision as a drafting option
            continue
        if not isinstance(rev, str) or not rev.strip():
            raise UserError(f"{name} ({flag}) is a branch, tag or commit of a hub repository, got {rev!r}")
        if Path(path).expanduser().exists():  # a path that is neither is told so when it is looked up
            raise UserError(f"{name} ({flag}) picks a version of a Hugging Face hub id, and {path} is a local "
                            "directory: leave it out")


def _pair_paths(target, draft, no_draft: bool) -> tuple[str | os.PathLike, str | os.PathLike | None]:
    """The target and drafter to load (the drafter None to decode plainly: `no_draft` overrides `draft`), or a
    UserError for a pair that cannot be meant."""
    if not isinstance(no_draft, bool):
        raise UserError(f"no_draft is True or False, got {no_draft!r}")
    if no_draft:
        draft = None
    for name, path in (("target", target), ("draft", draft)):
        if isinstance(path, str) and not path.strip():
            raise UserError(f"{name} is an empty path; give a checkpoint directory or a hub id like org/name (or leave "
                            "both out for the embedded pair)")
    if target is None:
        if draft is not None:
            raise UserError("a draft model needs its target: pass target= too (a drafter only fits the target it "
                            "was trained for)")
        target, draft = DEFAULT_TARGET, (None if no_draft else DEFAULT_DRAFT)
        missing = [p for p in (target, draft) if p is not None and not (Path(p) / "config.json").exists()]
        if missing:
            raise UserError(f"the embedded model pair is missing ({', '.join(map(str, missing))}); reinstall "
                            "dflash from a full checkout, or pass --target/--draft")
    elif draft is None and not no_draft:
        raise UserError("a target needs draft= (the DFlash drafter trained for it), or no_draft=True to decode with "
                        "the target alone")
    return target, draft


def _check_models(target: Any, drafter: Any) -> None:
    if not isinstance(target, TargetModel):
        loaded = (" (for a model loaded already: DFlash(TargetModel(model, tokenizer), load_drafter(path)))"
                  if isinstance(target, torch.nn.Module) else "")
        raise UserError(f"DFlash(target, drafter) takes a dflash.TargetModel, not {type(target).__name__}; to load "
                        f"from directories or hub ids use DFlash.from_pretrained(target, draft){loaded}")
    if drafter is not None and not isinstance(drafter, (DFlashDraftModel, TargetModel)):
        raise UserError(f"the drafter is a dflash.DFlashDraftModel (dflash.load_drafter(path)), a draft model as a "
                        f"dflash.TargetModel, or None, not {type(drafter).__name__}")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _prompt_kind(prompt: Any) -> str:
    """"text", "messages" or "token ids"; anything else (an empty list, a list of strings, a tensor) is a
    GenerationError saying what a prompt is."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise GenerationError(f"the prompt is empty; a prompt is {_PROMPT_KINDS} (at least one)")
        if _is_token_id(prompt[0]):
            bad = next((t for t in prompt if not _is_token_id(t)), None)
            if bad is not None:
                raise GenerationError(f"token ids are integers, but this prompt of token ids also holds {bad!r}")
            return "token ids"
        if isinstance(prompt[0], dict):
            return "messages"
        if isinstance(prompt[0], str):
            raise GenerationError("a list of strings is several prompts: pass them to generate_batch, or one "
                                  "string to generate")
        raise GenerationError(f"a prompt's list holds token ids (integers) or chat messages (dicts), not "
                              f"{type(prompt[0]).__name__} like {prompt[0]!r}")
    if isinstance(prompt, dict):
        raise GenerationError("a chat prompt is a list of messages: wrap the message in a list, [{'role': ..., "
                              "'content': ...}]")
    if hasattr(prompt, "tolist"):
        raise GenerationError(f"token ids are a list of integers; convert the {type(prompt).__name__} with "
                              ".tolist() (one prompt's ids, not a batch)")
    raise GenerationError(f"a prompt is {_PROMPT_KINDS}, not {type(prompt).__name__}")


def _check_batch(prompts: Any) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise GenerationError(f"generate_batch takes a list of prompts, not {type(prompts).__name__}; for one "
                              "prompt call generate")
    if prompts and all(_is_token_id(p) for p in prompts):
        raise GenerationError("generate_batch takes a list of prompts, and this is one prompt's token ids: call "
                              "generate(ids), or generate_batch([ids])")


