import pytest

from dflash.model.config import DrafterConfig, DrafterConfigError, default_target_layer_ids

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=1024)


def test_layer_id_formula_matches_published_examples():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(28, 2) == [1, 25]


def test_new_form_with_block_size_inside_dflash_config():
    raw = {**BASE, "architectures": ["DFlashDraftModel"], "num_target_layers": 8,
           "dflash_config": {"mask_token_id": 99, "target_layer_ids": [2, 5], "block_size": 10}}
    config = DrafterConfig.from_dict(raw)
    assert (config.mask_token_id, config.target_layer_ids, config.block_size) == (99, [2, 5], 10)


def test_top_level_block_size_and_round_trip():
    raw = {**BASE, "num_target_layers": 8, "block_size": 8, "dflash_config": {"mask_token_id": 7,
           "target_layer_ids": [1, 5]}, "custom_field": "kept"}
    config = DrafterConfig.from_dict(raw)
    assert config.block_size == 8
    again = DrafterConfig.from_dict(config.to_dict())
    assert again == config and config.to_dict()["custom_field"] == "kept"
    out = config.to_dict()
    assert out["architectures"] == ["DFlashDraftModel"] and out["tie_word_embeddings"] is False
    assert out["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 5], "block_size": 8}


def test_legacy_form_uses_formula_and_needs_a_mask_token():
    raw = {**BASE, "num_target_layers": 36, "block_size": 16}
    with pytest.raises(DrafterConfigError, match=r"\(legacy format without dflash_config\); .+--mask-token-id"):
        DrafterConfig.from_dict(raw)
    with pytest.raises(DrafterConfigError, match=r"\(its dflash_config has no mask_token_id\); .+--mask-token-id"):
        DrafterConfig.from_dict({**raw, "dflash_config": {"target_layer_ids": [1, 33]}})
    config = DrafterConfig.from_dict(raw, mask_token_id=5)
    assert config.target_layer_ids == [1, 33] and config.mask_token_id == 5


def test_a_plain_model_is_not_a_drafter():
    """What `dflash train --init-from` says of a causal LM: no advice about a draft-model option train lacks."""
    with pytest.raises(DrafterConfigError, match="not a DFlash drafter; give the directory of a DFlash drafter") as err:
        DrafterConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert "as the draft model" not in str(err.value)


def test_sliding_layers_need_a_window():
    raw = {**BASE, "num_target_layers": 8, "layer_types": ["sliding_attention", "full_attention"],
           "dflash_config": {"mask_token_id": 1}}
    with pytest.raises(DrafterConfigError, match="sliding_window"):
        DrafterConfig.from_dict(raw)
    # Qwen3Config, which both engines read this file with, keeps the window only under use_sliding_window
    with pytest.raises(DrafterConfigError, match="with use_sliding_window true .without it Qwen3Config"):
        DrafterConfig.from_dict({**raw, "sliding_window": 4})
    config = DrafterConfig.from_dict({**raw, "sliding_window": 4, "use_sliding_window": True})
    assert config.sliding_window == 4 and config.to_dict()["use_sliding_window"] is True


@pytest.mark.parametrize("model_type", ["qwen3", None])
def test_layer_types_and_window_are_read_as_qwen3config_reads_them(model_type):
    """What transformers' Qwen3Config gives vLLM and SGLang: without layer_types, the layers from max_window_layers
    on slide (under use_sliding_window); without use_sliding_window, no layer has a window."""
    from transformers import Qwen3Config

    raw = {**BASE, "num_hidden_layers": 3, "num_target_layers": 8, "dflash_config": {"mask_token_id": 1},
           "model_type": model_type}
    cases = [{"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
             {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 1},
             {"use_sliding_window": True, "sliding_window": 16},  # max_window_layers 28: none slides
             {"sliding_window": 16, "layer_types": ["full_attention"] * 3},
             {"use_sliding_window": True, "max_window_layers": 2}]  # their default window, 4096
    for case in cases:
        config, theirs = DrafterConfig.from_dict({**raw, **case}), Qwen3Config(**{**raw, **case})
        assert (config.layer_types, config.sliding_window) == (theirs.layer_types, theirs.sliding_window), case
    mistral = DrafterConfig.from_dict({**raw, "model_type": "mistral", "sliding_window": 16})  # no such rule there
    assert (mistral.layer_types, mistral.sliding_window) == (["full_attention"] * 3, 16)
    # values transformers refuses (so the engines cannot load the file) are refused by name
    for bad, named in (({"use_sliding_window": "false"}, "use_sliding_window must be true or false, got 'false'"),
                       ({"use_sliding_window": True, "max_window_layers": 2.0}, "max_window_layers must be a whole"),
                       ({"max_window_layers": True}, "max_window_layers must be a whole number, got True")):
        with pytest.raises(DrafterConfigError, match=named):
            DrafterConfig.from_dict({**raw, **bad})


GOOD = {**BASE, "num_target_layers": 8, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 5]}}


