"""`specllm serve`: the OpenAI-compatible server (the work is in `specllm.server`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specllm.chat import thinking_variables
from specllm.cli import common as c
from specllm.cli import interrupt
from specllm.cli import options as o
from specllm.cli.app import Command, app
from specllm.errors import SpecllmError, UsageError
from specllm.models import catalog
from specllm.session import SpecConfig


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


@app.command(cls=Command)
def serve(
    model: o.Model = None,
    draft: o.Draft = None,
    spec: o.Spec = o.SPEC.strategy,
    draft_max: o.DraftMax = o.SPEC.draft_max,
    draft_p_min: o.DraftPMin = o.SPEC.draft_p_min,
    ngram_min: o.NgramMin = o.SPEC.ngram_min,
    ngram_max: o.NgramMax = o.SPEC.ngram_max,
    ctx_size: o.CtxSize = o.LOAD.n_ctx,
    threads: o.Threads = o.LOAD.n_threads,
    gpu_layers: o.GpuLayers = o.LOAD.n_gpu_layers,
    gpu_layers_draft: o.GpuLayersDraft = o.LOAD.n_gpu_layers,
    exact: o.Exact = o.LOAD.exact,
    flash_attn: o.FlashAttn = o.LOAD.flash_attn,
    no_think: Annotated[bool, o.flag("--no-think", help="A thinking model (Qwen3) answers without reasoning first unless a request's chat_template_kwargs say otherwise.")] = False,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")] = 8080,
    queue_size: Annotated[int, typer.Option("--queue-size", help="Requests that may wait while one is served; more get HTTP 503.")] = 8,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPECLLM_API_KEY", show_envvar=True, help="Answer only requests that carry this key (Authorization: Bearer KEY, as OpenAI clients send it); /health stays open. For a server other machines can reach (--host 0.0.0.0).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help=f"uvicorn's log level: {', '.join(LOG_LEVELS)} (info: one line per request).")] = "warning",
) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health)
    and llama.cpp's /infill and /completion for editors."""
    o.check_common(1, ctx_size, threads, exact, gpu_layers, gpu_layers_draft, flash_attn)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    if queue_size < 1:
        raise UsageError(f"--queue-size must be at least 1, got {queue_size}")
    if log_level.lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    try:
        from specllm.server.app import Service
        from specllm.server.run import listen, loading
    except ImportError as exc:
        raise SpecllmError(f'`specllm serve` needs the server extra ({exc.name} is missing): pip install starlette uvicorn') from None
    spec_config = SpecConfig(spec, draft_max, draft_p_min, ngram_min, ngram_max).validate()
    sock = listen(host, port)  # a port in use is said before minutes of loading and measuring
    model_id = _model_id(model)
    # meanwhile /health answers 503 "loading model" (editors poll it) and other requests wait
    with loading(sock, model_id, log_level.lower(), api_key or None) as server:  # an empty key (SPECLLM_API_KEY=) is none
        # a server's log says why it is not answering yet, a terminal or not
        engine = c.open_engine(model, draft, spec_config, ctx_size, threads, gpu_layers, gpu_layers_draft, exact, flash_attn, announce=True, think=not no_think)
        variables = thinking_variables(engine.target, think=not no_think)
        service = Service(engine, model_id, queue_size, aliases=_aliases(model_id), variables=variables)

        def ready(bound_host: str, bound_port: int) -> None:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            print(f"specllm serve: {service.model_id} (spec {service.strategy}) on http://{shown}:{bound_port}/v1 "
                  "- Ctrl-C stops", file=sys.stderr, flush=True)  # fmt: skip

        # a Ctrl-C (SIGTERM) dropped while loading, where Python could not raise it (a finalizer), noted
        # by main's handler: honoured before serving, not served past and taken as a later signal's exit code
        interrupt.raise_pending()
        try:
            server.serve_loaded(service, ready)
        finally:
            engine.keep_learned()
    print("specllm serve: stopped", file=sys.stderr, flush=True)


def _model_id(model: str | None) -> str:
    """The name clients send as `model`: the preset or model name, or a GGUF file's stem."""
    if model is None:
        return catalog.default_preset(catalog.load_registry()).name
    return Path(model).stem if model.endswith(".gguf") else model


def _aliases(model_id: str) -> set[str]:
    """Other names of the served model: a preset's target model (`qwen2.5-coder-1.5b` for `qwen2.5-coder`)."""
    preset = catalog.load_registry().presets.get(model_id)
    return {preset.target} if preset is not None else set()
