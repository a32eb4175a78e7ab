"""The OpenAI wire format, coming in: request bodies checked into `Request`s.

Pure functions, no I/O: every refusal is an `ApiError` with the HTTP status and the error object
OpenAI's clients expect (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from specllm.engine.sampling import InvalidSampling, SamplingParams
from specllm.server.tools import prefill

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # what specllm gives a template
MAX_STOPS = 64  # OpenAI allows 4, llama.cpp any number; Continue's autocomplete sends 9 for Qwen2.5-Coder (a 400 broke it)
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's; chat runs to the context's end
NO_LIMIT = -1  # max_tokens -1: until the end token or the context's end, as llama.cpp's server reads it (llama.vscode sent it)
LLAMA_CPP_KINDS = ("infill", "native")  # llama.cpp's own routes (/infill, /completion): its answer's shape, no model check
DEFAULTS = SamplingParams()  # a field left out takes specllm's default, as llama.cpp's server does
SAMPLING_FIELDS = {field: repr(field) for field in ("temperature", "top_k", "top_p", "min_p", "seed")}  # as an error names them: 'top_p'


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def busy(message: str) -> ApiError:
    return ApiError(503, message, code="server_busy", kind="server_error")


@dataclass(frozen=True)
class Infill:
    """What llama.cpp's /infill takes (as its editor plugins, llama.vim and llama.vscode, send it)."""

    prefix: str  # `input_prefix`: the code before the gap
    suffix: str  # `input_suffix`: the code after it
    typed: str = ""  # `prompt`: the line typed so far, after the prefix
    extra: list[tuple[str, str]] = field(default_factory=list)  # `input_extra`: (filename, text) of other code


@dataclass(frozen=True)
class Request:
    kind: str  # "chat", "completion" (/v1/completions), "infill" or "native" (llama.cpp's /infill and /completion)
    messages: list[dict] | None  # chat: roles mapped to the template's (developer -> system); tool calls' arguments as objects
    prompt: str | list[int] | None  # completion, native: text, or token ids
    max_tokens: int | None  # None: as many as the context holds (chat)
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    suffix: str | None = None  # completion: the text after the gap, for fill-in-the-middle
    tools: list[dict] | None = None  # chat: function definitions for the template (None: none, or tool_choice "none")
    tool_choice: str | dict = "auto"  # "auto", "required", or {"type": "function", "function": {"name": ...}}
    template_variables: dict | None = None  # chat: `chat_template_kwargs`, such as Qwen3's {"enable_thinking": false}
    infill: Infill | None = None  # infill: the gap and what is around it
    n_indent: int = 0  # infill: end before a line indented less than this (llama.cpp's `n_indent`); 0 or less: never
    t_max_predict_ms: float = 0.0  # infill: past a new line, end once generating has taken this long; 0 or less: never
    response_fields: list[str] | None = None  # infill: only these fields of the answer, by path ("timings/prompt_n")

    @property
    def tool_prefill(self) -> str:
        """The markup a required call's answer starts with, in the prompt ("" without tools)."""
        return prefill(self.tool_choice) if self.tools else ""

    @property
    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools or []]


def parse(kind: str, body: object) -> Request:
    """A request body (already JSON-decoded) checked field by field."""
    _object(body)
    messages = prompt = suffix = tools = variables = None
    tool_choice = "auto"
    if kind == "chat":
        messages = _messages(_required(body, "messages"))
        tools, tool_choice = _tools(body)
        variables = _template_variables(body)
    else:
        suffix = _get(body, "suffix", str, None)
        prompt = _prompt(_required(body, "prompt"), infill=suffix is not None)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n}", "n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, max_tokens if kind == "chat" else COMPLETION_MAX_TOKENS)
    if max_tokens is not None and max_tokens < 1 and max_tokens != NO_LIMIT:
        raise ApiError(400, f"max_tokens must be at least 1 (or -1: no limit), got {max_tokens}", "max_tokens")
    stream_options = _get(body, "stream_options", dict, {}) or {}
    return Request(
        kind,
        messages,
        prompt,
        None if max_tokens == NO_LIMIT else max_tokens,
        _params(body),
        _stop(body.get("stop")),
        _get(body, "stream", bool, False),
        bool(stream_options.get("include_usage")),
        _get(body, "model", str, None),
        suffix,
        tools,
        tool_choice,
        variables,
    )


