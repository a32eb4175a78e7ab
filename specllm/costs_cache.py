"""The cost cache (`costs.json` in specllm's cache folder): each machine's calibration of a model set,
and what later processes' passes refined it to, kept between runs. File I/O only: the cost model
itself is the engine's (`engine/costmodel.py`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from specllm.engine.costmodel import OUTLIER_FACTOR, CostModel
from specllm.filelock import locked


def load_costs(path: Path | None, key: str) -> CostModel | None:
    """A cost model saved for exactly this machine, build and model set (`key`), or None."""
    return _entry(_read_cache(path), key)


def save_costs(path: Path | None, key: str, costs: CostModel) -> None:
    """Keep a calibration for this key, in place of an earlier one and what was learned from it."""
    if path is not None:
        with _locked(path):
            _write_cache(path, _read_cache(path) | {key: costs.to_dict()})


def load_learned(path: Path | None, key: str, calibrated: CostModel) -> CostModel | None:
    """The curve earlier processes refined from this calibration (`save_learned`), or None; none refined
    before passes beyond the timed context were told apart (its sizes may hold their context's cost)."""
    entry = _read_cache(path).get(key) or {}
    learned = _entry(entry, "learned")
    if learned is None or "deep_growth" not in entry["learned"] or learned.batch_seconds.keys() != calibrated.batch_seconds.keys():
        return None
    # A size learned beyond OUTLIER_FACTOR of its calibrated share of one token's pass was learned
    # from stalls (before timings were bounded): it starts again from its calibration.
    one, calibrated_one = learned.batch_seconds[1], calibrated.batch_seconds[1]
    if not (math.isfinite(one) and one > 0 and math.isfinite(calibrated_one) and calibrated_one > 0):
        return None  # damaged: the calibration serves
    for k, seconds in calibrated.batch_seconds.items():
        share = seconds / calibrated_one
        if not share / OUTLIER_FACTOR <= learned.batch_seconds[k] / one <= share * OUTLIER_FACTOR:
            learned.batch_seconds[k] = share * one
    return learned


def save_learned(path: Path | None, key: str, calibrated: CostModel, learned: CostModel) -> None:
    """Keep the refined curve beside the calibration it grew from, for the next process to start from;
    not where the cache now holds another calibration (measured again meanwhile) or none."""
    if path is None:
        return
    with _locked(path):
        data = _read_cache(path)
        current = _entry(data, key)
        if current is None or current.batch_seconds != calibrated.batch_seconds:
            return  # no cache, or not this calibration's
        data[key] = data[key] | {"learned": learned.to_dict()}
        _write_cache(path, data)


# Batch sizes a curve may hold: --draft-max is at most 256. A larger one (an edit by hand) would make
# the cost model interpolate every size up to it, gigabytes for a size of 10**9.
MAX_BATCH = 1024


def _entry(data: dict, key: str) -> CostModel | None:
    try:
        costs = CostModel.from_dict(data[key])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):  # OverflowError: an infinite count
        return None  # a damaged cache is simply measured again
    # no sizes, a size out of range, one that costs nothing or NaN, or a figure that is not finite:
    # damaged too (the cost model cannot price from it)
    sizes = costs.batch_seconds
    figures = [costs.draft_seconds, costs.context_seconds, costs.draft_token_seconds, costs.deep_growth]
    if not sizes or not all(1 <= k <= MAX_BATCH and math.isfinite(s) and s > 0 for k, s in sizes.items()):
        return None
    if not all(math.isfinite(f) for f in figures) or costs.depth < 0 or costs.passes < 0:
        return None
    return costs


def _read_cache(path: Path | None) -> dict:
    try:
        # a byte-order mark (an editor's, on a file edited by hand) is no JSON: read without it
        data = json.loads(path.read_text("utf-8").removeprefix("\ufeff")) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
    """The whole file at once: written under a name of this write's own, then renamed over it, so that
    a reader (another process: a server beside a run) sees the old file or the new, never half."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        # caching is an optimisation; measuring again next time is fine


def _locked(path: Path):
    """One process at a time reads, changes and writes the cache, so that two writing at once both keep
    their entries. Where it cannot be locked (`filelock.locked`), unlocked: writes stay whole, one of
    two at once may lose its entry (measured again)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)  # the lock file goes beside it
    return locked(path)
