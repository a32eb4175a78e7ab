"""Request shapes that real clients send, replayed against `specllm serve` on the tiny models.

Each test names the client whose source sends (or reads) the shape: llama.vscode's edit request
(`max_tokens: -1`), Continue's "llama.cpp" provider (llama.cpp's own `/completion`), a client given
the server's address without `/v1` (aider's OPENAI_API_BASE, Zed's api_url, the openai client's
base_url), browser clients (Open WebUI's direct connections: a CORS preflight first), and values
other servers' clients send (`tool_choice: null`, vLLM's `top_k: -1`).
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from specllm.backend import LoadOptions
from specllm.server import parsing
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.server_helpers import WAIT, raw, running

N_CTX = 256  # small, so that a request without a limit runs to the context's end in a moment
SMALL = LoadOptions(n_ctx=N_CTX, n_threads=1, n_gpu_layers=0)
CODE = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def server(tiny_pair):
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("ngram+draft"), SMALL, SMALL)
    with running(Service(engine, "tiny")) as url:
        yield url
    engine.close()


def request(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, headers with lower-case names, body as text)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


def events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]


# -- max_tokens -1 ------------------------------------------------------------------------------

# llama.vscode's "edit selected text" request (v0.0.10 to v0.0.14), as its source writes it
LLAMA_VSCODE_EDIT = {
    "messages": [{"role": "system", "content": "You are an expert coder."}, {"role": "user", "content": "Rename add to plus:\n" + CODE}],
    "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
    "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "xtc_probability": 0,
    "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1,
    "timings_per_token": False,
}  # fmt: skip


def test_max_tokens_minus_one_is_no_limit_as_llama_cpp_reads_it(server):
    """llama.vscode's edit request sent `max_tokens: -1` (a 400 here: every edit failed); llama.cpp's
    server reads it as no limit: the answer runs to the end token or the context's end."""
    status, _, text = request(server, "POST", "/v1/chat/completions", LLAMA_VSCODE_EDIT)
    assert status == 200, text
    reply = json.loads(text)
    usage = reply["usage"]
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    if reply["choices"][0]["finish_reason"] == "length":
        assert usage["prompt_tokens"] + usage["completion_tokens"] == N_CTX
    completion = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=WAIT).completions.create(
        model="tiny", prompt=CODE, max_tokens=-1, temperature=0)
    assert completion.choices[0].finish_reason == "length"  # the tiny model writes no end token
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == N_CTX
    for value in (0, -2):
        assert raw(server, "POST", "/v1/chat/completions", {**LLAMA_VSCODE_EDIT, "max_tokens": value})[0] == 400
    assert parsing.parse("chat", {**LLAMA_VSCODE_EDIT, "max_completion_tokens": -1, "max_tokens": None}).max_tokens is None


# -- null and other servers' spellings -----------------------------------------------------------