def parse_infill(body: object) -> Request:
    """An /infill body, checked as llama.cpp's server checks it; `samplers`, `cache_prompt` and
    `t_max_prompt_ms` are ignored. `n_predict` -1 or left out: until the end token or the context's
    end (as one larger than the context); 0: read the prompt only (editors warm the cache with it)."""
    _object(body)
    prefix, suffix = (_get(body, name, str, None) for name in ("input_prefix", "input_suffix"))
    for name, value in (("input_prefix", prefix), ("input_suffix", suffix)):
        if value is None:
            raise ApiError(400, f"missing required field {name!r}", name)
    extra = []
    chunks = body.get("input_extra", [])
    if chunks is None:
        chunks = []
    if not isinstance(chunks, list):
        raise ApiError(400, "'input_extra' must be an array of {\"filename\": string, \"text\": string}", "input_extra")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, f"input_extra[{i}] must be an object with a \"text\" string", f"input_extra[{i}]")
        filename = chunk.get("filename", "tmp")  # llama.cpp's name for a chunk without one
        if not isinstance(filename, str):
            raise ApiError(400, f"input_extra[{i}].filename must be a string, got {_type(filename)}", f"input_extra[{i}].filename")
        extra.append((filename, chunk["text"]))
    infill = Infill(prefix, suffix, _get(body, "prompt", str, ""), extra)
    return Request("infill", None, None, infill=infill, **_llama_cpp_fields(body))


def parse_native(body: object) -> Request:
    """A /completion body: llama.cpp's own completion route, which Continue's "llama.cpp" provider
    sends for chat and autocomplete alike. `prompt` is text (read as /v1/completions reads it, special
    tokens included) or token ids; the other fields are /infill's."""
    _object(body)
    prompt = _prompt(_required(body, "prompt"), infill=False)
    return Request("native", None, prompt, **_llama_cpp_fields(body))


def _llama_cpp_fields(body: dict) -> dict:
    """What llama.cpp's /infill and /completion share: `n_predict` (or `max_tokens`), sampling, `stop`,
    `stream`, `model` (read by no check), the two limits editors set, `response_fields`."""
    max_tokens = _get(body, "n_predict", int, _get(body, "max_tokens", int, None))
    if max_tokens is not None and max_tokens < NO_LIMIT:
        raise ApiError(400, f"'n_predict' must be -1 (no limit), 0 (read the prompt only) or more, got {max_tokens}", "n_predict")
    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise ApiError(400, "'response_fields' must be an array of strings", "response_fields")
    return dict(
        max_tokens=None if max_tokens == NO_LIMIT else max_tokens, params=_params(body), stop=_stop(body.get("stop")),
        stream=_get(body, "stream", bool, False), model=_get(body, "model", str, None),
        n_indent=max(0, _get(body, "n_indent", int, 0)), t_max_predict_ms=max(0.0, float(_get(body, "t_max_predict_ms", float, 0))),
        response_fields=fields or None,
    )  # fmt: skip


def _object(body: object) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type(body)}")


def check_length(request: Request, prompt_tokens: int, n_ctx: int) -> int:
    """The most tokens to generate for a prompt of this size; ApiError when it cannot fit."""
    if prompt_tokens >= n_ctx:
        # llama.cpp's words beside OpenAI's code: llama.vscode's chat tells a context overflow (and says
        # to shorten the chat) by "exceeds the available context size" in the message
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens but the context holds {n_ctx}: the request exceeds the available context size",
                       {"chat": "messages", "infill": "input_prefix"}.get(request.kind, "prompt"), "context_length_exceeded")  # fmt: skip
    if request.max_tokens is None:
        return n_ctx - prompt_tokens
    if request.max_tokens > n_ctx and request.kind not in LLAMA_CPP_KINDS:  # llama.cpp's own routes run to the context's end
        raise ApiError(400, f"max_tokens is {request.max_tokens}, more than the context holds ({n_ctx} tokens)",
                       "max_tokens", "context_length_exceeded")  # fmt: skip
    # One that fits the context but not beside this prompt runs until the context is full ("length"), as
    # llama.cpp's and Ollama's servers do: editors send a fixed max_tokens (4096, say) with every prompt.
    return min(request.max_tokens, n_ctx - prompt_tokens)


# -- fields ----------------------------------------------------------------------------------


def _required(body: dict, name: str):
    if body.get(name) is None:
        raise ApiError(400, f"missing required field {name!r}", name)
    return body[name]


def _get(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    number = kind in (int, float)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, (int, float) if kind is float else kind):
        raise ApiError(400, f"{name!r} must be {_word(kind)}, got {_type(value)}", name)
    if number and not _finite(value):
        raise ApiError(400, f"{name!r} must be a finite number", name)
    return value


