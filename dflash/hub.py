"""The Hugging Face hub, asked once with a bounded wait.

huggingface_hub's downloads ask the hub without a timeout of their own, and `datasets` retries for half a minute
before it gives up, so a machine without a network (or one that swallows packets) would wait minutes for an error.
`unreachable` asks once, bounded, and remembers a failure for the rest of the process: later look-ups go to the
local cache at once.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

from dflash.errors import DFlashWarning, UserError, in_brief

# Why the hub could not be reached, once it could not.
_unreachable: str | None = None


class RepoError(UserError):
    """The hub answered: it has no such repository (or hides it), gates it, or lacks the revision."""


def offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) tells us not to ask the hub at all."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def wait_s() -> float:
    """How long one look-up waits for the hub (HF_HUB_ETAG_TIMEOUT, huggingface_hub's own setting)."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


def unreachable(repo_id: str, revision: str | None = None, repo_type: str = "model",
                instead: str = "pass a local directory") -> str | None:
    """None when the hub answers for `repo_id`; else why it cannot be reached. A repository the hub does not
    have, hides, gates or lacks `revision` of is a RepoError saying so, and `instead`, what to give in its place."""
    global _unreachable
    if _unreachable is not None:
        return _unreachable
    from huggingface_hub import HfApi
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    noun = "dataset" if repo_type == "dataset" else "repository"
    timeout_s = wait_s()
    start = time.monotonic()
    try:
        HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=timeout_s)
        return None
    except GatedRepoError:  # before its base class, RepositoryNotFoundError
        raise RepoError(f"{repo_id} is a gated {noun} on the Hugging Face hub: accept its terms on its page and log "
                        f"in (`hf auth login`), or {instead}") from None
    except RepositoryNotFoundError:
        raise RepoError(f"{repo_id} is neither a local path nor a {noun} on the Hugging Face hub (a private one needs "
                        f"`hf auth login`); check the path or id, or {instead}") from None
    except RevisionNotFoundError:
        raise RepoError(f"{repo_id} has no revision {revision!r} on the Hugging Face hub") from None
    except HfHubHTTPError as err:  # the hub answered with an error of its own (e.g. 5xx): the cache may serve
        if getattr(err.response, "status_code", None) == 401:
            raise RepoError(f"the Hugging Face hub refused the token sent for {repo_id} (HF_TOKEN, or the one `hf "
                            "auth login` saved): log in again, or for a public repository unset HF_TOKEN (`hf auth "
                            f"logout` for a saved one); or {instead}") from None
        return in_brief(err)
    except Exception as err:  # no network, DNS, refused, timed out (the HTTP client's own error types)
        timed_out = "Timeout" in type(err).__name__
        waited = time.monotonic() - start  # huggingface_hub may try again after a timeout: say the whole wait
        _unreachable = (f"no answer in {waited:.1f} s, {timeout_s:g} s a try; HF_HUB_ETAG_TIMEOUT sets the wait"
                        if timed_out else in_brief(err))
        return _unreachable


def look_up(repo_id: str, revision: str | None = None, repo_type: str = "model",
            instead: str = "pass a local directory") -> tuple[str | None, RepoError | None]:
    """(why only the local cache can serve `repo_id` now, or None; the hub's refusal, or None). HF_HUB_OFFLINE, a
    hub that cannot be reached, and a refusal (no such repository, gated, a token it does not take) all send the
    caller to the local cache: a job run without the token its downloads had still finds what they fetched. When
    the cache has no copy either, the refusal is the error to give."""
    if offline():
        return "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set", None
    try:
        return unreachable(repo_id, revision, repo_type, instead), None
    except RepoError as err:
        return str(err), err


def warn_cached_copy(refused: RepoError, what: str) -> None:
    """Say that the local cache's copy of `what` serves in place of what the hub refused."""
    warnings.warn(DFlashWarning(f"{refused}. Using the local cache's copy of {what}, as downloaded before "
                                "(HF_HUB_OFFLINE=1 skips asking the hub)"), stacklevel=3)


@contextlib.contextmanager
def datasets_offline(on: bool) -> Iterator[None]:
    """While `on`, `datasets` reads its local cache only, without asking (and retrying) the hub."""
    if not on:
        yield
        return
    import datasets

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
