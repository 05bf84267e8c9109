"""Read and write drafters in the public DFlash checkpoint format (config.json + safetensors); find checkpoints
on disk or on the Hugging Face hub, and the device to load them on."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash import hub
from dflash.errors import DFlashWarning, UserError, in_brief
from dflash.model import hf_compat
from dflash.model.config import DrafterConfig, DrafterConfigError, is_dflash2
from dflash.model.drafter import DFlashDraftModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# What a hub download fetches first: configs (a sharded checkpoint's index among them), tokenizer files and chat
# templates, and the Python code a checkpoint ships (run only with --trust-remote-code) ...
_HUB_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]
# ... then the weights the model loads: the shards its index names, else the safetensors at the top of the
# repository (a pattern's * also matches "/": "*.safetensors" fetched gpt-oss's original/ copy, a second 13 GB,
# and Mistral's consolidated.safetensors beside its shards); for a repository without safetensors (older ones,
# e.g. facebook/opt-350m), its PyTorch weights
_SAFETENSORS, _PICKLED_WEIGHTS, _TOP_LEVEL_ONLY = ["*.safetensors"], ["pytorch_model*.bin"], ["*/*"]
_SAFETENSORS_INDEX = "model.safetensors.index.json"

# Any of these makes a directory hold a tokenizer that AutoTokenizer can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


class CheckpointError(UserError):
    """A checkpoint that cannot be found or read; the message says what to do."""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype to load weights in: None (also "auto") keeps the checkpoint's own."""
    if isinstance(dtype, torch.dtype) and dtype not in _DTYPES.values():  # integer, complex, float8 ...
        raise CheckpointError(f"dtype {dtype} cannot hold a model's weights here; use auto (the checkpoint's own), "
                              "float32, float16, bfloat16 or float64 (quantized weights come with a checkpoint's own "
                              "quantization config)")
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use auto (the checkpoint's own), float32, float16, bfloat16 "
                              "or float64")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load on: None is cuda when a GPU is visible, else cpu. A device this machine does not have is
    a UserError naming what it has, before any weights are read."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise UserError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r}; use cpu, cuda, cuda:N (a GPU's index) or mps") from None
    problem = _device_problem(parsed)
    if problem:
        raise UserError(f"device {str(parsed)!r} {problem}")
    return parsed


def _device_problem(device: torch.device) -> str | None:
    """Why this machine cannot load on `device`; None when it can."""
    if device.type == "cpu":
        return None
    if device.type == "meta":
        return "holds no data (meta tensors); use cpu or cuda"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (check CUDA_VISIBLE_DEVICES and the driver)")
            return f"is not available: {why} ({torch.__version__}); use cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"does not exist: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}"
        return None
    backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None:
        return "is not supported by dflash; use cpu or cuda"
    return None if available() else "is not available on this machine; use cpu"


