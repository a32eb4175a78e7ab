"""Names to verified files: a path as given, an `hf:` name, or a catalog entry from the cache
(downloaded when allowed)."""

from __future__ import annotations

from pathlib import Path

from specllm.errors import SpecllmError
from specllm.models import hfnames, hub
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
    """A local .gguf path, an `hf:` name, or the cached (downloaded if `fetch`) file of a preset's target or a model."""
    if hfnames.is_hf_name(spec):
        return resolve_hf(spec, fetch=fetch, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file() or (looks_like_path(spec) and path.exists()):
        return path  # a directory or an unreadable file: gguf.inspect says which
    if looks_like_path(spec):
        raise SpecllmError(f"model file not found: {spec}")
    registry = registry or load_registry()
    try:
        entry = find_model(spec, registry)
    except SpecllmError:
        if path.exists():  # no model of that name, but a folder of it here: gguf.inspect says what it is
            return path
        raise
    return ensure_model(entry, fetch=fetch, progress=progress, warn=warn, pull_name=spec)


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


def resolve_hf(spec: str, *, fetch: bool = True, refresh: bool = False, progress: Progress | None = None) -> Path:
    """The first file of an `hf:` name (every part of a split GGUF beside it), verified against the hub.

    A complete verified copy in the cache is used without asking the hub, unless `refresh` (`pull`):
    then the hub's current files are compared with the cache and what differs is downloaded.
    """
    name = hfnames.parse(spec)
    folder = hfnames.folder(cache_dir(), name)
    if not refresh or hub.hf_offline():
        cached = cached_hf(name)
        if cached is not None:
            return cached
        if hub.hf_offline():
            raise SpecllmError(f"{name} is not in the cache ({folder}) and HF_HUB_OFFLINE is set; "
                               f"run `specllm pull {name}` where the hub is reachable")  # fmt: skip
        if not fetch:
            raise SpecllmError(f"{name} is not downloaded; run `specllm pull {name}`")
    commit, files = hub.hub_files(name.repo, name.revision)
    chosen = hfnames.select(name, files, name.repo)
    for n, remote in enumerate(chosen, 1):
        label = str(name) if len(chosen) == 1 else f"{name} ({n}/{len(chosen)})"
        hub.fetch_hub_file(name.repo, commit, remote, folder / remote.path, progress, label=label)
    return folder / chosen[0].path


def cached_hf(name: hfnames.HfName) -> Path | None:
    """The first file of `name` when every file it means is in the cache, verified; else None."""
    folder = hfnames.folder(cache_dir(), name)
    if not folder.is_dir():
        return None
    verified = [
        hfnames.RemoteFile(path.relative_to(folder).as_posix(), path.stat().st_size)
        for path in folder.rglob("*.gguf")
        if hub.recorded_sha256(path)
    ]
    try:
        chosen = hfnames.select(name, verified, "the cache")
    except SpecllmError:
        return None
    return folder / chosen[0].path


def cached_files() -> list[Path]:
    """Every verified GGUF in the cache (catalog models and `hf:` downloads), first parts only."""
    root = cache_dir() / "models"
    found = []
    for path in sorted(root.rglob("*.gguf")) if root.is_dir() else []:
        split = hfnames.split_of(path.name)
        if (split is None or split[1] == 1) and hub.recorded_sha256(path):
            found.append(path)
    return found
