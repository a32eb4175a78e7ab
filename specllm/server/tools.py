"""Tool calls (OpenAI's function calling) as Qwen2.5's and Hermes' chat templates write them.

The request's `tools` go to the model's chat template, which tells the model to answer a call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. The answer's text before the
first call is its content; the calls become `tool_calls`, with `finish_reason: "tool_calls"`.
Small models often write the call's JSON without the tags, bare or in a ```json block (Qwen2.5-
Coder 1.5B does); an answer that is nothing but such a call to one of the request's tools is read
as one too, as llama.cpp's server reads it. A call that is required (`tool_choice: "required"`, or
a named function) is begun in the prompt (`prefill`): the model writes the rest of it, so nothing
constrains its distribution beyond that opening. An answer whose call cannot be read (cut by
`max_tokens`, not JSON) is sent as text. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE, NAME_KEY = "```", '"name"'
_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def wire(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def prefill(tool_choice: str | dict) -> str:
    """The markup the answer starts with: a call's opening where one is required, its name too where named."""
    if isinstance(tool_choice, dict):
        return f'{OPEN}\n{{"name": {json.dumps(tool_choice["function"]["name"], ensure_ascii=False)}, "arguments": '
    return f"{OPEN}\n" if tool_choice == "required" else ""


def split(text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
    """The content before the first call (None when empty) and the calls (to any name in tags, to one
    of `names` in an answer that is only a call's JSON); (text, []) where no call can be read."""
    start = text.find(OPEN)
    if start < 0:
        bare = _bare_calls(text, names)
        return (None, bare) if bare else (text, [])
    calls = []
    for match in _CALL.finditer(text, start):
        call = _read(match.group(1))
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def _bare_calls(text: str, names: list[str]) -> list[ToolCall]:
    fenced = _FENCED.fullmatch(text)
    body = fenced.group(1) if fenced else text.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    calls = [_read(json.dumps(item)) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(call is None or call.name not in names for call in calls):
        return []
    return calls


def begins_bare_call(text: str) -> bool | None:
    """Whether an answer beginning with `text` is writing a call's JSON without tags (an optional
    ```json line, then `{"name"`); None while too little is written to tell."""
    rest = text.lstrip()
    if rest.startswith(FENCE):
        rest = rest[len(FENCE) :]
        if len(rest) < len("json") and "json".startswith(rest):
            return None
        rest = rest.removeprefix("json").lstrip()
    elif FENCE.startswith(rest):
        return None  # nothing yet, or the fence begun
    if not rest:
        return None
    if not rest.startswith("{"):
        return False
    rest = rest[1:].lstrip()
    if len(rest) < len(NAME_KEY):
        return None if NAME_KEY.startswith(rest) else False
    return rest.startswith(NAME_KEY)


def _read(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class ContentText:
    """Streamed text in, the content to send now out: everything before a tool call's opening. From
    the opening on (or from the start, where the prompt opened a call, or where the answer begins
    with a call's bare JSON) text is held for `split`; a beginning that may be such JSON, or a tail
    that could begin the opening, is held until the next piece shows whether it does."""

    def __init__(self, prefill: str = ""):
        self.text = prefill
        self.sent = 0  # characters of `text` sent as content
        self.calling = bool(prefill)
        self.bare: bool | None = None if not prefill else False  # whether the answer begins with a call's bare JSON

    def push(self, piece: str) -> str:
        self.text += piece
        if self.bare is None:
            self.bare = begins_bare_call(self.text)
            self.calling = self.calling or bool(self.bare)
            if self.bare is None:
                return ""
        if self.calling:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.calling = True
            end = start
        else:
            end = len(self.text) - max((k for k in range(1, len(OPEN)) if self.text.endswith(OPEN[:k])), default=0)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def held(self) -> str:
        """What was held back and not sent: the calls' text, or text that began no call."""
        return self.text[self.sent :]
