"""Structured output: a JSON schema or a regular expression masks the target's logits, slot by slot in a verify
forward. Drafting at any block size gives what the target alone gives under the same grammar (transformers'
generate with a reference processor that reads the whole output afresh at each token), and every answer keeps it."""

from __future__ import annotations

import json
import re

import llguidance.hf
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import byte_fallback_tokenizer, partial_oracle, random_prompts, tiny_drafter, tiny_target_model
from dflash.decoding import DFlashProposer, GenerationConfig, SpeculativeEngine, structure
from dflash.errors import GenerationError
from dflash.model import TargetModel

MAX_NEW = 40
# compact JSON (llguidance's option; by default any whitespace may sit between items, as in vLLM, where a random
# model writes it on and on)
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["answer", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"(sold|paid) [0-9]{1,3} (clips|dollars)\."


@pytest.fixture(scope="module")
def tokenizer():
    return byte_fallback_tokenizer()  # every character writable: letters, then UTF-8 bytes


def text_target(family: str, tokenizer) -> TargetModel:
    return TargetModel(tiny_target_model(family, vocab=len(tokenizer)), tokenizer)


class Grammar(LogitsProcessor):
    """The reference: at every token, a fresh matcher reads the whole output so far and masks the logits."""

    def __init__(self, target: TargetModel, prompt_len: int, grammar: str):
        self.tokenizer = llguidance.hf.from_tokenizer(target.tokenizer, n_vocab=target.vocab_size,
                                                      eos_token=target.eos_token_ids())
        self.prompt_len, self.grammar = prompt_len, grammar

    def __call__(self, input_ids, scores):
        for r in range(scores.shape[0]):
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            assert matcher.consume_tokens(input_ids[r, self.prompt_len:].tolist())
            allowed = torch.tensor(list(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
            scores[r, ~allowed[: scores.shape[1]]] = float("-inf")
        return scores


def hf_structured(target: TargetModel, prompt: list[int], grammar: str, max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=0, eos_token_id=target.eos_token_ids(),
                                logits_processor=LogitsProcessorList([Grammar(target, len(prompt), grammar)]))
    return out[0, len(prompt):].tolist()


def grammar_of(json_schema=None, regex=None) -> str:
    if json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema))
    return llguidance.LLMatcher.grammar_from_regex(regex)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_structured_output_is_transformers_with_the_grammar(tokenizer, family, block_size):
    target = text_target(family, tokenizer)
    prompts = random_prompts(2, seed=71)
    options = [dict(json_schema=SCHEMA), dict(regex=REGEX)]
    refs = {tuple(p): hf_structured(target, p, grammar_of(**o)) for p, o in zip(prompts, options)}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, block_size))
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, **o) for o in options]
    outs = engine.generate(prompts, configs)
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    schema_out, regex_out = outs
    assert schema_out.finish_reason == regex_out.finish_reason == "stop"  # the grammar ended them, at EOS
    answer = json.loads(schema_out.text)
    assert answer["answer"] in ("yes", "no") and isinstance(answer["n"], int) and set(answer) == {"answer", "n"}
    assert re.fullmatch(REGEX, regex_out.text)
    if block_size > 2:
        assert any(a > 2 for o in outs for a in o.stats.acceptance_lengths[1:])  # draft tokens were accepted


def test_rows_with_and_without_a_grammar_decode_together_as_alone(tokenizer):
    target = text_target("qwen3", tokenizer)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    prompts = random_prompts(3, seed=72)
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, json_schema=SCHEMA), GenerationConfig(max_new_tokens=MAX_NEW),
               GenerationConfig(max_new_tokens=MAX_NEW, regex=REGEX)]
    together = engine.generate(prompts, configs)
    alone = [engine.generate([p], c)[0] for p, c in zip(prompts, configs)]
    assert [o.output_ids for o in together] == [o.output_ids for o in alone]
    assert together[0].output_ids != together[1].output_ids


def test_rows_of_one_schema_share_its_compiled_grammar_and_keep_their_own_state(tokenizer):
    """The grammar is compiled once and each row gets a copy: rows of one schema (a request's n choices, a client's
    turns) decode together as alone, from one compilation."""
    target = text_target("qwen3", tokenizer)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    prompts = random_prompts(3, seed=73)
    config = GenerationConfig(max_new_tokens=MAX_NEW, json_schema=SCHEMA)
    alone = [engine.generate([p], config)[0].output_ids for p in prompts]
    together = engine.generate(prompts, config)
    assert [o.output_ids for o in together] == alone and len(set(map(tuple, alone))) > 1
    assert len(engine._grammars._compiled) == 1


