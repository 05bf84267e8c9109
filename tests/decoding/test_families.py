"""Losslessness on more model families than the three the whole suite runs on (conftest.FAMILIES), one
compact check each, and the up-front refusal of families whose layer state cannot be rolled back."""

from __future__ import annotations

import pytest

from conftest import (
    MORE_FAMILIES,
    REFUSED_FAMILIES,
    OracleProposer,
    check_ragged_greedy,
    decode_with_branch_oracle,
    hf_greedy,
    partial_oracle,
    random_prompts,
    tiny_drafter,
    tiny_target_model,
)
from dflash.decoding import GenerationConfig, NoDraftProposer, SpeculativeEngine
from dflash.errors import GenerationError
from dflash.model.target import TargetModel, UnsupportedTargetError

# families with sliding-window layers (conftest._family_fields): they decode without branches
SLIDING_FAMILIES = {"mistral", "phi3", "qwen2", "gemma2", "gemma3_text", "cohere2", "gpt_oss"}
# their position bias or window follows the slot order, which a branch breaks
SLOT_ORDER_FAMILIES = {"bloom", "mpt", "gpt_neo"}
MAX_NEW = 32  # with prompts of 3-20 tokens, sequences run well past the sliding window (conftest.SLIDING_WINDOW)
SEEDED = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_speculative_decoding_is_lossless(family):
    """Greedy at block sizes 2, 8 and 16 in a ragged batch gives transformers' own greedy output; seeded
    sampling gives what the target alone samples."""
    target = TargetModel(tiny_target_model(family, layers=2))
    prompts = random_prompts(3, seed=1)
    check_ragged_greedy(target, prompts, MAX_NEW)
    sampled = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, GenerationConfig(**SEEDED))]
    engine = SpeculativeEngine(target, partial_oracle(target, dict(zip(map(tuple, prompts), sampled)), 8))
    outs = engine.generate(prompts, GenerationConfig(**SEEDED, block_size=8))
    assert [o.output_ids for o in outs] == sampled


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_branches_are_lossless_or_left_out(family):
    """A branch needs the family to read a tree-shaped 4D mask as given: every family that says it takes one
    decodes a ragged batch with branches (an oracle's, accepted at known steps) into transformers' own greedy
    output; the others decode without branches."""
    target = TargetModel(tiny_target_model(family, layers=2))
    outs, refs = decode_with_branch_oracle(target, 2, correct=2, branch_right=2, block_size=8, branch_length=3,
                                           max_new=MAX_NEW, rows=3)
    assert [o.output_ids for o in outs] == refs
    steps = {a for o in outs for a in o.stats.acceptance_lengths[1:-1]}
    assert steps == ({5} if target.takes_branches else {3})  # 2 right, then the branch's 2 (or the miss), 1
    assert target.takes_branches == (family not in SLIDING_FAMILIES | SLOT_ORDER_FAMILIES)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_survives_compaction_and_joining(family):
    """Rows join a running batch (left padding) and holes pile up until the cache is compacted; sliding
    windows still see exactly the last `window` tokens of each row."""
    target = TargetModel(tiny_target_model(family, layers=2))
    prompts = random_prompts(3, seed=5, low=2, high=30)
    refs = {tuple(p): hf_greedy(target, p, 80) for p in prompts}
    proposer = OracleProposer(tiny_drafter(target), target, refs, correct=lambda rng: rng.choice([0, 0, 15]), seed=3)
    engine = SpeculativeEngine(target, proposer)
    seqs = [engine.new_sequence(p, GenerationConfig(max_new_tokens=80, ignore_eos=True)) for p in prompts]
    batch = engine.merge([engine.prefill(seqs[0]), engine.prefill(seqs[1])])
    for _ in range(3):
        engine.step(batch)
    batch = engine.merge([batch, engine.prefill(seqs[2])])
    compacted = False
    while batch is not None:
        holes = int((~batch.target_valid).sum())
        engine.step(batch)
        compacted = compacted or int((~batch.target_valid).sum()) < holes  # a step alone only adds holes
        batch = engine.drop_finished(batch)
    assert compacted
    assert [s.output_ids for s in seqs] == [refs[tuple(p)] for p in prompts]


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
def test_targets_whose_state_cannot_be_rolled_back_are_refused_up_front(family):
    target = TargetModel(tiny_target_model(family, layers=2))
    for proposer in (None, NoDraftProposer()):
        with pytest.raises(UnsupportedTargetError, match=r"layers \[0(, 1)?\] are '\w+' layers: .+full or sliding"):
            SpeculativeEngine(target, proposer)


