"""Replay `--spec auto`'s n-gram policy against recorded greedy text, on a virtual clock.

At temperature 0 a draft is accepted exactly as far as it agrees with what plain decoding
produced, so once the plain text of each prompt is recorded, any policy can be scored
without timing noise: every target pass costs what the measured cost curve says. This is
how policy changes are compared before `bench` measures them for real.

    python scripts/replay_policy.py record --out streams.json [--prompts dev.jsonl] [-n 128] [-c 4096] [--limit N]
    python scripts/replay_policy.py replay streams.json --costs CURVE [CURVE ...] [--no-draft] [-v]

`record` runs plain decoding on the default preset (or `--model` and `--draft`; slow: a few seconds
a prompt), and keeps the target's top probability on every token and what the draft model proposes
after every position; run on an existing recording (of the same model, prompts and `-n`), it records
the prompts it lacks and adds the target's top probabilities where they are missing;
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
sys.path.insert(0, str(ROOT / "scripts"))

from script_inputs import at_least, load_curve, load_recording, max_tokens_of, read_json  # noqa: E402


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

    out = Path(args.out)
    earlier = _earlier_recording(out, args.n)  # a stopped recording resumes
    prompts = load_prompts(Path(args.prompts))
    if args.limit:
        prompts = prompts[: args.limit]
    target_name = args.model or load_registry().default
    draft_name = args.draft or resolve_preset_draft(target_name)
    if draft_name is None:
        raise SystemExit(f"Error: --model {target_name} names no preset with a draft model: add --draft")
    target_path, draft_path = resolve_model(target_name), resolve_model(draft_name)
    engine = Engine(ModelPaths(target_path), SpecConfig("off"), LoadOptions(n_ctx=args.ctx_size), LoadOptions())
    draft = LlamaBackend(draft_path, LoadOptions(n_ctx=args.ctx_size))
    eog = next(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))  # for streams that do not say
    sentence_ends = [t for t in range(engine.target.n_vocab) if ends_sentence(engine.target.token_bytes(t))]
    streams, max_tokens = earlier.get("streams", []), earlier.get("max_tokens", args.n or DEFAULT_MAX_TOKENS)
    _check_same_model(out, earlier, engine, prompts)
    eog = earlier.get("eog", eog)  # what the earlier streams that do not say ended with
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


DEFAULT_MAX_TOKENS = 128


def _earlier_recording(out: Path, max_tokens: int | None) -> dict:
    """What `--out` holds already: nothing, or a recording to resume (at its own `-n`). Anything
    else there is refused before the models load: writing the recording would replace it."""
    if not out.exists():
        return {}
    earlier = read_json(str(out), "--out")
    if not isinstance(earlier, dict) or not isinstance(earlier.get("streams"), list):
        raise SystemExit(f"Error: --out {out}: exists and is not a recording; writing one would replace it (name a new file)")
    if max_tokens is not None and max_tokens != earlier.get("max_tokens", max_tokens):
        raise SystemExit(f"Error: --out {out}: recorded with -n {earlier['max_tokens']}; resume it with that -n or name a new file")
    return earlier


def _check_same_model(out: Path, earlier: dict, engine, prompts) -> None:
    """A recording resumes only with the model (and prompts) it was made with: its streams are that
    model's tokens, and a stream of another would be replayed as if it were the same text."""
    if not earlier:
        return
    eog = earlier.get("eog")
    texts = {(p.id, p.category): p.text for p in prompts}
    same = isinstance(eog, int) and 0 <= eog < engine.target.n_vocab and engine.target.is_eog(eog)
    for stream in earlier["streams"]:
        if same and (stream["id"], stream["category"]) in texts:
            same = engine.encode(texts[stream["id"], stream["category"]]) == stream["prompt"]
    if not same:
        raise SystemExit(f"Error: --out {out}: recorded with another model or other prompts (its prompt tokens differ); name a new file")


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
                print(f"{stream['category']:16} {stream['id']:>6} auto {times(p, figures['auto'], 5, 2)}  oracle {times(p, figures['oracle'], 5, 2)}")
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
    return time_generation(decoder, stream, max_tokens_of(stream, data), clock)


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


def times(slower: float, faster: float, width: int = 6, digits: int = 3) -> str:
    """`slower / faster` as a speedup, or a dash where nothing was timed (a generation of no tokens)."""
    return f"{slower / faster:{width}.{digits}f}x" if faster > 0 else f"{'-':>{width}} "


COLUMNS = ("auto", "ngram_only", "ngram_oracle", "oracle")


def replay(args) -> None:
    data = load_recording(args.streams)
    curves = [(path, load_curve(path, args.max_batch)) for path in args.costs]  # every file checked before minutes of replaying
    for path, costs in curves:
        print(f"\n{Path(path).name}: one token {costs.verify(1) * 1000:.1f} ms, draft step {costs.draft_seconds / costs.verify(1):.2f}, "
              f"draft reads a token {costs.draft_token_seconds * 1000:.2f} ms")
        print(f"{'category':16} {'n':>3} {'auto':>7} {'ngram':>7} {'ng-orc':>7} {'oracle':>7} {'share':>6} {'told':>7} {'share':>6} {'thresh':>7}")
        largest = max(costs.batch_seconds)  # a curve measured to fewer sizes: as its engine verifies
        for category, f in sorted(simulate(data, costs, largest - 1, not args.no_draft, args.verbose).items()):
            ratios = " ".join(times(f["plain"], f[c]) for c in COLUMNS)
            baseline = f" {times(f['plain'], f['threshold'])} at {f['best_threshold']:.1f}" if "threshold" in f else ""
            told = f"{times(f['plain'], f['told'])} {_share(f['oracle'], f['told'])}"
            print(f"{category:16} {int(f['prompts']):>3} {ratios} {_share(f['oracle'], f['auto'])} {told}{baseline}")
        print("share: of the two-source oracle; told: the n-gram cache told each category's copy lengths by kind and span,\n"
              "in hindsight; thresh: the draft model alone at the best fixed confidence threshold, in hindsight")


def _share(best: float, reached: float) -> str:
    return f"{best / reached:6.1%}" if reached > 0 else f"{'-':>6}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--prompts", default=str(ROOT.parent / "shared/workloads/dev.jsonl"))
    rec.add_argument("-n", type=at_least(1), default=None, help=f"most tokens a prompt generates (default {DEFAULT_MAX_TOKENS}; a resumed recording: its own)")
    rec.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    rec.add_argument("-c", "--ctx-size", type=int, default=4096, help="context of both models (a prompt and its answer must fit)")
    rec.add_argument("-m", "--model", help="the target: preset, model name or GGUF path (default: the default preset's)")
    rec.add_argument("--draft", help="the draft model (default: the --model preset's)")
    rep = commands.add_parser("replay")
    rep.add_argument("streams")
    rep.add_argument("--costs", required=True, nargs="+", help="machine files, costs.json files or `bench --json` reports")
    rep.add_argument("--max-batch", type=at_least(2), default=32, help="largest batch for auto and the oracle alike")
    rep.add_argument("--no-draft", action="store_true", help="replay without the draft model")
    rep.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    from specllm.errors import SpecllmError

    try:
        record(args) if args.command == "record" else replay(args)
    except SpecllmError as error:  # a model, a prompts file or the configuration
        raise SystemExit(f"Error: {error}") from None


if __name__ == "__main__":
    main()
