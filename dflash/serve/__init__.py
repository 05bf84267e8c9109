"""`dflash serve`: an OpenAI-compatible server with continuous-batched DFlash decoding (see `app`)."""

__all__ = ["ServeConfig", "create_app"]


def __getattr__(name: str):
    """The app (FastAPI, the `serve` extra) is imported on first use: `dflash serve --engine vllm` and the
    hand-off need only the core install."""
    if name in __all__:
        from dflash.serve import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
