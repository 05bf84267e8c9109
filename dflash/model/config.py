"""Typed configuration of a DFlash drafter and its public `config.json` form (REFERENCE section 3)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from dflash.config_types import type_mismatch
from dflash.errors import UserError

# Fields this dataclass owns; everything else in a config.json is kept in `extra` and written back.
_OWNED = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "layer_types", "sliding_window",
    "rope_theta", "rope_scaling", "rope_parameters", "block_size", "num_target_layers", "dflash_config",
    "mask_token_id", "target_layer_ids", "architectures", "model_type", "tie_word_embeddings",
    "torch_dtype", "dtype", "hidden_act", "attention_bias",
}
_SILU = ("silu", "swish")  # the MLP's activation in DFlash drafters (and transformers' other name for it)


class DrafterConfigError(UserError):
    """A drafter config.json that cannot be used; the message says what to change."""


# The drafter's shape: whole numbers >= 1, checked before anything is built from them.
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings")


def is_whole_number(value: Any) -> bool:
    """A whole number >= 1 (not a bool, a float or a string)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_sizes(values: dict[str, Any]) -> None:
    """Refuse a size in `values` (name -> value; the names of `_SIZES` present) that is not a whole number >= 1."""
    bad = [f"{name} {value!r}" for name, value in values.items()
           if name in _SIZES and value is not None and not is_whole_number(value)]
    if bad:
        raise DrafterConfigError(f"drafter config: {', '.join(bad)}; each must be a whole number >= 1")


def check_layer_ids(layer_ids: Any) -> None:
    if (not isinstance(layer_ids, (list, tuple)) or not layer_ids
            or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in layer_ids)):
        raise DrafterConfigError(f"drafter config: target_layer_ids must be a non-empty list of target layer "
                                 f"indices, got {layer_ids!r}")


def _check_given_mask(given: Any, own: Any, vocab_size: Any) -> None:
    """A mask token id passed in (--mask-token-id) is for legacy drafters that do not name theirs, and must be a
    token of the vocabulary."""
    if given is None:
        return
    if own is not None and given != own:
        raise DrafterConfigError(f"this drafter was trained with mask token {own}, and a drafter drafts with its own: "
                                 f"drop the mask token id {given} (--mask-token-id, or mask_token_id= in Python), "
                                 "which is for drafters whose config does not name one")
    if not isinstance(given, numbers.Integral) or isinstance(given, bool):
        raise DrafterConfigError(f"mask token id {given!r} is not a token id: give a whole number (the id of the token "
                                 "the drafter was trained with as its mask)")
    if isinstance(vocab_size, int) and not 0 <= given < vocab_size:
        raise DrafterConfigError(f"mask token id {given} is outside the vocabulary (0 to {vocab_size - 1}); pass "
                                 "the id of the token the drafter was trained with as its mask")


@dataclass(frozen=True)
class DFlash2Options:
    """What DFlash2 adds to a drafter (REFERENCE section 3): a grouped dynamic depthwise convolution over the
    block around every attention and MLP sublayer, and a candidate selector that walks one path through each
    draft position's top candidates. In `dflash_config` of a `DFlash2DraftModel` checkpoint."""

    conv_kernel_size: int = 2  # taps: position t reads t, t-1, ... within its own block
    conv_group_size: int = 16  # channels sharing one dynamic kernel correction
    selector_top_k: int = 16  # candidates per draft position
    selector_rank: int = 256  # width of the predecessor / successor codebooks

    FIELDS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")

    def check(self, hidden_size: int, vocab_size: int) -> None:
        bad = [f"{name} {getattr(self, name)!r}" for name in self.FIELDS if not is_whole_number(getattr(self, name))]
        if bad:
            raise DrafterConfigError(f"dflash_config: {', '.join(bad)}; each must be a whole number >= 1")
        if hidden_size % self.conv_group_size:
            raise DrafterConfigError(f"dflash_config.conv_group_size {self.conv_group_size} must divide hidden_size "
                                     f"{hidden_size}")
        if self.selector_top_k > vocab_size:
            raise DrafterConfigError(f"dflash_config.selector_top_k (dflash train's --selector-top-k) "
                                     f"{self.selector_top_k} exceeds the vocabulary ({vocab_size} tokens)")

    @classmethod
    def from_dflash_config(cls, dflash: dict[str, Any]) -> "DFlash2Options":
        return cls(**{name: dflash[name] for name in cls.FIELDS if dflash.get(name) is not None})

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