def test_tool_choice_null_is_left_out_as_every_other_null_field_is(server):
    """A client that serializes every field it has (null where unset) sends `tool_choice: null`;
    llama.cpp's server and OpenAI read null as left out (it was a 400 here, the only such field)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": None, "tools": None,
            "stop": None, "temperature": None, "top_p": None, "seed": None, "max_completion_tokens": None,
            "stream_options": None, "response_format": None, "n": None, "logprobs": None, "user": None}  # fmt: skip
    status, answer = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    assert parsing.parse("chat", {**body, "tools": [{"type": "function", "function": {"name": "f"}}]}).tool_choice == "auto"


def test_top_k_minus_one_is_top_k_off(server):
    """vLLM's spelling of "no top-k", which clients written for it send; llama.cpp's server takes it too."""
    body = {"messages": [{"role": "user", "content": "Rename add to plus:\n" + CODE}], "max_tokens": 8, "temperature": 0}
    assert parsing.parse("chat", {**body, "top_k": -1}).params.top_k == 0
    status, off = raw(server, "POST", "/v1/chat/completions", {**body, "top_k": -1})
    assert status == 200, off
    zero = raw(server, "POST", "/v1/chat/completions", {**body, "top_k": 0})[1]
    assert off["choices"][0]["message"]["content"] == zero["choices"][0]["message"]["content"]
    assert raw(server, "POST", "/v1/chat/completions", {**body, "top_k": -2})[0] == 400


# -- paths ----------------------------------------------------------------------------------------


def test_the_openai_routes_answer_without_v1_as_llama_cpps_do(server):
    """A client given the server's address as its base URL (aider's OPENAI_API_BASE, Zed's api_url,
    the openai client's base_url) posts to /chat/completions: llama.cpp's server answers there too."""
    api = openai.OpenAI(base_url=server, api_key="any key", max_retries=0, timeout=WAIT)
    assert [m.id for m in api.models.list()] == ["tiny"]
    assert api.models.retrieve("tiny").id == "tiny"
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert chat.choices[0].message.content
    chunks = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              temperature=0, stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    text = api.completions.create(model="tiny", prompt=CODE, max_tokens=3, temperature=0).choices[0].text
    assert text == openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=WAIT).completions.create(
        model="tiny", prompt=CODE, max_tokens=3, temperature=0).choices[0].text
    with pytest.raises(openai.NotFoundError):  # another model's name is still refused there
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=3)


# -- browsers ------------------------------------------------------------------------------------


def test_a_browsers_preflight_is_answered_and_every_answer_allows_any_origin(server):
    """Open WebUI's direct connections and web pages on the openai JS client call from the browser:
    a preflight (OPTIONS) first, then the request, whose answer the browser hands over only with
    Access-Control-Allow-Origin, as llama.cpp's server and OpenAI's API send it (a 405 here)."""
    origin = {"Origin": "http://localhost:3000"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    for path in ("/v1/chat/completions", "/v1/models", "/infill", "/health"):
        status, headers, _ = request(server, "OPTIONS", path, headers=preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "*", (path, headers)
        assert "POST" in headers["access-control-allow-methods"] and "authorization" in headers["access-control-allow-headers"].lower()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for extra, path in (({}, "/v1/models"), ({"stream": True}, "/v1/chat/completions"), ({}, "/v1/chat/completions"),
                        ({"model": "gpt-4o"}, "/v1/chat/completions")):  # fmt: skip
        get = path.endswith("models")
        status, headers, _ = request(server, "GET" if get else "POST", path, None if get else {**body, **extra},
                                     {**origin, "Authorization": "Bearer sk-any"})  # fmt: skip
        assert status in (200, 404) and headers.get("access-control-allow-origin") == "*", (path, extra, headers)


# -- llama.cpp's /completion ---------------------------------------------------------------------

# Continue's "llama.cpp" provider, for chat (its own template) and autocomplete alike, as its source sends it
CONTINUE_LLAMA_CPP = {"model": "qwen2.5-coder-1.5b", "prompt": CODE, "stream": True, "n_predict": 6, "frequency_penalty": 0,
                      "presence_penalty": 0, "min_p": 0.05, "mirostat": 0, "stop": ["\n\n\n"], "top_k": 40, "top_p": 0.95,
                      "temperature": 0}  # fmt: skip


def test_continues_llama_cpp_provider_gets_llama_cpps_completion_answer(server):
    """Continue's "llama.cpp" provider posts to /completion (a 404 here: chat and autocomplete
    both failed) and reads `content` from each event; the text is /v1/completions' own, the model's
    name is not checked (Continue sends the one in its config), and the stream has no [DONE]."""
    expected = raw(server, "POST", "/v1/completions", {"prompt": CODE, "max_tokens": 6, "temperature": 0})[1]["choices"][0]["text"]
    status, headers, text = request(server, "POST", "/completion", CONTINUE_LLAMA_CPP)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), text
    chunks = [json.loads(event) for event in events(text)]
    assert "".join(c["content"] for c in chunks) == expected
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["stop_type"] == "limit" and chunks[-1]["tokens_predicted"] == 6
    status, whole = raw(server, "POST", "/completion", {**CONTINUE_LLAMA_CPP, "stream": False})
    assert status == 200 and whole["content"] == expected and whole["stop"] is True, whole
    ids = raw(server, "POST", "/completion", {"prompt": [1, 2, 3], "n_predict": 2})
    assert ids[0] == 200 and ids[1]["tokens_evaluated"] == 3
    for body, param in (({"n_predict": 2}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": "x", "n_predict": -2}, "n_predict")):
        status, answer = raw(server, "POST", "/completion", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_an_api_key_is_asked_of_every_route_but_health(tiny_pair):
    """`serve --api-key KEY` (for a server other machines reach): OpenAI clients send it as a bearer
    token, llama.cpp's clients may send X-Api-Key; without it 401 in OpenAI's shape, which the openai
    client raises as its own AuthenticationError. A browser's preflight needs no key."""
    engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig("off"), SMALL, SMALL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with running(Service(engine, "tiny"), api_key="s3cret") as url:
            missing = request(url, "POST", "/v1/chat/completions", body)
            wrong = request(url, "POST", "/v1/chat/completions", body, {"Authorization": "Bearer nope"})
            bearer = request(url, "POST", "/v1/chat/completions", body, {"Authorization": "Bearer s3cret"})
            x_api_key = request(url, "POST", "/completion", {"prompt": "a", "n_predict": 1}, {"X-Api-Key": "s3cret"})
            health = request(url, "GET", "/health")
            models = request(url, "GET", "/v1/models")
            preflight = request(url, "OPTIONS", "/v1/chat/completions", None, {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="nope").models.list()
            listed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list()
    finally:
        engine.close()
    assert [missing[0], wrong[0], models[0]] == [401, 401, 401]
    assert json.loads(missing[2])["error"]["code"] == "invalid_api_key"
    assert [bearer[0], x_api_key[0], health[0], preflight[0]] == [200, 200, 200, 200]
    assert [m.id for m in listed.data] == ["tiny"]

