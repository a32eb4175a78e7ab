"""gpt-oss's harmony format: the `analysis` channel told apart from the `final` answer, the markup
never in the answer, streamed and whole, through run, chat and serve.

No gpt-oss model is at hand (13 GB at least), so a tiny model carries harmony's markup tokens (the
generated tokenizer's control tokens renamed) and a chat template written as gpt-oss's writes its
prompts; llama.cpp's own vocabulary rules for them apply as they do to the real model's. What the
model writes is scripted (`tests/fakes.Scripted`) as the real backend renders each token of it.
"""

from __future__ import annotations

import json
import os

import pytest

from specllm.backend import LoadOptions
from specllm.chat import ChatTemplate, reasoning_splitter, thinking_variables
from specllm.errors import UsageError
from specllm.reasoning import CONTENT, HARMONY, REASONING, TAGS, HarmonySplitter
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import specllm_here
from tests.fakes import Scripted
from tests.reply_helpers import check_every_cut
from tests.server_helpers import client, running
from tests.tiny_gguf import write_tiny_gguf

TINY = LoadOptions(n_ctx=2048, n_threads=1, n_gpu_layers=0)
# As gpt-oss's template writes a chat: a system message, earlier answers' `final` messages only (their
# reasoning dropped), the generation prompt `<|start|>assistant` (the model writes its channel)
GPT_OSS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% for message in messages %}{% if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# gpt-oss's markup tokens, in place of the tiny tokenizer's control tokens 3 to 9 (<repo_name> ...)
MARKUP = {3: "<|start|>", 4: "<|channel|>", 5: "<|message|>", 6: "<|end|>", 7: "<|return|>", 8: "<|call|>", 9: "<|constrain|>"}
PROMPT = "<|start|>user<|message|>2+2?<|end|><|start|>assistant"  # the prompt's end, as specllm reads it
REPLY = ("<|channel|>analysis<|message|>We need to add two and two.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>")  # fmt: skip


# -- telling reasoning from the answer -------------------------------------------------------------

CASES = {  # (the prompt's end, what the model writes) -> (reasoning, answer)
    "analysis, then the final answer": ((PROMPT, REPLY), ("We need to add two and two.", "The answer is 4.")),
    "the final answer alone": ((PROMPT, "<|channel|>final<|message|>4"), (None, "4")),
    "a final answer's content type": ((PROMPT, '<|channel|>final <|constrain|>json<|message|>{"a": 1}'), (None, '{"a": 1}')),
    "a preamble is for the user": ((PROMPT, "<|channel|>commentary<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>4"),
                                   (None, "Let me see.\n\n4")),  # fmt: skip
    "a tool call is neither": ((PROMPT, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
                                        '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}'), ("Need the weather.", "")),  # fmt: skip
    "a tool call, its recipient after the channel": ((PROMPT, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"), (None, "")),
    "two analysis messages": ((PROMPT, "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two."),
                              ("One.\n\nTwo.", "")),  # fmt: skip
    "text between messages": ((PROMPT, "<|channel|>analysis<|message|>a<|end|>\n<|start|>assistant<|channel|>final<|message|>b"), ("a", "b")),
    "another role's message": ((PROMPT, "<|channel|>final<|message|>4<|end|><|start|>user<|message|>Thanks!"), (None, "4")),
    "markup's look-alikes in the answer": ((PROMPT, "<|channel|>final<|message|>a <| b |> <|c"), (None, "a <| b |> <|c")),
    "cut off while reasoning": ((PROMPT, "<|channel|>analysis<|message|>Still going <|en"), ("Still going <|en", "")),
    "cut off in a header": ((PROMPT, "<|channel|>fin"), (None, "")),
    "cut off after a message's start": ((PROMPT, "<|channel|>final<|message|>4<|end|><|start|>assistant"), (None, "4")),
    "the prompt opened the final message": ((PROMPT + "<|channel|>final<|message|>", "4"), (None, "4")),
    "no harmony at all: all answer": ((PROMPT, "Just text,\nno channel."), (None, "Just text,\nno channel.")),
    "one plain word": ((PROMPT, "Hi"), (None, "Hi")),
    "nothing": ((PROMPT, ""), (None, "")),
}


@pytest.mark.parametrize("name", CASES)
def test_a_reply_is_told_into_reasoning_and_answer(name):
    (tail, text), expected = CASES[name]
    assert HarmonySplitter(tail).read(text) == expected


@pytest.mark.parametrize("name", CASES)
def test_streamed_pieces_add_up_to_the_whole_however_the_text_is_cut(name):
    """Cut at every place and pushed in three pieces: the same reasoning and answer as whole, no
    piece empty (a marker cut between pieces is held back, never given)."""
    (tail, text), (reasoning, answer) = CASES[name]
    check_every_cut(lambda: HarmonySplitter(tail), text, reasoning, answer)


def test_reasoning_is_given_as_it_comes_and_the_answer_after_it():
    splitter = HarmonySplitter(PROMPT)
    assert splitter.thinks and splitter.push("<|channel|>analysis<|mess") == []
    assert splitter.push("age|>We need") == [(REASONING, "We need")] and splitter.reasoning_open
    assert splitter.push(" to add.<|e") == [(REASONING, " to add.")]  # the marker's start held back
    assert splitter.push("nd|><|start|>assistant<|channel|>final<|message|>4") == [(CONTENT, "4")]
    assert not splitter.reasoning_open and splitter.finish() == []


def test_gpt_oss_template_is_told_from_a_think_tag_template():
    assert ChatTemplate(GPT_OSS, "<|return|>").thinks == HARMONY
    assert ChatTemplate("{{ '<think>' }}", "</s>").thinks == TAGS
    assert not ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "</s>").thinks


# -- the tiny gpt-oss: llama.cpp's rules for its tokens, run, chat and serve -----------------------


@pytest.fixture(scope="module")
def oss(tiny_dir):
    return write_tiny_gguf(tiny_dir / "tiny-gpt-oss.gguf", 0, chat_template=GPT_OSS, token_edits=MARKUP)


@pytest.fixture(scope="module")
def engine(oss):
    engine = Engine(ModelPaths(oss), SpecConfig("off"), TINY, TINY)
    yield engine
    engine.close()


def written(target, text: str) -> list[str]:
    """What the decoder commits where the model writes `text`: each token's text as specllm renders
    it, up to the first end-of-generation token (not committed)."""
    pieces = []
    for token in target.tokenize(text, parse_special=True):
        if target.is_eog(token):
            break
        pieces.append(target.token_bytes(token).decode("utf-8"))
    return pieces


def test_llama_cpp_renders_the_markup_and_ends_at_return_or_call_not_at_end(engine):
    """What the splitter relies on: llama.cpp renders <|channel|>, <|message|>, <|start|>,
    <|constrain|> and <|end|> as text (it makes them user-defined tokens), and of harmony's ends only
    <|return|> and <|call|> end the generation, so the answer after the analysis' <|end|> comes."""
    target = engine.target
    pieces = written(target, REPLY + "<|start|>assistant")
    assert "".join(pieces) == REPLY.removesuffix("<|return|>") and "<|end|>" in pieces
    assert "".join(written(target, "<|constrain|>json<|call|>more")) == "<|constrain|>json"
    prompt = engine.encode("2+2?")
    assert isinstance(reasoning_splitter(target, prompt), HarmonySplitter)
    assert b"".join(target.token_bytes(t) for t in prompt).decode().endswith(PROMPT)


@pytest.fixture
def scripted(monkeypatch, engine):
    decoder = Scripted(written(engine.target, REPLY))
    monkeypatch.setattr(Engine, "decoder", lambda self, strategy=None: decoder)
    return decoder


def test_run_writes_the_analysis_to_stderr_and_the_final_answer_to_stdout(oss, scripted):
    env = dict(os.environ)
    done = specllm_here(env, "run", "-m", oss, "--spec", "off", "-p", "2+2?")
    assert (done.returncode, done.stdout, done.stderr) == (0, "The answer is 4.\n", "We need to add two and two.\n")
    data = json.loads(specllm_here(env, "run", "-m", oss, "--spec", "off", "-p", "2+2?", "--json").stdout)
    assert (data["text"], data["reasoning"]) == ("The answer is 4.", "We need to add two and two.")


def test_chat_keeps_the_final_answers_and_leaves_the_analysis_out_of_the_conversation(oss, engine, scripted):
    done = specllm_here(dict(os.environ), "chat", "-m", oss, "--spec", "off", stdin=b"2+2?\nAnd 3+3?\n")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("The answer is 4.\n" * 2, "We need to add two and two.\n" * 2)
    second = b"".join(engine.target.token_bytes(t) for t in scripted.prompts[1]).decode()
    assert second.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant<|channel|>final<|message|>The answer is 4.<|end|>"
                           "<|start|>user<|message|>And 3+3?<|end|><|start|>assistant")  # fmt: skip
    assert "We need" not in second


def test_serve_gives_the_analysis_as_reasoning_content_whole_and_streamed(engine):
    decoder = Scripted(written(engine.target, REPLY))
    with running(Service(engine, "tiny", make_decoder=lambda: decoder)) as url:
        api, messages = client(url), [{"role": "user", "content": "2+2?"}]
        whole = api.chat.completions.create(model="tiny", messages=messages).choices[0].message
        chunks = [c for c in api.chat.completions.create(model="tiny", messages=messages, stream=True) if c.choices]
    assert (whole.content, whole.reasoning_content) == ("The answer is 4.", "We need to add two and two.")
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "We need to add two and two."


def test_no_think_is_refused_in_one_line_for_gpt_oss(engine):
    """gpt-oss reasons in every answer (its template's `reasoning_effort` shortens the analysis, no
    more): `--no-think` said nothing and changed nothing; now it is refused, as for R1's template."""
    with pytest.raises(UsageError, match="harmony format.* reasons in every answer and has no switch"):
        thinking_variables(engine.target, think=False)
    assert thinking_variables(engine.target, think=True) is None
