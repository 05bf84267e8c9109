"""Losslessness: speculative output == the target alone, for every family, block size, batch shape and
acceptance pattern (a random drafter rejects almost everything, an oracle accepts whole blocks, a partial
oracle is right for a random number of tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import VOCAB, OracleProposer, blocks_wanted, hf_greedy, partial_oracle, random_prompts, tiny_drafter
from dflash.decoding import DFlashProposer, GenerationConfig, NoDraftProposer, SpeculativeEngine
from dflash.decoding.engine import GenerationError, StepProfile

MAX_NEW = 48


def decode_to_the_end(engine, batch) -> None:
    """Step until every row has finished, dropping rows as they finish."""
    while batch is not None:
        engine.step(batch)
        batch = engine.drop_finished(batch)


def oracle_decoding(target, prompt_seed: int, correct, seed: int, max_new: int = 40):
    """An engine whose drafter is right for `correct(rng)` tokens per block, three new sequences to decode
    with it, and their reference outputs (transformers' greedy decoding)."""
    prompts = random_prompts(3, seed=prompt_seed)
    refs = {tuple(p): hf_greedy(target, p, max_new) for p in prompts}
    engine = SpeculativeEngine(target, OracleProposer(tiny_drafter(target), target, refs, correct=correct, seed=seed))
    config = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    return engine, [engine.new_sequence(p, config) for p in prompts], [refs[tuple(p)] for p in prompts]


@pytest.fixture
def references(target):
    prompts = random_prompts(3, seed=1)
    return prompts, {tuple(p): hf_greedy(target, p, MAX_NEW) for p in prompts}


def test_plain_decoding_matches_transformers_generate(target, references):
    prompts, refs = references
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert all(o.stats.acceptance_lengths == [1] * MAX_NEW for o in outs)


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("drafting", ["random", "oracle", "partial"])
def test_speculative_greedy_is_lossless(target, references, block_size, drafting):
    prompts, refs = references
    drafter = tiny_drafter(target, layers=2)
    if drafting == "random":
        proposer = DFlashProposer(drafter, target)
    else:
        correct = None if drafting == "oracle" else (lambda rng: rng.randint(0, block_size - 1))
        proposer = OracleProposer(drafter, target, refs, correct=correct, seed=block_size)
    engine = SpeculativeEngine(target, proposer)
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=block_size, ignore_eos=True)
    batch = engine.generate(prompts, config)
    singles = [engine.generate([p], config)[0] for p in prompts]
    for prompt, out, single in zip(prompts, batch, singles):
        assert out.output_ids == refs[tuple(prompt)]
        assert single.output_ids == refs[tuple(prompt)]
        assert sum(out.stats.acceptance_lengths) == len(out.output_ids) == MAX_NEW
        assert max(out.stats.acceptance_lengths) <= block_size
        assert single.stats.block_sizes == blocks_wanted(single.stats.acceptance_lengths, block_size, MAX_NEW)
        assert all(blocks_wanted(out.stats.acceptance_lengths, block_size, MAX_NEW)[i] <= k <= block_size
                   for i, k in enumerate(out.stats.block_sizes))  # its batch may want more than it
    taus = [o.stats.mean_acceptance_length for o in batch]
    if drafting == "oracle":  # whole blocks accepted, except where max_new_tokens cuts the last one
        assert all(t > block_size - 1 for t in taus), taus
    elif drafting == "partial" and block_size > 2:  # ragged: rows accept different numbers per step
        lengths = {tuple(o.stats.acceptance_lengths) for o in batch}
        assert len(lengths) > 1 and 1 < sum(taus) / len(taus) < block_size


def test_ragged_batch_compacts_and_stays_lossless(target):
    """Long enough that holes pile up past the compaction threshold."""
    prompts = random_prompts(4, seed=5, low=2, high=30)
    refs = {tuple(p): hf_greedy(target, p, 120) for p in prompts}
    proposer = OracleProposer(tiny_drafter(target), target, refs, correct=lambda rng: rng.choice([0, 15]), seed=3)
    engine = SpeculativeEngine(target, proposer)
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=120, ignore_eos=True))
    assert [o.output_ids for o in outs] == [refs[tuple(p)] for p in prompts]


