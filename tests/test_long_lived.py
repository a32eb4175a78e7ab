"""What a long-lived decoder keeps: a server's one drafter over thousands of requests, a chat of
many turns. Everything it holds must stay bounded however many generations it serves, and what it
learns must keep following the text it serves now (fake models: hundreds of requests in seconds)."""

from __future__ import annotations

import numpy as np
import pytest

from specllm.engine import auto, decode, drafters, estimates
from specllm.engine.auto import auto_drafter
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder, all_the_room
from specllm.engine.drafters import MEMORY_TOKENS, ModelDrafter
from specllm.engine.estimates import Beta
from specllm.engine.sampling import SamplingParams
from tests.fakes import FakeBackend

VOCAB, N_CTX = 64, 2048
WEIGHT_CAP = getattr(estimates, "WEIGHT_CAP", 8192)  # the most outcomes an estimate weighs


def test_an_estimate_in_use_for_long_weighs_a_bounded_number_of_outcomes():
    """Every outcome used to count forever: after a day of an editor's requests the busiest estimate
    weighed 20,000 of them (3,000 requests)."""
    estimate = Beta.prior(0.5)
    for _ in range(3 * WEIGHT_CAP):
        estimate.observe(1, False)
    assert estimate.accepted + estimate.rejected == pytest.approx(WEIGHT_CAP)
    assert estimate.mean > 0.999


def test_a_long_lived_estimate_follows_the_text_it_serves_now():
    """A server that drafted well-copied text all morning (20,000 accepted tokens) and then serves
    text where the copies fail (6,000 rejected) must see that: counted forever, the estimate still
    said 0.77 and the policy kept drafting."""
    estimate = Beta.prior(0.5)
    for _ in range(20_000):
        estimate.observe(1, False)
    for _ in range(6_000):
        estimate.observe(0, True)
    assert estimate.mean < 0.6


def test_an_estimate_under_the_cap_counts_every_outcome():
    """Below the cap (every generation of ordinary length) nothing changes: the counts are exact."""
    estimate = Beta.prior(0.25)
    for i in range(1000):
        estimate.observe(i % 3 == 0, i % 3 != 0)
    assert (estimate.accepted, estimate.rejected) == (0.5 + 334, 1.5 + 666)


def _server(clock_patch, with_draft: bool):
    """One auto decoder as `serve` keeps it, on fake models priced by a virtual clock."""
    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    for module in (decode, auto, drafters):
        clock_patch.setattr(module, "time", clock)
    price = lambda k: 0.02 + 0.001 * k  # noqa: E731
    target = FakeBackend(n_vocab=VOCAB, n_ctx=N_CTX, clock=clock, pass_seconds=price, sharpness=4.0)
    costs = CostModel({k: price(k) for k in range(1, 33)}, draft_seconds=0.004, depth=256, context_seconds=1e-7, draft_token_seconds=0.0003)
    model = None
    if with_draft:
        draft = FakeBackend(n_vocab=VOCAB, n_ctx=N_CTX, clock=clock, pass_seconds=lambda k: 0.004 + 0.0003 * k, sharpness=4.0)
        model = ModelDrafter(draft, 0.6, VOCAB)
    drafter = auto_drafter(costs, 31, (2, 4), model)
    return Decoder(target, drafter, all_the_room), drafter


def _estimates(drafter) -> list[Beta]:
    policy = drafter.policy
    ngram = policy.ngram_estimates
    return [*ngram.first.values(), *ngram.continuation.values(), ngram.after_sentence, ngram.first_pool,
            policy.draft_acceptance, *policy.confidence]  # fmt: skip


