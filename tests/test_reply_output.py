"""What `run` and `chat` print of a reply: its text on stdout, whole characters only, and a thinking
model's reasoning kept apart (tests/test_reasoning.py has the rest of that).

`Forced` (tests/reply_helpers.py) makes a tiny model (or a fake) write a chosen sequence of tokens
through the real decode loop, so the text is built from token bytes as with a real model: a
character of several tokens can be cut by the token limit.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from specllm.engine.decode import Decoder, Done, TokenCommitted
from specllm.engine.sampling import SamplingParams
from specllm.session import Engine
from tests.cli_helpers import specllm_here
from tests.fakes import FakeBackend
from tests.reply_helpers import FRAKTUR, Forced


class Bytes(FakeBackend):
    """A fake whose tokens stand for the bytes of FRAKTUR, one byte each (token i: byte i)."""

    def token_bytes(self, token: int) -> bytes:
        return FRAKTUR.encode()[token : token + 1]


@pytest.mark.parametrize("limit", range(1, 9))
def test_a_character_cut_by_the_token_limit_is_left_out_not_written_as_a_replacement(limit):
    """`-n` ending the text inside a character of several tokens: the rest of it never comes, so
    none of it is text (it was one "\\ufffd" at the end of stdout, `--json`'s text and the server's)."""
    target = Forced(Bytes(n_vocab=8), list(range(8)))
    events = list(Decoder(target).generate([0, 1], limit, SamplingParams(temperature=0.0), np.random.default_rng(0)))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length" and len(done.tokens) == limit
    whole = FRAKTUR[: limit // 4]
    assert done.text == whole
    assert "".join(e.text for e in events if isinstance(e, TokenCommitted)) == whole


@pytest.fixture
def forced(monkeypatch, tiny_pair):
    """Every decoder of an Engine writes what `forced.script` holds (token ids of the tiny model)."""

    class Script:
        tokens: list[int] = []

    script = Script()
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: Decoder(Forced(self.target, script.tokens)))
    return script


def tiny_tokens(model, text: str) -> list[int]:
    from specllm.backend import LlamaBackend, LoadOptions

    backend = LlamaBackend(model, LoadOptions(n_ctx=64, n_threads=1, n_gpu_layers=0))
    try:
        return backend.tokenize(text)
    finally:
        backend.close()


def test_run_and_chat_write_no_replacement_character_for_a_character_the_limit_cut(tiny_pair, forced):
    forced.tokens = tiny_tokens(tiny_pair[0], FRAKTUR)
    assert len(forced.tokens) == 8  # a byte a token: -n 6 cuts the second character
    env = dict(os.environ)
    done = specllm_here(env, "run", "-m", tiny_pair[0], "--spec", "off", "-p", "hi", "-n", "6")
    assert (done.returncode, done.stdout) == (0, "𝔘\n"), done.stderr
    data = json.loads(specllm_here(env, "run", "-m", tiny_pair[0], "--spec", "off", "-p", "hi", "-n", "6", "--json").stdout)
    assert (data["text"], data["finish_reason"], len(data["tokens"])) == ("𝔘", "length", 6)
    chat = specllm_here(env, "chat", "-m", tiny_pair[0], "--spec", "off", "-n", "6", stdin=b"hi\n")
    assert (chat.returncode, chat.stdout) == (0, "𝔘\n"), chat.stderr


# -- a thinking model's answers in a chat's history ---------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tiny_dir):
    from tests.reply_helpers import QWEN3
    from tests.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tiny_dir / "tiny-qwen3-output.gguf", 0, chat_template=QWEN3)


def prompt_text(model, tokens) -> str:
    """A prompt's text as the model reads it, control tokens (<|im_start|>) left out."""
    from specllm.backend import LlamaBackend, LoadOptions

    backend = LlamaBackend(model, LoadOptions(n_ctx=64, n_threads=1, n_gpu_layers=0))
    try:
        return b"".join(backend.token_bytes(t) for t in tokens).decode("utf-8", "replace")
    finally:
        backend.close()