def test_rows_finishing_at_different_times(target):
    prompts = random_prompts(3, seed=2)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (5, 30, 17)]
    expected = [engine.generate([p], c)[0].output_ids for p, c in zip(prompts, configs)]
    # one batch where rows leave early: simulate with per-row limits via separate sequences
    batch = engine.merge([engine.prefill(engine.new_sequence(p, c)) for p, c in zip(prompts, configs)])
    seqs = list(batch.sequences)
    batch = engine.drop_finished(batch)
    decode_to_the_end(engine, batch)
    assert [s.output_ids for s in seqs] == expected
    assert [len(s.output_ids) for s in seqs] == [5, 30, 17]


def test_joining_a_running_batch_is_lossless(target):
    """Continuous batching: a sequence prefilled later merges into a batch mid-decode."""
    engine, seqs, expected = oracle_decoding(target, prompt_seed=9, correct=lambda rng: rng.randint(0, 7), seed=1)
    batch = engine.merge([engine.prefill(seqs[0]), engine.prefill(seqs[1])])
    for _ in range(3):
        engine.step(batch)
    batch = engine.merge([batch, engine.prefill(seqs[2])])
    decode_to_the_end(engine, batch)
    assert [s.output_ids for s in seqs] == expected


def kv_storage(batch) -> list[int]:
    """Where every KV buffer of the batch's target and drafter caches lives."""
    buffers = [b for layer in batch.target_cache.layers for b in (layer._keys, layer._values)]
    buffers += batch.draft_state.cache._keys + batch.draft_state.cache._values
    return [b._data.data_ptr() for b in buffers]


def test_a_joining_row_brings_its_prompt_read_and_the_merged_caches_keep_room(target):
    """A row joining a batch has its prompt in the drafter's cache already, so the batch's next draft reads only
    the step's new context (before, it read the prompt padded to every row, and kept those holes); and the
    merged caches have spare room, so that step writes into them instead of copying them again."""
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target, block_size=8), target))
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    short, long = random_prompts(2, seed=13, low=5, high=8)
    long = (long * 10)[:60]
    seqs = [engine.new_sequence(short, config), engine.new_sequence(long, config)]
    batch = engine.prefill(seqs[0])
    for _ in range(2):
        engine.step(batch)
    joining = engine.prefill(seqs[1])
    assert joining.draft_state.cache.num_slots == len(long) and joining.draft_state.pending.features.shape[1] == 0
    batch = engine.merge([batch, joining])
    slots, storage = batch.draft_state.cache.num_slots, kv_storage(batch)
    engine.step(batch)
    assert batch.draft_state.cache.num_slots <= slots + 8  # the step's accepted tokens at most, not the prompt
    assert kv_storage(batch) == storage  # nothing was reallocated
    decode_to_the_end(engine, batch)
    assert [s.output_ids for s in seqs] == [engine.generate([p], config)[0].output_ids for p in (short, long)]


def test_moving_rows_between_plain_and_drafted_decoding_is_lossless(target):
    """What the server's fallback does: rows leave their batch and rejoin one of the other proposer."""
    engine, seqs, expected = oracle_decoding(target, prompt_seed=4, correct=lambda rng: rng.randint(2, 7), seed=2)
    drafting = engine.proposer
    batch = engine.merge([engine.prefill(s, NoDraftProposer()) for s in seqs])
    for proposer in (drafting, NoDraftProposer(), drafting):
        for _ in range(3):
            engine.step(batch)
        batch = engine.merge([engine.rejoin(s, proposer) for s in batch.sequences])
    decode_to_the_end(engine, batch)
    assert [s.output_ids for s in seqs] == expected
    lengths = [s.stats.acceptance_lengths for s in seqs]
    assert all(n == 1 for row in lengths for n in row[1:4] + row[7:10])  # plain steps: one token each
    assert all(min(row[4:7]) >= 3 for row in lengths)  # drafted steps after the first move


