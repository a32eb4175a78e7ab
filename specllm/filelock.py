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
    try:
        import fcntl
    except ImportError:
        fcntl = None
    lock = path.with_name(path.name + ".lock")
    if fcntl is None:
        with _locked_windows(lock) as held:
            yield held
        return
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


@contextlib.contextmanager
def _locked_windows(lock: Path):
    """As `locked`, with msvcrt's lock on the file's first byte. Windows refuses to delete a file that
    another process has open, so the file is removed after it is closed, and stays while a waiter has it."""
    try:
        import msvcrt
    except ImportError:
        yield False
        return
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield False
            return
        try:
            held = _wait_for_byte_lock(msvcrt, fd)
            there = held and _still_there(fd, lock)
        except BaseException:  # Ctrl-C while waiting
            os.close(fd)
            raise
        if there:
            try:
                yield True
            finally:
                _unlock_byte(msvcrt, fd)
                os.close(fd)
                with contextlib.suppress(OSError):  # another process has it open: it stays, for them
                    lock.unlink()
            return
        if held:  # the holder it waited for removed the file: lock the new one
            _unlock_byte(msvcrt, fd)
        os.close(fd)
        if not held:
            yield False
            return


def _wait_for_byte_lock(msvcrt, fd: int) -> bool:
    """Lock byte 0 of `fd`, waiting as long as another process holds it; False where locks are refused."""
    while True:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EDEADLK):  # held by another: EACCES (EDEADLOCK on some CRTs)
                return False
        time.sleep(WINDOWS_POLL_S)


def _unlock_byte(msvcrt, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _still_there(fd: int, lock: Path) -> bool:
    """Whether the file `fd` locked is still the lock file (not removed by the holder it waited for)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock))
    except FileNotFoundError:
        return False
