import torch

from conftest import tiny_drafter
from dflash.model.drafter import DrafterCache


def block_inputs(drafter, b=1, ctx=9, q=8, seed=0):
    torch.manual_seed(seed)
    h = drafter.config.hidden_size
    return (torch.randn(b, q, h), torch.arange(ctx, ctx + q).repeat(b, 1),
            torch.randn(b, ctx, drafter.config.num_features), torch.arange(ctx).repeat(b, 1))


def test_context_injected_in_pieces_through_the_cache_equals_all_at_once(target):
    drafter = tiny_drafter(target, layers=2)
    embeds, positions, features, ctx_positions = block_inputs(drafter)
    context = drafter.project_context(features)
    full = drafter(embeds, positions, context, ctx_positions)
    cache = DrafterCache(2)
    drafter(embeds, positions, context[:, :4], ctx_positions[:, :4], cache=cache)  # an earlier step's draft
    pieced = drafter(embeds, positions, context[:, 4:], ctx_positions[:, 4:], cache=cache)
    assert torch.allclose(full, pieced, atol=1e-5)
    assert cache.num_slots == 9  # only context is cached, never the block


def test_context_read_ahead_into_the_cache_drafts_as_if_given_to_the_forward(target):
    """`read_context` keeps a prompt's keys without drafting (a prefill), so a row joining a batch does not make
    the batch's next draft read its prompt padded to every row."""
    drafter = tiny_drafter(target, layers=2)
    embeds, positions, features, ctx_positions = block_inputs(drafter, b=2)
    context = drafter.project_context(features)
    full = drafter(embeds, positions, context, ctx_positions)
    cache = DrafterCache(2)
    drafter.read_context(context[:, :6], ctx_positions[:, :6], torch.ones(2, 6, dtype=torch.bool), cache)
    assert cache.num_slots == 6 and all(k.shape[2] == 6 for k in cache.keys)
    ahead = drafter(embeds, positions, context[:, 6:], ctx_positions[:, 6:], cache=cache)
    assert torch.allclose(full, ahead, atol=1e-5)
    empty = DrafterCache(2)  # guards the check: without the read-ahead context the draft differs
    assert not torch.allclose(full, drafter(embeds, positions, context[:, 6:], ctx_positions[:, 6:], cache=empty),
                              atol=1e-3)


def test_the_context_cache_drops_rows_in_place_and_compacts_into_spare_room(target):
    """As the target's cache does: a finished row leaves without copying the kept ones, and a compaction leaves
    room, so the next draft's context is written in place (both rebuilt exactly-sized buffers before)."""
    from dflash.decoding.slots import compaction_index

    drafter = tiny_drafter(target, layers=2)
    _, _, features, positions = block_inputs(drafter, b=3, ctx=12)
    valid = torch.rand(3, 12, generator=torch.Generator().manual_seed(0)) > 0.5
    valid[:, -2:] = True
    cache = DrafterCache(2)
    with torch.no_grad():  # as decoding runs it
        drafter.read_context(drafter.project_context(features), positions, valid, cache)
    keys, storage = cache.keys[0].clone(), cache._keys[0]._data.data_ptr()
    cache.select_rows([0, 2])
    assert torch.equal(cache.keys[0], keys[[0, 2]]) and torch.equal(cache.valid, valid[[0, 2]])
    assert cache._keys[0]._data.data_ptr() == storage
    index, new_valid = compaction_index(cache.valid)
    expected = keys[[0, 2]].gather(2, index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3]))
    cache.compact(index, new_valid)
    assert torch.equal(cache.keys[0], expected) and torch.equal(cache.valid, new_valid)
    assert torch.equal(cache.positions, positions[[0, 2]].gather(1, index))
    storage = cache._keys[0]._data.data_ptr()
    cache.keep(0, torch.zeros(2, keys.shape[1], 3, keys.shape[3]), torch.zeros(2, keys.shape[1], 3, keys.shape[3]))
    assert cache._keys[0]._data.data_ptr() == storage  # the room was there