def test_sampling_batch_equals_batch_of_one_and_seeds_repeat(target):
    prompts = random_prompts(3, seed=4)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    config = GenerationConfig(max_new_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    batch = [o.output_ids for o in engine.generate(prompts, config)]
    singles = [engine.generate([p], config)[0].output_ids for p in prompts]
    assert batch == singles
    other_seed = engine.generate(prompts[:1], GenerationConfig(**{**config.__dict__, "seed": 7}))[0].output_ids
    assert other_seed != singles[0]


SEEDED = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("drafting", ["random", "partial"])
def test_seeded_sampling_is_the_target_alones_output(target, block_size, drafting):
    """With a seed, every position's draw is fixed by the seed: drafting at any block size, in a batch or
    alone, gives token for token what the target alone samples."""
    prompts = random_prompts(3, seed=5)
    config = GenerationConfig(**SEEDED, block_size=block_size)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, GenerationConfig(**SEEDED))]
    refs = {tuple(p): out for p, out in zip(prompts, plain)}
    drafter = tiny_drafter(target, layers=2)
    if drafting == "random":
        proposer = DFlashProposer(drafter, target)
    else:
        proposer = OracleProposer(drafter, target, refs, correct=lambda rng: rng.randint(0, block_size - 1))
    engine = SpeculativeEngine(target, proposer)
    batch = engine.generate(prompts, config)
    assert [o.output_ids for o in batch] == plain
    assert [engine.generate([p], config)[0].output_ids for p in prompts] == plain
    if drafting == "partial" and block_size > 2:  # draft tokens were accepted, not only bonus tokens kept
        assert all(o.stats.mean_acceptance_length > 1.3 for o in batch)
    other = engine.generate(prompts[:1], GenerationConfig(**{**SEEDED, "seed": 12}))[0].output_ids
    assert other != plain[0]


def test_seeded_sampling_survives_moving_between_plain_and_drafted_decoding(target):
    prompts = random_prompts(2, seed=8)
    config = GenerationConfig(**SEEDED)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, config)]
    refs = {tuple(p): out for p, out in zip(prompts, plain)}
    drafting = OracleProposer(tiny_drafter(target), target, refs, correct=lambda rng: rng.randint(0, 6))
    engine = SpeculativeEngine(target, drafting)
    seqs = [engine.new_sequence(p, config) for p in prompts]
    batch = engine.merge([engine.prefill(s) for s in seqs])
    for proposer in (NoDraftProposer(), drafting.with_block_size(4), drafting):
        for _ in range(3):
            engine.step(batch)
        batch = engine.merge([engine.rejoin(s, proposer) for s in batch.sequences])
    decode_to_the_end(engine, batch)
    assert [s.output_ids for s in seqs] == plain


def test_sampling_without_a_seed_uses_rejection_sampling_and_varies(target):
    prompt = random_prompts(1, seed=9)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    config = GenerationConfig(max_new_tokens=30, temperature=1.5, ignore_eos=True)
    seq = engine.new_sequence(prompt, config)
    assert seq.noise is None and seq.generator is not None
    first, second = (engine.generate([prompt], config)[0].output_ids for _ in range(2))
    assert first != second


@pytest.mark.parametrize("drafting", ["dflash", "draft model"])
def test_unseeded_speculative_sampling_follows_the_targets_distribution(drafting):
    """The engine's rejection sampling end to end (the drafter's distribution handed to verification, accepted,
    recovered and bonus tokens): the first three tokens of many unseeded generations are counted against the
    target's own probabilities of each triple. A random DFlash drafter is rejected at nearly every step (recovered
    tokens); a perturbed copy of the target as draft model is accepted often (accepted and bonus tokens)."""
    from conftest import check_triples_follow_the_target, perturbed_copy, tiny_target_model
    from dflash.decoding.draft_model import DraftModelProposer
    from dflash.decoding.sampling import SamplingParams
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    proposer = (DFlashProposer(tiny_drafter(target), target) if drafting == "dflash"
                else DraftModelProposer(perturbed_copy(target, 0.5), target, 4))
    engine = SpeculativeEngine(target, proposer)
    params = SamplingParams(temperature=1.0, top_k=3)  # three tokens per position: 27 triples to count
    config = GenerationConfig(max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, block_size=4)
    prompt = random_prompts(1, seed=21)[0]
    draws = 1500
    counts: dict[tuple, int] = {}
    for _ in range(draws // 500):
        for out in engine.generate([prompt] * 500, config):
            counts[tuple(out.output_ids)] = counts.get(tuple(out.output_ids), 0) + 1
    check_triples_follow_the_target(target.model, params, prompt, counts)


def test_stop_tokens_strings_and_limits(target):
    prompt = random_prompts(1, seed=3)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    free = engine.generate([prompt], GenerationConfig(max_new_tokens=30, ignore_eos=True))[0].output_ids
    stop_at = free[10]
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.output_ids == free[: free.index(stop_at) + 1] and out.finish_reason == "stop"
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=7, ignore_eos=True))[0]
    assert out.output_ids == free[:7] and out.finish_reason == "length"


