"""The speculative decoding loop: prefill, then draft a block, verify it, accept, and go on.

    prefill:  target(prompt) -> first token (the first anchor); its features become drafter context
    step:     draft   = proposer(anchor, context)            one drafter forward, block_size - 1 tokens
              logits  = target([anchor, draft tokens])       one target forward
              new     = verify(draft, logits)                accepted draft tokens + recovered/bonus token
              commit: keep the accepted slots of the target cache, hand the accepted tokens' features
                      to the proposer, the last new token becomes the next anchor

Batches are ragged: each row accepts its own number of tokens per step (see `slots`). With a branch (`branch`),
the target forward also checks a second path leaving the draft where its first miss is likeliest.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch

from dflash.config_types import type_mismatch
from dflash.decoding.branch import Branch, accept_branch, block_visibility, most_likely_first_miss
from dflash.decoding.choice import choice_logits
from dflash.decoding.detokenizer import check_utf8
from dflash.decoding.logprobs import TokenLogprob, check_top, token_logprobs
from dflash.decoding.penalties import Penalties, TokenCounts
from dflash.decoding.proposer import Draft, NoDraftProposer, PendingContext, Proposer, check_proposer
from dflash.decoding.sampling import MAX_LOGIT_BIAS, NAN_LOGITS, PositionNoise, SamplingParams, to_probs
from dflash.decoding.slots import (
    compact_cache,
    has_gaps,
    merge_caches,
    pad_and_concat,
    select_cache_rows,
    worth_compacting,
)
from dflash.decoding.stopping import StopChecker
from dflash.decoding.structure import Grammar, GrammarCompiler
from dflash.decoding.verify import (
    NO_TOKEN,
    RowsFailed,
    greedy_verify,
    matching_prefix,
    rejection_sample,
    sample_target_only,
    target_argmax,
)
from dflash.errors import GenerationError, NoTokenError
from dflash.model import hf_compat
from dflash.model.target import TargetModel

AUTO = "auto"  # block_size: chosen before every step from measured step costs and acceptance (`block_policy`)

# Block size "auto" times steps of up to this many rows; costs of larger batches are extrapolated from them.
_AUTO_TIMED_ROWS = 8
_NO_LIMIT = 2**62  # positions left for a target whose config states no context


SEED_RANGE = (-(2**63), 2**64)  # what torch generators take; a seed beyond it would wrap onto another one


def check_token_ids(ids: list[int], vocab_size: int, what: str = "prompt token ids") -> None:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) for t in ids):
        raise GenerationError(f"{what} must be a list of ints, got {type(ids).__name__} {str(ids)[:60]}: the engine "
                              "takes token ids (DFlash.encode gives them; DFlash.generate takes text)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise GenerationError(f"{what} {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")


@dataclass
class GenerationConfig:
    """How to decode one prompt: the options of `DFlash.generate`, `generate_batch` and `stream`, and of
    `SpeculativeEngine.generate` (one config for all prompts, or one per prompt). Temperature 0 is greedy; top_k 0
    (or -1) is no top-k; a seed makes sampling repeat token for token, whatever the block size or batch. A bad value
    is a GenerationError naming the field."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0  # no stop (EOS, stop_token_ids, stop strings) before this many tokens (vLLM's min_tokens)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest's probability (0 = off)
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # stop at these too, besides the target's EOS ids (as vLLM's)
    ignore_eos: bool = False  # do not stop at the target's EOS ids (fixed-length outputs, as vLLM's)
    stop_strings: list[str] = field(default_factory=list)
    block_size: int | str | None = None  # None: the drafter's own block size; "auto": chosen every step
    branch_length: int = 0  # > 0: each step also verifies a branch of this many tokens (`branch`); greedy, seeded
    logit_bias: dict[int, float] | None = None  # added to the target's logits before choosing (OpenAI's, -100..100)
    # penalties on tokens the output (and, for repetition, the prompt) holds, after the bias (`penalties`)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of each token the output holds (-2..2)
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once for each time the output holds the token (-2..2)
    repetition_penalty: float = 1.0  # transformers' and vLLM's: > 1 discourages tokens of the prompt and output
    # structured output (`structure`; needs llguidance): the answer matches this JSON schema, or this regex
    json_schema: dict | None = None  # {"type": "object"}: any JSON object
    regex: str | None = None
    logprobs: int | None = None  # each output token's log-probability and this many alternatives (`logprobs`)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):  # one stop string, not its characters
            self.stop_strings = [self.stop_strings]
        self._check_types()
        if isinstance(self.block_size, str):
            self.block_size = self.block_size.strip().lower()  # "AUTO" as the CLI's --block-size takes it
        if self.seed is not None:
            self.seed = int(self.seed)  # a numpy integer would overflow in the seeded noise's 64-bit arithmetic
        if any(s == "" for s in self.stop_strings):
            raise GenerationError("a stop string is empty (every text would stop before its first token); drop it")
        for text in self.stop_strings:
            check_utf8(text, f"the stop string {text!r}")
        if self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0 (0: the prompt is read, and scored with "
                                  f"prompt_logprobs, and nothing is generated), got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise GenerationError(f"min_new_tokens must be from 0 to max_new_tokens ({self.max_new_tokens}): the "
                                  f"answer may stop only after that many tokens, got {self.min_new_tokens}")
        if self.branch_length < 0:
            raise GenerationError(f"branch_length is a number of tokens >= 0 (0: no branch), got {self.branch_length}")
        if isinstance(self.block_size, str) and self.block_size != AUTO:
            raise GenerationError(f"block_size is a number of tokens or {AUTO!r}, not {self.block_size!r}")
        if isinstance(self.block_size, int) and self.block_size < 2:
            raise GenerationError(f"block_size is at least 2 (the anchor and one draft token), got {self.block_size}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise GenerationError(f"seed must be in [-2**63, 2**64), the range torch's generators take, got "
                                  f"{self.seed}")
        for token, bias in (self.logit_bias or {}).items():
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if isinstance(token, bool) or not isinstance(token, int) or not (number and abs(bias) <= MAX_LOGIT_BIAS):
                raise GenerationError(f"logit_bias maps token ids to a bias from -{MAX_LOGIT_BIAS:g} to "
                                      f"{MAX_LOGIT_BIAS:g}, got {token!r}: {bias!r}")
        if self.json_schema is not None and self.regex is not None:
            raise GenerationError("json_schema and regex each set the answer's structure: give one of them")
        if self.structured and self.min_new_tokens:
            raise GenerationError("a structured answer ends where its grammar does, and min_new_tokens would hold "
                                  "its end back: drop min_new_tokens (or the json_schema / regex)")
        if self.structured and self.ignore_eos:
            raise GenerationError("a structured answer ends where its grammar does, at an EOS token, and ignore_eos "
                                  "writes on past it: drop ignore_eos (max_new_tokens still caps the answer)")
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(self, name)
            if top is not None and (problem := check_top(top)):
                raise GenerationError(f"{name}: {problem}")
        _ = self.sampling, self.penalties  # validates temperature / top_p / top_k / min_p and the penalties

    def _check_types(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            expected = type_mismatch(GenerationConfig, f.name, value)
            if expected:
                raise GenerationError(f"{f.name} must be {expected}, got {value!r}")

    @property
    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)
        except ValueError as err:
            raise GenerationError(str(err)) from None

    @property
    def structured(self) -> bool:
        """Whether a grammar (json_schema or regex) holds the answer."""
        return self.json_schema is not None or self.regex is not None

    @property
    def penalties(self) -> Penalties:
        try:
            return Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        except ValueError as err:
            raise GenerationError(str(err)) from None