def test_invalid_context_slots_are_ignored(target):
    drafter = tiny_drafter(target)
    embeds, positions, features, ctx_positions = block_inputs(drafter)
    context = drafter.project_context(features)
    valid = torch.ones(1, 9, dtype=torch.bool)
    valid[0, 3] = False
    noisy = context.clone()
    noisy[0, 3] += 5.0
    a = drafter(embeds, positions, context, ctx_positions, context_valid=valid)
    b = drafter(embeds, positions, noisy, ctx_positions, context_valid=valid)
    assert torch.allclose(a, b, atol=1e-6)


def test_attention_within_a_block_is_bidirectional(target):
    drafter = tiny_drafter(target)
    embeds, positions, features, ctx_positions = block_inputs(drafter)
    context = drafter.project_context(features)
    changed = embeds.clone()
    changed[0, -1] += 1.0  # the last block token
    a = drafter(embeds, positions, context, ctx_positions)
    b = drafter(changed, positions, context, ctx_positions)
    assert not torch.allclose(a[0, 0], b[0, 0])  # the first position sees the last one


def test_grouped_attention_equals_attention_over_repeated_heads():
    import torch.nn.functional as F

    from dflash.model.drafter import grouped_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    mask = torch.rand(2, 1, 5, 11) > 0.4
    mask[..., 0] = True
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                               attn_mask=mask)
    assert torch.allclose(grouped_attention(q, k, v, mask), reference, atol=1e-5)


def test_asking_only_for_some_positions_gives_their_values_of_the_full_forward(target):
    drafter = tiny_drafter(target, layers=2)
    embeds, positions, features, ctx_positions = block_inputs(drafter, b=2)
    context = drafter.project_context(features)
    full = drafter(embeds, positions, context, ctx_positions)  # (2, 8, h)
    for wanted in (slice(1, 4), slice(1, 8), slice(0, 1)):
        part = drafter(embeds, positions, context, ctx_positions, outputs=wanted)
        assert part.shape == full[:, wanted].shape
        assert torch.allclose(part, full[:, wanted], atol=1e-5)
    changed = embeds.clone()
    changed[:, -1] += 1.0  # a position left out of the output still feeds the ones asked for
    assert not torch.allclose(drafter(changed, positions, context, ctx_positions, outputs=slice(1, 4)),
                              full[:, 1:4], atol=1e-5)


def test_casting_the_drafter_keeps_its_rotary_frequencies_in_float32(target, tmp_path):
    """`.to(bfloat16)` (how a drafter loads in a bfloat16 target's dtype) rounded the rotary frequencies, which
    turned positions thousands of tokens apart by radians; they stay float32, as transformers keeps a target's."""
    from dflash.model.loading import load_drafter

    drafter = tiny_drafter(target)
    exact = {name: b.clone() for name, b in drafter.rotary_emb.named_buffers()}
    assert "inv_freq" in exact and all(b.dtype == torch.float32 for b in exact.values())
    drafter.save_pretrained(str(tmp_path / "d"))
    for cast in (load_drafter(tmp_path / "d", dtype=torch.bfloat16), drafter.half(), drafter.to(torch.bfloat16)):
        assert cast.norm.weight.dtype in (torch.bfloat16, torch.float16)  # the weights were cast
        for name, b in cast.rotary_emb.named_buffers():
            assert b.dtype == torch.float32 and torch.equal(b, exact[name]), name
        positions = torch.tensor([[4000]])
        x = torch.zeros(1, 1, 16, dtype=cast.norm.weight.dtype)
        cos, _ = cast.rotary_emb(x, positions)
        angles = positions[0, 0].double() * exact["inv_freq"].double()
        assert torch.allclose(cos[0, 0, :8].double(), angles.cos(), atol=1e-2)  # (rounded to bfloat16 at the end)