def test_stop_token_ids_stop_besides_eos_unless_eos_is_ignored(target, monkeypatch):
    """As vLLM's stop_token_ids and ignore_eos: a caller's stop ids add to the target's EOS, they do not replace it
    (replacing it let an answer run on past its end into a made-up next turn)."""
    prompt = random_prompts(1, seed=3)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    free = engine.generate([prompt], GenerationConfig(max_new_tokens=30, ignore_eos=True))[0].output_ids
    eos, stop_at = list(dict.fromkeys(free))[1:4:2]  # stop_at first occurs after eos does
    monkeypatch.setattr(target, "eos_token_ids", lambda: [eos])
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.output_ids == free[: free.index(eos) + 1] and out.finish_reason == "stop"
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=30, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.output_ids == free[: free.index(stop_at) + 1] and out.finish_reason == "stop"
    assert engine.generate([prompt], GenerationConfig(max_new_tokens=30, ignore_eos=True))[0].output_ids == free


def test_stream_yields_the_same_tokens(target):
    prompt = random_prompts(1, seed=6)[0]
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    config = GenerationConfig(max_new_tokens=25, ignore_eos=True)
    stream = engine.stream(prompt, config)
    pieces = list(stream)
    assert sum(pieces, []) == stream.result.output_ids == engine.generate([prompt], config)[0].output_ids
    assert [len(p) for p in pieces] == stream.result.stats.acceptance_lengths


def nan_after(target, forwards: int, monkeypatch) -> None:
    """The target's logits hold a NaN (one token's, every position) from its `forwards`-th forward on, as a float16
    overflow would leave them."""
    original, calls = target.forward, []

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(1)
        if len(calls) >= forwards:
            logits = out.logits.clone()
            logits[..., 3] = float("nan")
            out = dataclasses.replace(out, logits=logits)
        return out

    monkeypatch.setattr(target, "forward", forward)


@pytest.mark.parametrize("forwards", [1, 3])  # in the prefill, and in a verify step
@pytest.mark.parametrize("setting", ["no draft", "block 4", "branch"])
def test_nan_logits_stop_greedy_decoding_with_the_fix_not_garbage(forwards, setting, monkeypatch):
    """Greedy decoding took argmax's pick of a NaN row (the NaN's own index) as a token and went on; it stops with
    the error sampling gives, which says how to load the model."""
    from conftest import tiny_target_model
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    proposer = NoDraftProposer() if setting == "no draft" else DFlashProposer(tiny_drafter(target), target)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, block_size=None if setting == "no draft" else 4,
                              branch_length=2 if setting == "branch" else 0)
    engine = SpeculativeEngine(target, proposer)  # its probe forwards at load see sound logits
    nan_after(target, forwards, monkeypatch)
    outputs = engine.generate([[5, 6, 7], [8, 9]], config)
    assert [out.finish_reason for out in outputs] == ["error", "error"]
    assert [len(out.output_ids) for out in outputs] == [0, 0] if forwards == 1 else [1, 1]  # the prefill's token
    with pytest.raises(GenerationError, match="logits are NaN.*load the model in bfloat16 or float32"):
        outputs[1].raise_for_error()


