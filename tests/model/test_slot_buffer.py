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


def test_keeping_rows_moves_them_up_in_place_and_keeps_the_room():
    """A finished row leaving copied every kept row out and left no room, so the next append copied them again."""
    buffer = SlotBuffer()
    whole = kv(b=5, slots=40)
    buffer.append(whole)
    storage, capacity = buffer._data.data_ptr(), buffer.capacity
    buffer.keep_rows([0, 2, 3])
    assert torch.equal(buffer.view, whole[[0, 2, 3]])
    assert buffer._data.data_ptr() == storage and buffer.capacity == capacity  # nothing allocated
    more = kv(b=3, slots=2, seed=1)
    assert torch.equal(buffer.append(more), torch.cat([whole[[0, 2, 3]], more], dim=2))
    assert buffer._data.data_ptr() == storage  # the room was still there


def test_a_cache_keeps_rows_in_place_only_when_they_keep_their_order():
    from transformers import DynamicCache

    from dflash.decoding.slots import select_cache_rows
    from dflash.model.hf_compat import GrowingLayer

    def cache():
        c = DynamicCache()
        c.layers = [GrowingLayer(), GrowingLayer()]
        for i, layer in enumerate(c.layers):
            layer.update(kv(b=4, slots=9, seed=i), kv(b=4, slots=9, seed=10 + i))
        return c

    kept = cache()
    before = [(layer.keys.clone(), layer.values.clone(), layer.keys.data_ptr()) for layer in kept.layers]
    select_cache_rows(kept, torch.tensor([1, 3]))
    for layer, (k, v, storage) in zip(kept.layers, before):
        assert torch.equal(layer.keys, k[[1, 3]]) and torch.equal(layer.values, v[[1, 3]])
        assert layer.keys.data_ptr() == storage
    swapped = cache()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in swapped.layers]
    select_cache_rows(swapped, torch.tensor([3, 0]))  # out of order: copied out, still right
    for layer, (k, v) in zip(swapped.layers, before):
        assert torch.equal(layer.keys, k[[3, 0]]) and torch.equal(layer.values, v[[3, 0]])
