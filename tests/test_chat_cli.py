"""`specllm chat` transcripts: scripted input through the runner, the loop at a (pretend) terminal, a real model.

stdout must carry the replies and nothing else; notes and command output go to stderr.
"""

from __future__ import annotations

import io
import os
import re
import signal

import numpy as np
import pytest
from typer.testing import CliRunner

from specllm.chat import ChatSettings, Conversation, encode_messages
from specllm.cli import app
from specllm.cli import common as c
from specllm.cli.chat_loop import ChatLoop, leave_hint
from specllm.engine.sampling import SamplingParams
from specllm.errors import UsageError
from tests.fakes import FakeEngine, reader, reference_reply

GREEDY_FLAGS = ["--temp", "0", "-n", "6"]


@pytest.fixture
def engines(monkeypatch):
    """Patch model loading: each `chat` invocation gets a FakeEngine built from `engines.options`."""

    class Factory:
        options: dict = {}
        made: list = []

        def __call__(self, *args, **kwargs):
            engine = FakeEngine(**self.options)
            self.made.append(engine)
            return engine

    factory = Factory()
    monkeypatch.setattr(c, "open_engine", factory)
    return factory


def chat(lines, *flags):
    stdin = "".join(line + "\n" for line in lines)
    return CliRunner().invoke(app, ["chat", "-m", "fake", *flags], input=stdin)


def user(*texts):
    return [{"role": "user", "content": t} for t in texts]


def history(*pairs):
    messages = []
    for question, answer in pairs:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


# -- scripted transcripts ----------------------------------------------------------------


def test_script_of_turns_and_commands_puts_only_replies_on_stdout(engines):
    result = chat(["hello", "", "/set temp abc", "/set", "/frobnicate", "/help", "/stats", "and more"], *GREEDY_FLAGS)
    assert result.exit_code == 0, result.output
    first = reference_reply(user("hello"), 6)
    second = reference_reply(history(("hello", first)) + user("and more"), 6)
    assert result.stdout == f"{first}\n{second}\n"
    assert "temp must be a number, got 'abc'" in result.stderr
    assert result.stderr.count("temp 0 ·") >= 2  # the refused /set left temp at 0, as /set then shows
    assert "Unknown command /frobnicate. Commands: /help /stats /set /spec /clear /bye" in result.stderr
    assert "/spec" in result.stderr and "/clear" in result.stderr
    assert "1 replies" in result.stderr  # /stats after the first turn
    assert ">>>" not in result.stdout + result.stderr  # no prompts when stdin is not a terminal


def test_turn_two_reuses_the_kv_cache_of_turn_one(engines):
    result = chat(["hello", "and more"], *GREEDY_FLAGS, "--verbose")
    assert result.exit_code == 0, result.output
    summaries = [line for line in result.stderr.splitlines() if line.startswith("prompt ")]
    assert len(summaries) == 2 and "reused" not in summaries[0]
    reused = int(re.search(r"\((\d+) reused\)", summaries[1]).group(1))
    prompt1 = int(re.match(r"prompt (\d+) tok", summaries[0]).group(1))
    assert reused == prompt1 + 6 - 1  # the first prompt and its reply, all but the last token
    assert len(engines.made) == 1 and engines.made[0].strategies == ["auto"]  # one decoder for the session


def test_summaries_only_when_asked_or_at_a_terminal(engines):
    quiet = chat(["hello"], *GREEDY_FLAGS)
    assert "tok/pass" not in quiet.stderr
    verbose = chat(["hello"], *GREEDY_FLAGS, "-v")
    assert "tok/pass" in verbose.stderr and "tok/pass" not in verbose.stdout


def test_a_byte_order_mark_before_a_scripts_first_command_leaves_it_a_command(engines):
    result = chat(["\ufeff/set max_tokens 3", "hello"], "--temp", "0")  # a script saved by Notepad or PowerShell
    assert result.exit_code == 0, result.output
    assert "Now temp 0" in result.stderr and "max_tokens 3" in result.stderr
    assert result.stdout == reference_reply(user("hello"), 3) + "\n"  # the only message, cut at 3 tokens


