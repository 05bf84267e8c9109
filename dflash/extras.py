"""Optional dependencies: the extra that brings each, and one clear error when one is missing.

The core install decodes and trains; `dflash serve` needs the `serve` extra, `dflash bench` the `bench` extra
(its plots, a server run), and reading prompts or benchmark sets from the hub, parquet, CSV or a dataset
directory the `data` extra (which `bench` brings too). PyPI's `dflash` is another project, so the hint installs from the
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
    "datasets": ("data", "datasets"),
}


class MissingExtraError(UserError):
    """An optional package that a command needs is not installed."""


def require(modules: list[str], needed_for: str) -> None:
    """Raise MissingExtraError naming every one of `modules` that is not installed (before any work starts), so one
    install fixes it."""
    missing = [module for module in modules if not _installed(module)]
    if missing:
        raise MissingExtraError(missing_message(missing, needed_for))


def _installed(module: str) -> bool:
    if sys.modules.get(module) is not None:  # imported already (or put there, as a test does)
        return True
    return importlib.util.find_spec(module) is not None


def missing_message(modules: str | list[str], needed_for: str) -> str:
    modules = [modules] if isinstance(modules, str) else modules
    packages = [OPTIONAL.get(module, (None, module))[1] for module in modules]
    extras = sorted({OPTIONAL[module][0] for module in modules if module in OPTIONAL})
    fix = f"pip install {' '.join(packages)}"
    if len(extras) == 1:
        fix += f", or DFlash's '{extras[0]}' extra: pip install -e \".[{extras[0]}]\" in the DFlash checkout"
    named = ", ".join(repr(module) for module in modules)
    if len(modules) == 1:
        return f"{needed_for} needs the Python package {named}, which is not installed: {fix}"
    return f"{needed_for} needs the Python packages {named}, which are not installed: {fix}"


def as_missing_extra(err: ModuleNotFoundError, needed_for: str) -> MissingExtraError | None:
    """The clear error for an import that failed on one of the optional packages; None for any other module."""
    top = (err.name or "").split(".")[0]
    return MissingExtraError(missing_message(top, needed_for)) if top in OPTIONAL else None
