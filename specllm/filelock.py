"""An advisory lock beside a file, for what two specllm processes may do to it at once: download it
(`models.hub`), or read, change and write it (the cost cache)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path):
    """Hold `<path>.lock` exclusively; yields whether it is held. The lock file is removed before the
    lock is released, so none stays beside the file (a waiter then finds the file it locked gone, and
    takes a new one). Unlocked (False) where the OS has no such locks (Windows), the lock file cannot
    be made (a read-only or missing folder), or the filesystem refuses locks (some network ones)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    lock = path.with_name(path.name + ".lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                yield False
                return
            if _still_there(fd, lock):
                try:
                    yield True
                finally:
                    lock.unlink(missing_ok=True)
                return
        finally:
            os.close(fd)


def _still_there(fd: int, lock: Path) -> bool:
    """Whether the file `fd` locked is still the lock file (not removed by the holder it waited for)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock))
    except FileNotFoundError:
        return False
