"""The figures `bench` prints and writes, computed by hand on small cases: what each one counts."""

import math

import pytest

from specllm.bench.harness import Run, summarize
from specllm.bench.workloads import Prompt
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Done, PrefillDone, StepDone, TokenCommitted
from specllm.engine.stats import Stats

COSTS = CostModel({1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3})


def _auto_stats() -> Stats:
    """Three target passes: a plain one, one verifying a draft `auto` mixed (two n-gram tokens the
    draft model continued with two of its own, all four right) and one of the draft model alone (one of two right)."""
    stats = Stats()
    events = [
        PrefillDone(5, 0, 0.5),
        StepDone(None, 0, 0, 1, 0.0, 0.1, 0.1),
        StepDone("ngram", 4, 4, 5, 0.03, 0.2, 0.25, model_seconds=0.02, sources=("ngram", "ngram", "draft", "draft")),
        StepDone("draft", 2, 1, 2, 0.03, 0.15, 0.2, model_seconds=0.03),
    ]
    for event in events:
        stats.update(event)
    for token in range(8):
        stats.update(TokenCommitted(token, "x", "target"))
    stats.update(Done("length", list(range(8)), "x" * 8))
    return stats


def test_a_mixed_draft_is_one_drafted_pass_not_one_per_source():
    """Each source of a mixed draft counts a step of its own (its acceptance is its own), so passes
    less the sources' steps said 0 plain passes here, not 1, and the textbook speedup took the
    drafts for 2 tokens long instead of 3."""
    stats = _auto_stats()
    assert stats.to_dict()["undrafted_passes"] == 1
    assert stats.by_source["ngram"].steps == 1 and stats.by_source["draft"].steps == 2  # each source's own
    assert (stats.target_passes, stats.draft_steps, stats.undrafted_passes) == (3, 2, 1)

    prompt = Prompt("1", "qa", "hi")
    off = Stats(tokens=8, committed=8, target_passes=8, seconds=0.8)
    runs = [Run(prompt, "off", 0, [1, 2, 3], list(range(8)), off), Run(prompt, "auto", 0, [1, 2, 3], list(range(8)), stats)]
    row = next(r for r in summarize(runs, COSTS, greedy=False) if r["strategy"] == "auto")
    assert row["undrafted_passes"] == 1
    # α = 5/6 (accepted 4 + 1 of 6), γ = 6 drafted / 2 drafting passes = 3, c = (0.06 s / 6) / 0.1 s = 0.1,
    # v = a batch of γ + 1 = 4 against one = 0.2 / 0.1 = 2.0; the plain pass: one token for one pass
    alpha = 5 / 6
    drafted = (1 - alpha**4) / (1 - alpha)
    expected = (2 * drafted + 1) / (2 * (3 * 0.1 + 2.0) + 1)
    assert row["expected_speedup_independent"] == pytest.approx(round(expected, 3)) == 1.288
    # the measured acceptance by position (both drafts right at 1, one of two at 2, the 4-token one
    # at 3): 1 + 1 + 0.5 + 1 = 3.5 tokens a drafted pass, as committed (8 tokens in 3 passes)
    assert row["expected_speedup"] == pytest.approx(round((2 * 3.5 + 1) / (2 * (3 * 0.1 + 2.0) + 1), 3)) == 1.429


def test_the_expected_speedup_counts_the_passes_that_drafted_nothing():
    """`auto` declines most steps where little repeats: the textbook formula over its few drafted
    passes said 2.22x for a run of 98 plain passes and 2 sure 4-token drafts, which is about 1.05x."""
    prompt = Prompt("1", "qa", "hi")
    stats = Stats(tokens=110, committed=110, target_passes=100, seconds=10.0, drafted=8, accepted=8, draft_steps=2)
    stats.per_position = [[2, 2]] * 4  # both drafts right at every position, as the reducer counts them
    off = Stats(tokens=110, committed=110, target_passes=110, seconds=11.0)
    runs = [Run(prompt, "off", 0, [1, 2, 3], list(range(110)), off), Run(prompt, "auto", 0, [1, 2, 3], list(range(110)), stats)]
    row = next(r for r in summarize(runs, COSTS, greedy=False) if r["strategy"] == "auto")
    assert 5 / COSTS.relative(5) == pytest.approx(2.22, abs=0.01)  # a drafted pass: 5 tokens for a batch of 5
    assert row["expected_speedup"] == pytest.approx((2 * 5 + 98) / (2 * COSTS.relative(5) + 98), abs=1e-3)
    assert row["expected_speedup"] == pytest.approx(1.054, abs=1e-3)


