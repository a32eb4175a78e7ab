"""What `serve` shares with `run` and `chat`: `auto`'s draft model lost at its first use, a character
cut by the token limit, a thinking model's answers sent back, and Ctrl-C or SIGTERM with requests in
flight. Servers on 127.0.0.1 only (in-process, or a subprocess killed at teardown); every wait bounded.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal

import numpy as np
import openai
import pytest

from specllm.backend import LoadOptions
from specllm.chat import encode_raw
from specllm.costs_cache import save_costs
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder
from specllm.engine.sampling import SamplingParams
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.fakes import BIG_GPU, Scripted
from tests.fim_helpers import FIM_EDITS
from tests.reply_helpers import FRAKTUR, QWEN3, Forced, text_of
from tests.server_helpers import N_CTX, WAIT, client, raw_body, running, serve_process
from tests.tiny_gguf import write_tiny_gguf

OPTIONS = LoadOptions(n_ctx=N_CTX, n_threads=1)


def health(url: str) -> dict:
    """/health's answer (status, busy, queued)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def wait_for(condition, what: str) -> None:
    """Poll until `condition()` holds (bounded): the order of events, not a sleep's length."""
    import time

    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def events(body: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in body.split("\n\n") if line.startswith("data: {")]


# -- auto's draft model failing to load at its first use ----------------------------------------------


def big_gpu_curve() -> CostModel:
    """BIG_GPU at every size a calibration times (a cached curve without them all is measured again)."""
    sizes = sorted(BIG_GPU.batch_seconds)
    seconds = np.interp(range(1, 33), sizes, [BIG_GPU.batch_seconds[k] for k in sizes])
    return CostModel(dict(zip(range(1, 33), map(float, seconds))), draft_seconds=BIG_GPU.draft_seconds,
                     draft_token_seconds=BIG_GPU.draft_token_seconds)  # fmt: skip


def test_serve_says_once_that_auto_lost_its_draft_model_and_serves_every_request_as_before(tiny_pair, tmp_path):
    """The draft file removed after the start: `auto` drops the model at its first use and goes on.
    `run` and `chat` say so in one line; the server said nothing (a user wondering why `auto` never
    drafts with a model had no clue). Now one line in its log, once for all requests, each of them
    plain decoding's text."""
    draft = tmp_path / "draft.gguf"
    shutil.copyfile(tiny_pair[1], draft)
    probe = Engine(ModelPaths(tiny_pair[0], draft), SpecConfig("auto"), OPTIONS, OPTIONS)
    key = probe._cost_key(32)
    probe.close()
    cache = tmp_path / "cache"  # its own: priced as on a large GPU, `auto` consults the draft model at once
    save_costs(cache / "costs.json", key, big_gpu_curve())
    prompts = ["def add(a, b):\n    return a + b\n", "Hello there", "x = [1, 2, 3]"]
    plain = Engine(ModelPaths(tiny_pair[0]), SpecConfig("off"), OPTIONS, OPTIONS)
    try:
        greedy, expected = SamplingParams(temperature=0.0), []
        for prompt in prompts:
            done = list(plain.decoder().generate(encode_raw(plain.target, prompt), 16, greedy, np.random.default_rng(0)))[-1]
            expected.append(done.text)
    finally:
        plain.close()
    args = ("-m", str(tiny_pair[0]), "--draft", str(draft), "--spec", "auto", "-c", str(N_CTX), "-t", "1")
    with serve_process(*args, env={"SPECLLM_CACHE": str(cache)}) as (process, url):
        draft.unlink()
        api = client(url)
        texts = [api.completions.create(model=tiny_pair[0].stem, prompt=p, max_tokens=16, temperature=0).choices[0].text for p in prompts]
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0
        log = process.stderr.read().splitlines()
    assert texts == expected
    assert len(log) == 2 and log[-1] == "specllm serve: stopped", log
    assert log[0].startswith("warning: the draft model could not be loaded at its first use") and "the file is gone" in log[0]