def test_multi_line_block_is_one_message(engines):
    result = chat(['"""', "def f():", "    return 1", '"""', '"""one line"""'], *GREEDY_FLAGS)
    assert result.exit_code == 0, result.output
    first = reference_reply(user("def f():\n    return 1"), 6)
    second = reference_reply(history(("def f():\n    return 1", first)) + user("one line"), 6)
    assert result.stdout == f"{first}\n{second}\n"


def test_unterminated_block_at_end_of_input_is_not_sent(engines):
    result = chat(["hi", '"""', "half a message"], *GREEDY_FLAGS)
    assert str(result.exception) == "1 message(s) of the script were not sent (said above)"  # exit 1, the replies out
    assert result.stdout == reference_reply(user("hi"), 6) + "\n"
    assert '"""' in result.stderr and "not sent" in result.stderr


def test_bye_ends_the_session(engines):
    result = chat(["hi", "/bye", "never sent"], *GREEDY_FLAGS)
    assert result.exit_code == 0
    assert result.stdout == reference_reply(user("hi"), 6) + "\n"
    assert engines.made[0].kept == 1  # what auto learned of the costs goes to the cache as the chat ends


def test_clear_starts_a_new_conversation(engines):
    result = chat(["hi", "/clear", "again"], *GREEDY_FLAGS, "--system", "terse")
    system = [{"role": "system", "content": "terse"}]
    assert result.stdout.splitlines()[1] == reference_reply(system + user("again"), 6)
    assert "New conversation." in result.stderr


def test_spec_switches_decoder_and_refuses_a_missing_draft(engines):
    result = chat(["hi", "/spec draft", "/spec off", "/spec", "/spec bogus", "again"], *GREEDY_FLAGS, "--spec", "ngram")
    assert result.exit_code == 0, result.output
    assert "No draft model is loaded" in result.stderr
    assert "Speculation: off." in result.stderr and "No strategy 'bogus'. Speculation: off. Change it with /spec" in result.stderr
    assert engines.made[0].strategies == ["ngram", "off"]
    first = reference_reply(user("hi"), 6)
    # the new decoder starts from an empty cache and reads the whole conversation; the output is the same
    assert result.stdout == f"{first}\n{reference_reply(history(('hi', first)) + user('again'), 6)}\n"


def test_spec_reads_a_strategy_in_any_case_as_set_reads_its_names(engines):
    result = chat(["/spec OFF", "/spec Ngram", "hi"], *GREEDY_FLAGS, "--spec", "auto")
    assert result.exit_code == 0, result.output
    assert "No strategy" not in result.stderr
    assert engines.made[0].strategies == ["auto", "off", "ngram"]


def test_set_changes_the_next_reply(engines):
    result = chat(["/set max_tokens 3", "hi"], *GREEDY_FLAGS)
    assert result.stdout == reference_reply(user("hi"), 3) + "\n"
    assert "max_tokens 3" in result.stderr and "reached max_tokens 3" in result.stderr


def test_setting_the_seed_again_gives_the_same_sampled_reply_again(engines):
    """`/set seed 5` starts seed 5's draws afresh, as `--seed 5` does, even where the seed was 5 already."""
    result = chat(["/set seed 5", "hi", "/clear", "/set seed 5", "hi", "/clear", "hi"], "--temp", "1.5", "-n", "12")
    first, again, then = result.stdout.splitlines()
    assert first == again != then
    assert chat(["hi"], "--temp", "1.5", "-n", "12", "--seed", "5").stdout.splitlines() == [first]


def test_reply_ending_on_its_own_says_nothing_more(engines):
    engines.options = {"eog": 2}
    result = chat(["hi"], "--temp", "0", "-n", "100")
    reply = reference_reply(user("hi"), 100, eog=2)
    assert result.stdout == reply + "\n" and len(reply) < 100
    assert result.stderr == ""


