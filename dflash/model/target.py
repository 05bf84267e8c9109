"""Adapter around any Hugging Face causal LM used as the DFlash target.

It runs target forwards with a KV cache and captures the outputs of decoder layers `target_layer_ids`
with forward hooks, so only those layers' hidden states exist, never all of them.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash.errors import UserError, in_brief
from dflash.model import hf_compat
from dflash.model.config import DrafterConfig
from dflash.model.loading import (
    CheckpointError,
    causal_lm_shape_mismatches,
    check_target_dir,
    parse_dtype,
    resolve_device,
    resolve_model_dir,
    tokenizer_failure,
)

log = logging.getLogger(__name__)


class IncompatibleDrafterError(UserError):
    """The drafter was not built for this target; the message names every mismatch."""


class UnsupportedTargetError(UserError):
    """The target's architecture cannot be decoded speculatively without changing its output."""


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (b, q, vocab) float32
    features: torch.Tensor | None  # (b, q, len(target_layer_ids) * hidden) or None without feature layers


# generation_config.json options that change which tokens transformers' generate picks, and their neutral values
_LOGIT_OPTIONS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                  "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                  "forced_bos_token_id": None, "forced_eos_token_id": None, "min_new_tokens": None, "min_length": 0,
                  "num_beams": 1, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def _warn_if_unreadable_generation_config(directory: Path) -> None:
    """transformers falls back to a generation config built from config.json, without a word, when the model's own
    generation_config.json does not parse: its stop tokens and sampling defaults would be lost unseen."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("%s is unreadable (%s): its stop tokens and sampling defaults are not read (the stop tokens "
                    "come from config.json); fix the file", path, in_brief(err))


def unapplied_generation_options(generation_config, sampling_defaults: bool = True) -> list[str]:
    """'name=value' for each option of a model's generation config that changes its tokens and that DFlash does
    not apply: its logit options, and (`sampling_defaults`) its sampling defaults, which each command brings its own
    of (`dflash serve` applies them: see `dflash.serve.sampling_defaults`)."""
    if generation_config is None:
        return []
    found = [f"{name}={getattr(generation_config, name)!r}" for name, neutral in _LOGIT_OPTIONS.items()
             if getattr(generation_config, name, neutral) not in (neutral, None, [], {}, 0)]
    if sampling_defaults and getattr(generation_config, "do_sample", False):
        found.append("do_sample=True" + "".join(
            f", {name}={getattr(generation_config, name)!r}" for name in ("temperature", "top_p", "top_k", "min_p")
            if getattr(generation_config, name, None) is not None))
    return found


def warn_unapplied_generation_options(target: "TargetModel") -> None:
    """Name, once a target is loaded to decode, the generation_config.json options DFlash leaves out."""
    unapplied = unapplied_generation_options(getattr(target.model, "generation_config", None))
    if unapplied:
        log.warning("%s: its generation_config.json sets %s, which DFlash does not apply (transformers' generate "
                    "would): every command decodes with the options it gives (greedy unless a temperature is given "
                    "to dflash generate, bench or datagen, and without a repetition penalty unless dflash generate's "
                    "--repetition-penalty gives one; dflash serve applies its sampling defaults and "
                    "repetition_penalty, see --generation-config)", type(target.model).__name__, ", ".join(unapplied))


NEEDS_ITS_OWN_CODE = ("{path} needs the Python code it ships (its config.json's auto_map names classes transformers "
                      "lacks), which runs only when asked: add --trust-remote-code (Python: trust_remote_code=True) "
                      "if you trust its source")


class TargetModel:
    def __init__(self, model: nn.Module, tokenizer=None):
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise UserError(f"TargetModel wraps a loaded transformers causal LM, not a {type(model).__name__}: "
                            "TargetModel(AutoModelForCausalLM.from_pretrained(...), tokenizer), or "
                            "TargetModel.from_pretrained(path_or_id) to load one")
        self.model = model.eval()
        hf_compat.use_gqa_attention(model)
        self.tokenizer = tokenizer
        self.config = hf_compat.text_config(model.config)
        self.layers = hf_compat.decoder_layers(model)
        # None: every layer's cache can be cropped
        # why DFlash cannot decode it losslessly, or None: from its config, then (`check_decodable`) probe forwards
        self.decode_problem = hf_compat.rollback_problem(model.config) or hf_compat.cache_problem(model)
        self._probed = False  # `check_decodable` runs the probe forwards once
        # longrope: each row of a forward rotated with its own factors (`forward`'s long_rope_rows), the engine
        # keeping a row's blocks below the switch and reading it again when it reaches it, as transformers' generate
        # does (`rope_rows_switch`); where the rotary module is not found, DFlash decodes within the switch instead
        self.rope_switch = hf_compat.rope_switch_length(model.config)
        self._capped_at, self._cap_reason = None, ""
        if self.rope_switch is not None and not hf_compat.rotate_rows(model, self.rope_switch, self._long_rope_rows):
            self._capped_at = self.rope_switch
            self._cap_reason = (f"its longrope rotary switches to its long factors at {self.rope_switch} tokens, and "
                                "a block verified across that point would change the output")
        window = getattr(self.config, "keep_window_size", None)  # Doge: each forward keeps its top-k keys
        bound = self._capped_at or getattr(self.config, "max_position_embeddings", None)
        if isinstance(window, int) and (bound is None or window < bound):
            self._capped_at = window
            self._cap_reason = (f"its attention keeps the {window} keys it ranks highest in each forward, and past "
                                "that many tokens a verified block would rank them otherwise than one token at a time")
        if self._capped_at is not None:
            log.warning("%s: DFlash decodes within its first %d tokens%s", type(model).__name__, self._capped_at,
                        self.context_note)
        self._sliding = self.decode_problem is None and hf_compat.has_sliding_layers(model.config)
        self.positions_by_slot = hf_compat.positions_by_slot(model.config)  # its batches keep no holes between tokens
        self._cache_kwarg = hf_compat.cache_kwarg_name(model)
        forward = inspect.signature(hf_compat.unwrapped(model).forward).parameters  # through a wrapper's **kwargs
        self._takes_logits_to_keep = "logits_to_keep" in forward
        self._hooks: dict[int, object] = {}
        self._hooks_lock = threading.Lock()
        # what a forward wants captured and what it captured, per thread: the hooks run on the thread of the forward,
        # so pipelines sharing this target can decode on several threads at once
        self._capture = threading.local()

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        revision: str | None = None,
        trust_remote_code: bool = False,
    ) -> "TargetModel":
        """`trust_remote_code`: run the Python code a checkpoint ships for an architecture transformers lacks
        (its config.json's `auto_map`); off by default, as in transformers and vLLM."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory = resolve_model_dir(path_or_id, revision)
        check_target_dir(directory)
        _warn_if_unreadable_generation_config(directory)
        device = resolve_device(device)
        torch_dtype = parse_dtype(dtype) or "auto"
        code = {"trust_remote_code": trust_remote_code}  # False, not None: transformers would ask on a terminal
        try:
            model, loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, output_loading_info=True,
                                                                 **code)
            model = model.to(device)
        except ValueError as err:  # transformers' word for a config it cannot build a causal LM from
            if "trust_remote_code" in str(err):
                raise CheckpointError(NEEDS_ITS_OWN_CODE.format(path=path_or_id)) from None
            raise CheckpointError(f"could not load {path_or_id} as a causal LM: {str(err).splitlines()[0]}") from None
        except RuntimeError as err:
            if "mismatched" not in str(err) and "size mismatch" not in str(err):
                raise
            raise _mismatch_error(directory) from None
        except hf_compat.CONFIG_ERRORS as err:  # a field of the wrong type, an unknown rope type, ...
            raise CheckpointError(f"could not load {path_or_id} as a causal LM: transformers cannot build it from its "
                                  f"config.json ({hf_compat.config_error_text(err)}); fix the field this names, "
                                  "or restore the config.json that came with the weights") from None
        missing = sorted(loaded.get("missing_keys") or [])
        if missing:  # transformers starts them at random: a model, but not the one trained
            shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
            raise CheckpointError(f"the weights in {directory} lack {len(missing)} tensor(s) its config.json "
                                  f"describes: {shown}; transformers would start them at random. Restore the "
                                  "missing files (a shard, say) or the config.json that came with these weights")
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, **code)
        except Exception as err:
            if "trust_remote_code" in str(err):
                raise CheckpointError(NEEDS_ITS_OWN_CODE.format(path=path_or_id)) from None
            raise tokenizer_failure(directory, err) from None
        return cls(model, tokenizer)

    # ---- facts about the target -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int | None:
        """The tokens DFlash decodes within: the target's context (`max_position_embeddings`; None when its config
        states none), or less (`context_note` says why): for a `longrope` target whose rotary module was not found
        (`hf_compat.rotate_rows`), the position where its rotary frequencies switch, past which a verified block
        would rotate tokens otherwise than decoding one at a time does; for Doge, its `keep_window_size`."""
        limit = getattr(self.config, "max_position_embeddings", None)
        return self._capped_at if self._capped_at is not None else limit

    @property
    def rope_rows_switch(self) -> int | None:
        """A longrope target whose forwards take each row's factors (`hf_compat.rotate_rows`): where they switch.
        A row is rotated with the long factors once it has reached past that position, and read again then."""
        return self.rope_switch if self.rope_switch is not None and self._capped_at is None else None

    @property
    def context_note(self) -> str:
        """Why `context_length` is shorter than the target's context, in words ("" when it is not)."""
        if self._capped_at is None:
            return ""
        return f" ({self._cap_reason}, so DFlash decodes within it)"

    @property
    def context_words(self) -> str:
        """`context_length` for a message: "4096 tokens", with `context_note` after it."""
        return f"{self.context_length} tokens{self.context_note}"

    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    @property
    def takes_branches(self) -> bool:
        """Whether a decode step may verify a branch with its block (a tree-shaped mask; `decoding.branch`)."""
        return self.decode_problem is None and hf_compat.takes_tree_masks(self.model)

    def check_decodable(self) -> None:
        """Refuse, before any decoding, a target whose cache cannot be put back to the accepted tokens, or whose
        logits depend on what DFlash changes about a forward: the tokens after one (a verified block's), or the
        padding and slots around it (a batch's rows, a branch)."""
        if self.decode_problem is None and not self._probed:
            self.decode_problem = self._cache_probe_problem() or self._order_probe_problem()
            self._probed = True
        if self.decode_problem is not None:
            name = type(self.model).__name__
            raise UnsupportedTargetError(
                f"{name} cannot be decoded by DFlash without changing its output: {self.decode_problem}. DFlash "
                f"decodes causal targets whose every layer is full or sliding-window attention; decode {name} "
                "without DFlash (e.g. transformers' generate), or pick such a target."
            )

    @torch.inference_mode()
    def _cache_probe_problem(self) -> str | None:
        """One token through the model with the cache DFlash gives it: the cache must then hold that token's keys
        and values (a model that keeps its own state instead fails here, or leaves the cache empty)."""
        ids = self._probe_ids(1)
        cache = self.new_cache()
        try:
            self.forward(ids, torch.zeros_like(ids), cache, logits_to_keep=1)
        except Exception as err:  # noqa: BLE001 - any failure here means the same: it cannot decode this way
            return (f"its forward fails with the key/value cache DFlash gives it ({type(err).__name__}: "
                    f"{str(err).splitlines()[0][:200]}): it keeps a state of its own or needs inputs of its own")
        held = hf_compat.cache_length(cache)
        if held == 0:
            return ("its forward keeps nothing in the key/value cache it is given: it keeps a state of its own (which "
                    "takes in every draft token), or no cache at all")
        if held != 1:
            return f"its key/value cache holds {held} entries after one token, so it cannot be cut back to a token"
        return None

    @torch.inference_mode()
    def _order_probe_problem(self) -> str | None:
        """Forwards of one shape, without a cache, whose logits for the same tokens must agree: two sequences that
        share their first token (causal attention), and three tokens after and before four slots of padding the
        attention mask hides (positions as given, not by slot)."""
        ids = self._probe_ids(3)  # (1, 3): tokens 1, 2, 3 (the padding id passed over)
        positions = torch.arange(3, device=self.device)[None]
        first = self.forward(ids, positions, self.new_cache()).logits[0, 0]
        later_others = torch.cat([ids[:, :1], self._probe_ids(2, first=5)], dim=1)  # tokens 1, 5, 6
        other = self.forward(later_others, positions, self.new_cache()).logits[0, 0]
        if _differ(first, other, self.dtype):
            return "its attention is not causal: a token's logits change with the tokens after it"
        pad = torch.zeros(1, 4, dtype=torch.long, device=self.device)
        real = torch.ones_like(ids)
        after = self.forward(torch.cat([pad, ids], 1), torch.cat([pad, positions], 1), self.new_cache(),
                             attention_mask=torch.cat([pad, real], 1)).logits[0, 4:]
        before = self.forward(torch.cat([ids, pad], 1), torch.cat([positions, pad], 1), self.new_cache(),
                              attention_mask=torch.cat([real, pad], 1)).logits[0, :3]
        if _differ(after, before, self.dtype):
            return ("it numbers positions by slot instead of taking the positions it is given, so a batch's padding "
                    "or a verified branch would change its text")
        return None

    def _probe_ids(self, n: int, first: int = 1) -> torch.Tensor:
        """(1, n) ordinary token ids for a probe forward: first, first + 1, ..., within the vocabulary, passing over
        the padding id (a forward without an attention mask that meets it warns of padding, as GPT-2's does)."""
        pad = getattr(self.model.config, "pad_token_id", None)
        ids, t = [], first
        while len(ids) < n:
            if t % self.vocab_size != pad or self.vocab_size == 1:
                ids.append(t % self.vocab_size)
            t += 1
        return torch.tensor(ids, device=self.device)[None]

    # ---- feature capture ----------------------------------------------------------------------------
    def _ensure_hooks(self, layer_ids: list[int]) -> None:
        """Hooks are added once per layer and capture only while that layer's output is wanted."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise IncompatibleDrafterError(
                f"feature layer ids {bad} are outside the target's {self.num_layers} layers: the drafter was trained "
                "for another target; use the drafter trained for this one, or train one for it (dflash train --target)")
        with self._hooks_lock:
            for i in layer_ids:
                if i not in self._hooks:
                    self._hooks[i] = self.layers[i].register_forward_hook(self._capture_hook(i))

    def _capture_hook(self, layer_id: int):
        def hook(module, inputs, output):
            if layer_id in getattr(self._capture, "wanted", ()):
                self._capture.captured[layer_id] = hf_compat.layer_output_tensor(output)

        return hook

    def _start_capture(self, layer_ids) -> None:
        self._capture.wanted, self._capture.captured = set(layer_ids), {}

    def _end_capture(self, layer_ids) -> list[torch.Tensor]:
        """The outputs of `layer_ids` captured on this thread since `_start_capture`, in that order."""
        captured = self._capture.captured
        self._capture.wanted, self._capture.captured = set(), {}
        return [captured[i] for i in layer_ids]

    # ---- forwards -------------------------------------------------------------------------------------
    def new_cache(self):
        return hf_compat.new_dynamic_cache(self.model.config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's token embeddings: rows of the target's embedding table, without the sqrt(hidden) scale some
        families apply to their own inputs. Where that scale lives moved between transformers versions (Gemma and
        Gemma 2: the model's forward in 4.x, the embedding module in 5.x), and vLLM's DFlash drafter looks its
        tokens up in the target's table and leaves it out, so a drafter embeds alike in training, in any
        transformers version and in vLLM."""
        module = self.model.get_input_embeddings()
        if isinstance(module, nn.Embedding):  # a transformers *ScaledWordEmbedding subclasses it
            return nn.Embedding.forward(module, input_ids)
        return module(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output embedding alone: what a drafter's hidden states go through (its argmax is the logits')."""
        return self.model.get_output_embeddings()(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its final (normed) hidden states: the LM head, then what its family does
        to it (Gemma's final soft-capping, Cohere's logit_scale, Granite's logits_scaling). `distillation_problem`
        checks the result against the model's forward."""
        logits = self.lm_head(hidden)
        scale = _logit_scale(self.config)
        if scale is not None:
            logits = logits * scale
        cap = _number(getattr(self.config, "final_logit_softcapping", None))
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def distillation_problem(self) -> str | None:
        """Whether `logits` of the final hidden states (what training's soft labels are made of) misses the
        model's own logits, as a family with a transform of its own would; None when they agree."""
        ids = self._probe_ids(4)
        try:
            hidden = self.context_features(ids, torch.ones_like(ids, dtype=torch.bool), [], with_final_hidden=True)
            ours = self.logits(hidden.to(self.dtype))[0].float()  # (4, vocab)
            theirs = self.model(input_ids=ids, use_cache=False).logits[0].float()
        except Exception as err:  # noqa: BLE001 - a config DFlash misreads fails in any of Python's ways
            return f"its logits could not be made from its final hidden states ({in_brief(err)})"
        if _differ(theirs, ours, self.dtype):
            return (f"{type(self.model).__name__}'s forward gives other logits than its LM head of its final hidden "
                    "states with the transforms DFlash knows of its family")
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (b, q)
        position_ids: torch.Tensor,  # (b, q) real sequence positions
        cache,
        attention_mask: torch.Tensor | None = None,  # (b, cache slots + q), 1 = real token, 0 = hole
        logits_to_keep: int = 0,  # 0 = logits for every position
        feature_layer_ids: list[int] | tuple = (),  # outputs of these layers, concatenated in this order
        visibility: torch.Tensor | None = None,  # (b, q, q) bool: which new tokens each sees; None = causal
        long_rope_rows: list[bool] | None = None,  # a longrope target: the rows rotated with its long factors
    ) -> TargetOutput:
        self._ensure_hooks(list(feature_layer_ids))
        self._start_capture(feature_layer_ids)
        self._capture.long_rope_rows = None
        if self.rope_rows_switch is not None and long_rope_rows is not None:
            self._capture.long_rope_rows = torch.tensor(long_rope_rows, device=input_ids.device)  # (b,)
        b, q = input_ids.shape
        if attention_mask is None and (visibility is not None or hf_compat.padding_mask_needed(b)):
            attention_mask = torch.ones(b, hf_compat.cache_length(cache) + q, dtype=torch.long,
                                        device=input_ids.device)  # no holes
        if visibility is not None:  # a block and its branch: a tree inside the new tokens
            attention_mask = hf_compat.tree_attention_mask(self.model, attention_mask, visibility)
        elif attention_mask is not None and self._sliding:  # holes: sliding windows by position, not by slot
            attention_mask = hf_compat.ragged_attention_mask(self.model, attention_mask, q)
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
        finally:
            self._capture.long_rope_rows = None  # the model's own forwards (generate ...) rotate as transformers does
        logits = out.logits
        if logits_to_keep and logits.shape[1] > logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        captured = self._end_capture(feature_layer_ids)
        features = torch.cat(captured, dim=-1) if captured else None
        return TargetOutput(logits=logits.float(), features=features)

    def _long_rope_rows(self) -> torch.Tensor | None:
        """(b,) bool during a `forward` given `long_rope_rows`; None otherwise."""
        return getattr(self._capture, "long_rope_rows", None)

    @torch.no_grad()
    def context_features(
        self,
        input_ids: torch.Tensor,  # (b, T)
        attention_mask: torch.Tensor,  # (b, T) bool, real tokens
        feature_layer_ids: list[int],
        with_final_hidden: bool = False,
    ) -> torch.Tensor:
        """Features of whole sequences for training, (b, T, len(ids) * hidden); no cache, no LM head.

        With `with_final_hidden`, the decoder's final (normed) hidden states (b, T, hidden) follow the
        features on the last dimension: `logits` of them gives the target's logits (soft labels)."""
        self._ensure_hooks(list(feature_layer_ids))
        self._start_capture(feature_layer_ids)
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if decoder is None or decoder is self.model:  # transformers 4 answers the model itself for GPT-2 and others
            decoder = self.model.base_model
        out = decoder(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False)
        parts = self._end_capture(feature_layer_ids)
        if with_final_hidden:
            parts.append(out.last_hidden_state)
        return torch.cat(parts, dim=-1)


