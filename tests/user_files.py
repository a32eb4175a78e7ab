"""The user's own cache and config folders, as they were before the tests ran, and what changed
in them since (shared by conftest.py's end-of-session check and tests/test_isolation.py).

Read when this module is first imported, by conftest.py at startup: before any test points the
environment at a temporary home.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from specllm.models import catalog

USER_ENV = dict(os.environ)
USER_CACHE = catalog.cache_dir()
USER_CONFIG = catalog.user_config_path().parent
USER_XDG = [Path(os.environ.get(var) or Path.home() / sub) for var, sub in (("XDG_CACHE_HOME", ".cache"), ("XDG_CONFIG_HOME", ".config"))]


def user_files() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under the user's specllm cache and config folders but the model
    downloads, plus the names directly inside the user's cache and config folders (but specllm's
    cache folder itself, which a first download creates)."""
    files = {}
    for root in (USER_CACHE, USER_CONFIG):
        for path in root.rglob("*") if root.is_dir() else ():
            if path.is_file() and not _is_model_download(path):
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    for root in USER_XDG:
        for path in root.iterdir() if root.is_dir() else ():
            if path != USER_CACHE:  # created by the first model download on a fresh machine; its files are checked above
                files.setdefault(str(path), (0, 0))
    return files


def _is_model_download(path: Path) -> bool:
    if path.parent != USER_CACHE / "models":
        return False
    model = path.with_name(path.name[: -len(".verified")]) if path.name.endswith(".verified") else path
    return Path(str(model) + ".verified").is_file()


def user_files_changed(before: dict[str, tuple[int, int]]) -> list[str]:
    after = user_files()
    return sorted(path for path, stamp in after.items() if path not in before or (stamp != (0, 0) and before[path] != stamp))


def builtin_registry() -> catalog.Registry:
    """The shipped models.toml alone: a user's overrides do not change what the tests load."""
    text = resources.files("specllm.models").joinpath("models.toml").read_text("utf-8")
    return catalog.parse_registry(text, catalog.BUILTIN)
