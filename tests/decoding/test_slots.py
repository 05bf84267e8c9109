"""The slot layout of ragged batches: which holes compaction squeezes out, and what it keeps."""

from __future__ import annotations

import torch

from dflash.decoding.slots import compact_cache, compaction_index, has_gaps, merge_caches, pad_and_concat
from dflash.model.hf_compat import GrowingLayer


def test_left_padding_is_no_gap_but_a_hole_after_a_token_is():
    padded = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert not has_gaps(padded)
    assert has_gaps(torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool))  # a rejected token's slot
    assert has_gaps(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))  # at the end of a row


def test_compaction_keeps_each_rows_tokens_in_order_right_aligned():
    valid = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    index, new_valid = compaction_index(valid)
    assert new_valid.tolist() == [[False, True, True, True], [True, True, True, True]]
    assert [row[keep].tolist() for row, keep in zip(index, new_valid)] == [[0, 2, 4], [1, 2, 3, 4]]
    assert not valid.gather(1, index)[~new_valid].any()  # the padding in front is an old hole
    assert not has_gaps(new_valid)


def growing_cache(rows: int, slots: int, seed: int):
    from transformers import DynamicCache

    torch.manual_seed(seed)
    cache = DynamicCache()
    cache.layers = [GrowingLayer(), GrowingLayer()]
    for layer in cache.layers:
        layer.update(torch.randn(rows, 2, slots, 4), torch.randn(rows, 2, slots, 4))
    return cache


def appends_in_place(cache) -> bool:
    """Whether the next step's keys go into the cache's spare room (no layer reallocates)."""
    before = [layer._keys._data.data_ptr() for layer in cache.layers]
    for layer in cache.layers:
        rows = layer.keys.shape[0]
        layer.update(torch.randn(rows, 2, 3, 4), torch.randn(rows, 2, 3, 4))
    return [layer._keys._data.data_ptr() for layer in cache.layers] == before


def test_padding_and_concatenating_left_pads_with_invalid_slots_and_can_leave_room():
    a, b = torch.ones(1, 2, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)
    assert pad_and_concat([a, None, b], [1, 1, 2], 1).tolist() == [[False, True, True], [False] * 3,
                                                                    [True] * 3, [True] * 3]
    roomy = pad_and_concat([a, None, b], [1, 1, 2], 1, room=4)
    assert roomy.shape == (4, 7) and torch.equal(roomy[:, :3], pad_and_concat([a, None, b], [1, 1, 2], 1))


def test_merged_and_compacted_caches_keep_spare_room_for_the_next_step():
    """Merging and compacting wrote exactly-sized tensors, so the next step copied the whole cache again."""
    first, second = growing_cache(2, 9, seed=0), growing_cache(1, 5, seed=1)
    expected = [pad_and_concat([k1, k2], [2, 1], 2) for (k1, _), (k2, _) in
                zip([(la.keys, la.values) for la in first.layers], [(la.keys, la.values) for la in second.layers])]
    merged = merge_caches([first, None, second], [2, 1, 1])
    for layer, keys in zip(merged.layers, expected):
        assert torch.equal(layer.keys[[0, 1, 3]], keys) and not layer.keys[2].any()
    assert appends_in_place(merged)

    valid = torch.rand(4, 12) > 0.4
    valid[:, -3:] = True
    index, new_valid = compaction_index(valid)
    squeezed = [layer.keys.gather(2, index[:, None, :, None].expand(-1, 2, -1, 4)) for layer in merged.layers]
    assert torch.equal(compact_cache(merged, valid), new_valid)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(merged.layers, squeezed))
    assert appends_in_place(merged)


def test_a_cache_of_transformers_own_layers_is_merged_to_the_exact_width():
    """Layers that cannot keep spare room (transformers' own) get the merged slots without it."""
    from transformers import DynamicCache

    torch.manual_seed(2)
    caches, parts = [], []
    for rows, slots in ((2, 6), (1, 4)):
        cache = DynamicCache()
        k, v = torch.randn(rows, 2, slots, 4), torch.randn(rows, 2, slots, 4)
        cache.update(k, v, 0)
        caches.append(cache)
        parts.append((k, v))
    merged = merge_caches(caches, [2, 1])
    keys, values = merged.layers[0].keys, merged.layers[0].values
    assert not isinstance(merged.layers[0], GrowingLayer)
    assert keys.shape == (3, 2, 6, 4) and merged.get_seq_length() == 6
    assert torch.equal(keys, pad_and_concat([parts[0][0], parts[1][0]], [2, 1], 2))
    assert torch.equal(values, pad_and_concat([parts[0][1], parts[1][1]], [2, 1], 2))