@pytest.mark.parametrize("where", ["prefill", "step"])
def test_generate_finishes_a_row_without_a_token_as_an_error_and_decodes_the_others(where, monkeypatch):
    """`generate` failed the whole call on one prompt's NaN logits, so a datagen batch lost its other answers and
    a rerun met the same prompt again; that prompt now finishes with finish_reason "error" and the others decode
    to their own outputs."""
    from conftest import tiny_target_model
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    config = GenerationConfig(max_new_tokens=14, ignore_eos=True, block_size=4)
    prompts = random_prompts(3, seed=12)
    alone = [engine.generate([p], config)[0] for p in prompts]
    original, calls = target.forward, []

    def forward(*args, **kwargs):  # prompt 1's prefill (the 2nd forward), or row 1 of the first 3-row step
        out = original(*args, **kwargs)
        calls.append(out.logits.shape[0])
        first_step = calls[-1] == 3 and calls.count(3) == 1
        if not ((where == "prefill" and len(calls) == 2) or (where == "step" and first_step)):
            return out
        logits = out.logits.clone()
        logits[0 if where == "prefill" else 1, :, 3] = float("nan")
        return dataclasses.replace(out, logits=logits)

    monkeypatch.setattr(target, "forward", forward)
    outputs = engine.generate(prompts, config)
    assert [out.finish_reason for out in outputs] == ["length", "error", "length"]
    assert "NaN" in outputs[1].error and outputs[0].error is None and outputs[2].error is None
    assert len(outputs[1].output_ids) == (0 if where == "prefill" else 1)
    assert [outputs[r].output_ids for r in (0, 2)] == [alone[0].output_ids, alone[2].output_ids]
    assert outputs[0].raise_for_error() is outputs[0]
    with pytest.raises(GenerationError, match="logits are NaN"):
        outputs[1].raise_for_error()


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "unseeded"])
@pytest.mark.parametrize("branch_length", [0, 2])
def test_a_rows_nan_logits_fail_that_row_alone_and_the_others_decode_on(sampling, branch_length, monkeypatch):
    """One row's NaN logits (a float16 overflow on its text) failed the whole step, so a server failed every
    request decoding with it; the step now finishes that row with finish_reason 'error', raises RowsFailed with the
    others' tokens, and the others decode on to their own outputs."""
    from conftest import tiny_target_model
    from dflash.decoding.verify import RowsFailed
    from dflash.model import TargetModel

    if branch_length and sampling == "unseeded":
        pytest.skip("a branch is verified for greedy and seeded rows only")
    target = TargetModel(tiny_target_model())
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    temperature, seed = {"greedy": (0.0, None), "seeded": (0.8, 3), "unseeded": (0.8, None)}[sampling]
    config = GenerationConfig(max_new_tokens=14, ignore_eos=True, temperature=temperature, seed=seed, block_size=4,
                              branch_length=branch_length)
    prompts = random_prompts(3, seed=11)
    alone = [engine.generate([p], config)[0].output_ids for p in prompts]
    rows = [engine.new_sequence(p, config) for p in prompts]
    batch = engine.merge([engine.prefill(seq) for seq in rows])
    original = target.forward

    def forward(*args, **kwargs):  # row 1's logits hold a NaN in this one forward
        out = original(*args, **kwargs)
        logits = out.logits.clone()
        logits[1, :, 3] = float("nan")
        return dataclasses.replace(out, logits=logits)

    monkeypatch.setattr(target, "forward", forward)
    with pytest.raises(RowsFailed, match="logits are NaN.*load the model in bfloat16 or float32") as failed:
        engine.step(batch)
    monkeypatch.setattr(target, "forward", original)
    assert failed.value.kept[1] == [] and all(failed.value.kept[r] for r in (0, 2))
    assert rows[1].finish_reason == "error" and "NaN" in rows[1].error and len(rows[1].output_ids) == 1  # prefill's
    batch = engine.drop_finished(batch)
    assert batch.sequences == [rows[0], rows[2]]
    while batch is not None:
        engine.step(batch)
        batch = engine.drop_finished(batch)
    assert [rows[0].finish_reason, rows[2].finish_reason] == ["length", "length"]
    if sampling != "unseeded":  # greedy and seeded text is the target's own, whatever the batch went through
        assert [rows[0].output_ids, rows[2].output_ids] == [alone[0], alone[2]]