def _pair(prompt: Prompt, repeat: int, off_seconds: float, seconds: float, tokens: int = 10) -> list[Run]:
    """off's run and ngram's of one prompt in one repeat, `tokens` tokens each, one pass a token."""
    runs = []
    for strategy, spent in (("off", off_seconds), ("ngram", seconds)):
        stats = Stats(tokens=tokens, committed=tokens, target_passes=tokens, seconds=spent)
        runs.append(Run(prompt, strategy, repeat, [1, 2, 3], [7] * tokens, stats))
    return runs


def test_prompts_are_counted_once_however_many_times_they_ran():
    """Two prompts run twice each said 4 prompts in the table and in the JSON (whose settings said 2)."""
    p1, p2 = Prompt("1", "qa", "a"), Prompt("2", "qa", "b")
    runs = [run for repeat in (0, 1) for prompt in (p1, p2) for run in _pair(prompt, repeat, 1.0, 0.5)]
    rows = summarize(runs, COSTS, greedy=True)
    assert [(r["strategy"], r["prompts"], r["runs"]) for r in rows] == [("off", 2, 4), ("ngram", 2, 4)]
    from specllm.cli.bench_cmd import _prompts

    assert _prompts(rows[1]) == "2x2"
    once = summarize([run for prompt in (p1, p2) for run in _pair(prompt, 0, 1.0, 0.5)], COSTS, greedy=True)
    assert (once[1]["prompts"], once[1]["runs"], _prompts(once[1])) == (2, 2, "2")
    cut = summarize(runs[:6], COSTS, greedy=True)  # a stop during the second repeat: p2 ran once
    assert (cut[1]["prompts"], cut[1]["runs"], _prompts(cut[1])) == (2, 3, "2 (3 runs)")


