"""What run, chat and bench share: model resolution, engine loading, prompt input (options: `options`)."""

from __future__ import annotations

import codecs
import io
import sys
from contextlib import contextmanager
from typing import Callable

from rich.console import Console
from rich.text import Text

from specllm.backend import LoadOptions
from specllm.chat import thinking_variables
from specllm.cli.display import colour_allowed
from specllm.errors import SpecllmError, UsageError
from specllm.models import catalog, store
from specllm.session import Engine, ModelPaths, SpecConfig, pick_draft

stderr = Console(stderr=True, highlight=False)


def open_engine(
    model: str | None,
    draft: str | None,
    spec: SpecConfig,
    ctx_size: int,
    threads: int | None,
    gpu_layers: int,
    gpu_layers_draft: int,
    exact: bool = False,
    flash_attn: str = "auto",
    announce: bool | None = None,
    think: bool = True,
    check: Callable[[Engine], None] | None = None,
) -> Engine:
    """Resolve names to verified files (downloading when needed) and load them; with `--spec auto`,
    measure the cost curve if none is cached, saying so (`announce`; default: where stderr is a terminal).
    `think` False (`--no-think`) is checked against the model's template before that measurement, and so
    is the input `check` refuses (a prompt the context cannot hold): an error, not minutes of measuring first."""
    spec = spec.validate()
    reg = catalog.load_registry()
    model = model or catalog.default_preset(reg).name
    draft_path = None
    with download_progress() as progress:
        target_path = store.resolve_model(model, reg, progress=progress, warn=warn)
        if spec.uses_draft_model:
            draft_name = draft or catalog.resolve_preset_draft(model, reg)
            if draft_name == "auto":
                draft_path = auto_draft(model, target_path, reg, progress)
            elif draft_name:
                draft_path = store.resolve_model(draft_name, reg, progress=progress, warn=warn)
        elif draft:
            warn(f"--draft is not used with --spec {spec.strategy}: no draft model loaded")
    options = LoadOptions(n_ctx=ctx_size, n_threads=threads, n_gpu_layers=gpu_layers, exact=exact, flash_attn=flash_attn)
    draft_options = LoadOptions(n_ctx=ctx_size, n_threads=threads, n_gpu_layers=gpu_layers_draft, flash_attn=flash_attn)
    engine = Engine(ModelPaths(target_path, draft_path), spec, options, draft_options, catalog.cache_dir() / "costs.json")
    trained = engine.target.n_ctx_train
    if 0 < trained < ctx_size:  # llama.cpp only logs it, and its log is off
        warn(f"--ctx-size {ctx_size} is more than the {trained} tokens {engine.target.path.name} was trained on: text past {trained} tokens may lose its thread")
    try:
        thinking_variables(engine.target, think)  # a template that cannot answer without thinking: said before minutes of measuring
        if check is not None:
            check(engine)
    except SpecllmError:
        engine.close()
        raise
    if spec.strategy == "auto":
        cost_curve(engine, announce=sys.stderr.isatty() if announce is None else announce)
    return engine


def cost_curve(engine: Engine, announce: bool = True):
    """The engine's cost curve, measured first when this machine has none cached for these models
    (`announce`: say so on stderr); a curve measured while other work was busy says so too."""
    if engine.costs_known():
        return engine.costs()
    if not announce:
        costs = engine.costs()
    else:
        stderr.print("measuring the verification cost curve (once for these models; 1-3 min on 2 cores) ...", soft_wrap=True)
        with _elapsed("measuring"):
            costs = engine.costs()
    if not costs.steady and announce:
        warn("other work shared the cores while the cost curve was measured: it serves this run and is measured again next time")
    return costs


