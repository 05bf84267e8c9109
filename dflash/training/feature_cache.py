"""--feature-cache: the target's features of each training example, computed once and read again every epoch.

`memory` keeps them in this process; a directory keeps one `<split>-<index>[-soft].pt` file per example, (T, F [+ h]),
and a manifest.json naming the target, its dtype, the feature layers and the examples they were computed from:
features of another setup would train silently wrong, so a run that differs is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from dflash.errors import UserError, in_brief, why_not_written
from dflash.records import read_json_object

# what `Trainer._feature_manifest` names
MANIFEST_KEYS = ("target", "target_files", "target_dtype", "feature_layer_ids", "examples")


class FeatureCache:
    def __init__(self, where: str | None):
        self.where = where  # None: no cache; "memory"; or a directory
        self._memory: dict[str, torch.Tensor] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.where)

    @property
    def directory(self) -> Path | None:
        return None if self.where in (None, "", "memory") else Path(self.where)

    # ---- the manifest ----------------------------------------------------------------------------------------
    def check(self, manifest: dict, checkpoint_dir: Path) -> None:
        """Refuse a directory inside the run's checkpoints, or one that holds the features of another setup."""
        directory = self.directory
        if directory is None:
            return
        if directory.resolve().is_relative_to(checkpoint_dir.resolve()):
            raise UserError(f"--feature-cache {directory} lies in {checkpoint_dir}, which holds this run's "
                            "checkpoints alone (--overwrite deletes it whole): give a directory outside it, e.g. "
                            f"{checkpoint_dir.parent / 'features'}")
        path = directory / "manifest.json"
        if path.exists():
            changed = _manifest_changes(_saved_manifest(directory, path), manifest)
            if changed:
                raise UserError(f"--feature-cache {directory} holds the features of another setup "
                                f"({'; '.join(changed)}); pass another directory, or delete this one to compute "
                                "them again")
        elif any(directory.glob("*.pt")):
            raise UserError(f"--feature-cache {directory} holds features but no manifest.json (an older dflash wrote "
                            "them): what they were computed from is unknown; delete it or pass another directory")

    def write_manifest(self, manifest: dict) -> None:
        """Name the setup in the directory (once: a checked one already names this one)."""
        directory = self.directory
        if directory is None or (directory / "manifest.json").exists():
            return
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, directory / "manifest.json")

    # ---- the features ----------------------------------------------------------------------------------------
    def get(self, key: str, shape: tuple[int, int], warn: Callable[[str], None]) -> torch.Tensor | None:
        """The cached features (T, F [+ h]) of one example, or None when they are not cached yet.

        A file that cannot be read, or holds another shape, is computed again and rewritten, with a warning: the
        cache only saves time, its contents are exactly what the target computes again, so stopping the run (and
        losing the steps since the last checkpoint) would cost more than it protects. Writes are atomic, so this
        takes a disk that damaged the file, or someone else's hand."""
        directory = self.directory
        if directory is None:
            return self._memory.get(key)
        path = directory / f"{key}.pt"
        if not path.exists():
            return None
        try:
            features = torch.load(path, map_location="cpu", weights_only=True)
        except torch.cuda.OutOfMemoryError:  # not damage: let it say what it is
            raise
        except Exception as err:  # a damaged file fails in any of the unpickler's ways
            problem = f"it cannot be read ({in_brief(err)})"
        else:
            if isinstance(features, torch.Tensor) and tuple(features.shape) == tuple(shape):
                return features
            problem = (f"it holds {tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)}"
                       f", not features of shape {tuple(shape)}")
        warn(f"the feature cache file {path} is damaged: {problem}; its features are computed again and the "
                   "file rewritten")
        return None

    def put(self, key: str, features: torch.Tensor) -> torch.Tensor:
        """Cache one example's features (T, F [+ h]); returns them as cached (on the CPU)."""
        features = features.detach().cpu().clone()
        directory = self.directory
        if directory is None:
            self._memory[key] = features
            return features
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.pt.tmp{os.getpid()}"  # each process its own
        try:
            torch.save(features, tmp)
            os.replace(tmp, directory / f"{key}.pt")
        except (OSError, RuntimeError) as err:
            tmp.unlink(missing_ok=True)
            raise UserError(f"could not write to the feature cache {directory} ({in_brief(err)}; "
                            f"{why_not_written(err)}): fix that, or pass --feature-cache memory (or leave the option "
                            "out)") from None
        return features


def _saved_manifest(directory: Path, path: Path) -> dict:
    """The manifest.json of a --feature-cache directory, refused when something else wrote it: "features of another
    setup" would describe the user's own file as if dflash had written it."""
    return read_json_object(path, "a dflash feature cache's manifest", f"--feature-cache {directory} holds something "
                            "else: pass another directory (a new or empty one)", MANIFEST_KEYS)


def _manifest_changes(saved: dict, now: dict) -> list[str]:
    what = {"target_files": lambda: f"target {saved.get('target')!r}, now {now['target']!r} (its config or weight "
                                    "files differ in size or modification time: a copy made without keeping the "
                                    "times reads as changed)",
            "target_dtype": lambda: f"target dtype {saved.get('target_dtype')}, now {now['target_dtype']}",
            "feature_layer_ids": lambda: f"feature layers {saved.get('feature_layer_ids')}, now "
                                         f"{now['feature_layer_ids']}",
            "examples": lambda: "the examples differ (another --data, --extra-train-data, --max-length, "
                                "--eval-fraction or --seed, or the files changed)"}
    return [describe() for key, describe in what.items() if saved.get(key) != now[key]]
