"""Typed training configuration: dataclass defaults < YAML file < command-line flags."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from dflash.config_types import blank_option, parse_int_list, type_mismatch
from dflash.errors import UserError
from dflash.model.config import untappable
from dflash.training.reporting import MISSING as TENSORBOARD_MISSING
from dflash.training.reporting import REPORTERS

ANCHOR_POLICIES = ("uniform", "decoding")
DEFAULT_MAX_LENGTH = 3072  # tokens of prompt + response per example
DEFAULT_BLOCK_SIZE = 16  # a new drafter's; a fine-tune keeps its drafter's unless --block-size says otherwise
DEFAULT_SELECTOR_RANK, DEFAULT_SELECTOR_TOP_K = 256, 16  # a new DFlash2 selector's


@dataclass
class TrainConfig:
    target: str = ""  # path or hub id of the target
    data: str = ""  # JSONL from `dflash datagen`; the held-out split is drawn from it
    extra_train_data: list[str] | None = None  # more JSONL files, for training only (the split is unchanged)
    enable_thinking: bool | None = None  # text records: the chat template's enable_thinking, as it will be served
    chat_template_kwargs: dict | None = None  # text records: other chat template variables (default: the data's)
    output: str = ""  # output directory: the public drafter format + checkpoints/
    # drafter shape
    draft_layers: int | None = None  # a new drafter: 1 by default; with init_from: its own (more adds layers)
    block_size: int | None = None  # default 16; with init_from: the drafter's own
    target_layer_ids: list[int] | None = None  # default: the published formula
    mask_token_id: int | None = None  # default: the tokenizer's mask token, or the first unused embedding row
    intermediate_size: int | None = None  # default: the target's
    # a DFlash2 drafter (in-block convolutions + candidate selector); None: not said (a new drafter is DFlash, an
    # --init-from drafter stays what it is)
    dflash2: bool | None = None
    selector_rank: int | None = None  # DFlash2: codebook width (default 256; with init_from: the drafter's own)
    selector_top_k: int | None = None  # DFlash2: candidates per draft position (default 16; likewise)
    selector_loss_weight: float = 1.0  # DFlash2: the selector's cross-entropy next to the block loss
    # objective
    anchors_per_sequence: int = 64
    anchor_policy: str = "uniform"  # "decoding": greedy decoding's anchors under the current drafter first
    loss_gamma: float | None = None  # default: from block size (7 for 16)
    max_length: int | None = None  # default: DEFAULT_MAX_LENGTH, or the target's context when that is shorter
    distill_weight: float = 0.0  # w: per position (1 - w) * CE(label) + w * KL(target's distribution || drafter's)
    # optimisation
    epochs: float = 6.0
    max_steps: int | None = None  # overrides epochs when set
    batch_size: int = 4  # sequences per process per forward
    grad_accum: int = 1  # forwards per process per optimizer step: a step trains batch_size x grad_accum x processes
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0  # max gradient norm; 0: no clipping
    dtype: str = "float32"  # float32 or bfloat16 (autocast; master weights stay fp32)
    tf32: bool = True  # on a CUDA GPU, float32 matmuls use TF32 tensor cores (float32 sums, 10-bit products)
    seed: int = 0
    # bookkeeping
    eval_fraction: float = 0.02
    eval_every: int = 200
    eval_decoding_examples: int = 64  # held-out responses replayed for eval_tau_decoding (0: skip it)
    log_every: int = 10
    report_to: str = "none"  # "tensorboard": the log's numbers as TensorBoard scalars too (`reporting`)
    checkpoint_every: int = 200
    keep_checkpoints: int = 2  # the newest checkpoints kept in checkpoints/
    feature_cache: str | None = None  # "memory" or a directory: keep target features across epochs
    resume: bool = False
    overwrite: bool = False  # a fresh run into an output with an earlier run's checkpoints (deleted first) or a model
    init_from: str | None = None  # a drafter checkpoint (public format) to start from instead of random weights
    device: str | None = None
    trust_remote_code: bool = False  # run the Python code the target ships (its config.json's auto_map)

    def template_kwargs(self) -> dict | None:
        """The chat template's variables for text records (None: the template's defaults)."""
        from dflash.chat import merged_template_kwargs

        return merged_template_kwargs(self.chat_template_kwargs, self.enable_thinking)

    def validate(self) -> None:
        if not self.target:  # like every command that takes a model: the embedded target
            from dflash.api import DEFAULT_TARGET

            self.target = str(DEFAULT_TARGET)
        for name in ("data", "output"):
            if not getattr(self, name):
                raise UserError(f"--{name} is required (or set `{name}:` in the YAML config)")
        self.template_kwargs()  # checked: names a template may take, and one enable_thinking
        if isinstance(self.extra_train_data, str):
            self.extra_train_data = [self.extra_train_data]
        for flag, path in [("--data", self.data), *(("--extra-train-data", p) for p in self.extra_train_data or [])]:
            if Path(path).expanduser().is_dir():  # before anything reads its name or the files beside it
                raise UserError(f"{flag} {path} is a directory; give a JSONL file of `dflash datagen` (one JSON "
                                "object per line)")
        self._refuse_data_twice()
        problems = self._problems()
        if problems:
            raise UserError("; ".join(problems))

    def _refuse_data_twice(self) -> None:
        """A file given twice (the same path, however written) would train its records twice, and --data's
        held-out records would train too."""
        seen = {Path(self.data).expanduser().resolve(): "--data"}
        for path in self.extra_train_data or []:
            resolved = Path(path).expanduser().resolve()
            if resolved in seen:
                raise UserError(f"--extra-train-data {path} is the {seen[resolved]} file again: its records would "
                                "train twice; give each file once")
            seen[resolved] = "--extra-train-data"

    def _problems(self) -> list[str]:
        """Every out-of-range option, as the message that names it and its range."""
        untapped = untappable(self.target_layer_ids or [])
        checks = [
            (self.block_size is None or 2 <= self.block_size <= 64,
             f"--block-size must be in 2..64, got {self.block_size}"),
            (self.target_layer_ids is None or len(self.target_layer_ids) > 0,
             "--target-layer-ids needs at least one layer id, e.g. 1,9,17 (leave it out for the default)"),
            (untapped is None, f"--target-layer-ids {','.join(map(str, self.target_layer_ids or []))}: {untapped}; "
                               "give distinct layers in ascending order"),
            (self.draft_layers is None or self.draft_layers >= 1,
             f"--draft-layers must be >= 1, got {self.draft_layers}"),
            (self.intermediate_size is None or self.intermediate_size >= 1,
             f"--intermediate-size must be >= 1, got {self.intermediate_size}"),
            (self.selector_rank is None or self.selector_rank >= 1,
             f"--selector-rank must be >= 1, got {self.selector_rank}"),
            (self.selector_top_k is None or self.selector_top_k >= 1,
             f"--selector-top-k must be >= 1, got {self.selector_top_k}"),
            (self.dflash2 or self.init_from or (self.selector_rank is None and self.selector_top_k is None),
             "--selector-rank and --selector-top-k (selector_rank and selector_top_k in a config file) shape a "
             "DFlash2 drafter's selector: add --dflash2 (dflash2: true), or leave them out"),
            (math.isfinite(self.selector_loss_weight) and self.selector_loss_weight >= 0,
             f"--selector-loss-weight must be a finite number >= 0, got {self.selector_loss_weight}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1 (1: no accumulation), got {self.grad_accum}"),
            (self.anchors_per_sequence >= 1, f"--anchors-per-sequence must be >= 1, got {self.anchors_per_sequence}"),
            (self.anchor_policy in ANCHOR_POLICIES,
             f"--anchor-policy must be one of {', '.join(ANCHOR_POLICIES)}, got {self.anchor_policy!r}"),
            (self.loss_gamma is None or self.loss_gamma > 0, f"--loss-gamma must be > 0, got {self.loss_gamma}"),
            (self.max_length is None or self.max_length >= 2,
             f"--max-length must be >= 2 (a prompt token and a response token), got {self.max_length}"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be a finite number > 0, got {self.lr}"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"--weight-decay must be a finite number >= 0, got {self.weight_decay}"),
            (0.0 <= self.warmup_ratio < 1.0,
             f"--warmup-ratio is the share of the steps spent warming up, in [0, 1), got {self.warmup_ratio}"),
            (self.grad_clip >= 0, f"--grad-clip is the largest gradient norm kept, >= 0 (0: no clipping), got "
                                  f"{self.grad_clip}"),
            (0.0 <= self.distill_weight <= 1.0,
             f"--distill-weight must be in 0..1 (0: hard labels only), got {self.distill_weight}"),
            (self.dtype in ("float32", "bfloat16"), f"--dtype must be float32 or bfloat16, got {self.dtype}"),
            (self.max_steps is None or self.max_steps >= 1,
             f"--max-steps must be >= 1, got {self.max_steps}; leave it out to train for --epochs"),
            (math.isfinite(self.epochs) and self.epochs > 0,  # with --max-steps too: a typo is not let through
             f"--epochs must be a finite number > 0, got {self.epochs}"
             + ("; --max-steps sets the length of this run, so leave --epochs out" if self.max_steps else "")),
            (0.0 <= self.eval_fraction < 1.0, f"--eval-fraction is the share of --data held out for evaluation, in "
                                              f"[0, 1) (0: no evaluation), got {self.eval_fraction}"),
            (self.eval_every >= 0, f"--eval-every must be >= 0 (0: evaluate only at the end), got {self.eval_every}"),
            (self.eval_decoding_examples >= 0,
             f"--eval-decoding-examples must be >= 0, got {self.eval_decoding_examples}"),
            (self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}"),
            (self.report_to in REPORTERS, f"--report-to is one of {', '.join(REPORTERS)}, got {self.report_to!r}"),
            (self.report_to != "tensorboard" or importlib.util.find_spec("tensorboard") is not None,
             TENSORBOARD_MISSING),
            (self.checkpoint_every >= 0,
             f"--checkpoint-every must be >= 0 (0: only at the end), got {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1,
             f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (not (self.resume and self.overwrite), "--resume continues the checkpoints that --overwrite would delete; "
                                                   "pass one of them"),
        ]
        return [message for ok, message in checks if not ok]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def portable_dict(self) -> dict[str, Any]:
        """The settings for the exported training_config.yaml (`portable_settings`)."""
        return portable_settings(self.to_dict())


# What a run does with its output rather than how it trains, and what it lets run: never written to
# training_config.yaml, so reading that file back with --config cannot delete a run's checkpoints (overwrite),
# continue one by surprise (resume) or run a checkpoint's own code unasked (trust_remote_code)
RUN_ACTIONS = ("resume", "overwrite", "trust_remote_code")
PATH_OPTIONS = ("target", "data", "extra_train_data", "output", "init_from", "feature_cache")  # local paths, or not


def portable_settings(values: dict[str, Any]) -> dict[str, Any]:
    """A run's settings with every local path absolute and without `RUN_ACTIONS`: the exported training_config.yaml
    names the target and data it was trained with, and `dflash train --config` reads it back from any folder."""
    values = {k: v for k, v in values.items() if k not in RUN_ACTIONS}
    for key in PATH_OPTIONS:
        if key in values and key != "extra_train_data":
            values[key] = absolute_if_local(values[key])
    if values.get("extra_train_data"):
        values["extra_train_data"] = [absolute_if_local(path) for path in values["extra_train_data"]]
    return values


def absolute_if_local(value: str | None) -> str | None:
    """A path that exists here, made absolute; anything else (a hub id, "memory", None) as it is."""
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def load_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Dataclass defaults, then the YAML file, then every flag that was given (not None)."""
    values: dict[str, Any] = {}
    if yaml_path:
        path = Path(yaml_path)
        loaded = _read_yaml(path)
        if not isinstance(loaded, dict):
            raise UserError(f"{path} must be a YAML mapping of training options")
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
        _read_numbers(values)
        _read_id_lists(values)
        _check_types(values, path)
        _refuse_empty(values, f"in {path}: {{name}} is empty; give a value or leave the option out")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    _refuse_empty(given, "--{flag} is empty; give a value or leave the flag out")
    if values.get("overwrite") and not given.get("overwrite"):  # a file exported before 2026-12-05 holds it
        raise UserError(f"{yaml_path} sets overwrite: true, which deletes an earlier run's checkpoints; it is taken "
                        "only as the --overwrite flag: drop it from the file (and pass --overwrite if you mean it)")
    if values.get("trust_remote_code") and not given.get("trust_remote_code"):
        raise UserError(f"{yaml_path} sets trust_remote_code: true, which runs the target's own Python code; it is "
                        "taken only as the --trust-remote-code flag: drop it from the file (and pass the flag if you "
                        "trust the target's source)")
    values.update(given)
    _flags_win_over_the_file(values, given)
    unknown = sorted(set(values) - {f.name for f in fields(TrainConfig)})
    if unknown:
        where = f" in {yaml_path}" if yaml_path and not set(unknown) & set(given) else ""
        raise UserError(f"unknown training option(s){where}: {', '.join(_suggest(name) for name in unknown)}; the "
                        "options are the flags of `dflash train --help`, with _ for -")
    _check_types(given, "the options given")  # flags come typed; a Python caller's dict may not
    config = TrainConfig(**values)
    config.validate()
    return config