def test_a_servers_drafter_keeps_bounded_state_over_many_requests(monkeypatch):
    """An editor's requests (the code around a moving cursor, each a new prompt that abandons the
    last one's tail and answer) and chat turns, through one decoder: the n-gram cache holds the
    history and at most twice MEMORY_TOKENS of earlier text, its indexes at most (n_max - n_min + 1)
    entries a token, the learned estimates a bounded number of keys, each weighing at most the cap
    (lowered here so that a few hundred requests reach it)."""
    monkeypatch.setattr(estimates, "WEIGHT_CAP", 64, raising=False)
    decoder, drafter = _server(monkeypatch, with_draft=True)
    rng = np.random.default_rng(0)
    source = rng.integers(0, VOCAB, size=1500).tolist()
    for i in range(240):
        if i % 3:  # an editor's /infill: prefix, a marker, suffix
            cursor = 100 + (i * 37) % 1000
            prompt = source[:cursor] + [VOCAB - 1] + source[cursor : cursor + 200]
        else:  # a chat request of its own
            prompt = rng.integers(0, VOCAB, size=120).tolist()
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8)
        for _ in decoder.generate(prompt, 24, params, np.random.default_rng(i)):
            pass
        ngram = drafter.ngram
        assert len(ngram.cache) == len(decoder.history) <= N_CTX
        assert len(ngram.memory) <= 2 * MEMORY_TOKENS
        for cache in (ngram.cache, ngram.memory):
            assert len(cache._index) <= 3 * len(cache)
            assert all(len(entry[0]) <= 8 for entry in cache._index.values())
    learned = drafter.policy.ngram_estimates
    assert len(learned.first) <= 4 * 8 * 2 and len(learned.continuation) <= 3 * 4  # kinds x span buckets x last_full; groups x depths
    weights = [b.accepted + b.rejected for b in _estimates(drafter)]
    assert max(weights) == pytest.approx(64)  # at most the cap, and the busiest reached it: the test exercised it


class _Readline:
    """readline as input() uses it: every line typed joins the in-memory history."""

    def __init__(self):
        self.history: list[str] = []

    def get_current_history_length(self) -> int:
        return len(self.history)

    def remove_history_item(self, pos: int) -> None:
        del self.history[pos]


def test_a_long_chat_at_a_terminal_keeps_a_bounded_line_history(monkeypatch):
    """readline keeps every line typed for the up arrow; a chat of thousands of lines (each line of a
    pasted block is one) kept them all for the session's life. The latest ones stay, in order."""
    import builtins
    import sys

    from specllm.cli import chat_loop

    fake = _Readline()
    typed = iter(range(10**6))

    def typing(prompt: str = "") -> str:  # noqa: ARG001
        line = f"line {next(typed)}"
        fake.history.append(line)
        return line

    monkeypatch.setitem(sys.modules, "readline", fake)
    monkeypatch.setattr(builtins, "input", typing)
    read = chat_loop.terminal_reader()
    lines = [read(">>> ") for _ in range(3000)]
    assert lines[-1] == "line 2999"
    assert 100 <= len(fake.history) <= 2000
    assert fake.history == lines[-len(fake.history) :]


def test_clients_that_leave_mid_stream_are_noticed_and_leave_no_log_lines():
    """A streamed answer whose client goes away (an editor's cancel, a chat's stop button): while
    the worker's pieces waited in the queue the stream wrote them without ever letting the loop
    run, so the disconnect went unseen until the queue ran dry (generations ran on, some to their
    end), and every write after the fifth logged "socket.send() raised exception." (5,377 lines for
    10 such clients)."""
    import json
    import logging
    import socket
    import types

    from specllm.server.app import Service
    from tests.fakes import Scripted
    from tests.server_helpers import running, until

    pieces = 20_000
    target = types.SimpleNamespace(path=types.SimpleNamespace(name="fake.gguf", stem="fake"), n_ctx=4096, n_vocab=300,
                                   tokenize=lambda text, add_special=False, parse_special=False: [100 + ord(c) % 100 for c in text])  # fmt: skip
    engine = types.SimpleNamespace(target=target, spec=types.SimpleNamespace(strategy="off"))
    service = Service(engine, "fake", make_decoder=lambda: Scripted(["word "] * pieces))
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    body = json.dumps({"prompt": "hello", "max_tokens": 100, "stream": True}).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    logging.getLogger("asyncio").addHandler(handler)
    try:
        with running(service) as url:
            host, port = url.removeprefix("http://").split(":")
            for served in range(1, 4):
                with socket.create_connection((host, int(port)), timeout=60) as sock:
                    sock.sendall(request + body)
                    assert sock.recv(100)  # the answer has begun
                until(lambda: service.worker.served == served, "the generation to end")
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert [r.finish_reason for r in service.worker.recent] == ["interrupted"] * 3
    assert not [line for line in logged if "socket.send" in line]
