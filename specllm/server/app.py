"""The HTTP routes (Starlette): check a request, encode its prompt, queue it, send the events back.

No decoding happens here. A handler turns the body into a `Job` for the worker and answers with
a `JobResponse`, which waits for the job's turn, then sends one JSON object or a stream of
server-sent events, and cancels the job as soon as the client disconnects.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from concurrent.futures import Future
from typing import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from specllm.chat import encode_infill, encode_messages, encode_raw, encode_repo_infill, reasoning_splitter
from specllm.engine.decode import Decoder
from specllm.errors import SpecllmError
from specllm.reasoning import REASONING, ThinkSplitter
from specllm.server import llama_cpp, parsing, rendering, tools
from specllm.server.body import read_json_object
from specllm.server.parsing import LLAMA_CPP_KINDS, ApiError, busy
from specllm.server.rendering import Renderer
from specllm.server.worker import LEFT, SHUTTING_DOWN, Job, Result, Worker

class Service:
    """What the routes share: the engine (tokenizer, context size), the served name, the worker."""

    def __init__(self, engine, model_id: str, queue_size: int = 8, make_decoder: Callable[[], Decoder] | None = None, aliases=(),
                 variables: dict | None = None):  # fmt: skip
        self.engine, self.model_id = engine, model_id
        self.variables = variables or {}  # the template's switches by default (`serve --no-think`); a request's own win
        self.strategy = engine.spec.strategy
        # what a client may send as `model`: the served name, other names of the same model (a
        # preset's target), the GGUF file's name
        self.names = {model_id, *aliases, engine.target.path.name, engine.target.path.stem}
        self.created = int(time.time())
        draft = getattr(engine, "draft", None)  # a DeferredBackend keeps why its load at first use failed
        self.worker = Worker(make_decoder or engine.decoder, queue_size, lambda: getattr(draft, "error", None))

    def check_name(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.model_id!r}", "model", "model_not_found")

    def encode(self, request: parsing.Request) -> list[int]:
        target = self.engine.target
        if request.kind == "infill":
            gap = request.infill
            return encode_repo_infill(target, gap.prefix, gap.suffix, gap.typed, gap.extra)
        if request.kind == "chat":
            if request.tools:
                template = target.chat_template()
                if template is not None and template.takes_tools and not template.writes_tool_call_tags:
                    raise ApiError(400, f"the chat template of {target.path.name} writes tool calls in a format specllm does not read "
                                   "(it reads <tool_call> tags, as Qwen2.5's and Hermes' templates write them)", "tools")  # fmt: skip
            return encode_messages(target, request.messages, tools=request.tools, prefill=request.tool_prefill,
                                   variables={**self.variables, **(request.template_variables or {})})  # fmt: skip
        if request.suffix is not None:
            return encode_infill(target, request.prompt, request.suffix)
        if isinstance(request.prompt, list):
            self.check_tokens(request.prompt, "prompt")
            return request.prompt
        return encode_raw(target, request.prompt)

    def check_tokens(self, tokens: list, param: str) -> None:
        n_vocab = self.engine.target.n_vocab
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in tokens):
            raise ApiError(400, f"token ids must be between 0 and {n_vocab - 1}", param)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes, a control token's as its text (`<|im_end|>`), as llama.cpp's /detokenize writes them."""
        target = self.engine.target
        return target.token_bytes(token) or target.token_text(token).encode("utf-8")

    def settings(self) -> dict:
        """llama.cpp's `generation_settings`, so far as its clients read them: llama.vscode's status line
        reads n_ctx from every /infill answer (without it, it stopped before gathering the editor's context)."""
        defaults = parsing.DEFAULTS
        params = {"n_predict": -1, "temperature": defaults.temperature, "top_k": defaults.top_k, "top_p": defaults.top_p,
                  "min_p": defaults.min_p, "seed": -1}  # fmt: skip
        return {"n_ctx": self.engine.target.n_ctx, "model": self.model_id, "params": params}

    def props(self) -> dict:
        """llama.cpp's /props, the fields its clients read (the context's size above all)."""
        return {"default_generation_settings": self.settings(), "total_slots": 1, "model_alias": self.model_id,
                "model_path": str(self.engine.target.path), "modalities": {"vision": False, "audio": False}}  # fmt: skip

    def close(self) -> None:
        self.worker.close()


