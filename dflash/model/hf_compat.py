"""The one seam between DFlash and transformers internals.

Everything that changed between transformers 4.57 and 5.x (the cache keyword, `DynamicCache.crop`'s
argument, decoder-layer outputs, rotary embeddings) is handled here and nowhere else, and so is what the
families differ in: which attention each layer has (full, sliding-window, or a state that cannot be rolled
back) and the attention masks a ragged batch needs for sliding-window layers.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import transformers
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from dflash.model.config import DEFAULT_ROPE_THETA
from dflash.model.slot_buffer import SlotBuffer

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# transformers' SDPA and eager mask makers evaluate a mask function per row only on torch >= 2.6; before, they
# vmap it over queries and keys with no row index (4.57's `sdpa_mask_older_torch`), so a mask that differs by row
# (holes, positions, a branch) cannot be made by them
MASK_MAKERS_SEE_ROWS = TORCH_VERSION >= (2, 6)


def cache_kwarg_name(model: nn.Module) -> str:
    """The forward keyword a model takes its KV cache under (`cache` in 5.x, `past_key_values` before), read
    through a wrapper (`unwrapped`) that passes it on in its `**kwargs`."""
    params = inspect.signature(unwrapped(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a wrapper whose forward takes everything as `**kwargs`: torch.compile's
    OptimizedModule (`_orig_mod`), PEFT's (`get_base_model`)."""
    inner = getattr(model, "_orig_mod", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that writes new keys/values into spare room (`SlotBuffer`) instead of
    concatenating them onto the whole cache every forward. `keys` / `values` read as usual; assigning them
    (selecting rows, merging batches) replaces the storage."""

    def __init__(self, **kwargs):
        self._keys, self._values = SlotBuffer(), SlotBuffer()
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys.view

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = SlotBuffer(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return self._values.view

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = SlotBuffer(tensor)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys, self._values = SlotBuffer(), SlotBuffer()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._keys.append(key_states), self._values.append(value_states)

    def get_seq_length(self) -> int:
        return self._keys.length

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take (b, kv_heads, capacity, d) tensors whose first `length` slots are filled as the storage."""
        self._keys, self._values = SlotBuffer(keys, length), SlotBuffer(values, length)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (ascending) in place (`SlotBuffer.keep_rows`)."""
        if self._keys.view is not None:
            self._keys.keep_rows(rows)
            self._values.keep_rows(rows)

    def crop(self, length_or_removed: int) -> None:
        """Minus the number of slots to drop (both versions; `crop_cache` passes that), or the number of slots to
        keep (transformers 4.x alone; 0 keeps none there, and drops none in 5.x)."""
        if length_or_removed == 0 and TRANSFORMERS_MAJOR >= 5:
            return
        keep = self._keys.length + length_or_removed if length_or_removed < 0 else length_or_removed
        self._keys.truncate(keep)
        self._values.truncate(keep)


class SlidingGrowingLayer(GrowingLayer):
    """A sliding-window layer that keeps every slot, as a full-attention `GrowingLayer` does.

    transformers' own sliding layer drops the keys that fell out of its window, so once a sequence is longer
    than the window it can no longer be cropped back to the accepted tokens, and its slots would not line up
    with the other layers' when a ragged batch is compacted or merged. Keeping them costs full-attention memory
    for these layers; the window itself is applied by the attention mask (see `ragged_attention_mask`)."""

    is_sliding = True

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(**kwargs)
        self.sliding_window = sliding_window


# The layer kinds whose cache is keys and values per token, which a rejected draft can be cropped from.
ROLLBACK_LAYER_KINDS = ("full_attention", "sliding_attention")

# Why the other kinds cannot be rolled back to the accepted tokens, row by row.
_NO_ROLLBACK = {
    "linear_attention": "their recurrent (linear-attention or state-space) state takes in every draft token, and "
                        "a rejected one cannot be taken out again",
    "hybrid": "their recurrent state takes in every draft token, and a rejected one cannot be taken out again",
    "hybrid_sliding": "their recurrent state takes in every draft token, and a rejected one cannot be taken out again",
    "conv": "their convolution state takes in every draft token, and a ragged batch cannot take a rejected one out",
    "chunked_attention": "their attention chunks are drawn by cache slot, and the holes a rejected draft leaves in "
                         "a ragged batch move the chunk borders",
    "dummy": "they keep no cache of their own (they reuse other layers' keys and values, or have no attention), "
             "which DFlash's cache handling does not follow",
    "indexed_attention": "their sparse-attention indexer cache is not moved with the keys and values when rows are "
                         "cropped, selected or merged",
}


def layer_kinds(config: Any) -> list[str]:
    """The attention kind of every decoder layer, as transformers' cache names it: "full_attention",
    "sliding_attention", "chunked_attention", "linear_attention", "conv", "hybrid", "dummy" (no cache) ..."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: only full and sliding layers are told apart
        kind = "sliding_attention" if getattr(text, "sliding_window", None) is not None else "full_attention"
        return list(getattr(text, "layer_types", None) or [kind] * text.num_hidden_layers)
    return list(get_layer_types_and_kwargs(text)[0])


def rollback_problem(config: Any) -> str | None:
    """Why speculative decoding cannot put this target's cache back to the accepted tokens (None: it can).

    A rejected draft token must leave no trace, row by row: keys and values per token (full and
    sliding-window attention) can be cropped or masked; other kinds of layer state cannot (see `_NO_ROLLBACK`)."""
    kinds = layer_kinds(config)
    problems = []
    for kind in dict.fromkeys(k for k in kinds if k not in ROLLBACK_LAYER_KINDS):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        reason = _NO_ROLLBACK.get(kind, "DFlash cannot roll their cache back to the accepted tokens")
        problems.append(f"layers {layers} are {kind!r} layers: {reason}")
    return "; ".join(problems) or None


# the keywords recurrent models take their state under, in place of a key/value cache
_STATE_KEYWORDS = ("state", "cache_params", "rnn_state")


def cache_problem(model: nn.Module) -> str | None:
    """Why a model's forward cannot be decoded with a key/value cache, from its signature (None: nothing says so).
    A recurrent model (RWKV) takes its state under its own keyword and would swallow `past_key_values` in its
    `**kwargs` unseen. Wrappers (`torch.compile`, PEFT) are looked through; `TargetModel.check_decodable` also
    tries one forward, for a model whose signature does not tell (xLSTM's own `cache`)."""
    params = inspect.signature(unwrapped(model).forward).parameters
    if "cache" in params or "past_key_values" in params or not any(k in params for k in _STATE_KEYWORDS):
        return None
    return ("its forward takes no key/value cache (`past_key_values`): it keeps a recurrent state, which takes in "
            "every draft token, and a rejected one cannot be taken out again")


def rope_switch_length(config: Any) -> int | None:
    """Where a `longrope` rotary embedding (Phi-3 and Phi-3.5 128k, Phi-4-mini) changes its frequencies, when that
    is inside the context; None for any other rotary.

    transformers picks the short or the long factors once per forward, from the forward's largest position: a
    forward that reaches `original_max_position_embeddings` rotates every token in it with the long factors.
    Decoding one token at a time rotates a token with the long factors only from that position on, so a verified
    block, a batch or a re-read that straddles it would rotate some tokens otherwise, and change the output."""
    text = text_config(config)
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 names them `rope_parameters`
        params = getattr(text, key, None)
        if not isinstance(params, dict):
            continue
        kinds = [params] + [v for v in params.values() if isinstance(v, dict)]  # per layer kind (Gemma 3's form)
        for kind in kinds:
            if (kind.get("rope_type") or kind.get("type")) != "longrope":
                continue
            if kind.get("long_factor") is not None and kind.get("long_factor") == kind.get("short_factor"):
                continue  # the same frequencies either way
            switch = kind.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                             None)
            limit = getattr(text, "max_position_embeddings", None)
            if switch is not None and (limit is None or switch < limit):
                return int(switch)
    return None


