"""The base of every error a user can cause; the CLI prints these as one clear line, never a traceback."""


class UserError(ValueError):
    """Something the user or client gave was wrong; the message says what and how to fix it."""
