"""One run at a time on an output: an exclusive lock, held while the run lasts, that a second run is refused on."""

from __future__ import annotations

import os
from pathlib import Path

from dflash.errors import UserError


def lock_or_refuse(fd: int, busy: str) -> None:
    """Lock the open file (or directory) `fd` for this process; raise UserError(`busy`) when another holds it.
    Nothing on a system or file system without locks (not POSIX, some network mounts)."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(busy) from None
    except OSError:
        pass


def being_written(path: str | os.PathLike) -> bool:
    """Whether another process holds `lock_or_refuse`'s lock on the file `path` (a dflash datagen writing it). False
    where locks are not available, or the file cannot be opened."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


class DirectoryLock:
    """The directory `path` locked for this process (`lock_or_refuse`) until `release`, or until the lock is
    garbage collected."""

    def __init__(self, path: Path, busy: str):
        self._fd: int | None = os.open(path, os.O_RDONLY)
        try:
            lock_or_refuse(self._fd, busy)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()