def nan_proposer(kind: str, target, monkeypatch):
    """A proposer whose drafter gives NaN logits (a float16 overflow in the drafter alone)."""
    from conftest import dflash2_drafter, perturbed_copy
    from dflash.decoding.draft_model import DraftModelProposer

    if kind == "draft model":
        draft = perturbed_copy(target, 0.5)
        proposer = DraftModelProposer(draft, target, 4)  # its checks at load see sound outputs
        original = draft.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            return dataclasses.replace(out, logits=torch.full_like(out.logits, float("nan")))

        monkeypatch.setattr(draft, "forward", forward)
        return proposer
    drafter = dflash2_drafter(target) if kind == "dflash2" else tiny_drafter(target)
    proposer = DFlashProposer(drafter, target)  # its probe forwards at load see sound outputs
    original = drafter.forward
    monkeypatch.setattr(drafter, "forward", lambda *a, **k: torch.full_like(original(*a, **k), float("nan")))
    return proposer


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "draft model"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "unseeded"])
def test_nan_from_the_drafter_alone_costs_drafts_not_the_answer(kind, sampling, monkeypatch):
    """A drafter only proposes: NaN in its logits (a float16 overflow in it alone) stopped sampled decoding with
    the target's error, though the target was sound; now such a draft proposes at random and the text is the
    target's own."""
    from conftest import tiny_target_model
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    temperature, seed = {"greedy": (0.0, None), "seeded": (0.8, 3), "unseeded": (0.8, None)}[sampling]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=seed,
                              block_size="auto" if kind == "dflash" else None)
    prompts = [[5, 6, 7], [8, 9]]
    drafted = SpeculativeEngine(target, nan_proposer(kind, target, monkeypatch)).generate(prompts, config)
    assert [len(out.output_ids) for out in drafted] == [12, 12]
    if sampling != "unseeded":
        alone = SpeculativeEngine(target, NoDraftProposer()).generate(prompts, config)
        assert [out.output_ids for out in drafted] == [out.output_ids for out in alone]


@pytest.mark.parametrize("bad", [
    dict(prompt=[], config=GenerationConfig()),
    dict(prompt=[VOCAB + 5], config=GenerationConfig()),
    dict(prompt=[1, 2], config=GenerationConfig(max_new_tokens=5000)),
    dict(prompt=[1, 2], config=GenerationConfig(block_size=17)),
])
def test_bad_requests_are_refused_clearly(target, bad):
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    with pytest.raises(GenerationError):
        engine.generate([bad["prompt"]], bad["config"])


def test_the_low_level_pieces_say_what_they_take():
    """Each was an AttributeError or a TypeError from deep inside ('<=' not supported, no attribute 'eval')."""
    from conftest import tiny_target_model
    from dflash.errors import UserError
    from dflash.model import TargetModel

    model = tiny_target_model()
    with pytest.raises(UserError, match="TargetModel wraps a loaded transformers causal LM, not a str"):
        TargetModel("Qwen/Qwen3-8B")
    with pytest.raises(GenerationError, match="SpeculativeEngine takes a TargetModel, not a Qwen3ForCausalLM"):
        SpeculativeEngine(model)
    target = TargetModel(model)
    drafter = tiny_drafter(target)
    with pytest.raises(UserError, match="DFlashProposer takes \\(drafter, target\\).* not a TargetModel and a "
                                        "DFlashDraftModel"):
        DFlashProposer(target, drafter)
    engine = SpeculativeEngine(target, DFlashProposer(drafter, target))
    for prompts, named in (([[5, 6], "hello"], "prompts is a list of prompts"),
                           ([5, 6, 7], "prompts is a list of prompts"),
                           ([[5, 6.5]], "prompt token ids must be a list of ints")):
        with pytest.raises(GenerationError, match=named):
            engine.generate(prompts, GenerationConfig(max_new_tokens=2))
    with pytest.raises(GenerationError, match="config is a GenerationConfig"):
        engine.generate([[5, 6]], {"max_new_tokens": 2})


def test_no_prompts_decode_to_no_outputs(target):
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    assert engine.generate([], GenerationConfig(max_new_tokens=4)) == []


def test_a_request_beyond_the_context_is_told_how_many_tokens_fit(target):
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))  # block 16, context 1024
    with pytest.raises(GenerationError, match=r"a prompt of 2 tokens leaves room for at most 1022 new tokens, not "
                                              r"max_new_tokens=5000: the target's context is 1024 tokens"):
        engine.generate([[1, 2]], GenerationConfig(max_new_tokens=5000))
    with pytest.raises(GenerationError, match=r"a prompt of 1030 tokens leaves room for at most 0 new tokens, not "
                                              r"max_new_tokens=1: .*; shorten the prompt$"):  # nothing else helps
        engine.generate([[1] * 1030], GenerationConfig(max_new_tokens=1))


