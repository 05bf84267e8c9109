"""Ragged batches in a shared slot layout.

Rows of a batch accept different numbers of tokens per step. Instead of cropping each row's KV cache
to its own length, every row keeps the same number of slots and a `valid` mask (b, slots) hides the
slots of rejected tokens; attention never reads them. Compaction squeezes the holes out when they pile up,
and merging left-pads rows with invalid slots so that batches can join.
"""

from __future__ import annotations

import torch

from dflash.model import hf_compat
from dflash.model.slot_buffer import gather_slots, spare_room

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


def padded_width(tensors: list[torch.Tensor | None], dim: int) -> int:
    return max((t.shape[dim] for t in tensors if t is not None), default=0)


def pad_and_concat(tensors: list[torch.Tensor | None], batch_sizes: list[int], dim: int,
                   room: int = 0) -> torch.Tensor | None:
    """Left-pad each part with zero (= invalid) slots to the widest, then concatenate rows; written once into one
    allocation. With `room`, the result has that many more slots along `dim`, after the others and not written.

    A None part stands for rows that have no slots yet.
    """
    ref = next((t for t in tensors if t is not None), None)
    if ref is None:
        return None
    width = padded_width(tensors, dim)
    shape = list(ref.shape)
    shape[0], shape[dim] = sum(batch_sizes), width + room
    out = ref.new_empty(shape)
    start = 0
    for t, rows in zip(tensors, batch_sizes):
        part = out[start : start + rows]
        filled = 0 if t is None else t.shape[dim]
        part.narrow(dim, 0, width - filled).zero_()
        if filled:
            part.narrow(dim, width - filled, filled).copy_(t)
        start += rows
    return out


# ---- a transformers KV cache in this layout (the target's, a draft model's) ------------------------------
def worth_compacting(valid: torch.Tensor) -> bool:
    """valid (b, s): enough slots, and enough of them holes, to squeeze out."""
    return (valid.shape[1] >= COMPACT_MIN_SLOTS
            and valid.numel() - int(valid.sum()) >= COMPACT_HOLE_SHARE * valid.numel())


def has_gaps(valid: torch.Tensor) -> bool:
    """valid (b, s): whether some row has an invalid slot after a valid one (left padding alone is no gap)."""
    return bool((valid[:, 1:] < valid[:, :-1]).any())


def compact_cache(cache, valid: torch.Tensor) -> torch.Tensor:
    """Squeeze every row's holes out of `cache` into tensors with spare room (the next step appends without
    copying them again); returns the new valid mask."""
    index, new_valid = compaction_index(valid)
    width = index.shape[1]
    room = spare_room(width)
    hf_compat.set_cache_tensors(cache, [(gather_slots(k, index, 2, room), gather_slots(v, index, 2, room))
                                        for k, v in hf_compat.cache_tensors(cache)], length=width)
    return new_valid


def select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep the rows `rows` (indices) of `cache`: in place when its layers grow in place and the rows keep their
    order (a finished row leaving: the rows after it move up), else by copying the kept rows out."""
    if hf_compat.keep_cache_rows_in_place(cache, rows.tolist()):
        return
    hf_compat.set_cache_tensors(cache, [(k[rows], v[rows]) for k, v in hf_compat.cache_tensors(cache)])


def merge_caches(caches: list, batch_sizes: list[int]) -> object:
    """The rows of all `caches` in the first non-empty one, slots left-padded to equal width, with spare room
    (the next step appends without copying them again); a None cache stands for rows with no slots yet."""
    layers = [None if c is None else hf_compat.cache_tensors(c) for c in caches]
    first = next(i for i, kv in enumerate(layers) if kv is not None)
    width = padded_width([kv[0][0] for kv in layers if kv is not None], 2)
    room = spare_room(width)
    hf_compat.set_cache_tensors(caches[first], [
        tuple(pad_and_concat([None if kv is None else kv[i][j] for kv in layers], batch_sizes, 2, room)
              for j in (0, 1))
        for i in range(len(layers[first]))
    ], length=width)
    return caches[first]
