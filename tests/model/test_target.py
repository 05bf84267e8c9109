import pytest
import torch

from conftest import FAMILIES, MORE_FAMILIES, tiny_target_model
from dflash.model.hf_compat import cache_length, crop_cache
from dflash.model.target import TargetModel, unapplied_generation_options, warn_unapplied_generation_options


def assert_features_are_layer_outputs(target, layer_ids: list[int]) -> None:
    ids = torch.tensor([[5, 9, 3, 44, 2, 7]])
    positions = torch.arange(6)[None]
    reference = target.model(ids, output_hidden_states=True)
    out = target.forward(ids, positions, target.new_cache(), feature_layer_ids=layer_ids)
    expected = torch.cat([reference.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert out.features.shape == (1, 6, len(layer_ids) * target.hidden_size)
    assert torch.allclose(out.features, expected, atol=1e-5)
    assert torch.allclose(out.logits, reference.logits, atol=1e-4)


def test_features_are_the_outputs_of_the_chosen_layers(target):
    """Layer id l means the output of decoder layer l, i.e. transformers' hidden_states[l + 1] (except for
    the last layer, whose hidden_states entry has the final norm applied; DFlash never reads that one)."""
    assert_features_are_layer_outputs(target, [2, 0, 1])


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_features_of_more_families(family):
    """Whatever a family calls its decoder layers (`layers`, `h`) and whatever they return."""
    assert_features_are_layer_outputs(TargetModel(tiny_target_model(family, layers=3)), [1, 0])


def test_no_features_unless_asked_and_hooks_capture_only_when_asked(target):
    ids, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    target.forward(ids, positions, target.new_cache(), feature_layer_ids=[1])
    out = target.forward(ids, positions, target.new_cache())
    assert out.features is None and not getattr(target._capture, "captured", {})  # nothing kept after the forward


def test_cache_crop_keeps_a_prefix(target):
    cache = target.new_cache()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    target.forward(ids, torch.arange(5)[None], cache)
    crop_cache(cache, 3)
    assert cache_length(cache) == 3
    step = target.forward(torch.tensor([[4]]), torch.tensor([[3]]), cache)
    full = target.forward(ids[:, :4], torch.arange(4)[None], target.new_cache())
    assert torch.allclose(step.logits[0, -1], full.logits[0, -1], atol=1e-4)


def test_a_config_that_does_not_fit_the_weights_names_the_mismatch(tiny_pair, tmp_path):
    import json
    import shutil

    from dflash.model.loading import CheckpointError

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] *= 2
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"do not fit its config.json \(model.layers.0.mlp.\w+_proj.weight: "
                                              r"file \[\d+, \d+\], config \[\d+, \d+\].*and \d+ more"):
        TargetModel.from_pretrained(target)


def test_generation_config_options_dflash_does_not_apply_are_named_in_a_warning(caplog):
    """Qwen2.5-Instruct ships repetition_penalty 1.05, which transformers' generate applies and DFlash does not."""
    model = tiny_target_model("qwen3")
    model.generation_config.min_p, model.generation_config.min_new_tokens = 0.0, 0  # neutral values
    with caplog.at_level("WARNING", logger="dflash.model.target"):
        warn_unapplied_generation_options(TargetModel(model))
    assert "generation_config" not in caplog.text  # nothing set: nothing said
    model.generation_config.repetition_penalty = 1.05
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    with caplog.at_level("WARNING", logger="dflash.model.target"):
        warn_unapplied_generation_options(TargetModel(model))
    assert "sets repetition_penalty=1.05, do_sample=True, temperature=0.7" in caplog.text
    assert "DFlash does not apply" in caplog.text and "dflash serve applies its sampling defaults" in caplog.text
    assert unapplied_generation_options(model.generation_config, sampling_defaults=False) == ["repetition_penalty=1.05"]


# families whose logits are more than the LM head of the final hidden states
TRANSFORMED_LOGITS = {"gemma2": "final_logit_softcapping", "gemma3_text": "final_logit_softcapping",
                      "cohere2": "logit_scale", "granite": "logits_scaling"}


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_the_targets_logits_from_its_final_hidden_states_are_its_forwards(family, monkeypatch):
    """Distillation's soft labels are `logits` of the final hidden states: the model's own distribution, its
    family's transform included (without it Gemma's would be uncapped, Cohere's and Granite's scaled otherwise)."""
    target = TargetModel(tiny_target_model(family))
    assert target.distillation_problem() is None
    if family in TRANSFORMED_LOGITS:
        assert getattr(target.config, TRANSFORMED_LOGITS[family])
        monkeypatch.setattr(TargetModel, "logits", TargetModel.lm_head)  # the head alone misses them
        assert "forward gives other logits than its LM head" in target.distillation_problem()


@pytest.mark.parametrize("logit_scale", ["inv_sqrt_d_model", 0.5])
def test_a_field_named_like_a_transform_in_a_family_that_does_not_apply_it_is_left_alone(logit_scale):
    """MPT's config has a logit_scale its transformers forward never reads (llm-foundry sets a string there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mpt", vocab_size=128, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2,
                                  max_seq_len=256, logit_scale=logit_scale)
    target = TargetModel(AutoModelForCausalLM.from_config(config))
    assert target.distillation_problem() is None


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text"])
def test_the_drafters_token_embeddings_are_the_tables_rows_in_every_transformers_version(family):
    """transformers 5 scales Gemma 2's (and Gemma's) embeddings by sqrt(hidden) inside the module, 4.x in their
    forward; vLLM's DFlash drafter reads the table alone. A drafter trained under one read sqrt(hidden) (48 for
    Gemma 2 2B) times larger embeddings under the other."""
    target = TargetModel(tiny_target_model(family))
    ids = torch.tensor([[1, 5, 9]])
    table = target.model.get_input_embeddings().weight
    assert torch.equal(target.embed(ids), torch.nn.functional.embedding(ids, table))


def test_the_load_time_probes_never_feed_the_padding_id():
    """A forward without an attention mask that meets the padding id warns of padding (GPT-2's does, once per
    process): the probes at load pass over it."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_target_config

    config = tiny_target_config("gpt2", 2)
    config.pad_token_id = 2
    target = TargetModel(AutoModelForCausalLM.from_config(config).eval())
    for first, n in ((1, 1), (1, 3), (2, 2), (5, 2)):
        ids = target._probe_ids(n, first=first)[0].tolist()
        assert len(ids) == n and 2 not in ids and ids[0] in (first, first + 1)
    config.vocab_size = 3  # the ids wrap round, passing over the padding id each time
    assert TargetModel(AutoModelForCausalLM.from_config(config).eval())._probe_ids(3)[0].tolist() == [1, 0, 1]
