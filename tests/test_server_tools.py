"""Tool calls through `specllm serve`: what a model writes read as OpenAI's `tool_calls`, streamed and
whole alike; the request's tools in the model's own template; one agent turn on the default pair.

The HTTP tests run a tiny model whose template takes tools, with a decoder that writes a script
(what a model would write; the tiny model's own text is noise), so that each way of writing a call
is checked end to end in the fast tier; the real test lets Qwen2.5-Coder 1.5B write its own.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import openai
import pytest

from specllm.server import tools
from specllm.server.tools import OPEN
from specllm.server.app import Service
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.fakes import Scripted
from tests.server_helpers import TINY, client, raw, running
from tests.tiny_gguf import write_tiny_gguf

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]

# As Qwen2.5's template, shortened: the tools in the system turn, earlier calls in <tool_call> tags, results in user turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}{% for call in message.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- reading calls out of text -------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = tools.ToolCall("get_weather", '{"city": "Paris"}')
NAMES = ["get_weather", "get_time"]
LONG_NUMBER = '<tool_call>{"name": "get_weather", "arguments": {"n": ' + "1" * 5000 + "}}"  # a model repeating a digit
TEXTS = {  # what a model writes -> (content, calls)
    "a call in tags": (CALL, (None, [PARIS])),
    "words, then two calls": (
        "Let me look.\n" + CALL + "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        ("Let me look.", [PARIS, tools.ToolCall("get_time", "{}")]),
    ),
    "a call whose closing tag never came": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', (None, [PARIS])),
    "arguments as a JSON string": ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', (None, [PARIS])),
    "a call cut short": ('<tool_call>\n{"name": "get_weather", "argum', ('<tool_call>\n{"name": "get_weather", "argum', [])),
    "bare JSON": ('{"name": "get_weather", "arguments": {"city": "Paris"}}', (None, [PARIS])),
    "JSON in a fence": ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', (None, [PARIS])),
    "bare JSON naming no tool": ('{"name": "Ada", "arguments": {}}', ('{"name": "Ada", "arguments": {}}', [])),
    "code in a fence": ("```python\nprint('hi')\n```", ("```python\nprint('hi')\n```", [])),
    "JSON with words after it": ('{"name": "get_weather", "arguments": {}} and more', ('{"name": "get_weather", "arguments": {}} and more', [])),
    "several calls in one block, as Qwen2.5-Coder writes them": (
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time", "arguments": {}}\n```',
        (None, [PARIS, tools.ToolCall("get_time", "{}")]),
    ),
    "a call in each of two blocks": (
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n```json\n{"name": "get_time"}\n```',
        (None, [PARIS, tools.ToolCall("get_time", "{}")]),
    ),
    "a list of calls": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', (None, [PARIS])),
    "doubled braces, as the template's example shows a call": ('{{"name": "get_weather", "arguments": {"city": "Paris"}}}', (None, [PARIS])),
    "parameters, as Llama 3 writes them": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [PARIS])),
    "arguments that are no object": ('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
                                     ('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', [])),
    "JSON that names a tool among other keys": ('{"name": "get_weather", "version": 2}', ('{"name": "get_weather", "version": 2}', [])),
    "a block beside words": ('Like this:\n```json\n{"name": "get_weather"}\n```', ('Like this:\n```json\n{"name": "get_weather"}\n```', [])),
    "words and white space before a call": ("Let me check.\n\n" + CALL, ("Let me check.", [PARIS])),
    "words after the call": ("Checking.\n" + CALL + "\nI will tell you when I know.\n", ("Checking.\n\nI will tell you when I know.", [PARIS])),
    "plain words": ("It is sunny, I think.", ("It is sunny, I think.", [])),
    "a tag's beginning, and no tag": ("a <tool_ca", ("a <tool_ca", [])),
    "brackets nested deeper than Python reads JSON": ("[" * 3000, ("[" * 3000, [])),
    "a number longer than Python reads": (LONG_NUMBER, (LONG_NUMBER, [])),
}


@pytest.mark.parametrize("name", TEXTS)
def test_calls_are_read_out_of_what_the_model_wrote(name):
    text, expected = TEXTS[name]
    assert tools.split(text, NAMES) == expected


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_content_never_shows_a_call_and_adds_up_to_the_whole(name):
    """However the text arrives in pieces, the content streamed before the end begins the whole
    answer's content where it has calls (never a piece of one), and is all of its text where it has none."""
    text, (content, calls) = TEXTS[name]
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = tools.ContentText()
        sent = "".join(stream.push(piece) for piece in pieces)
        assert stream.text == text
        if calls:
            assert (content or "").startswith(sent) and OPEN not in sent  # the rest is sent at the end
        else:
            assert sent + stream.held() == text


