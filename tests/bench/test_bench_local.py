"""The local backend on the tiny pair: honest runs report 0 mismatches, a planted fault is caught."""

from __future__ import annotations

import pytest

from conftest import OracleProposer
from dflash.bench.datasets import Sample
from dflash.bench.local import LocalBackend, LocalConfig
from dflash.decoding import GenerationConfig, SpeculativeEngine
from dflash.errors import UserError

SAMPLES = [Sample("a", ("How many clips did Natalia sell?",)), Sample("b", ("Weng earns 12 dollars an hour.",))]
FAST = LocalConfig(max_new_tokens=12, warmup_tokens=4)


class CorruptingEngine:
    """Wraps an engine and flips the last output token of one prompt: a lossy decoder to be caught."""

    def __init__(self, engine, victim_ids: list[int]):
        self.engine, self.victim_ids = engine, victim_ids

    def generate_one(self, prompt, config):
        out = self.engine.generate_one(prompt, config)
        if prompt == self.victim_ids and config.max_new_tokens == FAST.max_new_tokens:
            out.output_ids[-1] = (out.output_ids[-1] + 1) % 100
        return out


class RecordingEngine:
    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate_one(self, prompt, config):
        self.prompts.append(prompt)
        return self.engine.generate_one(prompt, config)


def test_honest_run_has_no_mismatches_and_consistent_acceptance(pipe):
    result = LocalBackend(pipe).run("gsm8k", SAMPLES, FAST)
    assert result.mismatches == 0 and result.mismatched_prompts == []
    assert result.num_prompts == 2 and result.num_requests == 2
    block = pipe.engine.proposer.block_size
    assert result.block_size == block and len(result.acceptance_histogram) == block + 1
    assert 2 <= result.mean_block_size <= block  # a last block is cut to what its answer still wants
    assert len(result.acceptance_rate_per_position) == block - 1
    steps = sum(result.acceptance_histogram)
    assert steps > 0 and result.acceptance_histogram[0] == 0
    produced = sum(n * c for n, c in enumerate(result.acceptance_histogram))
    assert result.mean_acceptance_length == pytest.approx(produced / steps)
    # every output token is either a prefill's first token or produced by a verify step
    assert result.dflash_output_tokens == produced + result.num_requests
    assert result.baseline_output_tokens == result.dflash_output_tokens
    assert result.speedup == pytest.approx(result.dflash_tokens_per_s / result.baseline_tokens_per_s)
    assert result.baseline_ttft_ms > 0 and result.dflash_tpot_ms > 0
    # 2 prompts x 12 tokens: a handful of verify steps, said to be too few to trust (3 prompts of ~9 tokens had
    # shown a speedup and a tau, the same at blocks 8 and 16, without a word)
    [few] = [n for n in result.notes if "verify steps" in n]
    assert few.startswith(f"only {steps} verify steps ({result.dflash_output_tokens} output tokens) were measured")
    assert "--max-samples or --max-new-tokens" in few


def test_a_planted_mismatch_is_caught(pipe):
    victim = pipe.encode([{"role": "user", "content": SAMPLES[1].turns[0]}])
    backend = LocalBackend(pipe, dflash=CorruptingEngine(pipe.engine, victim))
    result = backend.run("gsm8k", SAMPLES, FAST)
    assert result.mismatches == 1
    assert result.mismatched_prompts == ["b#0"]


def test_second_turn_follows_the_models_own_first_answer(pipe):
    recorder = RecordingEngine(SpeculativeEngine(pipe.target))
    backend = LocalBackend(pipe, baseline=recorder)
    sample = Sample("81", ("Write about clips.", "Now shorter."))
    [first, second] = backend.run_sample(sample, FAST, 0).records
    answer = pipe.tokenizer.decode(first.baseline.output_ids, skip_special_tokens=True)
    expected = pipe.encode([{"role": "user", "content": "Write about clips."},
                            {"role": "assistant", "content": answer},
                            {"role": "user", "content": "Now shorter."}])
    assert answer and recorder.prompts[-1] == expected
    assert (first.turn, second.turn) == (0, 1)
    assert second.baseline.output_ids == second.dflash.output_ids


def test_oracle_drafts_give_full_blocks(pipe):
    """With a drafter that proposes the target's own continuation, every verify step accepts the block."""
    plain = SpeculativeEngine(pipe.target)
    prompts = [pipe.encode([{"role": "user", "content": s.turns[0]}]) for s in SAMPLES]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    references = {tuple(p): out.output_ids for p, out in zip(prompts, plain.generate(prompts, config))}
    oracle = SpeculativeEngine(pipe.target, OracleProposer(pipe.drafter, pipe.target, references))

    class NoStop:  # the oracle's references run past EOS; so must the bench's generations
        def __init__(self, engine):
            self.engine = engine

        def generate_one(self, prompt, config):
            config.ignore_eos = True
            return self.engine.generate_one(prompt, config)

    backend = LocalBackend(pipe, baseline=NoStop(plain), dflash=NoStop(oracle))
    result = backend.run("gsm8k", SAMPLES, LocalConfig(max_new_tokens=33, warmup_tokens=0))
    block = pipe.engine.proposer.block_size
    assert result.mismatches == 0
    assert result.acceptance_histogram[block] == 2 * 32 // block  # 32 tokens after the prefill's, full blocks
    assert result.mean_acceptance_length == block
    assert result.acceptance_rate_per_position == [1.0] * (block - 1)


