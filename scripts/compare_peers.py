"""specllm's strategies beside llama.cpp's own speculative modes, per category, each as a ratio to
that tool's own plain decoding of the same prompts.

    ../shared/peers/llamacpp-modes.sh PROMPTS.jsonl QID,QID,... 128 > peers.txt
    specllm bench --prompts PROMPTS.jsonl --strategies ngram,draft,ngram+draft,auto --json bench.json
    python scripts/compare_peers.py peers.txt bench.json

The peers' lines read `QID CATEGORY plain=TOK/S MODE=TOK/S(acc A%) ...`. A prompt counts with the
tokens specllm's `off` generated for it (both tools decode the same greedy text, up to near ties),
so a category's ratio is its plain decoding time over its time, as `bench`'s speedups are; "best
peer" is the best of llama.cpp's modes for that category, chosen in hindsight.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from collections import Counter, defaultdict

LINE = re.compile(r"^(\d+) (\S+) plain=([\d.]+)")
MODE = re.compile(r" ([\w,-]+)=([\d.]*)\(acc ([\d.]+|-)%\)")


def parse_peers(text: str) -> dict[str, tuple[str, dict[str, float], set[str]]]:
    """Prompt id -> (category, tok/s by mode with "plain", the modes that drafted nothing (`acc -`));
    modes that printed no speed are left out."""
    peers = {}
    for line in text.splitlines():
        found = LINE.match(line)
        if found:
            modes = MODE.findall(line)
            speeds = {"plain": float(found[3]), **{mode: float(tps) for mode, tps, _ in modes if tps}}
            peers[found[1]] = (found[2], speeds, {mode for mode, tps, acc in modes if tps and acc == "-"})
    return peers


def specllm_speeds(report: dict) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """From a `bench --json` report: prompt id -> tok/s by strategy (over its repeats), and the
    tokens `off` generated for each prompt (the weights)."""
    tokens, seconds, runs = defaultdict(float), defaultdict(float), Counter()
    for run in report["runs"]:
        key = run["prompt"], run["strategy"]
        tokens[key] += run["tokens"]
        seconds[key] += run["seconds"]
        runs[key] += 1
    speeds: dict[str, dict[str, float]] = defaultdict(dict)
    for (prompt, strategy), n in tokens.items():
        if seconds[prompt, strategy]:
            speeds[prompt][strategy] = n / seconds[prompt, strategy]
    weights = {prompt: round(n / runs[prompt, strategy]) for (prompt, strategy), n in tokens.items() if strategy == "off"}
    return speeds, weights


def category_ratios(speeds: dict[str, dict[str, float]], categories: dict[str, str], weights: dict[str, int], plain: str) -> dict[str, dict[str, float]]:
    """Category ("all" too) -> mode -> plain time over the mode's time, on the prompts where both ran."""
    times: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for prompt, by_mode in speeds.items():
        # a prompt `off` answered with no token weighs nothing (and has no speed to divide by)
        if by_mode.get(plain, 0) <= 0 or not weights.get(prompt) or prompt not in categories:
            continue
        for mode, tps in by_mode.items():
            if tps <= 0:  # no token in its time: no speed to compare
                continue
            for category in (categories[prompt], "all"):
                total = times[category, mode]
                total[0] += weights[prompt] / by_mode[plain]
                total[1] += weights[prompt] / tps
    ratios: dict[str, dict[str, float]] = defaultdict(dict)
    for (category, mode), (plain_seconds, mode_seconds) in times.items():
        ratios[category][mode] = plain_seconds / mode_seconds
    return ratios


def mean_speed(speeds: dict[str, dict[str, float]], weights: dict[str, int], prompts, mode: str) -> float:
    """Tokens per second of one mode over these prompts, each counted with its weight in tokens."""
    timed = [p for p in prompts if speeds.get(p, {}).get(mode, 0) > 0 and weights[p]]
    return sum(weights[p] for p in timed) / sum(weights[p] / speeds[p][mode] for p in timed) if timed else float("nan")


def read_inputs(peers_path: str, bench_path: str):
    """The peers' lines and the bench report's speeds; one line on stderr and exit 1 where either is not one."""
    try:
        peers = parse_peers(Path(peers_path).read_text("utf-8"))
        report = json.loads(Path(bench_path).read_text("utf-8"))
    except OSError as error:
        raise SystemExit(f"Error: {error.filename}: {error.strerror or error}") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise SystemExit(f"Error: {bench_path}: not a `specllm bench --json` report ({error})") from None
    if not peers:
        raise SystemExit(f"Error: {peers_path}: no line of llamacpp-modes.sh's (QID CATEGORY plain=TOK/S MODE=TOK/S(acc A%) ...)")
    try:
        ours, weights = specllm_speeds(report)
    except (AttributeError, KeyError, TypeError):
        raise SystemExit(f"Error: {bench_path}: not a `specllm bench --json` report (its runs)") from None
    if not weights:
        raise SystemExit(f"Error: {bench_path}: no run of the off strategy: specllm's ratios are to it (add off to --strategies)")
    return peers, ours, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("peers", help="llamacpp-modes.sh's output")
    parser.add_argument("bench", help="a `specllm bench --json` report on the same prompts")
    args = parser.parse_args()
    peers, ours, weights = read_inputs(args.peers, args.bench)
    categories = {prompt: category for prompt, (category, _, _) in peers.items()}
    theirs = {prompt: speeds for prompt, (_, speeds, _) in peers.items()}
    their_ratios = category_ratios(theirs, categories, weights, "plain")
    our_ratios = category_ratios(ours, categories, weights, "off")
    peer_modes = sorted({mode for ratios in their_ratios.values() for mode in ratios} - {"plain"})
    strategies = sorted({mode for ratios in our_ratios.values() for mode in ratios} - {"off"})
    prompts = weights.keys() & categories.keys()
    count = Counter(categories[prompt] for prompt in prompts)
    count["all"] = len(prompts)

    columns = [f"llama.cpp {mode}" for mode in peer_modes] + [f"specllm {strategy}" for strategy in strategies]
    print("| category | prompts | " + " | ".join(columns) + " | auto / best peer |")
    print("|" + "---|" * (len(columns) + 3))
    for category in sorted(their_ratios, key=lambda name: (name != "all", name)):
        peer_row = [their_ratios[category].get(mode) for mode in peer_modes]
        our_row = [our_ratios.get(category, {}).get(strategy) for strategy in strategies]
        best, auto = max(filter(None, peer_row), default=None), our_ratios.get(category, {}).get("auto")
        cells = [f"{ratio:.2f}x" if ratio else "-" for ratio in peer_row + our_row]
        lead = f"{auto / best:.2f}" if auto and best else "-"
        print(f"| {category} | {count[category]} | " + " | ".join(cells) + f" | {lead} |")
    print(f"plain decoding over these prompts: llama.cpp {mean_speed(theirs, weights, prompts, 'plain'):.2f} tok/s, "
          f"specllm {mean_speed(ours, weights, prompts, 'off'):.2f} tok/s")
    # A peer run that drafted nothing did plain decoding's work in another process: its ratio is noise.
    idle = sorted(speeds[mode] / speeds["plain"] for _, speeds, modes in peers.values() for mode in modes if speeds["plain"] > 0)
    if idle:
        print(f"llama.cpp runs that drafted nothing: {len(idle)}, against plain {sum(idle) / len(idle):.2f}x on average, "
              f"{idle[0]:.2f}-{idle[-1]:.2f}x (the noise of one run per process)")


if __name__ == "__main__":
    main()
