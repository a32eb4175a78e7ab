"""`specllm serve` under several clients and misbehaving ones, and what llama.cpp's clients read
besides completions: on the tiny models, the server in a thread on 127.0.0.1 (bounded waits).

Clients named here by what their source sends or reads: llama.vscode (the `/infill` answer's
`generation_settings.n_ctx` on its status line; a context overflow told by its message; `/tokenize`
to count a prompt; `/props` for the context's size).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from specllm.backend import LoadOptions
from specllm.server import body as body_module
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.fim_helpers import EXTRA, PREFIX, SUFFIX, fim_engine, fim_model  # noqa: F401 - fixtures
from tests.server_helpers import WAIT, raw, running, until

N_CTX = 512
SMALL = LoadOptions(n_ctx=N_CTX, n_threads=1, n_gpu_layers=0)


@pytest.fixture(scope="module")
def server(tiny_pair):
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("ngram+draft"), SMALL, SMALL)
    service = Service(engine, "tiny")
    with running(service) as url:
        yield url, service
    engine.close()


def connect(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=WAIT)


def streamed_text(url: str, path: str, body: dict) -> tuple[str, dict]:
    """The text of a streamed answer (OpenAI's chunks or llama.cpp's events) and its last event."""
    connection = connect(url)
    try:
        connection.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        events = [json.loads(line[6:]) for line in response.read().decode().split("\n") if line.startswith("data: {")]
    finally:
        connection.close()
    if path == "/completion":
        return "".join(e["content"] for e in events), events[-1]
    return "".join(c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text", "") for c in events if c["choices"]), events[-1]


# -- a body too large to read -----------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_with_413_whether_announced_or_chunked(server):
    """A 100 MB body was read whole, parsed and tokenized (45 s, 2 GB) before its 400: now one
    announced larger than the limit is refused unread, and a chunked one once the limit is passed."""
    url, service = server
    too_large = 17 * 2**20
    assert body_module.MAX_BODY < too_large
    connection = connect(url)
    try:  # spaces: read whole, they were a 400 (no JSON) after it all came
        connection.request("POST", "/v1/completions", b" " * too_large, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 413 and answer["error"]["code"] == "request_too_large"
    connection = connect(url)
    try:  # chunked: no length said up front
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        chunk = b" " * 2**20
        for _ in range(too_large // len(chunk) + 1):
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        connection.send(b"0\r\n\r\n")
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 413 and "larger than" in answer["error"]["message"]
    status, answer = raw(url, "POST", "/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert status == 200 and service.worker.queued() == 0


# -- the context's size, as llama.cpp's clients read it -------------------------------------------


def test_a_prompt_beyond_the_context_is_a_400_that_llama_vscode_reads_as_a_context_overflow(server):
    url, _ = server
    status, answer = raw(url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * (2 * N_CTX)}]})
    error = answer["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert "exceeds the available context size" in error["message"]  # what llama.vscode's chat provider tests for
    assert f"the context holds {N_CTX}" in error["message"]


def test_llama_cpps_completion_answer_carries_generation_settings_with_n_ctx(server):
    """llama.vscode's status line reads `generation_settings.n_ctx` of every answer; without the object
    it threw, and the code after it (gathering the editor's context for later requests) never ran."""
    url, _ = server
    body = {"prompt": "def add(a, b):", "n_predict": 4, "temperature": 0}
    status, answer = raw(url, "POST", "/completion", body)
    assert status == 200 and answer["generation_settings"]["n_ctx"] == N_CTX
    text, last = streamed_text(url, "/completion", body)
    assert text == answer["content"] and last["stop"] is True and last["generation_settings"]["n_ctx"] == N_CTX
    status, picked = raw(url, "POST", "/completion", {**body, "response_fields": ["content", "generation_settings/n_ctx"]})
    assert status == 200 and picked == {"content": answer["content"], "generation_settings/n_ctx": N_CTX}
    status, answer = raw(url, "POST", "/v1/completions", {**body, "max_tokens": 4})
    assert status == 200 and "generation_settings" not in answer  # OpenAI's shape stays OpenAI's


def test_llama_vscodes_infill_request_gets_n_ctx_in_its_answer(fim_engine):  # noqa: F811
    """The request llama.vscode's source sends (n_cmpl, id_slot, samplers and the rest)."""
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "a",
            "n_predict": 8, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4}  # fmt: skip
    with running(Service(fim_engine, "tiny-fim")) as url:
        status, answer = raw(url, "POST", "/infill", body)
    assert status == 200 and isinstance(answer["content"], str) and isinstance(answer["tokens_cached"], int)
    assert answer["generation_settings"]["n_ctx"] == fim_engine.target.n_ctx


def test_props_tokenize_and_detokenize_answer_as_llama_cpps_do(server):
    url, service = server
    status, props = raw(url, "GET", "/props")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == N_CTX and props["total_slots"] == 1
    text = "def add(a, b):<|im_end|>"
    status, answer = raw(url, "POST", "/tokenize", {"content": text})  # special tokens parsed, no BOS, by default
    tokens = answer["tokens"]
    assert status == 200 and tokens == service.engine.target.tokenize(text, parse_special=True)
    assert raw(url, "POST", "/detokenize", {"tokens": tokens}) == (200, {"content": text})
    status, pieces = raw(url, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == tokens and "".join(p["piece"] for p in pieces["tokens"]) == text
    assert raw(url, "POST", "/tokenize", {"content": text, "parse_special": False})[1]["tokens"] != tokens
    for path, body in (("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": "1 2"}), ("/tokenize", {"content": 7}),
                       ("/tokenize", [1]), ("/tokenize", b"\xff")):  # fmt: skip
        status, answer = raw(url, "POST", path, body)
        assert status == 400 and answer["error"]["message"], (path, body)


# -- several clients --------------------------------------------------------------------------


def test_clients_at_once_and_cancelled_ones_between_get_the_text_each_gets_alone(server):
    """Two streams at once are served in turn, each the text it gets alone at temperature 0, and an
    editor's cancelled requests (the connection closed at once, or after the first bytes) leave the
    next request's text as it was."""
    url, service = server
    requests = [{"messages": [{"role": "user", "content": f"Client {i}: " + "alpha beta " * (i + 1)}], "max_tokens": 24,
                 "temperature": 0} for i in range(2)]  # fmt: skip
    alone = [streamed_text(url, "/v1/chat/completions", r)[0] for r in requests]
    together = [None, None]

    def ask(i):
        together[i] = streamed_text(url, "/v1/chat/completions", requests[i])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert together == alone
    host, port = url.removeprefix("http://").split(":")
    for i in range(6):
        body = json.dumps({**requests[i % 2], "max_tokens": 200, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            if i % 2:
                sock.recv(64)
    until(lambda: not service.worker.busy and service.worker.queued() == 0, "the cancelled requests to end")
    assert [streamed_text(url, "/v1/chat/completions", r)[0] for r in reversed(requests)] == alone[::-1]