class Loading:
    """The service to come while `serve` loads its models (minutes, with a download or the cost
    curve's measuring): /health answers 503 "loading model" at once, as llama.cpp's server does for
    the editors and orchestrators that poll it, and every other route waits for the service (`set`),
    or answers 503 if it never comes (`fail`: the loading failed or was interrupted)."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.future: Future[Service] = Future()  # set from the loading thread, awaited in the event loop's

    @classmethod
    def done(cls, service: Service) -> Loading:
        loading = cls(service.model_id)
        loading.set(service)
        return loading

    def set(self, service: Service) -> None:
        self.future.set_result(service)

    def fail(self) -> None:
        if not self.future.done():
            self.future.set_exception(busy(SHUTTING_DOWN))

    async def service(self) -> Service:
        if not self.future.done():
            await asyncio.wrap_future(self.future)
        return self.future.result()  # the 503 of `fail`, raised


def create_app(service: Service | Loading, api_key: str | None = None) -> Starlette:
    """The routes; with `api_key`, every route but /health answers only requests that carry it."""
    loading = service if isinstance(service, Loading) else Loading.done(service)

    async def chat(request: HttpRequest):
        return await _generate(await loading.service(), "chat", request)

    async def completions(request: HttpRequest):
        return await _generate(await loading.service(), "completion", request)

    async def infill(request: HttpRequest):  # llama.cpp's, for its editor plugins (llama.vim, llama.vscode)
        return await _generate(await loading.service(), "infill", request)

    async def native(request: HttpRequest):  # llama.cpp's /completion, for Continue's "llama.cpp" provider
        return await _generate(await loading.service(), "native", request)

    async def models(request: HttpRequest):
        service = await loading.service()
        return JSONResponse(rendering.models_list(service.model_id, service.created))

    async def model(request: HttpRequest):  # the OpenAI client's `models.retrieve`
        service = await loading.service()
        name = request.path_params["name"]
        service.check_name(name)
        return JSONResponse(rendering.model_object(name, service.created))

    async def health(request: HttpRequest):
        if not loading.future.done():  # llama.cpp's answer (its error object) beside specllm's status
            body = {"status": "loading model", "model": loading.model_id,
                    "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}  # fmt: skip
            return JSONResponse(body, status_code=503, headers=_retry_after(503))
        service = await loading.service()
        worker = service.worker
        status = "shutting down" if worker.closing.is_set() else "ok"
        return JSONResponse({"status": status, "model": service.model_id, "busy": worker.busy, "queued": worker.queued()},
                            status_code=503 if worker.closing.is_set() else 200)  # fmt: skip

    routes = [
        Route("/infill", infill, methods=["POST"]),
        Route("/completion", native, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        *llama_cpp.routes(loading.service),
    ]
    # The OpenAI routes with and without /v1, as llama.cpp's server has them: a client given the
    # server's address as its base URL (aider's OPENAI_API_BASE, Zed's api_url) adds no /v1
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/chat/completions", chat, methods=["POST"]),
            Route(f"{prefix}/completions", completions, methods=["POST"]),
            Route(f"{prefix}/models", models, methods=["GET"]),
            Route(f"{prefix}/models/{{name:path}}", model, methods=["GET"]),
        ]
    handlers = {HTTPException: _http_error, ApiError: _api_error, Exception: _internal_error}
    # Any origin may call, as llama.cpp's server and OpenAI's API allow: browser clients (Open WebUI's
    # direct connections, web pages built on the openai JS client) send a preflight first
    cors = Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"], max_age=600)
    keyed = [Middleware(RequireKey, key=api_key)] if api_key else []  # inside CORS: a preflight carries no key
    return Starlette(routes=routes, exception_handlers=handlers, middleware=[cors, *keyed])


class RequireKey:
    """`--api-key`, as llama.cpp's server reads it: `Authorization: Bearer KEY` (what OpenAI clients
    send) or `X-Api-Key: KEY`; without it, 401 in OpenAI's error shape. /health stays open (what
    orchestrators and editors poll)."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN or self._carries_key(dict(scope["headers"])):
            await self.app(scope, receive, send)
            return
        body = {"message": "this server needs an API key: send Authorization: Bearer KEY (the key given to --api-key)",
                "type": "authentication_error", "param": None, "code": "invalid_api_key"}  # fmt: skip
        await _send_json(send, 401, {"error": body})

    def _carries_key(self, headers: dict[bytes, bytes]) -> bool:
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.key)


