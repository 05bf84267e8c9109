"""`dflash serve`: an OpenAI-compatible server with continuous-batched DFlash decoding (see `app`)."""

from dflash.serve.app import ServeConfig, create_app

__all__ = ["ServeConfig", "create_app"]
