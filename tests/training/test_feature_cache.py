"""FeatureCache on its own: what it keeps and gives back, in memory and in a directory (the trainer's use of it is
tested in test_trainer.py)."""

import pytest
import torch

from dflash.errors import UserError
from dflash.training.feature_cache import FeatureCache

MANIFEST = {"target": "/t", "target_files": {"config.json": [1, 2]}, "target_dtype": "float32",
            "feature_layer_ids": [1, 3], "examples": "abc"}


@pytest.mark.parametrize("where", ["memory", "dir"])
def test_features_put_are_got_back_and_unknown_keys_are_none(tmp_path, where):
    cache = FeatureCache("memory" if where == "memory" else str(tmp_path / "cache"))
    features = torch.randn(5, 6)
    assert cache.get("train-0", (5, 6), pytest.fail) is None
    stored = cache.put("train-0", features)
    features.add_(1)  # the cache holds its own copy
    assert torch.equal(cache.get("train-0", (5, 6), pytest.fail), stored) and not torch.equal(stored, features)
    assert cache.get("train-1", (5, 6), pytest.fail) is None
    assert (where == "dir") == (tmp_path / "cache" / "train-0.pt").exists()


def test_a_damaged_or_misshapen_file_is_warned_about_and_read_as_missing(tmp_path):
    warnings = []
    cache = FeatureCache(str(tmp_path))
    cache.put("train-0", torch.zeros(4, 2))
    assert cache.get("train-0", (5, 2), warnings.append) is None
    assert "holds (4, 2), not features of shape (5, 2)" in warnings[-1]
    (tmp_path / "train-0.pt").write_bytes(b"not a tensor")
    assert cache.get("train-0", (4, 2), warnings.append) is None and "cannot be read" in warnings[-1]


def test_a_directory_serves_only_the_setup_its_manifest_names(tmp_path):
    cache = FeatureCache(str(tmp_path / "cache"))
    cache.check(MANIFEST, tmp_path / "out" / "checkpoints")
    cache.write_manifest(MANIFEST)
    cache.check(MANIFEST, tmp_path / "out" / "checkpoints")
    with pytest.raises(UserError, match=r"features of another setup \(feature layers \[1, 3\], now \[1, 4\]\)"):
        cache.check({**MANIFEST, "feature_layer_ids": [1, 4]}, tmp_path / "out" / "checkpoints")
    inside = FeatureCache(str(tmp_path / "out" / "checkpoints" / "f"))
    with pytest.raises(UserError, match="holds this run's checkpoints alone"):
        inside.check(MANIFEST, tmp_path / "out" / "checkpoints")
