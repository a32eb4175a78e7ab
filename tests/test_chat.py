"""Chat without a model: command parsing, /set, multi-line blocks, and KV reuse across turns."""

from __future__ import annotations

import numpy as np
import pytest

from specllm.chat import (
    COMMANDS,
    ChatSettings,
    Conversation,
    MultiLine,
    apply_set,
    encode_messages,
    help_text,
    parse_command,
)
from specllm.engine.decode import Done, PrefillDone, generate_plain
from specllm.engine.sampling import SamplingParams
from specllm.errors import UsageError
from tests.fakes import ChatFakeBackend, FakeEngine, reference_reply

GREEDY = SamplingParams(temperature=0.0)


def run_turn(decoder, target, conversation, text, n, stop=None):
    conversation.add("user", text)
    prompt = encode_messages(target, conversation.all_messages())
    events = list(decoder.generate(prompt, n, GREEDY, np.random.default_rng(0), stop=stop))
    done = events[-1]
    assert isinstance(done, Done)
    conversation.add("assistant", done.text)
    return prompt, done, events


# -- commands ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, name, args, known",
    [
        ("/help", "/help", [], True),
        ("/?", "/help", [], True),
        ("  /BYE ", "/bye", [], True),
        ("/exit", "/bye", [], True),
        ("/set temp 0.7", "/set", ["temp", "0.7"], True),
        ("/spec ngram+draft", "/spec", ["ngram+draft"], True),
        ("/frobnicate now", "/frobnicate", ["now"], False),
    ],
)
def test_parse_command(line, name, args, known):
    command = parse_command(line)
    assert (command.name, command.args, command.known) == (name, args, known)


@pytest.mark.parametrize("line", ["hello", "", "   ", "/usr/bin/python crashes, why?", "/ alone", "a /help"])
def test_lines_that_are_messages_not_commands(line):
    assert parse_command(line) is None


def test_help_lists_every_command():
    text = help_text()
    assert all(name in text for name in COMMANDS) and '"""' in text


# -- /set --------------------------------------------------------------------------------

BASE = ChatSettings(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=None), 256)


@pytest.mark.parametrize(
    "args, check",
    [
        (["temp", "0.7"], lambda s: s.params.temperature == 0.7),
        (["temperature", "0"], lambda s: s.params.greedy),
        (["top_k", "0"], lambda s: s.params.top_k == 0),
        (["top-p", "0.5"], lambda s: s.params.top_p == 0.5),
        (["min_p", "0.1"], lambda s: s.params.min_p == 0.1),
        (["seed", "42"], lambda s: s.params.seed == 42),
        (["seed", "random"], lambda s: s.params.seed is None),
        (["max_tokens", "32"], lambda s: s.max_tokens == 32),
    ],
)
def test_set_changes_one_setting(args, check):
    settings = apply_set(BASE, args)
    assert check(settings)
    assert BASE.params.temperature == 0.8 and BASE.max_tokens == 256  # frozen: the old value is untouched


@pytest.mark.parametrize(
    "args, message",
    [
        (["temp", "abc"], "temp must be a number, got 'abc'"),
        (["temp", "-1"], "temp must be 0 or more"),
        (["temp", "nan"], "temp must be a finite number, got nan"),
        (["top_k", "1.5"], "top_k must be a whole number"),
        (["top_p", "1.5"], "top_p must be in [0, 1]"),
        (["min_p", "1"], "min_p must be in [0, 1)"),
        (["max_tokens", "0"], "max_tokens must be at least 1"),
        (["seed", "x"], "seed must be a whole number"),
        (["colour", "red"], "unknown setting 'colour'"),
        (["temp"], "usage: /set NAME VALUE"),
    ],
)
def test_set_refuses_bad_values_with_a_clear_message(args, message):
    with pytest.raises(UsageError) as info:
        apply_set(BASE, args)
    assert message in str(info.value)
    assert "--" not in str(info.value)  # settings are named as typed, not as flags


# -- multi-line input --------------------------------------------------------------------


def feed_all(lines):
    block, out = MultiLine(), []
    for line in lines:
        result = block.feed(line)
        if result is not None:
            out.append(result)
    return block, out


def test_block_keeps_lines_indentation_and_blank_lines():
    block, out = feed_all(['"""', "def f():", "", "    return 1", '"""'])
    assert out == ["def f():\n\n    return 1"] and not block.open


def test_block_with_text_on_the_opening_and_closing_lines():
    _, out = feed_all(['"""first', "middle", 'last"""'])
    assert out == ["first\nmiddle\nlast"]


def test_one_line_block():
    _, out = feed_all(['"""just this"""'])
    assert out == ["just this"]


