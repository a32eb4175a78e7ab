"""Ctrl-C (and, for `run` and a `chat` reply, SIGTERM) during generation: the first signal asks the
decoder to stop after its current step (so what was generated is kept and the KV cache stays
consistent); a second one is a hard stop.

Elsewhere a signal raises at once (`install`), and is noted first: Python runs a handler at its next
bytecode, and where that is a finalizer (a jinja generator's, collected mid-render) the exception is
printed and dropped ("Exception ignored in ..."), and the command went on and exited 0. A noted
signal is honoured later: `StopOnSignal` stops the generation it starts, bench stops after the run
in hand, and `main` ends the command with its exit code. Code that handles a KeyboardInterrupt on
purpose (a chat's Ctrl-C at the prompt) calls `handled()`."""

from __future__ import annotations

import signal
import sys
import threading


class Terminated(BaseException):
    """SIGTERM, turned into an exception so that output already written is flushed (exit 143).

    A BaseException, as KeyboardInterrupt is: `except Exception` (a download trying its next
    source, say) must not swallow it."""


_noted: list[int] = []  # signals raised as exceptions and not handled yet, the first first


def install() -> None:
    """The command's own handlers (main thread only): SIGTERM raises Terminated, and SIGINT, where it
    is not ignored (a background job's), KeyboardInterrupt; each noted before it raises."""
    _noted.clear()
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _raise)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise)
    if not isinstance(sys.unraisablehook, _QuietForNotedSignals):
        sys.unraisablehook = _QuietForNotedSignals(sys.unraisablehook)


def exception_for(signum: int) -> BaseException:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def note(signum: int) -> None:
    _noted.append(signum)


def pending() -> int | None:
    """The first signal noted and not handled yet, or None."""
    return _noted[0] if _noted else None


def handled() -> None:
    """Where a KeyboardInterrupt (or Terminated) is caught and dealt with: nothing is left to honour."""
    _noted.clear()


def raise_pending() -> None:
    """Raise the exception of a signal noted and lost on the way (exit 130 or 143 in the end)."""
    signum = pending()
    if signum is not None:
        handled()
        raise exception_for(signum)


def _raise(signum, frame):  # noqa: ARG001
    note(signum)
    raise exception_for(signum)


class _QuietForNotedSignals:
    """sys.unraisablehook: a KeyboardInterrupt or Terminated dropped in a finalizer is noted and will
    be honoured, so its traceback is left out ("Interrupted." says it); anything else as before."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)) and _noted:
            return
        self.previous(unraisable)


class StopOnSignal:
    def __init__(self, terminate: bool = False):
        self._event = threading.Event()
        self._signals = (signal.SIGINT, signal.SIGTERM) if terminate else (signal.SIGINT,)
        self._previous: dict = {}
        self.received: int | None = None  # the first signal that asked to stop

    def requested(self) -> bool:
        return self._event.is_set()

    def raise_if_stopped(self) -> None:
        """After the output is written: end the command the way the signal asks (exit 130 or 143)."""
        if self.received is not None:
            raise exception_for(self.received)

    def _handle(self, signum, frame):  # noqa: ARG002
        if self._event.is_set():
            _raise(signum, frame)  # a hard stop, noted as every raised signal is
        self.received = signum
        self._event.set()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        signum = pending()
        if signum is not None and signum in self._signals:  # a signal raised and lost just before: the generation stops at once
            handled()
            self.received = signum
            self._event.set()
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        hard_stops = [signum for signum in _noted if signum in self._signals]
        if self.received is not None and hard_stops:
            # a hard stop dropped (noted) while the stop was in force: the stop served it (left noted, a
            # chat took it for a Ctrl-C at its next prompt); a SIGTERM among them still exits 143
            _noted[:] = [signum for signum in _noted if signum not in self._signals]
            if signal.SIGTERM in hard_stops:
                self.received = signal.SIGTERM
