"""The base of every error a user can cause; the CLI prints these as one clear line, never a traceback."""


class UserError(ValueError):
    """Something the user or client gave was wrong; the message says what and how to fix it.

    Its kinds: `CheckpointError` (a model that cannot be found or read), `DrafterConfigError` (a drafter config
    that cannot be used), `IncompatibleDrafterError` (a drafter trained for another target), `GenerationError`
    (a prompt or generation option the engine cannot serve)."""


class GenerationError(UserError):
    """A request the engine cannot serve as given; the message says what to change."""


class NoTokenError(GenerationError):
    """The target gave a row no token: its logits were NaN (or -inf everywhere), usually a float16 overflow on
    that row's text. It fails that row alone: a batch's other rows decode on."""


class DFlashWarning(UserWarning):
    """A likely mistake that does not stop the work (e.g. a drafter trained for another target: decoding stays
    lossless, only slower); the CLI prints it as one line."""


def in_brief(err: BaseException, limit: int = 160) -> str:
    """An exception in a few words, for a message that quotes it: its type and the first line of its text, a long
    one cut at a word and marked as cut (not ended in mid-word or mid-parenthesis, as if that were all it said)."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    first = lines[0]
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."
    return f"{type(err).__name__}: {first}"


def why_not_written(err: BaseException) -> str:
    """What to check when a write failed: the permissions where they refused it, a folder where the file should be,
    else the disk's room."""
    if isinstance(err, PermissionError) or "Permission denied" in str(err):
        return "can this user write there?"
    if isinstance(err, IsADirectoryError) or "Is a directory" in str(err):
        return "a folder stands where the file goes: move it away"
    if isinstance(err, NotADirectoryError) or "Not a directory" in str(err):
        return "a file stands where a folder of the path goes: move it away"
    return "is the disk full?"
