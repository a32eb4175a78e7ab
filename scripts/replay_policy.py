"""Replay `--spec auto`'s n-gram policy against recorded greedy text, on a virtual clock.

At temperature 0 a draft is accepted exactly as far as it agrees with what plain decoding
produced, so once the plain text of each prompt is recorded, any policy can be scored
without timing noise: every target pass costs what the measured cost curve says. This is
how policy changes are compared before `bench` measures them for real.

    python scripts/replay_policy.py record --out streams.json [--prompts dev.jsonl] [-n 128] [-c 4096]
    python scripts/replay_policy.py replay streams.json [--costs bench.json]

`record` runs plain decoding on the default preset (slow: a few seconds a prompt), and keeps the
target's top probability on every token and what the draft model proposes after every position;
run on an existing recording, it adds the target's top probabilities where they are missing;
`replay` prints, per category, the policy's simulated speedup over plain decoding, with the n-gram
cache alone, the n-gram oracle bound of `bench`, the two-source oracle and the share of it reached,
an n-gram policy told in hindsight how far the category's proposals run by their kind and agreeing
span (and its share of the oracle: what deciding from those features can reach when copy lengths
are known on average), and the draft model alone with the best fixed confidence threshold (the
baseline a draft-model policy must beat; the oracles know where every draft ends, no policy does).
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


OFF_PATH_STEPS = 6  # past a wrong draft token, how far the draft model's own continuation is recorded
OFF_PATH_FLOOR = 0.05  # ... stopping once its confidence falls below this (no policy drafts on there)
# The baseline a draft-model policy must beat: the draft model at every step, drafting while its
# confidence is at least a fixed threshold, the threshold chosen per category with hindsight.
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def record(args) -> None:
    from specllm.backend import LlamaBackend, LoadOptions
    from specllm.bench.workloads import load_prompts
    from specllm.engine.decode import Done
    from specllm.engine.ngram import ends_sentence
    from specllm.engine.sampling import SamplingParams
    from specllm.models.catalog import load_registry, resolve_preset_draft
    from specllm.models.store import resolve_model
    from specllm.session import Engine, ModelPaths, SpecConfig

    registry = load_registry()
    engine = Engine(ModelPaths(resolve_model(registry.default, registry)), SpecConfig("off"), LoadOptions(n_ctx=args.ctx_size), LoadOptions())
    draft = LlamaBackend(resolve_model(resolve_preset_draft(registry.default, registry), registry), LoadOptions(n_ctx=args.ctx_size))
    eog = next(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))  # for streams that do not say
    sentence_ends = [t for t in range(engine.target.n_vocab) if ends_sentence(engine.target.token_bytes(t))]
    prompts = load_prompts(Path(args.prompts))
    if args.limit:
        prompts = prompts[: args.limit]
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.exists() else {}  # a stopped recording resumes
    streams, max_tokens = earlier.get("streams", []), earlier.get("max_tokens", args.n)
    done = {(s["id"], s["category"]) for s in streams}
    for stream in streams:  # recorded before the target's confidence was kept
        if "target_confidence" not in stream:
            stream["target_confidence"] = record_target(engine.target, sequence_of(stream, recording_eog=eog), len(stream["prompt"]))
    for prompt in prompts:
        if (prompt.id, prompt.category) in done:
            continue
        tokens = engine.encode(prompt.text)
        decoder = engine.decoder("off")
        for event in decoder.generate(tokens, max_tokens, SamplingParams(temperature=0.0), np.random.default_rng(0)):
            if isinstance(event, Done):
                ended = event.finish_reason == "stop"
                stream = {"id": prompt.id, "category": prompt.category, "prompt": tokens, "tokens": event.tokens, "stopped": ended}
                if ended:
                    stream["end"] = decoder.history[-1]  # the end-of-generation token the target chose
                sequence = sequence_of(stream, recording_eog=eog)
                stream["target_confidence"] = record_target(engine.target, sequence, len(tokens))
                stream["draft"] = record_draft(draft, sequence, len(tokens), engine.target.n_vocab)
                streams.append(stream)
                print(f"{prompt.category:16} {prompt.id:>6} {len(event.tokens)} tokens", file=sys.stderr)
        _save(out, eog, max_tokens, sentence_ends, streams)  # after every prompt
    _save(out, eog, max_tokens, sentence_ends, streams)


def _save(out: Path, eog: int, max_tokens: int, sentence_ends: list[int], streams: list[dict]) -> None:
    out.write_text(json.dumps({"eog": eog, "max_tokens": max_tokens, "sentence_ends": sentence_ends, "streams": streams}))


def record_target(target, sequence: list[int], prompt_length: int) -> list[float]:
    """The target's top probability on each token after the prompt, the end token included (what
    `--spec auto` reads of how sure the target is while the draft model is cold), from one batched
    pass over the text."""
    rows = _rows_along(target, sequence, prompt_length)
    target.rewind(0)
    return [round(float(c), 4) for c in _top_probability(rows)]


def _rows_along(backend, sequence: list[int], prompt_length: int) -> np.ndarray:
    """The backend's logits for the token after each position of `sequence` from the prompt's last
    token on, from one batched pass (its cache then holds all of the sequence but the last token)."""
    backend.rewind(0)
    start = prompt_length - 1
    if start:
        backend.evaluate(sequence[:start], [])
    return backend.evaluate(sequence[start:-1], list(range(len(sequence) - 1 - start)))


def record_draft(draft, sequence: list[int], prompt_length: int, n_vocab: int) -> dict:
    """What the draft model proposes after every position of the recorded text, at temperature 0.

    One batched pass over the text gives the draft's argmax and confidence (top probability) for the
    token after each position from the prompt's last token on: a draft started there is accepted
    exactly as far as these argmaxes equal the text. Where one does not, the draft model's own
    continuation is decoded a few steps, for its confidences (the policy's stopping signal); those
    tokens are rejected whatever they are.
    """
    start = prompt_length - 1
    rows = _rows_along(draft, sequence, prompt_length)[:, :n_vocab]
    argmax = [int(t) for t in rows.argmax(axis=1)]
    confidence = [round(float(c), 4) for c in _top_probability(rows)]
    off_path = {}
    for i, token in enumerate(argmax):
        position = start + i
        if token == sequence[position + 1]:
            continue
        draft.rewind(position + 1)
        steps, last = [], token
        for _ in range(OFF_PATH_STEPS):
            row = draft.evaluate([last], [0])[0][:n_vocab]
            last, top = int(row.argmax()), float(_top_probability(row[None])[0])
            steps.append([last, round(top, 4)])
            if top < OFF_PATH_FLOOR:
                break
        off_path[str(position)] = steps
    draft.rewind(0)
    return {"start": start, "argmax": argmax, "confidence": confidence, "off_path": off_path}


def end_token(stream: dict, recording_eog: int) -> int:
    """The end-of-generation token the target chose (recordings that do not keep it: the
    recording's first end-of-generation token)."""
    return stream.get("end", recording_eog)


def sequence_of(stream: dict, recording_eog: int) -> list[int]:
    """The prompt, the recorded text and, when the generation stopped, its end token."""
    return stream["prompt"] + stream["tokens"] + ([end_token(stream, recording_eog)] if stream["stopped"] else [])


def _top_probability(rows: np.ndarray) -> np.ndarray:
    z = rows.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return 1.0 / np.exp(z).sum(axis=1)


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _one_hot_row(n_vocab: int, token: int, confidence: float) -> np.ndarray:
    """Logits whose argmax is `token` with top probability `confidence` (softmax over n_vocab)."""
    row = np.zeros(n_vocab, dtype=np.float32)
    c = min(max(confidence, 1e-6), 1 - 1e-6)
    row[token] = np.log(c * (n_vocab - 1) / (1 - c))
    return row


class ReplayBackend:
    """A target whose greedy choice after every position is the recorded text, with the recorded top
    probability on the generated tokens (where the recording has none, a one-hot row's: almost 0);
    passes cost virtual time."""

    def __init__(self, sequence: list[int], eog: int, n_vocab: int, costs, clock: Clock, prompt_length: int = 0, confidence: list[float] = ()):
        self.sequence, self.eog, self.costs, self.clock = sequence, eog, costs, clock
        self.n_vocab, self.prompt_length, self.confidence = n_vocab, prompt_length, confidence
        self.n_ctx = self.n_batch = len(sequence) + 64
        self.n_past = 0

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        self.clock.now += self.costs.verify(len(tokens), self.n_past)
        out = np.zeros((len(rows), self.n_vocab), dtype=np.float32)
        for i, row in enumerate(rows):
            position = self.n_past + row + 1
            token = self.sequence[position] if position < len(self.sequence) else self.eog
            generated = position - self.prompt_length
            if 0 <= generated < len(self.confidence):
                out[i] = _one_hot_row(self.n_vocab, token, self.confidence[generated])
            else:
                out[i, token] = 1.0
        self.n_past += len(tokens)
        return out

    def rewind(self, n_past: int) -> None:
        self.n_past = min(self.n_past, n_past)

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def token_bytes(self, token: int) -> bytes:
        return b""


class ReplayDraftBackend:
    """The draft model as recorded: after a prefix of the text, its greedy guess and confidence; after
    one of its own wrong guesses, its recorded continuation (then no confidence: it stops). A batch of
    n tokens costs the cost model's catch-up of n, one token a draft step."""

    def __init__(self, sequence: list[int], record: dict, n_vocab: int, costs, clock: Clock, eog: int):
        self.sequence, self.costs, self.clock, self.n_vocab, self.eog = sequence, costs, clock, n_vocab, eog
        self.start, self.argmax, self.confidence = record["start"], record["argmax"], record["confidence"]
        self.off_path = {int(k): v for k, v in record["off_path"].items()}
        self.n_ctx = self.n_batch = len(sequence) + 64
        self.kv: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.kv)

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        self.clock.now += self.costs.catch_up(len(tokens)) if len(tokens) > 1 else self.costs.draft_seconds
        base = len(self.kv)
        self.kv.extend(tokens)
        return np.vstack([self._row(base + r) for r in rows])

    def _row(self, q: int) -> np.ndarray:
        """The draft's next-token logits after kv[: q + 1]."""
        agree = next((j for j in range(q + 1) if j >= len(self.sequence) or self.kv[j] != self.sequence[j]), q + 1)
        if agree > q:  # on the recorded text (after its end: no confidence at all)
            i = q - self.start
            return _one_hot_row(self.n_vocab, self.argmax[i], self.confidence[i]) if i < len(self.argmax) else np.zeros(self.n_vocab, dtype=np.float32)
        wrong = agree - 1  # kv[agree] is the draft's own wrong guess after position `wrong`
        steps = self.off_path.get(wrong, [])
        j = q - agree
        if j < len(steps) and all(self.kv[agree + 1 + t] == steps[t][0] for t in range(j)):
            return _one_hot_row(self.n_vocab, steps[j][0], steps[j][1])
        return np.zeros(self.n_vocab, dtype=np.float32)  # beyond the recording: no confidence at all

    def rewind(self, n_past: int) -> None:
        del self.kv[n_past:]

    def is_eog(self, token: int) -> bool:
        return token == self.eog


def simulate(data: dict, costs, draft_max: int, use_draft: bool = True, verbose: bool = False) -> dict[str, dict[str, float]]:
    """Per category, seconds on the virtual clock: plain decoding, auto (with the draft model when
    recorded and `use_draft`), auto with the n-gram cache alone, the n-gram oracle, the two-source
    oracle, the n-gram policy told each category's copy lengths; and the prompts."""
    from specllm.bench.oracle import ngram_oracle_cost, plain_cost, told_ngram_cost, two_source_oracle_cost
    from specllm.engine import auto, decode, drafters

    proposals, lengths = _copy_lengths_by_category(data, draft_max)
    clock = Clock()
    by_category: dict[str, dict[str, float]] = {}
    modules = (decode, auto, drafters)  # they read time.perf_counter only; put back below
    for module in modules:
        module.time = clock
    try:
        for stream in data["streams"]:
            sequence = sequence_of(stream, data["eog"])
            record = stream.get("draft") if use_draft else None
            end_pass = costs.verify(1, len(sequence) - 2) if stream["stopped"] else 0.0  # the pass that chose the end token
            figures = {"plain": plain_cost(stream["prompt"], stream["tokens"], costs) + end_pass, "prompts": 1}
            figures["auto"] = _run_auto(stream, data, sequence, record, costs, draft_max, clock)
            figures["ngram_only"] = _run_auto(stream, data, sequence, None, costs, draft_max, clock) if record else figures["auto"]
            figures["ngram_oracle"] = ngram_oracle_cost(stream["prompt"], stream["tokens"], costs, (2, 4), draft_max) + end_pass
            guesses = record["argmax"] if record else None
            figures["oracle"] = two_source_oracle_cost(stream["prompt"], stream["tokens"], costs, (2, 4), draft_max, guesses) + end_pass
            figures["told"] = told_ngram_cost(stream["prompt"], proposals[id(stream)], lengths[stream["category"]], costs) + end_pass
            if record:
                for threshold in THRESHOLDS:
                    figures[f"threshold {threshold}"] = threshold_cost(stream, costs, threshold, draft_max) + end_pass
            totals = by_category.setdefault(stream["category"], {})
            for name, value in figures.items():
                totals[name] = totals.get(name, 0.0) + value
            if verbose:
                p = figures["plain"]
                print(f"{stream['category']:16} {stream['id']:>6} auto {p / figures['auto']:5.2f}x  oracle {p / figures['oracle']:5.2f}x")
    finally:
        for module in modules:
            module.time = time
    everything = {}
    for totals in by_category.values():
        for name, value in totals.items():
            everything[name] = everything.get(name, 0.0) + value
    by_category["all"] = everything
    for totals in by_category.values():  # the threshold that did best in the category, with hindsight
        if f"threshold {THRESHOLDS[0]}" in totals:
            best = min(THRESHOLDS, key=lambda threshold: totals[f"threshold {threshold}"])
            totals["threshold"], totals["best_threshold"] = totals[f"threshold {best}"], best
    return by_category


def _copy_lengths_by_category(data: dict, draft_max: int) -> tuple[dict, dict]:
    """Every stream's n-gram proposals (by `id` of the stream), and each category's copy lengths over them."""
    from specllm.bench.oracle import copy_lengths, ngram_proposals

    proposals = {id(s): ngram_proposals(s["prompt"], s["tokens"], (2, 4), draft_max) for s in data["streams"]}
    lengths = {}
    for category in {s["category"] for s in data["streams"]}:
        streams = [s for s in data["streams"] if s["category"] == category]
        lengths[category] = copy_lengths([proposals[id(s)] for s in streams], [len(s["prompt"]) for s in streams], draft_max)
    return proposals, lengths


def threshold_cost(stream: dict, costs, threshold: float, draft_max: int) -> float:
    """Seconds the draft model alone spends on the recorded text with a fixed stopping rule: at every
    step it drafts while its confidence is at least `threshold` (the step that shows a lower one is
    paid too), then the target verifies. It reads the prompt before its first step, and after a
    fully accepted draft it reads its last drafted token with the target's next one, as `auto` does."""
    record, generated = stream["draft"], stream["tokens"]
    confidence, guesses, off_path = record["confidence"], record["argmax"], record["off_path"]
    start = len(stream["prompt"]) - 1
    seconds = costs.catch_up(start) if start else 0.0
    i = 0
    while i < len(generated):
        steps, drafted, accepted, wrong = 0, 0, 0, None  # wrong: the draft's own continuation past its first wrong token
        while drafted < min(draft_max, len(generated) - i - 1):
            if wrong is None:
                confident = confidence[i + drafted]
            else:
                j = drafted - accepted - 1
                confident = wrong[j][1] if j < len(wrong) else 0.0
            steps += 1
            if confident < threshold:
                break
            if wrong is None and guesses[i + drafted] == generated[i + drafted]:
                accepted += 1
            elif wrong is None:
                wrong = off_path.get(str(start + i + drafted), [])
            drafted += 1
        else:
            if drafted and accepted == drafted:
                seconds += costs.catch_up(2) - costs.draft_seconds
        seconds += steps * costs.draft_seconds + costs.verify(drafted + 1, start + i)
        i += accepted + 1
    return seconds


def vocab_size(stream, data) -> int:
    """The replay backends' vocabulary: one past the largest token id the stream or its draft record holds."""
    record = stream.get("draft") or {"argmax": [], "off_path": {}}
    off = [t for steps in record["off_path"].values() for t, _ in steps]
    return max(sequence_of(stream, data["eog"]) + record["argmax"] + off + [data["eog"]]) + 1


def _run_auto(stream, data, sequence, record, costs, draft_max, clock) -> float:
    """Seconds `--spec auto` spends generating the recorded text (its prefill apart) on the virtual clock."""
    from specllm.engine.auto import auto_drafter
    from specllm.engine.decode import Decoder, all_the_room
    from specllm.engine.drafters import ModelDrafter
    from specllm.session import SpecConfig

    n_vocab = vocab_size(stream, data)
    eog = end_token(stream, data["eog"])
    target = ReplayBackend(sequence, eog, n_vocab, costs, clock, len(stream["prompt"]), stream.get("target_confidence", ()))
    model = ModelDrafter(ReplayDraftBackend(sequence, record, n_vocab, costs, clock, eog), 0.0, n_vocab, target.is_eog) if record else None
    sentence_ends = frozenset(data.get("sentence_ends", ()))  # the target's tokens that end a sentence (none in old recordings)
    spec = SpecConfig()  # the n-gram sizes a user's `auto` has
    drafter = auto_drafter(costs.copy(), draft_max, (spec.ngram_min, spec.ngram_max), model, target.is_eog, sentence_ends.__contains__)
    decoder = Decoder(target, drafter, all_the_room)
    return time_generation(decoder, stream, data["max_tokens"], clock)


def time_generation(decoder, stream: dict, max_tokens: int, clock: Clock) -> float:
    """Seconds on the virtual clock `decoder` spends generating the recorded text (its prefill
    apart) at temperature 0; RuntimeError where its text parts from the recording."""
    from specllm.engine.decode import Done, PrefillDone
    from specllm.engine.sampling import SamplingParams

    started = clock.now
    for event in decoder.generate(stream["prompt"], max_tokens, SamplingParams(temperature=0.0), np.random.default_rng(0)):
        if isinstance(event, PrefillDone):
            started = clock.now
        elif isinstance(event, Done) and event.tokens != stream["tokens"]:
            raise RuntimeError(f"replay of {stream['id']} diverged from the recording")
    return clock.now - started


def load_curve(path: str, max_batch: int):
    """A cost model from a machine file (`../shared/machines/*.json`), a `costs.json` entry file, or
    a `bench --json` report."""
    from specllm.engine.costmodel import CostModel

    report = json.loads(Path(path).read_text())
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
    costs.batch_seconds = {k: v for k, v in costs.batch_seconds.items() if k <= max_batch}
    return costs


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


COLUMNS = ("auto", "ngram_only", "ngram_oracle", "oracle")


def replay(args) -> None:
    data = json.loads(Path(args.streams).read_text())
    for path in args.costs:
        costs = load_curve(path, args.max_batch)
        print(f"\n{Path(path).name}: one token {costs.verify(1) * 1000:.1f} ms, draft step {costs.draft_seconds / costs.verify(1):.2f}, "
              f"draft reads a token {costs.draft_token_seconds * 1000:.2f} ms")
        print(f"{'category':16} {'n':>3} {'auto':>7} {'ngram':>7} {'ng-orc':>7} {'oracle':>7} {'share':>6} {'told':>7} {'share':>6} {'thresh':>7}")
        largest = min(args.max_batch, max(costs.batch_seconds))  # a curve measured to fewer sizes: as its engine verifies
        for category, f in sorted(simulate(data, costs, largest - 1, not args.no_draft, args.verbose).items()):
            ratios = " ".join(f"{f['plain'] / f[c]:6.3f}x" for c in COLUMNS)
            baseline = f" {f['plain'] / f['threshold']:6.3f}x at {f['best_threshold']:.1f}" if "threshold" in f else ""
            told = f"{f['plain'] / f['told']:6.3f}x {f['oracle'] / f['told']:6.1%}"
            print(f"{category:16} {int(f['prompts']):>3} {ratios} {f['oracle'] / f['auto']:6.1%} {told}{baseline}")
        print("share: of the two-source oracle; told: the n-gram cache told each category's copy lengths by kind and span,\n"
              "in hindsight; thresh: the draft model alone at the best fixed confidence threshold, in hindsight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--prompts", default=str(ROOT.parent / "shared/workloads/dev.jsonl"))
    rec.add_argument("-n", type=int, default=128)
    rec.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    rec.add_argument("-c", "--ctx-size", type=int, default=4096, help="context of both models (a prompt and its answer must fit)")
    rep = commands.add_parser("replay")
    rep.add_argument("streams")
    rep.add_argument("--costs", required=True, nargs="+", help="machine files, costs.json files or `bench --json` reports")
    rep.add_argument("--max-batch", type=int, default=32, help="largest batch for auto and the oracle alike")
    rep.add_argument("--no-draft", action="store_true", help="replay without the draft model")
    rep.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