def test_reading_calls_takes_time_in_step_with_the_text():
    """A small model stuck writing blank lines after an unclosed fence, or white space inside a call:
    regexes took minutes over these (cubic, quadratic), on the event loop, and every client waited.
    Read in a process of its own, so that a slow reading fails the test rather than hanging it."""
    code = ("from specllm.server import tools\n"
            "assert tools.split('```json\\n{\\n' + '    \\n' * 20000, ['f'])[1] == []\n"
            "assert tools.split('<tool_call>x' + ' ' * 200000 + 'y', ['f'])[1] == []\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_a_required_call_is_begun_in_the_prompt_up_to_its_name():
    assert tools.prefill("auto") == ""
    required = tools.prefill("required")
    assert required == '<tool_call>\n{"name": "'  # a bare tag, and Qwen2.5-Coder 1.5B ends its answer there
    assert tools.split(required + 'get_weather", "arguments": {"city": "Paris"}}', NAMES) == (None, [PARIS])
    named = tools.prefill({"type": "function", "function": {"name": "get_weather"}})
    assert tools.split(named + ' {"city": "Paris"}}\n</tool_call>', NAMES) == (None, [PARIS])
    stream = tools.ContentText(named)
    assert stream.push(' {"city": "Paris"}}') == "" and tools.split(stream.text, NAMES) == (None, [PARIS])
    cut = tools.ContentText(named)
    cut.push(' {"ci')
    assert cut.held() == ' {"ci'  # a call left unreadable is sent as what the model wrote, not the prompt's markup


# -- through the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_server(tiny_dir):
    path = write_tiny_gguf(tiny_dir / "tiny-tools.gguf", 0, chat_template=TOOLS_TEMPLATE)
    engine = Engine(ModelPaths(path), SpecConfig("off"), TINY, TINY)
    decoder = Scripted()
    try:
        with running(Service(engine, "tiny", make_decoder=lambda: decoder)) as url:
            yield url, decoder, engine
    finally:
        engine.close()


def ask(server, script: list[str], messages=ASK, **kwargs):
    """The whole reply and the streamed one's chunks for the same request, the decoder writing `script`."""
    url, decoder, _ = server
    decoder.script = script
    api = client(url)
    whole = api.chat.completions.create(model="tiny", messages=messages, **kwargs)
    chunks = [c for c in api.chat.completions.create(model="tiny", messages=messages, stream=True, **kwargs) if c.choices]
    return whole.choices[0], chunks


def streamed_calls(chunks) -> list[dict]:
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    return [{"name": call.function.name, "arguments": call.function.arguments} for call in calls]


def test_words_after_a_call_are_content_whole_and_streamed(scripted_server):
    script = ["<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>", "\nThen I will ", "answer."]
    whole, chunks = ask(scripted_server, script, tools=[WEATHER, TIME])
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Then I will answer."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Then I will answer."
    assert streamed_calls(chunks) == [{"name": "get_time", "arguments": "{}"}]


def test_a_call_comes_back_as_tool_calls_whole_and_streamed(scripted_server):
    script = ["Let me", " look.\n<tool", "_call>\n{\"name\": \"get_weather\", ", '"arguments": {"city": "Paris"}}\n</tool_call>']
    whole, chunks = ask(scripted_server, script, tools=[WEATHER, TIME])
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me look."
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Let me look."
    assert streamed_calls(chunks) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_an_answer_without_a_call_is_text_whole_and_streamed(scripted_server):
    script = ["```", "python\n", "print('hi')\n```"]
    whole, chunks = ask(scripted_server, script, tools=[WEATHER])
    assert whole.finish_reason == "stop" and whole.message.content == "".join(script) and not whole.message.tool_calls
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(script) and not streamed_calls(chunks)


def test_a_lone_surrogate_the_model_escaped_in_a_call_goes_out_escaped(scripted_server):
    """JSON's "\\ud83d" without its pair reads as a character UTF-8 cannot carry: it made a 500 and
    cut the stream short; on the wire it is the escape the model wrote, which a client reads back."""
    script = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\ud83d"}}</tool_call>']
    whole, chunks = ask(scripted_server, script, tools=[WEATHER])
    arguments = '{"city": "Paris \ud83d"}'
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.arguments == arguments
    assert streamed_calls(chunks) == [{"name": "get_weather", "arguments": arguments}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_tools_and_earlier_calls_reach_the_template(scripted_server):
    """The prompt holds each tool's definition and the earlier call and its result, as the template writes them."""
    _, decoder, engine = scripted_server
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 14}'},
    ]  # fmt: skip
    whole, _ = ask(scripted_server, ["It is 14 degrees."], tools=[WEATHER], messages=history)
    assert whole.message.content == "It is 14 degrees." and whole.finish_reason == "stop"
    prompt = "".join(engine.target.token_bytes(t).decode() for t in decoder.prompts[-1])
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"celsius": 14}\n</tool_response>' in prompt
    decoder.script = ["Hello"]
    client(scripted_server[0]).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in "".join(engine.target.token_bytes(t).decode() for t in decoder.prompts[-1])


