"""Ctrl-C during generation: the first press asks the decoder to stop after its current step
(so what was generated is kept and the KV cache stays consistent); a second press is a hard stop."""

from __future__ import annotations

import signal
import threading


class StopOnSignal:
    def __init__(self):
        self._event = threading.Event()
        self._previous = None

    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame):  # noqa: ARG002
        if self._event.is_set():
            raise KeyboardInterrupt
        self._event.set()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
