"""A thinking model's reasoning, told apart from its answer (pure; the CLI and the server do the I/O).

Qwen3, QwQ and DeepSeek-R1's distillations reason between <think> and </think>, then answer; their
chat templates write or strip those tags (that is how a thinking model is recognised). The generation
prompt may open the block itself (QwQ's and R1's templates end with "<think>\\n"), close an empty
one (Qwen3's with `enable_thinking` false), or leave the model to open it (Qwen3's default). As
llama.cpp's server and DeepSeek's API give it: the reasoning without the tags and the blank lines
around it, the answer from its first character after </think>.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


def template_thinks(template_text: str) -> bool:
    return OPEN in template_text or CLOSE in template_text


class ThinkSplitter:
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

    def read(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (its reasoning, None where there was none; its answer)."""
        self.push(text)
        self.finish()
        return ("".join(self.reasoning) or None), "".join(self.content)

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