def test_a_named_tool_choice_begins_the_call_in_the_prompt(scripted_server):
    _, decoder, engine = scripted_server
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole, chunks = ask(scripted_server, ["{}}\n</tool_call>"], tools=[WEATHER, TIME], tool_choice=choice)
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.name == "get_time"
    assert streamed_calls(chunks) == [{"name": "get_time", "arguments": "{}"}]
    prompt = "".join(engine.target.token_bytes(t).decode() for t in decoder.prompts[-1])
    assert prompt.endswith('assistant\n<tool_call>\n{"name": "get_time", "arguments":')  # control tokens read as nothing


BAD_TOOLS = {
    "tools not an array": ({"tools": {"name": "f"}}, "tools"),
    "a tool without a name": ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    "a tool of another type": ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    "an unknown tool_choice": ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    "a tool_choice naming no tool": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    "a call required of no tools": ({"tool_choice": "required"}, "tool_choice"),
    "a name with spaces": ({"tools": [{"type": "function", "function": {"name": "my func!"}}]}, "tools[0].function.name"),
    "two tools of one name": ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    "parameters that are no object": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "oops"}}]}, "tools[0].function.parameters"),
    "an earlier call without a name": ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[1].tool_calls[0]"),
}


def test_bad_tools_get_an_openai_error(scripted_server):
    url = scripted_server[0]
    for name, (fields, param) in BAD_TOOLS.items():
        status, answer = raw(url, "POST", "/v1/chat/completions", {"messages": ASK, **fields})
        assert status == 400 and answer["error"]["param"] == param, (name, answer)


def test_a_model_whose_template_takes_no_tools_says_so(tiny_pair):
    engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig("off"), TINY, TINY)
    try:
        with running(Service(engine, "tiny")) as url:
            with pytest.raises(openai.BadRequestError, match="does not take tools"):
                client(url).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
            assert client(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices[0].message.content is not None
    finally:
        engine.close()


# -- the default pair writes its own calls ---------------------------------------------------------


@pytest.mark.real
def test_qwen_calls_the_weather_tool_and_reads_its_result(qwen_engine):
    """An agent's turn on Qwen2.5-Coder 1.5B: asked about the weather with a weather tool, it calls it
    for Paris (whole and streamed alike); the call and its result sent back render and are served,
    the prompt's prefix reused; with a call required, it calls the weather tool."""
    with running(Service(qwen_engine, "qwen")) as url:
        api = client(url)
        whole = api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0)
        chunks = [c for c in api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=64,
                                                         temperature=0, stream=True) if c.choices]  # fmt: skip
        assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0].message
        (call,) = whole.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)  # "Paris" or "Paris, France": kernels may tip a near tie
        assert call.function.name == "get_weather" and set(arguments) == {"city"} and "Paris" in arguments["city"]
        assert streamed_calls(chunks) == [{"name": "get_weather", "arguments": call.function.arguments}]
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 14, "sky": "cloudy"})}]  # fmt: skip
        after = api.chat.completions.create(model="qwen", messages=history, tools=[WEATHER], max_tokens=48, temperature=0)
        assert after.choices[0].finish_reason in ("stop", "tool_calls", "length")
        assert after.usage.prompt_tokens_details.cached_tokens > whole.usage.prompt_tokens // 2
        # required: the call begun in the prompt up to its name (after a bare tag this model ends its answer)
        required = api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                               max_tokens=48, temperature=0)  # fmt: skip
        assert required.choices[0].finish_reason == "tool_calls", required.choices[0].message
        assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