def test_a_recurrent_target_that_takes_no_kv_cache_is_refused_up_front():
    """RWKV keeps its state under its own keyword: the engine's cache would vanish into its `**kwargs`, and every
    forward would see only its own tokens (other text than transformers' generate, with or without a drafter)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("rwkv", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                  attention_hidden_size=64, intermediate_size=128)
    target = TargetModel(AutoModelForCausalLM.from_config(config).eval())
    for proposer in (None, NoDraftProposer()):
        with pytest.raises(UnsupportedTargetError, match=r"RwkvForCausalLM .+takes no key/value cache"):
            SpeculativeEngine(target, proposer)


def test_a_model_that_keeps_its_own_state_under_cache_is_refused_after_one_forward():
    """xLSTM takes `cache` as a KV model does, and keeps a recurrent state there: one forward with DFlash's cache
    tells (it crashed mid-decode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model("xlstm", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=4)
    except ValueError:
        pytest.skip("this transformers has no xLSTM")
    target = TargetModel(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(UnsupportedTargetError, match=r"xLSTMForCausalLM .+ keeps a (state of its own|recurrent state)"):
        SpeculativeEngine(target)


def test_a_wrapped_target_whose_forward_takes_kwargs_still_decodes():
    """A wrapper's forward (PEFT's, torch.compile's) takes the cache in **kwargs: nothing in its signature says
    recurrent, and one forward shows the cache filling."""
    import torch
    from torch import nn

    model = tiny_target_model("qwen3", layers=2)

    class Wrapper(nn.Module):  # the shape of PEFT's PeftModelForCausalLM
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_base_model(self):
            return self.inner

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    wrapped = TargetModel(Wrapper(model))
    wrapped.layers = TargetModel(model).layers
    prompt = random_prompts(1, seed=2)[0]
    with torch.inference_mode():
        out = SpeculativeEngine(wrapped).generate([prompt], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert out[0].output_ids == hf_greedy(TargetModel(model), prompt, 8)


def _longrope_target(switch: int, family: str = "phi3") -> TargetModel:
    """A tiny Phi-3 whose longrope rotary switches from its short to its long factors at `switch` tokens (Phi-3 and
    Phi-3.5 128k's form, in a context of 1,024), with factors far enough apart to change its greedy text."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import tiny_target_config

    config = tiny_target_config(family, layers=2)
    config.sliding_window = None
    half = config.hidden_size // config.num_attention_heads // 2
    factors = dict(short_factor=[1.0] * half, long_factor=[1.0 + 3.0 * i for i in range(half)])
    config.original_max_position_embeddings = switch
    if hasattr(config, "rope_parameters"):  # transformers 5
        config.rope_parameters = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=switch,
                                      **factors)
    else:
        config.rope_scaling = dict(type="longrope", **factors)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)
    return TargetModel(model)


@pytest.mark.parametrize("block", [4, 16])
def test_a_longrope_target_decodes_across_its_switch_losslessly(block):
    """transformers picks a longrope target's factors once per forward, from its largest position: a verified block,
    a batch or a re-read reaching past the switch would rotate the tokens before it with the long factors, which
    decoding one token at a time does not (4 of 12 prompts changed their text that way). Each position is rotated
    with its own factors instead (`hf_compat.rotate_rows`), and a row read again at the switch as `generate`
    reads it: prompts shorter and longer than the switch, decoded across
    it in one ragged batch, whole blocks straddling it, give transformers' own text."""
    switch = 24
    target = _longrope_target(switch)
    assert target.context_length == 1024 and target.context_note == ""  # not capped at the switch
    prompts = random_prompts(6, seed=1, low=4, high=8) + random_prompts(2, seed=2, low=30, high=40)
    max_new = 40
    refs = {tuple(p): hf_greedy(target, p, max_new) for p in prompts}
    config = GenerationConfig(max_new_tokens=max_new, block_size=block, ignore_eos=True)
    for proposer in (OracleProposer(tiny_drafter(target), target, refs), partial_oracle(target, refs, block)):
        engine = SpeculativeEngine(target, proposer.with_block_size(block))
        outs = engine.generate(prompts, config)
        assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert max(n for o in outs for n in o.stats.acceptance_lengths) > 2  # blocks were accepted


def test_a_longrope_llama_whose_generate_does_not_read_again_decodes_within_its_switch():
    """Only Phi-3's classes read a sequence again at the switch in `generate`; a Llama given a longrope config
    keeps the short rotation before it, which DFlash's re-read would not match: it stays within the switch."""
    target = _longrope_target(24, family="llama")
    assert target.context_length == 24 and target.rope_rows_switch is None
    prompts = random_prompts(3, seed=1, low=4, high=8)
    refs = {tuple(p): hf_greedy(target, p, 24 - len(p)) for p in prompts}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, 4).with_block_size(4))
    outs = engine.generate(prompts, [GenerationConfig(max_new_tokens=24 - len(p), block_size=4, ignore_eos=True)
                                     for p in prompts])
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]


