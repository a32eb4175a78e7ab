"""`specllm models` (what is known and what is cached), `specllm pull` (download and verify) and
`specllm rm` (delete from the cache)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from specllm.cli import common as c
from specllm.cli.app import Command, app, flag
from specllm.errors import SpecllmError, UsageError
from specllm.models import catalog, hfnames, hub, store


@app.command("models", cls=Command)
def models(
    as_json: Annotated[bool, flag("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """List presets and models, and whether each model file is already in the cache."""
    listing = describe_models(catalog.load_registry())
    if as_json:
        sys.stdout.write(json.dumps(listing, indent=2) + "\n")
        return
    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    console.print(_presets_table(listing))
    console.print()
    console.print(_models_table(listing))
    _say(console, f"cache: {listing['cache_dir']}   user file: {listing['user_file']}")


@app.command("pull", cls=Command)
def pull(
    names: Annotated[
        Optional[list[str]], typer.Argument(metavar="[PRESET_OR_MODEL...]", help="Default: the default preset.")
    ] = None,
) -> None:
    """Download presets' target and draft models, models, or hf:ORG/REPO:QUANT names, and verify them."""
    # an hf: name needs no registry (a user file with a mistake in it does not stop it)
    reg = catalog.load_registry() if not names or not all(hfnames.is_hf_name(n) for n in names) else None
    names = names or [catalog.default_preset(reg).name]
    for name in names:  # every name is checked before anything is fetched
        if hfnames.is_hf_name(name):
            hfnames.parse(name)
        else:
            catalog.models_for(name, reg)
    for name in names:
        if hfnames.is_hf_name(name):
            with c.download_progress() as progress:
                path = store.resolve_hf(name, refresh=True, progress=progress)
            _say(c.stderr, f"{name}: {_size(hfnames.bytes_on_disk(path))} in {len(hfnames.parts_beside(path))} file(s) ok  {path}")
            continue
        for entry in catalog.models_for(name, reg):
            with c.download_progress() as progress:
                path = store.ensure_model(entry, progress=progress, warn=c.warn)
            size = sum((path.parent / f).stat().st_size for f in entry.files)
            _say(c.stderr, f"{entry.name}: {_size(size)} ok  {path}")


@app.command("rm", cls=Command)
def rm(
    names: Annotated[list[str], typer.Argument(metavar="PRESET_OR_MODEL...", help="Models, presets (their target and draft), or hf: names.")],
) -> None:
    """Delete models' files from the cache (a preset: its target, and its draft unless another preset
    whose target is cached drafts with it too). They download again when used."""
    # hf: names need no registry, as in `pull` (a user file with a mistake in it does not stop them)
    reg = catalog.load_registry() if not all(hfnames.is_hf_name(n) for n in names) else catalog.Registry()
    cache = catalog.cache_dir()
    targets = {}  # label -> the files that make it up; every name is checked before anything is deleted
    drafts = set()  # models named only as a preset's draft
    for name in names:
        if hfnames.is_hf_name(name):
            targets[name] = _cached_hf_files(hfnames.parse(name), cache)
            continue
        if name not in reg.presets and name not in reg.models and catalog.looks_like_path(name):
            raise UsageError(f"rm takes preset, model or hf: names (`specllm models` lists them), not paths: {name}")
        preset = reg.presets.get(name)
        for entry in catalog.models_for(name, reg):  # unknown names: an error
            path = store.model_path(entry, cache)
            targets[entry.name] = [path.parent / f for f in entry.files]
            if preset is not None and entry.name == preset.draft:
                drafts.add(entry.name)
    for model in sorted(drafts - set(names)):
        user = _other_user(model, names, set(targets), reg, cache)
        if user is not None:
            del targets[model]
            _say(c.stderr, f"{model}: kept, {user} uses it too (`specllm rm {model}` deletes it)")
    for label in [label for label in targets if label in reg.models]:
        owner = _same_file_owner(label, set(targets), reg, cache)
        if owner is not None:
            del targets[label]
            _say(c.stderr, f"{label}: kept, its file is {owner}'s too (`specllm rm {label} {owner}` deletes it)")
    for label, files in targets.items():
        present = [f for f in files + [hub.sidecar_path(f) for f in files] + [hub.part_path(f) for f in files] if f.is_file()]
        if not present:
            _say(c.stderr, f"{label}: not in the cache")
            continue
        size = sum(f.stat().st_size for f in present if not f.name.endswith(".verified"))  # begun downloads too
        for f in present:
            f.unlink()
        _say(c.stderr, f"{label}: removed {_size(size)}  {files[0]}")


def _other_user(model: str, names: list[str], deleting: set[str], reg: catalog.Registry, cache) -> str | None:
    """A preset not named that uses `model`, whose target stays in the cache (or is `model`), or None."""
    for preset in reg.presets.values():
        if preset.name in names or model not in (preset.target, preset.draft):
            continue
        target = reg.models.get(preset.target)
        if preset.target == model or (target is not None and preset.target not in deleting and hub.cache_state(target, store.model_path(target, cache)) != "missing"):
            return preset.name
    return None


