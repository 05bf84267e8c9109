import copy

import pytest
import torch

from conftest import tiny_target_model
from dflash.model import hf_compat
from dflash.model.target import TargetModel


def test_grouped_query_attention_matches_transformers_sdpa_under_a_mask():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = torch.randn(3, 4, 5, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.rand(3, 1, 5, 9) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    ours, _ = hf_compat._sdpa_with_gqa(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_switched_to_shared_kv_attention_gives_the_same_logits_with_holes(family):
    reference = tiny_target_model(family)
    target = TargetModel(copy.deepcopy(reference))
    assert target.model.config._attn_implementation == "sdpa_shared_kv"
    assert reference.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 2] = 0  # a hole, as a ragged batch has after a rejected draft
    cache = target.new_cache()
    ours = target.forward(ids, torch.arange(7).repeat(2, 1), cache, attention_mask=mask).logits
    theirs = reference(input_ids=ids, attention_mask=mask, position_ids=torch.arange(7).repeat(2, 1)).logits
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_growing_cache_layers_follow_appends_crops_and_row_selection():
    model = tiny_target_model("qwen3")
    cache = hf_compat.new_dynamic_cache(model.config)
    assert all(isinstance(layer, hf_compat.GrowingLayer) for layer in cache.layers)
    target = TargetModel(model)
    ids = torch.randint(0, 100, (2, 12))
    positions = torch.arange(12).repeat(2, 1)
    target.forward(ids[:, :5], positions[:, :5], cache)
    target.forward(ids[:, 5:9], positions[:, 5:9], cache)
    hf_compat.crop_cache(cache, 7)  # drop 2 slots: a rejected draft
    out = target.forward(ids[:, 7:12], positions[:, 7:12], cache)
    full = target.forward(ids, positions, target.new_cache())
    assert hf_compat.cache_length(cache) == 12
    assert torch.allclose(out.logits, full.logits[:, 7:], atol=1e-4)
    # rows selected by assigning the layer tensors, then decoding goes on
    hf_compat.set_cache_tensors(cache, [(k[1:], v[1:]) for k, v in hf_compat.cache_tensors(cache)])
    nxt = target.forward(torch.tensor([[3]]), torch.tensor([[12]]), cache).logits
    ref = target.forward(torch.cat([ids[1:], torch.tensor([[3]])], 1), torch.arange(13)[None], target.new_cache())
    assert torch.allclose(nxt[0, -1], ref.logits[0, -1], atol=1e-4)
