"""Replay `--spec auto` over a server's session: requests in order, one decoder for all of them.

`specllm serve` keeps one decoder for its life, so what one request teaches carries to the next:
the n-gram cache remembers earlier prompts and answers (a completion asked for again, an answer
regenerated), and the policy keeps what it learned of acceptance. `replay_policy.py` replays
prompts one at a time and cannot see either. This records a session's greedy answers as
`specllm serve --spec off` gives them, then replays `auto` on a virtual clock, each request
against plain decoding, once as the session runs (one drafter throughout) and once with a fresh
drafter for every request (what the same request would cost served alone).

    python scripts/replay_session.py record --requests session.jsonl --out session.json [--model GGUF]
    python scripts/replay_session.py replay session.json --costs CURVE [CURVE ...] [-v]

A requests file has one request a line, the body an endpoint takes plus `"endpoint"`: `infill`
(llama.cpp's `/infill`), `chat` (`/v1/chat/completions`) or `completions`, and an optional
`"category"`. A chat request with `"continue": true` carries only the new messages: the recorder
sends the conversation so far, the last answer included, as an agent does. Answers end as the
server ends them (the end token, `max_tokens`, `stop`, `n_indent`), not by `t_max_predict_ms`
(it depends on the machine). Temperature 0 only; the n-gram cache only (what the draft model adds
is `replay_policy.py`'s).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import replay_policy  # noqa: E402  (the replay backends and the virtual clock)


ENDPOINTS = ("infill", "chat", "completions")


def read_requests(path: str) -> list[tuple[int, dict]]:
    """The requests file's lines as (line number, body), every one checked as the server would check
    it before any model loads (one line on stderr and exit 1 at the first that is not a request)."""
    from specllm.server import parsing

    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"Error: --requests {path}: {getattr(error, 'strerror', None) or error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            body = json.loads(line)
        except ValueError as error:
            raise SystemExit(f"Error: {where}: not JSON: {error}") from None
        if not isinstance(body, dict) or body.get("endpoint") not in ENDPOINTS:
            raise SystemExit(f"Error: {where}: a request is a JSON object with \"endpoint\": {', '.join(ENDPOINTS)}")
        if body.get("continue") and body["endpoint"] != "chat":
            raise SystemExit(f"Error: {where}: \"continue\" carries on a chat: its endpoint must be chat")
        if body.get("category") == "all":
            raise SystemExit(f"Error: {where}: the category 'all' is the name of the summary row")
        try:
            _parse({k: v for k, v in body.items() if k not in ("endpoint", "category", "continue")}, body["endpoint"])
        except parsing.ApiError as error:
            raise SystemExit(f"Error: {where}: {error.message}") from None
        requests.append((number, body))
    if not requests:
        raise SystemExit(f"Error: --requests {path}: no requests")
    return requests


def _parse(body: dict, endpoint: str):
    from specllm.server import parsing

    return parsing.parse_infill(body) if endpoint == "infill" else parsing.parse(endpoint, body)


def record(args) -> None:
    from specllm.backend import LoadOptions
    from specllm.engine.ngram import ends_sentence
    from specllm.models.catalog import load_registry
    from specllm.models.store import resolve_model
    from specllm.server import parsing
    from specllm.server.app import Service
    from specllm.server.worker import Job
    from specllm.session import Engine, ModelPaths, SpecConfig

    requests = read_requests(args.requests)
    if args.model:
        model = resolve_model(args.model)
    else:
        registry = load_registry()
        model = resolve_model(registry.default, registry)
    engine = Engine(ModelPaths(model), SpecConfig("off"), LoadOptions(n_ctx=args.ctx_size), LoadOptions())
    service = Service(engine, "recording")
    service.worker.start()
    eog = next(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))
    conversation: list[dict] = []
    streams = []
    try:
        for number, (line, body) in enumerate(requests):
            endpoint, category = body.pop("endpoint"), body.pop("category", None)
            if body.pop("continue", False):
                body["messages"] = conversation + body["messages"]
            body["temperature"] = 0
            try:
                request = _parse(body, endpoint)
                prompt = service.encode(request)
                max_tokens = parsing.check_length(request, len(prompt), engine.target.n_ctx)
            except parsing.ApiError as error:
                raise SystemExit(f"Error: {args.requests}:{line}: {error.message}") from None
            result = _serve(service, Job(prompt, max_tokens, request.params, None, request.stop, request.n_indent))
            answer = service.worker.decoder.history[len(prompt) :]
            stopped = bool(answer) and engine.target.is_eog(answer[-1])
            tokens = answer[:-1] if stopped else answer
            stream = {"id": str(number), "category": category or endpoint, "prompt": prompt, "tokens": tokens, "stopped": stopped,
                      "max_tokens": max_tokens if stopped else len(tokens)}  # fmt: skip
            if stopped:
                stream["end"] = answer[-1]
            streams.append(stream)
            if endpoint == "chat":
                conversation = body["messages"] + [{"role": "assistant", "content": result.text}]
            print(f"{number:3} {stream['category']:14} prompt {len(prompt):5}  answer {len(tokens):4}", file=sys.stderr)
    finally:
        service.close()
    sentence_ends = [t for t in range(engine.target.n_vocab) if ends_sentence(engine.target.token_bytes(t))]
    Path(args.out).write_text(json.dumps({"eog": eog, "sentence_ends": sentence_ends, "streams": streams}))


def _serve(service, job):
    """Run one job on the service's worker, as the server does, and return its Result."""
    finished = threading.Event()
    outcome = {}

    def post(kind: str, payload) -> None:
        if kind in ("done", "error"):
            outcome[kind] = payload
            finished.set()

    job.post = post
    service.worker.submit(job)
    finished.wait()
    if "error" in outcome:
        raise SystemExit(f"request failed: {outcome['error']}")
    return outcome["done"]