def rotate_rows(model: Any, switch: int, long_rows: Callable[[], Any]) -> int:
    """Let each row of a forward choose `model`'s longrope factors: returns how many rotary modules it changed (0:
    none it can change, or a class whose `generate` does not read a sequence again at the switch; the caller must
    then keep its forwards within the switch).

    transformers picks the short or the long factors once per forward, from its largest position, and its
    `generate` reads a sequence again with the long factors when it first reaches past the switch. A batch of
    rows on either side of the switch needs each row's own choice: `long_rows()` gives it during one of DFlash's
    forwards ((b,) bool); None outside them, where the module works as transformers wrote it. Both factor sets come
    from the module's own forward (the short set for the positions with the long rows' zeroed, all below the
    switch; the long set for the positions with the switch appended), so every value is the one transformers
    computes for that position."""
    inner = unwrapped(model)
    kinds = {getattr(inner.config, "model_type", None), getattr(text_config(inner.config), "model_type", None)}
    if not kinds & _RECOMPUTE_AT_SWITCH:
        return 0  # its generate keeps the short rotation before the switch: the caller stays within it
    modules = [m for m in inner.modules() if type(m).__name__.endswith("RotaryEmbedding")
               and "longrope" in str(getattr(m, "rope_type", ""))]
    if not modules or any("position_ids" not in inspect.signature(m.forward).parameters for m in modules):
        return 0  # e.g. transformers 4's Phi-3.5-MoE rotary, which takes a sequence length
    for module in modules:
        module.forward = _rotary_by_row(module.forward, switch, long_rows)
    return len(modules)