def _differ(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two forwards' logits for the same tokens differ by more than rounding in the target's `dtype`
    (other kernels round otherwise: ~1e-6 of the largest logit in float32, up to ~1e-2 in 16 bits), or are not
    numbers at all."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return True
    share = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return bool((a - b).abs().max() > share * a.abs().max().clamp_min(1e-6))


# families whose forward multiplies the LM head's output by a config field, or divides it by one
_LOGIT_MULTIPLIERS = {"cohere": "logit_scale", "cohere2": "logit_scale"}
_LOGIT_DIVISORS = dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"), "logits_scaling")


def _logit_scale(config) -> float | None:
    """The factor a family's forward applies to its LM head's output, by its model_type (the same field name may
    mean nothing elsewhere: MPT's logit_scale); None for none."""
    family = getattr(config, "model_type", None)
    if family in _LOGIT_MULTIPLIERS:
        return _number(getattr(config, _LOGIT_MULTIPLIERS[family], None))
    divisor = _number(getattr(config, _LOGIT_DIVISORS[family], None)) if family in _LOGIT_DIVISORS else None
    return 1.0 / divisor if divisor else None


def _number(value) -> float | None:
    """A config field's value when it is a number (MPT's logit_scale may be a string its forward never reads)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def check_drafts_in_hidden_size(target: TargetModel) -> None:
    """A DFlash drafter reads the target's token embeddings and hands its output to the target's LM head, both in
    the target's hidden size; refuse a target that projects between its embeddings and its layers (OPT-350m,
    ELECTRA, RemBERT)."""
    model, hidden = target.model, target.hidden_size
    width = model.get_input_embeddings().weight.shape[-1]
    head = model.get_output_embeddings().weight.shape[-1]
    if width != hidden or head != hidden:
        raise UnsupportedTargetError(
            f"{type(model).__name__}'s token embeddings are {width} wide and its LM head reads {head}, not its hidden "
            f"size {hidden} (it projects between them), while a DFlash drafter drafts with both in the hidden size: "
            "no DFlash drafter can draft for it; decode it alone, or with a draft model (classic speculative "
            "decoding: --draft SMALL_CAUSAL_LM)")


def check_drafter_fits(target: TargetModel, config: DrafterConfig) -> None:
    """`check_compatible` for a loaded target, whose embeddings' width is known too."""
    check_drafts_in_hidden_size(target)
    check_compatible(target, config)