# -- a full context ----------------------------------------------------------------------


def test_message_longer_than_the_context_is_refused_and_conversation_unchanged(engines):
    engines.options = {"n_ctx": 64}
    result = chat(["hi", "x" * 80, "ok"], *GREEDY_FLAGS)
    assert str(result.exception) == "1 message(s) of the script were not sent (said above)"  # a script learns it: exit 1
    assert re.search(r"Message not sent: the conversation would need \d+ tokens \(\d+ so far \+ \d+ for this message\) "
                     r"and the context holds 64", result.stderr)
    first = reference_reply(user("hi"), 6, n_ctx=64)
    assert result.stdout == f"{first}\n{reference_reply(history(('hi', first)) + user('ok'), 6, n_ctx=64)}\n"


def test_a_system_prompt_that_leaves_no_room_is_refused_at_the_start(engines):
    engines.options = {"n_ctx": 64}
    result = chat(["hi"], *GREEDY_FLAGS, "--system", "x" * 80)
    assert isinstance(result.exception, UsageError) and result.stdout == ""  # the command line's entry point: one line, exit 2
    assert re.fullmatch(r"the system prompt alone takes \d+ tokens and the context holds 64: shorten it or raise --ctx-size", str(result.exception))
    # one that leaves a little room refuses a longer message without pointing at /clear, which keeps it
    result = chat(["a longer message than fits", "hi"], *GREEDY_FLAGS, "--system", "x" * 30)
    assert result.exit_code == 1 and "A shorter message or --ctx-size makes room." in result.stderr and "/clear" not in result.stderr


def test_reply_that_fills_the_context_is_kept_and_said(engines):
    engines.options = {"n_ctx": 40}
    result = chat(["hello", "next"], "--temp", "0", "-n", "100")
    assert result.exit_code == 1 and str(result.exception) == "1 message(s) of the script were not sent (said above)"
    reply = reference_reply(user("hello"), 100, n_ctx=40)
    assert result.stdout == reply + "\n" and 0 < len(reply) < 100
    assert "the context is full at 40 tokens: the reply was cut short and kept; /clear starts a new conversation" in result.stderr
    # the next message no longer fits, and the conversation alone takes more than the context: said so, not "42 so far"
    assert re.search(r"Message not sent: the conversation already takes 4\d tokens, all of the 40-token context "
                     r"\(the last reply filled it\)\. /clear starts a new conversation", result.stderr)
    assert "so far" not in result.stderr


def stats_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if " replies · " in line)


def test_stats_after_a_reply_that_filled_the_context_says_no_message_fits(engines):
    """Re-encoded with its turn's end, a conversation cut at a full context takes more tokens than
    the context holds: /stats says no message fits, not "42 of 40"; the next message is refused."""
    engines.options = {"n_ctx": 40}
    result = chat(["hello", "/stats", "next"], "--temp", "0", "-n", "100")
    assert result.exit_code == 1 and "Message not sent" in result.stderr
    no_room = "the conversation leaves no room in the 40-token context: the next message will not fit (/clear starts a new conversation)"
    assert stats_line(result.stderr) == f"1 replies · {no_room} · spec auto"
    # a system prompt that leaves no room for a message: /clear would keep it
    engines.options = {"n_ctx": 64}
    result = chat(["/stats"], "--system", "x" * 36)
    assert stats_line(result.stderr).endswith("the next message will not fit (--ctx-size gives a larger context) · spec auto")


@pytest.mark.parametrize("max_tokens, sent", [(20, True), (21, False)])
def test_stats_says_no_room_exactly_when_a_one_character_message_would_be_refused(engines, max_tokens, sent):
    """With n_ctx 64 the prompt after "hello" and a reply of 20 tokens leaves room for the message "x"
    (63 tokens < 64); after 21 it does not, though the conversation takes only 45 tokens."""
    engines.options = {"n_ctx": 64}
    result = chat(["hello", "/stats", "x"], "--temp", "0", "-n", str(max_tokens))
    assert ("Message not sent" not in result.stderr) == sent and result.exit_code == (0 if sent else 1)
    line = stats_line(result.stderr)
    assert (f"conversation {24 + max_tokens} of 64 context tokens" in line) == sent
    assert ("the next message will not fit" in line) == (not sent)