# Model types whose `generate` reads a sequence again with the long factors when it first passes the switch
# (their prepare_inputs_for_generation drops the cache there): Phi-3 and Phi-3.5, Phi-3.5-MoE, Phi-4-multimodal
_RECOMPUTE_AT_SWITCH = {"phi3", "phimoe", "phi4_multimodal"}


def _rotary_by_row(original: Callable, switch: int, long_rows: Callable[[], Any]) -> Callable:
    def forward(x, position_ids, *args, **kwargs):
        rows = long_rows()
        if rows is None:
            return original(x, position_ids, *args, **kwargs)
        position_ids = position_ids.expand(rows.shape[0], -1)  # (b, q)
        use_long = rows.to(position_ids.device)[:, None].expand_as(position_ids)  # (b, q)
        forced = torch.cat([position_ids, position_ids.new_full((rows.shape[0], 1), switch)], dim=1)
        long_cos, long_sin = (t[:, :-1] for t in original(x, forced, *args, **kwargs))  # (b, q, d) each
        short_cos, short_sin = original(x, position_ids.masked_fill(use_long, 0), *args, **kwargs)
        pick = use_long[..., None]
        return torch.where(pick, long_cos, short_cos), torch.where(pick, long_sin, short_sin)

    return forward


def _rollback_layer(layer: Any) -> Any:
    """Our slot-keeping replacement of a transformers cache layer (the layer itself if it has none)."""
    if type(layer) is DynamicLayer:
        return GrowingLayer()
    if type(layer) is DynamicSlidingWindowLayer:
        return SlidingGrowingLayer(layer.sliding_window)
    return layer


def new_dynamic_cache(config: Any) -> DynamicCache:
    """A DynamicCache whose full-attention and sliding-window layers are `GrowingLayer`s and
    `SlidingGrowingLayer`s: every layer keeps every slot, so crops, row selection and compaction treat all
    layers alike (other layer kinds stay transformers' own; `rollback_problem` names them)."""
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older signatures
        cache = DynamicCache()
    layers = getattr(cache, "layers", None)
    if layers:
        cache.layers = [_rollback_layer(layer) for layer in layers]
    elif getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def has_sliding_layers(config: Any) -> bool:
    return "sliding_attention" in layer_kinds(config)


