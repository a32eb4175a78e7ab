"""Share of generation wall time spent outside llama.cpp's evaluation calls (Python drafting,
verification, bookkeeping) for one generation.

    python scripts/profile_overhead.py [--spec auto] [-n 128] [--category code_edit] [--row N]   (a row of dev.jsonl)

`auto` decides by the cost curve in the cache (measured first, 1-3 minutes, where there is none).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from script_inputs import at_least  # beside this script: on the path when it runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="auto")
    parser.add_argument("-n", type=at_least(1), default=128)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--category", default="code_edit")
    parser.add_argument("--row", type=int, default=0, help="index among the category's rows")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1].parent / "shared/workloads/dev.jsonl"))
    args = parser.parse_args()

    from specllm.backend import LlamaBackend, LoadOptions
    from specllm.bench.workloads import load_prompts
    from specllm.engine.decode import Done, PrefillDone
    from specllm.engine.sampling import SamplingParams
    from specllm.errors import SpecllmError
    from specllm.models.catalog import cache_dir, load_registry, resolve_preset_draft
    from specllm.models.store import resolve_model
    from specllm.session import Engine, ModelPaths, SpecConfig

    try:
        rows = load_prompts(args.prompts, [args.category])
        if not 0 <= args.row < len(rows):
            raise SystemExit(f"Error: --row {args.row}: {args.prompts} has {len(rows)} {args.category} rows (0 to {len(rows) - 1})")
        prompt = rows[args.row].text
        reg = load_registry()
        preset = reg.default
        engine = Engine(
            ModelPaths(resolve_model(preset, reg), resolve_model(resolve_preset_draft(preset, reg), reg)),
            SpecConfig(args.spec).validate(), LoadOptions(n_ctx=4096), LoadOptions(), cost_cache=cache_dir() / "costs.json",
        )
        if args.spec == "auto":  # measured before the timing starts; the other strategies never price a pass
            engine.costs()
        decoder = engine.decoder()
        if engine.draft is not None:  # `auto` loads it at its first use: seconds that are no overhead of decoding
            engine.draft.load()
    except SpecllmError as error:
        raise SystemExit(f"Error: {error}") from None
    inside = [0.0]
    original = LlamaBackend.evaluate

    def timed(self, tokens, rows, copy=True):
        started = time.perf_counter()
        try:
            return original(self, tokens, rows, copy)
        finally:
            inside[0] += time.perf_counter() - started

    LlamaBackend.evaluate = timed
    params = SamplingParams(temperature=args.temp)
    started = None
    for event in decoder.generate(engine.encode(prompt), args.n, params, np.random.default_rng(0)):
        if isinstance(event, PrefillDone):  # count generation only, not the prompt
            inside[0], started = 0.0, time.perf_counter()
        elif isinstance(event, Done):
            total = time.perf_counter() - started
            print(f"{len(event.tokens)} tokens in {total:.2f}s ({len(event.tokens) / total:.2f} tok/s), spec {args.spec}")
    outside = total - inside[0]
    print(f"inside llama.cpp evaluation: {inside[0]:.3f}s; outside: {outside:.3f}s = {outside / total:.2%} of wall time")


if __name__ == "__main__":
    main()
