"""`specllm serve` while its models load: /health answers 503 at once (as llama.cpp's server does,
for the editors and orchestrators that poll it) and other requests wait for the models. The loading
is a block that waits for an event here; the server listens on 127.0.0.1 and every wait is bounded."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from specllm.server.app import Service
from specllm.server.run import listen, loading
from tests.server_helpers import WAIT, raw, tiny_engine, until


def get(url: str, path: str) -> tuple[int, dict, dict]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read()), dict(response.getheaders())
    finally:
        connection.close()


def test_health_answers_503_while_the_models_load_and_other_requests_wait(tiny_pair):
    sock = listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    models_loaded, servers, failures = threading.Event(), [], []

    def serve() -> None:
        engine = None
        try:
            with loading(sock, "tiny") as server:
                servers.append(server)
                assert models_loaded.wait(WAIT)  # the models loading
                engine = tiny_engine(tiny_pair, "ngram")
                server.serve_loaded(Service(engine, "tiny"))
        except BaseException as exc:  # noqa: BLE001 - the test's thread says what failed
            failures.append(exc)
        finally:
            if engine is not None:
                engine.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        status, body, headers = get(url, "/health")
        assert status == 503 and body["status"] == "loading model" and body["model"] == "tiny"
        assert body["error"] == {"code": 503, "message": "Loading model", "type": "unavailable_error"}  # llama.cpp's
        assert headers.get("retry-after") == "1"
        answers = []
        asking = threading.Thread(target=lambda: answers.append(
            raw(url, "POST", "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0})), daemon=True)  # fmt: skip
        asking.start()
        assert get(url, "/health")[0] == 503 and not answers  # it cannot be answered before the models are there
        models_loaded.set()
        asking.join(WAIT)
        assert answers and answers[0][0] == 200 and answers[0][1]["usage"]["completion_tokens"] == 2
        until(lambda: get(url, "/health")[0] == 200, "the health check to say ok")
        assert get(url, "/health")[1]["status"] == "ok"
    finally:
        models_loaded.set()
        until(lambda: servers, "the server")
        servers[0].should_exit = True
        thread.join(WAIT)
    assert not thread.is_alive() and not failures, failures
    assert sock.fileno() == -1  # closed


def test_a_loading_that_fails_stops_the_server_and_says_why(tiny_pair):
    """An error while loading (a model that is not there, Ctrl-C) leaves the block as it came: the
    HTTP server stops and the port is closed."""
    sock = listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    with pytest.raises(KeyboardInterrupt):
        with loading(sock, "tiny") as server:
            assert get(url, "/health")[0] == 503
            raise KeyboardInterrupt
    assert not server.thread.is_alive() and sock.fileno() == -1
    with pytest.raises(OSError):
        get(url, "/health")
