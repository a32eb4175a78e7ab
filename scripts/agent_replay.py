"""The agent case: one multi-turn editing session replayed against `specllm serve` and against
`python -m llama_cpp.server` (plain, and with its prompt-lookup draft), same model, same requests.

The session is built from the code edits of a Spec-Bench-style workload (`dev.jsonl`): the
functions taken from one source file make "the file"; turn k asks for the edit of row k on one of
its functions, with the whole current file, and every earlier turn, in the request (as an agent
sends them). The reply's code replaces that function in the file for the next turn. specllm runs
first and its replies build the later turns; the llama.cpp servers then get exactly those requests.
Every request streams at temperature 0; reported per turn: tokens, time to first token, tok/s
after the first token, and wall time.

    python scripts/agent_replay.py --workload dev.jsonl [--file base64.py] [--turns 3] [-n 128]

Needs specllm's `server` extra and llama-cpp-python's server extra (fastapi, sse-starlette,
starlette-context, pydantic-settings); `--llama-python` names another interpreter for the latter.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from script_inputs import at_least  # beside this script: on the path when it runs

START_TIMEOUT = 600  # seconds for a server to load its model (and, for auto, measure its costs)
REQUEST_TIMEOUT = 900
# Sent explicitly: a template's default system prompt (Qwen's Jinja template has one, llama.cpp's
# built-in rendering does not) would otherwise make the two servers' prompts differ.
SYSTEM = "You are a careful coding assistant."


# -- the session ---------------------------------------------------------------------------------


def edits_by_file(workload: Path) -> dict[str, list[dict]]:
    """Code-edit rows grouped by source file: {"base64.py": [{name, instruction, code}, ...]}."""
    groups = defaultdict(list)
    for line in workload.read_text("utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("category") != "code_edit" or ":" not in row.get("source", ""):
            continue
        instruction, _, rest = row["turns"][0].partition("\n\n```python\n")
        code = rest.rsplit("\n```", 1)[0]
        path, name = row["source"].split()[-1].split(":")
        groups[Path(path).name].append({"name": name, "instruction": instruction, "code": code})
    return dict(groups)


def user_turn(edit: dict, file_text: str) -> str:
    return f"{edit['instruction']}\nThe function is `{edit['name']}` in this file:\n\n```python\n{file_text}\n```"


def apply_reply(file_text: str, old_code: str, reply: str) -> tuple[str, str]:
    """The file with the function replaced by the reply's code block (unchanged when there is none)."""
    found = re.search(r"```(?:python)?\n(.*?)(?:\n```|$)", reply, flags=re.S)
    new_code = found.group(1).rstrip("\n") if found else None
    if not new_code or old_code not in file_text:
        return file_text, old_code
    return file_text.replace(old_code, new_code, 1), new_code


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server(command: list[str], port: int, log: Path, env: dict | None = None):
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not ready(port):
                if process.poll() is not None:
                    raise SystemExit(f"{command[:4]} exited with {process.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"{command[:4]} did not start in {START_TIMEOUT}s; see {log}")
                time.sleep(0.5)
            yield
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


def ready(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/v1/models")
        return connection.getresponse().status == 200
    except OSError:
        return False


def stream_chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: text, tokens, time to first token and wall time."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {response.read()[:300]!r}")
    pieces, first, usage, chunks = [], None, None, 0
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                pieces.append(piece)
                chunks += 1
    ended = time.perf_counter()
    connection.close()
    tokens = usage["completion_tokens"] if usage else chunks  # llama_cpp.server streams a token a chunk
    first = first or ended
    return {"text": "".join(pieces), "tokens": tokens, "ttft": first - started, "wall": ended - started,
            "tok_s": (tokens - 1) / (ended - first) if tokens > 1 and ended > first else 0.0,
            "prompt_tokens": usage.get("prompt_tokens") if usage else None,
            "speculation": (usage or {}).get("speculation")}  # fmt: skip


def replay(port: int, turns: list[list[dict]], max_tokens: int) -> list[dict]:
    stream_chat(port, [{"role": "user", "content": "Say OK."}], 2)  # warm-up, not timed
    return [stream_chat(port, messages, max_tokens) for messages in turns]


def specllm_session(port: int, edits: list[dict], file_text: str, max_tokens: int) -> tuple[list[list[dict]], list[dict]]:
    """Run the session on specllm, building each turn from the replies so far."""
    stream_chat(port, [{"role": "user", "content": "Say OK."}], 2)
    messages, turns, results = [{"role": "system", "content": SYSTEM}], [], []
    for edit in edits:
        messages = messages + [{"role": "user", "content": user_turn(edit, file_text)}]
        turns.append(messages)
        result = stream_chat(port, messages, max_tokens)
        results.append(result)
        messages = messages + [{"role": "assistant", "content": result["text"]}]
        file_text, _ = apply_reply(file_text, edit["code"], result["text"])
        print(f"  specllm turn {len(turns)}: {result['tokens']} tokens, {result['wall']:.1f}s", file=sys.stderr)
    return turns, results


def check_servers(llama_python: str) -> None:
    """Both servers can start: specllm's (its `server` extra) here, llama_cpp.server (its `server`
    extra) in `llama_python`. One line on stderr and exit 1 where one cannot."""
    checks = {
        "specllm serve (specllm's server extra: starlette, uvicorn)": [sys.executable, "-c", "import starlette, uvicorn"],
        f"llama_cpp.server in {llama_python} (llama-cpp-python[server]; --llama-python names another interpreter)":
            [llama_python, "-c", "import llama_cpp.server.app"],
    }  # fmt: skip
    for what, command in checks.items():
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except OSError as error:
            raise SystemExit(f"Error: cannot run {what}: {error.strerror or error}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1]
            raise SystemExit(f"Error: cannot start {what}: {last}")


def run_server(name: str, command: list[str], args, work):
    """Start a server on a free port, do `work(port)` (-> (turns, results)), stop it."""
    port = free_port()
    print(f"{name} ...", file=sys.stderr)
    with server(command + ["--port", str(port)], port, args.logs / f"agent_replay_{name.replace(' ', '_')}.log"):
        return work(port)


# -- the report ------------------------------------------------------------------------------------


def table(names: list[str], runs: dict[str, list[dict]]) -> str:
    head = "| turn | prompt tok | " + " | ".join(f"{n}: tokens, TTFT s, tok/s, wall s" for n in names) + " |"
    lines = [head, "|" + " --- |" * (2 + len(names))]
    first = runs[names[0]]
    for i in range(len(first)):
        cells = [f"{runs[n][i]['tokens']}, {runs[n][i]['ttft']:.2f}, {runs[n][i]['tok_s']:.1f}, {runs[n][i]['wall']:.2f}" for n in names]
        lines.append(f"| {i + 1} | {first[i]['prompt_tokens']} | " + " | ".join(cells) + " |")
    totals = []
    for n in names:
        tokens, wall = sum(r["tokens"] for r in runs[n]), sum(r["wall"] for r in runs[n])
        ttft = sum(r["ttft"] for r in runs[n])
        totals.append(f"{tokens}, {ttft:.2f}, {tokens / wall:.1f} (end to end), {wall:.2f}")
    lines.append("| all | | " + " | ".join(totals) + " |")
    base = sum(r["wall"] for r in runs[names[0]])
    ratios = ", ".join(f"{n} took {sum(r['wall'] for r in runs[n]) / base:.2f}x as long" for n in names[1:])
    return "\n".join(lines) + f"\n\ntotal wall time against {names[0]}'s: {ratios}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=Path(__file__).resolve().parents[2] / "shared/workloads/dev.jsonl")
    parser.add_argument("--file", default="base64.py", help="source file whose functions make the session")
    parser.add_argument("--turns", type=at_least(1), default=3)
    parser.add_argument("-n", "--max-tokens", type=at_least(1), default=128)
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="specllm preset or model name")
    parser.add_argument("--spec", default="auto")
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("--llama-python", default=sys.executable, help="interpreter with llama-cpp-python[server]")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="llama_cpp.server --draft_model_num_pred_tokens")
    parser.add_argument("--skip-lookup", action="store_true", help="only plain llama_cpp.server")
    parser.add_argument("--rounds", type=at_least(1), default=1, help="replay the session this many times per server")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"), help="folder for the servers' logs")
    args = parser.parse_args()

    from specllm.errors import SpecllmError
    from specllm.models.store import resolve_model

    try:
        groups = edits_by_file(args.workload)
    except OSError as error:
        raise SystemExit(f"Error: --workload {args.workload}: {error.strerror or error}") from None
    except (UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as error:
        raise SystemExit(f"Error: --workload {args.workload}: not a Spec-Bench JSONL workload ({error})") from None
    if args.file not in groups:
        raise SystemExit(f"Error: no code edits of {args.file} in {args.workload}; files: {', '.join(sorted(groups)) or 'none'}")
    edits = (groups[args.file] * args.turns)[: args.turns]
    file_text = "\n\n\n".join(e["code"] for e in groups[args.file])
    threads = args.threads or min(os.cpu_count() or 1, 8)
    try:
        model_path = resolve_model(args.model)
    except SpecllmError as error:
        raise SystemExit(f"Error: {error}") from None
    check_servers(args.llama_python)  # before minutes of specllm's session, not after
    spec_name = f"specllm {args.spec}"
    spec_command = [sys.executable, "-m", "specllm", "serve", "-m", args.model, "--spec", args.spec,
                    "-c", str(args.ctx_size), "-t", str(threads)]  # fmt: skip
    llama = [args.llama_python, "-m", "llama_cpp.server", "--model", str(model_path), "--n_ctx", str(args.ctx_size),
             "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_gpu_layers", "0"]  # fmt: skip
    commands = {spec_name: spec_command, "llama_cpp.server": llama}
    if not args.skip_lookup:
        commands["llama_cpp.server lookup"] = llama + ["--draft_model", "prompt-lookup-decoding",
                                                       "--draft_model_num_pred_tokens", str(args.lookup_tokens)]  # fmt: skip
    rounds = {name: [] for name in commands}  # name -> one list of per-turn results per round
    turns = None
    for round_ in range(args.rounds):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))  # drift hits every server alike
        if turns is None:  # the first round's specllm run writes the session
            order.remove(spec_name)
            session = lambda port: specllm_session(port, edits, file_text, args.max_tokens)  # noqa: E731
            rounds[spec_name].append(run_server(spec_name, spec_command, args, session))
            turns = rounds[spec_name][0][0]
        for name in order:
            again = lambda port: (turns, replay(port, turns, args.max_tokens))  # noqa: E731
            rounds[name].append(run_server(name, commands[name], args, again))
    rounds = {name: [results for _, results in rs] for name, rs in rounds.items()}
    runs = {name: min(rs, key=lambda results: sum(r["wall"] for r in results)) for name, rs in rounds.items()}
    for name, results in runs.items():
        for i, result in enumerate(results):
            result["prompt_tokens"] = result["prompt_tokens"] or runs[spec_name][i]["prompt_tokens"]

    names = list(runs)
    base_texts = [r["text"] for r in runs[names[0]]]
    same = {n: sum(a == r["text"] for a, r in zip(base_texts, runs[n])) for n in names[1:]}
    print(f"session: {len(edits)} turns on the functions of {args.file} ({', '.join(e['name'] for e in edits)}); "
          f"-n {args.max_tokens}, temperature 0, {threads} threads, model {model_path.name}")  # fmt: skip
    print(f"best of {args.rounds} round(s) per server (the round with the shortest total wall time); server order alternates")
    print(table(names, runs))
    for name, rs in rounds.items():
        totals = ", ".join(f"{sum(r['wall'] for r in results):.1f}" for results in rs)
        print(f"{name}: total wall s per round: {totals}")
    print("replies identical to specllm's: " + ", ".join(f"{n} {k}/{len(edits)}" for n, k in same.items()))
    if args.json:
        slim = {n: [[{k: v for k, v in r.items() if k != "text"} for r in results] for results in rs] for n, rs in rounds.items()}
        args.json.write_text(json.dumps({"file": args.file, "max_tokens": args.max_tokens, "runs": slim}, indent=1))


if __name__ == "__main__":
    main()
