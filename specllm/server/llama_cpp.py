"""llama.cpp's server routes beside the completions: what its clients read of the model and the tokenizer.

llama.vscode counts a prompt's tokens with /tokenize and reads the context's size from /props; both
answer as llama.cpp's server does (its defaults: no BOS added, special tokens parsed; /detokenize
writes a control token as its text).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from specllm.server import parsing
from specllm.server.body import read_json_object


def routes(service: Callable[[], Awaitable]) -> list[Route]:
    """/props, /tokenize and /detokenize, answered by the `Service` that `service()` awaits."""

    async def props(request: HttpRequest):
        return JSONResponse((await service()).props())

    async def tokenize(request: HttpRequest):
        served = await service()
        body = await read_json_object(request)
        content = parsing.get(body, "content", str, "")
        add_special, parse_special = parsing.get(body, "add_special", bool, False), parsing.get(body, "parse_special", bool, True)
        with_pieces = parsing.get(body, "with_pieces", bool, False)
        tokens = await run_in_threadpool(served.engine.target.tokenize, content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(served.token_bytes(t))} for t in tokens]})

    async def detokenize(request: HttpRequest):
        served = await service()
        tokens = parsing.get(await read_json_object(request), "tokens", list, [])
        served.check_tokens(tokens, "tokens")
        return JSONResponse({"content": b"".join(served.token_bytes(t) for t in tokens).decode("utf-8", "replace")})

    return [Route("/props", props, methods=["GET"]), Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]


def _piece(data: bytes) -> str | list[int]:
    """A token's piece as llama.cpp's /tokenize writes it: text, or its bytes where they are no UTF-8 of their own."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