# -- the loop at a terminal: Ctrl-C --------------------------------------------------------


def terminal_loop(engine, **kwargs):
    out = io.StringIO()
    settings = ChatSettings(SamplingParams(temperature=0.0), kwargs.pop("max_tokens", 40))
    loop = ChatLoop(engine, Conversation(), settings, "ngram", out=out, interactive=True, **kwargs)
    return loop, out


def test_ctrl_c_mid_reply_keeps_the_partial_reply_and_the_next_turn_is_exact(capsys):
    engine = FakeEngine(interrupt_at=4)  # prefill, then SIGINT after the third verify pass
    loop, out = terminal_loop(engine)
    loop.run(reader(["write code", "continue"]))
    partial, second = out.getvalue().splitlines()
    assert 0 < len(partial) < 40
    assert loop.conversation.messages[1] == {"role": "assistant", "content": partial}
    # the next turn (on the same decoder and KV cache) equals a fresh session fed the same history
    assert second == reference_reply(history(("write code", partial)) + user("continue"), 40)
    assert "interrupted; the partial reply is kept" in capsys.readouterr().err


def test_ctrl_c_before_the_reply_begins_withdraws_the_message(capsys):
    loop, out = terminal_loop(FakeEngine(interrupt_at=1), max_tokens=5)  # Ctrl-C during the prefill
    loop.run(reader(["first try", "second"]))
    assert "interrupted before the reply began; the message was not kept" in capsys.readouterr().err
    assert out.getvalue() == reference_reply(user("second"), 5) + "\n"
    assert loop.conversation.messages == history(("second", out.getvalue()[:-1]))


def test_second_ctrl_c_stops_mid_step_and_the_next_turn_reads_the_conversation_afresh(capsys):
    engine = FakeEngine(interrupt_at=4, presses=2)  # the second press raises inside the target's evaluation
    loop, out = terminal_loop(engine)
    loop.run(reader(["write code", "continue"]))
    partial, second = out.getvalue().splitlines()
    assert 0 < len(partial) < 40 and engine.strategies == ["ngram", "ngram"]  # a fresh decoder after the hard stop
    assert loop.conversation.messages[1] == {"role": "assistant", "content": partial}
    assert second == reference_reply(history(("write code", partial)) + user("continue"), 40)


def test_spec_auto_measures_the_cost_curve_and_ctrl_c_there_keeps_the_chat(capsys):
    """A chat begun with another strategy on a machine with no cost curve measures it at `/spec auto`;
    Ctrl-C while it measures keeps the strategy and the conversation, and the next turn is exact."""
    engine = FakeEngine()
    engine.measured = False
    engine.measure = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
    loop, out = terminal_loop(engine, max_tokens=5)
    loop.run(reader(["hi", "/spec auto", "again"]))
    first, second = out.getvalue().splitlines()
    assert "Measuring stopped: speculation stays ngram." in capsys.readouterr().err
    assert loop.strategy == "ngram" and engine.strategies == ["ngram", "ngram"]  # a fresh decoder: the measuring used the cache
    assert second == reference_reply(history(("hi", first)) + user("again"), 5)
    engine.measure = lambda: None
    loop.run(reader(["/spec auto"]))
    assert engine.measured and loop.strategy == "auto" and "Speculation: auto" in capsys.readouterr().err


