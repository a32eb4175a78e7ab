"""What the scripts read, checked: a recording, a cost curve, a JSON file, a count. Where it is not
what a script needs: one line on stderr (`Error: PATH: ...`) and exit 1, before any model loads or
minutes of replaying."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_curve(path: str, max_batch: int):
    """A cost model from a machine file (`../shared/machines/*.json`), a `costs.json` entry file, or
    a `bench --json` report (anything else: one line on stderr, exit 1)."""
    report = read_json(path, "a cost curve")
    try:
        costs = _curve_of(report)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        costs = None
    if costs is None:
        what = "a recording, not a cost curve" if isinstance(report, dict) and "streams" in report else "not a cost curve"
        raise SystemExit(f"Error: {path}: {what} (a machine file, a costs.json or a `bench --json` report)")
    costs.batch_seconds = {k: v for k, v in costs.batch_seconds.items() if k <= max_batch}
    if len(costs.batch_seconds) < 2:
        raise SystemExit(f"Error: {path}: no two batch sizes up to --max-batch {max_batch} (a draft needs a batch of 2 at least)")
    return costs


def _curve_of(report: dict):
    from specllm.engine.costmodel import CostModel

    if "streams" in report:
        return None
    if "calibrated" in report:  # a machine file
        costs = CostModel.from_dict(report["calibrated"])
        costs.draft_token_seconds = costs.draft_token_seconds or _draft_token_seconds(report)
    elif "costs" in report:  # bench --json: the cost model as the run's own passes refined it, else as calibrated
        costs = CostModel.from_dict(report.get("costs_learned") or report["costs"])
    elif "verify_cost" in report:  # an older bench --json: the curve and the draft step (its reading rate unknown: priced as steps)
        curve = {c["batch"]: c["ms"] / 1000 for c in report["verify_cost"]}
        depth, context_seconds = report.get("verify_cost_depth", 0), report.get("verify_context_us", 0.0) / 1e6
        costs = CostModel(curve, (report.get("draft_cost_relative") or 0.0) * curve[1], depth, context_seconds)
    else:  # costs.json: one entry per machine, build and model set, the newest last; the newest with a draft model
        # and llama.cpp's default settings (a `--flash-attn` curve prices attention at depth otherwise; an `--exact`
        # one stops at the few sizes those kernels keep), as `auto`'s passes refined it where they did (`learned`)
        entries = sorted(reversed(report.items()), key=lambda item: _setting_rank(item[0]))
        entry = next((e for _, e in entries if e.get("draft_seconds")), entries[0][1])
        costs = CostModel.from_dict(entry.get("learned") or entry)
    return costs if costs.batch_seconds else None


def _setting_rank(key: str) -> int:
    """A costs.json key's settings, in the order a replay prefers them: llama.cpp's defaults, a flash-attention
    setting asked for, the exact kernels (see `Engine._cost_key`)."""
    return 2 if key.endswith("|exact kernels") else 1 if "|flash attention " in key else 0


def _draft_token_seconds(machine: dict) -> float:
    """The draft model's per-token cost reading a batch: published prefill rate, else measured prefill, else its batch curve."""
    if "prefill_seconds_per_token" in machine:
        return float(machine["prefill_seconds_per_token"]["draft"])
    prefill = machine.get("second_sample", {}).get("draft_prefill_seconds_after_256")
    if prefill:
        n = max(prefill, key=int)
        return float(prefill[n]) / int(n)
    batches = machine.get("draft_batch_seconds")
    if batches:
        sizes = sorted(batches, key=int)
        return (float(batches[sizes[-1]]) - float(batches[sizes[0]])) / (int(sizes[-1]) - int(sizes[0]))
    return 0.0


def read_json(path: str, what: str):
    """A JSON file's content; where there is none, one line on stderr and exit 1."""
    try:
        return json.loads(Path(path).read_text("utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"Error: {path}: no such file ({what})") from None
    except OSError as error:
        raise SystemExit(f"Error: {path}: {error.strerror or error} ({what})") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise SystemExit(f"Error: {path}: not JSON ({what}): {error}") from None


def load_recording(path: str) -> dict:
    """A recording (`record`'s, or `replay_session.py record`'s), checked: one line on stderr and exit 1
    where it is something else or holds nothing to replay."""
    data = read_json(path, "a recording")
    if not isinstance(data, dict) or not isinstance(data.get("streams"), list) or not isinstance(data.get("eog"), int):
        kind = "a cost curve, not a recording" if isinstance(data, dict) and ("calibrated" in data or "costs" in data) else "not a recording"
        raise SystemExit(f"Error: {path}: {kind} (the file `record` writes)")
    if not data["streams"]:
        raise SystemExit(f"Error: {path}: a recording of no prompts: nothing to replay")
    for number, stream in enumerate(data["streams"]):
        if not _is_stream(stream) or not isinstance(max_tokens_of(stream, data), int):
            raise SystemExit(f"Error: {path}: stream {number} is not a recorded generation (id, category, prompt, tokens, stopped, max_tokens)")
        if stream["category"] == "all":
            raise SystemExit(f"Error: {path}: stream {number} has the category 'all', the name of the summary row")
    return data


def _is_stream(stream) -> bool:
    def tokens(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and t >= 0 for t in value)

    return (isinstance(stream, dict) and isinstance(stream.get("category"), str) and "id" in stream and tokens(stream.get("prompt"))
            and len(stream["prompt"]) > 0 and tokens(stream.get("tokens")) and isinstance(stream.get("stopped"), bool))  # fmt: skip


def max_tokens_of(stream: dict, data: dict) -> int:
    """The `-n` a stream was generated with: its own (a session's requests each have one), else the recording's."""
    return stream.get("max_tokens", data.get("max_tokens"))


def at_least(least: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    return parse