def resolve_model_dir(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory as is; anything else that reads as a Hugging Face hub repo id is fetched from the hub (or
    its local cache). The hub is asked once with a timeout (HF_HUB_ETAG_TIMEOUT, 10 s a try by default); when it cannot
    be reached, or HF_HUB_OFFLINE is set, only the local cache serves."""
    if isinstance(path_or_id, torch.nn.Module):  # its repr is the whole module tree
        raise CheckpointError(f"a model is a directory path or a hub id like org/name, not a loaded "
                              f"{type(path_or_id).__name__}; wrap a loaded model instead: "
                              "DFlash(TargetModel(model, tokenizer), load_drafter(path))")
    if not isinstance(path_or_id, (str, os.PathLike)):
        shown = repr(path_or_id)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"a model is a directory path or a hub id like org/name, not {type(path_or_id).__name__}"
                              f" {shown}")
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path_or_id} is a file; give the checkpoint directory that holds its config.json "
                              "and weights")
    if not is_hub_id(str(path_or_id)):
        bare = str(path_or_id).rstrip("/")
        if bare != str(path_or_id) and is_hub_id(bare):
            raise CheckpointError(f"{path_or_id} is no local directory; for the hub id, leave the trailing slash out: "
                                  f"{bare}")
        raise CheckpointError(f"{path_or_id} does not exist; give a checkpoint directory or a hub id like org/name")
    try:
        return _from_hub(str(path_or_id), revision)
    except CheckpointError as err:
        if path.parent == Path(".") or not path.parent.is_dir():
            raise
        # org/name whose org/ is a local folder, and the hub has no such model for us: most likely a mistyped path
        raise CheckpointError(f"{path_or_id} is not in the local folder {path.parent}{_holding(path.parent)}, and as a "
                              f"hub id: {err}") from None


def _holding(folder: Path, most: int = 6) -> str:
    """" (it holds a, b, c)": what a folder's subfolders are, for a message about a mistyped path in it."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return ""
    if not names:
        return " (it holds no folders)"
    return f" (it holds {', '.join(names[:most])}{', ...' if len(names) > most else ''})"


def is_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _from_hub(repo_id: str, revision: str | None) -> Path:
    """The snapshot directory of `repo_id`: downloaded when the hub answers, else from the local cache."""
    from huggingface_hub import snapshot_download

    def download(local_only: bool) -> Path:
        def fetch(allow: list[str], ignore: list[str] | None = None) -> Path:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow, ignore_patterns=ignore,
                                          local_files_only=local_only))

        snapshot = fetch(_HUB_PATTERNS)
        shards = _indexed_shards(snapshot / _SAFETENSORS_INDEX)
        with _quiet_when_nothing_matches():  # a repository of pickled weights alone has no safetensors to match
            snapshot = fetch(shards) if shards else fetch(_SAFETENSORS, _TOP_LEVEL_ONLY)
        if not local_only and not any(snapshot.glob("*.safetensors")):  # an older repository: pickled weights alone
            snapshot = fetch(_PICKLED_WEIGHTS, _TOP_LEVEL_ONLY)
        return snapshot

    return _fetch(repo_id, revision, download)


@contextlib.contextmanager
def _quiet_when_nothing_matches():
    """huggingface_hub logs a warning when no file matches a download's patterns: not news while weights are looked
    for in two forms."""
    logger = logging.getLogger("huggingface_hub._snapshot_download")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _indexed_shards(index: Path) -> list[str]:
    """The weight files a sharded safetensors checkpoint's index names ([] without a readable index)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({name for name in weight_map.values() if isinstance(name, str)})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of a hub repository (e.g. its config.json): downloaded when the hub answers, else from the local
    cache; the same errors as a whole checkpoint's."""
    from huggingface_hub import hf_hub_download

    return Path(_fetch(repo_id, revision, lambda local_only: hf_hub_download(
        repo_id, filename, revision=revision, local_files_only=local_only)))


_stale_warned: set[str] = set()  # repositories served from the cache while the hub was unreachable, said once


def _fetch(repo_id: str, revision: str | None, download):
    """download(local_only) from the hub, asked once with a timeout first (`hub.unreachable`); the local cache alone
    when the hub cannot be reached or HF_HUB_OFFLINE is set. Every failure is a CheckpointError saying what to do."""
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    offline = hub.offline()
    cache_only, refused = hub.look_up(repo_id, revision)
    try:
        found = download(cache_only is not None)
    except LocalEntryNotFoundError as err:
        if refused is not None:  # and no copy in the cache: the hub's refusal says what to do
            raise CheckpointError(str(refused)) from None
        if cache_only is None:
            raise _download_failure(repo_id, err) from None
        why = cache_only if offline else f"the Hugging Face hub is not reachable ({cache_only})"
        raise CheckpointError(
            f"{repo_id} is not a local directory, and it cannot be downloaded: {why}, and the local cache "
            f"({constants.HF_HUB_CACHE}) has no copy of it. Pass a local checkpoint directory instead, or download "
            f"it first where the hub is reachable (`hf download {repo_id}`; then HF_HUB_OFFLINE=1 skips the hub)"
        ) from None
    except Exception as err:  # a download that broke off, a full disk, a denied file: all mean "could not get it"
        if refused is not None:
            raise CheckpointError(str(refused)) from None
        raise _download_failure(repo_id, err) from None
    if cache_only is not None and not offline and repo_id not in _stale_warned:  # outside the try: -W error makes
        _stale_warned.add(repo_id)  # the warning an exception
        if refused is not None:
            hub.warn_cached_copy(refused, repo_id)
        else:
            warnings.warn(DFlashWarning(f"the Hugging Face hub is not reachable ({cache_only}): {repo_id} is the "
                                        "local cache's copy, which may be older than the hub's"), stacklevel=2)
    return found