def test_the_compiled_grammars_kept_are_bounded(tokenizer, monkeypatch):
    monkeypatch.setattr(structure, "COMPILED_KEPT", 3)
    compiler = structure.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for n in range(5):
        compiler.grammar(None, f"a{{{n + 1}}}")
    compiler.grammar(None, "a{3}")  # used again: the last to go
    compiler.grammar(None, "b")
    assert list(compiler._compiled) == [llguidance.LLMatcher.grammar_from_regex(r) for r in ("a{5}", "a{3}", "b")]


def test_a_row_with_a_grammar_verifies_no_branch(tokenizer):
    """A grammar's masks follow the block's draft tokens: a branch's slots would be masked after the wrong ones."""
    target = text_target("qwen3", tokenizer)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    prompt = random_prompts(1, seed=74)[0]
    branched = engine.generate([prompt], GenerationConfig(max_new_tokens=MAX_NEW, regex=REGEX, branch_length=3))[0]
    assert all(size <= 16 for size in branched.stats.block_sizes)
    plain = engine.generate([prompt], GenerationConfig(max_new_tokens=MAX_NEW, branch_length=3))[0]
    assert any(size > 16 for size in plain.stats.block_sizes)  # so the branch is left out for the grammar alone


def test_sampled_answers_keep_the_grammar_seeded_as_the_target_alone(tokenizer):
    target = text_target("llama", tokenizer)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    prompts = random_prompts(6, seed=73)
    seeded = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, seed=4, regex=REGEX)
    plain = SpeculativeEngine(target).generate(prompts, seeded)
    assert [o.output_ids for o in engine.generate(prompts, seeded)] == [o.output_ids for o in plain]
    unseeded = engine.generate(prompts * 5, GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.5,
                                                            json_schema=SCHEMA))
    for out in plain + unseeded:  # rejection sampling against the masked target: no token outside the grammar
        if out.finish_reason == "stop":
            assert re.fullmatch(REGEX, out.text) if out in plain else json.loads(out.text)["answer"] in ("yes", "no")
    assert sum(o.finish_reason == "stop" for o in unseeded) >= 20


@pytest.mark.parametrize("options, says", [
    (dict(json_schema={"type": "object"}, regex="a+"), "give one of them"),
    (dict(regex="a+", ignore_eos=True), "drop ignore_eos"),
    (dict(json_schema=[1]), "json_schema must be"),
])
def test_a_bad_structure_is_refused(options, says):
    with pytest.raises(GenerationError, match=says):
        GenerationConfig(**options)


def test_a_schema_the_grammar_cannot_take_is_refused_by_name(tokenizer):
    engine = SpeculativeEngine(text_target("qwen3", tokenizer))
    with pytest.raises(GenerationError, match="the json_schema cannot be used: .*fix it"):
        engine.new_sequence([5, 6], GenerationConfig(json_schema={"type": "wrong"}))
    with pytest.raises(GenerationError, match="the regex cannot be used"):
        engine.new_sequence([5, 6], GenerationConfig(regex="(unclosed"))
    with pytest.raises(GenerationError, match="the json_schema is not JSON"):
        engine.new_sequence([5, 6], GenerationConfig(json_schema={"enum": {1, 2}}))


def test_without_llguidance_the_error_says_what_to_install(tokenizer, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    engine = SpeculativeEngine(text_target("qwen3", tokenizer))
    with pytest.raises(GenerationError, match=r"needs llguidance: pip install 'dflash\[structured\]'"):
        engine.new_sequence([5, 6], GenerationConfig(regex="a+"))


def test_a_grammar_past_llguidances_limits_fails_its_row_alone(tokenizer):
    """`(a{1000}){1000}` passes llguidance's checks and fails at its first token ("too many expressions"): that row
    finishes with finish_reason "error" saying so, and the row beside it decodes as it would alone."""
    target = text_target("qwen3", tokenizer)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    prompts = random_prompts(2, seed=75)
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, regex=REGEX),
               GenerationConfig(max_new_tokens=MAX_NEW, regex="(a{1000}){1000}")]
    good, bad = engine.generate(prompts, configs)
    assert good.output_ids == engine.generate(prompts[:1], configs[0])[0].output_ids
    assert bad.finish_reason == "error" and "the answer's grammar failed in llguidance" in bad.error
    assert "\n" not in bad.error and "simplify the json_schema or regex" in bad.error