def is_dflash2(architectures: list[str]) -> bool:
    return "DFlash2DraftModel" in architectures


def is_causal_lm(architectures: list[str]) -> bool:
    """A plain Hugging Face causal LM (a target, or a draft model for classic speculative decoding), not a drafter:
    its class ends in ForCausalLM, or in LMHeadModel as the GPT-2 family's do (GPT2LMHeadModel, distilgpt2's)."""
    return any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)


# dflash_config fields the dataclass owns; the others (e.g. causal, use_swa, swa_window_size) stay in `dflash_extra`
_DFLASH_OWNED = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers", *DFlash2Options.FIELDS}


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer's block attends: to the keys within `window` positions (None: the whole context), and
    causally (a block position sees the block's positions before it, not after) or both ways."""

    window: int | None
    causal: bool


# the rope base vLLM's and this package's DFlash loaders take when a drafter's config.json names none (SGLang takes
# Qwen3Config's own, 10,000); exports always name theirs
DEFAULT_ROPE_THETA = 1_000_000.0
# model types whose configs (Qwen2Config, Qwen3Config, as both engines read a drafter's config.json) keep a
# sliding_window only under use_sliding_window, and derive absent layer_types from it and max_window_layers
_QWEN_WINDOW_RULES = (None, "qwen2", "qwen3")
_QWEN_MAX_WINDOW_LAYERS = 28  # their default max_window_layers
_QWEN_SLIDING_WINDOW = 4096  # their default sliding_window, under use_sliding_window
# config fields that set how draft layers attend, as vLLM reads them (top level, dflash_config)
ATTENTION_FIELDS = ("is_causal",)
DFLASH_ATTENTION_FIELDS = ("causal", "use_swa", "swa_window_size")


def _qwen_window_rules(raw: dict[str, Any]) -> bool:
    """Whether the config is read by Qwen2Config / Qwen3Config rules; their window fields must have their types,
    which transformers checks too (the engines could not load the file otherwise)."""
    if raw.get("model_type") not in _QWEN_WINDOW_RULES:
        return False
    flag, first = raw.get("use_sliding_window"), raw.get("max_window_layers")
    if flag is not None and not isinstance(flag, bool):
        raise DrafterConfigError(f"drafter config: use_sliding_window must be true or false, got {flag!r}")
    if "max_window_layers" in raw and (not isinstance(first, int) or isinstance(first, bool)):
        raise DrafterConfigError(f"drafter config: max_window_layers must be a whole number, got {first!r}")
    return True


def _sliding_window(raw: dict[str, Any]) -> Any:
    """The top-level window as Qwen3Config reads it: none unless use_sliding_window is true, then 4096 unless
    sliding_window says otherwise."""
    if not _qwen_window_rules(raw):
        return raw.get("sliding_window")
    return raw.get("sliding_window", _QWEN_SLIDING_WINDOW) if raw.get("use_sliding_window") else None


def _layer_types(raw: dict[str, Any]) -> list[str]:
    """Each layer's attention type as Qwen3Config reads it: layer_types, else (under use_sliding_window, with a
    window) the layers from max_window_layers on slide; [] leaves them all full."""
    if raw.get("layer_types") or not _qwen_window_rules(raw) or _sliding_window(raw) is None:
        return list(raw.get("layer_types") or [])
    first = raw.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(raw["num_hidden_layers"])]