def test_cancel_drops_a_half_typed_block():
    block, out = feed_all(['"""', "half"])
    assert block.open and out == []
    assert block.cancel() and not block.open and not block.cancel()


# -- turns on one decoder ----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ngram", "draft"])
def test_turn_two_evaluates_only_its_new_tokens(strategy):
    with_draft = strategy == "draft"
    engine = FakeEngine(with_draft=with_draft)
    target, decoder = engine.target, engine.decoder(strategy)
    conversation = Conversation("be brief")
    prompt1, done1, _ = run_turn(decoder, target, conversation, "hello there", 12)
    held = len(decoder.history) - 1
    target.evaluations.clear()
    draft_before = len(engine.draft.evaluations) if with_draft else 0
    prompt2, _, events = run_turn(decoder, target, conversation, "and again", 12)
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    # The whole first turn (prompt and reply) is reused; only the new user turn is evaluated.
    assert prefill.reused_tokens == held == len(prompt1) + len(done1.tokens) - 1
    new_tokens = len(prompt2) - 1 - held
    assert target.evaluations[0] == new_tokens
    assert new_tokens <= len("|<user>and again|<assistant>")
    if with_draft:
        first_catch_up = engine.draft.evaluations[draft_before]
        assert first_catch_up <= new_tokens + 2  # the draft model too reads only what it has not seen


def test_interrupted_turn_then_next_turn_equals_a_fresh_session():
    engine = FakeEngine()
    target, decoder = engine.target, engine.decoder("ngram")
    conversation = Conversation()
    steps = iter(range(100))
    _, done, _ = run_turn(decoder, target, conversation, "write code", 40, stop=lambda: next(steps) >= 3)
    assert done.finish_reason == "interrupted" and 0 < len(done.tokens) < 40
    assert target.kv == decoder.history[:-1]
    _, continued, _ = run_turn(decoder, target, conversation, "more", 15)
    fresh = reference_reply(conversation.all_messages()[:-1], 15)
    assert continued.text == fresh
    # and the plain reference agrees token for token
    fresh_target = ChatFakeBackend(seed=0)
    prompt = encode_messages(fresh_target, conversation.all_messages()[:-1])
    assert continued.tokens == generate_plain(fresh_target, prompt, 15, GREEDY, None)


def test_encode_messages_keeps_typed_markup_as_text():
    target = ChatFakeBackend()
    typed = [{"role": "user", "content": "|<assistant>"}]
    tokens = encode_messages(target, typed)
    assert tokens == target.tokenize("<user>|<assistant>|<assistant>")


class _TrimmingTemplate(ChatFakeBackend):
    """A template that trims every message (Llama 3's does): `strip` would cut a \\x1f marker."""

    def apply_chat_template(self, messages, add_assistant=True, tools=None, variables=None):
        return super().apply_chat_template([{**m, "content": m["content"].strip()} for m in messages], add_assistant, tools, variables)


def test_a_template_that_trims_contents_keeps_them():
    target = _TrimmingTemplate()
    assert encode_messages(target, [{"role": "user", "content": "abc"}]) == target.tokenize("<user>abc|<assistant>")


@pytest.mark.real
def test_the_models_own_template_gives_its_default_system_prompt(smollm2_path, qwen_pair):
    """Rendered as Transformers renders the GGUF's Jinja template: with no system message, the one
    the template puts there (llama.cpp's built-in chatml formatter leaves it out); with one, that
    one; with an empty one (`--system ''`), none."""
    from specllm.backend import LlamaBackend, LoadOptions

    defaults = {smollm2_path: "You are a helpful AI assistant named SmolLM", qwen_pair[0]: "You are Qwen, created by Alibaba Cloud."}
    for path, default in defaults.items():
        model = LlamaBackend(path, LoadOptions(n_ctx=256, n_threads=1))
        try:
            user = [{"role": "user", "content": "hi"}]
            assert f"<|im_start|>system\n{default}" in model.apply_chat_template(user)
            given = model.apply_chat_template([{"role": "system", "content": "Be brief."}, *user])
            assert default not in given and given.startswith("<|im_start|>system\nBe brief.<|im_end|>")
            tokens = encode_messages(model, user)
            assert model.tokenize(default) == tokens[3 : 3 + len(model.tokenize(default))]  # after <|im_start|>system\n
            empty = model.apply_chat_template([{"role": "system", "content": ""}, *user])  # --system '': none at all
            assert default not in empty and empty.startswith("<|im_start|>system\n<|im_end|>")
            assert len(encode_messages(model, [{"role": "system", "content": ""}, *user])) < len(tokens)
        finally:
            model.close()
