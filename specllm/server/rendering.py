"""The OpenAI wire format, going out: the JSON a response carries (and llama.cpp's /infill answer).

Pure functions, no I/O.
"""

from __future__ import annotations

import time
import uuid

from specllm.engine.stats import Stats
from specllm.server.parsing import LLAMA_CPP_KINDS


def finish_reason(engine_reason: str) -> str:
    """The engine's reasons in OpenAI's words: a full context is a length limit, a stop is a stop."""
    return "length" if engine_reason in ("length", "context") else "stop"


def usage(stats: Stats, strategy: str) -> dict:
    """The usual counts, plus what speculation did for this request."""
    by_source = {name: {"drafted": s.drafted, "accepted": s.accepted, "steps": s.steps} for name, s in stats.by_source.items()}
    for name in ("ngram", "draft"):
        by_source.setdefault(name, {"drafted": 0, "accepted": 0, "steps": 0})
    speculation = {
        "strategy": strategy,
        "steps": stats.target_passes,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "by_source": dict(sorted(by_source.items())),
        "tok_per_s": round(stats.tok_per_s, 2),
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "seconds": round(stats.seconds, 4),
    }
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.tokens,
        "total_tokens": stats.prompt_tokens + stats.tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
        "speculation": speculation,
    }


class Renderer:
    """Builds the objects of one response (an id and a creation time shared by all its chunks)."""

    def __init__(self, kind: str, model: str, fields: list[str] | None = None):
        self.kind, self.model = kind, model
        self.fields = fields  # infill: `response_fields`
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str | None, reason: str, usage: dict, tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
        if self.kind in LLAMA_CPP_KINDS:
            return infill_body(text, reason, usage, self.model, self.fields)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
            if reasoning is not None:  # a thinking model's, as llama.cpp's server and DeepSeek's API name it
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, reason: str | None = None, usage: dict | None = None, first: bool = False,
              tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:  # fmt: skip
        if self.kind in LLAMA_CPP_KINDS:  # llama.cpp's stream: the text, then the whole answer's fields with none
            return {"content": text or "", "stop": False} if reason is None else infill_body("", reason, usage, self.model, self.fields)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            if tool_calls:
                delta = {"tool_calls": tool_calls}
            elif reasoning is not None:
                delta = {"reasoning_content": reasoning}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict) -> dict:
        """The closing chunk `stream_options.include_usage` asks for: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def infill_stop_type(result) -> str:
    """Why an /infill answer ended, in llama.cpp's words: its end token (eos), a stop string (word),
    a limit (n_predict, the context, n_indent, t_max_predict_ms), or neither (none: cut short). An
    indentation cut comes before any stop string in the text (the stop strings never see what it cut)."""
    if result.cut:
        return "limit"
    if result.stopped_by_text:
        return "word"
    if result.finish_reason in ("length", "context"):
        return "limit"
    return "eos" if result.finish_reason == "stop" else "none"


def infill_body(text: str, stop_type: str, usage: dict, model: str, fields: list[str] | None = None) -> dict:
    """An /infill answer as llama.cpp's server writes it (the fields its editor plugins read: content,
    timings, tokens_cached), with specllm's usage beside; with `fields` (`response_fields`), only
    those, each under its path as llama.cpp returns them ({"timings/prompt_n": 12}: llama.vim reads them so)."""
    spec = usage["speculation"]
    prompt_n = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    predicted_n, prompt_ms, predicted_ms = usage["completion_tokens"], spec["prefill_seconds"] * 1000, spec["seconds"] * 1000
    timings = {
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(1000 * prompt_n / prompt_ms, 2) if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
        "predicted_per_second": round(1000 * predicted_n / predicted_ms, 2) if predicted_ms else 0.0,
    }
    body = {
        "content": text,
        "stop": True,
        "stop_type": stop_type,
        "model": model,
        "tokens_predicted": predicted_n,
        "tokens_evaluated": usage["prompt_tokens"],
        "tokens_cached": usage["prompt_tokens"] + predicted_n,
        "truncated": False,
        "timings": timings,
        "usage": usage,
    }
    return body if not fields else {path: value for path in fields if (value := _at(body, path)) is not _MISSING}


_MISSING = object()


def _at(body: dict, path: str):
    """The value at a "/"-separated path of nested objects, or _MISSING."""
    value = body
    for key in path.split("/"):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def model_object(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specllm"}


def models_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model_id, created)]}