def _causal_by_position(slot_positions: torch.Tensor, window: int | None):
    """A transformers mask function, index-based: the query slot sees the key slot when the key's sequence
    position is not after the query's and, with a `window`, less than `window` before it.
    slot_positions (b, slots)."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        q_pos, kv_pos = slot_positions[batch_idx, q_idx], slot_positions[batch_idx, kv_idx]
        seen = kv_pos <= q_pos
        return seen if window is None else seen & (q_pos - kv_pos < window)

    return inner


def ragged_attention_mask(model: nn.Module, attention_mask: torch.Tensor, q_length: int) -> Any:
    """The attention masks of a forward over a ragged batch, for a target with sliding-window layers.

    attention_mask (b, cache slots + q): 1 = a real token, 0 = a hole (a rejected draft token's slot, or left
    padding). transformers draws a sliding window by slot: with holes inside a row, a window of slots covers
    fewer than `window` tokens, so a sliding layer would miss keys it must see. Here each slot gets its
    sequence position (a row's real tokens fill positions 0, 1, ... in slot order) and windows are drawn by
    position. The masks take the form transformers' own `generate` hands a model (`create_masks_for_generate`):
    one per layer kind when the config lists `layer_types`, else one sliding mask; each made by the attention
    implementation's mask maker (boolean for SDPA, additive for eager, the padding mask for flash).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = model.config.get_text_config(decoder=True)
    make_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(config._attn_implementation)
    if make_mask is None:  # a kernel that builds no mask (e.g. paged): it reads the padding mask itself
        return attention_mask
    valid = attention_mask.bool()  # (b, slots)
    slot_positions = valid.long().cumsum(-1) - 1  # (b, slots); a hole repeats its predecessor's (masked anyway)
    batch_size, slots = valid.shape

    def mask(window: int | None):
        return _call_mask_maker(
            make_mask, q_length, slots, batch_size=batch_size,
            mask_function=_causal_by_position(slot_positions, window), attention_mask=valid, local_size=window,
            allow_is_causal_skip=False, use_vmap=False, dtype=model.dtype, config=config, device=valid.device,
        )

    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # no layer kinds: every layer slides
        return mask(config.sliding_window)
    return {kind: mask(config.sliding_window if kind == "sliding_attention" else None) for kind in set(kinds)}


def _mask_maker(config: Any):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS.get(config._attn_implementation)


def _call_mask_maker(make_mask, q_length: int, kv_length: int, **kwargs: Any) -> Any:
    """A transformers mask maker's mask for the last `q_length` of `kv_length` slots (the new tokens after the
    cache), in either signature: transformers 5 takes the query count and offset, 4.57 the queries' slot indices
    (`cache_position`); the mask function sees the same absolute slot index as `q_idx` in both. On torch < 2.6,
    where transformers' SDPA and eager makers cannot tell rows apart, the mask is made here (`_dense_mask`)."""
    q_offset = kv_length - q_length
    kind = _mask_kind(make_mask)
    if not MASK_MAKERS_SEE_ROWS and kind is not None:
        return _dense_mask(kind, q_length, kv_length, **kwargs)
    if _takes_cache_position(make_mask):
        device = kwargs.get("device")
        kwargs["cache_position"] = torch.arange(q_offset, kv_length, device=device)
    else:
        kwargs.update(q_length=q_length, q_offset=q_offset)
    return make_mask(kv_length=kv_length, kv_offset=0, **kwargs)


@functools.lru_cache(maxsize=16)
def _takes_cache_position(make_mask) -> bool:
    """Whether a mask maker has transformers 4.57's signature (asked once per maker: masks are made every step)."""
    return "cache_position" in inspect.signature(make_mask).parameters


@functools.lru_cache(maxsize=16)
def _mask_kind(make_mask) -> str | None:
    """The form of mask transformers' `make_mask` makes: "bool" for SDPA, "additive" for eager, None for others."""
    from transformers import masking_utils

    makers = {"sdpa_mask": "bool", "sdpa_mask_older_torch": "bool", "sdpa_mask_recent_torch": "bool",
              "eager_mask": "additive"}
    name = getattr(make_mask, "__name__", "")
    return makers.get(name) if getattr(masking_utils, name, None) is make_mask else None


def _dense_mask(kind: str, q_length: int, kv_length: int, *, batch_size: int, mask_function, attention_mask,
                dtype: torch.dtype, device: torch.device, **_: Any) -> torch.Tensor:
    """What transformers' SDPA ("bool") or eager ("additive") mask maker makes, (b, 1, q, kv), with the mask
    function evaluated on broadcast indices instead of under vmap. attention_mask (b, kv) bool, real slots."""
    rows = torch.arange(batch_size, device=device)[:, None, None]  # (b, 1, 1)
    queries = torch.arange(kv_length - q_length, kv_length, device=device)[None, :, None]  # (1, q, 1)
    keys = torch.arange(kv_length, device=device)[None, None, :]  # (1, 1, kv)
    seen = mask_function(rows, None, queries, keys).expand(batch_size, q_length, kv_length)
    seen = (seen & attention_mask[:, None, :])[:, None]  # (b, 1, q, kv)
    if TORCH_VERSION < (2, 5):  # as transformers does there: a query that sees nothing would make SDPA give NaN
        seen = seen | ~seen.any(-1, keepdim=True)
    if kind == "bool":
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, torch.finfo(dtype).min)