def test_a_chat_sends_back_an_answer_about_the_think_tags_whole(thinker, monkeypatch):
    """An answer that explains the tags (`</think>` in code) is the answer, told apart from the
    reasoning as it came: the next turn sends it whole, not cut after its `</think>` as a reply
    still holding its reasoning block would be (it went as " then answer.")."""
    from tests.fakes import Scripted

    answer = "Close it with `</think>` then answer."
    decoder = Scripted(["<think>", "\nAbout tags.\n", "</think>", "\n\n", answer])
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: decoder)
    done = specllm_here(dict(os.environ), "chat", "-m", thinker, "--spec", "off", stdin=b"How do I end a think block?\nAnd then?\n")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == (f"{answer}\n" * 2, "About tags.\n" * 2)
    second = prompt_text(thinker, decoder.prompts[1])
    assert f"assistant\n{answer}\nuser\nAnd then?" in second and "About tags." not in second


def test_run_json_has_a_reasoning_field_whatever_the_model(tiny_pair, thinker, monkeypatch):
    """One schema for every model: `reasoning` is null where the model does not think (it was
    missing, so `data["reasoning"]` failed on one model and worked on the next)."""
    from tests.fakes import Scripted

    decoder = Scripted(["<think>", "x", "</think>", "4"])
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: decoder)
    env = dict(os.environ)
    plain = json.loads(specllm_here(env, "run", "-m", tiny_pair[0], "--spec", "off", "-p", "2+2?", "--json").stdout)
    assert (plain["text"], plain["reasoning"]) == ("<think>x</think>4", None)
    thinking = json.loads(specllm_here(env, "run", "-m", thinker, "--spec", "off", "-p", "2+2?", "--json").stdout)
    assert (thinking["text"], thinking["reasoning"]) == ("4", "x")
    assert list(plain) == list(thinking)
    decoder.script = ["4"]
    off = json.loads(specllm_here(env, "run", "-m", thinker, "--spec", "off", "-p", "2+2?", "--json", "--no-think").stdout)
    assert (off["text"], off["reasoning"]) == ("4", "")


@pytest.mark.parametrize("script, how", [(["<think>", "\nStill", " going"], "while still reasoning"),
                                         (["<think>", "\nDone.", "</think>", "\n\n"], "after its reasoning")])  # fmt: skip
def test_run_says_when_the_model_ended_its_reply_with_reasoning_and_no_answer(thinker, monkeypatch, script, how):
    """The model's own end token inside its thinking block (or right after it): stdout, a file
    perhaps, is empty with exit 0; one line on stderr says why (a token limit there already did)."""
    from tests.fakes import Scripted

    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: Scripted(script))
    done = specllm_here(dict(os.environ), "run", "-m", thinker, "--spec", "off", "-p", "2+2?")
    assert (done.returncode, done.stdout) == (0, "")
    assert done.stderr.splitlines()[-1] == f"warning: the model ended its reply {how}, with no answer"
    quiet = specllm_here(dict(os.environ), "run", "-m", thinker, "--spec", "off", "-p", "2+2?", "-q")
    assert "warning" not in quiet.stderr
    chat = specllm_here(dict(os.environ), "chat", "-m", thinker, "--spec", "off", stdin=b"2+2?\n")
    assert (chat.returncode, chat.stdout) == (0, "")
    assert chat.stderr.splitlines()[-1] == "(the model ended its reply with reasoning and no answer)"


def test_an_answer_sent_with_its_own_reasoning_content_keeps_its_whole_text():
    """What a chat keeps, or a client that reads `reasoning_content` sends back: told apart already,
    so nothing is cut at a `</think>` inside the answer; a reply still holding its block is split."""
    from specllm.chat import reasoning_apart

    answer = "Close it with `</think>`."
    apart = [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer, "reasoning_content": "Tags."},
             {"role": "user", "content": "ok"}]  # fmt: skip
    assert reasoning_apart(apart) == apart
    inline = [apart[0], {"role": "assistant", "content": f"<think>\nTags.\n</think>\n\n{answer}"}, apart[2]]
    assert reasoning_apart(inline)[1] == {"role": "assistant", "content": "`."}  # as the template cuts it: at the last </think>
