"""Turning text and conversations into tokens (no I/O).

The model's chat template renders the conversation; the template's own markup is tokenized
with special tokens parsed, while what users and the model wrote is tokenized as plain
text, so a typed "<|im_end|>" can never close a turn or open a role. A raw prompt is the
text as the model reads it, markup included (a client that formats its own chat or
fill-in-the-middle prompt writes "<|im_start|>" or "<|fim_prefix|>"), as llama.cpp reads one.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime

from specllm.engine.sampling import SamplingParams
from specllm.errors import UsageError
from specllm.reasoning import CLOSE, HARMONY, OPEN, HarmonySplitter, ThinkSplitter, template_thinks


def encode_raw(backend, text: str) -> list[int]:
    """A prompt sent as is (with BOS where the model wants one), special tokens' text parsed as them."""
    return backend.tokenize(text, add_special=True, parse_special=True)


def encode_infill(backend, prefix: str, suffix: str) -> list[int]:
    """A fill-in-the-middle prompt: the model's FIM tokens around the code before and after the gap
    (prefix, suffix, middle: the order Qwen2.5-Coder, StarCoder and CodeLlama are trained on, and
    llama.cpp's /infill sends), the code itself tokenized as plain text. UsageError where the model
    has no FIM tokens."""
    pre, suf, mid = _fim_tokens(backend)
    return _start(backend) + [pre] + backend.tokenize(prefix) + [suf] + backend.tokenize(suffix) + [mid]


def _fim_tokens(backend) -> tuple[int, int, int]:
    """The model's (prefix, suffix, middle) FIM tokens; UsageError where it has none."""
    fim = backend.fim_tokens()
    if fim is None:
        raise UsageError(f"{backend.path.name} has no fill-in-the-middle tokens")
    return fim


def _start(backend) -> list[int]:
    """What every prompt begins with: the BOS token, where the model wants one."""
    return backend.tokenize("", add_special=True, parse_special=False) if getattr(backend, "add_bos", False) else []


# llama.cpp's server reads an /infill request into a batch of this many tokens (its default `-b`):
# the code before the gap keeps its last three quarters of it, the code after the first quarter, and
# the files sent beside them fill what the context has left, the same for every request (so a
# request that only warms the cache, `n_predict` 0, and the completion after it share the files'
# tokens). specllm cuts alike, keeping INFILL_ANSWER tokens twice over for the answer where
# llama.cpp keeps its server-wide `-n`'s (none by default, and then a full gap overflows); in a
# context too small for both (`-c` under 2560) the batch shrinks to what the answer leaves.
INFILL_BATCH = 2048
INFILL_ANSWER = 256  # the most llama.vim asks for (llama.vscode: 128): at least 510 tokens are left for it
INFILL_PROJECT = "myproject"  # the repository's name in the repo-level layout, as llama.cpp's server writes it
INFILL_FILE = "filename"  # and the name of the file being edited, which /infill does not send