async def _generate(service: Service, kind: str, http: HttpRequest):
    body = await read_json_object(http)
    parse = {"infill": parsing.parse_infill, "native": parsing.parse_native}.get(kind)
    request = parse(body) if parse else parsing.parse(kind, body)
    # llama.vim sends "model": "" whatever it is set to, and llama.cpp's own routes read no name (an
    # editor sends the one it starts llama-server with, Continue the one in its config): only the
    # OpenAI routes check it
    if request.model is not None and request.model.strip() and kind not in LLAMA_CPP_KINDS:
        service.check_name(request.model)
    try:
        prompt = await run_in_threadpool(service.encode, request)
    except SpecllmError as exc:  # a template that cannot render these messages, a model without FIM tokens
        fields = {"chat": "tools" if request.tools else "messages", "infill": "input_prefix"}
        param = fields.get(kind, "suffix" if request.suffix is not None else "prompt")
        raise ApiError(400, str(exc), param) from None
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    max_tokens = parsing.check_length(request, len(prompt), service.engine.target.n_ctx)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def post(kind: str, payload) -> None:  # from the worker thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    job = Job(prompt, max_tokens, request.params, post, request.stop, request.n_indent, request.t_max_predict_ms / 1000)
    service.worker.submit(job)
    thinking = reasoning_splitter(service.engine.target, prompt) if kind == "chat" else ThinkSplitter(thinks=False)
    response = JobResponse(job, events, request, Renderer(kind, service.model_id, request.response_fields), service.strategy, thinking)
    response.settings = service.settings() if kind in LLAMA_CPP_KINDS else None
    return response


