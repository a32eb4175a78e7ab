"""The reply loop `run` and `chat` share (`specllm.cli.display.stream_reply`): a decoder's events to
the writers, the answer to stdout, a thinking model's reasoning to stderr, every event to each reducer."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from specllm.cli.display import LiveStatus, ReasoningWriter, ReplyWriter, TokenWriter, colour_allowed, stream_reply, use_colour
from specllm.engine.stats import Stats
from specllm.reasoning import ThinkSplitter
from tests.fakes import Scripted

SCRIPT = ["<think>", "\nhm,", " four", "</think>", "\n\nIt is", " 4."]


def streamed(shown: bool = True):
    """Play SCRIPT through stream_reply: (the reply, what stdout and stderr got, the Done, the turn's and the session's Stats)."""
    out, err, live = io.StringIO(), io.StringIO(), LiveStatus(False)
    reply = ReplyWriter(ThinkSplitter(), TokenWriter(out), ReasoningWriter(live, err), shown=shown)
    stats, session = Stats(), Stats()
    done = stream_reply(Scripted(SCRIPT).generate([1, 2], 10, None, None), reply, live, stats, session)
    reply.finish()
    return reply, out.getvalue(), err.getvalue(), done, stats, session


def test_the_answer_goes_to_its_writer_the_reasoning_apart_and_every_reducer_sees_every_event():
    reply, out, err, done, stats, session = streamed()
    assert out == "It is 4." and err == "hm, four\n"  # the reasoning's last line ended before the answer
    assert "".join(reply.written) == "It is 4." == "".join(reply.splitter.content)
    assert done.finish_reason == "stop" and done.text == "".join(SCRIPT)
    assert stats.tokens == session.tokens == len(SCRIPT) and stats.prompt_tokens == session.prompt_tokens == 2


def test_a_reply_not_shown_is_split_and_written_nowhere():
    """`run --json`: the text is in the JSON object, so none of it is written."""
    reply, out, err, done, stats, _ = streamed(shown=False)
    assert out == err == "" and reply.written == []
    assert "".join(reply.splitter.content) == "It is 4." and "".join(reply.splitter.reasoning) == "hm, four"
    assert done.finish_reason == "stop" and stats.tokens == len(SCRIPT)


@pytest.mark.parametrize("value, colour", [(None, True), ("", True), ("1", False)], ids=["unset", "empty", "set"])
def test_no_color_turns_colour_off_only_when_set_to_something(monkeypatch, value, colour):
    """no-color.org (and rich, which draws the live line) read an empty NO_COLOR as unset: it turned
    colours off here and not in rich."""
    terminal = SimpleNamespace(isatty=lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    if value is not None:
        monkeypatch.setenv("NO_COLOR", value)
    assert colour_allowed(terminal) == colour and use_colour("auto", terminal) == colour