def _download_failure(repo_id: str, err: BaseException) -> CheckpointError:
    return CheckpointError(f"could not download {repo_id} from the Hugging Face hub ({in_brief(err)}); check the "
                           "id and your connection, or pass a local directory")


def _training_checkpoint_error(directory: Path) -> CheckpointError:
    """A `dflash train` checkpoint (checkpoints/step-N under a run's --output) given where a model belongs."""
    step = directory.name.removeprefix("step-").lstrip("0") or "0"
    return CheckpointError(
        f"{directory} is a checkpoint of `dflash train` (optimizer state included), not an exported drafter: pass "
        f"its run's --output directory ({directory.parent.parent}), where the drafter is exported when training "
        f"ends, or export this checkpoint by running that training command again with --resume --max-steps {step}")


def _unexported_run_error(directory: Path) -> CheckpointError:
    """A `dflash train` --output whose run stopped before its export was complete: checkpoints/ and not both of the
    drafter's config.json and weights (the export writes the weights, then the config)."""
    steps = sorted(p.name for p in (directory / "checkpoints").glob("step-*"))
    last = (steps[-1].removeprefix("step-").lstrip("0") or "0") if steps else "STEP"
    return CheckpointError(
        f"{directory} is the output of a `dflash train` run that stopped before its export was complete (it holds "
        f"checkpoints/ but no drafter config.json and weights): export the newest checkpoint by running that "
        f"training command again with --resume --max-steps {last}, or let the run finish")


