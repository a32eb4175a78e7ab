"""Thinking models (Qwen3, QwQ, DeepSeek-R1's distillations): their reasoning told apart from the
answer, streamed and whole; `--no-think` and `chat_template_kwargs` through the template's switch.

What a thinking model writes is scripted (`tests/fakes.Scripted`) on a tiny model that carries
Qwen3's own chat template (`tests/data/qwen3-chat-template.jinja`), so run, chat and serve are
checked end to end without a multi-gigabyte model; none of this project's real models thinks.
"""

from __future__ import annotations

import json
import os

import pytest

from specllm.chat import ChatTemplate, encode_messages, reasoning_splitter
from specllm.engine.decode import Done
from specllm.models import catalog
from specllm.reasoning import CONTENT, REASONING, ThinkSplitter
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import assert_one_error, specllm_here
from tests.fakes import Scripted
from tests.reply_helpers import QWEN3, check_every_cut, text_of
from tests.server_helpers import TINY, client, raw, running
from tests.tiny_gguf import write_tiny_gguf

# As DeepSeek-R1's distillations' templates: the generation prompt opens the block, no switch to close it
R1 = (
    "{% for message in messages %}{% set content = message.content %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}<|im_start|>{{ message.role }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# As Qwen3's 2507 Instruct template: earlier turns' reasoning stripped, no switch, the model does not think
NO_THINKING = R1.replace("assistant\n<think>\n{% endif %}", "assistant\n{% endif %}")
THOUGHT = ["<think>", "\nTwo and", " two.\n\n", "</think>", "\n\n", "It is", " 4."]  # as Qwen3 writes it, by token


# -- telling reasoning from the answer -------------------------------------------------------------

CASES = {  # (the prompt's end, what the model writes) -> (reasoning, answer)
    "the model opens the block (Qwen3)": (("<|im_start|>assistant\n", "".join(THOUGHT)), ("Two and two.", "It is 4.")),
    "the prompt opens it (R1, QwQ)": (("assistant\n<think>\n", "Hmm, yes.\n</think>\n\nYes."), ("Hmm, yes.", "Yes.")),
    "thinking turned off (enable_thinking false)": (("assistant\n<think>\n\n</think>\n\n", "<think>x</think>y"), (None, "<think>x</think>y")),
    "an empty block": (("assistant\n", "<think>\n\n</think>\n\nHi."), (None, "Hi.")),
    "no block: all answer": (("assistant\n", "Say <think> to think."), (None, "Say <think> to think.")),
    "blank lines before the block": (("assistant\n", "\n <think>a</think>b"), ("a", "b")),
    "cut off while thinking": (("assistant\n", "<think>\nStill going\n</thi"), ("Still going\n</thi", "")),
    "a tag's beginning and no more": (("assistant\n", "<thi"), (None, "<thi")),
    "nothing": (("assistant\n", ""), (None, "")),
}


@pytest.mark.parametrize("name", CASES)
def test_a_reply_is_told_into_reasoning_and_answer(name):
    (tail, text), expected = CASES[name]
    assert ThinkSplitter(tail).read(text) == expected


@pytest.mark.parametrize("name", CASES)
def test_streamed_pieces_add_up_to_the_whole_however_the_text_is_cut(name):
    """Cut at every place and pushed in three pieces: the same reasoning and answer as whole."""
    (tail, text), (reasoning, answer) = CASES[name]
    check_every_cut(lambda: ThinkSplitter(tail), text, reasoning, answer)


def test_a_model_that_does_not_think_writes_all_answer():
    splitter = ThinkSplitter("assistant\n", thinks=False)
    assert splitter.push("<think>") == [(CONTENT, "<think>")] and splitter.read("x</think>y") == (None, "<think>x</think>y")


def test_reasoning_is_given_as_it_comes():
    splitter = ThinkSplitter("assistant\n")
    assert splitter.push("<think>\nFirst") == [(REASONING, "First")]
    assert splitter.push(" thought.\n</") == [(REASONING, " thought.")]  # the blank and the tag's start held back
    assert splitter.push("think>\n\nDone") == [(CONTENT, "Done")]


# -- the template ----------------------------------------------------------------------------------


def test_qwen3s_template_thinks_and_turns_it_off_on_request():
    template = ChatTemplate(QWEN3, "<|im_end|>")
    assert template.thinks and template.can_stop_thinking and template.writes_tool_call_tags
    messages = [{"role": "user", "content": "2+2?"}]
    assert template.render(messages).endswith("<|im_start|>assistant\n")
    assert template.render(messages, variables={"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a variable never replaces what specllm gives the template
    assert "2+2?" in template.render(messages, variables={"messages": []})
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "</s>")
    assert not plain.thinks and not plain.can_stop_thinking


@pytest.fixture(scope="module")
def thinker(tiny_dir):
    return write_tiny_gguf(tiny_dir / "tiny-qwen3.gguf", 0, chat_template=QWEN3)


@pytest.fixture(scope="module")
def engine(thinker):
    engine = Engine(ModelPaths(thinker), SpecConfig("off"), TINY, TINY)
    yield engine
    engine.close()


def test_no_think_closes_the_block_in_the_prompt_and_the_answer_starts_at_once(engine):
    thinking, answering = engine.encode("2+2?"), engine.encode("2+2?", think=False)
    assert text_of(engine, answering).endswith("assistant\n<think>\n\n</think>\n\n")
    assert answering[: len(thinking)] == thinking
    assert reasoning_splitter(engine.target, answering).read("<think>x</think>y") == (None, "<think>x</think>y")
    assert reasoning_splitter(engine.target, thinking).read("<think>x</think>y") == ("x", "y")


def test_reasoning_sent_back_in_an_earlier_answer_is_left_out_as_the_template_leaves_it(engine):
    asked = [{"role": "user", "content": "2+2?"}]
    clean = asked + [{"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"}]
    sent_back = [{**m, "content": "<think>\nTwo and two.\n</think>\n\nIt is 4."} if m["role"] == "assistant" else m for m in clean]
    assert encode_messages(engine.target, sent_back) == encode_messages(engine.target, clean)


def test_a_tool_loops_reasoning_sent_back_is_written_as_the_template_writes_it(engine):
    """After the last user message (the steps of a tool loop) Qwen3's template writes an answer's
    reasoning back in its block: sent inside the content or as `reasoning_content`, the prompt reads
    as the template renders the messages itself (control tokens aside)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    result = [{"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 14}'}]
    inline = asked + [{"role": "assistant", "content": "<think>\nI need the weather.\n</think>\n\n", "tool_calls": [call]}] + result
    apart = asked + [{"role": "assistant", "content": "", "reasoning_content": "I need the weather.", "tool_calls": [call]}] + result
    rendered = ChatTemplate(QWEN3, "<|im_end|>").render(inline)
    assert "<think>\nI need the weather.\n</think>\n\n<tool_call>" in rendered
    for messages in (inline, apart):
        assert text_of(engine, encode_messages(engine.target, messages)) == rendered.replace("<|im_start|>", "").replace("<|im_end|>", "")


# -- run and chat -----------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    decoder = Scripted(THOUGHT)
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: decoder)
    return decoder


def test_run_writes_the_reasoning_to_stderr_and_the_answer_to_stdout(thinker, scripted):
    env = dict(os.environ)
    done = specllm_here(env, "run", "-m", thinker, "--spec", "off", "-p", "2+2?")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("It is 4.\n", "Two and two.\n")
    data = json.loads(specllm_here(env, "run", "-m", thinker, "--spec", "off", "-p", "2+2?", "--json").stdout)
    assert (data["text"], data["reasoning"]) == ("It is 4.", "Two and two.")


def test_no_think_is_refused_where_every_answer_thinks_and_the_template_has_no_switch(tiny_dir, scripted):
    r1 = write_tiny_gguf(tiny_dir / "tiny-r1.gguf", 0, chat_template=R1)
    env = dict(os.environ)
    assert_one_error(specllm_here(env, "run", "-m", r1, "--spec", "auto", "-p", "2+2?", "--no-think"), 2, "--no-think", "tiny-r1.gguf", "opens a thinking block")
    costs = catalog.cache_dir() / "costs.json"  # refused before auto's first run measured the cost curve
    assert not costs.exists() or "tiny-r1.gguf" not in costs.read_text("utf-8")
    scripted.script = ["Hmm.\n</think>\n\n", "4"]  # the prompt opened the block
    done = specllm_here(env, "run", "-m", r1, "--spec", "off", "-p", "2+2?")
    assert (done.stdout, done.stderr) == ("4\n", "Hmm.\n")
    instruct = write_tiny_gguf(tiny_dir / "tiny-2507.gguf", 0, chat_template=NO_THINKING)
    scripted.script = ["4"]
    done = specllm_here(env, "run", "-m", instruct, "--spec", "off", "-p", "2+2?", "--no-think")  # nothing to turn off
    assert (done.returncode, done.stdout, done.stderr) == (0, "4\n", "")


def test_no_think_is_no_error_for_a_model_that_does_not_think(tiny_pair, scripted):
    scripted.script = ["<think>", "4"]  # not a thinking model: what it writes is all answer
    done = specllm_here(dict(os.environ), "run", "-m", tiny_pair[0], "--spec", "off", "-p", "2+2?", "--no-think")
    assert (done.returncode, done.stdout, done.stderr) == (0, "<think>4\n", "")


def test_chat_keeps_the_answers_and_leaves_the_reasoning_out_of_the_conversation(thinker, engine, scripted):
    done = specllm_here(dict(os.environ), "chat", "-m", thinker, "--spec", "off", stdin=b"2+2?\nAnd 3+3?\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "It is 4.\nIt is 4.\n"
    assert done.stderr == "Two and two.\nTwo and two.\n"
    second = text_of(engine, scripted.prompts[1])
    assert "assistant\nIt is 4.\nuser\nAnd 3+3?" in second and "Two and" not in second  # control tokens show as nothing


# -- serve ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine):
    decoder = Scripted()
    with running(Service(engine, "tiny", make_decoder=lambda: decoder)) as url:
        yield url, decoder


def ask(server, script, **kwargs):
    url, decoder = server
    decoder.script = script
    api = client(url)
    messages = [{"role": "user", "content": "2+2?"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, **kwargs).choices[0]
    chunks = [c for c in api.chat.completions.create(model="tiny", messages=messages, stream=True, **kwargs) if c.choices]
    return whole, chunks


def streamed(chunks, field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks)


def test_serve_gives_the_reasoning_as_reasoning_content_whole_and_streamed(server):
    whole, chunks = ask(server, THOUGHT)
    assert (whole.message.content, whole.message.reasoning_content) == ("It is 4.", "Two and two.")
    assert (streamed(chunks, "content"), streamed(chunks, "reasoning_content")) == ("It is 4.", "Two and two.")
    first_answer = next(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks[first_answer:])


def test_a_tool_call_after_thinking_is_read_from_the_answer(server):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    whole, chunks = ask(server, ["<think>\nI need the weather", " <tool_call> for it.\n</think>\n\n", call], tools=[weather])
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.reasoning_content == "I need the weather <tool_call> for it."
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or []] == ["get_weather"]
    assert streamed(chunks, "reasoning_content") == "I need the weather <tool_call> for it." and streamed(chunks, "content") == ""


def test_chat_template_kwargs_turn_thinking_off(server, engine):
    url, decoder = server
    whole, chunks = ask(server, ["It is 4."], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert whole.message.content == "It is 4." and getattr(whole.message, "reasoning_content", None) is None
    assert text_of(engine, decoder.prompts[-1]).endswith("assistant\n<think>\n\n</think>\n\n")
    for bad, word in (({"messages": []}, "messages"), ([1], "an object")):
        status, body = raw(url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": bad})
        assert status == 400 and word in body["error"]["message"] and body["error"]["param"] == "chat_template_kwargs"


def test_serve_no_think_is_the_default_a_request_may_override(engine):
    decoder = Scripted(["It is 4."])
    with running(Service(engine, "tiny", make_decoder=lambda: decoder, variables={"enable_thinking": False})) as url:
        api, messages = client(url), [{"role": "user", "content": "2+2?"}]
        api.chat.completions.create(model="tiny", messages=messages)
        api.chat.completions.create(model="tiny", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert text_of(engine, decoder.prompts[0]).endswith("<think>\n\n</think>\n\n")
    assert text_of(engine, decoder.prompts[1]).endswith("assistant\n")


def test_under_a_redrawn_status_line_reasoning_is_written_in_whole_lines():
    """Stderr a terminal, stdout elsewhere: the status line is redrawn where the cursor is, so
    reasoning goes out a whole line at a time, each clearing the status first."""
    import io

    from specllm.cli.display import LiveStatus, ReasoningWriter

    live, err = LiveStatus(True), io.StringIO()
    live.shared_terminal = False  # stdout elsewhere (`pytest -s` at a terminal would say otherwise)
    writer = ReasoningWriter(live, err)
    writer.write("First line\nSecond ")
    assert err.getvalue() == "\r\x1b[2KFirst line\n"
    writer.write("half")
    writer.end()
    assert err.getvalue() == "\r\x1b[2KFirst line\n\r\x1b[2KSecond half\n"
    plain = ReasoningWriter(LiveStatus(False), io.StringIO())
    plain.write("as it comes")
    plain.end()
    assert plain.stream.getvalue() == "as it comes\n"


def test_reasoning_cut_off_by_max_tokens_is_said_and_a_chat_keeps_no_empty_answer(thinker, scripted):
    scripted.script = ["<think>", "\nStill", " thinking"]
    scripted.generate = _ending_at_the_limit(scripted.generate)
    env = dict(os.environ)
    done = specllm_here(env, "run", "-m", thinker, "--spec", "off", "-p", "2+2?", "-n", "3")
    assert done.returncode == 0 and done.stdout == ""
    assert done.stderr.splitlines() == ["Still thinking", "warning: stopped after 3 tokens while the model was still reasoning, "
                                        "before any answer: raise --max-tokens, or --no-think"]  # fmt: skip
    chat = specllm_here(env, "chat", "-m", thinker, "--spec", "off", "-n", "3", stdin=b"2+2?\n")
    assert chat.returncode == 0 and chat.stdout == ""
    assert "max_tokens 3 was reached before any answer; the message was not kept" in chat.stderr


def _ending_at_the_limit(generate):
    """The scripted decoder's events, its end a token limit's (`length`) rather than the model's own."""

    def wrapped(*args, **kwargs):
        for event in generate(*args, **kwargs):
            yield Done("length", event.tokens, event.text) if isinstance(event, Done) else event

    return wrapped


def test_serve_takes_reasoning_content_sent_back_with_an_answer():
    from specllm.server import parsing

    body = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
                         {"role": "user", "content": "And 3+3?"}]}  # fmt: skip
    assert parsing.parse("chat", body).messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
