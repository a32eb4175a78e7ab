"""A request's body: read up to a limit, and parsed as the JSON object every route takes."""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request as HttpRequest

from specllm.server import parsing
from specllm.server.parsing import ApiError
from specllm.server.worker import LEFT

# The largest request body read: over 30 times what a 128k-token context holds as JSON text. A larger
# one (100 MB took 45 s of tokenizing and 2 GB of memory, then a 400) is refused before it is read.
MAX_BODY = 16 * 1024 * 1024


async def read_body(http: HttpRequest) -> bytes:
    """The body, up to MAX_BODY: a larger one is refused (413) as soon as it is announced or read."""
    too_large = ApiError(413, f"the request body is larger than {MAX_BODY // 2**20} MiB", code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body came (an editor cancelling): answered, not logged as a crash
        raise ApiError(LEFT.status, LEFT.message, kind=LEFT.kind) from None
    return b"".join(chunks)


async def read_json_object(http: HttpRequest) -> dict:
    """The body as a JSON object; ApiError (400, 413) when it is not one."""
    data = await read_body(http)
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer longer than Python reads (4,300 digits by default)
        raise ApiError(400, "the request body is not valid JSON here: a number has too many digits") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: nested too deeply") from None
    parsing.check_object(body)
    return body