# -- a character cut by the token limit ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cut_server(tiny_dir):
    """A server whose every answer is FRAKTUR's 8 byte tokens (a model with FIM tokens, for /infill)."""
    model = write_tiny_gguf(tiny_dir / "tiny-fim-cut.gguf", 0, token_edits=FIM_EDITS)
    engine = Engine(ModelPaths(model), SpecConfig("off"), OPTIONS, OPTIONS)
    forced = Forced(engine.target, engine.target.tokenize(FRAKTUR))
    assert len(forced.script) == 8  # a byte a token: 6 tokens cut the second character
    try:
        with running(Service(engine, "tiny", make_decoder=lambda: Decoder(forced))) as url:
            yield url, forced
    finally:
        engine.close()


OPENAI = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}
LLAMA_CPP = {"/completion": {"prompt": "hi"}, "/infill": {"input_prefix": "a = ", "input_suffix": "\n"}}


def streamed_text(path: str, objects: list[dict]) -> str:
    if path == "/v1/chat/completions":
        return "".join(o["choices"][0]["delta"].get("content") or "" for o in objects if o["choices"])
    if path == "/v1/completions":
        return "".join(o["choices"][0]["text"] for o in objects if o["choices"])
    return "".join(o["content"] for o in objects)


@pytest.mark.parametrize("path", [*OPENAI, *LLAMA_CPP])
def test_a_character_cut_by_max_tokens_is_in_no_answer_whole_or_streamed(cut_server, path):
    """6 tokens end inside the second character: every route answers the first alone (no "\\ufffd"),
    streamed as whole, and counts the 6 tokens generated."""
    url, forced = cut_server
    limit = {"max_tokens": 6} if path in OPENAI else {"n_predict": 6}
    body = {**OPENAI.get(path, LLAMA_CPP.get(path)), **limit, "temperature": 0}
    answers = []
    for stream in (False, True):
        forced.rows = 0  # the script from its start
        status, text = raw_body(url, path, {**body, "stream": stream})
        assert status == 200, text
        assert "\ufffd" not in text and "\\ufffd" not in text
        answers.append(text)
    whole, objects = json.loads(answers[0]), events(answers[1])
    if path in OPENAI:
        choice = whole["choices"][0]
        assert (choice.get("text") or choice.get("message", {}).get("content"), choice["finish_reason"]) == ("𝔘", "length")
        assert whole["usage"]["completion_tokens"] == 6 and objects[-1]["usage"]["completion_tokens"] == 6
    else:
        assert (whole["content"], whole["stop_type"], whole["tokens_predicted"]) == ("𝔘", "limit", 6)
        assert objects[-1]["tokens_predicted"] == 6
    assert streamed_text(path, objects) == "𝔘"


# -- a thinking model's answers sent back --------------------------------------------------------------


def test_a_clients_own_reasoning_content_and_a_think_block_in_content_read_as_the_template_reads_them(tiny_dir):
    """The openai client sends the message it was given back as it came (`reasoning_content` beside an
    answer about the tags: the answer whole, the reasoning left out before the last user message, as
    Qwen3's template does); a client that kept the block in the content gets it cut at `</think>`, as
    the template cuts it. The answer's reasoning is what `run --json` gives as `reasoning`."""
    model = write_tiny_gguf(tiny_dir / "tiny-qwen3-shared.gguf", 0, chat_template=QWEN3)
    engine = Engine(ModelPaths(model), SpecConfig("off"), OPTIONS, OPTIONS)
    answer = "Close it with `</think>` then answer."
    decoder = Scripted(["<think>", "\nAbout tags.\n", "</think>", "\n\n", answer])
    try:
        with running(Service(engine, "tiny", make_decoder=lambda: decoder)) as url:
            api, asked = client(url), [{"role": "user", "content": "How do I end a think block?"}]
            reply = api.chat.completions.create(model="tiny", messages=asked).choices[0].message
            assert (reply.content, reply.reasoning_content) == (answer, "About tags.")
            api.chat.completions.create(model="tiny", messages=[*asked, reply, {"role": "user", "content": "And then?"}])
            inline = {"role": "assistant", "content": f"<think>\nAbout tags.\n</think>\n\n{answer}"}
            api.chat.completions.create(model="tiny", messages=[*asked, inline, {"role": "user", "content": "And then?"}])
        sent_back, kept_inline = (text_of(engine, tokens) for tokens in decoder.prompts[1:])
    finally:
        engine.close()
    assert f"assistant\n{answer}\nuser\nAnd then?" in sent_back and "About tags." not in sent_back
    assert "assistant\n` then answer.\nuser\nAnd then?" in kept_inline and "About tags." not in kept_inline


