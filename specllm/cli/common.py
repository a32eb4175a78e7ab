"""What run, chat and bench share: options, model resolution, engine loading, prompt input."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from specllm import registry
from specllm.backend import LoadOptions
from specllm.errors import SpecllmError, UsageError
from specllm.sampling import SamplingParams
from specllm.session import STRATEGIES, Engine, ModelPaths, SpecConfig

stderr = Console(stderr=True, highlight=False)
MAX_THREADS = 512  # GGML_MAX_N_THREADS: llama.cpp crashes on more

# -- options shared by the generating commands (Typer `Annotated` aliases) ----------------
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Preset name or path to a GGUF file. [default: the default preset]")]
Draft = Annotated[Optional[str], typer.Option("--draft", help="Draft model: preset/model name or GGUF path. [default: the preset's draft]")]
Spec = Annotated[str, typer.Option("--spec", help=f"Speculation strategy: {', '.join(STRATEGIES)}.")]
DraftMax = Annotated[int, typer.Option("--draft-max", help="Most tokens drafted per step.")]
DraftPMin = Annotated[float, typer.Option("--draft-p-min", help="Draft model stops when its top probability falls below this.")]
NgramMin = Annotated[int, typer.Option("--ngram-min", help="Shortest n-gram the cache matches.")]
NgramMax = Annotated[int, typer.Option("--ngram-max", help="Longest n-gram the cache matches.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below this fraction of the best one (0: off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed. [default: random]")]
CtxSize = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens.")]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads. [default: all cores up to 8]")]
GpuLayers = Annotated[int, typer.Option("--gpu-layers", "-ngl", help="Target layers on the GPU (-1: all when the build supports it).")]
GpuLayersDraft = Annotated[int, typer.Option("--gpu-layers-draft", "-ngld", help="Draft layers on the GPU (-1: all when supported).")]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Color = Annotated[str, typer.Option("--color", help="Colour tokens by source: auto, always, never.")]


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float, seed: int | None) -> SamplingParams:
    return SamplingParams(temp, top_k, top_p, min_p, seed).validate()


def check_common(max_tokens: int, ctx_size: int, threads: int | None) -> None:
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    if ctx_size < 8:
        raise UsageError(f"--ctx-size must be at least 8 tokens, got {ctx_size}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise UsageError(f"--threads must be between 1 and {MAX_THREADS}, got {threads}")


def open_engine(
    model: str | None,
    draft: str | None,
    spec: SpecConfig,
    ctx_size: int,
    threads: int | None,
    gpu_layers: int,
    gpu_layers_draft: int,
) -> Engine:
    """Resolve names to verified files (downloading when needed) and load them."""
    spec = spec.validate()
    reg = registry.load_registry()
    model = model or registry.default_preset(reg).name
    draft_path = None
    with download_progress() as progress:
        target_path = registry.resolve_model(model, reg, progress=progress, warn=warn)
        if spec.uses_draft_model:
            draft_name = draft or registry.resolve_preset_draft(model, reg)
            if draft_name:
                draft_path = registry.resolve_model(draft_name, reg, progress=progress, warn=warn)
    options = LoadOptions(n_ctx=ctx_size, n_threads=threads, n_gpu_layers=gpu_layers)
    draft_options = LoadOptions(n_ctx=ctx_size, n_threads=threads, n_gpu_layers=gpu_layers_draft)
    engine = Engine(ModelPaths(target_path, draft_path), spec, options, draft_options, registry.cache_dir() / "costs.json")
    if spec.strategy == "auto" and not engine.costs_known():
        if sys.stderr.isatty():
            stderr.print("measuring what a target pass costs on this machine (once for these models, ~20-30 s) ...")
        engine.costs()
    return engine


def warn(message: str) -> None:
    """One line on stderr, never wrapped, never read as markup (paths may hold brackets)."""
    if _colour_ok():
        stderr.print(Text.assemble(("warning:", "yellow"), f" {message}"), soft_wrap=True)
    else:
        print(f"warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def download_progress():
    """A progress callback for downloads and checksums: a bar on stderr when it is a terminal
    (removed when the block ends, however it ends), else None."""
    if not stderr.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    bar = Progress(*columns, console=stderr, transient=True)
    task = None

    def update(description: str, done: int, total: int) -> None:
        nonlocal task
        if task is None:  # shown only once there is something to show: cached models flash nothing
            bar.start()
            task = bar.add_task(description, total=total)
        bar.update(task, description=description, completed=done, total=total)

    try:
        yield update
    finally:
        bar.stop()


def _colour_ok() -> bool:
    return sys.stderr.isatty() and "NO_COLOR" not in os.environ


def read_prompt(prompt: str | None) -> str:
    """Piped stdin first, then the --prompt text, as llm and ollama do."""
    piped = None
    if not sys.stdin.isatty():
        data = sys.stdin.buffer.read()
        try:
            piped = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecllmError(f"standard input is not valid UTF-8 (byte {exc.start})") from None
    parts = [p for p in (piped, prompt) if p is not None and p.strip()]
    if not parts:
        if piped is None and prompt is None:
            raise UsageError('no prompt: pass --prompt "..." or pipe text in (try `specllm run --help`)')
        raise UsageError("the prompt is empty")
    return "\n\n".join(p.strip("\n") for p in parts)
