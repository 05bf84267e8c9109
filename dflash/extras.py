"""Optional dependencies: the extra that brings each, and one clear error when one is missing.

The core install decodes and trains; `dflash serve` needs the `serve` extra, `dflash bench` the `bench` extra
(its plots, a server run, hub datasets). PyPI's `dflash` is another project, so the hint installs from the
checkout, or the package alone.
"""

from __future__ import annotations

import importlib.util
import sys

from dflash.errors import UserError

# module -> (the extra that brings it, its name on PyPI)
OPTIONAL = {
    "fastapi": ("serve", "fastapi"),
    "uvicorn": ("serve", "uvicorn"),
    "prometheus_client": ("serve", "prometheus-client"),
    "httpx": ("bench", "httpx"),
    "matplotlib": ("bench", "matplotlib"),
    "datasets": ("bench", "datasets"),
}


class MissingExtraError(UserError):
    """An optional package that a command needs is not installed."""


def require(modules: list[str], needed_for: str) -> None:
    """Raise MissingExtraError naming the first of `modules` that is not installed (before any work starts)."""
    for module in modules:
        if not _installed(module):
            raise MissingExtraError(missing_message(module, needed_for))


def _installed(module: str) -> bool:
    if sys.modules.get(module) is not None:  # imported already (or put there, as a test does)
        return True
    return importlib.util.find_spec(module) is not None


def missing_message(module: str, needed_for: str) -> str:
    extra, package = OPTIONAL.get(module, (None, module))
    fix = f"pip install {package}"
    if extra:
        fix += f", or DFlash's '{extra}' extra: pip install -e \".[{extra}]\" in the DFlash checkout"
    return f"{needed_for} needs the Python package {module!r}, which is not installed: {fix}"


def as_missing_extra(err: ModuleNotFoundError, needed_for: str) -> MissingExtraError | None:
    """The clear error for an import that failed on one of the optional packages; None for any other module."""
    top = (err.name or "").split(".")[0]
    return MissingExtraError(missing_message(top, needed_for)) if top in OPTIONAL else None