def check_compatible(target: TargetModel, config: DrafterConfig) -> None:
    """Refuse a drafter built for another target, naming every mismatch."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size: drafter {config.hidden_size}, target {target.hidden_size}")
    if config.num_target_layers not in (None, target.num_layers):
        problems.append(f"number of target layers: drafter was built for {config.num_target_layers}, "
                        f"target has {target.num_layers}")
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} out of range for a {target.num_layers}-layer target")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab size: drafter {config.vocab_size}, target {target.vocab_size}")
    if not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is not in the target's vocabulary "
                        f"of {target.vocab_size}")
    if problems:
        raise IncompatibleDrafterError(
            "this drafter does not fit this target: " + "; ".join(problems)
            + ". Use the drafter trained for this target (or train one with `dflash train`)."
        )


def _mismatch_error(directory: Path) -> CheckpointError:
    try:
        mismatches = causal_lm_shape_mismatches(directory)
    except (ValueError, OSError, CheckpointError):  # a config only the checkpoint's own code builds, or headers that
        # cannot be read: the shapes go unnamed
        mismatches = []
    shown = "; ".join(mismatches[:3]) + (f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else "")
    return CheckpointError(f"the weights in {directory} do not fit its config.json ({shown or 'shapes differ'}): "
                           "restore the config.json that came with these weights")
