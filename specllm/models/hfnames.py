"""`hf:` names: which files of a hub repository a name means (no I/O, no huggingface_hub).

`hf:ORG/REPO:QUANT` picks the GGUF whose name carries the quantisation (Q4_K_M when none is
given), `hf:ORG/REPO/PATH.gguf` names one file; `@REV` after the repository pins a branch, tag or
commit. A split GGUF (`NAME-00001-of-00003.gguf`) always comes with all its parts: llama.cpp loads
it from the first part and finds the others beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from specllm.errors import SpecllmError

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"  # as llama.cpp's -hf picks
SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_NAME = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w.-]+))?(?::(?P<quant>[\w.-]+)|/(?P<file>[^:@]+\.gguf))?",
    re.IGNORECASE,
)
USAGE = "use hf:ORG/REPO:QUANT (e.g. hf:Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M) or hf:ORG/REPO/FILE.gguf"


@dataclass(frozen=True)
class HfName:
    repo: str
    revision: str = "main"
    file: str | None = None  # a path inside the repository
    quant: str | None = None

    def __str__(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        tail = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        return f"{PREFIX}{self.repo}{rev}{tail}"


@dataclass(frozen=True)
class RemoteFile:
    """A file as the hub describes it: its size, and its LFS sha256 (or git blob id when not in LFS)."""

    path: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None


def is_hf_name(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse(spec: str) -> HfName:
    match = _NAME.fullmatch(spec[len(PREFIX) :]) if is_hf_name(spec) else None
    if match is None or ".." in spec:
        raise SpecllmError(f"'{spec}' is not a hub name: {USAGE}")
    return HfName(match["repo"], match["rev"] or "main", match["file"], match["quant"])


def split_of(path: str) -> tuple[str, int, int] | None:
    """(prefix, part number, part count) of a split GGUF's part, else None."""
    match = SPLIT.match(path)
    return (match["prefix"], int(match["no"]), int(match["count"])) if match else None


def parts_beside(path: Path) -> list[Path]:
    """A split GGUF's parts, named like its first part and beside it; else just the file."""
    path = Path(path)
    split = split_of(path.name)
    if split is None:
        return [path]
    prefix, _, count = split
    return [path.with_name(f"{prefix}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]


def bytes_on_disk(path: Path) -> int:
    """A GGUF's size on disk, every part of a split one that is there (a download stopped between
    parts leaves some of them)."""
    return sum(part.stat().st_size for part in parts_beside(path) if part.exists())


def folder(cache: Path, name: HfName) -> Path:
    """Where a repository's files are cached: <cache>/models/hf/ORG/REPO/<path in the repository>."""
    return Path(cache) / "models" / "hf" / Path(*name.repo.split("/"))


def select(name: HfName, files: list[RemoteFile], where: str = "the repository") -> list[RemoteFile]:
    """The files `name` means, first part first; SpecllmError saying what is there when none or several fit."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    if name.file is not None:
        chosen = next((f for f in ggufs if f.path == name.file), None)
        if chosen is None:
            raise SpecllmError(f"{name}: {where} has no file {name.file} (GGUF files there: {_listing(ggufs)})")
        return parts_of(chosen, ggufs, name)
    quant = name.quant or DEFAULT_QUANT
    fitting = _of_quant(quant, ggufs)
    groups = {group_of(f.path) for f in fitting}
    if not groups:
        raise SpecllmError(f"{name}: no GGUF file in {where} matches {quant} (GGUF files there: {_listing(ggufs)})")
    if len(groups) > 1:
        raise SpecllmError(
            f"{name}: several GGUF files match {quant}: {', '.join(sorted(groups))}; name one as hf:{name.repo}/FILE.gguf"
        )
    first = min(fitting, key=lambda f: f.path)
    return parts_of(first, ggufs, name)


def quant_groups(name: HfName, files: list[RemoteFile]) -> set[str]:
    """The GGUFs (a split one as one) whose names carry the name's quantisation."""
    return {group_of(f.path) for f in _of_quant(name.quant or DEFAULT_QUANT, files)}


def _of_quant(quant: str, files: list[RemoteFile]) -> list[RemoteFile]:
    token = re.compile(rf"(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])", re.IGNORECASE)
    return [f for f in files if f.path.lower().endswith(".gguf") and token.search(_stem(f.path)) and "mmproj" not in f.path.lower()]


def parts_of(chosen: RemoteFile, files: list[RemoteFile], name: HfName | str) -> list[RemoteFile]:
    """All parts of the split GGUF `chosen` belongs to (just `chosen` when it is not split)."""
    split = split_of(chosen.path)
    if split is None:
        return [chosen]
    prefix, _, count = split
    by_path = {f.path: f for f in files}
    wanted = [f"{prefix}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]
    missing = [PurePosixPath(w).name for w in wanted if w not in by_path]
    if missing:
        raise SpecllmError(f"{name}: split GGUF {PurePosixPath(prefix).name} lacks part(s) {', '.join(missing)}")
    return [by_path[w] for w in wanted]


def _stem(path: str) -> str:
    name = PurePosixPath(path).name
    split = split_of(name)
    return split[0] if split else name[: -len(".gguf")]


def group_of(path: str) -> str:
    """The GGUF a file belongs to: a split one's parts are one (`NAME-*-of-00003.gguf`)."""
    split = split_of(path)
    return f"{split[0]}-*-of-{split[2]:05d}.gguf" if split else path


def _listing(files: list[RemoteFile], most: int = 12) -> str:
    names = sorted({group_of(f.path) for f in files})
    if not names:
        return "none"
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")
