"""Names to verified files: a path as given, or a catalog entry from the cache (downloaded when allowed)."""

from __future__ import annotations

from pathlib import Path

from specllm.errors import SpecllmError
from specllm.models import hub
from specllm.models.catalog import (
    ModelEntry,
    Progress,
    Registry,
    Warn,
    cache_dir,
    find_model,
    load_registry,
    looks_like_path,
)


def model_path(entry: ModelEntry, cache: Path | None = None) -> Path:
    """Where a model's file lives once downloaded: <cache>/models/<file>."""
    return hub.model_path(entry, cache if cache is not None else cache_dir())


def resolve_model(
    spec: str,
    registry: Registry | None = None,
    *,
    fetch: bool = True,
    progress: Progress | None = None,
    warn: Warn | None = None,
) -> Path:
    """A local .gguf path, or the cached (downloaded if `fetch`) file of a preset's target or a model."""
    path = Path(spec).expanduser()
    if path.is_file() or (looks_like_path(spec) and path.exists()):
        return path  # a directory or an unreadable file: gguf.inspect says which
    if looks_like_path(spec):
        raise SpecllmError(f"model file not found: {spec}")
    registry = registry or load_registry()
    return ensure_model(find_model(spec, registry), fetch=fetch, progress=progress, warn=warn, pull_name=spec)


def ensure_model(
    entry: ModelEntry,
    *,
    fetch: bool = True,
    progress: Progress | None = None,
    warn: Warn | None = None,
    pull_name: str | None = None,
) -> Path:
    """The verified cached file of `entry`, downloading it first when `fetch` is true."""
    if fetch:
        return hub.fetch(entry, cache_dir(), progress, warn=warn)
    path = model_path(entry)
    if hub.verify_cached(entry, path, progress):
        return path
    state = "does not match its checksum" if path.exists() else "is not downloaded"
    raise SpecllmError(f"model '{entry.name}' {state} ({path}); run `specllm pull {pull_name or entry.name}`")
