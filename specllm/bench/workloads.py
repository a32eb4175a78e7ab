"""Benchmark prompts: Spec-Bench's question format, and a small built-in set."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specllm.errors import SpecllmError, UsageError


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
            text = Path(path).read_text("utf-8-sig")  # a BOM, as Windows editors write one, is no row
        except OSError as exc:
            raise SpecllmError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SpecllmError(f"{path}: not UTF-8 text") from None
        source = str(path)
    prompts, taken, lines, found = [], {}, {}, {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        prompt, numbered = _parse(line, source, number, turn)
        if prompt.id in lines:  # results are kept by question_id
            earlier, earlier_numbered = lines[prompt.id]
            by = "by its question_id" if not earlier_numbered else "by its line number: it has no question_id"
            raise SpecllmError(f"{source}:{number}: question_id {prompt.id} is taken already (line {earlier}, {by})")
        lines[prompt.id] = number, numbered
        found[prompt.category] = None
        if categories and prompt.category not in categories:
            continue
        if limit is not None and taken.get(prompt.category, 0) >= limit:
            continue
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        prompts.append(prompt)
    missing = [c for c in categories or () if c not in found]
    if missing and found:  # a misspelt category would drop its prompts unseen
        raise UsageError(f"{source}: no category {', '.join(missing)}; its categories: {', '.join(found)}")
    if not prompts:
        raise SpecllmError(f"{source}: no prompts")
    return prompts


def _parse(line: str, source: str, number: int, turn: int) -> tuple[Prompt, bool]:
    """The row's prompt, and whether it is known by its line number (it has no question_id)."""
    where = f"{source}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecllmError(f"{where}: not JSON ({exc.msg} at character {exc.pos + 1})") from None
    if not isinstance(row, dict):
        raise SpecllmError(f"{where}: a Spec-Bench row is a JSON object with question_id, category and turns")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise SpecllmError(f"{where}: 'turns' must be a list of non-empty strings (the user's turns), got {json.dumps(turns)[:60]}")
    # str() would take anything: a prompt named None, or filed under the category "['qa']"
    question_id, category = row.get("question_id", number), row.get("category", "default")
    if isinstance(question_id, bool) or not isinstance(question_id, (int, str)) or not str(question_id).strip():
        raise SpecllmError(f"{where}: 'question_id' must be an integer or a non-empty string, got {json.dumps(question_id)[:60]}")
    if not isinstance(category, str) or not category.strip():
        raise SpecllmError(f"{where}: 'category' must be a non-empty string, got {json.dumps(category)[:60]}")
    if category == "all":  # the summary's name for every category together: its rows would hold every prompt
        raise SpecllmError(f"{where}: the category 'all' names the rows over every category; call it something else")
    numbered = "question_id" not in row
    return Prompt(str(question_id), category, turns[min(turn, len(turns) - 1)]), numbered