def simulate(data: dict, costs, draft_max: int) -> list[dict]:
    """Per request, seconds on the virtual clock: plain decoding, `auto` with one drafter for the
    whole session (as the server keeps it), `auto` with a fresh drafter for the request alone."""
    from specllm.bench.oracle import plain_cost
    from specllm.engine import auto, decode, drafters

    clock = replay_policy.Clock()
    modules = (decode, auto, drafters)
    for module in modules:
        module.time = clock
    try:
        sentence_ends = frozenset(data.get("sentence_ends", ()))  # the target's tokens that end a sentence (none in old recordings)
        session = _drafter(costs, draft_max, sentence_ends)
        rows = []
        for stream in data["streams"]:
            sequence = replay_policy.sequence_of(stream, data["eog"])
            end_pass = costs.verify(1, len(sequence) - 2) if stream["stopped"] else 0.0
            rows.append({
                "id": stream["id"], "category": stream["category"], "tokens": len(stream["tokens"]),
                "plain": plain_cost(stream["prompt"], stream["tokens"], costs) + end_pass,
                "session": _generate(stream, sequence, data, session, costs, clock),
                "alone": _generate(stream, sequence, data, _drafter(costs, draft_max, sentence_ends), costs, clock),
            })  # fmt: skip
        return rows
    finally:
        for module in modules:
            module.time = replay_policy.time


def _drafter(costs, draft_max: int, sentence_ends: frozenset[int]):
    from specllm.engine.auto import auto_drafter
    from specllm.session import SpecConfig

    spec = SpecConfig()  # the n-gram sizes a user's `auto` has
    return auto_drafter(costs.copy(), draft_max, (spec.ngram_min, spec.ngram_max), sentence_end=sentence_ends.__contains__)


def _generate(stream, sequence, data, drafter, costs, clock) -> float:
    """Seconds `auto` spends generating the recorded answer (its prefill apart) with `drafter`."""
    from specllm.engine.decode import Decoder, all_the_room

    eog = replay_policy.end_token(stream, data["eog"])
    target = replay_policy.ReplayBackend(sequence, eog, replay_policy.vocab_size(stream, data), costs, clock, len(stream["prompt"]))
    drafter.ngram.ends_generation = target.is_eog
    # A new decoder reads the whole prompt (not timed); the drafter compares it with what it holds,
    # as the server's does, and remembers what the new prompt abandons.
    decoder = Decoder(target, drafter, all_the_room)
    return replay_policy.time_generation(decoder, stream, replay_policy.max_tokens_of(stream, data), clock)


def replay(args) -> None:
    data = replay_policy.load_recording(args.session)
    curves = [(path, replay_policy.load_curve(path, args.max_batch)) for path in args.costs]  # every file checked first
    for path, costs in curves:
        rows = simulate(data, costs, max(costs.batch_seconds) - 1)
        print(f"\n{Path(path).name}: one token {costs.verify(1) * 1000:.1f} ms")
        if args.verbose:
            for r in rows:
                if r["tokens"]:
                    print(f"  {r['id']:>4} {r['category']:14} {r['tokens']:4} tokens  session {r['plain'] / r['session']:5.2f}x  alone {r['plain'] / r['alone']:5.2f}x")
        answered = [r for r in rows if r["tokens"]]
        if not answered:
            print("no request was answered with a token: nothing timed")
            continue
        print(f"{'category':16} {'n':>3} {'session':>8} {'alone':>7} {'lowest':>7}")
        for category in sorted({r["category"] for r in answered}) + ["all"]:
            chosen = [r for r in answered if category in ("all", r["category"])]
            plain = sum(r["plain"] for r in chosen)
            lowest = min(r["plain"] / r["session"] for r in chosen)
            print(f"{category:16} {len(chosen):>3} {plain / sum(r['session'] for r in chosen):7.3f}x "
                  f"{plain / sum(r['alone'] for r in chosen):6.3f}x {lowest:6.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--requests", required=True, help="one request body a line, with its endpoint")
    rec.add_argument("--out", required=True)
    rec.add_argument("--ctx-size", type=int, default=4096)
    rec.add_argument("--model", help="a GGUF file (default: the default preset's target)")
    rep = commands.add_parser("replay")
    rep.add_argument("session")
    rep.add_argument("--costs", required=True, nargs="+", help="machine files, costs.json files or `bench --json` reports")
    rep.add_argument("--max-batch", type=replay_policy.at_least(2), default=32, help="largest batch `auto` verifies")
    rep.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    from specllm.errors import SpecllmError

    try:
        record(args) if args.command == "record" else replay(args)
    except SpecllmError as error:  # a model or the configuration
        raise SystemExit(f"Error: {error}") from None


if __name__ == "__main__":
    main()
