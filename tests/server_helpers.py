"""Running `specllm serve` in tests and talking to it (shared by the server tests and a few others).

The tiny models' load options (`TINY`, a context of `N_CTX`) and an engine on the tiny pair; the
server in a thread on 127.0.0.1 (`running`) or as a subprocess (`serve_process`); the official
`openai` client on it (`client`) and raw HTTP (`raw`: JSON back, `raw_body`: the text of a POST's
answer). Every wait is bounded by `WAIT` seconds (`until` polls a condition within it).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import openai

from specllm.backend import LoadOptions
from specllm.server.app import Service
from specllm.server.run import Server, listen
from specllm.session import Engine, ModelPaths, SpecConfig

N_CTX = 2048
TINY = LoadOptions(n_ctx=N_CTX, n_threads=1, n_gpu_layers=0)
WAIT = 60  # seconds: the bound on every wait


def tiny_engine(tiny_pair, strategy: str = "ngram+draft") -> Engine:
    return Engine(ModelPaths(*tiny_pair), SpecConfig(strategy), TINY, TINY)


@contextmanager
def running(service: Service, api_key: str | None = None):
    """The server in a thread on a free port; yields its base URL and stops it (bounded) at the end."""
    server = Server(service, listen("127.0.0.1", 0), api_key=api_key)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    host, port = server.address
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        assert not thread.is_alive(), "the server did not stop"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=WAIT)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def raw(url: str, method: str, path: str, body: object = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def raw_body(url: str, path: str, body: dict) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


@contextmanager
def serve_process(*args, env: dict | None = None):
    command = [sys.executable, "-m", "specllm", "serve", "--port", "0", *args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1", **(env or {})})
    try:
        ready, _, _ = select.select([process.stderr], [], [], WAIT)  # the first line names the address
        assert ready, "the server printed nothing"
        line = process.stderr.readline()
        found = re.search(r"http://([\d.]+):(\d+)/v1", line)
        assert found, line + process.stderr.read() if process.poll() is not None else line
        yield process, f"http://{found.group(1)}:{found.group(2)}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(WAIT)
