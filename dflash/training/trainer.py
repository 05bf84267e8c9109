"""The drafter training recipe: setup / train / evaluate / save_checkpoint / export / cleanup.

Target features are computed on the fly without gradients (optionally cached); only the drafter's
layers, fc and norms train; the target's embedding and LM head are used frozen. Under `torchrun` the
same command trains with DDP (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn

from dflash.chat import THINKING_IGNORED, describe_template_kwargs, ignores_thinking, renders_alike
from dflash.errors import UserError, in_brief, why_not_written
from dflash.model.config import untappable
from dflash.model.dflash2 import GroupedDynamicConv
from dflash.model.drafter import DFlashDraftModel
from dflash.model.loading import load_drafter, resolve_model_dir, save_drafter
from dflash.model.target import check_compatible, check_drafter_fits
from dflash.training import datagen
from dflash.training.checkpoints import CheckpointDir, check_resumable, step_of
from dflash.training.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_LENGTH,
    PATH_OPTIONS,
    TrainConfig,
    absolute_if_local,
    portable_settings,
)
from dflash.training.data import (
    Batch,
    Example,
    collate,
    epoch_batches,
    fingerprint,
    read_examples,
    seeded_generator,
    split_records,
    torch_seed,
)
from dflash.training.drafter_setup import (
    check_kept_options,
    choose_mask_token_id,
    deepen,
    dflash2_options,
    drafter_config_for,
    free_mask_token_id,
    mask_token_advice,
    mask_token_problem,
    mask_token_uses,
    text_token_problem,
    to_dflash2,
    unused_text_token,
    widen_features,
    widen_mlp,
)
from dflash.training.drafting_head import DraftingHead, DraftOutput
from dflash.training.feature_cache import FeatureCache
from dflash.training.lock import DirectoryLock, being_written
from dflash.training.objective import (
    Blocks,
    block_hits,
    block_loss,
    build_blocks,
    estimated_acceptance_length,
    leading_correct,
    loss_gamma,
    sample_anchors,
    selector_loss,
    true_predecessors,
    walk_decoding_anchors,
)
from dflash.training.processes import process_device
from dflash.training.reporting import TensorBoardReport, reporter


def parameter_groups(drafter: DFlashDraftModel, lr: float) -> list[dict]:
    """Every parameter at `lr`, except DFlash2's kernel projections, at their `projection_lr_scale` of it (each
    group's `lr_scale`)."""
    convs = [m for m in drafter.modules() if isinstance(m, GroupedDynamicConv)]
    scaled = [p for conv in convs for p in conv.kernel_projection.parameters()]
    ids = {id(p) for p in scaled}
    groups = [{"params": [p for p in drafter.parameters() if id(p) not in ids], "lr": lr, "lr_scale": 1.0}]
    if scaled:
        scale = GroupedDynamicConv.projection_lr_scale
        groups.append({"params": scaled, "lr": lr * scale, "lr_scale": scale})
    return groups


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM while training asks the loop to stop after the current step, so it can save a
    checkpoint of a consistent state; once the steps are done (`finishing`), the run goes on to its evaluation and
    export. A second signal acts at once, unless it comes within REPEAT_WINDOW_S of the first: that is the same
    stop delivered twice (a job scheduler signals every process of a job, and torchrun forwards its own copy to
    its workers milliseconds later). Only the main thread can take signals."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_WINDOW_S = 1.0

    def __init__(self, announce: bool):
        self.requested = False
        self.finishing = False  # every step has trained: what is left is the last checkpoint, evaluation, export
        self._announce = announce
        self._previous: dict[int, object] = {}
        self._first_at: float | None = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_at is not None:
            if now - self._first_at < self.REPEAT_WINDOW_S:
                return  # the same stop, delivered again
            self._act_at_once(signum, frame)
            return
        self.requested, self._first_at = True, now
        if self._announce and self.finishing:
            print("dflash train: the last step has trained; finishing the run (its checkpoint, the final evaluation "
                  "and the export; again to stop at once, and --resume exports the last step saved)", file=sys.stderr,
                  flush=True)
        elif self._announce:
            print("dflash train: stopping after this step to save a checkpoint (again to stop at once, losing the "
                  f"steps since the last checkpoint){_TORCHRUN_KILLS if os.environ.get('TORCHELASTIC_RUN_ID') else ''}",
                  file=sys.stderr, flush=True)

    def _act_at_once(self, signum, frame) -> None:
        """What the signal did before training took it: Python's KeyboardInterrupt for Ctrl-C, the end of the
        process for SIGTERM."""
        previous = self._previous[signum]
        previous = signal.SIG_DFL if previous is None else previous  # None: a handler not set from Python
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)


# torchrun forwards a stop to its workers and kills them 30 s later (its default --shutdown-timeout)
_TORCHRUN_KILLS = ("; torchrun kills its workers 30 s after a stop, so a longer checkpoint needs its "
                   "--shutdown-timeout SECONDS (recent torch versions)")


def _lost_a_process(err: RuntimeError) -> bool:
    """Whether a collective failed because another process of the job went away (gloo: "Connection closed by
    peer", "Connection reset by peer"; NCCL: a DistBackendError)."""
    backend_error = getattr(dist, "DistBackendError", ())
    return isinstance(err, backend_error) or any(
        words in str(err) for words in ("closed by peer", "reset by peer", "Broken pipe", "Connection refused"))


_EVAL_EPOCH = 999_999  # anchors for evaluation are drawn once, the same at every evaluation


def _example_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return seeded_generator((seed * 1_000_003 + epoch) * 10_000_019 + index)