# -- Ctrl-C and SIGTERM with requests in flight --------------------------------------------------------


@pytest.mark.parametrize("signals", [[signal.SIGINT, signal.SIGINT], [signal.SIGTERM, signal.SIGINT]], ids=["ctrl-c twice", "sigterm, ctrl-c"])
def test_a_second_signal_with_requests_in_flight_ends_the_server_cleanly_with_exit_zero(tiny_pair, signals):
    """The second signal aborts the running request (its stream ends with an error event), the
    waiting one gets 503; the process exits 0 with its two lines, no traceback or "Exception ignored"."""
    import threading

    target, draft = tiny_pair
    with serve_process("-m", str(target), "--draft", str(draft), "--spec", "ngram+draft", "-c", str(N_CTX), "-t", "1") as (process, url):
        stream = client(url).chat.completions.create(model=target.stem, messages=[{"role": "user", "content": "Go on."}],
                                                     max_tokens=N_CTX - 64, temperature=0, stream=True)  # fmt: skip
        chunks = iter(stream)
        next(chunks)  # its turn came
        waiting = []
        thread = threading.Thread(target=lambda: waiting.append(raw_body(url, "/v1/completions", {"prompt": "x", "max_tokens": 4})))
        thread.start()
        wait_for(lambda: health(url)["queued"] == 1, "the second request to wait in the queue")
        first, second = signals
        process.send_signal(first)
        wait_for(lambda: waiting, "the waiting request's 503: the first signal taken")  # two at once may arrive as one
        process.send_signal(second)
        with pytest.raises(openai.APIError, match="cut short"):
            list(chunks)
        thread.join(WAIT)
        assert process.wait(WAIT) == 0
        log = process.stderr.read()
    assert waiting and waiting[0][0] == 503
    assert log.splitlines() == ["specllm serve: stopped"], log


def test_a_ctrl_c_dropped_while_the_models_load_stops_serve_before_it_serves(home, tiny_pair, monkeypatch):
    """A Ctrl-C that Python dropped (raised in a finalizer, noted by `main`'s handler) while the models
    loaded: the server started all the same and served until the next signal, which then ended it
    with exit 130 for a Ctrl-C long past. Now it is honoured before anything is served."""
    import threading

    from specllm.cli import common, interrupt
    from tests.cli_helpers import specllm_here

    class Dropping:
        def __del__(self):  # a finalizer: Python prints and drops what a signal raises here
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    real_open = common.open_engine

    def open_and_drop(*args, **kwargs):
        engine = real_open(*args, **kwargs)
        Dropping()
        return engine

    monkeypatch.setattr(common, "open_engine", open_and_drop)
    main = threading.main_thread().ident
    watchdog = threading.Timer(WAIT / 4, lambda: signal.pthread_kill(main, signal.SIGTERM))  # ends a server that did start
    watchdog.start()
    try:
        done = specllm_here(home, "serve", "-m", tiny_pair[0], "--spec", "off", "--port", "0", "-c", str(N_CTX), "-t", "1", timeout=WAIT)
    finally:
        watchdog.cancel()
        interrupt.handled()
    assert done.returncode == 130 and done.stderr.splitlines() == ["Interrupted."], done.stderr