def _refuse_empty(values: dict[str, Any], message: str) -> None:
    """An option given as '' (or spaces) is refused (`blank_option`); `message` names it as {name} or {flag}."""
    name = blank_option(values)
    if name is not None:
        raise UserError(message.format(name=name, flag=name.replace("_", "-")))


def _flags_win_over_the_file(values: dict[str, Any], given: dict[str, Any]) -> None:
    """Options that exclude one another: the one a flag gives overrides the file's other one. --epochs on the command
    line is not undone by the file's max_steps (which would win over it), nor --overwrite by the file's resume, nor
    --enable-thinking by the file's chat_template_kwargs (or the other way round)."""
    if "epochs" in given and "max_steps" not in given:
        values.pop("max_steps", None)
    if given.get("overwrite") and "resume" not in given:
        values["resume"] = False
    if given.get("resume") and "overwrite" not in given:
        values["overwrite"] = False
    # enable_thinking, spelled as its own flag or inside --chat-template-kwargs: the flags' spelling wins
    flag_kwargs = given.get("chat_template_kwargs")
    if "enable_thinking" in given or (isinstance(flag_kwargs, dict) and "enable_thinking" in flag_kwargs):
        if "enable_thinking" not in given:
            values.pop("enable_thinking", None)
        file_kwargs = values.get("chat_template_kwargs")
        if "chat_template_kwargs" not in given and isinstance(file_kwargs, dict):
            values["chat_template_kwargs"] = {k: v for k, v in file_kwargs.items() if k != "enable_thinking"} or None