def untappable(layer_ids: list[int], num_target_layers: int | None = None) -> str | None:
    """Why vLLM and SGLang cannot feed a drafter these target layers, None when they can. Both tap layer l's output
    as layer l + 1's input, once per layer, and hand the drafter the taps in layer order: the ids must be distinct,
    ascending and (given the target's depth) before its last layer."""
    repeated = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if repeated:
        return (f"they name layer {repeated[0]} more than once, and vLLM and SGLang take each target layer's output "
                "once, which would not fit the drafter's fc")
    if layer_ids != sorted(layer_ids):
        return ("they are not in ascending order, and vLLM and SGLang hand the drafter the target layers' outputs in "
                "layer order, not in the order its fc takes them")
    if num_target_layers is not None and num_target_layers - 1 in layer_ids:
        return (f"they include the target's last layer ({num_target_layers - 1}), and vLLM and SGLang read a layer's "
                "output as the next layer's input, which the last layer has not")
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Which target layers feed the drafter when a checkpoint does not say (REFERENCE section 1).

    One draft layer reads the middle target layer; n layers read n ids spread from layer 1 to layer N-3.
    Qwen3-8B (36 layers) with 5 draft layers gives [1, 9, 17, 25, 33].
    """
    n_target, n = num_target_layers, num_draft_layers
    if n_target < 1 or n < 1:
        raise DrafterConfigError(f"need at least one target and one draft layer, got {n_target} and {n}")
    if n == 1:
        return [n_target // 2]
    ids = [round(1 + i * (n_target - 4) / (n - 1)) for i in range(n)]
    return [min(max(i, 0), n_target - 1) for i in ids]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int | None  # None: the config does not say (the target's depth is then not checked)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_theta": DEFAULT_ROPE_THETA})
    dtype: str | None = None
    dflash2: DFlash2Options | None = None  # None: a DFlash drafter
    extra: dict[str, Any] = field(default_factory=dict)
    dflash_extra: dict[str, Any] = field(default_factory=dict)  # dflash_config's other fields, written back

    def __post_init__(self) -> None:
        check_sizes({name: getattr(self, name) for name in _SIZES})
        check_layer_ids(self.target_layer_ids)
        for name in ("mask_token_id", "block_size", "rms_norm_eps", "sliding_window"):
            expected = type_mismatch(DrafterConfig, name, getattr(self, name))
            if expected:
                raise DrafterConfigError(f"drafter config: {name} must be {expected}, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(f"drafter config: num_attention_heads {self.num_attention_heads} is not a "
                                     f"multiple of num_key_value_heads {self.num_key_value_heads}")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        unknown = sorted({kind for kind in self.layer_types if kind not in ("full_attention", "sliding_attention")},
                         key=str)
        if unknown:
            raise DrafterConfigError(f"drafter config: layer_types holds {unknown}; a draft layer is "
                                     "full_attention or sliding_attention")
        if len(self.layer_types) != self.num_hidden_layers:
            raise DrafterConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}; "
                "give one entry per draft layer in config.json"
            )
        self._check_attention_fields()
        if self.block_size < 2:
            raise DrafterConfigError(f"block_size must be >= 2 (one anchor + draft tokens), got {self.block_size}")
        if self.dflash2 is not None:
            self.dflash2.check(self.hidden_size, self.vocab_size)

    def _check_attention_fields(self) -> None:
        flags = {"is_causal": self.extra.get("is_causal"), "dflash_config.causal": self.dflash_extra.get("causal"),
                 "dflash_config.use_swa": self.dflash_extra.get("use_swa")}
        for name, value in flags.items():
            if value is not None and not isinstance(value, bool):
                raise DrafterConfigError(f"drafter config: {name} must be true, false or absent, got {value!r}")
        window = self.dflash_extra.get("swa_window_size")
        if window is not None and not is_whole_number(window):
            raise DrafterConfigError(f"drafter config: dflash_config.swa_window_size must be a whole number >= 1, "
                                     f"got {window!r}")
        if any(self._sliding(i) for i in range(self.num_hidden_layers)) and not is_whole_number(self._window()):
            raise DrafterConfigError("the drafter has sliding-window layers (layer_types 'sliding_attention', or "
                                     "dflash_config.use_swa) but no window: set sliding_window in config.json to a "
                                     "whole number >= 1 with use_sliding_window true (without it Qwen3Config, as "
                                     "vLLM and SGLang read the file, drops the window), or "
                                     f"dflash_config.swa_window_size; got {self._window()!r}")

    def not_run_here(self) -> str | None:
        """What of this checkpoint dflash's drafter does not implement, though vLLM's DFlash loader reads it (the
        hand-off still takes it); None when nothing."""
        eagle = self.extra.get("eagle_config") if isinstance(self.extra.get("eagle_config"), dict) else {}
        aux = self.dflash_extra.get("use_aux_hidden_state", eagle.get("use_aux_hidden_state"))  # where vLLM reads it
        if self.extra.get("is_neox_style") is False:
            return "rotates interleaved pairs of each head (is_neox_style false), not its halves"
        if aux is False:
            return "drafts from the target's last hidden state alone (use_aux_hidden_state false), without fc"
        if self.dflash_extra.get("attention_sink_bias", self.extra.get("add_swa_attention_sink_bias")):
            return "adds a learned attention sink to each head (attention_sink_bias)"
        if "hidden_act" in self.extra:
            return f"uses {self.extra['hidden_act']!r} in its MLP (hidden_act), not silu"
        return None

    def _window(self) -> Any:
        """A sliding layer's window: dflash_config's swa_window_size, else sliding_window (as vLLM reads them)."""
        return self.dflash_extra.get("swa_window_size") or self.sliding_window

    def _sliding(self, i: int) -> bool:
        swa_everywhere = bool(self.dflash_extra.get("use_swa")) and "sliding_attention" not in self.layer_types
        return swa_everywhere or self.layer_types[i] == "sliding_attention"

    def layer_attention(self, i: int) -> LayerAttention:
        """Draft layer i's attention, read from the checkpoint as vLLM's DFlash loader reads it: a full layer's block
        attends both ways (REFERENCE section 1) and a sliding-window layer's causally (vLLM's rule), unless `is_causal`
        (top level) or dflash_config `causal` says so for every layer; dflash_config `use_swa` slides every layer of a
        config without sliding layers, bidirectionally, within `swa_window_size` (else `sliding_window`)."""
        sliding = self._sliding(i)
        window = self._window() if sliding else None
        causal = self.extra.get("is_causal")
        if causal is None:
            causal = self.dflash_extra.get("causal")
        if causal is None:
            causal = self.layer_types[i] == "sliding_attention"
        return LayerAttention(window, causal)

    @property
    def architecture(self) -> str:
        return "DFlash2DraftModel" if self.dflash2 is not None else "DFlashDraftModel"

    @property
    def num_features(self) -> int:
        """Width of the concatenated target features fed to `fc`."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], mask_token_id: int | None = None) -> "DrafterConfig":
        """Parse the public format: `dflash_config` (new), top-level fields, or the legacy form without either."""
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DrafterConfigError(f"drafter config: dflash_config must be an object, got {dflash!r}")
        architectures = raw.get("architectures") or []
        if architectures and not any("DFlash" in a for a in architectures):
            raise DrafterConfigError(
                f"this checkpoint is a {architectures[0]} model, not a DFlash drafter; give the directory of a "
                "DFlash drafter here (one `dflash train` exports, or a published one such as "
                "z-lab/Qwen3-8B-DFlash-b16)"
            )
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise DrafterConfigError(f"drafter config.json lacks {', '.join(missing)}; is this a DFlash drafter?")
        check_sizes({**dflash, **raw})  # before any arithmetic on them below
        own = dflash.get("mask_token_id", raw.get("mask_token_id"))
        _check_given_mask(mask_token_id, own, raw["vocab_size"])
        mask = mask_token_id if mask_token_id is not None else own
        if mask is None:
            form = ("its dflash_config has no mask_token_id" if "dflash_config" in raw
                    else "legacy format without dflash_config")
            raise DrafterConfigError(
                f"this drafter checkpoint does not name its mask token ({form}); pass it explicitly, e.g. "
                "--mask-token-id ID or load_drafter(..., mask_token_id=ID), or write it into config.json's "
                "dflash_config (vLLM and SGLang read it there)"
            )
        n_layers = raw["num_hidden_layers"]
        n_target = raw.get("num_target_layers", dflash.get("num_target_layers"))
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:
            if n_target is None:
                raise DrafterConfigError(
                    "config.json has neither target_layer_ids nor num_target_layers; add one of them"
                )
            layer_ids = default_target_layer_ids(n_target, n_layers)
        check_layer_ids(layer_ids)
        heads = raw["num_attention_heads"]
        from dflash.model import hf_compat

        rope = {k: raw[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if raw.get(k) is not None}
        # a top-level original_max_position_embeddings joins them for a longrope rotary alone (transformers 5 would
        # read it into a yarn one too, and 4 would not); otherwise it stays among the fields written back as read
        rope = hf_compat.complete_longrope(rope, raw.get("max_position_embeddings", 32768),
                                           raw.get("original_max_position_embeddings"))
        config = cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 4 * raw["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            num_target_layers=n_target,
            target_layer_ids=list(layer_ids),
            mask_token_id=mask,
            block_size=dflash.get("block_size", raw.get("block_size", 16)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            layer_types=_layer_types(raw),
            sliding_window=_sliding_window(raw),
            rope=rope or {"rope_theta": DEFAULT_ROPE_THETA},
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            dflash2=DFlash2Options.from_dflash_config(dflash) if is_dflash2(architectures) else None,
            # another activation is kept, so that not_run_here names it (dflash's drafter runs silu alone)
            extra={k: v for k, v in raw.items() if k not in _OWNED or (k == "hidden_act" and v not in _SILU)},
            dflash_extra={k: v for k, v in dflash.items() if k not in _DFLASH_OWNED},
        )
        config.check_rotary()
        return config

    def check_rotary(self) -> None:
        """Refuse rope fields (and a head_dim) transformers cannot build this drafter's rotary embedding from."""
        from dflash.model import hf_compat

        try:
            hf_compat.rotary_embedding(self.qwen3_fields())
        except (*hf_compat.CONFIG_ERRORS, ValueError) as err:
            raise DrafterConfigError(f"drafter config: transformers cannot build its rotary embedding from it "
                                     f"({hf_compat.config_error_text(err)}); fix the field this names (rope_theta, "
                                     "rope_scaling or rope_parameters, head_dim)") from None

    def to_dict(self) -> dict[str, Any]:
        """The public config.json (Qwen3 fields + DFlash fields) that vLLM, SGLang and this package read."""
        out: dict[str, Any] = dict(self.extra)
        if self.sliding_window is not None:  # else Qwen3Config, and so both engines, read no window
            out["use_sliding_window"] = True
        out.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
            hidden_act="silu",
            attention_bias=False,
            tie_word_embeddings=False,
            block_size=self.block_size,
            **({} if self.num_target_layers is None else {"num_target_layers": self.num_target_layers}),
            dflash_config={
                **self.dflash_extra,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
                "block_size": self.block_size,
                **(self.dflash2.to_dict() if self.dflash2 is not None else {}),
            },
            **self.rope,
        )
        if self.dtype:
            out["torch_dtype"] = self.dtype
        return out

    def qwen3_fields(self) -> dict[str, Any]:
        """Fields a transformers Qwen3Config accepts (used for the rotary embedding)."""
        return dict(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            **self.rope,
        )
