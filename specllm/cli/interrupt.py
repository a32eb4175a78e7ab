"""Ctrl-C (and, for `run` and a `chat` reply, SIGTERM) during generation: the first signal asks the
decoder to stop after its current step (so what was generated is kept and the KV cache stays
consistent); a second one is a hard stop."""

from __future__ import annotations

import signal
import threading


class Terminated(BaseException):
    """SIGTERM, turned into an exception so that output already written is flushed (exit 143).

    A BaseException, as KeyboardInterrupt is: `except Exception` (a download trying its next
    source, say) must not swallow it."""


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
        if self.received == signal.SIGTERM:
            raise Terminated()
        if self.received is not None:
            raise KeyboardInterrupt

    def _handle(self, signum, frame):  # noqa: ARG002
        if self._event.is_set():
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt
        self.received = signum
        self._event.set()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
