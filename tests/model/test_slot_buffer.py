import torch

from dflash.model.slot_buffer import SlotBuffer


def kv(b=2, slots=3, seed=0):
    torch.manual_seed(seed)
    return torch.randn(b, 2, slots, 4)


def test_appends_read_as_the_concatenation_and_grow_without_losing_slots():
    buffer, pieces = SlotBuffer(), []
    for i, n in enumerate([5, 1, 1, 70, 3, 200]):  # crosses several reallocations
        piece = kv(slots=n, seed=i)
        pieces.append(piece)
        view = buffer.append(piece)
        assert torch.equal(view, torch.cat(pieces, dim=2))
    assert buffer.length == 280 and buffer.capacity >= 280


def test_growth_reserves_room_so_most_appends_do_not_reallocate():
    buffer = SlotBuffer()
    buffer.append(kv(slots=100))
    reallocations, data = 0, buffer._data
    for i in range(100):
        buffer.append(kv(slots=2, seed=i))
        reallocations += buffer._data is not data
        data = buffer._data
    assert reallocations <= 3


def test_scratch_is_attended_but_not_kept():
    buffer = SlotBuffer()
    kept, scratch = kv(slots=4), kv(slots=3, seed=1)
    view = buffer.append(kept, scratch=scratch)
    assert torch.equal(view, torch.cat([kept, scratch], dim=2))
    assert buffer.length == 4 and torch.equal(buffer.view, kept)
    more = kv(slots=2, seed=2)
    assert torch.equal(buffer.append(more), torch.cat([kept, more], dim=2))  # written over the scratch


def test_truncate_keeps_a_prefix_and_later_appends_follow_it():
    buffer = SlotBuffer(kv(slots=6))
    start = buffer.view.clone()
    buffer.truncate(4)
    new = kv(slots=1, seed=3)
    assert torch.equal(buffer.append(new), torch.cat([start[:, :, :4], new], dim=2))