class JobResponse:
    """An ASGI response that follows one job; a client that goes away cancels it."""

    def __init__(self, job: Job, events: asyncio.Queue, request: parsing.Request, render: Renderer, strategy: str, thinking: ThinkSplitter):
        self.job, self.events, self.request, self.render, self.strategy = job, events, request, render, strategy
        self.thinking = thinking  # a thinking model's reasoning goes apart from the answer
        self.settings: dict | None = None  # llama.cpp's routes: `generation_settings` in the answer's last object

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            kind, payload = await self.events.get()  # "start" once its turn comes, or an error
            if kind == "error":
                await _send_json(send, payload.status, payload.body())
            elif self.request.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away while we wrote
            pass
        finally:
            self.job.cancel()  # a no-op once the job is done
            watcher.cancel()

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.job.cancel()

    async def _whole(self, send) -> None:
        pieces = []
        while True:
            kind, payload = await self.events.get()
            if kind == "text":
                pieces.append(payload)
            elif kind == "error":
                return await _send_json(send, payload.status, payload.body())
            elif kind == "done":
                text, reason, calls = "".join(pieces), self._reason(payload), None
                reasoning, text = self.thinking.read(text)
                if self.request.tools:
                    content, found = tools.split(self.request.tool_prefill + text, self.request.tool_names)
                    if found:  # else the model's own text, a required call's opening apart
                        text, calls, reason = content, [call.wire() for call in found], "tool_calls"
                body = self.render.whole(text, reason, rendering.usage(payload.stats, self.strategy), calls, reasoning)
                return await _send_json(send, 200, self._with_settings(body))

    async def _stream(self, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._event(send, self.render.chunk(None, first=True) if self.request.kind == "chat" else None)
        content = tools.ContentText(self.request.tool_prefill) if self.request.tools else None  # text before a tool call
        while True:
            kind, payload = await self.events.get()
            if kind == "text":
                for part, piece in self.thinking.push(payload):
                    await self._piece(send, part, piece, content)
            elif kind == "error":
                await self._event(send, payload.body())
                break
            elif kind == "done":
                for part, piece in self.thinking.finish():
                    await self._piece(send, part, piece, content)
                usage, reason = rendering.usage(payload.stats, self.strategy), self._reason(payload)
                if content is not None:
                    text, found = tools.split(content.text, self.request.tool_names)
                    if found:
                        rest = (text or "")[len(content.sent_text()) :]  # text between or after the calls
                        if rest:
                            await self._event(send, self.render.chunk(rest))
                        await self._event(send, self.render.chunk(None, tool_calls=[call.wire(i) for i, call in enumerate(found)]))
                        reason = "tool_calls"
                    elif content.held():
                        await self._event(send, self.render.chunk(content.held()))
                if self.request.include_usage:  # in a closing chunk of its own, as OpenAI sends it
                    await self._event(send, self.render.chunk(None, reason))
                    await self._event(send, self.render.usage_chunk(usage))
                else:  # usage on the last chunk all the same (what speculation did), as llama.cpp's server sends its timings
                    await self._event(send, self._with_settings(self.render.chunk(None, reason, usage)))
                break
        end = b"" if self.request.kind in LLAMA_CPP_KINDS else b"data: [DONE]\n\n"  # llama.cpp's own stream has no end marker
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _piece(self, send, part: str, text: str, content: tools.ContentText | None) -> None:
        """Reasoning as it comes; answer text held back where it may begin a tool call."""
        if part == REASONING:
            return await self._event(send, self.render.chunk(None, reasoning=text))
        text = content.push(text) if content is not None else text
        if text:
            await self._event(send, self.render.chunk(text))

    @staticmethod
    async def _event(send, obj: dict | None) -> None:
        if obj is not None:
            data = b"data: " + _json_bytes(obj) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
            # Let the loop run between events: while the worker's pieces wait in the queue nothing else
            # suspends, so a client gone mid-stream went unnoticed (its generation ran on, every write
            # after the fifth logged "socket.send() raised exception.": 5,377 lines for 10 clients).
            await asyncio.sleep(0)

    def _with_settings(self, body: dict) -> dict:
        """llama.cpp's answer carries its `generation_settings`; with `response_fields`, those asked for."""
        if self.settings is None:
            return body
        fields = self.request.response_fields
        if not fields:
            return {**body, "generation_settings": self.settings}
        asked = {path: self.settings[path.split("/", 1)[1]] for path in fields
                 if path.startswith("generation_settings/") and path.split("/", 1)[1] in self.settings}  # fmt: skip
        return {**body, **asked}

    def _reason(self, result: Result) -> str:
        if self.request.kind in LLAMA_CPP_KINDS:
            return rendering.infill_stop_type(result)
        return "stop" if result.stopped_by_text else rendering.finish_reason(result.finish_reason)


def _json_bytes(obj: dict) -> bytes:
    """Compact JSON in UTF-8, as llama.cpp's server and Starlette's JSONResponse write it: llama.vim
    drops an /infill answer in which `"content":"` is not written so. A lone surrogate, which UTF-8
    cannot carry, goes out as its JSON escape: a tool call's arguments hold one where the model
    wrote "\\ud83d" without its pair."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


async def _send_json(send, status: int, body: dict) -> None:
    data = _json_bytes(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in _retry_after(status).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=_retry_after(exc.status))


def _retry_after(status: int) -> dict[str, str]:
    """A 503 (busy or shutting down) tells the client it may try again."""
    return {"Retry-After": "1"} if status == 503 else {}


async def _http_error(request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(ApiError(exc.status_code, message, kind=kind).body(), status_code=exc.status_code)


async def _internal_error(request, exc: Exception):
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    return JSONResponse(error.body(), status_code=500)