def test_the_interval_of_many_repeats_uses_students_t_not_the_normals():
    """32 repeats whose speedups alternate e^0.1 and e^-0.1: a t-interval on the logarithms with
    31 degrees of freedom (t = 2.0395); 1.96 was taken beyond 30, an interval 4% too narrow."""
    prompt = Prompt("1", "qa", "a")
    runs = [run for repeat in range(32) for run in _pair(prompt, repeat, 1.0, math.exp(-0.1 if repeat % 2 else 0.1))]
    row = next(r for r in summarize(runs, COSTS, greedy=True) if r["strategy"] == "ngram")
    sd = 0.1 * math.sqrt(32 / 31)  # sample standard deviation of ±0.1, 16 of each
    half = 2.0395 * sd / math.sqrt(32)
    assert row["speedup_interval"] == [round(math.exp(-half), 3), round(math.exp(half), 3)] == [0.964, 1.037]
    # and at 30 degrees of freedom still the table's 2.04
    runs = [run for repeat in range(31) for run in _pair(prompt, repeat, 1.0, math.exp(-0.1 if repeat % 2 else 0.1))]
    logs = [-0.1 if repeat % 2 == 0 else 0.1 for repeat in range(31)]  # speedup: off's seconds over ngram's
    mean = sum(logs) / 31
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 30)
    row = next(r for r in summarize(runs, COSTS, greedy=True) if r["strategy"] == "ngram")
    half = 2.04 * sd / math.sqrt(31)
    assert row["speedup_interval"] == [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def test_warm_keeps_the_decoders_and_a_kv_cache_only_where_no_other_strategy_ran_between(tmp_path, tiny_pair):
    """`--warm` promised to keep the KV cache between prompts; the strategies take turns on the same
    models, so a prompt reuses none of it unless its strategy also ran the prompt before (the
    rotation puts ngram last on prompt 1 and first on prompt 2), and the help says so."""
    import json
    import re

    from typer.testing import CliRunner

    from specllm.cli import app

    prompts = tmp_path / "p.jsonl"
    shared = "Repeat this line exactly, then stop: "
    prompts.write_text("".join(json.dumps({"question_id": n, "category": "qa", "turns": [shared + text]}) + "\n" for n, text in enumerate(["a b c", "d e f"], 1)))
    out = tmp_path / "bench.json"
    args = ["bench", "-m", str(tiny_pair[0]), "--prompts", str(prompts), "-n", "4", "-c", "256", "-t", "1", "--strategies", "ngram", "--warm", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(run["prompt"], run["strategy"], run["reused_tokens"] > 0) for run in runs] == [
        ("1", "off", False), ("1", "ngram", False), ("2", "ngram", True), ("2", "off", False),
    ]  # fmt: skip
    shown = " ".join(re.sub(r"[│\s]+", " ", CliRunner().invoke(app, ["bench", "--help"], terminal_width=300).output).split())
    assert "its KV cache only where no other strategy ran in between" in shown and "Keep KV" not in shown


def test_the_ngram_oracle_is_the_cheapest_schedule_not_each_steps_best_rate():
    """The oracle is the best any n-gram policy could do. Each step's best rate alone is not: where 2
    tokens cost 1.2 passes and 3 cost 2.0, two right tokens before the copy ends were drafted one
    (2 tokens for 1.2 passes, then a plain pass: 3 for 2.2) instead of both (3 for 2.0)."""
    from specllm.bench.harness import oracle_cost, oracle_speedup

    costs = CostModel({1: 0.1, 2: 0.12, 3: 0.2})
    prompt, generated = [1, 2, 3, 4, 1, 2], [3, 4, 8]  # [1, 2] again: the cache proposes [3, 4], both right, then 8 ends the copy
    assert oracle_cost(prompt, generated, costs, (2, 2), max_draft=2) == pytest.approx(0.2)
    off = Run(Prompt("1", "qa", "x"), "off", 0, prompt, generated, Stats(tokens=3, committed=3, target_passes=3, seconds=0.3))
    assert oracle_speedup([off], costs, (2, 2)) == pytest.approx(0.3 / 0.2)
    rows = summarize([off], costs, greedy=True)
    assert rows[0]["oracle_speedup"] == 1.5 and rows[0]["share_of_oracle"] == round(1 / 1.5, 3)


def test_the_prompt_rate_counts_the_tokens_the_prefill_read():
    """A `--warm` run that found 20 of its 34 prompt tokens in the KV cache read 13 (the last one is
    the first generation pass's): 13 / 0.13 s = 100 tok/s, not 34 / 0.13 s = 262."""
    prompt = Prompt("1", "qa", "x")
    runs = []
    for strategy, reused in (("off", 0), ("ngram", 20)):
        stats = Stats(prompt_tokens=34, reused_tokens=reused, prefill_seconds=0.33 if not reused else 0.13, tokens=4, committed=4, target_passes=4, seconds=0.4)
        runs.append(Run(prompt, strategy, 0, list(range(34)), [1, 2, 3, 4], stats))
    rows = {r["strategy"]: r for r in summarize(runs, COSTS, greedy=False)}
    assert rows["ngram"]["prefill_tok_per_s"] == 100.0
    assert rows["off"]["prefill_tok_per_s"] == 100.0  # 33 / 0.33 s


def test_the_table_in_a_file_or_pipe_shows_every_figure_whole():
    """Out of a terminal the table was squeezed into 160 columns and rich cut cells: an interval from
    two repeats (t = 12.71) read "0.02-86.…"."""
    import io

    from rich.console import Console

    from specllm.cli.bench_cmd import _table, _widen

    prompt = Prompt("question-with-a-long-id", "summarization", "x")
    runs = [run for repeat, ratio in ((0, 0.78), (1, 1.6)) for run in _pair(prompt, repeat, 1.0, 1.0 / ratio)]
    rows = summarize(runs, COSTS, greedy=True)
    low, high = rows[1]["speedup_interval"]
    out = Console(highlight=False, width=160, file=io.StringIO(), record=True)  # as `bench` prints to a pipe
    out.print(_widen(out, _table(rows)))
    shown = out.export_text()
    assert f"{low:.2f}-{high:.2f}" in shown and "…" not in shown
    assert "time ngram/model/verify" in shown and "same as off" in shown