def _finite(value: int | float) -> bool:
    """JSON's integers have no bound: one past a float's range (10**400) counts as infinite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object, got {_type(message)}", param)
        role = message.get("role")
        if role not in ROLES:
            known = ", ".join(ROLES)
            raise ApiError(400, f"{param}.role must be one of {known}, got {role!r}", f"{param}.role")
        calls = message.get("tool_calls") if role == "assistant" else None
        content = _content(message.get("content"), "assistant" if calls else role, f"{param}.content")
        entry = {"role": ROLES[role], "content": content}
        if calls:
            entry["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        if role == "assistant" and isinstance(message.get("reasoning_content"), str):  # as sent back to llama.cpp's server
            entry["reasoning_content"] = message["reasoning_content"]
        out.append(entry)
    return out


def _tool_calls(value, param: str) -> list[dict]:
    """An assistant's earlier calls, for the template: arguments as the object they encode (as
    Transformers' templates expect them), where they are JSON."""
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be an array of tool calls", param)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{param}[{i}] must be a function call with a name", f"{param}[{i}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # sent on as the text it is
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _tools(body: dict) -> tuple[list[dict] | None, str | dict]:
    """The function definitions and how they may be called; no tools where `tool_choice` is "none"."""
    tools = body.get("tools")
    if tools is None or tools == []:
        tools = None
    elif not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array of function definitions", "tools")
    names = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{i}]")
        name = function["name"]
        if not TOOL_NAME.fullmatch(name):
            raise ApiError(400, f"tools[{i}]: a function's name is 1-64 letters, digits, _ or -, got {name!r}", f"tools[{i}].function.name")
        if name in names:
            raise ApiError(400, f"tools[{i}]: two tools are named {name!r}", f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}]: 'parameters' must be a JSON Schema object", f"tools[{i}].function.parameters")
        names.append(name)
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice  # null is left out, as for every other field
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ApiError(400, f"'tool_choice' must name one of the tools ({', '.join(names) or 'none given'})", "tool_choice")
    elif choice not in TOOL_CHOICES:
        raise ApiError(400, f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named function", "tool_choice")
    elif choice == "required" and not tools:
        raise ApiError(400, "'tool_choice' is required but no tools were given", "tool_choice")
    return (None if choice == "none" else tools), choice


def _template_variables(body: dict) -> dict | None:
    """`chat_template_kwargs` (as vLLM's and llama.cpp's servers take them): more variables for the
    template, never the ones specllm sets itself."""
    variables = _get(body, "chat_template_kwargs", dict, None)
    taken = sorted(set(variables or {}) & TEMPLATE_OWN)
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' cannot set {', '.join(taken)}", "chat_template_kwargs")
    return variables or None


def _content(value, role: str, param: str) -> str:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):  # content parts: text only
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param}: only text content parts are supported", param)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{param} must be a string or an array of text parts, got {_type(value)}", param)


def _prompt(value, infill: bool) -> str | list[int]:
    """A completion's prompt; with a `suffix` (`infill`), the text before the gap: text, and it may be empty."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one, text or token ids (as evaluation harnesses send it)
    if isinstance(value, str):
        if not value and not infill:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return value
    if infill:
        raise ApiError(400, "with a 'suffix', 'prompt' must be the text before the gap", "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise ApiError(400, "'prompt' must be a non-empty string or array of token ids; batches of more than one are not supported", "prompt")


def _params(body: dict) -> SamplingParams:
    temperature = _get(body, "temperature", float, DEFAULTS.temperature)
    top_p = _get(body, "top_p", float, DEFAULTS.top_p)
    top_k = _get(body, "top_k", int, DEFAULTS.top_k)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "off", which clients written for it send; llama.cpp's takes it too
    min_p = _get(body, "min_p", float, DEFAULTS.min_p)
    seed = _get(body, "seed", int, None)
    seed = None if seed == -1 else seed  # llama.cpp's servers' "random"
    params = SamplingParams(float(temperature), top_k, float(top_p), float(min_p), seed)
    try:
        return params.validate(SAMPLING_FIELDS)
    except InvalidSampling as exc:
        raise ApiError(400, str(exc), exc.field) from None


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' holds at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return [s for s in stops if s]


def _word(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "an object", list: "an array"}[kind]


# for llama.cpp's routes outside the completion requests (/tokenize, /detokenize)
check_object, get = _object, _get


def _type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)  # fmt: skip