def _same_file_owner(model: str, deleting: set[str], reg: catalog.Registry, cache) -> str | None:
    """Another model, not being deleted, whose file in the cache is one of `model`'s (two entries of
    models.toml naming one file: a user's entry beside a built-in one) that the file is the right size for, or None."""
    mine = {store.model_path(reg.models[model], cache).parent / f for f in reg.models[model].files}
    for other in reg.models.values():
        if other.name in deleting:
            continue
        path = store.model_path(other, cache)
        if mine & {path.parent / f for f in other.files} and hub.cache_state(other, path) != "missing":
            return other.name
    return None


def _cached_hf_files(name: hfnames.HfName, cache) -> list:
    """The cached files an hf: name means (downloaded or begun; a split GGUF's parts, however many
    came), as `run` would choose among them; none where none fits; SpecllmError where several GGUFs
    fit a quantisation (the name must pick one)."""
    folder = hfnames.folder(cache, name)
    paths = {p.with_name(p.name.removesuffix(".part")) for p in folder.rglob("*.gguf*") if p.name.endswith((".gguf", ".gguf.part"))} if folder.is_dir() else set()
    files = {p.relative_to(folder).as_posix(): p for p in sorted(paths)}
    if name.file is not None:
        groups = {hfnames.group_of(name.file)} & {hfnames.group_of(f) for f in files}
    else:
        groups = hfnames.quant_groups(name, [hfnames.RemoteFile(f, 0) for f in files])
        if len(groups) > 1:
            raise SpecllmError(f"{name}: several GGUF files in the cache match {name.quant or hfnames.DEFAULT_QUANT}: "
                               f"{', '.join(sorted(groups))}; name one as hf:{name.repo}/FILE.gguf")  # fmt: skip
    return [path for f, path in files.items() if hfnames.group_of(f) in groups]


def _say(console: Console, line: str) -> None:
    """One plain line: no markup (paths and errors may hold brackets), no wrapping."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def describe_models(reg: catalog.Registry) -> dict:
    """Everything `specllm models` shows, as plain data (the --json output)."""
    cache = catalog.cache_dir()
    models = []
    for entry in reg.models.values():
        path = store.model_path(entry, cache)
        state = hub.cache_state(entry, path)
        models.append(
            {"name": entry.name, "file": entry.file, "files": list(entry.files), "size": entry.shown_size,
             "size_exact": entry.size is not None, "sha256": entry.sha256,
             "verified_by": "pinned sha256" if entry.pinned else "the hub's LFS metadata",
             "hf_repo": entry.hf_repo, "cached": state == "verified", "state": state, "path": str(path)}
        )  # fmt: skip
    presets = [
        {"name": p.name, "target": p.target, "draft": p.draft, "description": p.description,
         "hardware": p.hardware, "default": p.name == reg.default}
        for p in reg.presets.values()
    ]  # fmt: skip
    downloads = [{"path": str(p), "size": hfnames.bytes_on_disk(p)}
                 for p in store.cached_files() if "hf" in p.relative_to(cache / "models").parts[:1]]  # fmt: skip
    return {"default": reg.default, "presets": presets, "models": models, "hf_downloads": downloads,
            "cache_dir": str(cache), "user_file": str(catalog.user_config_path())}  # fmt: skip


def _presets_table(listing: dict) -> Table:
    sizes = {m["name"]: (m["size"], m["size_exact"]) for m in listing["models"]}
    table = Table(title="Presets", title_justify="left", box=None, pad_edge=False)
    for column in ("name", "target", "draft", "size", "for", "description"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for p in listing["presets"]:
        members = [sizes[p["target"]]] + ([sizes[p["draft"]]] if p["draft"] else [])
        shown = ("" if all(exact for _, exact in members) else "~") + _size(sum(size for size, _ in members))
        name = p["name"] + (" (default)" if p["default"] else "")
        table.add_row(*map(Text, (name, p["target"], p["draft"] or "-", shown, p["hardware"] or "-", p["description"])))
    return table


def _models_table(listing: dict) -> Table:
    table = Table(title="Models", title_justify="left", box=None, pad_edge=False)
    for column in ("name", "size", "files", "checked against", "cached", "path"):
        table.add_column(column, justify="right" if column == "size" else "left", no_wrap=column == "path")
    for m in listing["models"]:
        cached = {"verified": "yes", "unverified": "yes (unverified)", "missing": "no"}[m["state"]]
        size = ("" if m["size_exact"] else "~") + _size(m["size"])
        table.add_row(*map(Text, (m["name"], size, str(len(m["files"])), m["verified_by"], cached, m["path"])))
    for d in listing["hf_downloads"]:
        table.add_row(*map(Text, ("(hf: download)", _size(d["size"]), "", "the hub's LFS metadata", "yes", d["path"])))
    return table


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
