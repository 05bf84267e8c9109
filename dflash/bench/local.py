"""The local backend: the same target decodes every prompt twice in one process, plainly (the baseline)
and with DFlash, after a warm-up. The two outputs must be identical token for token, at any temperature:
greedy decoding is lossless, and every turn is sampled with its own seed (`datasets.request_seed`), which fixes
each position's draw whatever the drafting (`dflash.decoding.sampling.PositionNoise`). Every difference is
counted in `mismatches`.

For multi-turn samples (mt-bench) each next turn follows the model's own previous answer: the baseline's,
so both methods see exactly the same prompt at every turn.

Every first turn must fit the target's context with max_new_tokens to spare (`check_context`, before any
decoding); a later turn that would not (it grows with the answers) ends its conversation there, and the
turns left out are listed in `skipped_turns`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from dflash.bench.datasets import Sample, request_seed
from dflash.bench.metrics import (
    DRAFT_MODEL,
    BenchResult,
    acceptance_histogram,
    acceptance_rate_per_position,
    few_steps_note,
    mean_acceptance_length,
    mean_ms,
    ratio,
)
from dflash.decoding.detokenizer import decode
from dflash.decoding.engine import AUTO, GenerationConfig, GenerationOutput, SpeculativeEngine
from dflash.errors import UserError
from dflash.model.target import TargetModel


class Engine(Protocol):  # as `SpeculativeEngine.generate_one`: the bench decodes one prompt at a time
    def generate_one(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationOutput: ...


@dataclass
class LocalConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    block_size: int | str | None = None  # None: the drafter's own; "auto": chosen before every step
    seed: int = 0
    warmup_tokens: int = 16  # a short generation per engine before timing (0: none)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    branch_length: int = 0  # DFlash runs: a branch of this many tokens with each greedy block (`decoding.branch`)


@dataclass
class TurnRecord:
    sample_id: str
    turn: int
    baseline: GenerationOutput
    dflash: GenerationOutput


@dataclass
class Conversation:
    records: list[TurnRecord]
    skipped_turns: list[str] = field(default_factory=list)  # "id#turn": later turns past the context


class LocalBackend:
    """Plain decoding and DFlash on one target. Engines can be swapped (tests plant a faulty one)."""

    def __init__(self, pipe, baseline: Engine | None = None, dflash: Engine | None = None):
        if pipe.drafter is None and dflash is None:
            raise UserError("dflash bench compares DFlash with plain decoding and needs a drafter: "
                            "drop --no-draft, or pass --draft with --target")
        self.pipe = pipe
        self.baseline = baseline or SpeculativeEngine(pipe.target)  # the same target, no drafter
        self.dflash = dflash or pipe.engine

    def block_size(self, requested: int | str | None) -> int:
        """The (largest) block size a run uses; raises a UserError if the drafter cannot use `requested`."""
        return self.pipe.engine.proposer_for(GenerationConfig(block_size=requested)).block_size

    def fits(self, prompt_len: int, config: LocalConfig) -> bool:
        """Whether a prompt this long leaves max_new_tokens of room in the target's context
        (`SpeculativeEngine.room`)."""
        room = self.pipe.engine.room(prompt_len)
        return room is None or config.max_new_tokens <= room

    def check_context(self, data: dict[str, list[Sample]], config: LocalConfig) -> None:
        """Before any decoding: every first turn must fit, or the run would stop on it after hours of work."""
        too_long = [(f"{name} sample {s.id}", n) for name, samples in data.items() for s in samples
                    if not self.fits(n := len(self.encode(first_turn(s))), config)]
        if too_long:
            raise UserError(self._too_long_message(too_long, config))

    def _too_long_message(self, too_long: list[tuple[str, int]], config: LocalConfig) -> str:
        engine = self.pipe.engine
        most_new_tokens = engine.room(max(n for _, n in too_long))
        fix = (f"lower --max-new-tokens to {most_new_tokens} or less, or leave them out of the data (--data-file)"
               if most_new_tokens >= 1 else "leave them out of the data (--data-file)")
        shown = ", ".join(f"{key} ({n} tokens)" for key, n in too_long[:10])
        return (f"{len(too_long)} prompt(s) do not fit the target's context of {engine.target.context_words} with "
                "--max-new-tokens "
                f"{config.max_new_tokens}: {shown}{' ...' if len(too_long) > 10 else ''}; "
                f"{fix}")

    def run(self, dataset: str, samples: list[Sample], config: LocalConfig,
            on_turn: Callable[[], None] | None = None) -> BenchResult:
        block_size = self.block_size(config.block_size)
        self.warm_up(samples[0], config)
        records, skipped = [], []
        for index, sample in enumerate(samples):
            conversation = self.run_sample(sample, config, index, on_turn=on_turn)
            records.extend(conversation.records)
            skipped.extend(conversation.skipped_turns)
        result = summarize(dataset, len(samples), records, config, block_size)
        result.drafter = DRAFT_MODEL if isinstance(self.pipe.drafter, TargetModel) else result.drafter
        result.skipped_turns = skipped
        if config.block_size == AUTO:
            result.block_size = AUTO  # the histogram spans the drafter's whole block
        return result

    def warm_up(self, sample: Sample, config: LocalConfig) -> None:
        if config.warmup_tokens <= 0:
            return
        ids = self.encode(first_turn(sample))
        short = min(config.warmup_tokens, config.max_new_tokens)
        self.baseline.generate_one(ids, self.generation_config(config, short, baseline=True))
        self.dflash.generate_one(ids, self.generation_config(config, short, baseline=False))

    def run_sample(self, sample: Sample, config: LocalConfig, index: int,
                   on_turn: Callable[[], None] | None = None) -> Conversation:
        """Sample `index` of the dataset's, each turn decoded plainly and with DFlash with one seed
        (`request_seed`)."""
        messages = list(sample.history)
        conversation = Conversation([])
        for turn, text in enumerate(sample.turns):
            messages.append({"role": "user", "content": text})
            ids = self.encode(messages)
            if not self.fits(len(ids), config):  # the answers so far left no room for this turn
                conversation.skipped_turns = [f"{sample.id}#{t}" for t in range(turn, len(sample.turns))]
                break
            seed = request_seed(config.seed, index, turn)
            base_cfg = self.generation_config(config, config.max_new_tokens, baseline=True, seed=seed)
            dflash_cfg = self.generation_config(config, config.max_new_tokens, baseline=False, seed=seed)
            baseline = self.baseline.generate_one(ids, base_cfg)
            dflash = self.dflash.generate_one(ids, dflash_cfg)
            conversation.records.append(TurnRecord(sample.id, turn, baseline, dflash))
            messages.append({"role": "assistant", "content": self.answer_text(baseline)})
            if on_turn is not None:
                on_turn()
        return conversation

    def encode(self, messages: list[dict]) -> list[int]:
        """The chat template's tokens, or for a target without one (a base model) the turns as plain text, as
        `dflash datagen` gives them (`DFlash.encode`)."""
        return self.pipe.encode(messages)

    def answer_text(self, output: GenerationOutput) -> str:
        if output.text is not None:
            return output.text
        return decode(self.pipe.tokenizer, output.output_ids)

    @staticmethod
    def generation_config(config: LocalConfig, max_new_tokens: int, baseline: bool,
                          seed: int | None = None) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, temperature=config.temperature,
                                top_p=config.top_p, top_k=config.top_k, seed=seed if seed is not None else config.seed,
                                block_size=None if baseline else config.block_size,
                                branch_length=0 if baseline else config.branch_length)


def first_turn(sample: Sample) -> list[dict]:
    return list(sample.history) + [{"role": "user", "content": sample.turns[0]}]


def summarize(dataset: str, num_prompts: int, records: list[TurnRecord], config: LocalConfig,
              block_size: int) -> BenchResult:
    """Pool the per-turn outputs of one dataset into its numbers."""
    base = [r.baseline for r in records]
    fast = [r.dflash for r in records]
    steps = [n for out in fast for n in out.stats.acceptance_lengths[1:]]  # verify steps only
    blocks = [b for out in fast for b in out.stats.block_sizes]
    hist = acceptance_histogram(steps, block_size)
    base_tps, fast_tps = tokens_per_s(base), tokens_per_s(fast)
    mismatched = [f"{r.sample_id}#{r.turn}" for r in records if r.baseline.output_ids != r.dflash.output_ids]
    result = BenchResult(
        dataset=dataset, backend="local", num_prompts=num_prompts, num_requests=len(records),
        block_size=block_size, mean_block_size=sum(blocks) / len(blocks) if blocks else None,
        branch_length=config.branch_length,
        concurrency=1, temperature=config.temperature, max_new_tokens=config.max_new_tokens,
        baseline_tokens_per_s=base_tps, dflash_tokens_per_s=fast_tps, speedup=ratio(fast_tps, base_tps),
        mean_acceptance_length=mean_acceptance_length(hist), acceptance_histogram=hist,
        acceptance_rate_per_position=acceptance_rate_per_position(hist),
        mismatches=len(mismatched), mismatched_prompts=mismatched,
        baseline_output_tokens=sum(o.stats.num_output_tokens for o in base),
        dflash_output_tokens=sum(o.stats.num_output_tokens for o in fast),
        baseline_ttft_ms=mean_ms([o.stats.time_to_first_token_s for o in base]),
        dflash_ttft_ms=mean_ms([o.stats.time_to_first_token_s for o in fast]),
        baseline_tpot_ms=mean_ms([_tpot(o) for o in base if o.stats.num_output_tokens > 1]),
        dflash_tpot_ms=mean_ms([_tpot(o) for o in fast if o.stats.num_output_tokens > 1]),
    )
    note = few_steps_note(len(steps), result.dflash_output_tokens)
    if note:
        result.notes.append(note)
    if not steps and records:  # the prefill's token alone: both sides timed the same prefill, not decoding
        result.speedup = None
        result.notes.append("no verify step was measured (every answer ended at the prefill's first token), so there "
                            "is no speedup ('-'): raise --max-new-tokens")
    return result


def tokens_per_s(outputs: list[GenerationOutput]) -> float | None:
    """Output tokens over generation time (time to first token + decode), pooled over requests."""
    tokens = sum(o.stats.num_output_tokens for o in outputs)
    seconds = sum(o.stats.time_to_first_token_s + o.stats.decode_time_s for o in outputs)
    return tokens / seconds if seconds > 0 else None


def _tpot(output: GenerationOutput) -> float:
    return output.stats.decode_time_s / (output.stats.num_output_tokens - 1)