class Trainer:
    def __init__(self, config: TrainConfig):
        if not isinstance(config, TrainConfig):
            raise UserError(f"Trainer takes a TrainConfig, not {type(config).__name__}: Trainer(load_config(yaml_path, "
                            "options)) checks the options and fills in the defaults")
        self.config = config
        self.step = 0
        self.earlier_train_time_s = 0.0  # the time the resumed checkpoint's runs trained, before this one
        self._run_started = time.perf_counter()  # reset when training starts
        self.rank, self.world = 0, 1
        # holds nothing of the trainer: a trainer nobody holds any more lets go of --output at once (no cycle)
        self.feature_cache = FeatureCache(config.feature_cache)
        self.checkpoints = CheckpointDir(Path(config.output) / "checkpoints")
        self.history: list[dict] = []
        self.trained_with: dict | None = None  # a resume with no step left: the checkpoint's settings, exported
        self._output_lock: DirectoryLock | None = None  # rank 0's, on --output from setup to the end of train
        self._setup_log: list[dict] | None = None  # while setting up: the records train_log.jsonl gets if it succeeds
        self._stopped = False  # a Ctrl-C stopped the run after a step, and `_stop` said where
        self._report: TensorBoardReport | None = None  # --report-to's, rank 0's, while train runs

    # ---- setup ----------------------------------------------------------------------------------------
    def setup(self) -> "Trainer":
        """Everything before the first step. A setup that fails leaves --output as it found it: no directory it
        created, no line in train_log.jsonl (what it logged is written only once it has succeeded)."""
        self._setup_distributed()
        created = self._check_directories()
        self._lock_output()  # refused: another run holds --output, and the directories are its own (even ones this
        self._setup_log = []  # run counted as created, in the same instant as it did)
        try:
            self._setup_output()
            self._setup_target()
            self._setup_data()
            self._setup_drafter()
            self._setup_optimizer()
            self._setup_feature_cache()
            if self.config.resume:
                self._load_latest_checkpoint()
            self._clear_earlier_run()
        except BaseException:  # a run that never started leaves no empty directories behind
            self._setup_log = None
            self._unlock_output()
            _remove_empty(created)
            raise
        logged, self._setup_log = self._setup_log, None
        if self.rank == 0:
            self._writing_log(_cut_half_written_line)  # once, before this run's first record
        for record in logged:
            self._write_log(record)
        return self

    def _setup_distributed(self) -> None:
        self.device = self._device()
        if self.device.type == "cuda":  # nccl's collectives, and any CUDA work without a device, use this GPU
            torch.cuda.set_device(self.device)
            use_tf32(self.config.tf32)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _device(self) -> torch.device:
        """--device, checked; by default this process's GPU when there is one (`process_device`)."""
        name = process_device(self.config.device)
        if not name:
            return torch.device("cpu")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UserError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N (default: cuda when "
                            "there is a GPU)") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise UserError(f"--device {name}, but torch sees no CUDA GPU here; pass --device cpu, or leave "
                                "--device out to use a GPU when there is one")
            if device.index >= torch.cuda.device_count():
                raise UserError(f"--device {device} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
        return device

    def _check_directories(self) -> list[Path]:
        """Create --output and a --feature-cache directory before the target loads: a run must not end in an
        error about where its results go. --output is never the target's or --init-from's directory, whose model the
        export would overwrite. Returns the directories it created, parents first."""
        c = self.config
        output = Path(c.output).expanduser().resolve()
        cache = None if c.feature_cache in (None, "memory") else Path(c.feature_cache).expanduser().resolve()
        for flag, source in (("--target", c.target), ("--init-from", c.init_from)):
            given = Path(source).expanduser().resolve() if source else None
            if given is not None and given == output:  # also when neither exists yet (--init-from names a typo)
                raise UserError(f"--output {c.output} is the {flag} directory: the trained drafter would be written "
                                "over that model; pass another --output")
            inside = given is not None and cache is not None and (cache == given or given in cache.parents)
            if inside and given.is_dir():
                raise UserError(f"--feature-cache {c.feature_cache} is inside the {flag} directory: its files would "
                                "be written into that model's checkpoint; give a directory of its own")
        if cache is not None and cache == output:
            raise UserError(f"--feature-cache {c.feature_cache} is the --output directory, where the drafter is "
                            "exported; give a directory of its own (e.g. a features/ folder beside it)")
        wanted = [("--output", Path(c.output), "give a directory (it is created if missing)"),
                  ("--output", self.checkpoint_dir,
                   "give a directory you can write (checkpoints go in its checkpoints/)")]
        if c.feature_cache not in (None, "memory"):
            wanted.append(("--feature-cache", Path(c.feature_cache), "give a directory (it is created if missing), or "
                           "'memory'"))
        created: list[Path] = []
        for _, path, _ in wanted:  # each, with the missing folders above it
            missing = [p for p in (path, *path.parents) if not p.exists()]
            created += [p for p in reversed(missing) if p not in created]
        try:
            for flag, path, advice in wanted:
                _make_directory(flag, path, advice)
        except BaseException:  # e.g. an uncreatable --feature-cache: --output's new directories go too
            _remove_empty(created)
            raise
        return created

    def _lock_output(self) -> None:
        """Two runs on one --output would write each other's checkpoints, prune them and mix their logs: the first
        holds a lock on the directory until it ends, and a second is refused (on every process)."""

        def lock() -> None:
            self._output_lock = DirectoryLock(Path(self.config.output), (
                f"another dflash train is writing {self.config.output}; let it finish (or stop it with Ctrl-C: it "
                "saves a checkpoint to --resume from), or pass another --output"))

        self._on_rank_0(lock)

    def _unlock_output(self) -> None:
        if self._output_lock is not None:
            self._output_lock.release()
            self._output_lock = None

    def _setup_output(self) -> None:
        """A fresh run never shares its output with an earlier run's checkpoints: pruning would delete the new ones
        and --resume would continue the old run. --overwrite deletes them, once the whole set-up has succeeded
        (`_clear_earlier_run`): a mistyped option must not cost the earlier run."""
        c = self.config
        found = self.checkpoints.all()
        self._barrier()  # every process has looked before any deletes
        if found and not c.resume and not c.overwrite:
            raise UserError(f"{self.checkpoint_dir} holds checkpoints of an earlier run (newest: {found[-1].name}); "
                            "pass --resume to continue that run, --overwrite to delete them and start afresh, or "
                            "another --output")
        self._refuse_a_model_output(resumable=bool(found))

    def _clear_earlier_run(self) -> None:
        """--overwrite: delete the earlier run's checkpoints, log and exported model, the last thing before training
        starts. The model goes too: a run stopped before its own export must not leave the earlier drafter to load
        beside its checkpoints (`dflash generate` then refuses the output and says how to export them)."""
        c = self.config
        if c.resume or not c.overwrite:
            return
        exported = [Path(c.output) / name for name in EXPORTED_FILES]
        if not self.checkpoints.all() and not any(p.is_file() for p in exported):
            return
        self._barrier()  # every process has set up (and looked) before any deletes

        def delete() -> None:
            self.checkpoints.clear()
            for path in [*exported, Path(c.output) / "train_log.jsonl"]:
                path.unlink(missing_ok=True)

        self._on_rank_0(delete)  # a failure there stops every process (and ends as the barrier did)

    def _refuse_a_model_output(self, resumable: bool) -> None:
        """The export writes config.json, model.safetensors and training_config.yaml into --output: over another
        model (or a config file kept there) only when --overwrite says so, or when a run resumes its own checkpoints
        there."""
        c, output = self.config, Path(self.config.output).resolve()
        if c.overwrite or resumable:
            return
        models = sorted(p.name for p in _model_files_in(output))
        if models:
            raise UserError(f"--output {c.output} already holds a model ({', '.join(models)}) and no checkpoints of a "
                            "run to resume: training would write the drafter over it; pass another --output, or "
                            "--overwrite to replace it")
        if (output / "training_config.yaml").is_file():
            raise UserError(f"--output {c.output} holds a training_config.yaml, which the export writes: keep your "
                            "own elsewhere (or pass --overwrite to replace it), or pass another --output")

    def _setup_target(self) -> None:
        from dflash.api import load_target

        self.target = load_target(self.config.target, dtype="auto", device=self.device,
                                  trust_remote_code=self.config.trust_remote_code)
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = self.target.tokenizer
        if self.config.enable_thinking and not getattr(self.tokenizer, "chat_template", None):
            from dflash.chat import THINKING_WITHOUT_TEMPLATE

            raise UserError(THINKING_WITHOUT_TEMPLATE)
        if self.config.enable_thinking and ignores_thinking(self.tokenizer):
            self._warn(THINKING_IGNORED)
        problem = self.target.distillation_problem() if self.config.distill_weight > 0 else None
        if problem:
            raise UserError(f"--distill-weight {self.config.distill_weight}: {problem}, so the soft labels would "
                            "not be its distribution; train without --distill-weight")

    def _setup_data(self) -> None:
        c = self.config
        self.context = self.target.context_length  # what decoding reaches (a longrope target: its switch)
        if self.context and c.max_length and c.max_length > self.context:
            self._note(f"--max-length {c.max_length} is beyond the target's context of {self.target.context_words}; "
                       f"sequences are cut at {self.context}")
        limit = c.max_length or DEFAULT_MAX_LENGTH
        c.max_length = min(limit, self.context) if self.context else limit
        self.text_records = 0  # counted by `_read`
        files = [("--data", c.data), *(("--extra-train-data", path) for path in c.extra_train_data or [])]
        flag_given = c.template_kwargs() is not None
        data_mode, taken = self._settle_template_mode(files)  # before any text record renders
        train, self.eval_examples = split_records(self._read("--data", c.data), c.eval_fraction, c.seed)
        if c.eval_fraction > 0 and not self.eval_examples:
            self._warn(f"--eval-fraction {c.eval_fraction} holds nothing out: --data {c.data} holds one conversation "
                       "(a record's turns stay together), which training needs; no held-out figures are logged")
        self.train_examples = self._without_held_out_prompts(train, "--data", c.data)  # a prompt listed twice
        for path in c.extra_train_data or []:
            self.train_examples += self._without_held_out_prompts(self._read("--extra-train-data", path),
                                                                  "--extra-train-data", path)
        if taken:
            self._say_mode_from_data(data_mode)
        if flag_given and not self.text_records and data_mode is None:  # else `_settle_template_mode` spoke
            flag = ("--chat-template-kwargs" if c.enable_thinking is None else
                    "--enable-thinking" if c.enable_thinking else "--no-enable-thinking")
            self._warn(f"{flag} renders text records, and this data holds none: its records hold the token ids "
                       "dflash datagen made, with its own --enable-thinking setting (pass that flag to datagen)")
        self.data_fingerprint = {"train": fingerprint(self.train_examples), "eval": fingerprint(self.eval_examples)}
        self.global_batch = c.batch_size * c.grad_accum * self.world
        if len(self.train_examples) < self.global_batch:
            held = f" ({len(self.eval_examples)} more held out by --eval-fraction)" if self.eval_examples else ""
            count = len(self.train_examples)
            raise UserError(f"only {count} training example{'' if count == 1 else 's'}{held} for a global batch of "
                            f"{self.global_batch} (--batch-size x --grad-accum x processes); lower --batch-size or "
                            "--grad-accum, or add data")
        self.batches_per_epoch = len(self.train_examples) // self.global_batch
        self.total_steps = c.max_steps or max(1, math.ceil(c.epochs * self.batches_per_epoch))
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        self.pad_id = pad if pad is not None else 0

    def _settle_template_mode(self, files: list[tuple[str, str]]) -> tuple[dict | None, bool]:
        """The chat template variables dflash datagen made the data's answers with (its settings files say), which
        text records then render with too, unless --enable-thinking says otherwise: one drafter, one way of
        rendering prompts, recorded in training_config.yaml (decoding warns when it renders them otherwise). Files
        made in different modes, or a flag that differs from theirs, are named in a warning. Returns the data's
        variables ({}: the template's defaults; None: no datagen settings, or modes that differ), and whether text
        records take them (said once they are counted, `_say_mode_from_data`)."""
        c = self.config
        made = {f"{flag} {path}": settings.get("chat_template_kwargs") or {} for flag, path in files
                if (settings := _datagen_settings(path))}
        modes = list({json.dumps(m, sort_keys=True): m for m in made.values()}.values())
        alike = len(modes) <= 1 or all(renders_alike(self.tokenizer, modes[0], m) for m in modes[1:])
        if not alike:
            named = "; ".join(f"{where}: {describe_template_kwargs(m)}" for where, m in made.items())
            self._warn(f"dflash datagen made the data's answers with different chat template settings ({named}): the "
                       "drafter learns prompts rendered both ways and is served with one; make them all with the "
                       "--enable-thinking setting the target will be served with")
            return None, False
        if not modes:
            return None, False
        mode = modes[0]
        given = c.template_kwargs()
        if given is None and c.chat_template_kwargs == {}:  # --chat-template-kwargs '{}': the template's defaults
            given = {}
        if given is None and mode:  # text records as the answers were made; exported with them
            c.enable_thinking = mode.get("enable_thinking")
            c.chat_template_kwargs = {k: v for k, v in mode.items() if k != "enable_thinking"} or None
            return mode, True
        if given is not None and not renders_alike(self.tokenizer, given, mode):
            self._warn(f"{describe_template_kwargs(given)} (given to dflash train by flag or --config), but dflash "
                       f"datagen made the data's answers with {describe_template_kwargs(mode)} ({', '.join(made)}): "
                       "text records render otherwise than those answers' prompts, and the exported drafter records "
                       "what train was given; give what datagen was given, or regenerate the answers")
        return mode, False

    def _say_mode_from_data(self, mode: dict) -> None:
        """Where the data's settings chose how text records render: a warning when there are text records (they
        render otherwise than the template's defaults, which this package used before 2026-12-07), else a note."""
        said = (f"text records render with {describe_template_kwargs(mode)}, as dflash datagen made the data's "
                "answers (its settings files say)")
        if self.text_records:
            self._warn(f"{self.text_records} {said}; pass --chat-template-kwargs '{{}}' for the template's defaults")
        else:
            self._note(said)

    def _read(self, flag: str, path: str) -> list[Example]:
        """The examples of one data file; records that leave nothing to train on are named in a warning, and so is
        another target's datagen output."""
        if being_written(path):
            raise UserError(f"{flag} {path} is still being written by dflash datagen; let it finish, then train (a run "
                            "on part of it could not be resumed once the file has grown)")
        parts = datagen.stopped_parts(Path(path))
        if parts:
            raise UserError(f"{flag} {path}: a torchrun run of dflash datagen on it was stopped before joining its "
                            f"processes' answers, which are in {', '.join(p.name for p in parts[:3])}"
                            f"{' ...' if len(parts) > 3 else ''} beside it: rerun that datagen command (one process "
                            "is enough) to finish and join them, or delete those files to train on what it holds")
        settings = _datagen_settings(path)
        if settings.get("finished") is False:
            self._warn(f"{flag} {path} is the output of a dflash datagen run that was stopped before it finished: "
                       "training on what it holds so far. Rerun that datagen command to finish it first, as a "
                       "--resume of this run is refused once the file has grown (its examples differ)")
        suffix = settings.get("prompt_suffix")
        loaded = read_examples(path, self.tokenizer, self.config.max_length, self.target.vocab_size, flag,
                               self.config.template_kwargs(), suffix if isinstance(suffix, str) else "")
        self._check_data_target(flag, path, settings)
        if loaded.decode_checked >= 3 and loaded.decode_differs * 2 > loaded.decode_checked:
            self._warn(f"{flag} {path}: the answer token ids of {loaded.decode_differs} of the {loaded.decode_checked} "
                       "records checked do not decode, with this target's tokenizer, to the answer text beside them: "
                       "the data look made with another tokenizer (another target's dflash datagen?), and a drafter "
                       "trained on them drafts nothing this target says; make them with `dflash datagen --target` "
                       "this target")
        self.text_records += loaded.text_records
        if loaded.dropped:
            lines = ", ".join(map(str, loaded.dropped[:10])) + (" ..." if len(loaded.dropped) > 10 else "")
            self._warn(f"{flag} {path}: {len(loaded.dropped)} of {loaded.records} "
                       f"records are left out, their responses empty or cut below 2 tokens by --max-length "
                       f"{self.config.max_length} (lines {lines})")
        if loaded.answers_without_ids:
            self._warn(f"{flag} {path}: {loaded.answers_without_ids} earlier answers of multi-turn records do not "
                       "train: the records hold only their last turn's ids (dflash datagen before 2026-12-06 wrote "
                       "them so); rerun datagen into a new file to train on every answer")
        if loaded.cut_turns:
            self._warn(f"{flag} {path}: {loaded.cut_turns} turns of conversations are left out, their responses "
                       f"empty or cut below 2 tokens by --max-length {self.config.max_length} (the other turns of "
                       "their records train)")
        return loaded.examples

    def _check_data_target(self, flag: str, path: str, settings: dict) -> None:
        """Warn when `dflash datagen` wrote the file with another target (its settings file says which), or when no
        settings file says whose answers the file holds (a public trainers' pitfall: answers not regenerated by the
        target)."""
        wrote_with = settings.get("target")
        ours = datagen.target_name(self.config.target)
        if not settings:
            self._warn(f"{flag} {path} has no dflash datagen settings beside it, so whose answers it holds is unknown: "
                       "a drafter learns to draft its target from that target's own answers, and one trained on "
                       "another model's (a public dataset's, a bigger model's) drafts fewer accepted tokens; if they "
                       f"are not {ours}'s, make them with `dflash datagen --target {self.config.target or ours}`")
        if isinstance(wrote_with, str) and wrote_with != ours:
            self._warn(f"{flag} {path} holds the answers of another target ({wrote_with}, says "
                       f"{settings['file']}), and this drafter is trained for {ours}: a drafter learns to draft its "
                       "target from that target's own answers, so regenerate them with `dflash datagen --target "
                       f"{self.config.target or ours}`")

    def _without_held_out_prompts(self, examples: list[Example], flag: str, path: str) -> list[Example]:
        """Training examples, less the responses whose prompt is a held-out one (another answer to it, or the same
        record twice in --data): the held-out figures must come from prompts training never saw. Such a response
        stays in its sequence as context of the turns after it, untrained."""
        held = {prompt for e in self.eval_examples for prompt in e.prompts()}
        asked = {a for e in self.eval_examples for a in e.asked}  # the same questions after other answers
        kept, left, answers_left = [], set(), 0
        for e in examples:
            fresh = [i for i, (prompt, question) in enumerate(zip(e.prompts(), e.asked))
                     if question not in asked and prompt not in held]
            if len(fresh) < len(e.responses):
                left.add(e.record)
                answers_left += len(e.responses) - len(fresh)
            if fresh:
                kept.append(e.keeping(fresh))
        if left:
            answers = f" ({answers_left} answers)" if answers_left != len(left) else ""
            still = len(left & {e.record for e in kept})
            others = f"; {still} of these records train on their other answers" if still else ""
            self._warn(f"{flag} {path}: {len(left)} records{answers} answer a prompt or the questions of the held-out "
                       f"split of --data, and those answers are left out of training{others} (the held-out figures "
                       "would be measured on prompts training saw)")
        return kept

    def _setup_drafter(self) -> None:
        c = self.config
        self._refuse_a_drafter_deeper_than_the_target()
        torch.manual_seed(torch_seed(c.seed))
        if c.init_from:
            self.drafter = self._pretrained_drafter(c.init_from)
            self.drafter_config = self.drafter.config
        else:
            c.dflash2 = bool(c.dflash2)  # not said: a DFlash drafter
            c.block_size = c.block_size or DEFAULT_BLOCK_SIZE
            mask_id = choose_mask_token_id(c, self.tokenizer, self.target.vocab_size)
            if mask_id is None:
                raise UserError(f"cannot pick a mask token: {self._mask_token_advice()}")
            self._check_mask_token(mask_id)
            self.drafter_config = drafter_config_for(self.target, c, mask_id)
            self.drafter = DFlashDraftModel(self.drafter_config)
            self.drafter.init_weights()
        self._warn_untapped_layer()
        self.drafter.to(self.device, torch.float32).train()
        self.head = DraftingHead(self.drafter, self.target)
        self.model: nn.Module = self.head
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.head, device_ids=ids)
        self.gamma = c.loss_gamma or loss_gamma(c.block_size)

    def _refuse_a_drafter_deeper_than_the_target(self) -> None:
        """A drafter deeper than its target drafts slower than the target decodes; a typo (--draft-layers 100)
        would also fill the memory before the first step."""
        layers, target_layers = self.config.draft_layers, self.target.num_layers
        if layers is not None and layers > target_layers:
            raise UserError(f"--draft-layers {layers}: the target has {target_layers} layers, and a drafter deeper "
                            "than its target drafts slower than the target decodes; DFlash drafters have a few "
                            f"layers (1 by default): give at most {target_layers}")

    def _warn_untapped_layer(self) -> None:
        """A drafter whose target layers vLLM and SGLang cannot feed it (`untappable`: e.g. the target's last layer,
        or a fine-tuned drafter's own ids) serves with `dflash serve` only; the hand-off refuses it."""
        ids = self.drafter_config.target_layer_ids
        problem = untappable(ids, self.target.num_layers)
        if problem:
            self._warn(f"the drafter's feature layers {ids}: {problem}; it will serve with `dflash serve` only "
                       "(--target-layer-ids picks others)")

    def _check_mask_token(self, mask_id: int) -> None:
        """Refuse a mask token that aliases pad, eos or text (`_mask_token_problem`); warn when the responses hold
        it, or when it is the token of text a tokenizer without a free id leaves."""
        problem = self._mask_token_problem(mask_id)
        if problem:
            chosen = "--mask-token-id" if self.config.mask_token_id is not None else "the tokenizer's mask token"
            raise UserError(f"{chosen} ({mask_id}) cannot be the mask token: {problem}; {self._mask_token_advice()}")
        text = text_token_problem(mask_id, self.tokenizer)
        if text:  # allowed: no free id, and no training sequence holds it
            self._warn(f"--mask-token-id {mask_id}: {text}, which none of the {self._num_examples()} training "
                       "sequences holds, so the drafter learns it as its mask (this tokenizer has no special token "
                       "to spare and every embedding row is a token). Where the target writes it, the block after "
                       "it drafts poorly; the output stays the target's")
        self._warn_mask_token_uses(mask_id)

    def _mask_token_problem(self, mask_id: int) -> str | None:
        """`mask_token_problem`, except for a token of text where the tokenizer has no free id (GPT-2's layout):
        that one is a problem only where training sequences hold it."""
        problem = mask_token_problem(mask_id, self.target)
        if not problem or self._has_free_mask_id() or problem != text_token_problem(mask_id, self.tokenizer):
            return problem
        holding = sum(mask_id in e.input_ids for e in self.train_examples + self.eval_examples)
        return f"{problem}, held by {holding} of the {self._num_examples()} training sequences" if holding else None

    def _has_free_mask_id(self) -> bool:
        return free_mask_token_id(self.tokenizer, self.target.vocab_size) is not None

    def _num_examples(self) -> int:
        return len(self.train_examples) + len(self.eval_examples)

    def _mask_token_advice(self) -> str:
        """`mask_token_advice`, and where the tokenizer has no id to spare, a token of text the data never holds."""
        advice = mask_token_advice(self.tokenizer, self.target.vocab_size)
        if self.tokenizer is None or self._has_free_mask_id():
            return advice
        spare = unused_text_token(self.target, self.train_examples + self.eval_examples)
        if spare is None:
            return (f"{advice}; this tokenizer has no special token to spare, every embedding row is a token, and "
                    "the data holds every one: add a special token to the target's tokenizer and embedding")
        return (f"{advice}; this tokenizer has no special token to spare and every embedding row is a token, so "
                f"pass a token of text the data never holds, such as --mask-token-id {spare} "
                f"({self.tokenizer.convert_ids_to_tokens(spare)!r})")

    def _warn_mask_token_uses(self, mask_id: int) -> None:
        uses = mask_token_uses(mask_id, self.train_examples + self.eval_examples)
        if uses:
            self._warn(f"the mask token ({mask_id}) occurs {uses} times in the responses: blocks that start at it "
                       "or are labelled with it teach the drafter to confuse a mask with a token; "
                       f"{mask_token_advice(self.tokenizer, self.target.vocab_size)}")

    def _pretrained_drafter(self, path: str) -> DFlashDraftModel:
        """Fine-tune an existing drafter: its own shape and mask token; the block size may change,
        --target-layer-ids may add feature layers (`widen_features`), --intermediate-size widen its MLP
        (`widen_mlp`) and --draft-layers add layers (`deepen`)."""
        drafter = load_drafter(path, dtype=torch.float32, device=self.device)
        check_drafter_fits(self.target, drafter.config)
        if self.config.dflash2 is False and drafter.config.dflash2 is not None:
            raise UserError(f"--no-dflash2: the drafter in {path} is a DFlash2 drafter, whose convolutions and "
                            "selector cannot be taken out; leave --no-dflash2 out to fine-tune it as it is, or train "
                            "a DFlash drafter from scratch (without --init-from)")
        drafter.config.num_target_layers = self.target.num_layers  # stated in the export, where its config had none
        check_kept_options(self.config, drafter.config, path)
        self.config.block_size = drafter.config.block_size = self.config.block_size or drafter.config.block_size
        wanted = self.config.target_layer_ids
        if wanted is not None and list(wanted) != drafter.config.target_layer_ids:
            widen_features(drafter, list(wanted))
            check_compatible(self.target, drafter.config)
        if self.config.intermediate_size is not None:
            widen_mlp(drafter, self.config.intermediate_size)
        if self.config.draft_layers is not None:
            deepen(drafter, self.config.draft_layers)
        if self.config.dflash2 and drafter.config.dflash2 is None:
            to_dflash2(drafter, dflash2_options(self.config))
        self.config.dflash2 = drafter.config.dflash2 is not None  # training_config.yaml says what was trained
        mask_id = drafter.config.mask_token_id
        problem = self._mask_token_problem(mask_id)
        if problem:  # the drafter learnt with this mask token: a warning, it cannot change now
            self._warn(f"the drafter's mask token ({mask_id}) aliases a real token: {problem}; its blocks cannot "
                       "tell a mask from that token, which lowers acceptance")
        self._warn_mask_token_uses(mask_id)
        return drafter

    def _setup_optimizer(self) -> None:
        c = self.config
        groups = parameter_groups(self.drafter, c.lr)
        self.lr_scales = [g["lr_scale"] for g in groups]  # kept here too: a loaded optimizer state may lack them
        self.optimizer = torch.optim.AdamW(groups, lr=c.lr, weight_decay=c.weight_decay, betas=(0.9, 0.95))
        warmup = max(1, int(c.warmup_ratio * self.total_steps))
        total = self.total_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def _setup_feature_cache(self) -> None:
        """A --feature-cache directory serves only the setup its manifest names (`FeatureCache.check`)."""
        if self.feature_cache.directory is None:
            return
        manifest = self._feature_manifest()
        self.feature_cache.check(manifest, self.checkpoint_dir)
        self._barrier()  # every process has checked before the manifest is written
        self._on_rank_0(lambda: self.feature_cache.write_manifest(manifest))  # a failure there stops every process

    def _feature_manifest(self) -> dict:
        return {"target": absolute_if_local(self.config.target), "target_files": _model_files(self.config.target),
                "target_dtype": str(self.target.dtype).removeprefix("torch."),
                "feature_layer_ids": list(self.drafter_config.target_layer_ids), "examples": self.data_fingerprint}

    # ---- one step ----------------------------------------------------------------------------------------
    def _features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features (b, T, F) and, when distilling, the target's final hidden states (b, T, h) (else None)."""
        soft = self.config.distill_weight > 0
        out = self._target_outputs(batch, soft)
        f = self.drafter_config.num_features
        return out[..., :f], (out[..., f:] if soft else None)

    def _target_outputs(self, batch: Batch, soft: bool) -> torch.Tensor:
        """(b, T, F [+ h]) from the target, cached per example when --feature-cache is set."""
        ids, real = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        layer_ids = self.drafter_config.target_layer_ids
        if not self.feature_cache.enabled:
            return self.target.context_features(ids, real, layer_ids, with_final_hidden=soft).float()
        keys = [f"{batch.split}-{i}{'-soft' if soft else ''}" for i in batch.indices]
        width = self.drafter_config.num_features + (self.target.hidden_size if soft else 0)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        rows = [self.feature_cache.get(key, (length, width), self._warn) for key, length in zip(keys, lengths)]
        missing = [r for r, row in enumerate(rows) if row is None]
        if missing:
            computed = self.target.context_features(ids[missing], real[missing], layer_ids, with_final_hidden=soft)
            for r, row in zip(missing, computed):
                rows[r] = self.feature_cache.put(keys[r], row[: lengths[r]])
        out = torch.zeros(len(keys), ids.shape[1], width, device=self.device)
        for r, row in enumerate(rows):
            out[r, : row.shape[0]] = row.to(self.device).float()
        return out

    def _soft_targets(self, final_hidden: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """The target's logits for each block position p: its logits (`TargetModel.logits`) of its final hidden
        state at p - 1, the distribution the label at p was drawn from. final_hidden (b, T, h) -> (b, n*B, vocab)."""
        previous = (blocks.positions - 1).clamp(0, final_hidden.shape[1] - 1)  # (b, n*B)
        hidden = final_hidden.gather(1, previous[:, :, None].expand(-1, -1, final_hidden.shape[2]))
        with torch.no_grad():
            return self.target.logits(hidden.to(self.target.dtype)).float()

    def _loss(self, batch: Batch, epoch: int, decoding_anchors: bool = False):
        """The objective on a batch. With decoding_anchors, greedy decoding's anchors under the current drafter
        come first (`walk_decoding_anchors`) and random ones fill up to --anchors-per-sequence; the walk's
        acceptance length is returned as `walk_tau` (else None)."""
        c = self.config
        features, final_hidden = self._features(batch)
        generators = [_example_generator(c.seed, epoch, i) for i in batch.indices]
        ids, real = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        loss_mask = batch.loss_mask.to(self.device)
        walked, walk_tau = None, None
        if decoding_anchors:
            walked, walk_tokens = self._walk(ids, real, loss_mask, features)
            walk_tau = float(walk_tokens.sum()) / max(int(walked.sum()), 1)
        anchors, anchor_valid = sample_anchors(loss_mask, c.anchors_per_sequence, generators, preferred=walked)
        blocks = build_blocks(ids, loss_mask, real, anchors, anchor_valid, c.block_size,
                              self.drafter_config.mask_token_id, self.gamma)
        soft_targets = None if final_hidden is None else self._soft_targets(final_hidden, blocks)
        draft = self._draft(batch, features, blocks)
        out = block_loss(draft.logits, blocks, c.block_size, soft_targets, c.distill_weight,
                         self.head.drafted_tokens(draft, blocks.tokens))
        if draft.selector_scores is not None:  # DFlash2: + its selector's term
            selected = selector_loss(draft.selector_scores, draft.candidates, blocks)
            out.loss = out.loss + c.selector_loss_weight * selected.loss
            out.selector_recall = float(selected.recall) / max(int(selected.labelled), 1)
        return out, walk_tau

    @torch.no_grad()
    def _walk(self, ids: torch.Tensor, real: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor):
        """Greedy decoding's anchors on each response under the current drafter: one block per row at a time,
        with the context projected once. Returns `walk_decoding_anchors`'s (walked (b, T), tokens (b,))."""
        context = self.drafter.project_context(features)  # (b, T, h)
        B, mask_id = self.config.block_size, self.drafter_config.mask_token_id

        def acceptance_lengths(rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
            blocks = build_blocks(ids[rows], loss_mask[rows], real[rows], anchors[:, None],
                                  torch.ones_like(anchors[:, None], dtype=torch.bool), B, mask_id, self.gamma)
            seen = int(anchors.max())  # no block sees context at or after its anchor: drop those keys
            mask = torch.cat([blocks.attn_mask[:, :, :seen], blocks.attn_mask[:, :, ids.shape[1]:]], dim=2)
            with self._autocast():
                draft = self.head.draft(context[rows, :seen], blocks.tokens, blocks.positions, real[rows, :seen],
                                        mask)  # (r, B, vocab) logits
            drafted = self.head.drafted_tokens(draft, blocks.tokens)
            leading, _ = leading_correct(*block_hits(draft.logits, blocks, B, drafted))
            return 1 + leading[:, 0]

        return walk_decoding_anchors(loss_mask, acceptance_lengths)

    def _autocast(self):
        return (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.dtype == "bfloat16"
                else nullcontext())

    def _draft(self, batch: Batch, features: torch.Tensor, blocks: Blocks) -> DraftOutput:
        """The drafter's outputs for the blocks ((b, n*B, vocab) logits, ...), in the configured precision."""
        previous = true_predecessors(blocks, self.config.block_size) if self.drafter.selector is not None else None
        model = self.model if torch.is_grad_enabled() else self.head  # no-grad forwards: no DDP collectives
        with self._autocast():
            return model(features, blocks.tokens, blocks.positions, batch.attention_mask.to(self.device),
                              blocks.attn_mask, previous)

    def _batch(self, split: str, indices: list[int]) -> Batch:
        examples = self.train_examples if split == "train" else self.eval_examples
        return collate([examples[i] for i in indices], indices, self.pad_id, split)

    def _train_step(self, global_indices: list[int], epoch: int) -> dict:
        """One optimizer step: this process's share of the global batch, in --grad-accum forwards whose gradients
        add up (each loss divided by their number, as DDP averages over processes), synchronised once."""
        c = self.config
        share = c.batch_size * c.grad_accum
        mine = global_indices[self.rank * share: (self.rank + 1) * share]
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"loss": 0.0, "tokens": 0, "accepted": 0.0, "blocks": 0.0}
        walk_taus = []
        for start in range(0, share, c.batch_size):
            batch = self._batch("train", mine[start: start + c.batch_size])
            last = start + c.batch_size == share
            with nullcontext() if last or self.world == 1 else self.model.no_sync():  # DDP: all-reduce once
                out, walk_tau = self._loss(batch, epoch, decoding_anchors=c.anchor_policy == "decoding")
                (out.loss / c.grad_accum).backward()
            stats["loss"] += out.loss.item() / c.grad_accum
            stats["tokens"] += int(batch.attention_mask.sum())
            stats["accepted"] += float(out.accepted)
            stats["blocks"] += float(out.blocks)
            if walk_tau is not None:
                walk_taus.append(walk_tau)
        max_norm = c.grad_clip or math.inf  # 0: no clipping (the norm is still measured)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), max_norm)
        # the rate this step takes: the scheduler's record of it is stale after a resume that changed --lr or
        # --max-steps, and after scheduler.step() it is the next step's
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        walk = sum(walk_taus) / len(walk_taus) if walk_taus else None
        return {**stats, "grad_norm": float(grad_norm), "walk_tau": walk, "lr": lr}

    def _train_record(self, stats: dict, window_tokens: int, elapsed: float) -> dict:
        """The log line of a step: loss, tau and walk_tau averaged over every process, tokens/s of them all."""
        walk = stats["walk_tau"]
        loss, tokens, accepted, blocks, walk_sum = self._sum_over_processes(
            [stats["loss"], window_tokens, stats["accepted"], stats["blocks"], walk or 0.0])
        record = {"step": self.step, "epoch": round(self.step / self.batches_per_epoch, 3),
                  "loss": round(loss / self.world, 4), "grad_norm": round(stats["grad_norm"], 3),
                  "lr": stats["lr"],
                  "tau_estimate": round(estimated_acceptance_length(accepted, blocks), 3),
                  "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1)}
        if walk is not None:
            record["walk_tau"] = round(walk_sum / self.world, 3)
        return record

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Train to the last step, then checkpoint, evaluate and export. Ctrl-C (or SIGTERM) stops after the
        current step with a checkpoint to --resume from, and raises KeyboardInterrupt; once the last step has
        trained, it lets the run finish. A second one stops at once and names the newest checkpoint. The output is
        unlocked at the end."""
        self._log({"event": "start", "steps": self.total_steps, "train_examples": len(self.train_examples),
                   "eval_examples": len(self.eval_examples), "world_size": self.world,
                   "drafter": self.drafter_config.to_dict()})
        self._run_started = time.perf_counter()
        stop = StopRequest(announce=self.rank == 0)
        try:
            if self.rank == 0:  # closed when train ends, however it ends
                self._report = reporter(self.config.report_to, Path(self.config.output), self.step)
            with stop:
                self._train_steps(stop)
                stop.finishing = True
                if self.trained_with is None:  # else no step ran: the newest checkpoint is this step, as it was
                    self.save_checkpoint()  # the last step, before the final evaluation: an interrupt loses no step
                final = {"step": self.step, **self._train_times()}
                if self.eval_examples:
                    evaluated = self.evaluate()
                    self._log({"step": self.step, **evaluated})  # a step record like every evaluation's
                    final.update(evaluated)
                    self._check_held_out_loss(final.get("eval_loss"))
                self.export()
        except KeyboardInterrupt:  # SIGTERM's Terminated too
            if stop.requested and not self._stopped:  # a second signal, at once: say what is kept
                self._stopped_at_once()
            raise
        except RuntimeError as err:
            if self.world > 1 and _lost_a_process(err):  # its own error is above: one line here, not gloo's traceback
                raise UserError(f"another process of this torchrun job stopped (its error is above; here: "
                                f"{in_brief(err)}); {self.checkpoints.kept()}") from None
            raise
        finally:
            self._unlock_output()
            if self._report is not None:
                self._report.close()
        self._log({"event": "done", **final})
        self._barrier()  # no process tears its connections down while another still uses them (cleanup)
        return final

    def train_time_s(self) -> float:
        """Seconds of training to this point, the runs before a --resume included."""
        return self.earlier_train_time_s + time.perf_counter() - self._run_started

    def _train_times(self) -> dict[str, float]:
        """The done record's times: in all, and (after a --resume) this run's alone."""
        total = self.train_time_s()
        times = {"train_time_s": round(total, 1)}
        if self.earlier_train_time_s:
            times["train_time_this_run_s"] = round(total - self.earlier_train_time_s, 1)
        return times

    def _train_steps(self, stop: StopRequest) -> None:
        """The steps from the current one to the last: log, evaluate and checkpoint as configured; stop with a
        checkpoint when asked to."""
        c = self.config
        window_tokens, window_start = 0, time.perf_counter()
        while self.step < self.total_steps:
            epoch, offset = divmod(self.step, self.batches_per_epoch)
            for indices in epoch_batches(len(self.train_examples), self.global_batch, epoch, c.seed)[offset:]:
                stats = self._train_step(indices, epoch)
                self._check_finite(stats)
                window_tokens += stats["tokens"]
                if self.step % c.log_every == 0 or self.step == self.total_steps:
                    self._log(self._train_record(stats, window_tokens, time.perf_counter() - window_start))
                    window_tokens, window_start = 0, time.perf_counter()
                paused = time.perf_counter()  # evaluation and checkpoints are not training: tokens/s leaves them out
                if (self.eval_examples and c.eval_every and self.step % c.eval_every == 0
                        and self.step < self.total_steps):  # the last step's is the final evaluation (`train`)
                    self._log({"step": self.step, **self.evaluate()})
                saved = c.checkpoint_every and self.step % c.checkpoint_every == 0 and self.step < self.total_steps
                if saved:
                    self.save_checkpoint()
                window_start += time.perf_counter() - paused
                if self._stop_requested(stop):
                    self._stop(saved)
                if self.step >= self.total_steps:
                    break

    def _check_finite(self, stats: dict) -> None:
        """Stop at the first step whose loss or gradient norm is not a finite number (a too high --lr, or bfloat16
        overflowing): the weights it updated are no longer usable, and saving them would prune good checkpoints.
        Every process sees the same sums, so they all stop at the same step."""
        loss, grad_norm = self._sum_over_processes([stats["loss"], stats["grad_norm"]])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            self._diverged(f"the training {what} became {loss if what == 'loss' else grad_norm} at step {self.step}")

    def _check_held_out_loss(self, loss: float | None) -> None:
        """The final evaluation's loss: not a finite number, the last step broke the weights (they may still be
        finite, only huge), and they are neither saved nor exported."""
        if loss is not None and not math.isfinite(loss):
            if self.trained_with is None:  # this run saved them just before: they are the diverged step's
                self._on_rank_0(lambda: self.checkpoints.remove(self.step))
            self._diverged(f"the held-out loss became {loss} after the last step (step {self.step})")

    def _diverged(self, what: str) -> None:
        c = self.config
        checkpoints = self.checkpoints.all()
        self._log({"event": "diverged", "step": self.step, "message": what,
                   "checkpoint": str(checkpoints[-1]) if checkpoints else None})
        fix = f"lower --lr (now {c.lr})"
        if c.lr * c.weight_decay >= 1:  # AdamW takes lr x weight_decay of every weight each step: all of it, or more
            fix = f"lower --weight-decay (now {c.weight_decay}: with --lr {c.lr} it takes all of every weight, or more)"
        fix += " or train in float32 (--dtype float32)" if c.dtype == "bfloat16" else ""
        kept = (f"the newest checkpoint, {checkpoints[-1]}, is kept (nothing was saved from the diverged steps); "
                f"{fix} and rerun with --resume to continue from it" if checkpoints else
                f"no checkpoint was written before it; {fix} and rerun")
        raise UserError(f"{what}: training diverged and stopped; {kept}")

    def _stop_requested(self, stop: StopRequest) -> bool:
        """Whether any process was asked to stop (all of them must stop after the same step)."""
        if self.world == 1:
            return stop.requested
        return self._sum_over_processes([float(stop.requested)])[0] > 0

    def _stop(self, saved: bool) -> None:
        if not saved:
            self.save_checkpoint()
        checkpoint = self.checkpoints.step_path(self.step)
        self._log({"event": "interrupted", "step": self.step, "checkpoint": str(checkpoint)})
        if self.rank == 0:
            print(f"dflash train: stopped at step {self.step} and saved {checkpoint}; {self._resume_advice()}",
                  file=sys.stderr, flush=True)
        self._stopped = True
        raise KeyboardInterrupt

    def _stopped_at_once(self) -> None:
        """A second Ctrl-C (or SIGTERM) stopped the run wherever it was: name the newest checkpoint, which --resume
        continues from (or exports, when it is the last step)."""
        checkpoints = self.checkpoints.all()
        self._log({"event": "interrupted", "step": self.step,
                   "checkpoint": str(checkpoints[-1]) if checkpoints else None})
        if self.rank != 0:
            return
        if checkpoints:
            step = step_of(checkpoints[-1])
            print(f"dflash train: stopped at once; the newest checkpoint is {checkpoints[-1]} (step {step}): "
                  f"{self._resume_advice(step)}", file=sys.stderr, flush=True)
        else:
            print("dflash train: stopped at once, before the first checkpoint: nothing is saved to resume from; run "
                  "the same command again to start afresh", file=sys.stderr, flush=True)

    def _resume_advice(self, step: int | None = None) -> str:
        step = self.step if step is None else step
        if step >= self.total_steps:
            return "run the same command with --resume to evaluate and export it"
        return "run the same command with --resume to continue from it"

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, per-position accuracy, and two acceptance lengths: over random anchors (fixed
        across evaluations), and as greedy decoding would measure it (`eval_tau_decoding`). Under torchrun each
        process evaluates its share of the held-out batches and responses, and the sums are added up: every
        process gets the figures of the whole split."""
        self.drafter.eval()
        B = self.config.block_size
        sums = {"loss": 0.0, "n": 0.0, "accepted": 0.0, "blocks": 0.0, "recall": 0.0, "recalled_batches": 0.0}
        correct, counted = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)  # (B,)
        for indices in self._eval_batches()[self.rank::self.world]:
            out, _ = self._loss(self._batch("eval", indices), epoch=_EVAL_EPOCH)  # uniform anchors, comparable
            sums["loss"] += float(out.loss) * len(indices)
            sums["n"] += len(indices)
            sums["accepted"] += float(out.accepted)
            sums["blocks"] += float(out.blocks)
            if out.selector_recall is not None:  # DFlash2: how often the label is among a position's candidates
                sums["recall"] += out.selector_recall
                sums["recalled_batches"] += 1
            correct += out.correct.cpu()
            counted += out.counted.cpu()
        tokens, steps = self._decoding_walk(self.config.eval_decoding_examples)
        summed = self._sum_over_processes([*sums.values(), *correct.tolist(), *counted.tolist(), tokens, steps])
        sums = dict(zip(sums, summed))
        correct, counted = torch.tensor(summed[len(sums):len(sums) + B]), torch.tensor(summed[len(sums) + B:-2])
        tokens, steps = summed[-2:]
        out = {"eval_loss": round(sums["loss"] / sums["n"], 4),
               "eval_tau_estimate": round(estimated_acceptance_length(sums["accepted"], sums["blocks"]), 3)}
        if sums["recalled_batches"]:
            out["eval_candidate_recall"] = round(sums["recall"] / sums["recalled_batches"], 4)
        if self.config.eval_decoding_examples:
            out["eval_tau_decoding"] = round(tokens / steps if steps else math.nan, 3)
        self.drafter.train()
        accuracy = (correct[1:] / counted[1:].clamp_min(1)).tolist()
        return {**out, "eval_accuracy_per_position": [round(a, 3) for a in accuracy]}

    def _eval_batches(self) -> list[list[int]]:
        """The held-out split in batches of --batch-size, in order."""
        n, bs = len(self.eval_examples), self.config.batch_size
        return [list(range(start, min(start + bs, n))) for start in range(0, n, bs)]

    def _decoding_walk(self, num_responses: int) -> tuple[int, int]:
        """Tokens and steps of greedy decoding replayed on this process's share of the first `num_responses`
        held-out responses, one sequence at a time (`_walk`); tau = tokens / steps over every process."""
        tokens = steps = 0
        for i, cut in self._decoding_examples(num_responses)[self.rank::self.world]:
            batch = self._batch("eval", [i])
            if cut is not None:
                batch.loss_mask[0, cut:] = False
            features, _ = self._features(batch)  # (1, T, F)
            walked, walk_tokens = self._walk(*(t.to(self.device) for t in (batch.input_ids, batch.attention_mask,
                                                                          batch.loss_mask)), features)
            tokens, steps = tokens + int(walk_tokens.sum()), steps + int(walked.sum())
        return tokens, steps

    def _decoding_examples(self, num_responses: int) -> list[tuple[int, int | None]]:
        """The held-out sequences that hold the first `num_responses` responses, each with the position its loss
        mask is cut at (a sequence's responses past that number are left out; None: none are)."""
        chosen = []
        for i, example in enumerate(self.eval_examples):
            if num_responses <= 0:
                break
            cut = example.responses[num_responses][0] if len(example.responses) > num_responses else None
            chosen.append((i, cut))
            num_responses -= len(example.responses)
        return chosen

    # ---- checkpoints -----------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoints.path

    def save_checkpoint(self) -> None:
        """Write checkpoints/step-N atomically (temporary directory, then rename); keep the newest few. Weights that
        are not finite are never saved: they would push out checkpoints that can still be resumed."""
        finite = torch.stack([torch.isfinite(p).all() for p in self.drafter.parameters()]).all()
        if not finite:  # one host sync per checkpoint; the weights are the same on every process
            self._diverged(f"the drafter's weights are no longer finite numbers at step {self.step}")
        self._on_rank_0(self._write_checkpoint)

    def _write_checkpoint(self) -> None:
        state = {
            "step": self.step,
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.config.to_dict(),
            "drafter_config": self.drafter_config.to_dict(),
            "data": self.data_fingerprint,  # a resume must see the same examples in the same order
            "world_size": self.world,
            "train_time_s": self.train_time_s(),  # a resumed run's done record counts it in
            "total_steps": self.total_steps,  # its run's last step: reached, the data order no longer matters
        }
        self.checkpoints.write(self.step, state, self.config.keep_checkpoints)

    def _trains_on(self, state: dict) -> bool:
        """Whether resuming this checkpoint trains more steps in its data order. Not when it stands at or past the
        last step, and that step is its own run's (it finished) or the one --max-steps names now: an --epochs
        count gives fewer steps at a larger global batch, and a run that stopped half-way would pass for
        finished."""
        step = state.get("step", 0)
        if step < self.total_steps:
            return True
        finished = state.get("total_steps") is not None and step >= state["total_steps"]
        return not (finished or self.config.max_steps is not None)

    def _load_latest_checkpoint(self) -> None:
        checkpoints = self.checkpoints.all()
        if not checkpoints:
            self._log({"event": "resume", "note": "no checkpoint found; starting from scratch"})
            self._warn(f"--resume: no checkpoint found in {self.checkpoint_dir}, so training starts from scratch")
            return
        state = self.checkpoints.read(checkpoints[-1], self.device)
        self._restore(state, checkpoints[-1])
        self.step = state["step"]
        self.earlier_train_time_s = float(state.get("train_time_s", 0.0))  # none in checkpoints of older versions
        self._log({"event": "resume", "step": self.step, "checkpoint": str(checkpoints[-1])})
        if self.step > self.total_steps:
            self._warn(f"the newest checkpoint is at step {self.step}, past the last step of this run "
                       f"({self.total_steps}, from --max-steps or --epochs): nothing is trained, and step {self.step} "
                       "is evaluated and exported as it is")
        elif self.step == self.total_steps:
            self._note(f"the newest checkpoint is at the last step ({self.step}): it is evaluated and exported")
        if self.step >= self.total_steps:  # no step runs with the settings given now: export what trained it
            # its settings, with this run's paths: the checkpoint keeps them as its run gave them (relative to where
            # that ran), and this run's name the same files (the data were checked by their fingerprint)
            here, then = self.config.portable_dict(), portable_settings(state["config"])
            # the final evaluation's settings too: they are what the log's last held-out figures measured
            self.trained_with = {**then, **{k: here[k] for k in (*PATH_OPTIONS, *EVAL_CHANGES)}}
            if absolute_if_local(state["config"].get("target")) != absolute_if_local(self.config.target):
                self.trained_with["target"] = then.get("target")  # another model now: name the one that trained it

    def _restore(self, state: dict, checkpoint: Path) -> None:
        """Load a checkpoint's drafter, optimizer and schedule. One that reads but does not fit together (edited by
        hand, or written by something else) is an error that says how to go on, as a damaged one is."""
        try:
            check_resumable(state, checkpoint, drafter_config=self.drafter_config, config=self.config,
                            data_fingerprint=self.data_fingerprint, global_batch=self.global_batch, world=self.world,
                            context=self.context, trains_on=self._trains_on(state))
            self.drafter.load_state_dict(state["drafter"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self._continue_with_given_settings(state["config"], steps_left=state["step"] < self.total_steps)
        except UserError:
            raise
        except Exception as err:  # wrong types, shapes or keys fail in any of torch's or our ways
            raise UserError(f"checkpoint {checkpoint} does not hold a training state this version can resume "
                            f"(training_state.pt: {in_brief(err)}); delete that step directory to resume from the "
                            "previous checkpoint, or run without --resume and with --overwrite to start over") from None

    def _continue_with_given_settings(self, old: dict, steps_left: bool) -> None:
        """Settings that may change on resume take the values given now (lr and weight decay too, which the loaded
        optimizer state would otherwise keep); a warning names every change. With no step left to train they change
        nothing, and the warning says so (--max-steps and --epochs, which chose to stop here, are not named)."""
        c = self.config
        names = RESUMABLE_CHANGES if steps_left else [k for k in RESUMABLE_CHANGES if k not in SCHEDULE_END]
        changed = [f"{k} {old.get(k)!r} -> {getattr(c, k)!r}" for k in names if old.get(k) != getattr(c, k)]
        if absolute_if_local(old.get("target")) != absolute_if_local(c.target):  # the drafter learns its features
            changed.insert(0, f"target {old.get('target')!r} -> {c.target!r}" + (
                " (the drafter now learns another model's features; if that is a mistake, stop and resume with the "
                "checkpoint's target)" if steps_left else " (the final evaluation reads the new target's features, "
                "while training_config.yaml keeps the checkpoint's target, which trained the drafter; if that is a "
                "mistake, stop and resume with the checkpoint's target)"))
        if changed and steps_left:
            self._warn(f"resuming with other settings than the checkpoint's: {'; '.join(changed)}; the run continues "
                       "with the new values")
        elif changed:
            self._warn(f"other settings than the checkpoint's: {'; '.join(changed)}; no step is left to train, so they "
                       "change nothing: the checkpoint is evaluated and exported with the settings that trained it")
        measured = [f"{k} {old.get(k)!r} -> {getattr(c, k)!r}" for k in EVAL_CHANGES
                    if k in old and old[k] != getattr(c, k)]
        if measured:  # the log's held-out figures after this point are not comparable with the ones before
            self._warn(f"evaluating with other settings than the checkpoint's: {'; '.join(measured)}; the held-out "
                       "figures logged from here on use the new values (training_config.yaml records them)")
        self.scheduler.base_lrs = [c.lr * scale for scale in self.lr_scales]  # each group keeps its share of lr
        for group, scale, base in zip(self.optimizer.param_groups, self.lr_scales, self.scheduler.base_lrs):
            group["initial_lr"], group["lr_scale"], group["weight_decay"] = base, scale, c.weight_decay
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def export(self) -> None:
        """The output directory in the public format (what this package, vLLM and SGLang load)."""

        def write() -> None:
            trained_with = self.trained_with or self.config.portable_dict()
            try:
                save_drafter(self.drafter, self.config.output)
                (Path(self.config.output) / "training_config.yaml").write_text(yaml.safe_dump(trained_with))
            except (OSError, RuntimeError) as err:
                raise UserError(f"could not export the drafter into {self.config.output} ({in_brief(err)}; "
                                f"{why_not_written(err)}); step {self.step} is saved in {self.checkpoint_dir}: fix "
                                "that and rerun the same command with --resume to export it") from None

        self._on_rank_0(write)

    def cleanup(self) -> None:
        self._unlock_output()
        if dist.is_initialized():
            # DDP's reducer holds the process group: left to the interpreter's exit, gloo's threads can be torn
            # down after Python and abort the process (seen on 2-process runs that had finished)
            self.model = getattr(self, "head", None)
            gc.collect()
            dist.destroy_process_group()

    # ---- helpers ---------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if not dist.is_initialized():
            return
        if self.device.type == "cuda":  # nccl's barrier on this process's GPU, which it would otherwise guess
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _on_rank_0(self, work) -> None:
        """Run `work` on rank 0 alone; a UserError it raises is raised on every process, with its message (the
        others would wait at the next barrier for a process that has stopped, and die with a traceback that buries
        the message). Any other failure there (a bug, an interrupt) is raised as it is on rank 0, and the others
        stop with a UserError that points to rank 0's output, instead of waiting for it until the collective's
        timeout. Every process returns only once rank 0's work is done."""
        problem, failure = None, None
        if self.rank == 0:
            try:
                work()
            except UserError as err:
                problem = str(err)
            except BaseException as err:  # noqa: BLE001 - said to the others, then raised here as it is
                failure = err
                problem = (f"process 0 failed while writing {self.config.output} ({type(err).__name__}: {err}); its "
                           "output above says why")
        if self.world > 1:
            shared = [problem]
            dist.broadcast_object_list(shared, src=0, device=self.device if self.device.type == "cuda" else None)
            problem = shared[0]
        if failure is not None:
            raise failure
        if problem is not None:
            raise UserError(problem)

    def _sum_over_processes(self, values: list[float]) -> list[float]:
        """The sums of `values` over every process (one all-reduce); the values themselves in one process."""
        if self.world == 1:
            return [float(v) for v in values]
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.tolist()

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.rank != 0:
            return
        if self._setup_log is not None:  # setting up: written once the setup has succeeded
            self._setup_log.append(record)
        else:
            self._write_log(record)
        # the drafter's whole config goes to the file only (the run's config.json holds it too)
        print(json.dumps({k: v for k, v in record.items() if k != "drafter"}), flush=True)

    def _write_log(self, record: dict) -> None:
        def append(path: Path) -> None:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

        self._writing_log(append)
        if self._report is not None:
            self._report.record(record)

    def _writing_log(self, write) -> None:
        """write(path of train_log.jsonl); a write the OS refuses is a UserError naming the checkpoint to go on from."""
        path = Path(self.config.output) / "train_log.jsonl"
        try:
            write(path)
        except OSError as err:
            raise UserError(f"could not write the training log {path} ({in_brief(err)}; {why_not_written(err)}); "
                            f"{self.checkpoints.kept()}") from None

    def _note(self, message: str) -> None:
        self._log({"event": "note", "message": message})

    def _warn(self, message: str) -> None:
        self._log({"event": "warning", "message": message})
        if self.rank == 0:
            print(f"dflash train: warning: {message}", file=sys.stderr, flush=True)


MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

RESUMABLE_CHANGES = ("lr", "weight_decay", "warmup_ratio", "grad_clip", "anchors_per_sequence", "anchor_policy",
                     "loss_gamma", "distill_weight", "selector_loss_weight", "dtype", "max_steps", "epochs")
SCHEDULE_END = ("max_steps", "epochs")
EVAL_CHANGES = ("eval_decoding_examples",)  # changes what the held-out figures measure, not the training
EXPORTED_FILES = ("config.json", "model.safetensors", "training_config.yaml")  # what `export` writes


def use_tf32(on: bool) -> None:
    """Whether CUDA float32 matmuls may run on TF32 tensor cores (the whole process's setting)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch 2.9 and later; mixing it with allow_tf32 is refused
        matmul.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = on


def _model_files_in(directory: Path) -> list[Path]:
    """What makes `directory` a model: config.json and weight files."""
    return [p for p in directory.iterdir() if p.name == "config.json" or p.suffix in MODEL_SUFFIXES]


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories a failed setup created (parents first in `created`), those that are still empty."""
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _make_directory(flag: str, path: Path, instead: str) -> None:
    """Create the directory a flag names, or say what was wrong with it and `instead`, what to give."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; {instead}")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{flag} {path} cannot be created: {blocking} is a file, not a directory; {instead}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create {flag} {path}: {err.strerror or err}; {instead}, somewhere you can "
                        "write") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable; {instead}, somewhere you can write")


def _model_files(name: str) -> dict[str, list[int]]:
    """(size, modification time) of a model's config and weight files: they change when the model does."""
    directory = resolve_model_dir(name)
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(directory.iterdir())
            if p.name == "config.json" or p.suffix in (".safetensors", ".bin")}


def _cut_half_written_line(path: Path) -> None:
    """A log whose last line a stopped write left unfinished (a full disk, a kill) loses that line, so the next
    record starts a line of its own."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        data = f.seek(0) or f.read()
        f.truncate(data.rfind(b"\n") + 1)


def _datagen_settings(path: str) -> dict:
    """The settings `dflash datagen` wrote beside a data file (for a gzipped X.jsonl.gz, the X.jsonl.datagen.json
    beside X.jsonl), with "file" its name; {} for data from elsewhere."""
    settings = datagen.settings_path(Path(path))
    if not settings.exists() and path.endswith(".gz"):
        settings = datagen.settings_path(Path(path[: -len(".gz")]))
    try:
        values = json.loads(settings.read_text())
    except (OSError, ValueError):  # no settings file (data from elsewhere)
        return {}
    return {**values, "file": settings.name} if isinstance(values, dict) else {}
