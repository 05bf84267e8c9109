import copy
import json

import pytest
import torch

from conftest import FAMILIES, MORE_FAMILIES, REFUSED_FAMILIES, tiny_target_config, tiny_target_model
from dflash.model import hf_compat
from dflash.model.config import DrafterConfig
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
    switched = hf_compat.sdpa_reads_shared_heads(torch.device("cpu"))  # torch >= 2.5 (`enable_gqa`)
    assert target.model.config._attn_implementation == ("sdpa_shared_kv" if switched else "sdpa")
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


def test_a_crop_to_no_slots_empties_the_cache_and_a_crop_of_zero_follows_each_versions_meaning():
    """transformers 4 reads crop(0) as "keep none", 5 as "drop none"; `crop_cache` passes a count to drop."""
    model = tiny_target_model("qwen3")
    target, cache = TargetModel(model), hf_compat.new_dynamic_cache(model.config)
    ids = torch.randint(0, 100, (1, 6))
    target.forward(ids, torch.arange(6)[None], cache)
    hf_compat.crop_cache(cache, 0)
    assert hf_compat.cache_length(cache) == 0
    out = target.forward(ids[:, :3], torch.arange(3)[None], cache)  # decodes anew from an empty cache
    assert torch.allclose(out.logits, target.forward(ids[:, :3], torch.arange(3)[None], target.new_cache()).logits,
                          atol=1e-5)
    layer = cache.layers[0]
    layer.crop(-1)
    assert layer.keys.shape[-2] == 2
    layer.crop(0)
    assert layer.keys.shape[-2] == (2 if hf_compat.TRANSFORMERS_MAJOR >= 5 else 0)


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES + REFUSED_FAMILIES)
def test_rollback_problem_names_the_layers_that_cannot_be_rolled_back(family):
    problem = hf_compat.rollback_problem(tiny_target_config(family, layers=2))
    if family in REFUSED_FAMILIES:
        assert problem is not None and problem.startswith("layers [0")
    else:
        assert problem is None


