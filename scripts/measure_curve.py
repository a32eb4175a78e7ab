"""A machine file (the shape of ../shared/machines/*.json) for a target and a draft model on this machine.

    python scripts/measure_curve.py TARGET.gguf DRAFT.gguf --machine "what this machine is" > curve.json
    python scripts/replay_policy.py replay tests/data/dev-streams.json --costs curve.json

`calibrated` is specllm's own calibration (`measure_costs`, what `--spec auto` measures on a first
run); `load_seconds` is what loading each model and its context took, which a run pays before it
generates (and `auto` pays for the draft model where it first consults it). With twins of the models
(`scripts/gguf_twin.py`) the models themselves need not be on the machine: a pass costs what its
tensors' shapes and types make it cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specllm.backend import LlamaBackend, LoadOptions, system_info  # noqa: E402
from specllm.engine.costmodel import measure_costs  # noqa: E402
from specllm.errors import SpecllmError  # noqa: E402


def _loaded(path: Path, options: LoadOptions) -> tuple[LlamaBackend, float]:
    started = time.perf_counter()
    model = LlamaBackend(path, options)
    return model, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--machine", default="", help="what the machine is (CPU, GPU, threads, build)")
    parser.add_argument("--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu-layers", type=int, default=-1, help="-1: every layer where the build can offload")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--exact", action="store_true", help="the target with batch-invariant kernels (specllm --exact; batches as large as keep them)")
    args = parser.parse_args()
    for path in (args.target, args.draft):  # llama.cpp would say only that it could not load it
        if not path.is_file():
            sys.exit(f"Error: {path}: {'not a file' if path.exists() else 'no such file'}")
    options = LoadOptions(n_ctx=args.ctx_size, n_threads=args.threads, n_gpu_layers=args.gpu_layers, exact=args.exact)
    try:
        target, target_load = _loaded(args.target, options)
        draft, draft_load = _loaded(args.draft, LoadOptions(n_ctx=target.n_ctx, n_threads=args.threads, n_gpu_layers=args.gpu_layers))
    except SpecllmError as error:
        sys.exit(f"Error: {error}")
    started = time.perf_counter()
    largest = min(args.max_batch, target.exact_batch or args.max_batch)  # as the engine verifies
    costs = measure_costs(target, draft, max_batch=largest)
    report = {
        "machine": args.machine,
        "calibrated": costs.to_dict(),
        "load_seconds": {"target": round(target_load, 3), "draft": round(draft_load, 3)},
        "models": {"target": args.target.name, "draft": args.draft.name},
        "gpu_layers": {"target": target.n_gpu_layers, "draft": draft.n_gpu_layers},
        "steady": costs.steady,
        "calibration_seconds": round(time.perf_counter() - started, 1),
        "system_info": system_info(),
        "exact_kernels": target.exact,
    }
    print(json.dumps(report, indent=1))
    draft.close()
    target.close()


if __name__ == "__main__":
    main()
