"""Turning text and conversations into tokens (no I/O).

The model's chat template renders the conversation; the template's own markup is tokenized
with special tokens parsed, while what users and the model wrote is tokenized as plain
text, so a typed "<|im_end|>" can never close a turn or open a role.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field


def encode_raw(backend, text: str) -> list[int]:
    """A prompt sent as is (with BOS where the model wants one); special-token text stays text."""
    tokens = backend.tokenize(text, add_special=True, parse_special=False)
    return tokens


def encode_messages(backend, messages: list[dict[str, str]], add_assistant: bool = True) -> list[int]:
    """Render with the model's chat template; contents are tokenized without parsing special tokens."""
    marker = f"\x1fspecllm{secrets.token_hex(4)}:"
    placeholders = [{"role": m["role"], "content": f"{marker}{i}\x1f"} for i, m in enumerate(messages)]
    rendered = backend.apply_chat_template(placeholders, add_assistant)
    tokens: list[int] = []
    if getattr(backend, "add_bos", False):
        tokens += backend.tokenize("", add_special=True, parse_special=False)
    pattern = re.compile(re.escape(marker) + r"(\d+)\x1f")
    position = 0
    for match in pattern.finditer(rendered):
        tokens += backend.tokenize(rendered[position : match.start()], parse_special=True)
        tokens += backend.tokenize(messages[int(match.group(1))]["content"], parse_special=False)
        position = match.end()
    tokens += backend.tokenize(rendered[position:], parse_special=True)
    return tokens


@dataclass
class Conversation:
    """The messages of a chat so far; the decoder reuses the KV cache of their common prefix."""

    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def all_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def clear(self) -> None:
        self.messages.clear()