def test_a_longrope_target_whose_rotary_is_not_found_decodes_within_its_switch(monkeypatch):
    """Without a way to give each row its factors, DFlash stays below the switch and says why."""
    from dflash.model import hf_compat

    monkeypatch.setattr(hf_compat, "rotate_rows", lambda model, switch, rows: 0)
    target = _longrope_target(24)
    assert target.context_length == 24 and target.rope_rows_switch is None
    engine = SpeculativeEngine(target)
    with pytest.raises(GenerationError, match=r"context is 24 tokens \(its longrope rotary switches .+ at 24 tokens"):
        engine.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=22))


def test_a_longrope_row_read_again_past_its_switch_goes_on_as_decoded():
    """The server's fallback reads a row's prompt and answer again in one forward: a prompt below the switch and an
    answer past it keep their two rotations."""
    switch = 24
    target = _longrope_target(switch)
    prompt = random_prompts(1, seed=3, low=6, high=6)[0]
    ref = hf_greedy(target, prompt, 40)
    engine = SpeculativeEngine(target, OracleProposer(tiny_drafter(target), target, {tuple(prompt): ref}))
    seq = engine.new_sequence(prompt, GenerationConfig(max_new_tokens=40, block_size=4, ignore_eos=True))
    batch = engine.prefill(seq, NoDraftProposer())
    while seq.next_position < switch + 6:
        engine.step(batch)
    batch = engine.rejoin(seq, engine.proposer)
    while not seq.finished:
        engine.step(batch)
    assert seq.output_ids == ref


def _tiny(model_type: str, **fields):
    """A tiny random causal LM of `model_type` beyond conftest's families, with peaky logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, eos_token_id=None, bos_token_id=None, pad_token_id=None), **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return TargetModel(model)


@pytest.mark.parametrize("model_type,fields,reason", [
    # BART's decoder numbers positions by cache slot: a padded row, or a branch, would read other positions
    ("bart", dict(d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=128, decoder_ffn_dim=128, decoder_start_token_id=2),
     "numbers positions by slot|needs inputs of its own"),  # transformers 4's takes no position_ids at all
    ("bert", dict(is_decoder=False), "attention is not causal"),  # BertLMHeadModel left bidirectional
])
def test_targets_whose_logits_depend_on_what_a_block_or_a_batch_changes_are_refused_up_front(model_type, fields,
                                                                                               reason):
    target = _tiny(model_type, **fields)
    for proposer in (None, NoDraftProposer()):
        with pytest.raises(UnsupportedTargetError, match=reason):
            SpeculativeEngine(target, proposer)


def test_a_bert_built_as_a_decoder_is_lossless():
    target = _tiny("bert", is_decoder=True)
    check_ragged_greedy(target, random_prompts(3, seed=1), MAX_NEW)


@pytest.mark.parametrize("model_type,fields", [
    ("opt", dict(word_embed_proj_dim=32, ffn_dim=128)),  # facebook/opt-350m's shape: embeddings 512, hidden 1024
    ("electra", dict(embedding_size=32, is_decoder=True)),
])
def test_a_target_that_projects_between_its_embeddings_and_layers_gets_no_dflash_drafter(model_type, fields):
    """A DFlash drafter drafts with the target's embeddings and LM head in its hidden size; the target still decodes
    without one."""
    from dflash.decoding.proposer import DFlashProposer
    from dflash.training.config import TrainConfig
    from dflash.training.drafter_setup import drafter_config_for

    target = _tiny(model_type, **fields)
    with pytest.raises(UnsupportedTargetError, match="are 32 wide .+ not its hidden size 64"):
        DFlashProposer(tiny_drafter(target), target)
    with pytest.raises(UnsupportedTargetError, match="are 32 wide"):  # dflash train refuses it at setup
        drafter_config_for(target, TrainConfig(target="t", data="d.jsonl", output="o"), 0)
    prompt = random_prompts(1, seed=2)[0]
    out = SpeculativeEngine(target).generate([prompt], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert out[0].output_ids == hf_greedy(target, prompt, 8)


def test_a_target_keeping_its_top_keys_decodes_within_that_many_tokens():
    """Doge's attention keeps the `keep_window_size` keys it ranks highest in each forward: past that many tokens a
    verified block ranks them otherwise than one token at a time, so DFlash decodes within them, losslessly."""
    from dflash.model.hf_compat import TRANSFORMERS_MAJOR

    target = _tiny("doge", keep_window_size=40, num_key_value_heads=2, head_dim=16, num_experts=16,
                   num_experts_per_tok=2)
    if TRANSFORMERS_MAJOR < 5:  # its Doge lets a token see the tokens after it when given no mask
        with pytest.raises(UnsupportedTargetError, match="attention is not causal"):
            SpeculativeEngine(target)
        return
    assert target.context_length == 40 and "keeps the 40 keys it ranks highest" in target.context_words
    prompts = random_prompts(3, seed=1, low=3, high=8)
    check_ragged_greedy(target, prompts, 30)
    with pytest.raises(GenerationError, match="room for at most"):
        SpeculativeEngine(target).generate([prompts[0]], GenerationConfig(max_new_tokens=40))