def test_ctrl_c_at_the_prompt_says_how_to_leave_and_ctrl_d_leaves(capsys):
    loop, out = terminal_loop(FakeEngine(), max_tokens=5)
    loop.run(reader([KeyboardInterrupt(), '"""', "half", KeyboardInterrupt(), "hi", EOFError(), "never"]))
    err = capsys.readouterr().err
    assert leave_hint() in err and "Multi-line message dropped." in err
    assert out.getvalue() == reference_reply(user("hi"), 5) + "\n"
    assert loop.conversation.messages == history(("hi", out.getvalue().strip()))


def test_ctrl_c_in_a_script_stops_after_keeping_the_partial_reply():
    engine = FakeEngine(interrupt_at=4)
    out = io.StringIO()
    loop = ChatLoop(engine, Conversation(), ChatSettings(SamplingParams(temperature=0.0), 40), "ngram", out=out)
    with pytest.raises(KeyboardInterrupt):  # main() turns it into exit code 130
        loop.run(reader(["write code", "never read"]))
    assert out.getvalue().count("\n") == 1 and loop.conversation.messages[1]["content"] == out.getvalue()[:-1]


# -- a real model (SmolLM2-135M from the project's verified cache: conftest's smollm2_path) --------


@pytest.mark.real
def test_real_two_turn_code_chat_drafts_from_the_first_turn(smollm2_path):
    script = [
        "Write a Python function add(a, b) that returns a + b. Only the code.",
        "Rename the function to plus. Show the whole code again.",
    ]
    flags = ["--spec", "ngram", "--temp", "0", "-n", "32", "-c", "1024", "-t", "2", "-v"]
    result = CliRunner().invoke(app, ["chat", "-m", str(smollm2_path), *flags], input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    assert "def add" in result.stdout and "def plus" in result.stdout
    summaries = [line for line in result.stderr.splitlines() if line.startswith("prompt ")]
    assert len(summaries) == 2
    prompt1 = int(re.match(r"prompt (\d+) tok", summaries[0]).group(1))
    assert int(re.search(r"\((\d+) reused\)", summaries[1]).group(1)) >= prompt1  # turn 1 stays in the KV cache
    accepted = int(re.search(r"ngram (\d+)/\d+", summaries[1]).group(1))
    assert accepted > 0  # code from turn 1 drafts turn 2


@pytest.mark.real
def test_real_turn_on_reused_caches_equals_a_fresh_session(smollm2_path, capsys):
    """Target and draft KV caches carried across turns (and an interrupted turn) give a fresh session's tokens."""
    from specllm.backend import LoadOptions
    from specllm.session import Engine, ModelPaths, SpecConfig

    options = LoadOptions(n_ctx=512, n_threads=2, n_gpu_layers=0)
    engine = Engine(ModelPaths(smollm2_path, smollm2_path), SpecConfig("ngram+draft"), options, options)
    try:
        settings = ChatSettings(SamplingParams(temperature=0.0), 24)
        loop = ChatLoop(engine, Conversation("You write Python."), settings, "ngram+draft", out=io.StringIO(), interactive=True)
        evaluate, calls = engine.target.evaluate, []

        def evaluate_then_ctrl_c(tokens, rows, copy=True):  # Ctrl-C during the fourth target pass of turn 1
            calls.append(len(tokens))
            if len(calls) == 4:
                os.kill(os.getpid(), signal.SIGINT)
            return evaluate(tokens, rows, copy)

        engine.target.evaluate = evaluate_then_ctrl_c
        loop.run(reader(["Write a function that reverses a string.", "Now make it reverse a list instead."]))
        replies = [m["content"] for m in loop.conversation.messages if m["role"] == "assistant"]
        assert len(replies) == 2 and all(replies)
        assert "interrupted; the partial reply is kept" in capsys.readouterr().err
        engine.target.evaluate = evaluate
        fresh = engine.decoder("off")  # plain decoding from empty caches, same history
        prompt = encode_messages(engine.target, loop.conversation.all_messages()[:-1])
        events = list(fresh.generate(prompt, 24, settings.params, np.random.default_rng(0)))
        assert events[-1].text == replies[1]
    finally:
        engine.close()
