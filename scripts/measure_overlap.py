"""How much of the draft model's prompt reading hides behind the target's decoding when both run at once.

    python scripts/measure_overlap.py TARGET.gguf DRAFT.gguf --prompt 2048 > overlap.json

Before its first use the draft model must read the whole prompt (`auto` prices that catch-up and
often waits for it: on a GPU with a 32B target a 3,300-token prompt costs the 0.5B about 11 target
passes). Read in a second thread while the target decodes, it could cost less than that: llama.cpp
releases the GIL during evaluation, and on a GPU a bandwidth-bound decoding step leaves compute idle.
This times single-token target steps alone, the draft's reading alone, and both at once (steps taken
while the reading runs), and reports the share of the reading's time that was hidden: 1 - (what the
target's steps lost while it ran) / (the reading alone), from `--rounds` rounds (medians). Negative:
running both at once costs more than running them one after the other (two threads on one CPU's cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specllm.backend import LlamaBackend, LoadOptions, system_info  # noqa: E402
from specllm.engine.costmodel import filler_tokens, time_batch  # noqa: E402
from specllm.errors import SpecllmError  # noqa: E402

DEPTH = 256  # tokens in the target's cache while it decodes, as the calibration's


def _step(target: LlamaBackend, filler: list[int], token: int) -> float:
    """One single-token target pass after the filler, its row read."""
    return time_batch(target, filler, [token], rows=[0])


def _read(draft: LlamaBackend, prompt: list[int]) -> float:
    """The draft model reading the prompt from an empty cache, its last row only (as a catch-up)."""
    return time_batch(draft, [], prompt, rows=[len(prompt) - 1])


def measure_round(target: LlamaBackend, draft: LlamaBackend, prompt: list[int], filler: list[int], token: int, steps: int) -> dict:
    alone = statistics.median(_step(target, filler, token) for _ in range(steps))
    reading = _read(draft, prompt)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(seconds=_read(draft, prompt)))
    overlapped: list[float] = []
    started = time.perf_counter()
    thread.start()
    while thread.is_alive() or not overlapped:  # at least one step inside the reading
        overlapped.append(_step(target, filler, token))
    thread.join()
    both = time.perf_counter() - started
    lost = both - len(overlapped) * alone  # beyond what those steps cost alone
    return {
        "step_alone": alone,
        "step_during_reading": statistics.median(overlapped),
        "reading_alone": reading,
        "reading_during_steps": result["seconds"],
        "steps_during_reading": len(overlapped),
        "both": both,  # from the reading's start to the last step's end
        "hidden": 1.0 - lost / reading,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--prompt", type=int, default=2048, help="tokens the draft model reads")
    parser.add_argument("--steps", type=int, default=32, help="single-token target steps timed alone, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu-layers", type=int, default=-1, help="-1: every layer where the build can offload")
    args = parser.parse_args()
    for path in (args.target, args.draft):  # llama.cpp would say only that it could not load it
        if not path.is_file():
            sys.exit(f"Error: {path}: {'not a file' if path.exists() else 'no such file'}")
    n_ctx = max(args.prompt, DEPTH) + 64
    try:
        target = LlamaBackend(args.target, LoadOptions(n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=args.gpu_layers))
        draft = LlamaBackend(args.draft, LoadOptions(n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=args.gpu_layers))
    except SpecllmError as error:
        sys.exit(f"Error: {error}")
    filler = filler_tokens(target, DEPTH + 1)
    filler, token = filler[:DEPTH], filler[DEPTH]
    prompt = filler_tokens(draft, args.prompt)
    _read(draft, prompt)  # llama.cpp sizes its buffers on first use
    _step(target, filler, token)
    rounds = [measure_round(target, draft, prompt, filler, token, args.steps) for _ in range(args.rounds)]
    report = {name: round(statistics.median(r[name] for r in rounds), 6) for name in rounds[0]}
    report |= {
        "prompt": args.prompt,
        "models": {"target": args.target.name, "draft": args.draft.name},
        "gpu_layers": {"target": target.n_gpu_layers, "draft": draft.n_gpu_layers},
        "threads": target.n_threads,
        "rounds": rounds,
        "system_info": system_info(),
    }
    print(json.dumps(report, indent=1))
    draft.close()
    target.close()


if __name__ == "__main__":
    main()