def padding_mask_needed(batch_size: int) -> bool:
    """transformers 4.x on torch < 2.5 cannot make the causal mask of a forward of several rows that has no
    padding mask (it writes in place into a mask expanded over the rows): such a forward gets an all-ones one."""
    return batch_size > 1 and TORCH_VERSION < (2, 5) and TRANSFORMERS_MAJOR < 5


def takes_tree_masks(model: nn.Module) -> bool:
    """Whether a forward can take a tree-shaped mask (`tree_attention_mask`): an attention implementation that
    reads a 4D mask (SDPA, eager; not flash or paged kernels, which build their own), and no sliding-window
    layers (their windows would need a mask per layer kind), and no ALiBi (BLOOM, MPT, Falcon with `alibi`: their
    position bias is built from the 2D padding mask, by slot order, which a branch's tokens do not follow)."""
    config = model.config.get_text_config(decoder=True)
    return (_mask_maker(config) is not None and not has_sliding_layers(config) and not uses_alibi(config)
            and not positions_by_slot(config))


def uses_alibi(config: Any) -> bool:
    """Whether attention adds an ALiBi bias instead of rotating positions into queries and keys."""
    attn_config = getattr(config, "attn_config", None)  # MPT keeps it there
    return (config.model_type == "bloom" or bool(getattr(config, "alibi", False))
            or bool(getattr(attn_config, "alibi", False)))


def positions_by_slot(config: Any) -> bool:
    """Whether attention takes a token's distance to another from their cache slots, not from position ids or the
    padding mask: MPT's ALiBi bias (by key slot), GPT-Neo's local layers (a window of slots). Holes between a
    row's tokens (a ragged batch's rejected draft tokens) then change the output; such a target's batch is
    compacted after every step that leaves some (`SpeculativeEngine._maybe_compact`)."""
    config = config.get_text_config(decoder=True)
    local_layers = config.model_type == "gpt_neo" and "local" in getattr(config, "attention_layers", [])
    return config.model_type == "mpt" or local_layers


