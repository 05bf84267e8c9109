"""The DFlash drafter: a small stack of Qwen3-style layers that drafts a whole block in one forward.

Vocabulary (used across the package):
- anchor: the last accepted token; a block starts with it.
- block: `[anchor, MASK x (block_size - 1)]` at positions anchor..anchor+block_size-1.
- draft tokens: what the drafter proposes for the MASK slots.
- context: the target's features (outputs of layers `target_layer_ids`) of tokens strictly before the
  anchor, projected by `fc` + `hidden_norm` and injected as extra keys/values into every layer.

This module holds modules and their forward only; it never samples and never loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model import hf_compat
from dflash.model.config import DrafterConfig, DrafterConfigError
from dflash.model.cpu_precision import CastingLinear
from dflash.model.dflash2 import CandidateSelector, GroupedDynamicConv, block_conv
from dflash.model.slot_buffer import SlotBuffer, gather_slots, spare_room


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, t, d); cos/sin (b, t, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values = [injected context ; block]; the layer's mask says which of them each
    query sees (bidirectional within the block for the published drafters: `DrafterConfig.layer_attention`)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = CastingLinear(h, self.num_heads * d, bias=False)
        self.k_proj = CastingLinear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = CastingLinear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = CastingLinear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # (b, n, t, d)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, h) -> rotated keys and values, each (b, kv_heads, t, d)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # (b, q, h) normed block hidden states
        context: torch.Tensor,  # (b, c, h) projected context new to this forward
        cos: torch.Tensor,  # (b, c + q, d): rotary tables for [context ; block]
        sin: torch.Tensor,
        mask: torch.Tensor,  # (b, q, keys) bool, True = may attend; keys = cached + c + q
        cache: "DrafterCache | None" = None,
        layer_idx: int = 0,
        queries: slice = slice(None),  # the block positions that ask (every position gives keys/values)
    ) -> torch.Tensor:
        c = context.shape[1]
        cos_q, sin_q = cos[:, c:][:, queries], sin[:, c:][:, queries]
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x[:, queries]), self.num_heads)), cos_q, sin_q)
        # one projection for the new context and the block: fewer, larger matmuls
        k, v = self.keys_values(torch.cat([context, x], dim=1), cos, sin)  # (b, kv_heads, c + q, d)
        if cache is not None:  # every accepted token's keys, then this block's (not kept)
            k, v = cache.update(layer_idx, k[:, :, :c], v[:, :, :c], k[:, :, c:], v[:, :, c:])
        out = grouped_attention(q, k, v, mask[:, queries].unsqueeze(1))  # (b, heads, asking, d)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with fewer key/value heads than query heads: q (b, heads, q, d), k/v (b, kv_heads, keys, d), mask
    (b, 1, q, keys); the shared heads are read in place where `hf_compat.sdpa_reads_shared_heads` says so."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if hf_compat.sdpa_reads_shared_heads(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DFlashMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = CastingLinear(h, i, bias=False)
        self.up_proj = CastingLinear(h, i, bias=False)
        self.down_proj = CastingLinear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        if config.dflash2 is not None:  # DFlash2: an in-block convolution around each sublayer
            self.attention_conv = GroupedDynamicConv(config.hidden_size, config.dflash2)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, config.dflash2)

    def forward(self, x, context, cos, sin, mask, cache=None, layer_idx: int = 0,
                queries: slice = slice(None), block_width: int | None = None) -> torch.Tensor:
        """x (b, q, h) -> the new hidden states of the `queries` positions, (b, asking, h). `block_width`: the
        positions per block (DFlash2's convolution stays inside one; default q, one block)."""
        if hasattr(self, "attention_conv"):
            return self._forward_dflash2(x, context, cos, sin, mask, cache, layer_idx, block_width or x.shape[1],
                                         queries)
        x = x[:, queries] + self.self_attn(self.input_layernorm(x), context, cos, sin, mask, cache, layer_idx,
                                           queries)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _forward_dflash2(self, x, context, cos, sin, mask, cache, layer_idx: int, width: int,
                         queries: slice) -> torch.Tensor:
        """The block's first positions up to the last one asked for compute their outputs (a position's output
        convolution reads the positions before it, never after)."""
        asked = slice(0, queries.stop)
        normed = self.input_layernorm(x)
        kernels = self.attention_conv.kernels(normed)  # (b, q, 2, taps, h)
        attended = self.self_attn(block_conv(normed, kernels[:, :, 0], width), context, cos, sin, mask, cache,
                                  layer_idx, asked)  # (b, asked, h)
        x = x[:, asked] + block_conv(attended, kernels[:, asked, 1], width)
        normed = self.post_attention_layernorm(x)
        kernels = self.mlp_conv.kernels(normed)
        x = x + block_conv(self.mlp(block_conv(normed, kernels[:, :, 0], width)), kernels[:, :, 1], width)
        return x[:, queries]


class DrafterCache:
    """Keys/values of the injected context, per layer: only accepted tokens are ever kept here.

    Slots are shared across the batch; `valid` marks which slots hold a real token of that row (rows
    accept different numbers of tokens per step), `positions` holds each slot's sequence position. Keys live
    in `SlotBuffer`s, so a forward appends its new context and lays its block after it without copying the
    cache; `keys[i]` / `values[i]` read (b, kv_heads, slots, d) views.
    """

    def __init__(self, num_layers: int):
        self._keys = [SlotBuffer() for _ in range(num_layers)]
        self._values = [SlotBuffer() for _ in range(num_layers)]
        self.valid: torch.Tensor | None = None  # (b, slots) bool
        self.positions: torch.Tensor | None = None  # (b, slots) long

    @property
    def keys(self) -> list[torch.Tensor | None]:
        return [buffer.view for buffer in self._keys]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return [buffer.view for buffer in self._values]

    def set_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, length: int | None = None) -> None:
        """The layer's new storage, of which the first `length` slots (default: all) are filled."""
        self._keys[layer], self._values[layer] = SlotBuffer(keys, length), SlotBuffer(values, length)

    @property
    def num_slots(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def add_slots(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep context k/v (b, kv_heads, c, d) after the layer's cached slots."""
        self._keys[layer].append(k)
        self._values[layer].append(v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new context's k/v (b, kv_heads, c, d); returns [every context slot ; the block's k/v]."""
        return self._keys[layer].append(k, scratch=block_k), self._values[layer].append(v, scratch=block_v)

    def select_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows`: in place when they keep their order (a finished row leaving), as the target's
        cache does (`SlotBuffer.keep_rows`), else by copying them out."""
        in_place = rows == sorted(set(rows))
        for buffers in (self._keys, self._values):
            for i, buffer in enumerate(buffers):
                if buffer.view is None:
                    continue
                if in_place:
                    buffer.keep_rows(rows)
                else:
                    buffers[i] = SlotBuffer(buffer.view[rows])
        if self.valid is not None:
            self.valid, self.positions = self.valid[rows], self.positions[rows]

    def compact(self, index: torch.Tensor, new_valid: torch.Tensor) -> None:
        """Keep each row's slots `index` (b, s') in order (`slots.compaction_index`), into buffers with spare room
        (the next draft appends without copying them again)."""
        width = index.shape[1]
        room = spare_room(width)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.set_layer(layer, gather_slots(k, index, 2, room), gather_slots(v, index, 2, room), length=width)
        self.valid, self.positions = new_valid, self.positions.gather(1, index)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """A fresh drafter's weights for `module` and everything in it: Linear weights normal(0, std), norms ones;
    DFlash2's convolutions the identity and its selector the top-1 walk."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    for m in module.modules():
        if isinstance(m, GroupedDynamicConv):
            m.reset_to_identity()
        elif isinstance(m, CandidateSelector):
            m.init_weights(std)


class DFlashDraftModel(nn.Module):
    """Drafter modules with the public checkpoint's parameter names (no embedding, no LM head)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        unsupported = config.not_run_here()
        if unsupported:
            raise DrafterConfigError(f"this drafter {unsupported}, which dflash's drafter does not implement; serve "
                                     "it with vLLM (dflash serve --engine vllm hands the pair over)")
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = CastingLinear(config.num_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = hf_compat.rotary_embedding(config.qwen3_fields())
        # the target's LM head in this drafter's matmul dtype, for drafting (`cpu_precision`); None: the target's
        self.draft_head: torch.Tensor | None = None
        self.source: str | None = None  # the directory or hub id it was loaded from (`load_drafter`)
        if config.dflash2 is not None:
            self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.dflash2)

    def _apply(self, fn, recurse: bool = True):
        """Casts (`.to(bfloat16)`, `.half()`) leave the rotary frequencies in float32, as transformers keeps a
        target's: rounded to bfloat16 they turn a query and a key a few thousand positions apart by radians, so the
        drafter would rotate otherwise than it was trained (in float32) and than vLLM or SGLang rotate it."""
        frequencies = {name: b for name, b in self.rotary_emb.named_buffers(recurse=False) if b.is_floating_point()}
        super()._apply(fn, recurse)
        for name, kept in frequencies.items():  # the float32 values, moved to wherever `fn` moved the rounded ones
            moved = getattr(self.rotary_emb, name)
            if moved.dtype != kept.dtype:
                setattr(self.rotary_emb, name, kept.to(moved.device))
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's activations (its norms'), which its matrix products may not share."""
        return self.norm.weight.dtype

    @property
    def selector(self) -> CandidateSelector | None:
        """DFlash2's candidate selector; None for a DFlash drafter (each position's top-1 is its draft)."""
        return getattr(self, "candidate_selector", None)

    @classmethod
    def from_pretrained(cls, path_or_id: str, **kwargs) -> "DFlashDraftModel":
        from dflash.model.loading import load_drafter

        return load_drafter(path_or_id, **kwargs)

    def save_pretrained(self, directory: str) -> None:
        from dflash.model.loading import save_drafter

        save_drafter(self, directory)

    def init_weights(self, std: float = 0.02) -> None:
        init_weights(self, std)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features (b, c, len(target_layer_ids) * hidden) -> context (b, c, hidden)."""
        return self.hidden_norm(self.fc(features))

    def read_context(
        self,
        context: torch.Tensor,  # (b, c, h): projected context (`project_context`)
        context_positions: torch.Tensor,  # (b, c)
        context_valid: torch.Tensor,  # (b, c) bool
        cache: DrafterCache,
    ) -> None:
        """Keep the context's keys and values in `cache` without drafting a block. A layer's context keys come
        from the context alone, so the next forward drafts as if it had been given this context itself."""
        cache.add_slots(context_valid, context_positions)
        cos, sin = self.rotary_emb(context, context_positions)  # (b, c, d)
        for i, layer in enumerate(self.layers):
            cache.keep(i, *layer.self_attn.keys_values(context, cos, sin))

    def forward(
        self,
        block_embeds: torch.Tensor,  # (b, q, h): target embeddings of the block tokens
        block_positions: torch.Tensor,  # (b, q)
        context: torch.Tensor,  # (b, c, h): projected context of tokens new to this forward
        context_positions: torch.Tensor,  # (b, c)
        context_valid: torch.Tensor | None = None,  # (b, c) bool; default all valid
        cache: DrafterCache | None = None,
        attn_mask: torch.Tensor | None = None,  # (b, q, keys + q) bool; default: every valid key
        outputs: slice = slice(None),  # the block positions whose hidden states are wanted
        block_width: int | None = None,  # positions per block when q holds several (training); default q
    ) -> torch.Tensor:
        """Returns the final normed hidden states of the block's `outputs` positions, (b, wanted, h).

        Every position feeds the keys and values of every layer, but only the wanted ones need the last
        layer's queries, attention output and MLP: verifying k of a 16-wide draft skips them for the rest
        (the same values as the full forward's, sliced)."""
        b, q, _ = block_embeds.shape
        if context_valid is None:
            context_valid = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)
        if cache is not None:
            cache.add_slots(context_valid, context_positions)
            key_valid, key_positions = cache.valid, cache.positions
        else:
            key_valid, key_positions = context_valid, context_positions
        if attn_mask is None:
            block_valid = torch.ones(b, q, dtype=torch.bool, device=block_embeds.device)
            attn_mask = torch.cat([key_valid, block_valid], dim=1)[:, None, :].expand(b, q, -1)
        masks = self._layer_masks(attn_mask, key_positions, block_positions)
        cos, sin = self.rotary_emb(block_embeds, torch.cat([context_positions, block_positions], dim=1))
        hidden = block_embeds
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            queries = outputs if i == last else slice(None)
            hidden = layer(hidden, context, cos, sin, masks[i], cache, i, queries, block_width)
        return self.norm(hidden)

    def _layer_masks(self, attn_mask: torch.Tensor, key_positions: torch.Tensor,
                     block_positions: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's (b, q, keys + q) mask: `attn_mask`, narrowed to the layer's window and, for a causal
        layer, to the block positions up to each query's own (`DrafterConfig.layer_attention`)."""
        kinds = [self.config.layer_attention(i) for i in range(len(self.layers))]
        distance = None
        if any(kind.window or kind.causal for kind in kinds):
            all_positions = torch.cat([key_positions, block_positions], dim=1)  # (b, keys + q)
            distance = block_positions[:, :, None] - all_positions[:, None, :]  # (b, q, keys + q)
        masks = {}
        for kind in set(kinds):
            mask = attn_mask
            if kind.window:
                mask = mask & (distance < kind.window)
            if kind.causal:
                mask = mask & (distance >= 0)
            masks[kind] = mask
        return [masks[kind] for kind in kinds]