def test_a_block_size_the_drafter_cannot_verify_is_refused_in_any_rows_config(target):
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    configs = [GenerationConfig(max_new_tokens=4), GenerationConfig(max_new_tokens=4, block_size=17)]
    with pytest.raises(GenerationError, match="prompt 1: block_size 17 is not usable with this drafter"):
        engine.generate([[1, 2], [3, 4]], configs)


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", -1), ("temperature", -1), ("top_p", 0), ("top_k", -2),
    ("max_new_tokens", "10"), ("max_new_tokens", 2.5), ("temperature", "0.5"), ("top_k", 1.5), ("seed", "1"),
    ("stop_token_ids", [1, "2"]), ("stop_strings", [1]), ("block_size", 8.0), ("block_size", "big"),
])
def test_bad_generation_config(field, value):
    with pytest.raises(GenerationError, match=field):
        GenerationConfig(**{field: value})


def test_one_stop_string_is_not_split_into_characters():
    assert GenerationConfig(stop_strings="###").stop_strings == ["###"]


def test_a_stop_string_of_a_byte_that_was_not_utf8_is_refused():
    """A lone surrogate (Python's stand-in for such a byte) is in no decoded text: it was taken, and never matched."""
    with pytest.raises(GenerationError, match=r"the stop string 'ab\\udcff' is not valid text: character 2 "
                                              r"\('\\udcff'\) stands for a byte that was not UTF-8"):
        GenerationConfig(stop_strings=["###", "ab\udcff"])


def test_numpy_integers_are_integers():
    np = pytest.importorskip("numpy")
    assert GenerationConfig(max_new_tokens=np.int64(3), seed=np.int32(7), temperature=np.float32(0.5)).seed == 7


def test_the_step_profile_splits_a_step_and_waits_for_a_gpu_only_when_asked(target, monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    for synchronize, device, waits in ((True, "cuda:0", 1), (False, "cuda:0", 0), (True, "cpu", 0)):
        StepProfile(synchronize=synchronize).mark(torch.device(device))
        assert len(waited) == waits
        waited.clear()
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target, block_size=4), target))
    engine.profile = StepProfile(synchronize=True)
    engine.generate([random_prompts(1, 6)[0]], GenerationConfig(max_new_tokens=9))
    profile = engine.profile
    assert profile.steps >= 3 and profile.draft_s > 0 and profile.target_s > 0
    assert 0 <= profile.overhead_s < profile.total_s


def test_min_p_sampling_is_the_target_alones_seeded_and_follows_it_unseeded():
    """min_p goes through the same transform as top-k and top-p: seeded, every block size gives the target alone's
    tokens; unseeded, the first three tokens follow the target's min-p distribution (chi-square)."""
    from conftest import check_triples_follow_the_target, tiny_target_model
    from dflash.decoding.sampling import SamplingParams
    from dflash.model import TargetModel

    target = TargetModel(tiny_target_model())
    prompts = random_prompts(2, seed=22)
    seeded = dict(max_new_tokens=24, temperature=1.0, min_p=0.2, seed=5, ignore_eos=True)
    plain = [o.output_ids for o in SpeculativeEngine(target).generate(prompts, GenerationConfig(**seeded))]
    refs = {tuple(p): out for p, out in zip(prompts, plain)}
    engine = SpeculativeEngine(target, partial_oracle(target, refs, 8))
    drafted = engine.generate(prompts, GenerationConfig(**seeded, block_size=8))
    assert [o.output_ids for o in drafted] == plain and all(o.stats.mean_acceptance_length > 1.3 for o in drafted)
    params = SamplingParams(temperature=1.0, min_p=0.3)
    config = GenerationConfig(max_new_tokens=3, temperature=1.0, min_p=0.3, ignore_eos=True, block_size=4)
    engine = SpeculativeEngine(target, DFlashProposer(tiny_drafter(target), target))
    counts: dict[tuple, int] = {}
    for _ in range(3):
        for out in engine.generate([prompts[0]] * 500, config):
            counts[tuple(out.output_ids)] = counts.get(tuple(out.output_ids), 0) + 1
    check_triples_follow_the_target(target.model, params, prompts[0], counts)