def test_sliding_layers_keep_every_slot_so_a_crop_past_the_window_rolls_back():
    target = TargetModel(tiny_target_model("qwen2", layers=2))  # a full, then a sliding layer
    cache = target.new_cache()
    assert [type(layer) for layer in cache.layers] == [hf_compat.GrowingLayer, hf_compat.SlidingGrowingLayer]
    ids = torch.randint(0, 100, (1, 30))
    positions = torch.arange(30)[None]
    target.forward(ids[:, :24], positions[:, :24], cache)  # 24 slots: three windows
    hf_compat.crop_cache(cache, 13)  # a rejected draft of 11 tokens
    out = target.forward(ids[:, 13:30], positions[:, 13:30], cache)
    full = target.forward(ids, positions, target.new_cache())
    assert torch.allclose(out.logits, full.logits[:, 13:], atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text"])  # all sliding; eager + alternating; sdpa
def test_sliding_windows_are_drawn_by_position_across_holes(family):
    """Row 0 has 4 slots of a rejected draft before its next block, row 1 left padding and 3 such slots: every
    query still sees the last `window` tokens of its own row (counted by position, not by slot)."""
    target = TargetModel(tiny_target_model(family, layers=2))
    torch.manual_seed(0)
    real = torch.randint(0, 100, (2, 20))  # each row's tokens; row 1 has only 17
    junk = torch.randint(0, 100, (2, 4))
    # slots before the block: row 0 = 15 tokens + 4 rejected; row 1 = 4 padding + 12 tokens + 3 rejected
    slots = torch.stack([torch.cat([real[0, :15], junk[0]]), torch.cat([junk[1], real[1, :12], junk[1, :3]])])
    slot_positions = torch.tensor([list(range(19)), [0] * 4 + list(range(15))])
    valid = torch.ones(2, 19, dtype=torch.long)
    valid[0, 15:] = 0
    valid[1, :4] = valid[1, 16:] = 0
    cache = target.new_cache()
    prefill_mask = valid.clone()
    prefill_mask[:, 15:] = 1  # the rejected draft tokens were being verified when they were written
    target.forward(slots, slot_positions, cache, attention_mask=prefill_mask)
    block = torch.stack([real[0, 15:20], real[1, 12:17]])  # (2, 5)
    block_positions = torch.stack([torch.arange(15, 20), torch.arange(12, 17)])
    out = target.forward(block, block_positions, cache, attention_mask=torch.cat([valid, torch.ones(2, 5).long()], 1))
    for row, length in ((0, 20), (1, 17)):
        alone = target.forward(real[row : row + 1, :length], torch.arange(length)[None], target.new_cache())
        assert torch.allclose(out.logits[row], alone.logits[0, -5:], atol=1e-4), row


def test_mask_makers_of_both_transformers_signatures_get_the_new_tokens_slots():
    """transformers 5's mask makers take the query count and offset; 4.57's take the queries' slot indices
    (`cache_position`). Both must be asked for the last q of the slots, with nothing of the other signature."""
    calls = {}

    def maker_5(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, **kwargs):
        calls["5"] = dict(q_length=q_length, q_offset=q_offset, kv_length=kv_length, kv_offset=kv_offset, **kwargs)
        return "mask 5"

    def maker_4(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None, **kwargs):
        calls["4"] = dict(cache_position=cache_position.tolist(), kv_length=kv_length, kv_offset=kv_offset, **kwargs)
        return "mask 4"

    assert hf_compat._call_mask_maker(maker_5, 3, 10, batch_size=2, device=torch.device("cpu")) == "mask 5"
    assert hf_compat._call_mask_maker(maker_4, 3, 10, batch_size=2, device=torch.device("cpu")) == "mask 4"
    assert calls["5"] == dict(q_length=3, q_offset=7, kv_length=10, kv_offset=0, device=torch.device("cpu"))
    assert calls["4"] == dict(cache_position=[7, 8, 9], kv_length=10, kv_offset=0, device=torch.device("cpu"))


@pytest.mark.skipif(not hf_compat.MASK_MAKERS_SEE_ROWS, reason="transformers' makers see rows only on torch >= 2.6")
@pytest.mark.parametrize("maker_name", ["sdpa_mask", "eager_mask"])
def test_masks_made_here_on_older_torch_are_what_transformers_makes(maker_name):
    """On torch < 2.6 the ragged and tree masks are made by `_dense_mask`: here, where transformers' own maker
    can tell rows apart, both must give the same mask for a mask function that differs by row."""
    from transformers import masking_utils

    make_mask = getattr(masking_utils, maker_name)
    valid = torch.tensor([[1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # holes
    positions = valid.long().cumsum(-1) - 1
    kwargs = dict(batch_size=2, mask_function=hf_compat._causal_by_position(positions, 3), attention_mask=valid,
                  allow_is_causal_skip=False, use_vmap=False, dtype=torch.float32, device=torch.device("cpu"),
                  config=tiny_target_config("qwen3"))
    theirs = hf_compat._call_mask_maker(make_mask, 4, 7, **kwargs)
    ours = hf_compat._dense_mask(hf_compat._mask_kind(make_mask), 4, 7, **kwargs)
    assert hf_compat._mask_kind(make_mask) == ("bool" if maker_name == "sdpa_mask" else "additive")
    assert ours.shape == (2, 1, 4, 7) and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours[0], ours[1])  # the rows do differ


@pytest.mark.parametrize("family", MORE_FAMILIES + FAMILIES)
def test_a_drafter_for_every_family_gets_one_kind_of_rope(family):
    """Gemma3 keeps its rope settings per layer kind; the drafter's layers are all full attention."""
    from dflash.model.drafter import DFlashDraftModel
    from dflash.training.config import TrainConfig
    from dflash.training.drafter_setup import drafter_config_for

    target = TargetModel(tiny_target_model(family))
    config = drafter_config_for(target, TrainConfig(target="t", data="d.jsonl", output="o", block_size=4), 0)
    fields = hf_compat.rope_fields(target.config)
    if isinstance(getattr(target.config, "rope_parameters", None), dict) and "full_attention" in (
            target.config.rope_parameters):
        assert fields["rope_parameters"] == target.config.rope_parameters["full_attention"]
    drafter = DFlashDraftModel(config)  # builds its rotary embedding from those fields
    cos, _ = drafter.rotary_emb(torch.zeros(1, 3, config.hidden_size), torch.arange(3)[None])
    assert cos.shape == (1, 3, config.head_dim)
    saved = config.to_dict()  # what vLLM and SGLang read: the whole head rotates, as in training
    assert "partial_rotary_factor" not in json.dumps({k: saved.get(k) for k in ("rope_scaling", "rope_parameters")})
    loaded = DFlashDraftModel(DrafterConfig.from_dict(saved))  # rotates as it trained (GPT-2: no rope of its own)
    assert torch.equal(loaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    theta = getattr(target.config, "rope_theta", None) or rope.get("rope_theta")
    if theta is not None:  # at the top level too, where an engine on transformers 4 reads it (else: base 10,000)
        assert saved["rope_theta"] == theta


def test_a_drafter_for_a_partly_rotated_longrope_target_rotates_its_whole_head_with_the_base():
    """Phi-4-mini's longrope lists have one factor per rotated pair of its partly rotated head: they fit no whole
    head, so the drafter (which rotates all of its head) keeps the target's base alone instead of failing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.model.drafter import DFlashDraftModel
    from dflash.training.config import TrainConfig
    from dflash.training.drafter_setup import drafter_config_for

    config = AutoConfig.for_model(
        "phi3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=256,
        partial_rotary_factor=0.5, rope_theta=5000.0, eos_token_id=None, pad_token_id=None, bos_token_id=None,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})  # 4.x: "type"
    target = TargetModel(AutoModelForCausalLM.from_config(config))
    assert hf_compat.rope_fields(target.config) == {"rope_theta": 5000.0}
    drafter_config = drafter_config_for(target, TrainConfig(target="t", data="d.jsonl", output="o", block_size=4), 0)
    drafter = DFlashDraftModel(drafter_config)
    assert drafter.rotary_emb.inv_freq.shape == (drafter_config.head_dim // 2,)
    loaded = DFlashDraftModel(DrafterConfig.from_dict(drafter_config.to_dict()))
    assert torch.equal(loaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)


def test_a_drafter_for_a_longrope_target_rotates_as_the_target_on_both_sides_of_the_switch():
    """Phi-3.5's config keeps the switch length at its top level (transformers 4) or in rope_parameters (5), with
    no `factor`: transformers 4 could not build the drafter's rotary from the fields copied, and an export written
    under 5 did not load under 4. The drafter now rotates as its target, and its export loads as it trained."""
    from transformers import AutoModelForCausalLM

    from dflash.model.drafter import DFlashDraftModel
    from dflash.training.config import TrainConfig
    from dflash.training.drafter_setup import drafter_config_for

    config = tiny_target_config("phi3")
    config.sliding_window = None
    factors = dict(short_factor=[1.0] * 8, long_factor=[1.0 + i for i in range(8)])  # head_dim 16: whole head
    config.original_max_position_embeddings = 64
    if isinstance(getattr(config, "rope_parameters", None), dict):  # transformers 5
        config.rope_parameters = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                                      **factors)
    else:
        config.rope_scaling = dict(type="longrope", **factors)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    drafter_config = drafter_config_for(TargetModel(model),
                                        TrainConfig(target="t", data="d.jsonl", output="o", block_size=4), 0)
    saved = drafter_config.to_dict()
    assert saved["original_max_position_embeddings"] == 64  # where engines on transformers 4 read it
    rope = saved.get("rope_parameters") or saved["rope_scaling"]
    assert rope["factor"] == 1024 / 64 and rope["original_max_position_embeddings"] == 64
    older = {k: v for k, v in saved.items() if k != "original_max_position_embeddings"}  # an export of 5, before
    older = {**older, **{key: {k: v for k, v in older[key].items() if k != "factor"}
                         for key in ("rope_scaling", "rope_parameters") if isinstance(older.get(key), dict)}}
    x = torch.zeros(1, 1, 16)
    for drafter in (DFlashDraftModel(drafter_config), DFlashDraftModel(DrafterConfig.from_dict(saved)),
                    DFlashDraftModel(DrafterConfig.from_dict(older))):
        for position in (10, 63, 64, 200, 1000):  # short factors, then long ones, and their attention scaling
            ours = drafter.rotary_emb(x, torch.tensor([[position]]))
            theirs = model.model.rotary_emb(x, torch.tensor([[position]]))
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs)), position


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_top_level_original_length_reaches_a_longrope_rotary_alone(key):
    """A drafter config.json with a yarn rotary and a top-level original_max_position_embeddings (a hand-edited or
    third-party one): transformers 5 read the field into the yarn rotary when it was passed on, and 4 did not, so
    the drafter rotated otherwise under each. It is passed on for a longrope rotary alone, and written back."""
    from dflash.model.drafter import DFlashDraftModel

    base = DrafterConfig.from_dict(tiny_drafter_config_dict({key: {"rope_type": "yarn", "factor": 4.0,
                                                                   "rope_theta": 10000.0}}))
    raw = tiny_drafter_config_dict({key: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
                                    "original_max_position_embeddings": 256})
    config = DrafterConfig.from_dict(raw)
    assert "original_max_position_embeddings" not in config.rope
    assert config.to_dict()["original_max_position_embeddings"] == 256  # kept, as read
    x, far = torch.zeros(1, 1, 16), torch.tensor([[100000]])
    ours, plain = DFlashDraftModel(config).rotary_emb(x, far), DFlashDraftModel(base).rotary_emb(x, far)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def tiny_drafter_config_dict(fields: dict) -> dict:
    return {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 128, "max_position_embeddings": 1024,
            "dflash_config": {"mask_token_id": 127, "target_layer_ids": [1], "block_size": 4}, **fields}


def test_rope_switch_length_is_where_a_longrope_rotary_changes_its_factors_inside_the_context():
    from types import SimpleNamespace

    def config(original=4096, context=131072, long=(1.0, 2.0), key="rope_parameters", **fields):
        rope = dict(rope_type="longrope", short_factor=[1.0, 1.0], long_factor=list(long),
                    original_max_position_embeddings=original)
        return SimpleNamespace(max_position_embeddings=context, **{key: rope}, **fields)

    assert hf_compat.rope_switch_length(config()) == 4096  # Phi-3.5-mini's form
    assert hf_compat.rope_switch_length(config(original=4096, context=4096)) is None  # never reached
    assert hf_compat.rope_switch_length(config(long=(1.0, 1.0))) is None  # the same factors either way
    older = SimpleNamespace(max_position_embeddings=131072, original_max_position_embeddings=4096,
                            rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[2.0]))
    assert hf_compat.rope_switch_length(older) == 4096  # transformers 4's form
    per_kind = SimpleNamespace(max_position_embeddings=1024, rope_parameters={
        "full_attention": dict(rope_type="longrope", short_factor=[1.0], long_factor=[2.0],
                               original_max_position_embeddings=256),
        "sliding_attention": dict(rope_type="default")})
    assert hf_compat.rope_switch_length(per_kind) == 256
    yarn = SimpleNamespace(max_position_embeddings=131072, rope_parameters=dict(rope_type="yarn", factor=4.0))
    assert hf_compat.rope_switch_length(yarn) is None
