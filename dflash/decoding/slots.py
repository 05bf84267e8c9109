"""Ragged batches in a shared slot layout.

Rows of a batch accept different numbers of tokens per step. Instead of cropping each row's KV cache
to its own length, every row keeps the same number of slots and a `valid` mask (b, slots) hides the
slots of rejected tokens; attention never reads them. Compaction squeezes the holes out when they pile up,
and merging left-pads rows with invalid slots so that batches can join.
"""

from __future__ import annotations

import torch

from dflash.model import hf_compat

# Compact a cache once this share of its slots are holes (and it has at least this many slots).
COMPACT_HOLE_SHARE = 0.5
COMPACT_MIN_SLOTS = 64


def compaction_index(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """valid (b, s) -> (index (b, s'), new_valid (b, s')) keeping each row's valid slots, right-aligned, in order."""
    counts = valid.sum(dim=1)
    width = int(counts.max())
    order = torch.sort(valid.int(), dim=1, stable=True).indices  # invalid slots first, then valid, order kept
    index = order[:, valid.shape[1] - width:]
    new_valid = torch.arange(width, device=valid.device)[None, :] >= (width - counts)[:, None]
    return index, new_valid


def gather_slots(tensor: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Pick slots per row: tensor has batch at dim 0 and slots at `dim`; index (b, s')."""
    shape = [index.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = index.shape[1]
    expanded = index.view(shape).expand(*[s if i != dim else index.shape[1] for i, s in enumerate(tensor.shape)])
    return torch.gather(tensor, dim, expanded)


def pad_and_concat(tensors: list[torch.Tensor | None], batch_sizes: list[int], dim: int) -> torch.Tensor | None:
    """Left-pad each part with zero (= invalid) slots to the widest, then concatenate rows.

    A None part stands for rows that have no slots yet.
    """
    ref = next((t for t in tensors if t is not None), None)
    if ref is None:
        return None
    width = max(t.shape[dim] for t in tensors if t is not None)
    parts = []
    for t, rows in zip(tensors, batch_sizes):
        if t is None:
            shape = list(ref.shape)
            shape[0], shape[dim] = rows, 0
            t = ref.new_zeros(shape)
        missing = width - t.shape[dim]
        if missing:
            shape = list(t.shape)
            shape[dim] = missing
            t = torch.cat([t.new_zeros(shape), t], dim=dim)
        parts.append(t)
    return torch.cat(parts, dim=0)


# ---- a transformers KV cache in this layout (the target's, a draft model's) ------------------------------
def worth_compacting(valid: torch.Tensor) -> bool:
    """valid (b, s): enough slots, and enough of them holes, to squeeze out."""
    return (valid.shape[1] >= COMPACT_MIN_SLOTS
            and valid.numel() - int(valid.sum()) >= COMPACT_HOLE_SHARE * valid.numel())


def has_gaps(valid: torch.Tensor) -> bool:
    """valid (b, s): whether some row has an invalid slot after a valid one (left padding alone is no gap)."""
    return bool((valid[:, 1:] < valid[:, :-1]).any())


def compact_cache(cache, valid: torch.Tensor) -> torch.Tensor:
    """Squeeze every row's holes out of `cache`; returns the new valid mask."""
    index, new_valid = compaction_index(valid)
    hf_compat.set_cache_tensors(cache, [(gather_slots(k, index, 2), gather_slots(v, index, 2))
                                        for k, v in hf_compat.cache_tensors(cache)])
    return new_valid


def select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep the rows `rows` (indices) of `cache`: in place when its layers grow in place and the rows keep their
    order (a finished row leaving: the rows after it move up), else by copying the kept rows out."""
    if hf_compat.keep_cache_rows_in_place(cache, rows.tolist()):
        return
    hf_compat.set_cache_tensors(cache, [(k[rows], v[rows]) for k, v in hf_compat.cache_tensors(cache)])


def merge_caches(caches: list, batch_sizes: list[int]) -> object:
    """The rows of all `caches` in the first non-empty one, slots left-padded to equal width; a None cache
    stands for rows with no slots yet."""
    layers = [None if c is None else hf_compat.cache_tensors(c) for c in caches]
    first = next(i for i, kv in enumerate(layers) if kv is not None)
    hf_compat.set_cache_tensors(caches[first], [
        tuple(pad_and_concat([None if kv is None else kv[i][j] for kv in layers], batch_sizes, 2) for j in (0, 1))
        for i in range(len(layers[first]))
    ])
    return caches[first]