def _attention(layer_types=None, top=None, **dflash) -> list[tuple]:
    raw = {**GOOD, **(top or {}), "dflash_config": {**GOOD["dflash_config"], **dflash}}
    if layer_types:
        raw["layer_types"] = layer_types
    config = DrafterConfig.from_dict(raw)
    return [(a.window, a.causal) for a in map(config.layer_attention, range(2))]


MIXED = ["sliding_attention", "full_attention"]
WINDOW_8 = {"sliding_window": 8, "use_sliding_window": True}


@pytest.mark.parametrize("layer_types,top,dflash,expected", [
    (None, None, {}, [(None, False), (None, False)]),  # the published DFlash drafters: bidirectional blocks
    (MIXED, WINDOW_8, {}, [(8, True), (None, False)]),  # a sliding layer is causal (vLLM's reading)
    (MIXED, WINDOW_8, {"causal": False}, [(8, False), (None, False)]),
    (None, {"is_causal": True}, {"causal": False}, [(None, True), (None, True)]),  # is_causal first
    (None, None, {"use_swa": True, "swa_window_size": 6}, [(6, False), (6, False)]),  # every layer slides
    (MIXED, WINDOW_8, {"use_swa": True, "swa_window_size": 6}, [(6, True), (None, False)]),
])
def test_each_layers_attention_is_resolved_as_vllm_resolves_it(layer_types, top, dflash, expected):
    assert _attention(layer_types, top, **dflash) == expected


def test_attention_fields_round_trip_and_are_checked():
    raw = {**GOOD, "is_causal": False, "dflash_config": {**GOOD["dflash_config"], "causal": True, "use_swa": True,
                                                         "swa_window_size": 6}}
    config = DrafterConfig.from_dict(raw)
    again = DrafterConfig.from_dict(config.to_dict())
    assert again == config and again.to_dict()["dflash_config"]["swa_window_size"] == 6
    for top, dflash, named in (({"is_causal": "yes"}, {}, "is_causal"), ({}, {"causal": 1}, "dflash_config.causal"),
                               ({}, {"use_swa": "true"}, "dflash_config.use_swa"),
                               ({}, {"swa_window_size": 0}, "swa_window_size"),
                               ({}, {"use_swa": True}, "no window: set sliding_window"),
                               ({"sliding_window": -1, "use_sliding_window": True}, {"use_swa": True},
                                "whole number >= 1.*got -1")):
        with pytest.raises(DrafterConfigError, match=named):
            _attention(None, top, **dflash)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "64"}, "hidden_size '64'; each must be a whole number >= 1"),
    ({"num_attention_heads": 0}, "num_attention_heads 0"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers 1.5"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"block_size": "16"}, "block_size must be an integer, got '16'"),
    ({"dflash_config": {"mask_token_id": "1", "target_layer_ids": [1, 5]}}, "mask_token_id must be an integer"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": 5}}, "target_layer_ids must be a non-empty list"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": []}}, "target_layer_ids must be a non-empty list"),
    ({"dflash_config": "mask 1"}, "dflash_config must be an object"),
])
def test_a_value_of_the_wrong_kind_is_named(change, message):
    """Before: a TypeError, ZeroDivisionError or a wall of size mismatches from deep inside the model."""
    with pytest.raises(DrafterConfigError, match=message):
        DrafterConfig.from_dict({**GOOD, **change})
    assert DrafterConfig.from_dict(GOOD).target_layer_ids == [1, 5]


def test_a_given_mask_token_must_be_in_the_vocabulary_and_not_override_the_drafters_own():
    legacy = {**BASE, "num_target_layers": 36, "block_size": 16}
    for bad in (-5, BASE["vocab_size"]):
        with pytest.raises(DrafterConfigError, match="outside the vocabulary"):
            DrafterConfig.from_dict(legacy, mask_token_id=bad)
    named = {**BASE, "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 5]}, "block_size": 8}
    with pytest.raises(DrafterConfigError, match="trained with mask token 7.*drop the mask token id 9 "
                                                 ".--mask-token-id, or mask_token_id= in Python."):
        DrafterConfig.from_dict(named, mask_token_id=9)
    assert DrafterConfig.from_dict(named, mask_token_id=7).mask_token_id == 7  # the same: nothing to refuse


def test_a_published_sliding_drafters_config_survives_a_round_trip():
    """A fine-tune (--init-from) writes back what it read: transformers' Qwen3Config reads sliding_window only with
    use_sliding_window, and vLLM refuses a sliding layer without a window, so dropping the flag broke the export."""
    raw = {**GOOD, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048,
           "use_sliding_window": True, "max_window_layers": 1}
    out = DrafterConfig.from_dict(raw).to_dict()
    assert (out["use_sliding_window"], out["max_window_layers"], out["sliding_window"]) == (True, 1, 2048)
