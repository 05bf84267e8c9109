"""The hub, asked once with a bounded wait (`dflash.hub`)."""

from __future__ import annotations

import re
import time

import pytest

from dflash import hub


def test_a_hub_that_does_not_answer_is_asked_once_per_process(silent_hub):
    start = time.monotonic()
    first = hub.unreachable("org/model")
    waited = time.monotonic() - start
    said = re.search(r"no answer in (\d+\.\d) s, 0.5 s a try; HF_HUB_ETAG_TIMEOUT sets the wait", first or "")
    assert said, first
    assert float(said[1]) == pytest.approx(waited, abs=0.2)  # the whole wait (huggingface_hub may retry), not 0.5
    assert waited < 10
    start = time.monotonic()
    assert hub.unreachable("org/other", repo_type="dataset") == first  # remembered: no second wait
    assert time.monotonic() - start < 0.2


def test_a_repository_the_hub_does_not_have_is_named_with_what_to_give_instead(empty_hub):
    with pytest.raises(hub.RepoError, match="^org/no-such-set is neither a local path nor a dataset on the Hugging "
                                            "Face hub .*check the path or id, or pass a JSONL file$"):
        hub.unreachable("org/no-such-set", repo_type="dataset", instead="pass a JSONL file")
    assert hub._unreachable is None  # the hub answered: nothing to remember


def test_datasets_offline_is_undone_afterwards():
    datasets = pytest.importorskip("datasets")
    before = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(KeyError):
        with hub.datasets_offline(True):
            assert datasets.config.HF_HUB_OFFLINE is True
            raise KeyError("a load that failed")
    assert datasets.config.HF_HUB_OFFLINE == before
