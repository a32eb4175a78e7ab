"""`specllm chat` as a daily user meets it: pasted code, /spec's answers. On a FakeEngine, no model."""

from __future__ import annotations

import io

import pytest

from specllm.chat import ChatSettings, Conversation, MultiLine
from specllm.cli.chat_loop import ChatLoop
from specllm.engine.sampling import SamplingParams
from tests.fakes import PASS_FAILURE as FAILURE
from tests.fakes import FakeEngine, fail_generations, reader, reference_reply

MODULE = '"""Tools for strings."""\n\ndef rev(s):\n    return s[::-1]'


def terminal_loop(strategy="ngram", **kwargs):
    out = io.StringIO()
    settings = ChatSettings(SamplingParams(temperature=0.0), 5)
    return ChatLoop(FakeEngine(**kwargs), Conversation(), settings, strategy, out=out, interactive=True), out


def test_a_pasted_file_that_opens_with_a_docstring_is_one_message(capsys):
    """A Python module pasted at the prompt (one line holding its newlines, as readline hands over a
    bracketed paste) began with `\"\"\"`: it opened a multi-line block, the prompt became `... `, and
    the next command typed (`/stats`) went into the message instead of running."""
    loop, out = terminal_loop()
    loop.run(reader([MODULE, "/stats"]))
    assert [m["content"] for m in loop.conversation.messages][:1] == [MODULE]
    assert len(loop.conversation.messages) == 2 and not loop.block.open
    assert out.getvalue() == reference_reply([{"role": "user", "content": MODULE}], 5) + "\n"
    assert "1 replies" in capsys.readouterr().err  # /stats ran as a command


@pytest.mark.parametrize("paste", ['"""\nline one\nline two\n"""', '  """line one\nline two"""  '])
def test_a_pasted_block_between_quotes_is_still_its_inside(paste):
    loop, _ = terminal_loop()
    loop.run(reader([paste]))
    assert loop.conversation.messages[0]["content"] == "line one\nline two"


def test_wraps_tells_a_whole_block_from_a_docstring_at_the_start():
    assert MultiLine.wraps('"""\nx\n"""') and MultiLine.wraps('""""""')
    assert not MultiLine.wraps(MODULE) and not MultiLine.wraps('"""') and not MultiLine.wraps('""""')


def test_spec_draft_in_a_chat_started_without_one_names_the_option_that_loads_it(capsys):
    """`--spec ngram` (or off) loads no draft model even for a preset that has one: the answer told a
    user of the default preset to start with "a preset that has one", which they had done."""
    loop, _ = terminal_loop("ngram")
    loop.run(reader(["/spec draft"]))
    err = capsys.readouterr().err
    assert "a chat started with --spec ngram loads none; start it with --spec draft|ngram+draft|auto" in err
    assert "Speculation stays ngram." in err and loop.strategy == "ngram"


def test_spec_draft_in_a_chat_that_loads_one_but_has_none_names_the_draft_option(capsys):
    loop, _ = terminal_loop("auto")
    loop.run(reader(["/spec draft"]))
    assert "start the chat with --draft PATH or a preset that has one" in capsys.readouterr().err


@pytest.fixture
def first_reply_fails(monkeypatch):
    """The first generation fails once three tokens have come; later ones do not."""
    fail_generations(monkeypatch, after=3, first_only=True)


def test_a_reply_that_fails_midway_keeps_its_text_and_the_chat_goes_on(first_reply_fails, capsys):
    """A target pass failing mid-reply (llama.cpp out of memory) ended the whole chat: now what came is
    shown and kept, as after a Ctrl-C, one note says why, and the next message is answered by a fresh
    decoder (the failed pass may have left the KV caches short of the history)."""
    loop, out = terminal_loop()
    loop.run(reader(["Hello", "Again"]))
    partial = reference_reply([{"role": "user", "content": "Hello"}], 3)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": partial}]
    assert [m["content"] for m in loop.conversation.messages] == ["Hello", partial, "Again", reference_reply([*messages, {"role": "user", "content": "Again"}], 5)]
    assert out.getvalue().startswith(partial + "\n")
    assert f"(the reply failed: {FAILURE}; the partial reply is kept;" in capsys.readouterr().err
    assert len(loop.engine.strategies) == 2 and loop.failure is None


def test_a_reply_that_fails_before_its_first_token_is_not_kept(monkeypatch, capsys):
    fail_generations(monkeypatch, after=0, first_only=True)
    loop, out = terminal_loop()
    loop.run(reader(["Hello", "Again"]))
    assert [m["content"] for m in loop.conversation.messages][0] == "Again" and len(loop.conversation.messages) == 2
    assert f"(the reply failed: {FAILURE}; the message was not kept;" in capsys.readouterr().err


def test_a_script_ends_at_a_failed_reply_after_its_text(first_reply_fails):
    """As `run` does: the text so far, its line ended, then the error (main: one line, exit 1)."""
    from specllm.errors import SpecllmError

    out = io.StringIO()
    loop = ChatLoop(FakeEngine(), Conversation(), ChatSettings(SamplingParams(temperature=0.0), 5), "ngram", out=out)
    with pytest.raises(SpecllmError, match="failed to evaluate"):
        loop.run(reader(["Hello", "Again"]))
    assert out.getvalue() == reference_reply([{"role": "user", "content": "Hello"}], 3) + "\n"
