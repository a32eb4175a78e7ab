"""Benchmark prompts: Spec-Bench's question format, and a small built-in set."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specllm.errors import SpecllmError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(path: str | Path | None = None, categories: list[str] | None = None, limit: int | None = None, turn: int = 0) -> list[Prompt]:
    """Prompts from a Spec-Bench style JSONL file (or the built-in set), filtered by category.

    `limit` caps the prompts taken from each category, in file order.
    """
    if path is None:
        text = resources.files("specllm.bench").joinpath("builtin.jsonl").read_text("utf-8")
        source = "built-in workloads"
    else:
        try:
            text = Path(path).read_text("utf-8")
        except OSError as exc:
            raise SpecllmError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SpecllmError(f"{path}: not UTF-8 text") from None
        source = str(path)
    prompts, taken = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        prompt = _parse(line, source, number, turn)
        if categories and prompt.category not in categories:
            continue
        if limit is not None and taken.get(prompt.category, 0) >= limit:
            continue
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        prompts.append(prompt)
    if not prompts:
        wanted = f" in categories {', '.join(categories)}" if categories else ""
        raise SpecllmError(f"{source}: no prompts{wanted}")
    return prompts


def _parse(line: str, source: str, number: int, turn: int) -> Prompt:
    try:
        row = json.loads(line)
        turns = row["turns"]
        return Prompt(str(row.get("question_id", number)), str(row.get("category", "default")), str(turns[min(turn, len(turns) - 1)]))
    except (json.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
        raise SpecllmError(f"{source}:{number}: not a Spec-Bench question row ({exc.__class__.__name__}: {exc})") from None
