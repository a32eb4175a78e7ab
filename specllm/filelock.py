"""An advisory lock beside a file, for what two specllm processes may do to it at once: download it
(`models.hub`), or read, change and write it (the cost cache)."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

WINDOWS_POLL_S = 0.2  # how often a waiter asks again on Windows, whose byte locks have no blocking wait


@contextlib.contextmanager
def locked(path: Path):
    """Hold `<path>.lock` exclusively; yields whether it is held. The lock file is removed on release,
    so none stays beside the file (a waiter then finds the file it locked gone, and takes a new one).
    POSIX: flock; Windows: a byte lock (msvcrt.locking), polled. Unlocked (False) where the OS has
    neither, the lock file cannot be made (a read-only or missing folder), or the filesystem refuses
    locks (some network ones)."""
    os_lock = _os_lock()
    lock = path.with_name(path.name + ".lock")
    while os_lock is not None:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            break
        try:
            held = os_lock.acquire(fd)
            there = held and _still_there(fd, lock)
        except BaseException:  # Ctrl-C while waiting
            os.close(fd)
            raise
        if there:
            try:
                yield True
            finally:
                os_lock.release(fd, lock)
            return
        if held:  # the holder it waited for removed the file: lock the new one
            os_lock.unlock(fd)
        os.close(fd)
        if not held:
            break
    yield False


def _os_lock():
    """The OS's lock: `_Flock`, `_ByteLock` (Windows) or None."""
    try:
        import fcntl
    except ImportError:
        pass
    else:
        return _Flock(fcntl)
    try:
        import msvcrt
    except ImportError:
        return None
    return _ByteLock(msvcrt)


class _Flock:
    def __init__(self, fcntl):
        self.fcntl = fcntl

    def acquire(self, fd: int) -> bool:
        """Lock `fd`, waiting as long as another process holds it; False where locks are refused."""
        try:
            self.fcntl.flock(fd, self.fcntl.LOCK_EX)
        except OSError:
            return False
        return True

    def unlock(self, fd: int) -> None:
        self.fcntl.flock(fd, self.fcntl.LOCK_UN)

    def release(self, fd: int, lock: Path) -> None:
        """Removed while still locked: a waiter then finds the file it locked gone (`_still_there`)."""
        try:
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)


class _ByteLock:
    """msvcrt's lock on the file's first byte. Windows refuses to delete a file that another process
    has open, so the file is removed after it is closed, and stays while a waiter has it."""

    def __init__(self, msvcrt):
        self.msvcrt = msvcrt

    def acquire(self, fd: int) -> bool:
        """Lock byte 0 of `fd`, polling as long as another process holds it (no blocking wait);
        False where locks are refused."""
        while True:
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                self.msvcrt.locking(fd, self.msvcrt.LK_NBLCK, 1)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EDEADLK):  # held by another: EACCES (EDEADLOCK on some CRTs)
                    return False
            time.sleep(WINDOWS_POLL_S)

    def unlock(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_SET)
            self.msvcrt.locking(fd, self.msvcrt.LK_UNLCK, 1)

    def release(self, fd: int, lock: Path) -> None:
        self.unlock(fd)
        os.close(fd)
        with contextlib.suppress(OSError):  # another process has it open: it stays, for them
            lock.unlink()


def _still_there(fd: int, lock: Path) -> bool:
    """Whether the file `fd` locked is still the lock file (not removed by the holder it waited for)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock))
    except FileNotFoundError:
        return False