def tree_attention_mask(model: nn.Module, attention_mask: torch.Tensor, visibility: torch.Tensor) -> Any:
    """The 4D attention mask of a forward whose new tokens are not a causal chain (a block and its branch).

    attention_mask (b, cache slots + q): 1 = a real token, 0 = a hole; visibility (b, q, q) bool: which of the
    new tokens each new token sees. Made by the attention implementation's mask maker (boolean for SDPA,
    additive for eager); transformers passes a 4D mask on as it is (see `takes_tree_masks` for the others).
    """
    if not takes_tree_masks(model):
        raise ValueError("this target's attention takes no tree-shaped mask; check takes_tree_masks first")
    config = model.config.get_text_config(decoder=True)
    make_mask = _mask_maker(config)
    valid = attention_mask.bool()  # (b, slots)
    (batch_size, slots), q = valid.shape, visibility.shape[1]
    seen = torch.cat([valid[:, None, : slots - q].expand(-1, q, -1), visibility], dim=2)  # (b, q, slots)

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return seen[batch_idx, q_idx - (slots - q), kv_idx]

    return _call_mask_maker(
        make_mask, q, slots, batch_size=batch_size, mask_function=inner, attention_mask=valid,
        allow_is_causal_skip=False, use_vmap=False, dtype=model.dtype, config=config, device=valid.device,
    )


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_cache(cache: DynamicCache, new_length: int) -> None:
    """Keep the first `new_length` slots of every layer."""
    remove = cache_length(cache) - new_length
    if remove > 0:
        cache.crop(-remove)  # a negative count removes slots in transformers 4.57+ and 5.x alike


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (batch, kv_heads, slots, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_cache_tensors(cache: DynamicCache, tensors: list[tuple[torch.Tensor, torch.Tensor]],
                      length: int | None = None) -> None:
    """Per layer (keys, values) as the cache's new storage. With `length`, only their first `length` slots are
    filled: a layer that grows in place keeps the rest as spare room (`slot_buffer.spare_room`)."""
    for layer, (k, v) in zip(cache.layers, tensors):
        if length is None:
            layer.keys, layer.values = k, v
        elif isinstance(layer, GrowingLayer):
            layer.hold(k, v, length)
        else:
            layer.keys, layer.values = k[:, :, :length], v[:, :, :length]


def keep_cache_rows_in_place(cache: DynamicCache, rows: list[int]) -> bool:
    """Keep batch rows `rows` of a cache whose layers all grow in place, without copying the kept rows that do
    not move; False (nothing done) for other caches or rows out of order."""
    if not all(isinstance(layer, GrowingLayer) for layer in cache.layers) or rows != sorted(set(rows)):
        return False
    for layer in cache.layers:
        layer.keep_rows(rows)
    return True


# `scaled_dot_product_attention(..., enable_gqa=True)` exists from torch 2.5
_SDPA_HAS_GQA = TORCH_VERSION >= (2, 5)


def sdpa_reads_shared_heads(device: torch.device) -> bool:
    """Whether a masked grouped-query SDPA should read the shared key/value heads itself (`enable_gqa`) rather
    than have them repeated per query head: on a CPU, yes (measured faster here). On a GPU a masked grouped
    SDPA can fall back to the slow math kernel, so the heads are repeated there (as transformers does)."""
    return device.type == "cpu" and _SDPA_HAS_GQA


_GQA_ATTENTION = "sdpa_shared_kv"  # no "flash" in the name: transformers takes those for flash kernels


def _sdpa_with_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that a masked grouped-query attention on the CPU lets SDPA read the
    shared key/value heads (`enable_gqa`) instead of first copying them once per query head (`repeat_kv`):
    verifying a block is masked, and at 8 rows x ~400 slots those copies were a fifth of the target forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or not sdpa_reads_shared_heads(query.device)
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(  # (b, heads, q, d)
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch a CPU model that uses transformers' SDPA attention to `_sdpa_with_gqa` (same results, fewer
    copies); True when it was switched. GPU models and other attention implementations are left alone."""
    device = next(model.parameters()).device
    if not sdpa_reads_shared_heads(device) or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(_GQA_ATTENTION, _sdpa_with_gqa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_GQA_ATTENTION, sdpa_mask)
        model.set_attn_implementation(_GQA_ATTENTION)
    except (ImportError, AttributeError, TypeError, ValueError):  # an older transformers: keep its SDPA
        return False
    return getattr(model.config, "_attn_implementation", None) == _GQA_ATTENTION


def layer_output_tensor(output: Any) -> torch.Tensor:
    """A decoder layer returns a tensor in 5.x and a tuple (hidden, ...) in 4.x."""
    return output[0] if isinstance(output, (tuple, list)) else output


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer stack of a causal LM, whatever the family calls it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for candidate in (decoder, getattr(model, "model", None), model):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: it holds no list of layers, so "
                         "dflash cannot tap its hidden states; give a decoder-only transformer checkpoint")
    return max(lists, key=len)


def text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's fields under `text_config`."""
    return getattr(config, "text_config", None) or config


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config field it cannot build from: TypeError and KeyError (a value of the wrong
    type, an unknown rope type) and, from 5.x, huggingface_hub's strict-dataclass validation errors."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub before the strict dataclasses: transformers 4.x raises the others
        return (TypeError, KeyError)
    return (TypeError, KeyError, StrictDataclassError)


CONFIG_ERRORS = _config_errors()


def config_error_text(err: BaseException, limit: int = 300) -> str:
    """A CONFIG_ERRORS error in one line: its type and all of its text (a strict-dataclass error's first line only
    names the field; the lines after it say what is wrong with it)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text[:limit]}" if text else type(err).__name__


def rotary_embedding(fields: dict[str, Any]) -> nn.Module:
    """A Qwen3 rotary embedding built from config fields (rope_theta / rope_scaling / rope_parameters)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config=Qwen3Config(**fields))


