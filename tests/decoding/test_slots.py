"""The slot layout of ragged batches: which holes compaction squeezes out, and what it keeps."""

from __future__ import annotations

import torch

from dflash.decoding.slots import compaction_index, has_gaps


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
