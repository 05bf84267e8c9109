"""The one seam between DFlash and transformers internals.

Everything that changed between transformers 4.57 and 5.x (the cache keyword, `DynamicCache.crop`'s
argument, decoder-layer outputs, rotary embeddings) is handled here and nowhere else.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from torch import nn
from transformers import DynamicCache

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def cache_kwarg_name(model: nn.Module) -> str:
    """The forward keyword a model takes its KV cache under (`cache` in 5.x, `past_key_values` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_dynamic_cache(config: Any) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # older signatures
        return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_cache(cache: DynamicCache, new_length: int) -> None:
    """Keep the first `new_length` slots of every layer."""
    remove = cache_length(cache) - new_length
    if remove <= 0:
        return
    if TRANSFORMERS_MAJOR >= 5:
        cache.crop(-remove)
    else:
        cache.crop(new_length)


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (batch, kv_heads, slots, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_cache_tensors(cache: DynamicCache, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in zip(cache.layers, tensors):
        layer.keys, layer.values = k, v


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
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return max(lists, key=len)


def text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's fields under `text_config`."""
    return getattr(config, "text_config", None) or config


def rotary_embedding(fields: dict[str, Any]) -> nn.Module:
    """A Qwen3 rotary embedding built from config fields (rope_theta / rope_scaling / rope_parameters)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config=Qwen3Config(**fields))


def rope_fields(config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config, in the form its own constructor takes back."""
    out: dict[str, Any] = {}
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        value = getattr(config, key, None)
        if value is not None:
            out[key] = value
    return out
