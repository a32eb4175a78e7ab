"""Tool calls (OpenAI's function calling) as Qwen2.5's and Hermes' chat templates write them.

The request's `tools` go to the model's chat template, which tells the model to answer a call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. The answer's text outside the
calls is its content; the calls become `tool_calls`, with `finish_reason: "tool_calls"`.
Small models often write calls' JSON without the tags, bare or in ```json blocks (Qwen2.5-Coder
1.5B does, several calls in one block); an answer that is nothing but such calls to the request's
tools is read as them, as llama.cpp's server reads it. A call that is required (`tool_choice:
"required"`, or a named function) is begun in the prompt up to its name (`prefill`): the model
writes the rest, so nothing constrains its distribution beyond that opening. An answer whose call
cannot be read (cut by `max_tokens` or a stop string, not JSON) is sent as the text the model
wrote. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE, NAME_KEY = "```", '"name"'
_BARE_KEYS = {"name", "arguments", "parameters"}  # all an untagged call's JSON may hold


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def wire(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def prefill(tool_choice: str | dict) -> str:
    """The markup the answer starts with where a call is required: the call's opening up to its
    name (a model that writes its calls untagged, as Qwen2.5-Coder 1.5B does, ends its answer right
    after a bare tag), and the name too where the request names it."""
    if isinstance(tool_choice, dict):
        return f'{OPEN}\n{{"name": {json.dumps(tool_choice["function"]["name"], ensure_ascii=False)}, "arguments":'
    return f'{OPEN}\n{{"name": "' if tool_choice == "required" else ""


def split(text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
    """The content (the text before the first call, its trailing white space dropped, then any text
    between or after the calls, a paragraph each; None when empty) and the calls: to any name in
    tags, to one of `names` in an answer that is only calls' JSON (bare, in ```json blocks, one after
    another or in a list); (text, []) where no call can be read."""
    start = text.find(OPEN)
    if start < 0:
        bare = _bare_calls(text, names)
        return (None, bare) if bare else (text, [])
    calls, content, at = [], text[:start].rstrip(), start
    for opening, end, body in _tagged(text, start):
        call = _read(body)
        if call is None:
            return text, []
        calls.append(call)
        content = _with_paragraph(content, text[at:opening] if at > start else "")
        at = end
    content = _with_paragraph(content, text[at:])
    return content or None, calls


def _tagged(text: str, start: int):
    """(where it opens, where it ends, its body stripped) of each call in tags from `start`, a body
    running to its closing tag or the text's end. By `find`, not a regex: white space matched around
    a lazy body backtracks quadratically over a long run of it, and this runs on the event loop."""
    while start >= 0:
        body = start + len(OPEN)
        close = text.find(CLOSE, body)
        end = len(text) if close < 0 else close + len(CLOSE)
        yield start, end, text[body : len(text) if close < 0 else close].strip()
        start = text.find(OPEN, end)


def _with_paragraph(content: str, text: str) -> str:
    return "\n\n".join(part for part in (content, text.strip()) if part)


def _bare_calls(text: str, names: list[str]) -> list[ToolCall]:
    fenced = _fenced(text)
    if fenced is None:
        return []  # words beside the blocks: an answer that shows JSON, not a call
    values = [value for body in (fenced or [text]) for value in _json_values(body)]
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    if not items or not all(isinstance(item, dict) and set(item) <= _BARE_KEYS and item.get("name") in names for item in items):
        return []
    calls = [_call(item) for item in items]
    return calls if all(calls) else []


def _fenced(text: str) -> list[str] | None:
    """The bodies of the ``` (or ```json) blocks the text is made of, white space around them; []
    where there are none, None where anything else is beside them. Split, not a regex: white space
    matched around a lazy body backtracks cubically over white space after an unclosed fence."""
    parts = text.split(FENCE)
    if len(parts) < 3:
        return []
    if len(parts) % 2 == 0 or any(part.strip() for part in parts[::2]):
        return None
    return [part.removeprefix("json").strip() for part in parts[1::2]]


def _json_values(body: str) -> list:
    """The JSON values written one after another in `body` (white space or commas between them);
    none where anything else is there. A call wrapped in doubled braces, as Qwen2.5's template
    shows its example ({{"name": ...}}), is read as the call."""
    decoder, values, at = json.JSONDecoder(), [], 0
    body = body.strip()
    if body.startswith("{{") and body.endswith("}}"):
        body = body[1:-1]
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):  # not JSON, or JSON Python will not read (a 5,000-digit number, [[[[...)
            return []
        values.append(value)
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
    return values


def _read(body: str) -> ToolCall | None:
    values = _json_values(body)
    return _call(values[0]) if len(values) == 1 and isinstance(values[0], dict) else None


def _call(call: dict) -> ToolCall | None:
    """A call's JSON ({"name", "arguments"}, or "parameters" as Llama 3 writes it) as a ToolCall;
    None where the name is missing or the arguments are not an object (or its JSON text)."""
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def begins_bare_call(text: str) -> bool | None:
    """Whether an answer beginning with `text` is writing calls' JSON without tags (an optional
    ```json line, an optional `[`, then `{"name"`, or `{{"name"`); None while too little is
    written to tell."""
    rest = text.lstrip()
    if rest.startswith(FENCE):
        rest = rest[len(FENCE) :]
        if len(rest) < len("json") and "json".startswith(rest):
            return None
        rest = rest.removeprefix("json").lstrip()
    elif FENCE.startswith(rest):
        return None  # nothing yet, or the fence begun
    braces = 0
    for opening in ("[", "{", "{"):  # [{"name", {"name" or {{"name"
        if not rest:
            return None
        if rest.startswith(opening):
            rest, braces = rest[1:].lstrip(), braces + (opening == "{")
        elif braces and rest.startswith('"'):
            break
        elif opening != "[":
            return False
    if len(rest) < len(NAME_KEY):
        return None if NAME_KEY.startswith(rest) else False
    return rest.startswith(NAME_KEY)


class ContentText:
    """Streamed text in, the content to send now out: everything before a tool call's opening, bar
    the white space just before it (as `split` drops it). From the opening on (or from the start,
    where the prompt opened a call, or where the answer begins with a call's bare JSON) text is
    held for `split`; a beginning that may be such JSON, a tail that could begin the opening, and
    trailing white space are held until the next piece shows what they are."""

    def __init__(self, prefill: str = ""):
        self.text = prefill  # the answer's text, a prompt's opening of a call included, for `split`
        self.sent = self.opening = len(prefill)  # characters of `text` sent as content (the opening counts: it is never content)
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
        end = max(self.sent, len(self.text[:end].rstrip()))
        out, self.sent = self.text[self.sent : end], end
        return out

    def sent_text(self) -> str:
        """What was sent as content so far."""
        return self.text[: self.sent][self.opening :]

    def held(self) -> str:
        """What was held back and not sent, the prompt's opening apart: the calls' text, or text
        that began no call."""
        return self.text[self.sent :]
