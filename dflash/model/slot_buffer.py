"""A KV tensor that grows along its slot dimension by writing into spare room, not by concatenation.

Concatenating a step's new keys onto a KV cache copies the whole cache on every forward. At 8 rows x ~400
slots on a 2-core CPU those copies were a quarter of a decode step (`benchmarks/batched_step.py
--profile 8x2`). A `SlotBuffer` keeps its slots in a larger allocation and hands out views of the filled part;
only growing past the allocation copies, and it then reserves an eighth more (at least 64 slots): copies
stay rare, and a long context holds at most ~12% of unused KV memory.
"""

from __future__ import annotations

import torch

SLOT_DIM = 2  # tensors are (batch, heads, slots, head_dim)
_MIN_RESERVE = 64  # slots reserved beyond the need when the buffer grows


def spare_room(slots: int) -> int:
    """The unwritten slots to allocate past `slots` filled ones: an eighth more, at least `_MIN_RESERVE`."""
    return max(slots // 8, _MIN_RESERVE)


def gather_slots(tensor: torch.Tensor, index: torch.Tensor, dim: int, room: int = 0) -> torch.Tensor:
    """Pick slots per row: tensor has batch at dim 0 and slots at `dim`; index (b, s'). With `room`, the result
    has that many more slots along `dim`, after the picked ones and not written."""
    shape = [index.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = index.shape[1]
    expanded = index.view(shape).expand(*[s if i != dim else index.shape[1] for i, s in enumerate(tensor.shape)])
    if not room:
        return torch.gather(tensor, dim, expanded)
    out = tensor.new_empty(*[s if i != dim else index.shape[1] + room for i, s in enumerate(expanded.shape)])
    torch.gather(tensor, dim, expanded, out=out.narrow(dim, 0, index.shape[1]))
    return out


class SlotBuffer:
    def __init__(self, tensor: torch.Tensor | None = None, length: int | None = None):
        """Hold `tensor` (b, heads, capacity, d), of which the first `length` slots (default: all) are filled
        and the rest are spare room (`spare_room`, left by a merge or a compaction)."""
        self._data = tensor
        self.length = 0 if tensor is None else tensor.shape[SLOT_DIM] if length is None else length

    @property
    def capacity(self) -> int:
        return 0 if self._data is None else self._data.shape[SLOT_DIM]

    @property
    def view(self) -> torch.Tensor | None:
        """The filled slots, (b, heads, length, d): a view, valid until the buffer is written again."""
        return None if self._data is None else self._data[:, :, : self.length]

    def _room_for(self, new: torch.Tensor, slots: int) -> None:
        """Make the allocation hold `slots` slots shaped like `new`, keeping the filled ones."""
        if self._data is not None and slots <= self.capacity:
            return
        b, heads, _, d = new.shape
        data = new.new_empty(b, heads, slots + spare_room(slots), d)
        if self.length:
            data[:, :, : self.length] = self._data[:, :, : self.length]
        self._data = data

    def append(self, new: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Add `new` (b, heads, n, d) after the filled slots; returns a view of every filled slot.

        `scratch` (b, heads, m, d), if given, is written after them without being kept (the next write goes
        over it) and is part of the returned view: keys a forward attends to but the cache must not hold.
        """
        n, m = new.shape[SLOT_DIM], 0 if scratch is None else scratch.shape[SLOT_DIM]
        self._room_for(new, self.length + n + m)
        self._data[:, :, self.length : self.length + n] = new
        self.length += n
        if scratch is None:
            return self.view
        self._data[:, :, self.length : self.length + m] = scratch
        return self._data[:, :, : self.length + m]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (ascending) in place: each moves up over a dropped one. Only the rows after a
        dropped one are copied, nothing is allocated, and the spare room stays for the next appends."""
        with torch.inference_mode(self._data.is_inference()):  # a cache written under inference mode
            for i, row in enumerate(rows):
                if i != row:
                    self._data[i, :, : self.length] = self._data[row, :, : self.length]
            self._data = self._data[: len(rows)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` slots."""
        self.length = min(self.length, max(length, 0))