def auto_draft(model: str, target_path, reg: catalog.Registry, progress):
    """`--draft auto`: a preset's draft for this target, else a compatible, much smaller model in the cache."""
    candidates, paired = [], []
    for preset in reg.presets.values():
        matches = model in (preset.name, preset.target) or target_path.name in reg.models[preset.target].files
        if preset.draft and matches and preset.draft not in paired:
            paired.append(preset.draft)
    for name in paired:
        try:
            candidates.append((name, store.ensure_model(reg.models[name], progress=progress, warn=warn), True))
        except SpecllmError as exc:
            print(f"draft auto: {name} (the preset's draft) is not available: {exc}", file=sys.stderr)
    by_file = {store.model_path(m): m.name for m in reg.models.values()}
    hf_root = catalog.cache_dir() / "models" / "hf"
    for path in store.cached_files():
        if all(path != known for _, known, _ in candidates):
            label = f"hf:{path.relative_to(hf_root).as_posix()}" if path.is_relative_to(hf_root) else by_file.get(path, path.name)
            candidates.append((label, path, False))
    choice = pick_draft(target_path, candidates)
    if choice.path is None:
        print(f"draft auto: {choice.reason}; running with the n-gram cache alone", file=sys.stderr)
    else:
        print(f"draft auto: chose {choice.reason}", file=sys.stderr)
    return choice.path


def draft_lost(engine) -> str | None:
    """What to say where `auto` could not load the draft model at its first use (it went on without it), or None."""
    error = getattr(engine.draft, "error", None) if engine.draft is not None else None
    if error is None:
        return None
    return f"the draft model could not be loaded at its first use; generation went on without it (the same text, perhaps slower): {error}"


def warn(message: str) -> None:
    """One line on stderr, never wrapped, never read as markup (paths may hold brackets)."""
    if colour_allowed(sys.stderr):
        stderr.print(Text.assemble(("warning:", "yellow"), f" {message}"), soft_wrap=True)
    else:
        print(f"warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def _elapsed(description: str):
    """A spinner with the seconds elapsed on stderr while the block runs (a terminal only), then gone."""
    if not stderr.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(description), TimeElapsedColumn(), console=stderr, transient=True) as bar:
        bar.add_task(description, total=None)
        yield


@contextmanager
def download_progress():
    """A progress callback for downloads and checksums: a bar on stderr when it is a terminal
    (removed when the block ends, however it ends), else None."""
    if not stderr.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

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


def utf8_streams() -> None:
    """Standard streams in UTF-8 where their own encoding cannot hold every character. Windows reads and
    writes a redirected stream (a file, a pipe) in its ANSI code page (cp1252): a reply holding 'お'
    ended `run > out.txt` with an error and no text, and a UTF-8 script piped to `chat` arrived garbled.
    A terminal keeps its encoding (Windows' console is UTF-8 already); what it cannot show is replaced."""
    for stream, errors in ((sys.stdin, "strict"), (sys.stdout, "strict"), (sys.stderr, "backslashreplace")):
        encoding = getattr(stream, "encoding", None)
        if not encoding or not hasattr(stream, "reconfigure") or _holds_every_character(encoding):
            continue
        try:
            if not stream.isatty():
                stream.reconfigure(encoding="utf-8", errors=errors)
            elif stream is not sys.stdin:
                stream.reconfigure(errors="replace")
        except (OSError, ValueError, io.UnsupportedOperation):  # already read from, or closed: left as it is
            pass


def _holds_every_character(encoding: str) -> bool:
    try:
        return codecs.lookup(encoding).name.startswith("utf")
    except LookupError:
        return False


def read_prompt(prompt: str | None) -> str:
    """Piped stdin first, then the --prompt text, as llm and ollama do. Windows' line ends (a file made
    there) and an editor's byte-order mark are taken out of piped text, as they are out of a chat's
    script, so that a file is the same prompt on every system."""
    piped = None
    if not sys.stdin.isatty():
        try:
            data = sys.stdin.buffer.read()
        except OSError as exc:  # main would call it a failure to write the output
            raise SpecllmError(f"cannot read standard input: {exc.strerror or exc}") from None
        try:
            piped = data.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
        except UnicodeDecodeError as exc:
            raise SpecllmError(f"standard input is not valid UTF-8 (byte {exc.start})") from None
    parts = [p for p in (piped, prompt) if p is not None and p.strip()]
    if not parts:
        if piped is None and prompt is None:
            raise UsageError('no prompt: pass --prompt "..." or pipe text in (try `specllm run --help`)')
        raise UsageError("the prompt is empty")
    return "\n\n".join(p.strip("\n") for p in parts)
