"""Running the app under uvicorn: the listening socket, the worker's lifetime, and signals.

The first Ctrl-C or SIGTERM stops accepting work (waiting requests get 503) and lets the running
request finish; a second one aborts it at its next step. Either way `serve` returns normally.
`loading` answers while the models load (uvicorn in a thread of its own, the loading in the main
thread, where Ctrl-C interrupts it as before): /health with 503, other requests once they are loaded.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import uvicorn

from specllm.errors import SpecllmError
from specllm.server.app import Loading, Service, create_app

THREAD_WAIT = 30.0  # seconds: the most `loading` waits for the HTTP thread to start, or to stop


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

    def __init__(self, service: Service | Loading, sock: socket.socket, on_ready: Callable[[str, int], None] | None = None,
                 log_level: str = "warning", api_key: str | None = None):  # fmt: skip
        config = uvicorn.Config(create_app(service, api_key), log_level=log_level, access_log=False, lifespan="off")
        super().__init__(config)
        self.loading = service if isinstance(service, Loading) else None
        self.service = None if isinstance(service, Loading) else service  # a Loading's once `serve_loaded` has it
        self.sock, self.on_ready = sock, on_ready
        self.signals = 0
        self.thread: threading.Thread | None = None  # uvicorn's own, in `loading`

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None and self.loading is None:
            self.on_ready(*self.address)

    @contextmanager
    def capture_signals(self):
        self.loop = asyncio.get_running_loop()  # uvicorn enters this in its loop: where a signal's work goes
        with self._main_thread_signals():
            yield

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        """Runs in the main thread between two of its bytecodes, perhaps while the event loop there
        holds the job queue's lock (adding a job): the queue is drained from the loop, not here
        (in `loading` the loop runs in another thread, and the same holds)."""
        self.signals += 1
        self.should_exit = True
        try:
            self.loop.call_soon_threadsafe(self.service.worker.stop_accepting)
        except RuntimeError:  # its loop has ended (`loading`: the HTTP thread stopped meanwhile)
            pass
        if self.signals > 1:
            self.force_exit = True
            self.service.worker.abort()

    def serve_loaded(self, service: Service, on_ready: Callable[[str, int], None] | None = None) -> None:
        """In `loading`: serve the loaded service until a signal or should_exit (the HTTP thread ends)."""
        self.service = service
        service.worker.start()
        self.loading.set(service)
        thread = self.thread
        deadline = time.monotonic() + THREAD_WAIT
        while not self.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.started:
            raise SpecllmError(f"the HTTP server on {self.address[0]}:{self.address[1]} did not start")
        if on_ready is not None:
            on_ready(*self.address)
        with self._main_thread_signals():
            while thread.is_alive():
                thread.join(0.25)  # a wait that signal handlers interrupt

    @contextmanager
    def _main_thread_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def serve_forever(self) -> None:
        """Serve until should_exit (a signal, or a caller in another thread); the worker runs meanwhile."""
        self.service.worker.start()
        try:
            self.run(sockets=[self.sock])
        finally:
            self.service.close()
            self.sock.close()


@contextmanager
def loading(sock: socket.socket, model_id: str, log_level: str = "warning", api_key: str | None = None) -> Iterator[Server]:
    """Answer on `sock` (from `listen`, taken before the models load: a port in use is said at once)
    while the block loads the models: /health with 503 "loading model", other
    requests once the block calls `serve_loaded(service)`, which serves until a signal. Leaving the
    block without it (an error, Ctrl-C while loading) stops the server: waiting requests get 503."""
    server = Server(Loading(model_id), sock, log_level=log_level, api_key=api_key)
    server.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specllm-http", daemon=True)
    server.thread.start()
    try:
        yield server
    finally:
        server.loading.fail()  # a no-op once loaded
        server.should_exit = True
        server.thread.join(THREAD_WAIT)
        if server.service is not None:
            server.service.close()
        sock.close()