def _training_record(drafter_dir: Path) -> dict:
    """The settings `dflash train` exported beside a drafter (training_config.yaml); {} when there are none."""
    import yaml

    try:
        recorded = yaml.safe_load((Path(drafter_dir) / "training_config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def trained_for(drafter_dir: Path) -> Path | None:
    """The local target directory `dflash train` recorded for this drafter (its training_config.yaml), when the
    record is an absolute path to a directory here; None otherwise (no record, a hub id, another machine's path)."""
    recorded = _training_record(drafter_dir).get("target")
    if not isinstance(recorded, str) or not Path(recorded).is_absolute() or not Path(recorded).is_dir():
        return None
    return Path(recorded)


def trained_template_kwargs(drafter_dir: Path) -> dict | None:
    """The chat template variables `dflash train` recorded for this drafter's prompts (its training_config.yaml's
    chat_template_kwargs and enable_thinking), e.g. {"enable_thinking": False}, or {} for the template's defaults;
    None when it recorded nothing to go by (an export from before 2026-12-07, or a drafter from elsewhere)."""
    from dflash.chat import merged_template_kwargs

    recorded = _training_record(drafter_dir)
    variables, thinking = recorded.get("chat_template_kwargs"), recorded.get("enable_thinking")
    try:
        merged = merged_template_kwargs(variables if isinstance(variables, dict) else None,
                                        thinking if isinstance(thinking, bool) else None)
    except UserError:  # a record edited by hand into two answers: nothing to go by
        return None
    # exports since 2026-12-07 hold chat_template_kwargs, null included: their null means the template's defaults
    return merged if merged or "chat_template_kwargs" not in recorded else {}


def read_config(directory: Path, what: str = "a model checkpoint") -> dict:
    """The checkpoint's config.json as a dict; a missing or unreadable one is a CheckpointError saying so."""
    file = directory / "config.json"
    if not file.is_file() and (directory / "training_state.pt").is_file():
        raise _training_checkpoint_error(directory)
    if not file.is_file() and (directory / "checkpoints").is_dir():
        raise _unexported_run_error(directory)
    if not file.is_file():
        raise CheckpointError(f"{directory} has no config.json; is it {what} directory?")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a JSON {type(raw).__name__}, not an object; fix or replace the file")
    return raw


def check_target_dir(directory: Path) -> None:
    """Refuse, before any weights load, a target directory that is not a causal LM with a tokenizer."""
    raw = read_config(directory, "a Hugging Face causal LM checkpoint")
    if any("DFlash" in str(a) for a in raw.get("architectures") or []):
        raise CheckpointError(f"{directory} is a DFlash drafter, not a target model; pass the model it drafts for as "
                              "the target (--target), and the drafter as --draft to decode, bench or serve with it, "
                              "or as --init-from to train it further")
    if "model_type" not in raw:
        raise CheckpointError(f"{directory / 'config.json'} has no model_type; is {directory} a Hugging Face causal "
                              "LM checkpoint?")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"{directory} has no tokenizer (none of {', '.join(_TOKENIZER_FILES[:3])}, ...); "
                              + (_incomplete_cache_copy(directory) or "copy the tokenizer files of the model it was "
                                 "made from into it"))


def _incomplete_cache_copy(directory: Path) -> str | None:
    """For a snapshot in the Hugging Face cache (models--ORG--NAME/snapshots/REV) that lacks files: what to do, as
    editing the cache by hand is not it. None for any other directory."""
    repo = directory.parent.parent.name if directory.parent.name == "snapshots" else ""
    if not repo.startswith("models--"):
        return None
    repo_id = repo.removeprefix("models--").replace("--", "/")
    return (f"it is the Hugging Face cache's copy of {repo_id}, and incomplete (a download that stopped, or single "
            f"files fetched): `hf download {repo_id}` fetches the rest where the hub is reachable")


def load_failure(what: str, directory: Path, err: BaseException) -> CheckpointError:
    """A CheckpointError for weights or files that were found but could not be loaded."""
    damaged = isinstance(err, (SafetensorError, json.JSONDecodeError, UnicodeDecodeError))
    in_cache = _incomplete_cache_copy(directory) if isinstance(err, OSError) or damaged else None
    advice = (f"; {in_cache}" if in_cache
              else "; its files are damaged or incomplete: copy or download them again" if damaged else "")
    return CheckpointError(f"could not load {what} from {directory} ({in_brief(err)}){advice}")


def portable_tokenizer_config(config: dict) -> tuple[dict, list[str]]:
    """A tokenizer_config.json (as a dict) in the form transformers 4.57 reads too, and the edits that took.
    Transformers 5 writes its own class name, `TokenizersBackend`, and a list of `extra_special_tokens`, neither of
    which 4.x reads; `PreTrainedTokenizerFast` and `additional_special_tokens` load the same tokenizer in both."""
    edits = []
    if config.get("tokenizer_class") == "TokenizersBackend":
        config = {**config, "tokenizer_class": "PreTrainedTokenizerFast"}
        edits.append('set "tokenizer_class" to "PreTrainedTokenizerFast"')
    if isinstance(config.get("extra_special_tokens"), list):
        config = {("additional_special_tokens" if k == "extra_special_tokens" else k): v for k, v in config.items()}
        edits.append('rename "extra_special_tokens" to "additional_special_tokens"')
    return config, edits


# the files a tokenizer is built from (fast, sentencepiece, BPE, WordPiece); a directory with none has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tekken.json")


def tokenizer_failure(directory: Path, err: BaseException) -> CheckpointError:
    """Why transformers could not load the tokenizer in `directory` (raising `err`), told better than its own message
    where that can be:
    - A directory with no tokenizer file at all (transformers: "Couldn't instantiate the backend tokenizer").
    - A tokenizer JSON file that does not parse is damaged: transformers then falls back to other ways of building
      the tokenizer and fails with an unrelated error (4.57: "requires the protobuf library").
    - A tokenizer saved by transformers 5 cannot be read by 4.x (`portable_tokenizer_config`).
    - A tokenizer.json that parses but this tokenizers release cannot read (a newer one's format): 4.57 falls back
      as for a damaged file, 5.x says "data did not match any variant of untagged enum ModelUntagged".
    - Else a library it needs (sentencepiece, protobuf, tiktoken), or other damage."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return CheckpointError(f"{directory} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...): copy the "
                               "tokenizer files of the model it was saved from into it (tokenizer.save_pretrained)")
    parsed = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            parsed[name] = json.loads(file.read_bytes())
        except (ValueError, UnicodeDecodeError) as json_err:
            return load_failure(f"the tokenizer ({name})", directory, json_err)
    config = parsed.get("tokenizer_config.json")
    edits = portable_tokenizer_config(config)[1] if isinstance(config, dict) else []
    if edits and hf_compat.TRANSFORMERS_MAJOR < 5:
        import transformers

        return CheckpointError(
            f"the tokenizer in {directory} was saved by transformers 5, which transformers {transformers.__version__} "
            f"cannot load: upgrade it (pip install -U 'transformers>=5'), or in {directory / 'tokenizer_config.json'} "
            + " and ".join(edits)
        )
    unread = _tokenizer_json_problem(directory / "tokenizer.json") if "tokenizer.json" in parsed else None
    if unread is not None:
        import tokenizers

        return CheckpointError(f"could not load the tokenizer in {directory}: tokenizers {tokenizers.__version__} "
                               f"cannot read its tokenizer.json ({unread}): it was saved by a newer tokenizers, or is "
                               "damaged; pip install -U tokenizers transformers, or copy the file again")
    if isinstance(err, ImportError) or "library" in str(err).lower():
        fix = "install the library it names (pip install ...)"
    else:
        fix = ("its files are damaged, or were saved by a newer tokenizers than this one: pip install -U tokenizers "
               "transformers, or copy the tokenizer files again")
    return CheckpointError(f"could not load the tokenizer in {directory} ({in_brief(err)}): {fix}")


def _tokenizer_json_problem(path: Path) -> str | None:
    """Why the tokenizers library cannot read `path` (None: it can)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises plain Exception for a file it cannot read
        return in_brief(err)
    return None


def weight_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Each weight's shape from the safetensors headers of `files` (no tensor is read); a header that cannot be read
    is a CheckpointError naming its file."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as err:  # noqa: BLE001 - safetensors' own error type is not importable everywhere
            raise CheckpointError(f"the weights in {file} are damaged or incomplete ({in_brief(err)}): copy or "
                                  "export them again") from None
    return shapes


def drafter_weight_files(directory: Path) -> list[Path]:
    """The safetensors files a drafter directory's weights are in: the shards its model.safetensors.index.json
    lists (a CheckpointError names any that is missing), else every *.safetensors file; at least one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            files = [directory / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
            raise load_failure("the drafter's weight index", directory, err) from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            in_cache = _incomplete_cache_copy(directory)
            raise CheckpointError(f"{directory}: the shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                  f"listed in {index.name} {'are' if len(missing) > 1 else 'is'} missing; "
                                  + (in_cache or "copy or download the drafter again"))
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files and (directory / "checkpoints").is_dir():
        raise _unexported_run_error(directory)
    if not files:
        in_cache = _incomplete_cache_copy(directory)
        raise CheckpointError(f"no *.safetensors weights in {directory}" + (f"; {in_cache}" if in_cache else ""))
    return files


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    files = drafter_weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(f)
        except (SafetensorError, OSError) as err:
            raise load_failure("the drafter's weights", directory, err) from None
        twice = sorted(state.keys() & part.keys())
        if twice:  # a stray copy beside the weights: which one wins would be the order of their names
            raise CheckpointError(f"{directory}: {f.name} holds weights that another *.safetensors file there holds "
                                  f"too ({', '.join(twice[:3])}{', ...' if len(twice) > 3 else ''}); keep one copy "
                                  "of the drafter's weights in the directory, or name its shards in "
                                  "model.safetensors.index.json")
        state.update(part)
    return state


def _shape_mismatches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Weights whose shape differs from what config.json builds, as 'name: file [..], config [..]'."""
    expected = model.state_dict()
    return [f"{k}: file {list(v.shape)}, config {list(expected[k].shape)}" for k, v in state.items()
            if k in expected and tuple(v.shape) != tuple(expected[k].shape)]


def causal_lm_shape_mismatches(directory: Path) -> list[str]:
    """Weights in a causal LM checkpoint's safetensors whose shape differs from what its config.json builds
    (built on the meta device: no memory), as 'name: file [..], config [..]'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # a checkpoint's own code is never run here (nor a question asked about it)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, trust_remote_code=False))
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    return [f"{name}: file {shape}, config {expected[name]}"
            for name, shape in weight_shapes(sorted(directory.glob("*.safetensors"))).items()
            if name in expected and shape != expected[name]]


def load_drafter(
    path_or_id: str | os.PathLike,
    mask_token_id: int | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> DFlashDraftModel:
    """Load a drafter from a local directory or a hub id, in any of the public config forms."""
    device = resolve_device(device)
    directory = resolve_model_dir(path_or_id, revision)
    raw = read_config(directory, "a DFlash drafter checkpoint")
    try:
        config = DrafterConfig.from_dict(raw, mask_token_id=mask_token_id)
    except DrafterConfigError as err:
        raise DrafterConfigError(f"cannot use the drafter in {directory}: {err}") from None
    state = _read_state_dict(directory)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = DFlashDraftModel(config)
    wrong_shapes = _shape_mismatches(model, state)
    if wrong_shapes:
        raise CheckpointError(f"the weights in {directory} do not have the shapes its config.json describes: "
                              f"{'; '.join(wrong_shapes[:4])}{' ...' if len(wrong_shapes) > 4 else ''}; fix "
                              "config.json or use the weights it was saved with")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        dflash2 = any(k.startswith("candidate_selector.") for k in unexpected)
        hint = ('; these are a DFlash2 drafter\'s weights: its config.json needs "architectures": '
                '["DFlash2DraftModel"]' if dflash2 and not is_dflash2(raw.get("architectures") or []) else "")
        raise CheckpointError(
            f"{directory} does not match the DFlash drafter layout: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}{' ...' if len(missing) + len(unexpected) > 10 else ''}{hint}"
        )
    torch_dtype = parse_dtype(dtype) or _config_dtype(config.dtype, directory) or next(iter(state.values())).dtype
    model.source = str(path_or_id)
    return model.to(device=device, dtype=torch_dtype).eval()


def _config_dtype(dtype: str | None, directory: Path) -> torch.dtype | None:
    """The dtype a drafter's config.json names (torch_dtype / dtype), refused with where it was read."""
    try:
        return parse_dtype(dtype)
    except CheckpointError:
        raise CheckpointError(f"{directory / 'config.json'} gives the drafter's dtype as {dtype!r}, which is none "
                              "dflash loads weights in: fix it there (float32, float16 or bfloat16), or pass a dtype "
                              "(--dtype, dtype=)") from None


def save_drafter(model: DFlashDraftModel, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors with the public key names (what vLLM and SGLang read). Each file is
    written beside its place and then moved there, so a stop midway (a kill, a full disk) leaves each one whole: the
    earlier export's, or this one's (a stop between the two moves, a moment, leaves the new weights beside the
    earlier config.json). A write that fails takes its partial files away."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()
             if "rotary_emb" not in k}
    config = model.config
    config.dtype = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    weights, settings = directory / "model.safetensors.tmp", directory / "config.json.tmp"
    try:
        save_file(state, weights, metadata={"format": "pt"})
        _as_umask_allows(weights)
        settings.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    except BaseException as err:
        weights.unlink(missing_ok=True)  # a partial file the size of a model would hold the space a rerun needs
        settings.unlink(missing_ok=True)
        if type(err).__name__ == "SafetensorError":  # safetensors' writer reports a full disk or a denied write so
            raise OSError(f"writing {weights.name}: {err}") from None
        raise
    os.replace(weights, directory / "model.safetensors")
    os.replace(settings, directory / "config.json")


def _as_umask_allows(path: Path) -> None:
    """safetensors writes its file for the owner alone (0600); give it the permissions any new file gets here, so a
    server running as another user can read the drafter, as it can read config.json."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


__all__ = ["CheckpointError", "DrafterConfigError", "load_drafter", "save_drafter", "resolve_model_dir", "parse_dtype",
           "read_config", "resolve_device", "check_target_dir", "load_failure"]
