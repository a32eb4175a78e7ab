"""`specllm serve` as clients use it: the real server on 127.0.0.1 (a free port), driven by the
official `openai` client and by raw HTTP, on the tiny test models; one test on the default pair.

Servers run in-process (uvicorn in a thread, `should_exit` at teardown) or as a subprocess killed
at teardown; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import codecs
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from specllm.backend import LlamaBackend, LoadOptions
from specllm.chat import encode_raw
from specllm.costs_cache import save_costs
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import StepDone
from specllm.engine.sampling import SamplingParams, warp
from specllm.server.app import Service, create_app
from specllm.server.endings import StopText
from specllm.server.run import Server, listen
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.server_helpers import N_CTX, TINY, WAIT, client, raw, running, serve_process, tiny_engine, until
from tests.stat_helpers import chi_square_pvalue

SAMPLES = 600  # temperature > 0 check: requests of 2 tokens, each after a different one
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    engine = tiny_engine(tiny_pair)
    service = Service(engine, "tiny")
    with running(service) as url:
        yield url, service
    engine.close()


def chat(url, content, **kwargs):
    kwargs = {"max_tokens": 32, "temperature": 0, **kwargs}
    return client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


# -- the good path --------------------------------------------------------------------------


def test_chat_completion_carries_text_usage_and_speculation(tiny_server):
    url, _ = tiny_server
    reply = chat(url, "Rename add to plus:\n" + CODE)
    assert reply.object == "chat.completion" and reply.model == "tiny"
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.completion_tokens <= 32 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculation"]
    assert spec["strategy"] == "ngram+draft" and spec["steps"] >= 1
    assert set(spec["by_source"]) == {"ngram", "draft"}
    assert spec["drafted"] == sum(s["drafted"] for s in spec["by_source"].values())
    assert spec["accepted"] <= spec["drafted"] and spec["tok_per_s"] > 0


def test_streamed_text_equals_the_whole_reply(tiny_server):
    url, _ = tiny_server
    whole = chat(url, "Say something about " + CODE).choices[0].message.content
    stream = chat(url, "Say something about " + CODE, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    closing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(closing) == 1 and closing[0].usage is None  # with include_usage, usage comes once, as OpenAI sends it:
    assert [c for c in chunks if c.usage] == [chunks[-1]] and chunks[-1].choices == []  # alone in the last chunk
    assert chunks[-1].usage.completion_tokens >= 1 and "speculation" in chunks[-1].usage.model_extra
    plain = list(chat(url, "Say something about " + CODE, stream=True))  # without: on the chunk that finishes
    assert [c for c in plain if c.usage] == [plain[-1]] and plain[-1].choices[0].finish_reason


def test_models_and_health(tiny_server):
    url, _ = tiny_server
    assert [m.id for m in client(url).models.list()] == ["tiny"]
    assert client(url).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("gpt-4o")
    status, body = raw(url, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "tiny"


def test_a_presets_target_model_name_is_served_too(tiny_pair):
    """`specllm serve` serves the default preset as `qwen2.5-coder`; a client that names its target
    model, `qwen2.5-coder-1.5b` (the README's example), is served too, not told the model is unknown."""
    from specllm.cli.serve_cmd import _aliases

    assert _aliases("qwen2.5-coder") == {"qwen2.5-coder-1.5b"} and _aliases("no-such-preset") == set()
    engine = tiny_engine(tiny_pair)
    try:
        with running(Service(engine, "tiny", aliases={"tiny-1b"})) as url:
            api = client(url)
            assert [m.id for m in api.models.list()] == ["tiny"]
            reply = api.chat.completions.create(model="tiny-1b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message.content is not None
            with pytest.raises(openai.NotFoundError):
                api.chat.completions.create(model="tiny-2b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        engine.close()


def test_text_completion_streaming_and_stop_strings(tiny_server):
    url, _ = tiny_server
    api = client(url)
    full = api.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0).choices[0]
    assert full.text and full.finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in api.completions.create(model="tiny", prompt=CODE, max_tokens=24,
                                                                          temperature=0, stream=True) if c.choices)  # fmt: skip
    assert streamed == full.text
    stop = full.text[len(full.text) // 2 :][:3]  # a piece of the middle of the text
    for stream in (False, True):
        answer = api.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = [c.choices[0] for c in answer if c.choices]
            text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == full.text[: full.text.find(stop)] and reason == "stop"


def test_a_batch_of_one_prompt_is_that_prompt_as_text_or_token_ids(tiny_server):
    """OpenAI's prompt may be text, token ids, or a batch of either: a batch of one token list (as
    evaluation harnesses send it) was refused where a batch of one text was read."""
    url, service = tiny_server
    ids = encode_raw(service.engine.target, CODE)  # the tokens the text reads as
    texts = {repr(prompt)[:12]: client(url).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
             for prompt in (ids, [ids], [CODE])}  # fmt: skip
    assert len(set(texts.values())) == 1, texts


def test_a_prompt_formatted_by_the_client_reads_as_the_servers_own_template(tiny_server):
    """A client that formats its own chat (or fill-in-the-middle) prompt for /v1/completions writes the
    model's special tokens as text; they are read as those tokens, as llama.cpp's servers read them."""
    url, _ = tiny_server
    api = client(url)
    reply = chat(url, "Rename add to plus:\n" + CODE, max_tokens=16)
    formatted = "<|im_start|>user\nRename add to plus:\n" + CODE + "<|im_end|>\n<|im_start|>assistant\n"  # tiny's ChatML
    completion = api.completions.create(model="tiny", prompt=formatted, max_tokens=16, temperature=0)
    assert completion.usage.prompt_tokens == reply.usage.prompt_tokens
    assert completion.choices[0].text == reply.choices[0].message.content


def test_stop_text_holds_back_a_possible_start_and_cuts_at_the_first_stop():
    cut = StopText(["END", "xy"])
    assert [cut.push(p) for p in ["ab", "cE", "N", "x", "q", "zE", "ND tail"]] == ["ab", "c", "", "EN", "xq", "z", ""]
    assert cut.stopped and cut.flush() == ""
    cut = StopText(["END"])
    assert cut.push("aEN") == "a" and cut.flush() == "EN" and not cut.stopped


def test_reuse_keeps_temperature_zero_text_identical_to_a_fresh_server(tiny_server, tiny_pair):
    """An agent's second call extends its first: the KV prefix is reused and the n-gram cache has seen
    the first answer; the text must still equal that of the same request on a fresh server."""
    url, _ = tiny_server
    first_messages = [{"role": "user", "content": "Rewrite this code:\n" + CODE}]
    api = client(url)
    first = api.chat.completions.create(model="tiny", messages=first_messages, max_tokens=40, temperature=0)
    answer = first.choices[0].message.content
    follow = first_messages + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": "Again, the same code:\n" + CODE + answer}]  # fmt: skip
    second = api.chat.completions.create(model="tiny", messages=follow, max_tokens=40, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    engine = tiny_engine(tiny_pair)
    try:
        with running(Service(engine, "tiny")) as fresh:
            alone = client(fresh).chat.completions.create(model="tiny", messages=follow, max_tokens=40, temperature=0)
    finally:
        engine.close()
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == alone.choices[0].message.content


def next_probs(model: LlamaBackend, context: list[int], params: SamplingParams) -> np.ndarray:
    model.rewind(0)
    return warp(model.evaluate(context, [len(context) - 1])[0], params)


def exact_texts(truth: LlamaBackend, prompt: list[int], params: SamplingParams) -> dict[str, float]:
    """P(text of the first two generated tokens), over every pair the warping allows (an EOG ends early)."""
    texts: dict[str, float] = {}

    def add(seq: list[int], p: float) -> None:
        # as the engine writes it: the bytes of a character the token limit cut are left out, not "\ufffd"
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(truth.token_bytes(t) for t in seq))
        texts[text] = texts.get(text, 0.0) + p

    first = next_probs(truth, prompt, params)
    for a in map(int, np.flatnonzero(first)):
        if truth.is_eog(a):
            add([], first[a])
            continue
        second = next_probs(truth, prompt + [a], params)
        for b in map(int, np.flatnonzero(second)):
            add([a] if truth.is_eog(b) else [a, b], first[a] * second[b])
    return texts


@pytest.mark.slow
def test_a_seeded_request_gets_its_text_again_though_the_ngram_cache_drafts_it(tiny_pair):
    """At temperature > 0 with a `seed`: the second time the n-gram cache drafts the first answer
    from memory, and the text is the first one's (an n-gram token is verified by the target's own
    draw at its position, keyed by the seed), as a fresh server's is."""
    engine = tiny_engine(tiny_pair, "ngram")
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Write a list of words."}], max_tokens=32, temperature=0.9)
    try:
        with running(Service(engine, "tiny")) as url:
            replies = [client(url).chat.completions.create(**ask, seed=3) for _ in range(3)]
        with running(Service(engine, "tiny")) as url:
            fresh, other = (client(url).chat.completions.create(**ask, seed=seed).choices[0].message.content for seed in (3, 4))
    finally:
        engine.close()
    texts = [r.choices[0].message.content for r in replies]
    assert texts[0] and texts == [fresh] * 3 and other != fresh  # the seed decides, not what was drafted
    assert replies[-1].usage.model_extra["speculation"]["accepted"] > 0  # drafted from the remembered answers


def test_sampling_under_reuse_follows_the_target_distribution(compact_pair):
    """Temperature > 0, each sample served right after a different request (KV prefix and n-gram
    memory carried over): the texts follow the target's exactly computed distribution. On the
    compact pair (conftest.py): 1200 requests, each step reading a 4096-token output layer."""
    engine = tiny_engine(compact_pair)
    try:
        with running(Service(engine, "tiny")) as url:
            _sample_under_reuse(url, compact_pair[0])
    finally:
        engine.close()


def _sample_under_reuse(url: str, target) -> None:
    truth = LlamaBackend(target, TINY)
    try:
        params = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
        head = truth.tokenize("def add(a, b):")
        y = int(np.argmax(next_probs(truth, head, params)))
        prompt = head + [y] + head  # `S y S`: the n-gram cache proposes y again
        expected = exact_texts(truth, prompt, params)
    finally:
        truth.close()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 1.5, "top_k": 3, "top_p": 1.0, "min_p": 0.0}
    other = {"model": "tiny", "prompt": "x = [1, 2, 3]", "max_tokens": 2, "temperature": 1.5}
    texts, drafted = [], 0
    for i in range(SAMPLES):  # a seed of its own for each request: the test draws the same samples every run
        assert raw(url, "POST", "/v1/completions", {**other, "seed": i})[0] == 200
        status, answer = raw(url, "POST", "/v1/completions", {**body, "seed": SAMPLES + i})
        assert status == 200, answer
        texts.append(answer["choices"][0]["text"])
        drafted += answer["usage"]["speculation"]["drafted"]
    assert drafted > SAMPLES // 2  # speculation was at work
    pvalue = chi_square_pvalue(texts, expected)
    assert pvalue > 1e-3, f"served samples do not follow the target (p={pvalue:.2e})"


# -- bad input ------------------------------------------------------------------------------

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = {  # name: (path, body as sent, status, the param or code the error names)
    "malformed JSON": ("/v1/chat/completions", b'{"messages": [', 400, None),
    "not UTF-8": ("/v1/chat/completions", b'{"messages": "\xff"}', 400, None),
    "body is an array": ("/v1/chat/completions", [GOOD], 400, None),
    "missing messages": ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    "messages not an array": ("/v1/chat/completions", {**GOOD, "messages": "hi"}, 400, "messages"),
    "empty messages": ("/v1/chat/completions", {**GOOD, "messages": []}, 400, "messages"),
    "message not an object": ("/v1/chat/completions", {**GOOD, "messages": ["hi"]}, 400, "messages[0]"),
    "content a number": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "image content": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    "unknown role": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    "missing role": ("/v1/chat/completions", {**GOOD, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    "max_tokens 0": ("/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": ("/v1/chat/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    "max_tokens a string": ("/v1/chat/completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    "max_tokens a boolean": ("/v1/chat/completions", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    "max_tokens beyond the context": ("/v1/chat/completions", {**GOOD, "max_tokens": N_CTX + 1}, 400, "context_length_exceeded"),
    "prompt beyond the context": ("/v1/completions", {"prompt": "word " * (2 * N_CTX), "max_tokens": 4}, 400, "context_length_exceeded"),
    "messages beyond the context": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "word " * (2 * N_CTX)}]}, 400, "context_length_exceeded"),
    "temperature a string": ("/v1/chat/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    "temperature negative": ("/v1/chat/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    "top_p above one": ("/v1/chat/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    "seed a float": ("/v1/chat/completions", {**GOOD, "seed": 1.5}, 400, "seed"),
    "seed below -1": ("/v1/chat/completions", {**GOOD, "seed": -2}, 400, "seed"),
    "max_tokens past a float's range": ("/v1/chat/completions", {**GOOD, "max_tokens": 10**400}, 400, "max_tokens"),
    "temperature past a float's range": ("/v1/chat/completions", {**GOOD, "temperature": 10**400}, 400, "temperature"),
    "nested too deeply": ("/v1/chat/completions", b"[" * 100_000, 400, None),
    "a number too long to read": ("/v1/chat/completions", b'{"max_tokens": ' + b"1" * 5000 + b"}", 400, None),
    "stop a number": ("/v1/chat/completions", {**GOOD, "stop": 7}, 400, "stop"),
    "stream a string": ("/v1/chat/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    "n of 2": ("/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
    "unknown model": ("/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404, "model_not_found"),
    "model a number": ("/v1/chat/completions", {**GOOD, "model": 3}, 400, "model"),
    "missing prompt": ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    "prompt a batch": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    "token id out of range": ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    "suffix a number": ("/v1/completions", {"prompt": "def f(", "suffix": 3}, 400, "suffix"),
    "suffix after token ids": ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, 400, "prompt"),
    "suffix for a model without FIM tokens": ("/v1/completions", {"prompt": "def f(", "suffix": "):"}, 400, "suffix"),
}


def test_values_openai_clients_send_that_specllm_reads_its_own_way(tiny_server):
    """`top_p: 0` keeps the most likely token only (the greedy text); `seed: -1` is a random seed."""
    url, _ = tiny_server
    greedy = chat(url, "Rename add to plus:\n" + CODE, max_tokens=12).choices[0].message.content
    assert chat(url, "Rename add to plus:\n" + CODE, max_tokens=12, temperature=1.0, top_p=0).choices[0].message.content == greedy
    assert chat(url, "hi", max_tokens=2, temperature=1.0, seed=-1).choices[0].message.content is not None


def test_every_bad_input_gets_an_openai_error_and_the_server_keeps_serving(tiny_server):
    url, _ = tiny_server
    for name, (path, body, status, names) in BAD.items():
        got, answer = raw(url, "POST", path, body)
        assert got == status, (name, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (name, error)
        if names is not None:
            assert names in (error["param"], error["code"]), (name, error)
    assert raw(url, "GET", "/v1/nowhere")[0] == 404
    assert raw(url, "GET", "/v1/chat/completions")[0] == 405
    assert raw(url, "POST", "/v1/chat/completions", GOOD)[0] == 200  # still serving


def test_a_max_tokens_that_fits_the_context_but_not_beside_the_prompt_runs_until_it_is_full(tiny_server):
    """Editors send a fixed max_tokens (Continue: 4096) whatever the prompt: the answer runs until the
    context is full, as llama.cpp's and Ollama's servers run it, rather than a 400 for every request."""
    url, _ = tiny_server
    reply = client(url).completions.create(model="tiny", prompt=CODE, max_tokens=N_CTX, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == N_CTX


def test_the_openai_client_sees_the_errors_as_its_own_exceptions(tiny_server):
    url, _ = tiny_server
    api = client(url)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        api.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert chat(url, "hi", max_tokens=2).choices[0].message.content is not None


# -- one at a time: the queue, disconnects ----------------------------------------------------


class Paced:
    """A decoder that waits at a gate before it starts, then sleeps a little after each step,
    so that tests can hold the worker busy and catch a generation in the middle."""

    def __init__(self, decoder, gate: threading.Event, step_seconds: float):
        self.decoder, self.gate, self.step_seconds = decoder, gate, step_seconds

    def generate(self, *args, **kwargs):
        assert self.gate.wait(WAIT)
        for event in self.decoder.generate(*args, **kwargs):
            yield event
            if isinstance(event, StepDone):
                time.sleep(self.step_seconds)


@pytest.fixture
def paced_server(tiny_pair):
    engine = tiny_engine(tiny_pair, "ngram")
    gate = threading.Event()
    service = Service(engine, "tiny", queue_size=1, make_decoder=lambda: Paced(engine.decoder(), gate, 0.02))
    try:
        with running(service) as url:
            yield url, service, gate
    finally:
        gate.set()
        engine.close()


def test_a_full_queue_answers_503_and_the_queued_requests_are_served_in_order(paced_server):
    url, service, gate = paced_server
    answers = {}

    def ask(name):
        answers[name] = chat(url, f"request {name}", max_tokens=3).choices[0].message.content

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    until(lambda: service.worker.busy, "the first request to start")
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    until(lambda: service.worker.queued() == 1, "the second request to wait")
    with pytest.raises(openai.InternalServerError) as refused:
        chat(url, "one too many", max_tokens=3)
    assert refused.value.status_code == 503 and "the server is busy: 1 request is already waiting" in str(refused.value)
    assert refused.value.response.headers["retry-after"] == "1"
    gate.set()
    first.join(WAIT)
    second.join(WAIT)
    assert set(answers) == {"first", "second"}
    assert service.worker.served == 2


def waiting(service: Service) -> list:
    """The jobs in the worker's queue, left where they are."""
    with service.worker.jobs.mutex:
        return [job for job in service.worker.jobs.queue if job is not None]


def test_a_request_whose_client_leaves_while_it_waits_is_never_generated_and_frees_its_place(paced_server):
    url, service, gate = paced_server
    first = threading.Thread(target=chat, args=(url, "first"), kwargs={"max_tokens": 3})
    first.start()
    until(lambda: service.worker.busy, "the first request to start")
    host, port = url.removeprefix("http://").split(":")
    leaving = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    leaving.request("POST", "/v1/chat/completions", json.dumps({**GOOD, "stream": True}), {"Content-Type": "application/json"})
    until(lambda: service.worker.queued() == 1, "the second request to wait")
    leaving.close()
    # the server notices the closed connection (a 0.2 s sleep guessed it; on a busy machine, later: a 503)
    until(lambda: all(job.cancelled.is_set() for job in waiting(service)), "the server to notice the client left")
    third = threading.Thread(target=chat, args=(url, "third"), kwargs={"max_tokens": 3})
    third.start()  # the left request's place in the queue (of one) is free again: not a 503
    until(lambda: service.worker.queued() == 1, "the third request to wait")
    gate.set()
    first.join(WAIT)
    third.join(WAIT)
    until(lambda: service.worker.queued() == 0 and not service.worker.busy, "the queue to empty")
    assert service.worker.served == 2
    assert chat(url, "still there?", max_tokens=2).choices[0].message.content is not None


def test_a_client_that_disconnects_mid_stream_stops_its_generation(paced_server):
    url, service, gate = paced_server
    gate.set()
    stream = chat(url, "Tell a long story.", max_tokens=400, stream=True)
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    stream.close()  # the connection goes away
    until(lambda: service.worker.served == 1, "the generation to stop")
    result = service.worker.recent[-1]
    assert result.finish_reason == "interrupted" and result.stats.tokens < 200  # 400 at 0.02 s a step: 8 s
    assert chat(url, "still there?", max_tokens=2).choices[0].message.content is not None


def test_a_client_gone_before_its_body_came_is_answered_not_raised(tiny_server):
    """An editor cancelling while its request is on the way: the app answers (to nobody) rather than
    raising, which uvicorn logged as "Exception in ASGI application" with a traceback."""
    _, service = tiny_server
    arriving = iter([{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(arriving)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    asyncio.run(create_app(service)(scope, receive, send))
    assert sent[0]["status"] == 499 and service.worker.queued() == 0


def test_an_aborted_generation_is_an_error_not_a_finished_answer(paced_server):
    """A second Ctrl-C or SIGTERM aborts the running request: its client is told the answer was cut
    short (streamed: an error event after the text so far), not handed half an answer as finished."""
    url, service, gate = paced_server
    gate.set()
    stream = chat(url, "Tell a long story.", max_tokens=400, stream=True)
    seen = 0
    with pytest.raises(openai.APIError) as cut:
        for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
            if seen == 3:
                service.worker.stop_accepting()
                service.worker.abort()
    assert "cut short" in str(cut.value) and seen >= 3
    assert service.worker.recent[-1].finish_reason == "interrupted"


def test_tokens_past_a_stop_string_are_not_counted(tiny_server):
    """A step can commit a whole accepted draft at once: the tokens it committed after the one that
    completed a stop string are neither sent nor counted in `completion_tokens`."""
    url, _ = tiny_server
    api = client(url)
    prompt = "The quick brown fox jumps over the lazy dog."
    for _ in range(2):  # the second time the n-gram cache drafts the first answer, remembered, in a few steps
        full = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert full.usage.model_extra["speculation"]["steps"] <= 4 < full.usage.completion_tokens
    cut = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[full.choices[0].text[:1]])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == ""  # met at the first token
    assert cut.usage.completion_tokens == 1


def test_a_draft_is_not_verified_past_the_stop_string_that_ends_the_text(tiny_server):
    """The n-gram cache drafts a remembered answer whole; asked again with a stop string in its
    middle, the draft stops at the token that completes it: what would be thrown away is not
    verified. The text is the same answer cut at the stop string."""
    url, _ = tiny_server
    api = client(url)
    prompt = "A stop string in the middle of a remembered answer."
    for _ in range(2):
        full = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert full.usage.model_extra["speculation"]["drafted"] >= 20  # the whole answer, from memory
    stop = next(text[i : i + 2] for i in range(6, len(text) - 8) if text.find(text[i : i + 2]) == i)  # first met there
    cut = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.find(stop)]
    assert cut.usage.model_extra["speculation"]["drafted"] <= cut.usage.completion_tokens + 1


def test_an_editors_list_of_stop_strings_is_read_whole(tiny_server):
    """Continue's autocomplete sends Qwen2.5-Coder's nine special-token texts, and a stop of its own,
    as `stop` (OpenAI allows four: every one of its requests got a 400); the text ends at the first met."""
    url, _ = tiny_server
    api = client(url)
    prompt = "An editor's stop strings."
    text = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    ours = next(text[i : i + 2] for i in range(6, len(text) - 8) if text.find(text[i : i + 2]) == i)
    continues = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"]  # fmt: skip
    cut = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[*continues, ours])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.find(ours)]
    assert raw(url, "POST", "/v1/completions", {"prompt": prompt, "stop": ["x"] * 65})[0] == 400


# -- the command: signals and the exit code ------------------------------------------------------


def test_the_signal_handler_leaves_the_job_queue_to_the_event_loop(tiny_pair):
    """A signal handler runs in the main thread between two of its bytecodes, perhaps while the event
    loop there holds the job queue's lock: it only asks the loop to stop taking work (which drains the
    queue there), and a second signal aborts the running request."""
    engine = tiny_engine(tiny_pair, "ngram")
    sock = listen("127.0.0.1", 0)
    try:
        server = Server(Service(engine, "tiny", queue_size=1), sock)
        asked = []
        server.loop = SimpleNamespace(call_soon_threadsafe=asked.append)
        server._on_signal(signal.SIGINT, None)
        assert server.should_exit and asked == [server.service.worker.stop_accepting]
        assert not server.service.worker.closing.is_set()  # not drained here
        server._on_signal(signal.SIGINT, None)
        assert server.force_exit and server.service.worker.aborting.is_set()
    finally:
        sock.close()
        engine.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_running_request_and_exits_zero(tiny_pair, signum):
    target, draft = tiny_pair
    with serve_process("-m", str(target), "--draft", str(draft), "--spec", "ngram+draft", "-c", str(N_CTX), "-t", "1") as (process, url):
        assert [m.id for m in client(url).models.list()] == [target.stem]
        stream = client(url).chat.completions.create(model=target.stem, messages=[{"role": "user", "content": "Go on."}],
                                                     max_tokens=300, temperature=0, stream=True)  # fmt: skip
        chunks = [next(iter(stream))]
        process.send_signal(signum)
        chunks += list(stream)
        assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert process.wait(WAIT) == 0
        assert "stopped" in process.stderr.read()


def test_what_auto_learned_of_the_costs_is_kept_when_the_server_stops(tiny_pair, tmp_path):
    """The server's requests refine the curve `auto` decides by; stopping keeps it for the next process."""
    options = LoadOptions(n_ctx=N_CTX, n_threads=1)
    probe = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options)
    key = probe._cost_key(32)
    probe.close()
    cache = tmp_path / "cache"  # its own: a made-up calibration must not reach other tests
    calibrated = CostModel({k: 1.0 + 0.1 * k for k in range(1, 33)})
    save_costs(cache / "costs.json", key, calibrated)
    args = ("-m", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--spec", "auto", "-c", str(N_CTX), "-t", "1")
    with serve_process(*args, env={"SPECLLM_CACHE": str(cache)}) as (process, url):
        client(url).chat.completions.create(model=tiny_pair[0].stem, messages=[{"role": "user", "content": "def add(a, b): return a + b"}],
                                            max_tokens=8, temperature=0)  # fmt: skip
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0
    entry = json.loads((cache / "costs.json").read_text("utf-8"))[key]
    assert entry["learned"]["passes"] > 0 and CostModel.from_dict(entry) == calibrated


def test_a_port_in_use_is_one_error_line_before_any_model_loads(tiny_pair, tmp_path):
    """Said at once, not after loading the models (and measuring their costs, minutes): a model
    that is not there is not even looked at."""
    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        results = [subprocess.run([sys.executable, "-m", "specllm", "serve", "-m", str(model), "--spec", "off",
                                   "--port", str(port), "-c", str(N_CTX)], capture_output=True, text=True, timeout=WAIT)
                   for model in (tiny_pair[0], tmp_path / "missing.gguf")]  # fmt: skip
    finally:
        sock.close()
    for result in results:
        assert result.returncode == 1
        assert result.stderr.startswith(f"Error: cannot listen on 127.0.0.1:{port}") and result.stderr.count("\n") == 1


# -- the default pair: the server's text is `specllm run`'s -------------------------------------


@pytest.mark.real
def test_streamed_chat_on_the_default_pair_equals_specllm_run(qwen_pair, qwen_engine):
    """`specllm run` in a real process (the CLI end to end on the default pair) and the server on the
    session's engine (conftest.py: the same pair, context and threads) give the same text."""
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    flags = ["--spec", "ngram+draft", "-c", "1024", "-t", "2", "--temp", "0"]
    target, draft = qwen_pair
    run = subprocess.run([sys.executable, "-m", "specllm", "run", "-m", str(target), "--draft", str(draft), *flags,
                          "-n", "32", "-p", prompt, "--json"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    with running(Service(qwen_engine, "qwen")) as url:
        stream = client(url).chat.completions.create(model="qwen", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=32, temperature=0, stream=True)  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == json.loads(run.stdout)["text"]


@pytest.mark.real
def test_a_completion_with_a_suffix_fills_the_middle_as_plain_decoding_does(qwen_engine):
    """An editor's fill-in-the-middle request (`suffix`): the model's FIM tokens around the code, the
    middle generated losslessly (the text of plain decoding on the same tokens)."""
    prefix = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return "
    suffix = "\n\n\nprint(area(2, 3), perimeter(2, 3))\n"
    target = qwen_engine.target
    pre, suf, mid = target.fim_tokens()
    prompt = [pre] + target.tokenize(prefix) + [suf] + target.tokenize(suffix) + [mid]
    plain = list(qwen_engine.decoder("off").generate(prompt, 16, SamplingParams(temperature=0.0), np.random.default_rng(0)))[-1]
    with running(Service(qwen_engine, "qwen")) as url:
        api = client(url)
        answer = api.completions.create(model="qwen", prompt=prefix, suffix=suffix, max_tokens=16, temperature=0)
        streamed = "".join(c.choices[0].text for c in api.completions.create(model="qwen", prompt=prefix, suffix=suffix, max_tokens=16,
                                                                             temperature=0, stream=True) if c.choices)  # fmt: skip
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].text == streamed == plain.text
    assert "width + height" in answer.choices[0].text and answer.choices[0].finish_reason == "stop"  # the middle, then the end token