# Other trainers' names for ours.
_OPTION_ALIASES = {"learning_rate": "lr", "steps": "max_steps", "num_steps": "max_steps", "num_epochs": "epochs",
                   "train_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
                   "num_layers": "draft_layers", "num_hidden_layers": "draft_layers", "model": "target",
                   "output_dir": "output", "warmup_steps": "warmup_ratio"}


def _suggest(name: str) -> str:
    """`name`, with the option it likely meant: "max_step (did you mean max_steps?)"."""
    import difflib

    known = [f.name for f in fields(TrainConfig)]
    alias = _OPTION_ALIASES.get(name)
    close = [alias] if alias in known else difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f"{name} (did you mean {close[0]}?)" if close else name


def _read_yaml(path: Path) -> Any:
    """The --config file's contents; every way it cannot be read is a UserError naming it."""
    if not path.exists():
        raise UserError(f"config file {path} does not exist; give --config the YAML file of training options")
    if path.is_dir():
        raise UserError(f"--config {path} is a directory; give the YAML file of training options (e.g. "
                        f"{path / 'train.yaml'})")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; save the --config file as UTF-8") from None
    except RecursionError:  # the pure-Python parser recurses once per level of nesting
        raise UserError(f"{path} is nested too deeply to read; a --config file is a flat mapping of training "
                        "options (option: value)") from None
    except OSError as err:
        raise UserError(f"cannot read --config {path}: {err.strerror or err}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (the plain loader keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = str(self.construct_object(key_node, deep=deep)).replace("-", "_")
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"option {key!r} is set twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_numbers(values: dict[str, Any]) -> None:
    """YAML 1.1 reads `6e-4` (no dot) as a string: a numeric string is a number where the option is one."""
    hints = typing.get_type_hints(TrainConfig)
    for name, value in values.items():
        if isinstance(value, str) and float in _types(hints.get(name)):
            try:
                values[name] = float(value)
            except ValueError:
                pass  # not a number: _check_types names it


def _read_id_lists(values: dict[str, Any]) -> None:
    """`target_layer_ids: "1,9,17"`, the form the flag takes, is the list [1, 9, 17]."""
    text = values.get("target_layer_ids")
    if isinstance(text, str):
        with contextlib.suppress(ValueError):  # not integers: _check_types names it
            values["target_layer_ids"] = parse_int_list(text)


def _types(kind: Any) -> tuple:
    return typing.get_args(kind) if typing.get_args(kind) else (kind,)


def _check_types(values: dict[str, Any], path: Path | str) -> None:
    for name, value in values.items():
        expected = type_mismatch(TrainConfig, name, value)
        if expected:
            example = " (e.g. [1, 9, 17], or \"1,9,17\" as the flag takes it)" if name == "target_layer_ids" else ""
            raise UserError(f"{path}: `{name}: {value!r}` should be {expected}{example}")
