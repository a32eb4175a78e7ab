"""Share of generation wall time spent outside llama.cpp's evaluation calls (Python drafting,
verification, bookkeeping) for one generation, and that Python time per step as CPU time of the
decoding thread (other work on the machine slows wall time, not this).

    python scripts/profile_overhead.py [--spec auto] [-n 128] [--temp 0.8] [--category code_edit] [--row N]   (a row of dev.jsonl)
        [--repeat 5] [--cprofile 25]

`auto` decides by the cost curve in the cache (measured first, 1-3 minutes, where there is none).
`--repeat` runs the generation again (the same text) and reports the median per-step figure;
`--cprofile N` prints the N functions of most own time over the generations (llama.cpp's passes included;
the profiler's own cost inflates the per-step figures then).
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
    parser.add_argument("--repeat", type=at_least(1), default=1, help="generations to run; the median is reported")
    parser.add_argument("--cprofile", type=int, default=0, help="print this many functions of most own time")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1].parent / "shared/workloads/dev.jsonl"))
    args = parser.parse_args()

    from specllm.backend import LlamaBackend, LoadOptions
    from specllm.bench.workloads import load_prompts
    from specllm.engine.decode import Done, PrefillDone, StepDone
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
    inside = [0.0, 0.0]  # wall seconds and decoding-thread CPU seconds within llama.cpp's evaluations
    original = LlamaBackend.evaluate

    def timed(self, tokens, rows, copy=True):
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(self, tokens, rows, copy)
        finally:
            inside[0] += time.perf_counter() - started
            inside[1] += time.thread_time() - cpu

    LlamaBackend.evaluate = timed
    params = SamplingParams(temperature=args.temp)
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
    per_step = []
    for repeat in range(args.repeat):
        if repeat:  # a fresh decoder: an n-gram memory of the last answer would draft it whole
            decoder = engine.decoder()
        steps = 0
        if profiler is not None:
            profiler.enable()
        for event in decoder.generate(engine.encode(prompt), args.n, params, np.random.default_rng(0)):
            if isinstance(event, PrefillDone):  # count generation only, not the prompt
                inside[:] = [0.0, 0.0]
                started, cpu = time.perf_counter(), time.thread_time()
            elif isinstance(event, StepDone):
                steps += 1
            elif isinstance(event, Done):
                total, total_cpu = time.perf_counter() - started, time.thread_time() - cpu
                print(f"{len(event.tokens)} tokens in {total:.2f}s ({len(event.tokens) / total:.2f} tok/s), spec {args.spec}, {steps} steps")
        if profiler is not None:
            profiler.disable()
        outside = total - inside[0]
        python_cpu = total_cpu - inside[1]
        per_step.append(python_cpu / max(steps, 1) * 1000)
        print(f"inside llama.cpp evaluation: {inside[0]:.3f}s; outside: {outside:.3f}s = {outside / total:.2%} of wall time; "
              f"Python CPU outside it: {python_cpu * 1000:.1f} ms, {per_step[-1]:.3f} ms a step")  # fmt: skip
    if args.repeat > 1:
        print(f"Python CPU a step, median of {args.repeat}: {float(np.median(per_step)):.3f} ms (min {min(per_step):.3f}, max {max(per_step):.3f})")
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
