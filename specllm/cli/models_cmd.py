"""`specllm models` (what is known and what is cached) and `specllm pull` (download and verify)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from specllm.cli import common as c
from specllm.cli.app import app
from specllm.models import catalog, hub, store


@app.command("models")
def models(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
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


@app.command("pull")
def pull(
    name: Annotated[
        Optional[str], typer.Argument(metavar="[PRESET_OR_MODEL]", help="Default: the default preset.")
    ] = None,
) -> None:
    """Download a preset's target and draft models (or one model) into the cache and verify them."""
    reg = catalog.load_registry()
    name = name or catalog.default_preset(reg).name
    for entry in catalog.models_for(name, reg):
        with c.download_progress() as progress:
            path = store.ensure_model(entry, progress=progress, warn=c.warn)
        _say(c.stderr, f"{entry.name}: {_size(entry.size)} ok  {path}")


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
            {"name": entry.name, "file": entry.file, "size": entry.size, "sha256": entry.sha256,
             "hf_repo": entry.hf_repo, "cached": state == "verified", "state": state, "path": str(path)}
        )  # fmt: skip
    presets = [
        {"name": p.name, "target": p.target, "draft": p.draft, "description": p.description,
         "default": p.name == reg.default}
        for p in reg.presets.values()
    ]  # fmt: skip
    return {"default": reg.default, "presets": presets, "models": models,
            "cache_dir": str(cache), "user_file": str(catalog.user_config_path())}  # fmt: skip


def _presets_table(listing: dict) -> Table:
    sizes = {m["name"]: m["size"] for m in listing["models"]}
    table = Table(title="Presets", title_justify="left", box=None, pad_edge=False)
    for column in ("name", "target", "draft", "size", "description"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for p in listing["presets"]:
        size = sizes[p["target"]] + (sizes[p["draft"]] if p["draft"] else 0)
        name = p["name"] + (" (default)" if p["default"] else "")
        table.add_row(*map(Text, (name, p["target"], p["draft"] or "-", _size(size), p["description"])))
    return table


def _models_table(listing: dict) -> Table:
    table = Table(title="Models", title_justify="left", box=None, pad_edge=False)
    for column in ("name", "size", "cached", "path"):
        table.add_column(column, justify="right" if column == "size" else "left", no_wrap=column == "path")
    for m in listing["models"]:
        cached = {"verified": "yes", "unverified": "yes (unverified)", "missing": "no"}[m["state"]]
        table.add_row(*map(Text, (m["name"], _size(m["size"]), cached, m["path"])))
    return table


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