@dataclass
class GenerationStats:
    """What one generation measured: the tokens each target forward produced (acceptance lengths; entry 0 is the
    prefill's first token), the block each verify forward checked, times and forward counts."""

    prompt_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens per target forward; [0] = prefill's
    block_sizes: list[int] = field(default_factory=list)  # tokens each verify forward checked (the block + a branch)
    time_to_first_token_s: float = 0.0
    decode_time_s: float = 0.0  # from the first token to the last
    target_forwards: int = 0
    drafter_forwards: int = 0

    @property
    def num_output_tokens(self) -> int:
        return sum(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens per verify forward (decode steps; the prefill's single token is left out)."""
        steps = self.acceptance_lengths[1:]
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def mean_block_size(self) -> float:
        """Mean tokens per verify forward's block (the adaptive block size varies it; 1 = a plain step)."""
        return sum(self.block_sizes) / len(self.block_sizes) if self.block_sizes else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = self.num_output_tokens - 1
        return decoded / self.decode_time_s if self.decode_time_s > 0 else 0.0


@dataclass
class GenerationOutput:
    """One prompt's generation: its new token ids (up to and including a stop token or the token that completed
    a stop string), its text (cut before a stop string; None without a tokenizer), why it finished, and stats."""

    output_ids: list[int]  # generated ids only
    finish_reason: str  # "stop", "length", or "error" (the target gave no token: `error` says why)
    stats: GenerationStats
    text: str | None = None
    stop_string: str | None = None  # the stop string the text was cut at (finish_reason "stop"), else None
    error: str | None = None  # why the generation failed (finish_reason "error"), else None
    logprobs: list[TokenLogprob] | None = None  # one per output id, where the config asked (`logprobs`)
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt id after the first (`prompt_logprobs`)

    def raise_for_error(self) -> "GenerationOutput":
        """This output, unless its generation failed: then the NoTokenError that says why (for a caller that
        decodes one prompt, to whom a failed one is an error rather than a result)."""
        if self.error is not None:
            raise NoTokenError(self.error)
        return self


@dataclass
class StepProfile:
    """Where a decode step's time goes; the engine's own overhead is what is left outside model forwards. On a GPU
    the forwards return once their kernels are queued: `synchronize` waits for them at each mark, so the split is
    the kernels' (and the step a little slower); without it, their time shows up where the host next waits."""

    steps: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    synchronize: bool = False

    def mark(self, device: torch.device) -> float:
        """Now, once `device` has done its queued work when `synchronize` asks for it."""
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.draft_s - self.target_s


class Sequence:
    """One prompt being decoded: its output so far, its sampling state and its stats."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, stop: StopChecker,
                 device: torch.device | str = "cpu", bias: torch.Tensor | None = None, grammar: Grammar | None = None):
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.params = config.sampling
        self.stop = stop
        self.generator = None  # rejection sampling's, for sampling without a seed
        self.noise = None  # with a seed: each position's own noise, so the text does not depend on drafting
        if not self.params.greedy and config.seed is not None:
            self.noise = PositionNoise(config.seed, device)
        elif not self.params.greedy:
            self.generator = torch.Generator(device=device)  # on the device that samples
            self.generator.seed()  # a fresh non-deterministic seed, leaving torch's global RNG alone
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None  # one per output id
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the prefill's, where the config asks
        self.bias = bias  # (vocab,) the config's logit_bias over the target's logits, added before a token is chosen
        penalties = config.penalties
        self.penalties = penalties if penalties.active else None  # applied after the bias
        self.counts = TokenCounts(prompt_ids) if self.penalties is not None else None  # the tokens they count
        self.grammar = grammar  # the tokens the config's json_schema or regex allows next (`structure`)
        # (k,) the stop ids held back from the first min_new_tokens tokens (`stopping.hold_stops`); None: none
        self.held_stops = (torch.tensor(sorted(stop.stop_token_ids), device=device)
                           if config.min_new_tokens and stop.stop_token_ids else None)
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it finished with finish_reason 'error' (`fail`)
        self.long_rotated = False  # a longrope target's cache of this row holds its long factors' rotation
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_position(self) -> int:
        """The sequence position of the next token to draw: the one after the anchor (its last token)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def record(self, new_tokens: list[int], block_size: int | None = None,
               logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append a forward's new tokens, cut at a stop; returns the tokens kept. `block_size`: the tokens a
        verify forward checked (None for the prefill); `logprobs`: the new tokens', where the config asks."""
        decision = self.stop.check(self.output_ids, new_tokens)
        kept = new_tokens[: decision.keep]
        self.output_ids.extend(kept)
        if self.counts is not None:
            self.counts.add(kept)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[: len(kept)])
        self.stats.acceptance_lengths.append(len(kept))
        if block_size is not None:
            self.stats.block_sizes.append(block_size)
        now = time.perf_counter()
        if len(self.stats.acceptance_lengths) == 1:
            self.stats.time_to_first_token_s = now - self.started
        self.stats.decode_time_s = now - self.started - self.stats.time_to_first_token_s
        self.finish_reason = decision.reason
        if self.grammar is not None and (failed := self.grammar.advance(kept)):
            self.fail(failed)
        return kept

    def fail(self, message: str) -> None:
        """Finish with finish_reason 'error': the target gave this row no token (`RowsFailed`)."""
        self.finish_reason, self.error = "error", message

    def result(self) -> GenerationOutput:
        text, stop_string = self.stop.ending(self.output_ids) if self.stop.tokenizer is not None else (None, None)
        return GenerationOutput(list(self.output_ids), self.finish_reason or "length", self.stats, text, stop_string,
                                self.error, None if self.logprobs is None else list(self.logprobs),
                                self.prompt_logprobs)


@dataclass
class Batch:
    """Sequences decoded together, and the caches they share (see `slots` for the layout)."""

    sequences: list[Sequence]
    proposer: Proposer
    target_cache: object
    target_valid: torch.Tensor  # (b, slots) bool
    draft_state: object
    anchors: torch.Tensor  # (b,) the last token of each row, not yet seen by the target
    anchor_positions: torch.Tensor  # (b,)
    has_holes: bool = False
    block_size: int = 0  # the tokens per row the last step verified (the anchor + draft tokens)
    accepted: list[int] = field(default_factory=list)  # the last step's accepted draft tokens of the block, per row
    branched: bool = False  # the last step also verified a branch
    verified: int = 0  # the tokens per row the last forward checked: the block and a branch
    produced: list[int] = field(default_factory=list)  # the last step's accepted + 1 per row, before a stop cut them
    cut_short: bool = False  # the last step's block was cut to the context's end or to what its rows still want

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def timed_like_its_block(self) -> bool:
        """Whether the last step's time is a step of its block size, as start-up timed them: not with a branch (its
        tokens would count as the block's), nor a block cut to what its rows want (fewer outputs drafted)."""
        return not (self.branched or self.cut_short)


class SpeculativeEngine:
    """Lossless speculative decoding of token ids: a target (`TargetModel`) verifies what a `Proposer` drafts
    (`DFlashProposer`, a draft model's, or none: `NoDraftProposer`, plain decoding). `generate` decodes a ragged
    batch, `stream` one prompt's tokens as they come; `DFlash` (dflash.api) adds text, chat templates and loading."""

    def __init__(self, target: TargetModel, proposer: Proposer | None = None, tokenizer=None):
        if not isinstance(target, TargetModel):
            raise GenerationError(f"SpeculativeEngine takes a TargetModel, not a {type(target).__name__}: wrap the "
                                  "loaded model, SpeculativeEngine(TargetModel(model, tokenizer), proposer)")
        target.check_decodable()
        self.target = target
        self._rope_switch = target.rope_rows_switch  # a longrope target's rows switch factors here; None: no such
        self.proposer = proposer or NoDraftProposer()
        check_proposer(self.proposer)
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.profile = StepProfile()
        self._block_policy = None  # BlockSizePolicy for block_size "auto", timed on first use
        self._grammars: GrammarCompiler | None = None  # structured output's, built on first use
        self._grammars_made = threading.Lock()

    # ---- requests ---------------------------------------------------------------------------------------
    @property
    def context_length(self) -> int | None:
        """The target's context (max_position_embeddings, or less: `TargetModel.context_length`); None when its
        config states none."""
        return self.target.context_length

    def room(self, prompt_len: int, block_size: int | None = None) -> int | None:
        """The most new tokens a prompt of `prompt_len` tokens may ask for: prompt and output fill the target's
        context at most, as in plain decoding, whatever the block size (the steps near its end verify shorter
        blocks; `block_size` is taken for callers of earlier versions). None when the target states no context."""
        limit = self.context_length
        return limit - prompt_len if limit else None

    def new_sequence(self, prompt_ids: list[int], config: GenerationConfig, block_size: int | None = None) -> Sequence:
        """A sequence to decode, refused when its prompt, max_new_tokens or block size does not fit (`block_size`
        is taken for callers of earlier versions: the room no longer depends on it)."""
        if not prompt_ids:
            raise GenerationError("the prompt is empty; give at least one token")
        check_token_ids(prompt_ids, self.target.vocab_size)
        self.proposer_for(config)  # refuses a block size the drafter cannot verify
        room = self.room(len(prompt_ids))
        if room is not None and config.max_new_tokens > room:
            fix = "shorten the prompt or lower max_new_tokens" if room > 0 else "shorten the prompt"
            raise GenerationError(
                f"a prompt of {len(prompt_ids)} tokens leaves room for at most {max(room, 0)} new "
                f"token{'' if room == 1 else 's'}, not "
                f"max_new_tokens={config.max_new_tokens}: the target's context is {self.target.context_words}; {fix}"
            )
        if config.stop_token_ids:  # an id outside the vocabulary is never generated: a stop never met
            check_token_ids(config.stop_token_ids, self.target.vocab_size, "stop_token_ids")
        if config.logit_bias:
            check_token_ids(list(config.logit_bias), self.target.vocab_size, "logit_bias token ids")
        stop = StopChecker(self.stop_ids(config), config.stop_strings, config.max_new_tokens, self.tokenizer,
                           config.min_new_tokens)
        return Sequence(prompt_ids, config, stop, self.target.device, self._bias_vector(config.logit_bias),
                        self.grammar_for(config))

    def grammar_for(self, config: GenerationConfig, keep: bool = True) -> Grammar | None:
        """The grammar of a config's json_schema or regex (None without one), over the target's tokenizer;
        `keep=False`: not kept for later rows (`GrammarCompiler.grammar`)."""
        if not config.structured:
            return None
        with self._grammars_made:  # a server builds rows on several worker threads: one compiler for them all
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids())
        return self._grammars.grammar(config.json_schema, config.regex, keep)

    def _bias_vector(self, logit_bias: dict[int, float] | None) -> torch.Tensor | None:
        """A logit bias over the target's logits (vocab,), None for none."""
        if not logit_bias:
            return None
        bias = torch.zeros(self.target.vocab_size, device=self.target.device)
        bias[list(logit_bias)] = torch.tensor([float(v) for v in logit_bias.values()], device=self.target.device)
        return bias

    def stop_ids(self, config: GenerationConfig) -> list[int]:
        """The ids a sequence stops at: the target's EOS ids unless ignore_eos, and its stop_token_ids."""
        eos = [] if config.ignore_eos else self.target.eos_token_ids()
        return list(dict.fromkeys([*eos, *(config.stop_token_ids or ())]))

    def _new_row(self, index: int, prompt_ids: list[int], config: GenerationConfig, rows: int) -> Sequence:
        """`new_sequence` for row `index` of a batch of `rows`: a problem names the prompt when there are several."""
        try:
            return self.new_sequence(prompt_ids, config)
        except GenerationError as err:
            if rows == 1:
                raise
            raise GenerationError(f"prompt {index}: {err}") from None

    def proposer_for(self, config: GenerationConfig) -> Proposer:
        if config.block_size is None or config.block_size == AUTO:
            return self.proposer
        try:
            return self.proposer.with_block_size(config.block_size)
        except ValueError as err:
            raise GenerationError(str(err)) from None

    def block_policy_for(self, config: GenerationConfig, rows: int):
        """The policy choosing each step's block size when `config.block_size` is "auto" and there is a block
        to choose (None otherwise). The first use times real steps of up to `rows` rows (at most 8; about a
        second for one row on a CPU; see `block_policy.StepCosts.measure`); what it learns about acceptance
        carries over from one generation to the next."""
        if config.block_size != AUTO or self.proposer.block_size <= 2:
            return None
        from dflash.decoding.block_policy import BlockSizePolicy

        rows = min(rows, _AUTO_TIMED_ROWS)
        policy = self._block_policy
        if policy is None or max(policy.costs.rows) < rows:
            self._block_policy = policy = BlockSizePolicy.calibrate(self, rows)
            self.profile = StepProfile(synchronize=self.profile.synchronize)  # the timing steps are not decoding
        return policy

    def adaptive_step(self, batch: Batch, policy) -> list[list[int]]:
        """`step`, at the block size `policy` picks for this batch (None: the batch's own), before drafting or
        from the draft, teaching the policy how many draft tokens each row accepted and how long the step took
        beyond its start-up time (a start-up timed on a quieter or busier machine than the decoding would
        otherwise choose from stale costs)."""
        if policy is None:
            return self.step(batch)
        batch.proposer, choose = policy.plan(batch.sequences)
        started = time.perf_counter()
        kept = self.step(batch, choose)
        if batch.timed_like_its_block:
            policy.observe_step(len(batch), batch.block_size, time.perf_counter() - started,
                                after_drafting=choose is not None)
        policy.observe(batch.accepted, batch.block_size - 1)
        return kept

    # ---- the algorithm ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: Sequence, proposer: Proposer | None = None) -> Batch:
        """Run the prompt through the target alone; its first token becomes the first anchor (with max_new_tokens
        0 it finishes there, the prompt read and, with prompt_logprobs, scored)."""
        scored = seq.config.prompt_logprobs
        batch, logits = self._read(seq, seq.prompt_ids, proposer or self.proposer, keep=0 if scored is not None else 1)
        if scored is not None:  # logits (prompt length, vocab): token i + 1 was read at position i
            if torch.isnan(logits[:-1]).any():
                raise NoTokenError(NAN_LOGITS)
            seq.prompt_logprobs = token_logprobs(logits[:-1], seq.prompt_ids[1:], scored, ranks=True)
        last = logits[-1]  # (vocab,) the target's own; a token is chosen with the logit bias and penalties
        if seq.config.max_new_tokens == 0:
            seq.finish_reason = "length"
            return batch
        chosen_from = choice_logits(last[None, None], [seq])[0, 0]  # (vocab,)
        if seq.noise is not None:
            first = int(seq.noise.choose(to_probs(chosen_from[None], seq.params), seq.next_position)[0])
        else:
            first = sample_target_only(chosen_from, seq.params, seq.generator)
        seq.record([first], logprobs=self._logprobs_of(seq, last[None], [first]))
        batch.anchors = torch.tensor([first], device=batch.anchors.device)
        return batch

    @torch.inference_mode()
    def rejoin(self, seq: Sequence, proposer: Proposer) -> Batch:
        """A one-row batch, with another proposer, for a sequence that is already decoding: the target reads
        every token before its anchor (its last output token) again, so that proposer gets its context.
        Merge it into a batch of that proposer; the output goes on exactly as it would have."""
        if not seq.output_ids:
            raise ValueError("rejoin needs a sequence that was prefilled")
        batch, _ = self._read(seq, seq.prompt_ids + seq.output_ids[:-1], proposer)  # logits (1, vocab)
        batch.anchors = torch.tensor([seq.output_ids[-1]], device=batch.anchors.device)
        return batch

    def _read(self, seq: Sequence, tokens: list[int], proposer: Proposer,
              keep: int = 1) -> tuple[Batch, torch.Tensor]:
        """The target reads `tokens` into a new cache (the proposer observes their features); a one-row batch
        anchored right after them (its anchor token is the caller's), and the target's logits at the last `keep`
        positions (0: every one) (keep, vocab)."""
        device = self.target.device
        ids = torch.tensor([tokens], device=device)  # (1, n)
        positions = torch.arange(ids.shape[1], device=device)[None]
        cache = self.target.new_cache()
        seq.long_rotated = self._past_rope_switch(seq)
        out = self.target.forward(ids, positions, cache, logits_to_keep=keep,
                                  feature_layer_ids=proposer.feature_layer_ids, long_rope_rows=self._rope_rows([seq]))
        seq.stats.target_forwards += 1
        state = proposer.new_state()
        valid = torch.ones_like(ids, dtype=torch.bool)
        if out.features is not None:
            proposer.observe(state, PendingContext(out.features, positions, valid))
        proposer.prefill(state, tokens)
        batch = Batch(
            sequences=[seq], proposer=proposer, target_cache=cache, target_valid=valid, draft_state=state,
            anchors=torch.zeros(1, dtype=torch.long, device=device),
            anchor_positions=torch.tensor([ids.shape[1]], device=device),
        )
        return batch, out.logits[0]

    @torch.inference_mode()
    def step(self, batch: Batch, choose: Callable[[Draft], int] | None = None) -> list[list[int]]:
        """One draft-verify-accept round for every row; returns the tokens each row kept. `choose`: the block
        size to verify, picked from the draft (its first draft tokens are verified); None: all of it. A row the
        target gives no token (NaN logits) finishes with finish_reason 'error': the step stands for the others,
        and RowsFailed carries their tokens."""
        t0 = self.profile.mark(self.target.device)
        if self._rope_switch is not None:
            self._read_again_past_rope_switch(batch)
        room = self._block_room(batch.sequences)
        draft, branch = self._draft(batch, choose, room)
        t1 = self.profile.mark(self.target.device)
        block = torch.cat([batch.anchors[:, None], draft.tokens], dim=1)  # (b, block_size): anchor + draft tokens
        tokens, positions, sees, out = self._verify_forward(batch, block, branch)  # tokens, positions (b, q)
        t2 = self.profile.mark(self.target.device)
        new_tokens, kept_slots, failed = self._accept(batch, draft, branch, block.shape[1],
                                                      choice_logits(out.logits, batch.sequences, tokens, sees))
        # log-probabilities are the target's own, without the bias and penalties
        logprobs = self._step_logprobs(batch.sequences, new_tokens, out.logits, kept_slots, failed)
        self._commit(batch, new_tokens, out.features, positions,
                     drafter_forwards=draft.forwards if draft.tokens.shape[1] > 0 else 0, kept_slots=kept_slots)
        kept = self._record(batch.sequences, new_tokens, failed, verified=tokens.shape[1], logprobs=logprobs)
        batch.block_size, batch.branched, batch.verified = block.shape[1], branch is not None, tokens.shape[1]
        batch.cut_short = room < batch.proposer.block_size
        self._profile_step(t0, t1, t2)
        if failed:
            raise RowsFailed(NAN_LOGITS, kept)
        return kept

    def _draft(self, batch: Batch, choose: Callable[[Draft], int] | None,
               fit: int) -> tuple[Draft, Branch | None]:
        """The draft tokens this step verifies (b, k): what fits in `fit` positions from the anchor on
        (`_block_room`), cut to the block size `choose` picks; and the branch verified with them (None: none)."""
        rows = batch.sequences
        proposer = batch.proposer if fit >= batch.proposer.block_size else batch.proposer.with_block_size(max(fit, 2))
        draft = proposer.propose(batch.draft_state, batch.anchors, batch.anchor_positions, rows)
        if choose is not None:
            draft = draft.first(choose(draft) - 1)
        if draft.tokens.shape[1] >= fit:  # the anchor takes one of the positions left
            draft = draft.first(fit - 1)
        return draft, self._branch(batch, draft, min(proposer.block_size, fit))

    def _verify_forward(self, batch: Batch, block: torch.Tensor, branch: Branch | None):
        """The target's forward over the block (b, block_size) and a branch, whose keys and values it writes into
        the cache: the tokens it read and their positions (b, q), which of them each sees (b, q, q; None: those up
        to itself), and its output (logits (b, q, vocab), the features the drafter reads)."""
        offsets = torch.arange(block.shape[1], device=block.device)
        positions = batch.anchor_positions[:, None] + offsets  # (b, block_size)
        tokens, visibility = block, None
        if branch is not None:
            tokens, positions, visibility = self._with_branch(batch, block, positions, branch)
        mask = None
        if batch.has_holes:
            mask = torch.cat([batch.target_valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1).long()
        out = self.target.forward(tokens, positions, batch.target_cache, attention_mask=mask,
                                  feature_layer_ids=batch.proposer.feature_layer_ids, visibility=visibility,
                                  long_rope_rows=self._rope_rows(batch.sequences))
        return tokens, positions, visibility, out

    def _accept(self, batch: Batch, draft: Draft, branch: Branch | None, block_size: int,
                logits: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None, set[int]]:
        """Each row's new tokens: its accepted draft tokens and the recovered or bonus token; the forward's slots
        that stay in the cache (b, q), None for each row's first len(new tokens); and the rows the target gave no
        token (NaN logits: NO_TOKEN), whose new tokens are a placeholder. Sets the batch's accepted counts.
        logits (b, q, vocab)."""
        rows = batch.sequences
        if branch is None:
            new_tokens = self._verify(draft, logits, rows)
            batch.accepted, kept_slots = [len(t) - 1 for t in new_tokens], None
        else:
            target_tokens = self._target_tokens(logits, rows, block_size, branch)  # (b, q)
            num_accepted = matching_prefix(draft.tokens, target_tokens[:, :block_size])
            new_tokens, kept_slots = accept_branch(num_accepted, target_tokens, branch, block_size)
            batch.accepted = num_accepted.tolist()
        batch.produced = [len(t) for t in new_tokens]
        failed = {r for r, t in enumerate(new_tokens) if NO_TOKEN in t}
        # a failed row leaves the batch: a placeholder token keeps the commit's shapes for the step of the others
        return [[0] if r in failed else t for r, t in enumerate(new_tokens)], kept_slots, failed

    @staticmethod
    def _logprobs_of(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """The log-probabilities of a row's new tokens, token i chosen at logits[i] (n, vocab); None unless its
        config asks for them."""
        return None if seq.logprobs is None else token_logprobs(logits, tokens, seq.config.logprobs)

    def _step_logprobs(self, rows: list[Sequence], new_tokens: list[list[int]], logits: torch.Tensor,
                       kept_slots: torch.Tensor | None, failed: set[int]) -> list[list[TokenLogprob] | None]:
        """Each row's new tokens' log-probabilities (None for a row that does not ask, or failed). A row's new token
        j was chosen at the j-th forward slot it keeps (`_accept`): the anchor's, then its accepted tokens'.
        logits (b, q, vocab); kept_slots (b, q) or None: each row's first slots."""
        result = []
        for r, (seq, tokens) in enumerate(zip(rows, new_tokens)):
            if seq.logprobs is None or r in failed:
                result.append(None)
                continue
            slots = slice(0, len(tokens)) if kept_slots is None else kept_slots[r].nonzero()[: len(tokens), 0]
            result.append(self._logprobs_of(seq, logits[r, slots], tokens))
        return result

    @staticmethod
    def _record(rows: list[Sequence], new_tokens: list[list[int]], failed: set[int], verified: int,
                logprobs: list[list[TokenLogprob] | None]) -> list[list[int]]:
        """Each row's new tokens added to its output, cut at a stop (a failed row finishes with NAN_LOGITS instead):
        the tokens each row kept. `verified`: the tokens per row the forward checked."""
        kept = [[] if r in failed else seq.record(new, verified, logprobs[r])
                for r, (seq, new) in enumerate(zip(rows, new_tokens))]
        for r in failed:
            rows[r].fail(NAN_LOGITS)
        return kept

    def _profile_step(self, started: float, drafted: float, verified: float) -> None:
        self.profile.steps += 1
        self.profile.draft_s += drafted - started
        self.profile.target_s += verified - drafted
        self.profile.total_s += self.profile.mark(self.target.device) - started

    def _block_room(self, rows: list[Sequence]) -> int:
        """How many tokens this step's block may hold, the anchor included: what fits before the context's end
        (`_positions_left`), and no more than any row still wants (a block of k gives at most k new tokens), but
        a draft token at least: the drafter reads the step's new context either way."""
        wanted = max(seq.stop.max_new_tokens - len(seq.output_ids) for seq in rows)
        return min(self._positions_left(rows), max(wanted, 2))

    def _positions_left(self, rows: list[Sequence]) -> int:
        """How many positions this step may write into the target's cache, from the anchor on, so that no row
        writes past the context, nor a longrope target's row past its switch before it is read again there
        (`_read_again_past_rope_switch`): a step near either verifies a shorter block."""
        limit = self.context_length
        fit = limit - max(seq.next_position for seq in rows) + 1 if limit else _NO_LIMIT
        if self._rope_switch is None:
            return fit
        below = [seq.next_position for seq in rows if seq.next_position <= self._rope_switch]
        return min(fit, self._rope_switch - max(below) + 1) if below else fit

    def _past_rope_switch(self, seq: Sequence) -> bool:
        """Whether a longrope target's row has reached past its switch: its anchor (or prompt) stands there."""
        return self._rope_switch is not None and seq.next_position > self._rope_switch

    def _rope_rows(self, rows: list[Sequence]) -> list[bool] | None:
        """For a longrope target's forward: which rows are rotated with its long factors; None for any other."""
        return None if self._rope_switch is None else [seq.long_rotated for seq in rows]

    def _read_again_past_rope_switch(self, batch: Batch) -> None:
        """Rows of a longrope target that have just reached its switch are read again with the long factors, as
        transformers' generate does there (its rotary switches for a whole forward, so it recomputes the cache);
        the batch keeps its rows in their order."""
        rows = batch.sequences
        crossing = [i for i, seq in enumerate(rows) if self._past_rope_switch(seq) and not seq.long_rotated]
        if not crossing:
            return
        kept = [i for i in range(len(rows)) if i not in crossing]
        read_again = [self.rejoin(rows[i], batch.proposer) for i in crossing]
        rest = self.select_rows(batch, kept) if kept else None
        merged = self.merge(([rest] if rest is not None else []) + read_again)
        order = kept + crossing  # the batch index of each merged row
        if order != sorted(order):
            self._take_rows(merged, [order.index(i) for i in range(len(order))])
        vars(batch).update(vars(merged))  # the caller's batch object, now holding the merged rows

    def _branch(self, batch: Batch, draft: Draft, width: int) -> Branch | None:
        """The branch this step verifies with its block, or None: every row asks for one (`branch_length`) and is
        greedy or seeded (its target tokens do not depend on the drafts offered) and has no grammar (whose masks
        follow the block), the draft can give one, the target takes a tree-shaped mask, and a draft token can be
        replaced. It leaves the draft where its first
        miss is likeliest, and stays within `width` positions from the anchor (the proposer's block, or fewer
        at the end of the context)."""
        rows = batch.sequences
        length = min(seq.config.branch_length for seq in rows)
        drafted = draft.tokens.shape[1]
        if (length < 1 or drafted < 1 or draft.branch_fn is None or not self.target.takes_branches
                or not all(seq.params.greedy or seq.noise is not None for seq in rows)
                or any(seq.grammar is not None for seq in rows)):
            return None
        confidence = draft.confidence
        start = (most_likely_first_miss(confidence, drafted) if confidence is not None
                 else torch.zeros(len(rows), dtype=torch.long, device=draft.tokens.device))  # (b,)
        length = min(length, width - 1 - int(start.max()))
        if length < 1:
            return None
        return Branch(start, draft.branch_fn(start, length))

    @staticmethod
    def _with_branch(batch: Batch, block: torch.Tensor, positions: torch.Tensor, branch: Branch):
        """The forward's tokens and positions (b, q = block_size + length), the branch's after the block's at the
        positions they would take, and which of them each sees (b, q, q)."""
        branch_offsets = branch.start[:, None] + 1 + torch.arange(branch.length, device=block.device)
        return (torch.cat([block, branch.tokens], dim=1),
                torch.cat([positions, batch.anchor_positions[:, None] + branch_offsets], dim=1),
                block_visibility(block.shape[1], branch.start, branch.length))

    @staticmethod
    def _target_tokens(logits: torch.Tensor, rows: list[Sequence], block_size: int, branch: Branch) -> torch.Tensor:
        """The target's own token after each of a forward's q tokens (b, q), for greedy rows and seeded ones (the
        seed's noise at the position each token would take); NO_TOKEN where there is none (NaN logits).
        logits (b, q, vocab)."""
        tokens = target_argmax(logits)  # (b, q)
        for r, seq in enumerate(rows):
            if seq.noise is None:
                continue
            try:
                probs = to_probs(logits[r], seq.params)  # (q, vocab)
            except NoTokenError:  # no distribution to draw from
                tokens[r] = NO_TOKEN
                continue
            tokens[r, :block_size] = seq.noise.choose(probs[:block_size], seq.next_position)
            tokens[r, block_size:] = seq.noise.choose(probs[block_size:], seq.next_position + int(branch.start[r]) + 1)
        return tokens

    def _verify(self, draft, target_logits: torch.Tensor, rows: list[Sequence]) -> list[list[int]]:
        """Each row's new tokens: its accepted draft tokens plus one recovered or bonus token; NO_TOKEN last where
        the target gave none (NaN logits). target_logits (b, k + 1, vocab)."""
        if all(s.params.greedy for s in rows):
            num_accepted, target_tokens = greedy_verify(draft.tokens, target_logits)
            counts, tokens = num_accepted.tolist(), target_tokens.tolist()  # the step's one host sync
            return [t[: n + 1] for t, n in zip(tokens, counts)]
        new_tokens = []
        for r, seq in enumerate(rows):
            try:
                new_tokens.append(self._verify_row(draft, target_logits, r, seq))
            except NoTokenError:  # NaN logits: no distribution to sample from
                new_tokens.append([NO_TOKEN])
        return new_tokens

    @staticmethod
    def _verify_row(draft, target_logits: torch.Tensor, r: int, seq: Sequence) -> list[int]:
        """Row r's new tokens in a batch of mixed sampling settings."""
        if seq.params.greedy:
            n, t = greedy_verify(draft.tokens[r : r + 1], target_logits[r : r + 1])
            return t[0, : int(n) + 1].tolist()
        if seq.noise is not None:  # the target's own tokens at these positions, then as greedy
            p = to_probs(target_logits[r], seq.params)  # (k + 1, vocab)
            target_tokens = seq.noise.choose(p, seq.next_position)  # (k + 1,)
            n = int(matching_prefix(draft.tokens[r : r + 1], target_tokens[None]))
            return target_tokens[: n + 1].tolist()
        p = to_probs(target_logits[r], seq.params)
        q = draft.probs[r] if draft.probs[r] is not None else p.new_zeros(0, p.shape[-1])
        return rejection_sample(draft.tokens[r], q, p, seq.generator)

    def _commit(self, batch: Batch, new_tokens: list[list[int]], features, positions, drafter_forwards: int,
                kept_slots: torch.Tensor | None = None) -> None:
        """Keep the slots of accepted tokens, pass their features on, and move every anchor. kept_slots (b, q):
        the forward's slots that stay (a branch's accepted tokens, past the block's rejected ones); None: the
        anchor and the accepted draft tokens, the first len(new tokens) slots of each row."""
        device = batch.anchors.device
        produced = torch.tensor([len(t) for t in new_tokens], device=device)  # accepted + 1 per row
        if kept_slots is None:
            widest = max(len(t) for t in new_tokens)
            new_valid = torch.arange(widest, device=device)[None, :] < produced[:, None]  # (b, widest)
            holes = min(len(t) for t in new_tokens) != widest  # from the host's lists: no device sync
        else:
            slot = torch.arange(kept_slots.shape[1], device=device)
            widest = int(torch.where(kept_slots, slot + 1, 0).max())
            new_valid = kept_slots[:, :widest]  # (b, widest)
            holes = not bool(new_valid.all())
        old_slots = batch.target_valid.shape[1]
        hf_compat.crop_cache(batch.target_cache, old_slots + widest)
        batch.target_valid = torch.cat([batch.target_valid, new_valid], dim=1)
        batch.has_holes = batch.has_holes or holes
        if features is not None:
            batch.proposer.observe(batch.draft_state,
                                   PendingContext(features[:, :widest], positions[:, :widest], new_valid))
        batch.anchors = torch.tensor([t[-1] for t in new_tokens], device=device)
        batch.anchor_positions = batch.anchor_positions + produced
        for seq in batch.sequences:
            seq.stats.target_forwards += 1
            seq.stats.drafter_forwards += drafter_forwards
        self._maybe_compact(batch)

    def _maybe_compact(self, batch: Batch) -> None:
        """Squeeze the holes out of the batch's caches once they pile up; at once for a target that takes
        distances from cache slots (`TargetModel.positions_by_slot`), whose output a hole would change."""
        if not batch.has_holes:
            return
        valid = batch.target_valid
        if not (has_gaps(valid) if self.target.positions_by_slot else worth_compacting(valid)):
            return
        batch.target_valid = compact_cache(batch.target_cache, batch.target_valid)
        batch.proposer.compact(batch.draft_state)
        batch.has_holes = not bool(batch.target_valid.all())

    # ---- batch membership (continuous batching) -----------------------------------------------------
    def merge(self, batches: list[Batch]) -> Batch:
        """One batch with the rows of all `batches` (same proposer); call between steps."""
        if len(batches) == 1:
            return batches[0]
        sizes = [len(b) for b in batches]
        cache = merge_caches([b.target_cache for b in batches], sizes)
        valid = pad_and_concat([b.target_valid for b in batches], sizes, 1)
        return Batch(
            sequences=[s for b in batches for s in b.sequences],
            proposer=batches[0].proposer,
            target_cache=cache,
            target_valid=valid,
            draft_state=batches[0].proposer.merge([b.draft_state for b in batches], sizes),
            anchors=torch.cat([b.anchors for b in batches]),
            anchor_positions=torch.cat([b.anchor_positions for b in batches]),
            has_holes=not bool(valid.all()),
        )

    def drop_finished(self, batch: Batch) -> Batch | None:
        """Remove finished rows (their slots are freed); None when no row is left."""
        keep = [i for i, s in enumerate(batch.sequences) if not s.finished]
        return self.select_rows(batch, keep)

    def select_rows(self, batch: Batch, keep: list[int]) -> Batch | None:
        if len(keep) == len(batch):
            return batch
        if not keep:
            return None
        self._take_rows(batch, keep)
        return batch

    @staticmethod
    def _take_rows(batch: Batch, keep: list[int]) -> None:
        """Keep these rows of the batch, in this order (a subset, or a reordering)."""
        rows = torch.tensor(keep, device=batch.anchors.device)
        select_cache_rows(batch.target_cache, rows)
        batch.proposer.select_rows(batch.draft_state, rows)
        batch.sequences = [batch.sequences[i] for i in keep]
        batch.target_valid = batch.target_valid[rows]
        batch.anchors, batch.anchor_positions = batch.anchors[rows], batch.anchor_positions[rows]

    # ---- whole generations --------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], config: GenerationConfig | list[GenerationConfig] | None = None,
    ) -> list[GenerationOutput]:
        """Decode several prompts together (ragged); each output equals its batch-of-one output.

        `config` is shared, or one per prompt (e.g. different seeds); the first one's block size is used
        (a number, the drafter's own, or "auto": chosen before every step for the rows still decoding).
        A prompt the target gives no token (NaN logits) finishes with finish_reason "error" and its `error`
        says why; the others decode on (`GenerationOutput.raise_for_error` makes that an exception).
        """
        configs = config if isinstance(config, list) else [config or GenerationConfig()] * len(prompts)
        if not all(isinstance(c, GenerationConfig) for c in configs):
            raise GenerationError("config is a GenerationConfig (or a list of them, one per prompt): "
                                  "GenerationConfig(max_new_tokens=64, ...)")
        if not isinstance(prompts, (list, tuple)) or any(isinstance(p, (str, numbers.Integral)) for p in prompts):
            raise GenerationError("prompts is a list of prompts, each a list of token ids: [[1, 2, 3], ...]")
        if len(configs) != len(prompts):
            raise GenerationError(f"{len(configs)} generation configs for {len(prompts)} prompts; give one config for "
                                  "all of them, or a list of one per prompt")
        if not prompts:
            return []
        proposer = self.proposer_for(configs[0])
        policy = self.block_policy_for(configs[0], len(prompts))  # before any request's clock starts
        sequences = [self._new_row(i, p, c, len(prompts))
                     for i, (p, c) in enumerate(zip(prompts, configs))]
        batch = self._prefill_rows(sequences, proposer)
        while batch is not None:
            with contextlib.suppress(RowsFailed):  # those rows finished with finish_reason "error"; the rest go on
                self.adaptive_step(batch, policy)
            batch = self.drop_finished(batch)
        return [s.result() for s in sequences]

    def _prefill_rows(self, sequences: list[Sequence], proposer: Proposer) -> Batch | None:
        """The rows' prefills merged into one batch of those still decoding (None: none is). A prompt the target
        gives no first token finishes with finish_reason "error", as a row that gets none in a step does."""
        batches = []
        for seq in sequences:
            try:
                batches.append(self.prefill(seq, proposer))
            except NoTokenError as err:
                seq.fail(str(err))
        return self.drop_finished(self.merge(batches)) if batches else None

    def generate_one(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> GenerationOutput:
        """One prompt's output, for a caller that decodes it alone: a prompt the target gives no token is the
        NoTokenError that says why (`generate` finishes it with finish_reason "error" beside the others)."""
        return self.generate([prompt_ids], config)[0].raise_for_error()

    def stream(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> "TokenStream":
        """Iterate over the new tokens of each step; `.result` holds the full output afterwards."""
        return TokenStream(self, prompt_ids, config or GenerationConfig())


class TokenStream:
    def __init__(self, engine: SpeculativeEngine, prompt_ids: list[int], config: GenerationConfig):
        self._engine = engine
        self._policy = engine.block_policy_for(config, 1)
        self._seq = engine.new_sequence(prompt_ids, config)
        self._proposer = engine.proposer_for(config)
        self.stop_token_ids = self._seq.stop.stop_token_ids  # the ids it stops at (they add no text)
        self.result: GenerationOutput | None = None

    def __iter__(self) -> Iterator[list[int]]:
        self._seq.started = time.perf_counter()  # its time to first token runs from the first read, not creation
        batch = self._engine.prefill(self._seq, self._proposer)
        yield list(self._seq.output_ids)
        while not self._seq.finished:
            kept = self._engine.adaptive_step(batch, self._policy)[0]
            if kept:
                yield kept
        self.result = self._seq.result()