def encode_repo_infill(backend, prefix: str, suffix: str, prompt: str = "", extra: list[tuple[str, str]] = ()) -> list[int]:
    """llama.cpp's /infill prompt: other files of the project (`extra`: (filename, text), oldest
    first) in Qwen2.5-Coder's repo-level layout where the model has its tokens (a plain separator
    between snippets where not), then the gap: FIM prefix, the code before it and `prompt` (the
    line typed so far), FIM suffix, the code after it, FIM middle. Cut to fit as llama.cpp's server
    cuts it (`INFILL_BATCH`, `INFILL_ANSWER`; a BOS, where the model wants one, comes first:
    llama.cpp's server puts it after the files). UsageError where the model has no FIM tokens."""
    pre, suf, mid = _fim_tokens(backend)
    repo, sep = backend.fim_repo_tokens()
    context: list[int] = []
    if repo is not None:
        context += [repo] + backend.tokenize(f"{INFILL_PROJECT}\n")
    for filename, text in extra:
        context += [sep] + backend.tokenize(f"{filename}\n") if sep is not None else backend.tokenize("\n\n--- snippet ---\n\n")
        context += backend.tokenize(text)
    if sep is not None:
        context += [sep] + backend.tokenize(f"{INFILL_FILE}\n")
    typed = backend.tokenize(prompt)
    batch = max(0, min(INFILL_BATCH, backend.n_ctx - 2 * INFILL_ANSWER))
    code_before = backend.tokenize(prefix)
    before = code_before[max(0, len(code_before) - 3 * (batch // 4)) :]
    after = backend.tokenize(suffix)[: max(0, batch // 4 - (2 + len(typed)))]
    room = max(0, backend.n_ctx - batch - 2 * INFILL_ANSWER)
    context = context[len(context) - min(room, len(context)) :]  # the latest files first
    return _start(backend) + context + [pre] + before + typed + [suf] + after + [mid]


def encode_messages(backend, messages: list[dict], add_assistant: bool = True, tools: list[dict] | None = None, prefill: str = "",
                    variables: dict | None = None) -> list[int]:  # fmt: skip
    """Render with the model's chat template; contents are tokenized without parsing special tokens.
    `tools` (OpenAI's function definitions) go to the template, and `variables` (a client's
    `chat_template_kwargs`, such as Qwen3's `enable_thinking`); `prefill` is markup the answer
    starts with (a tool call's opening, where one is required)."""
    template = _template(backend)
    if template is not None and template.thinks:  # what the template does with earlier answers' reasoning, had it seen the text
        messages = reasoning_apart(messages)
    # Private-use characters: no template's `trim` (Python's strip) removes them, as it would \x1f.
    marker = f"\ue000specllm{secrets.token_hex(4)}:"
    texts: list[str] = []  # what each placeholder stands for

    def hold(text: str) -> str:
        texts.append(text)
        return f"{marker}{len(texts) - 1}\ue001"

    # an empty content stays empty: templates test it ("if message.content")
    placeholders = [{**m, **{f: hold(m[f]) for f in TEXT_FIELDS if isinstance(m.get(f), str) and m[f]}} for m in messages]
    rendered = backend.apply_chat_template(placeholders, add_assistant, tools, variables) + prefill
    tokens = _start(backend)
    if tokens and template is not None and template.bos_token and rendered.startswith(template.bos_token):
        rendered = rendered[len(template.bos_token) :]  # the template's BOS is the one the tokenizer adds: once
    pattern = re.compile(re.escape(marker) + r"(\d+)\ue001")
    position = 0
    for match in pattern.finditer(rendered):
        tokens += backend.tokenize(rendered[position : match.start()], parse_special=True)
        tokens += backend.tokenize(texts[int(match.group(1))], parse_special=False)
        position = match.end()
    tokens += backend.tokenize(rendered[position:], parse_special=True)
    return tokens


TEXT_FIELDS = ("content", "reasoning_content")  # what users and models wrote: never read as markup


def reasoning_apart(messages: list[dict]) -> list[dict]:
    """Earlier answers of a thinking model as its template reads them, when a client sends them back
    with their <think> block: before the last user message the reasoning is dropped (Qwen3's, QwQ's
    and R1's templates drop it), after it (the steps of a tool loop) it goes as `reasoning_content`,
    which Qwen3's template writes back in its block. An answer sent with its own `reasoning_content`
    (a chat's, a client's that reads ours) is told apart already: its content stays whole, as Qwen3's
    template keeps it, so an answer about the tags ("close it with </think>") is not cut."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        apart = isinstance(message.get("reasoning_content"), str)
        if message.get("role") != "assistant" or not isinstance(content, str) or CLOSE not in content or apart:
            out.append(message)
            continue
        answer = content.split(CLOSE)[-1].lstrip("\n")
        reasoning = content.split(CLOSE)[0].split(OPEN)[-1].strip("\n")
        out.append({**message, "content": answer} if i < last_user else {"reasoning_content": reasoning, **message, "content": answer})
    return out


def thinking_variables(backend, think: bool) -> dict | None:
    """The template variables for `think` (False: `--no-think`): None where the model's template
    does not think (nothing to turn off); UsageError where its every answer thinks, with no switch."""
    template = _template(backend)
    if think or template is None or not template.thinks:
        return None
    if template.can_stop_thinking:
        return {"enable_thinking": False}
    if template.thinks == HARMONY:  # gpt-oss: its template's reasoning_effort only shortens the analysis
        raise UsageError(f"--no-think: {backend.path.name} (gpt-oss's harmony format) reasons in every answer and has no switch to answer at once")
    if template.opens_thinking:  # R1's, QwQ's: every answer begins inside a thinking block
        raise UsageError(f"--no-think: the chat template of {backend.path.name} opens a thinking block in every answer and has no switch to answer at once")
    return None  # it only strips earlier turns' reasoning (Qwen3's 2507 Instruct): nothing to turn off


def reasoning_splitter(backend, prompt: list[int]) -> ThinkSplitter | HarmonySplitter:
    """What tells the reply to `prompt` into reasoning and answer: where the model's template thinks,
    by the tags or by harmony's channels (gpt-oss; the prompt's end says whether the block or the
    message is open already); else all answer."""
    template = _template(backend)
    if template is None or not template.thinks:
        return ThinkSplitter(thinks=False)
    tail = b"".join(backend.token_bytes(t) for t in prompt[-16:]).decode("utf-8", "replace")
    return HarmonySplitter(tail) if template.thinks == HARMONY else ThinkSplitter(tail)


def _template(backend) -> "ChatTemplate | None":
    return backend.chat_template() if hasattr(backend, "chat_template") else None  # test doubles have none


class ChatTemplate:
    """A model's Jinja chat template, rendered as Transformers renders it: sandboxed, `tojson` keeping
    key order and non-ASCII text, `raise_exception` and `strftime_now` at hand, `bos_token` the
    model's (Llama 2's template opens every user turn with it; `encode_messages` drops the leading
    one where the tokenizer adds BOS itself). A template with no system role (Gemma 2's refuses one,
    Phi-3 mini's leaves it out) gets the system prompt in the user turn after it."""

    def __init__(self, text: str, eos_token: str, bos_token: str = ""):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(text)  # jinja2.TemplateError where it cannot compile
        self.eos_token, self.bos_token = eos_token, bos_token
        self.takes_tools = "tools" in text
        self.writes_tool_call_tags = "<tool_call>" in text  # Qwen2.5's and Hermes' format
        self.thinks = template_thinks(text)  # Qwen3, QwQ, DeepSeek-R1's distillations
        self.can_stop_thinking = "enable_thinking" in text  # Qwen3's switch

    @functools.cached_property
    def opens_thinking(self) -> bool:
        """Whether the generation prompt itself opens a thinking block (R1's and QwQ's templates do)."""
        try:
            return self.render([{"role": "user", "content": "?"}]).rstrip().endswith(OPEN)
        except Exception:  # noqa: BLE001 - a template that needs more than one user message
            return False

    @functools.cached_property
    def takes_system(self) -> bool:
        """Whether a system message's text reaches the prompt (Gemma 2's template raises on one,
        Phi-3 mini's and Mistral v0.2's have no place for it), as llama.cpp's server probes it."""
        probe = "\ue000system\ue001"
        try:
            return probe in self._render([{"role": "system", "content": probe}, {"role": "user", "content": "?"}], True, None, None)
        except Exception:  # noqa: BLE001 - the template refused the system message
            return False

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               variables: dict | None = None) -> str:  # fmt: skip
        if not self.takes_system and any(m.get("role") == "system" for m in messages):
            messages = system_in_user_turns(messages)
        return self._render(messages, add_generation_prompt, tools, variables)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None, variables: dict | None) -> str:
        fixed = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                 "bos_token": self.bos_token, "eos_token": self.eos_token}  # fmt: skip
        return self._template.render({**(variables or {}), **fixed})  # a variable never replaces the messages


def system_in_user_turns(messages: list[dict]) -> list[dict]:
    """The messages for a template with no system role: a system message's text opens the next user
    message, a blank line between (as llama.cpp writes Gemma's prompt); one that no user message
    follows becomes one. An empty system message (`--system ''`) adds nothing."""
    out, pending = [], []
    for message in messages:
        if message.get("role") == "system":
            pending += [message["content"]] if message.get("content") else []
            continue
        if message.get("role") == "user" and pending:
            message = {**message, "content": "\n\n".join(pending + ([message["content"]] if message.get("content") else []))}
            pending = []
        out.append(message)
    return out + ([{"role": "user", "content": "\n\n".join(pending)}] if pending else [])


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


@dataclass
class Conversation:
    """The messages of a chat so far; the decoder reuses the KV cache of their common prefix."""

    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def all_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []  # "": no system prompt, not the template's default
        return head + self.messages

    def add(self, role: str, content: str, reasoning: str | None = None) -> None:
        """`reasoning`: a thinking model's, told apart from its answer `content` (which then stays whole)."""
        self.messages.append({"role": role, "content": content} | ({"reasoning_content": reasoning} if reasoning is not None else {}))

    def withdraw(self) -> None:
        """Drop the last message (a user turn that got no reply)."""
        self.messages.pop()

    def clear(self) -> None:
        self.messages.clear()


# -- chat input: commands, settings, multi-line blocks (pure; the CLI does the I/O) --------

COMMANDS = {
    "/help": "show this help",
    "/stats": "statistics of this session",
    "/set": "change a setting: /set temp 0.7 (temp, top_k, top_p, min_p, seed, max_tokens); /set alone shows them",
    "/spec": "speculation strategy: /spec off|ngram|draft|ngram+draft|auto",
    "/clear": "start a new conversation (the system prompt stays)",
    "/bye": "leave (also {eof})",
}
ALIASES = {"/?": "/help", "/exit": "/bye", "/quit": "/bye"}
_COMMAND_WORD = re.compile(r"/(\?|[A-Za-z][\w-]*)")


@dataclass(frozen=True)
class Command:
    name: str  # canonical, e.g. "/bye"; an unknown command keeps what was typed
    args: list[str]
    known: bool


def parse_command(line: str) -> Command | None:
    """A line whose first word looks like `/word` is a command; anything else (say "/usr/bin") is a message."""
    words = line.split()
    if not words or not _COMMAND_WORD.fullmatch(words[0]):
        return None
    name = ALIASES.get(words[0].lower(), words[0].lower())
    return Command(name, words[1:], name in COMMANDS)


def end_of_input_keys() -> str:
    """The keys that end a terminal's input: Ctrl-D, on Windows Ctrl-Z then Enter (Ctrl-D types ^D there)."""
    return "Ctrl-Z then Enter" if sys.platform == "win32" else "Ctrl-D"


def help_text() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {text.format(eof=end_of_input_keys())}" for name, text in COMMANDS.items()]
    lines.append('  """{0:<{1}}  begin and end a message of several lines'.format("", width - 3))
    return "Commands:\n" + "\n".join(lines)


def command_names() -> str:
    return " ".join(COMMANDS)


@dataclass(frozen=True)
class ChatSettings:
    """What /set changes: the sampling parameters and the most tokens per reply."""

    params: SamplingParams
    max_tokens: int

    def describe(self) -> str:
        p = self.params
        seed = "random" if p.seed is None else p.seed
        return (
            f"temp {p.temperature:g} · top_k {p.top_k} · top_p {p.top_p:g} · min_p {p.min_p:g} · "
            f"seed {seed} · max_tokens {self.max_tokens}"
        )


SETTING_NAMES = ("temp", "top_k", "top_p", "min_p", "seed", "max_tokens")
_SETTING_ALIASES = {"temperature": "temp", "num_predict": "max_tokens", "n": "max_tokens"}


def apply_set(settings: ChatSettings, args: list[str]) -> ChatSettings:
    """`/set NAME VALUE` as a new ChatSettings; UsageError (settings untouched) when it cannot apply."""
    usage = f"usage: /set NAME VALUE, NAME one of {', '.join(SETTING_NAMES)}"
    if len(args) != 2:
        raise UsageError(usage)
    name = args[0].lower().replace("-", "_")
    name = _SETTING_ALIASES.get(name, name)
    value = args[1]
    if name not in SETTING_NAMES:
        raise UsageError(f"unknown setting {args[0]!r}; {usage}")
    if name == "max_tokens":
        number = _number(name, value, int)
        if number < 1:
            raise UsageError(f"max_tokens must be at least 1, got {number}")
        return replace(settings, max_tokens=number)
    if name == "seed":
        seed = None if value.lower() in ("none", "random", "-1") else _number(name, value, int)
        params = replace(settings.params, seed=seed)
    else:
        field_name = {"temp": "temperature"}.get(name, name)
        number = _number(name, value, int if name == "top_k" else float)
        params = replace(settings.params, **{field_name: number})
    params.validate({"temperature": "temp"})  # the settings' names: temp, top_k, top_p, min_p, seed
    return replace(settings, params=params)


def _number(name: str, value: str, kind: type):
    try:
        return kind(value)
    except ValueError:
        word = "a whole number" if kind is int else "a number"
        raise UsageError(f"{name} must be {word}, got {value!r}") from None


class MultiLine:
    '''Gathers a message typed between `"""` lines; text on the opening or closing line counts.'''

    QUOTES = '"""'

    def __init__(self):
        self._lines: list[str] | None = None

    @property
    def open(self) -> bool:
        return self._lines is not None

    def starts(self, line: str) -> bool:
        return line.lstrip().startswith(self.QUOTES)

    @classmethod
    def wraps(cls, text: str) -> bool:
        '''Whether `text` (a block pasted at once) is a whole `"""` block, opened and closed.'''
        text = text.strip()
        return len(text) >= 2 * len(cls.QUOTES) and text.startswith(cls.QUOTES) and text.endswith(cls.QUOTES)

    def feed(self, line: str) -> str | None:
        """The whole message when `line` completes one, else None (more lines wanted)."""
        if self._lines is None:
            rest = line.lstrip()[len(self.QUOTES) :]
            if rest.rstrip().endswith(self.QUOTES):  # """one line"""
                return rest.rstrip()[: -len(self.QUOTES)]
            self._lines = [rest] if rest.strip() else []
            return None
        if line.rstrip().endswith(self.QUOTES):
            last = line.rstrip()[: -len(self.QUOTES)]
            lines = self._lines + ([last] if last.strip() else [])
            self._lines = None
            return "\n".join(lines)
        self._lines.append(line)
        return None

    def cancel(self) -> bool:
        """Drop a half-typed block; True when there was one."""
        was_open, self._lines = self.open, None
        return was_open