def test_sampled_outputs_are_compared_too(pipe):
    """Each prompt is sampled with its own seed, which fixes the text whatever the drafting: 0 mismatches."""
    config = LocalConfig(max_new_tokens=16, temperature=0.8, warmup_tokens=0)
    result = LocalBackend(pipe).run("gsm8k", SAMPLES[:2], config)
    assert result.mismatches == 0 and result.temperature == 0.8
    assert result.dflash_output_tokens > 0


def test_every_turn_is_sampled_with_a_seed_of_its_own_the_same_for_both_decoders(pipe):
    """Seeds were --seed + sample index + turn: a sample's second turn drew what the next sample's first did."""

    class SeedRecorder(RecordingEngine):
        def generate_one(self, prompt, config):
            self.prompts.append(config.seed)
            return self.engine.generate_one(prompt, config)

    baseline, dflash = SeedRecorder(SpeculativeEngine(pipe.target)), SeedRecorder(pipe.engine)
    backend = LocalBackend(pipe, baseline=baseline)
    backend.dflash = dflash
    config = LocalConfig(max_new_tokens=4, temperature=0.8, warmup_tokens=0)
    backend.run("mt-bench", [Sample("81", ("Hi.", "More.")), Sample("82", ("Yes.", "No."))], config)
    assert baseline.prompts == dflash.prompts and len(set(baseline.prompts)) == 4
    assert all(0 <= seed < 2**31 for seed in baseline.prompts)


def test_block_size_is_checked_against_the_drafter(pipe):
    backend = LocalBackend(pipe)
    assert backend.block_size(4) == 4
    with pytest.raises(UserError, match="block_size 99 is not usable"):
        backend.block_size(99)


def test_first_turns_past_the_context_fail_before_any_decoding(pipe):
    recorder = RecordingEngine(SpeculativeEngine(pipe.target))
    backend = LocalBackend(pipe, baseline=recorder)
    long = Sample("long-one", ("count the words " * 60,))
    data = {"gsm8k": [SAMPLES[0], long], "mt-bench": [Sample("81", ("Hi.", "More."))]}
    config = LocalConfig(max_new_tokens=256)
    with pytest.raises(UserError) as err:
        backend.check_context(data, config)
    message = str(err.value)
    n = len(pipe.encode([{"role": "user", "content": long.turns[0]}]))
    assert message.startswith(f"1 prompt(s) do not fit the target's context of 1024 tokens with --max-new-tokens "
                              f"256: gsm8k sample long-one ({n} tokens); lower --max-new-tokens to {1024 - n} or less")
    assert recorder.prompts == []  # nothing decoded
    backend.check_context(data, LocalConfig(max_new_tokens=1024 - n))  # the advice is right


def test_a_later_turn_past_the_context_ends_its_conversation(pipe, monkeypatch):
    sample = Sample("81", ("Write about clips.", "Now write much more: " + "clips and pens " * 60))
    first = len(pipe.encode([{"role": "user", "content": sample.turns[0]}]))
    config = LocalConfig(max_new_tokens=8, warmup_tokens=0)
    room = first + 8 + 8  # the first turn fits, the second cannot
    monkeypatch.setattr(pipe.target.config, "max_position_embeddings", room)
    backend = LocalBackend(pipe)
    backend.check_context({"mt-bench": [sample]}, config)
    result = backend.run("mt-bench", [sample, Sample("82", ("Hi.",))], config)
    assert result.skipped_turns == ["81#1"]
    assert result.num_prompts == 2 and result.num_requests == 2 and result.mismatches == 0


def test_answers_of_the_prefills_token_alone_measure_no_speedup(pipe):
    """--max-new-tokens 1 timed the same prefill on both sides and reported its ratio (0.95x) as a speedup."""
    result = LocalBackend(pipe).run("gsm8k", SAMPLES[:1], LocalConfig(max_new_tokens=1, warmup_tokens=0))
    assert result.speedup is None and result.mean_acceptance_length is None
    assert "no verify step was measured (every answer ended at the prefill's first token)" in result.notes[-1]
    from dflash.bench.metrics import few_steps_note

    assert few_steps_note(1, 2) == ("only 1 verify step (2 output tokens) was measured, too few for a steady tau or "
                                    "speedup: raise --max-samples or --max-new-tokens")