def rope_fields(config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config, in the form its own constructor takes back, for one kind of
    attention: a config that keeps them per layer kind (Gemma3's `rope_parameters` of "full_attention" and
    "sliding_attention") gives its full-attention ones, the kind of every drafter layer. A partial rotary factor
    (GPT-NeoX, Phi, StableLM, GLM) is left out: the drafter rotates its whole head, and an engine that read the
    factor from its config.json (vLLM, SGLang) would rotate it otherwise than it was trained. Per-frequency factors
    sized for a partly rotated head (Phi-4-mini's longrope lists) fit no whole head: the drafter rotates with the
    target's base alone. A target without rope (GPT-2's absolute positions) gives the base every loader of the
    format assumes when none is written (1,000,000), written out, so training and loading rotate alike."""
    out: dict[str, Any] = {}
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        value = getattr(config, key, None)
        if value is not None:
            out[key] = value
    for key in ("rope_scaling", "rope_parameters"):  # transformers 5 reads one as the other
        per_kind = out.get(key)
        if isinstance(per_kind, dict) and per_kind and all(isinstance(v, dict) for v in per_kind.values()):
            per_kind = out[key] = dict(per_kind.get("full_attention") or next(iter(per_kind.values())))
        if isinstance(per_kind, dict) and "partial_rotary_factor" in per_kind:
            out[key] = {k: v for k, v in per_kind.items() if k != "partial_rotary_factor"}
    if "rope_theta" not in out:  # transformers 5 keeps it inside rope_parameters; an engine on transformers 4 reads
        for key in ("rope_parameters", "rope_scaling"):  # it at the top level, else rotates with base 10,000
            theta = out.get(key, {}).get("rope_theta") if isinstance(out.get(key), dict) else None
            if theta is not None:
                out["rope_theta"] = theta
                break
    if not _factors_fit(out, head_dim(config)):
        out = {"rope_theta": out.get("rope_theta", DEFAULT_ROPE_THETA)}
    out.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    return complete_longrope(out, getattr(config, "max_position_embeddings", None),
                             getattr(config, "original_max_position_embeddings", None))


def complete_longrope(rope: dict[str, Any], max_positions: int | None, original: int | None) -> dict[str, Any]:
    """Longrope fields every transformers version reads alike. Phi-3's config keeps the length it switches from
    short to long factors at (`original_max_position_embeddings`) at its top level, and neither it nor transformers
    5 writes a `factor`; transformers 4 cannot build a longrope rotary without one of them on a Qwen3Config (a
    drafter's), and without the top-level field it switches at the wrong length. So the length goes both inside the
    rope dicts and beside them, and `factor` is its ratio to `max_positions`."""
    out = dict(rope)
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        if not isinstance(params, dict) or (params.get("rope_type") or params.get("type")) != "longrope":
            continue
        length = params.get("original_max_position_embeddings") or original or out.get(
            "original_max_position_embeddings")
        if not length:
            continue
        params = {**params, "original_max_position_embeddings": length}
        if params.get("factor") is None and max_positions:
            params["factor"] = max_positions / length
        out[key] = params
        out["original_max_position_embeddings"] = length
    return out


def head_dim(config: Any) -> int | None:
    """A transformers config's attention head size: its head_dim, or hidden_size over the heads."""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    return getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)


def _factors_fit(fields: dict[str, Any], head_dim: int | None) -> bool:
    """Whether per-frequency rope factors (longrope's short_factor / long_factor), if any, have one entry per
    rotated pair of a whole head of `head_dim`."""
    for key in ("rope_scaling", "rope_parameters"):
        params = fields.get(key)
        for name in ("short_factor", "long_factor"):
            factors = params.get(name) if isinstance(params, dict) else None
            if isinstance(factors, list) and head_dim is not None and len(factors) != head_dim // 2:
                return False
    return True
