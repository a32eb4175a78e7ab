"""Running the app under uvicorn: the listening socket, the worker's lifetime, and signals.

The first Ctrl-C or SIGTERM stops accepting work (waiting requests get 503) and lets the running
request finish; a second one aborts it at its next step. Either way `serve` returns normally.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from contextlib import contextmanager
from typing import Callable

import uvicorn

from specllm.errors import SpecllmError
from specllm.server.app import Service, create_app


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: any free port); SpecllmError when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise SpecllmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with specllm's signal handling and a callback once it accepts connections."""

    def __init__(self, service: Service, sock: socket.socket, on_ready: Callable[[str, int], None] | None = None,
                 log_level: str = "warning"):  # fmt: skip
        config = uvicorn.Config(create_app(service), log_level=log_level, access_log=False, lifespan="off")
        super().__init__(config)
        self.service, self.sock, self.on_ready = service, sock, on_ready
        self.signals = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready(*self.address)

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.loop = asyncio.get_running_loop()  # uvicorn enters this in its loop
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        """Runs in the main thread between two of its bytecodes, perhaps while the event loop there
        holds the job queue's lock (adding a job): the queue is drained from the loop, not here."""
        self.signals += 1
        self.should_exit = True
        self.loop.call_soon_threadsafe(self.service.worker.stop_accepting)
        if self.signals > 1:
            self.force_exit = True
            self.service.worker.abort()

    def serve_forever(self) -> None:
        """Serve until should_exit (a signal, or a caller in another thread); the worker runs meanwhile."""
        self.service.worker.start()
        try:
            self.run(sockets=[self.sock])
        finally:
            self.service.close()
            self.sock.close()


def serve(service: Service, sock: socket.socket, on_ready: Callable[[str, int], None] | None = None,
          log_level: str = "warning") -> None:  # fmt: skip
    """Serve on `sock` (from `listen`, taken before the models load: a port in use is said at once)."""
    Server(service, sock, on_ready, log_level).serve_forever()
