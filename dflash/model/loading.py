"""Read and write drafters in the public DFlash checkpoint format (config.json + safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.errors import UserError
from dflash.model.config import DrafterConfig, DrafterConfigError
from dflash.model.drafter import DFlashDraftModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CheckpointError(UserError):
    """A checkpoint that cannot be found or read; the message says what to do."""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16")
    return _DTYPES[dtype]


def resolve_model_dir(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory as is; anything else is treated as a Hugging Face hub repo id and downloaded."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") > 1:
        raise CheckpointError(f"{path_or_id} is not a directory; give a checkpoint directory or a hub id like org/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_id), revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as err:  # network, auth, missing repo: all mean "could not get it"
        raise CheckpointError(
            f"could not find {path_or_id!r} locally or download it from the Hugging Face hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); check the path or id, or download it first"
        ) from None


def read_config(directory: Path, what: str = "a model checkpoint") -> dict:
    """The checkpoint's config.json as a dict; a missing or unreadable one is a CheckpointError saying so."""
    file = directory / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no config.json; is it {what} directory?")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a JSON {type(raw).__name__}, not an object; fix or replace the file")
    return raw


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(directory / shard))
        return state
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_drafter(
    path_or_id: str | os.PathLike,
    mask_token_id: int | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> DFlashDraftModel:
    """Load a drafter from a local directory or a hub id, in any of the public config forms."""
    directory = resolve_model_dir(path_or_id, revision)
    raw = read_config(directory, "a DFlash drafter checkpoint")
    config = DrafterConfig.from_dict(raw, mask_token_id=mask_token_id)
    state = _read_state_dict(directory)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = DFlashDraftModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise CheckpointError(
            f"{directory} does not match the DFlash drafter layout: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}{' ...' if len(missing) + len(unexpected) > 10 else ''}"
        )
    torch_dtype = parse_dtype(dtype) or parse_dtype(config.dtype) or next(iter(state.values())).dtype
    return model.to(device=device, dtype=torch_dtype).eval()


def save_drafter(model: DFlashDraftModel, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors with the public key names (what vLLM and SGLang read)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()
             if "rotary_emb" not in k}
    config = model.config
    config.dtype = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


__all__ = ["CheckpointError", "DrafterConfigError", "load_drafter", "save_drafter", "resolve_model_dir", "parse_dtype",
           "read_config"]
