"""Replay `--spec auto`'s n-gram policy against recorded greedy text, on a virtual clock.

At temperature 0 a draft is accepted exactly as far as it agrees with what plain decoding
produced, so once the plain text of each prompt is recorded, any policy can be scored
without timing noise: every target pass costs what the measured cost curve says. This is
how policy changes are compared before `bench` measures them for real.

    python scripts/replay_policy.py record --out streams.json [--prompts dev.jsonl] [-n 128]
    python scripts/replay_policy.py replay streams.json [--costs bench.json]

`record` runs plain decoding on the default preset (slow: a few seconds a prompt);
`replay` prints, per category, the policy's simulated speedup over plain decoding, the
n-gram oracle bound of `bench` and the share of it reached. The draft model is not replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record(args) -> None:
    from specllm.backend import LoadOptions
    from specllm.bench.workloads import load_prompts
    from specllm.engine.decode import Done
    from specllm.engine.sampling import SamplingParams
    from specllm.models.catalog import load_registry
    from specllm.models.store import resolve_model
    from specllm.session import Engine, ModelPaths, SpecConfig

    registry = load_registry()
    engine = Engine(ModelPaths(resolve_model(registry.default, registry)), SpecConfig("off"), LoadOptions(n_ctx=4096), LoadOptions())
    eog = next(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))
    streams = []
    for prompt in load_prompts(Path(args.prompts)):
        tokens = engine.encode(prompt.text)
        for event in engine.decoder("off").generate(tokens, args.n, SamplingParams(temperature=0.0), np.random.default_rng(0)):
            if isinstance(event, Done):
                ended = event.finish_reason == "stop"
                streams.append({"id": prompt.id, "category": prompt.category, "prompt": tokens, "tokens": event.tokens, "stopped": ended})
                print(f"{prompt.category:16} {prompt.id:>6} {len(event.tokens)} tokens", file=sys.stderr)
    Path(args.out).write_text(json.dumps({"eog": eog, "max_tokens": args.n, "streams": streams}))


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ReplayBackend:
    """A target whose greedy choice after every position is the recorded text; passes cost virtual time."""

    def __init__(self, sequence: list[int], eog: int, costs, clock: Clock):
        self.sequence, self.eog, self.costs, self.clock = sequence, eog, costs, clock
        self.n_vocab = max(max(sequence), eog) + 1
        self.n_ctx = len(sequence) + 64
        self.n_past = 0

    def evaluate(self, tokens, rows) -> np.ndarray:
        self.clock.now += self.costs.verify(len(tokens), self.n_past)
        out = np.zeros((len(rows), self.n_vocab), dtype=np.float32)
        for i, row in enumerate(rows):
            position = self.n_past + row + 1
            out[i, self.sequence[position] if position < len(self.sequence) else self.eog] = 1.0
        self.n_past += len(tokens)
        return out

    def rewind(self, n_past: int) -> None:
        self.n_past = min(self.n_past, n_past)

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def token_bytes(self, token: int) -> bytes:
        return b""


def simulate(data: dict, costs, draft_max: int, verbose: bool = False) -> dict[str, list[float]]:
    """Per category: [plain seconds, auto's seconds, oracle seconds, prompts]."""
    from specllm.bench.harness import oracle_cost, plain_cost
    from specllm.engine import decode, policy
    from specllm.engine.decode import Decoder, Done, PrefillDone
    from specllm.engine.drafters import NgramDrafter
    from specllm.engine.policy import AutoDrafter, CostAwarePolicy
    from specllm.engine.sampling import SamplingParams

    clock = Clock()
    by_category: dict[str, list[float]] = {}
    decode.time = policy.time = clock  # both read time.perf_counter only; put back below
    try:
        for stream in data["streams"]:
            sequence = stream["prompt"] + stream["tokens"] + ([data["eog"]] if stream["stopped"] else [])
            backend = ReplayBackend(sequence, data["eog"], costs, clock)
            drafter = AutoDrafter(NgramDrafter(2, 4), None, CostAwarePolicy(costs.copy(), draft_max=draft_max))
            decoder = Decoder(backend, drafter, lambda history, limit: limit)
            started = None
            for event in decoder.generate(stream["prompt"], data["max_tokens"], SamplingParams(temperature=0.0), np.random.default_rng(0)):
                if isinstance(event, PrefillDone):
                    started = clock.now
                elif isinstance(event, Done):
                    if event.tokens != stream["tokens"]:
                        raise RuntimeError(f"replay of {stream['id']} diverged from the recording")
            end_pass = costs.verify(1, len(sequence) - 2) if stream["stopped"] else 0.0  # the pass that chose the end token
            plain = plain_cost(stream["prompt"], stream["tokens"], costs) + end_pass
            spent = clock.now - started
            oracle = oracle_cost(stream["prompt"], stream["tokens"], costs, (2, 4), max(costs.batch_seconds) - 1) + end_pass
            totals = by_category.setdefault(stream["category"], [0.0, 0.0, 0.0, 0])
            for i, value in enumerate((plain, spent, oracle, 1)):
                totals[i] += value
            if verbose:
                print(f"{stream['category']:16} {stream['id']:>6} auto {plain / spent:5.2f}x  oracle {plain / oracle:5.2f}x")
    finally:
        decode.time = policy.time = time
    by_category["all"] = [sum(t[i] for t in by_category.values()) for i in range(4)]
    return by_category


def load_curve(path: str, max_batch: int):
    from specllm.engine.costmodel import CostModel

    report = json.loads(Path(path).read_text())
    curve = {c["batch"]: c["ms"] / 1000 for c in report["verify_cost"] if c["batch"] <= max_batch}
    depth, context_seconds = report.get("verify_cost_depth", 0), report.get("verify_context_us", 0.0) / 1e6
    return CostModel(curve, draft_seconds=1.0, depth=depth, context_seconds=context_seconds)


def replay(args) -> None:
    data = json.loads(Path(args.streams).read_text())
    costs = load_curve(args.costs, args.max_batch)
    print(f"{'category':16} {'n':>3} {'auto':>6} {'oracle':>7} {'share':>6}")
    for category, (plain, spent, oracle, n) in sorted(simulate(data, costs, args.max_batch - 1, args.verbose).items()):
        print(f"{category:16} {n:>3} {plain / spent:5.3f}x {plain / oracle:6.3f}x {oracle / spent:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--prompts", default=str(ROOT.parent / "shared/workloads/dev.jsonl"))
    rec.add_argument("-n", type=int, default=128)
    rep = commands.add_parser("replay")
    rep.add_argument("streams")
    rep.add_argument("--costs", required=True, help="a `bench --json` file: its verify_cost curve is used")
    rep.add_argument("--max-batch", type=int, default=32, help="largest batch for auto and the oracle alike")
    rep.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
