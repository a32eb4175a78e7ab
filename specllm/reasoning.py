"""A thinking model's reasoning, told apart from its answer (pure; the CLI and the server do the I/O).

Qwen3, QwQ and DeepSeek-R1's distillations reason between <think> and </think>, then answer; their
chat templates write or strip those tags (that is how a thinking model is recognised). The generation
prompt may open the block itself (QwQ's and R1's templates end with "<think>\\n"), close an empty
one (Qwen3's with `enable_thinking` false), or leave the model to open it (Qwen3's default). As
llama.cpp's server and DeepSeek's API give it: the reasoning without the tags and the blank lines
around it, the answer from its first character after </think>.

OpenAI's gpt-oss models speak "harmony" instead: messages `<|start|>{role}<|channel|>{channel}<|message|>
{text}<|end|>`, the generation prompt ending `<|start|>assistant`; `HarmonySplitter` reads them.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"
TAGS, HARMONY = "tags", "harmony"  # how a model's reasoning is marked: <think> tags, or harmony's channels


def template_thinks(template_text: str) -> str:
    """How the model of a chat template reasons: HARMONY (gpt-oss), TAGS (<think>), "" (it does not)."""
    if CHANNEL in template_text and MESSAGE in template_text:
        return HARMONY
    return TAGS if OPEN in template_text or CLOSE in template_text else ""


class _Splitter:
    """What both kinds of splitter share: streamed text in (`push`, then `finish`), (REASONING |
    CONTENT, text) pieces out, each kind's pieces kept in `reasoning` and `content`."""

    reasoning: list[str]
    content: list[str]

    def read(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (its reasoning, None where there was none; its answer)."""
        self.push(text)
        self.finish()
        return ("".join(self.reasoning) or None), "".join(self.content)


class ThinkSplitter(_Splitter):
    """Streamed text in, (REASONING | CONTENT, text) pieces out, a tag cut between pieces held back;
    for a model that does not think (`thinks` False), every piece is answer."""

    def __init__(self, prompt_tail: str = "", thinks: bool = True):
        self.thinks = thinks
        tail = prompt_tail.rstrip()
        # "open": the model may begin with <think> (only whitespace before it); "think"; "between"
        # (after </think>, before the answer's first character); "answer"
        self._state = "answer" if not thinks or tail.endswith(CLOSE) else "think" if tail.endswith(OPEN) else "open"
        self._held = ""
        self._started = False  # whether reasoning text has been given (its leading blank lines dropped)
        self.reasoning, self.content = [], []

    def push(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        pieces: list[tuple[str, str]] = []
        while self._held:
            if self._state == "open":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self._held = "think", stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):
                    break  # "", "<", "<thi": not known yet
                else:
                    self._state = "answer"
            elif self._state == "think":
                end = self._held.find(CLOSE)
                if end >= 0:
                    self._emit(pieces, REASONING, self._held[:end].rstrip())
                    self._state, self._held = "between", self._held[end + len(CLOSE) :]
                    continue
                # keep back what may still be the start of </think>, and trailing blanks (dropped before it)
                keep = _partial_suffix(self._held, CLOSE)
                body = self._held[: len(self._held) - keep]
                cut = len(body.rstrip())
                self._emit(pieces, REASONING, body[:cut])
                self._held = self._held[cut:]
                break
            elif self._state == "between":
                self._held = self._held.lstrip()
                if self._held:
                    self._state = "answer"
            else:
                self._emit(pieces, CONTENT, self._held)
                self._held = ""
        return pieces

    @property
    def reasoning_open(self) -> bool:
        """Whether the text so far ends inside the thinking block (its </think> not come yet)."""
        return self._state == "think"

    def finish(self) -> list[tuple[str, str]]:
        """What is held when the text ends: reasoning cut off by the token limit, or an answer of blanks."""
        held, self._held = self._held, ""
        pieces: list[tuple[str, str]] = []
        if self._state == "think":
            self._emit(pieces, REASONING, held.rstrip())
        elif self._state in ("open", "answer"):
            self._emit(pieces, CONTENT, held)
        return pieces

    def _emit(self, pieces: list, kind: str, text: str) -> None:
        if kind == REASONING and not self._started:
            text = text.lstrip("\n")
            self._started = bool(text)
        if text:
            pieces.append((kind, text))
            (self.reasoning if kind == REASONING else self.content).append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag cut between pieces)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# -- harmony (gpt-oss) -----------------------------------------------------------------------------

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKUP = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
_MARKUP = re.compile("|".join(re.escape(m) for m in MARKUP))
CHANNELS = {"analysis": REASONING, "final": CONTENT, "commentary": CONTENT}  # commentary: a preamble, as llama.cpp gives it


class HarmonySplitter(_Splitter):
    """ThinkSplitter's interface for gpt-oss's harmony messages, as llama.cpp's server reads them:
    the `analysis` channel is reasoning, `final` the answer, and so is `commentary` with no
    recipient (a preamble to a tool call, meant for the user); a message to a tool (`to=...`, a
    call specllm cannot make for this format) or from another role is neither, and the markup is
    never given. llama.cpp renders <|start|>, <|channel|>, <|message|>, <|constrain|> and <|end|> as
    text and ends the generation at <|return|> or <|call|>, so the analysis' <|end|> is followed by
    the final message. A second message of the same kind comes after a blank line."""

    thinks = True

    def __init__(self, prompt_tail: str = ""):
        # "header" (role, recipient, channel: up to <|message|>), "body", "between" (after a message's end)
        self._state, self._held, self._kind = "header", "", None
        self._fresh = False  # a body whose first text is not given yet (a blank line before it, if its kind has text)
        self._first, self._from_prompt = True, 0  # in the first header (no body yet); how much of it the prompt wrote
        self.reasoning, self.content = [], []
        self._quiet = True  # the prompt's own part of the message (its "assistant", a prefilled header): read, not given
        self.push(prompt_tail[prompt_tail.rfind(START) + len(START) :] if START in prompt_tail else "")
        self._quiet = False
        self._from_prompt = len(self._held) if self._state == "header" else 0

    def push(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        pieces: list[tuple[str, str]] = []
        while self._held:
            if self._state == "header":
                end = self._held.find(MESSAGE)
                if end >= 0:
                    self._open(_message_kind(self._held[:end]))
                    self._held = self._held[end + len(MESSAGE) :]
                elif self._first and _plain(self._held[self._from_prompt :]):  # no harmony at all: all answer
                    self._held = self._held[self._from_prompt :]
                    self._open(CONTENT)
                else:
                    break
            elif self._state == "body":
                found = _MARKUP.search(self._held)
                if found is None:
                    keep = max(_partial_suffix(self._held, marker) for marker in MARKUP)
                    self._emit(pieces, self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    break
                self._emit(pieces, self._held[: found.start()])
                marker, self._held = found.group(), self._held[found.end() :]
                if marker in (START, CHANNEL):  # a new message, its <|end|> left out
                    self._state, self._held = "header", (CHANNEL if marker == CHANNEL else "") + self._held
                elif marker in (END, RETURN, CALL):
                    self._state = "between"
                # a stray <|message|> or <|constrain|> in a body: dropped, the body goes on
            else:  # text between messages is no message's (llama.cpp skips it too)
                start = self._held.find(START)
                if start < 0:
                    self._held = self._held[len(self._held) - _partial_suffix(self._held, START) :]
                    break
                self._state, self._held = "header", self._held[start + len(START) :]
        return pieces

    @property
    def reasoning_open(self) -> bool:
        """Whether the text so far ends inside an analysis message (its <|end|> not come yet)."""
        return self._state == "body" and self._kind == REASONING

    def finish(self) -> list[tuple[str, str]]:
        """What is held when the text ends: a body's last characters (what looked like a marker's
        start), or a reply with no harmony at all (all answer); a header cut off is dropped."""
        held, self._held = self._held, ""
        pieces: list[tuple[str, str]] = []
        if self._state == "body":
            self._emit(pieces, held)
        elif self._state == "header" and self._first and not _MARKUP.search(held[self._from_prompt :]):
            self._kind, self._fresh = CONTENT, True
            self._emit(pieces, held[self._from_prompt :])
        return pieces

    def _open(self, kind: str | None) -> None:
        self._state, self._kind, self._fresh, self._first = "body", kind, True, False

    def _emit(self, pieces: list, text: str) -> None:
        if not text or self._kind is None or self._quiet:
            return
        given = self.reasoning if self._kind == REASONING else self.content
        if self._fresh and given:
            text = "\n\n" + text
        self._fresh = False
        pieces.append((self._kind, text))
        given.append(text)


def _message_kind(header: str) -> str | None:
    """REASONING, CONTENT or None (not for the user) for a message's header: its role (the
    assistant's, or none where the prompt gave it), a recipient (`to=functions.get_weather`,
    before or after the channel), <|channel|> and the channel's name, a content type."""
    role = _MARKUP.split(header, 1)[0].split(" to=")[0].strip()
    if role not in ("", "assistant") or "to=" in header:
        return None
    if CHANNEL not in header:
        return CONTENT  # an assistant's message with no channel: its answer
    name = re.match(r"\s*([\w-]*)", header.split(CHANNEL, 1)[1]).group(1)
    return CHANNELS.get(name)


def _plain(text: str) -> bool:
    """Whether text where a header should be is plain text (a line ended, no marker before it): a
    header is one line with markup."""
    line = text.lstrip().partition("\n")
    return bool(line[1]) and not _MARKUP.search(line[0])
