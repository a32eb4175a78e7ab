"""The benchmark harness on a fake engine, its arithmetic, and a short run of the command on a tiny model."""

import io
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from specllm.bench.harness import (
    BenchSettings,
    Run,
    expected_speedup,
    oracle_cost,
    oracle_speedup,
    parting_points,
    plain_cost,
    run_bench,
    summarize,
    undrafted_pass_ratio,
)
from specllm.bench.oracle import copy_lengths, ngram_proposals, told_ngram_cost
from specllm.bench.workloads import Prompt, load_prompts
from specllm.errors import SpecllmError
from specllm.cli import app
from specllm.engine.costmodel import LEARNING_RATE, CostModel, measure_costs
from specllm.engine.sampling import SamplingParams
from specllm.engine.stats import SourceStats, Stats
from tests.bench_helpers import FakeEngine, fake_matplotlib
from tests.cli_helpers import assert_one_error, specllm_here

COSTS = CostModel({1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3})
PROMPTS = [Prompt(str(i), cat, text) for i, (cat, text) in enumerate([("a", "abcabcab"), ("a", "hello"), ("b", "xyzxyz")])]


def test_strategies_interleave_with_rotating_order_and_fresh_state():
    engine = FakeEngine()
    settings = BenchSettings(["off", "ngram"], max_tokens=6, params=SamplingParams(temperature=0))
    runs = list(run_bench(engine, PROMPTS, settings))
    assert [(r.prompt.id, r.strategy) for r in runs] == [
        ("0", "off"), ("0", "ngram"), ("1", "ngram"), ("1", "off"), ("2", "off"), ("2", "ngram"),
    ]  # fmt: skip
    # warm-up decoders first, then a fresh decoder (KV and n-gram state reset) for every run
    assert engine.created[2:] == [r.strategy for r in runs]
    off = {r.prompt.id: r.tokens for r in runs if r.strategy == "off"}
    assert all(r.tokens == off[r.prompt.id] for r in runs)


def test_warm_runs_reuse_decoders():
    engine = FakeEngine()
    settings = BenchSettings(["off", "ngram"], max_tokens=4, params=SamplingParams(temperature=0), warm=True)
    list(run_bench(engine, PROMPTS, settings))
    assert engine.created[2:] == ["off", "ngram"]


def _run(prompt, strategy, tokens, seconds, drafted=0, accepted=0, passes=None, draft_seconds=0.0, prompt_tokens=None, model_seconds=0.0):
    stats = Stats(tokens=len(tokens), committed=len(tokens), seconds=seconds, target_passes=passes or len(tokens), drafted=drafted, accepted=accepted, draft_seconds=draft_seconds)
    stats.model_seconds = model_seconds
    if drafted:
        stats.by_source["ngram"] = SourceStats(steps=passes, drafted=drafted, accepted=accepted)
        stats.draft_steps = passes
    return Run(prompt, strategy, 0, prompt_tokens or [1, 2, 3], tokens, stats)


def test_parted_texts_are_near_ties_without_exact_kernels_and_a_bug_with_them():
    from specllm.cli.bench_cmd import _parting_line

    p0, p1 = PROMPTS[0], PROMPTS[2]
    same = [_run(p0, "off", [1] * 4, 1.0), _run(p0, "ngram", [1] * 4, 0.5), _run(p1, "off", [2] * 4, 1.0), _run(p1, "ngram", [2] * 4, 0.5)]
    for greedy in (True, False):  # above temperature 0 a seeded text the draft model had no part in is off's too
        assert _parting_line(same, exact=True, greedy=greedy) == "exact kernels: all 2 texts equal off's, token for token"
        assert _parting_line(same, exact=False, greedy=greedy) is None  # nothing to say
        parted = same[:3] + [_run(p1, "ngram", [2, 3, 2, 2], 0.5)]
        assert "yet 1 of 2 texts part from off's: a bug" in _parting_line(parted, exact=True, greedy=greedy)
        line = _parting_line(parted, exact=False, greedy=greedy)
        assert line.startswith("1 of 2 texts part from off's: ") and "--exact rules that out" in line
    # a draft model's tokens are verified by rejection sampling: above temperature 0 its run's text is its own
    modelled = same[:3] + [_run(p1, "auto", [2, 3, 2, 2], 0.5, model_seconds=0.1)]
    assert "yet 1 of 2 texts part" in _parting_line(modelled, exact=True, greedy=True)
    assert _parting_line(modelled, exact=True, greedy=False) == "exact kernels: all 1 texts equal off's, token for token"


def test_sampled_texts_are_compared_with_offs_where_the_draft_model_had_no_part():
    """Above temperature 0 every strategy samples with off's seed: a text only n-gram drafts touched
    is off's (they are verified by off's own draws), one the draft model drafted into need not be."""
    p0, p1 = PROMPTS[0], PROMPTS[2]
    runs = [
        _run(p0, "off", [1] * 4, 1.0),
        _run(p0, "auto", [1] * 4, 0.5, drafted=3, accepted=3, passes=2),
        _run(p1, "off", [2] * 4, 1.0),
        _run(p1, "auto", [2, 3, 2, 2], 0.5, model_seconds=0.2),
    ]
    rows = {(r["category"], r["strategy"]): r for r in summarize(runs, COSTS, greedy=False)}
    assert rows[("a", "auto")]["identical_prompts"] == "1/1" and rows[("a", "auto")]["identical_to_off"] is True
    assert rows[("b", "auto")]["identical_prompts"] is None and rows[("b", "auto")]["identical_to_off"] is None
    assert rows[("all", "auto")]["identical_prompts"] == "1/1"
    assert parting_points(runs, greedy=False) == {} and parting_points(runs, greedy=True) == {id(runs[3]): 1}


def test_summary_arithmetic():
    p0, p1 = PROMPTS[0], PROMPTS[2]
    runs = [
        _run(p0, "off", [1] * 10, 2.0),
        _run(p0, "ngram", [1] * 10, 1.0, drafted=8, accepted=6, passes=4),
        _run(p1, "off", [2] * 10, 2.0),
        _run(p1, "ngram", [2, 2, 2, 2, 2, 2, 2, 2, 2, 3], 4.0, drafted=4, accepted=1, passes=9),
    ]
    rows = {(r["category"], r["strategy"]): r for r in summarize(runs, COSTS, greedy=True)}
    a = rows[("a", "ngram")]
    assert a["tok_per_s"] == 10.0 and a["speedup"] == 2.0
    assert a["acceptance_rate"] == 0.75 and a["mean_accepted_length"] == 2.5
    assert a["identical_to_off"] is True
    assert rows[("b", "ngram")]["identical_to_off"] is False
    assert parting_points(runs, greedy=True) == {id(runs[3]): 9}  # where b's ngram run parted from off
    assert rows[("b", "ngram")]["speedup"] == 0.5
    everything = rows[("all", "ngram")]
    assert everything["tokens"] == 20 and everything["speedup"] == pytest.approx(20 / 5 / (20 / 4), abs=1e-3)
    assert rows[("a", "off")]["speedup"] == 1.0
    assert rows[("a", "off")]["speedup_range"] is None  # off against itself says nothing
    assert rows[("a", "ngram")]["speedup_range"] is None  # one pair: no spread to show
    assert everything["speedup_range"] == [0.5, 2.0]  # runs at 2x and 0.5x pool to 0.8x: the range shows it


def test_the_oracle_is_priced_by_the_curve_the_run_learned_and_by_the_calibration_beside_it():
    """A run's own passes showed the batches dearer than calibration said: the oracle drafting them
    is priced by what they cost in the run, and the calibration's figure stays in the row."""
    p0 = PROMPTS[0]
    text = [1, 2, 3, 4, 5, 6] * 5  # repeats itself: the oracle drafts it
    runs = [_run(p0, "off", text, 3.0, prompt_tokens=[1, 2, 3, 4, 5, 6]), _run(p0, "auto", text, 1.5, drafted=20, accepted=20, passes=10)]
    learned = CostModel({k: v * (1.3 if k > 1 else 1.0) for k, v in COSTS.batch_seconds.items()})
    row = next(r for r in summarize(runs, learned, greedy=True, calibrated=COSTS) if r["strategy"] == "auto")
    assert row["oracle_speedup"] == round(oracle_speedup(runs[:1], learned), 3)
    assert row["oracle_speedup_calibrated"] == round(oracle_speedup(runs[:1], COSTS), 3)
    assert 1.0 < row["oracle_speedup"] < row["oracle_speedup_calibrated"]
    assert row["share_of_oracle"] == round(row["speedup"] / oracle_speedup(runs[:1], learned), 3)
    assert "oracle_speedup_calibrated" not in summarize(runs, COSTS, greedy=True)[0]  # one curve: nothing beside it


def test_auto_decoders_of_one_engine_share_what_they_learn_of_the_costs(tiny_pair):
    """Every pass a generation times refines the curve the next generation decides by (a bench's
    runs, a chat's turns, a server's requests); the calibrated curve, the one cached, stays as measured."""
    from specllm.backend import LoadOptions
    from specllm.session import Engine, ModelPaths, SpecConfig

    options = LoadOptions(n_ctx=512, n_threads=1)
    engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig("auto"), options, options, cost_cache=None)
    calibrated = CostModel({k: 1.0 + 0.1 * k for k in range(1, 9)})  # a second a pass: the tiny model takes milliseconds
    engine.costs = lambda max_batch=None: calibrated
    tokens = engine.encode("Repeat exactly: def add(a, b): return a + b")
    first = engine.decoder("auto")
    assert first.drafter.policy.costs is engine.learned_costs()
    list(first.generate(tokens, 12, SamplingParams(temperature=0.0), np.random.default_rng(0)))
    learned = engine.learned_costs()
    moved = min(learned.batch_seconds[k] / calibrated.batch_seconds[k] for k in calibrated.batch_seconds)
    assert moved < 0.95  # taught by its passes: each moves its size (one token's: every size) a tenth of the way to milliseconds
    assert calibrated.batch_seconds == {k: 1.0 + 0.1 * k for k in range(1, 9)}
    second = engine.decoder("auto")
    assert second.drafter.policy.costs is learned and second.drafter.policy.cost(1) == learned.verify(1)
    engine.close()


def test_runs_that_drafted_nothing_measure_the_timing_noise_against_off():
    p0, p1, p2 = PROMPTS
    runs = [
        _run(p0, "off", [1] * 10, 1.0),
        _run(p0, "auto", [1] * 10, 1.1),  # plain passes only, 10% slower: drift
        _run(p1, "off", [2] * 8, 0.8),
        _run(p1, "auto", [2] * 8, 0.72),  # 10% faster
        _run(p2, "off", [3] * 10, 1.0),
        _run(p2, "auto", [3] * 10, 0.5, drafted=8, accepted=6, passes=4),  # drafted: not plain work
    ]
    waited = _run(p2, "draft", [3] * 10, 1.6)
    waited.stats.model_seconds = 0.6  # consulted the draft model and drafted nothing: not plain work either
    noise = undrafted_pass_ratio(runs + [waited])
    assert noise["runs"] == 2 and noise["range"] == [0.9, 1.1]
    assert noise["mean"] == pytest.approx(1.0) and noise["standard_error"] == pytest.approx(0.1)
    assert undrafted_pass_ratio(runs[:2] + runs[4:]) is None  # one pair shows no spread


def test_speedup_interval_comes_from_the_spread_between_repeats():
    """Each repeat is a replicate of the category's figure: steady repeats give a narrow interval
    around the speedup, scattered ones a wide interval, one repeat none at all."""
    p0, p1 = PROMPTS[0], PROMPTS[1]

    def repeat(n, *speedups):
        runs = []
        for prompt, speedup in zip((p0, p1), speedups):
            runs += [_run(prompt, "off", [1] * 10, 2.0), _run(prompt, "ngram", [1] * 10, 2.0 / speedup)]
        for run in runs:
            run.repeat = n
        return runs

    def interval(runs):
        rows = {(r["category"], r["strategy"]): r for r in summarize(runs, COSTS, greedy=True)}
        return rows[("a", "ngram")]["speedup_interval"]

    assert interval(repeat(0, 0.9, 1.1)) is None
    steady = interval(repeat(0, 0.95, 0.95) + repeat(1, 0.96, 0.96) + repeat(2, 0.94, 0.94) + repeat(3, 0.95, 0.95))
    assert 0.92 < steady[0] < 0.95 < steady[1] < 0.98  # a 5% loss, told apart from 1.0
    scattered = interval(repeat(0, 0.85, 0.85) + repeat(1, 1.05, 1.05) + repeat(2, 0.95, 0.95))
    assert scattered[0] < 0.85 and scattered[1] > 1.05  # three scattered repeats prove nothing
    incomplete = repeat(0, 1.0, 1.0) + repeat(1, 1.0, 1.0)[:2]  # the second repeat lacks prompt p1
    assert interval(incomplete) is None


def test_expected_speedup_formula():
    # α = 0: one token per pass, cost v + γc
    assert expected_speedup(0.0, 4, 0.0, 2.0) == pytest.approx(0.5)
    # α = 1: every drafted token plus the bonus
    assert expected_speedup(1.0, 4, 0.1, 2.0) == pytest.approx(5 / 2.4)
    alpha, gamma, c, v = 0.8, 5, 0.05, 2.1
    assert expected_speedup(alpha, gamma, c, v) == pytest.approx((1 - alpha**6) / ((1 - alpha) * (gamma * c + v)))


def test_oracle_drafts_only_the_correct_prefix_that_pays():
    prompt = [5, 6, 7, 8, 9, 5, 6]
    # the n-gram "5 6" proposes 7 8 9 5 6 ...; the text continues 7 8 then diverges
    generated = [7, 8, 1, 2]
    spent = oracle_cost(prompt, generated, COSTS, (2, 2), max_draft=7)
    # step 1: correct prefix 7 8 -> best k by (k+1)/cost(k+1): 1/0.1, 2/0.15, 3/0.175 -> k=2, which
    # commits 7 8 and the target's 1; step 2: one token left, nothing to draft -> one plain pass
    assert spent == pytest.approx(COSTS.verify(3) + COSTS.verify(1))
    # with a curve where batches cost k times one token, drafting never pays even when correct
    linear = CostModel({1: 0.1, 8: 0.8})
    assert oracle_cost(prompt, generated, linear, (2, 2), max_draft=7) == pytest.approx(4 * 0.1)


def test_the_told_policy_drafts_by_its_category_copy_lengths_and_pays_for_what_it_gets_wrong():
    """An n-gram policy told how far proposals run (by kind and span) drafts the length of most
    expected tokens a second, and like any policy pays a wrong tail's rows: priced by hand."""
    prompt = [5, 6, 7, 8, 9, 5, 6]
    # "5 6" proposes 7 8 9 5 6 (a unique match of the prompt, agreeing span 2); the text goes 7 8 1 2
    generated = [7, 8, 1, 2]
    proposals = ngram_proposals(prompt, generated, (2, 2), max_draft=7)
    assert proposals[0][0].tokens == [7, 8, 9] and proposals[0][1] == 2  # drafts are cut to what the text leaves room for
    lengths = copy_lengths([proposals], [len(prompt)], max_draft=7)
    assert lengths[("unique", 2)] == ([1.0, 1.0, 1.0] + [0.0] * 5, 1)  # one proposal, its first two right
    # told that its first two are right: 3 tokens for verify(3) beats verify(1) and verify(4), then 1 2 by plain passes
    # (the proposals after 1 and 2 find no match)
    assert told_ngram_cost(prompt, proposals, lengths, COSTS) == pytest.approx(COSTS.verify(3) + COSTS.verify(1))
    # told that a proposal's three tokens are right as often as not: it drafts all three and pays a wrong row
    even = {("unique", 2): ([1.0, 0.5, 0.5, 0.5] + [0.0] * 4, 2)}
    flat = CostModel({1: 0.1, 8: 0.1 + 7 * 0.001})
    assert told_ngram_cost(prompt, proposals, even, flat) == pytest.approx(flat.verify(4) + flat.verify(1))


def test_a_deeper_context_costs_more_per_batch_token():
    costs = CostModel({1: 0.03, 32: 0.45}, depth=256, context_seconds=6e-6)
    assert costs.verify(32) == costs.verify(32, 256) == 0.45
    assert costs.verify(32, 1280) == pytest.approx(0.45 + 6e-6 * 32 * 1024)
    assert costs.verify(1, 1280) == pytest.approx(0.03 + 6e-6 * 1024)
    assert costs.verify(32, 0) == pytest.approx(0.45 - 6e-6 * 32 * 256)
    assert CostModel.from_dict(costs.to_dict()) == costs


def test_step_timings_are_read_back_at_the_calibration_depth():
    """A step deeper than the calibration that took what the context predicts teaches nothing; one
    slower than that does, while it lies within the context the growth was timed to."""
    costs = CostModel({1: 0.03, 32: 0.45}, depth=256, context_seconds=6e-6)
    assert costs.reach == 1024
    costs.observe_verify(32, costs.verify(32, 1000), context=1000)
    assert costs.batch_seconds[32] == pytest.approx(0.45)
    costs.observe_verify(32, costs.verify(32, 1000) + 0.1, context=1000)
    assert costs.batch_seconds[32] == pytest.approx(0.45 + LEARNING_RATE * 0.1)


def test_passes_beyond_the_timed_context_teach_its_growth_not_the_sizes():
    """Beyond the context the growth was timed to, it is extrapolated, and real passes there cost
    more than a straight line says (a 2-core Xeon at 3,000 cached tokens: 1.4-1.9 times the growth
    per token). Those passes must price deep passes, and leave the sizes as they are at the
    calibration depth: read back into a size, the misfit made a batch of 32 look 30% dearer at
    every short context after one bench of long prompts, where `auto` then drafted too short."""
    measured = CostModel({1: 0.07, 16: 0.28, 32: 0.46}, depth=256, context_seconds=3.5e-6)
    deeper = measured.copy()
    deeper.deep_growth = 1.7  # how the machine really grows beyond 1024 cached tokens
    costs = measured.copy()
    for context in range(2000, 3400, 20):  # a long prompt's answer, drafted in batches of 16 and 32
        k = 32 if context % 40 else 16
        costs.observe_verify(k, deeper.verify(k, context), context=context)
    assert costs.batch_seconds == measured.batch_seconds  # the sizes at the calibration depth: untouched
    assert costs.deep_growth == pytest.approx(1.7, rel=0.02)
    for k in (1, 16, 32):
        assert costs.verify(k, 3000) == pytest.approx(deeper.verify(k, 3000), rel=0.01)
        assert costs.verify(k, 800) == pytest.approx(measured.verify(k, 800))  # short contexts priced as measured
    assert CostModel.from_dict(costs.to_dict()) == costs  # kept with the learned curve
    # just past the timed context the extrapolated part is too small to tell from a pass's noise
    costs.observe_verify(32, 2 * costs.verify(32, 1030), context=1030)
    assert costs.deep_growth == pytest.approx(1.7, rel=0.02) and costs.batch_seconds == measured.batch_seconds
    # and bench says what was learned
    from specllm.cli.bench_cmd import _learned_line

    assert "beyond 1024 cached tokens each adds 1.70x the growth timed before it" in _learned_line(measured, costs)
    assert "no size moved" in _learned_line(measured, measured.copy())


def test_one_token_running_slower_than_measured_slows_every_cost_alike():
    """Other work slowing the machine by 20% slows every pass: a batch must not look cheaper beside
    one token (which would make drafts that cannot pay look worth it), nor the draft model."""
    measured = CostModel({1: 0.03, 2: 0.05, 16: 0.25, 32: 0.45}, draft_seconds=0.015, depth=256, context_seconds=6e-6, draft_token_seconds=0.003)
    costs = measured.copy()
    for _ in range(60):
        costs.observe_verify(1, 1.2 * measured.verify(1, 512), context=512)
    assert costs.verify(1, 512) == pytest.approx(1.2 * measured.verify(1, 512), rel=1e-3)
    for k in (2, 8, 16, 32):
        assert costs.verify(k, 512) / costs.verify(1, 512) == pytest.approx(measured.verify(k, 512) / measured.verify(1, 512))
    assert costs.draft_seconds == pytest.approx(1.2 * measured.draft_seconds, rel=1e-3)
    assert costs.catch_up(100) == pytest.approx(1.2 * measured.catch_up(100), rel=1e-3)
    # a batch that then runs slower still than that teaches its own size, at the speed learned
    costs.observe_verify(16, costs.verify(16, 512) + 0.05, context=512)
    assert costs.verify(16, 512) == pytest.approx(1.2 * measured.verify(16, 512) + LEARNING_RATE * 0.05, rel=1e-3)


def test_a_stalled_pass_moves_its_size_a_little_and_a_real_change_is_still_learned():
    """A pass the machine stalled for a second (30 single passes' time) counts as at most twice what
    was expected: one moved a batch of 4 by 10%, not 290%, and auto, which stops drafting to a size
    that looks dear, would never have timed it again. A size that really costs three times as much
    is learned all the same, in steps; one token's stall rescales the curve by 10% at most."""
    measured = CostModel({1: 0.07, 2: 0.1, 4: 0.12, 8: 0.22}, draft_seconds=0.04, depth=256, draft_token_seconds=0.005)
    costs = measured.copy()
    costs.observe_verify(4, 30 * 0.07)
    assert costs.batch_seconds[4] == pytest.approx(0.12 * (1 + LEARNING_RATE))
    for _ in range(20):
        costs.observe_verify(4, 0.12)
    assert costs.batch_seconds[4] == pytest.approx(0.12, rel=0.02)
    for _ in range(40):
        costs.observe_verify(8, 3 * 0.22)
    assert costs.batch_seconds[8] == pytest.approx(3 * 0.22, rel=0.02)
    costs.observe_verify(1, 30 * 0.07)
    assert costs.verify(1) == pytest.approx(0.07 * (1 + LEARNING_RATE))
    assert costs.speed() == 1.0  # one stalled pass is not the machine's speed: the median of three is
    costs.observe_draft(2.0)
    costs.observe_catch_up(11, 0.04 + 10 * 1.0)
    assert costs.draft_seconds == pytest.approx(measured.draft_seconds * (1 + LEARNING_RATE) ** 2, rel=1e-6)
    assert costs.draft_token_seconds == pytest.approx(measured.draft_token_seconds * (1 + LEARNING_RATE) ** 2, rel=1e-6)


def test_other_work_that_slows_every_pass_alike_leaves_the_curves_shape_as_it_was():
    """Other work starts and slows every pass by half until the run ends: one token's passes rescale
    the curve over a dozen passes, and a batch timed meanwhile is read at the speed they show, so no
    size comes out much dearer beside one token: 3.6% here, where read as it came a batch of 16
    looked 17% dearer (the first batches after the change are read before one token shows it)."""
    measured = CostModel({1: 0.07, 2: 0.1, 16: 0.27, 32: 0.45}, draft_seconds=0.04, depth=256)
    costs = measured.copy()
    for step in range(40):  # plain steps and drafts of 15 in turn, the last 16 steps slowed
        slow = 1.5 if step >= 24 else 1.0
        costs.observe_verify(1 if step % 2 else 16, slow * measured.verify(1 if step % 2 else 16))
    assert costs.relative(16) == pytest.approx(measured.relative(16), rel=0.05)
    assert costs.speed() == pytest.approx(1.5 / costs.verify(1) * measured.verify(1), rel=0.05)


@pytest.mark.parametrize("sizes", [range(1, 33), (1, 2, 4, 8, 16, 32)])
def test_a_learning_curve_prices_every_size_as_its_measurements_say(sizes):
    """`verify` reads a table of every size, kept up to date as passes refine the curve (rebuilt at
    every step it cost a pass on a GPU a percent): at every step it equals the table built afresh
    from the measurements, interpolated sizes included."""
    rng = np.random.default_rng(4)
    costs = CostModel({k: 0.03 * k**0.6 for k in sizes}, depth=256, context_seconds=6e-6)
    for _ in range(300):
        k = int(rng.integers(1, 33))
        costs.observe_verify(k, costs.verify(k, 400) * rng.uniform(0.8, 1.25), context=400)
        fresh = CostModel(dict(costs.batch_seconds), depth=256, context_seconds=6e-6)
        assert [costs.verify(j) for j in range(1, 33)] == pytest.approx([fresh.verify(j) for j in range(1, 33)], rel=1e-12)


def test_plain_and_oracle_costs_grow_with_the_context():
    prompt, generated = [5, 6, 7, 8, 9, 5, 6], [7, 8, 1, 2]
    deep = CostModel(dict(COSTS.batch_seconds), depth=0, context_seconds=1e-3)
    assert plain_cost(prompt, generated, deep) == pytest.approx(sum(0.1 + 1e-3 * (6 + i) for i in range(4)))
    # the oracle's two passes (3 tokens after 6 cached, then 1 after 9) pay for their depth
    expected = COSTS.verify(3) + 3e-3 * 6 + COSTS.verify(1) + 1e-3 * 9
    assert oracle_cost(prompt, generated, deep, (2, 2), max_draft=7) == pytest.approx(expected)


def test_builtin_workloads_cover_the_three_kinds():
    prompts = load_prompts()
    assert {"code_edit", "summarization"} <= {p.category for p in prompts}
    assert len(load_prompts(limit=1, categories=["code_edit"])) == 1


BAD_ROWS = {
    "a string for turns": ('{"question_id": 1, "category": "qa", "turns": "just a string"}', "'turns' must be a list of non-empty strings"),
    "a null turn": ('{"question_id": 1, "turns": [null]}', "'turns' must be a list of non-empty strings"),
    "an empty turn": ('{"question_id": 1, "turns": [""]}', "'turns' must be a list of non-empty strings"),
    "no turns": ('{"question_id": 1, "turns": []}', "'turns' must be a list of non-empty strings"),
    "turns missing": ('{"question_id": 1}', "'turns' must be a list of non-empty strings"),
    "an array": ('[1, 2]', "a Spec-Bench row is a JSON object"),
    "a question_id taken already": ('{"question_id": 0, "turns": ["again"]}', "question_id 0 is taken already (line 1, by its question_id)"),
    "not JSON": ('{"question_id": 1,', "not JSON (Expecting property name enclosed in double quotes at character 19)"),
    "a null category": ('{"question_id": 1, "category": null, "turns": ["hi"]}', "'category' must be a non-empty string, got null"),
    "a list for category": ('{"question_id": 1, "category": ["qa"], "turns": ["hi"]}', "'category' must be a non-empty string, got [\"qa\"]"),
    "an empty category": ('{"question_id": 1, "category": " ", "turns": ["hi"]}', "'category' must be a non-empty string, got \" \""),
    "a null question_id": ('{"question_id": null, "turns": ["hi"]}', "'question_id' must be an integer or a non-empty string, got null"),
    "a true question_id": ('{"question_id": true, "turns": ["hi"]}', "'question_id' must be an integer or a non-empty string, got true"),
    "the category all": ('{"question_id": 1, "category": "all", "turns": ["hi"]}', "the category 'all' names the rows over every category"),
    "an object for question_id": ('{"question_id": {"n": 1}, "turns": ["hi"]}', "'question_id' must be an integer or a non-empty string, got {\"n\": 1}"),
}


@pytest.mark.parametrize("name", BAD_ROWS)
def test_a_malformed_prompt_row_is_one_clear_error_naming_its_line(tmp_path, name):
    row, message = BAD_ROWS[name]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question_id": 0, "category": "qa", "turns": ["fine"]}\n\n' + row + "\n")
    with pytest.raises(SpecllmError) as error:
        load_prompts(path)
    assert str(error.value).startswith(f"{path}:3: {message}")


def test_a_row_without_a_question_id_is_known_by_its_line_number_and_a_clash_says_so(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"category": "qa", "turns": ["Say hi."]}\n{"question_id": 1, "turns": ["again"]}\n')
    with pytest.raises(SpecllmError) as error:
        load_prompts(path)
    assert str(error.value) == f"{path}:2: question_id 1 is taken already (line 1, by its line number: it has no question_id)"


def test_a_prompts_file_saved_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question_id": 7, "category": "qa", "turns": ["What is 2 + 2?"]}\n', encoding="utf-8-sig")
    assert load_prompts(path) == [Prompt("7", "qa", "What is 2 + 2?")]


def test_calibration_on_a_real_backend_is_sane_and_leaves_caches_empty(tiny_pair):
    from specllm.backend import LlamaBackend, LoadOptions

    # One thread for tiny models: llama.cpp's threads meet at a barrier every step, and on a busy
    # 2-core machine two of them made this calibration take 2 s instead of 0.1 s.
    target = LlamaBackend(tiny_pair[0], LoadOptions(n_ctx=256, n_threads=1))
    costs = measure_costs(target, target, max_batch=8, repeats=1)
    assert target.n_past == 0
    assert sorted(costs.batch_seconds) == list(range(1, 9))  # every size: none interpolated
    for k, seconds in costs.batch_seconds.items():
        assert costs.verify(1) <= seconds <= k * costs.verify(1)
    assert costs.draft_seconds > 0
    assert costs.depth == 256 - 8 and costs.context_seconds == 0.0  # no room to time a deeper context
    target.close()


def test_calibration_times_the_deeper_context_from_a_snapshot_of_a_real_cache(tiny_pair):
    from specllm.backend import LlamaBackend, LoadOptions
    from specllm.engine.costmodel import CONTEXT_ROUNDS, DEEPER

    target = LlamaBackend(tiny_pair[0], LoadOptions(n_ctx=2048, n_threads=1))
    restored = []
    restore = target.restore

    def counted_restore(snapshot):
        restore(snapshot)
        restored.append(target.n_past)

    target.restore = counted_restore
    costs = measure_costs(target, None, max_batch=8, repeats=1)
    assert restored == [DEEPER * costs.depth] * CONTEXT_ROUNDS  # each pair starts from the deeper cache
    assert costs.context_seconds >= 0.0 and target.n_past == 0
    target.close()


def test_calibration_fits_a_context_smaller_than_its_depth_and_batches(tiny_pair):
    from specllm.backend import LlamaBackend, LoadOptions

    target = LlamaBackend(tiny_pair[0], LoadOptions(n_ctx=16, n_threads=1))
    costs = measure_costs(target, None, max_batch=32, repeats=1)
    assert max(costs.batch_seconds) <= target.n_ctx and target.n_past == 0
    target.close()


def test_engine_measures_costs_once_and_caches_them(tmp_path, tiny_pair, monkeypatch):
    from specllm.backend import LoadOptions
    from specllm.engine import costmodel
    from specllm.session import Engine, ModelPaths, SpecConfig

    # Judged steady whatever else shares the cores (a busy curve is not cached: test_calibration.py);
    # beside another test worker the tiny target's timings once spread past BUSY_SPREAD.
    monkeypatch.setattr(costmodel, "BUSY_SPREAD", float("inf"))

    options = LoadOptions(n_ctx=256, n_threads=1)
    cache = tmp_path / "costs.json"
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options, cost_cache=cache)
    assert not engine.costs_known()
    measured = engine.costs()
    assert engine.costs_known() and cache.is_file()
    engine.close()
    again = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options, cost_cache=cache)
    assert again.costs_known()
    assert again.costs().batch_seconds == measured.batch_seconds  # loaded, not measured again
    again.close()


def test_bench_cli_short_run_writes_the_json_schema(tmp_path, tiny_pair):
    """On the tiny target (no real model is needed for the report's shape; a real model's greedy
    output equalling plain decoding is tests/test_lossless_real.py's claim)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "code_edit", "turns": ["Repeat exactly: def add(a, b): return a + b"]}) + "\n"
        + json.dumps({"question_id": 2, "category": "qa", "turns": ["What is 2 + 2?"]}) + "\n"
    )  # fmt: skip
    out = tmp_path / "bench.json"
    args = ["bench", "-m", str(tiny_pair[0]), "--prompts", str(prompts), "-n", "12", "--strategies", "ngram,auto", "--json", str(out), "-c", "1024", "--repeats", "2", "-t", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"machine", "models", "settings", "verify_cost", "results"} <= set(report)
    assert report["partial"] is False
    assert [p["batch"] for p in report["verify_cost"]][:3] == [1, 2, 3]
    keys = {"strategy", "category", "prompts", "tokens", "seconds", "tok_per_s", "speedup", "acceptance_rate", "mean_accepted_length", "identical_to_off", "oracle_speedup"}
    assert all(keys <= set(row) for row in report["results"])
    assert {(r["strategy"], r["category"]) for r in report["results"]} >= {("off", "qa"), ("ngram", "code_edit"), ("auto", "all")}
    # auto ran: the oracle is priced by the curve its passes refined, the calibration's figure beside it
    assert report["costs_learned"] != report["costs"] and all("oracle_speedup_calibrated" in r for r in report["results"])
    this_run = report["costs_learned"]["passes"] - report["costs_learned_earlier_passes"]
    assert this_run > 0 and f"cost curve refined by {this_run} passes of this run's auto" in result.output
    assert all(r["identical_to_off"] for r in report["results"])
    interval = next(r["speedup_interval"] for r in report["results"] if (r["strategy"], r["category"]) == ("auto", "all"))
    assert len(interval) == 2 and 0 < interval[0] <= interval[1]
    assert all("parts_from_off_at" in run for run in report["runs"])
    plain_only = [r for r in report["runs"] if r["strategy"] != "off" and not r["drafted"]]
    noise = report["undrafted_pass_ratio"]
    if len(plain_only) >= 2:  # random weights: whether a run drafts nothing depends on the text
        assert noise["runs"] == len(plain_only) and noise["mean"] > 0
        assert "timing noise: in the" in result.output
    else:
        assert noise is None


def test_rows_keep_one_strategy_order_in_every_category():
    """Strategies take turns going first from prompt to prompt; the table lists off first, then the
    others as the run first took them, in every category."""
    p0, p1 = PROMPTS[0], PROMPTS[2]
    runs = [_run(p0, "off", [1] * 4, 1.0), _run(p0, "ngram", [1] * 4, 1.0), _run(p0, "auto", [1] * 4, 1.0),
            _run(p1, "auto", [2] * 4, 1.0), _run(p1, "off", [2] * 4, 1.0), _run(p1, "ngram", [2] * 4, 1.0)]  # fmt: skip
    rows = summarize(runs, COSTS, greedy=True)
    for category in ("a", "b", "all"):
        assert [r["strategy"] for r in rows if r["category"] == category] == ["off", "ngram", "auto"]


def test_a_strategys_runs_add_up_every_count():
    """A row sums its runs: every count and time, the prompt tokens reused from the KV cache (a
    `--warm` bench's) included, and the drafts by source and position."""
    def run(reused, drafted, accepted):
        stats = Stats(prompt_tokens=100, reused_tokens=reused, prefill_seconds=0.5, tokens=10, committed=11,
                      target_passes=4, drafted=drafted, accepted=accepted, seconds=1.0, finish_reason="length")  # fmt: skip
        stats.by_source["ngram"] = SourceStats(steps=2, drafted=drafted, accepted=accepted, lengths={drafted // 2: 2})
        stats.per_position = [[2, 2], [2, 1]][: drafted // 2]
        return stats

    total = Stats().merge(run(30, 4, 3)).merge(run(0, 2, 1))
    assert (total.prompt_tokens, total.reused_tokens, total.tokens, total.committed, total.target_passes) == (200, 30, 20, 22, 8)
    assert (total.drafted, total.accepted, total.seconds, total.prefill_seconds) == (6, 4, 2.0, 1.0)
    assert total.by_source["ngram"] == SourceStats(steps=4, drafted=6, accepted=4, lengths={2: 2, 1: 2})
    assert total.per_position == [[4, 4], [2, 1]] and total.finish_reason is None


def _tiny_bench(tmp_path, *rows):
    """A prompts file of `rows` (turn texts, categories qa) and the start of a short bench on it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": n, "category": "qa", "turns": [text]}) + "\n" for n, text in enumerate(rows, 1)))
    return prompts, ["bench", "--prompts", str(prompts), "-n", "4", "-c", "256", "-t", "1"]


def test_bench_with_a_random_seed_draws_one_and_records_it(home, tmp_path, tiny_pair):
    """`--seed -1` is a random seed, as in `run`; it reached numpy as -1 and failed as a bug."""
    _, args = _tiny_bench(tmp_path, "Say hi.")
    out = tmp_path / "bench.json"
    done = specllm_here(home, *args, "-m", tiny_pair[0], "--strategies", "ngram", "--seed", "-1", "--json", out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["settings"]["seed"] >= 0


def test_a_prompt_the_context_cannot_hold_is_refused_by_its_question_id_before_measuring(home, tmp_path, tiny_pair):
    """Not at its turn, with the runs before it lost and no word of which prompt it was."""
    prompts, args = _tiny_bench(tmp_path, "Say hi.", "word " * 400)
    done = specllm_here(home, *args, "-m", tiny_pair[0], "--strategies", "ngram")
    assert_one_error(done, 1, f"{prompts}: question_id 2 (qa) has ", " tokens but the context holds 256; raise --ctx-size")


def test_draft_strategies_alone_without_a_draft_model_are_a_usage_error(home, tmp_path, tiny_pair):
    """Dropping them left `off` alone: a bench of plain decoding against itself, exit 0."""
    _, args = _tiny_bench(tmp_path, "Say hi.")
    done = specllm_here(home, *args, "-m", tiny_pair[0], "--strategies", "draft,ngram+draft")
    assert_one_error(done, 2, "--strategies draft,ngram+draft needs a draft model: pass --draft PATH")


@pytest.mark.parametrize(
    "json_name, plot_name, message",
    [(None, "bench.json", "--plot {dir}/bench.json: matplotlib writes no .json files (it writes png, svg); name a .png file"),
     ("p.jsonl", None, "--json {dir}/p.jsonl: is the --prompts file; writing there would replace the prompts"),
     ("out.png", "out.png", "--json and --plot name the same file, {dir}/out.png: the chart would overwrite the report")],
    ids=["an unknown chart format", "the prompts file", "one file for both"],
)  # fmt: skip
def test_bench_output_files_are_checked_before_the_model_loads(home, tmp_path, monkeypatch, json_name, plot_name, message):
    """An unknown suffix failed in matplotlib after the whole run, as a bug; the other two overwrote a file."""
    fake_matplotlib(monkeypatch)
    prompts, args = _tiny_bench(tmp_path, "Say hi.")
    outputs = [arg for flag, name in (("--json", json_name), ("--plot", plot_name)) if name for arg in (flag, tmp_path / name)]
    done = specllm_here(home, *args, "-m", tmp_path / "absent.gguf", *outputs)
    assert_one_error(done, 2, message.format(dir=tmp_path))
    assert json.loads(prompts.read_text())["turns"] == ["Say hi."]


def test_a_chart_named_without_a_suffix_is_a_png_at_that_very_path(home, tmp_path, monkeypatch, tiny_pair):
    """matplotlib adds .png to a name without a suffix: the file asked for never appeared."""
    fake_matplotlib(monkeypatch)
    _, args = _tiny_bench(tmp_path, "Say hi.")
    done = specllm_here(home, *args, "-m", tiny_pair[0], "--strategies", "ngram", "--plot", tmp_path / "chart")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "chart").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "chart.png").exists()


def test_acceptance_is_no_figure_where_nothing_was_drafted():
    """A strategy that drafted nothing accepted nothing and rejected nothing: '-', not 0%."""
    from rich.console import Console

    from specllm.cli.bench_cmd import _table

    p = PROMPTS[0]
    runs = [_run(p, "off", [1] * 4, 1.0), _run(p, "ngram", [1] * 4, 1.0), _run(p, "auto", [1] * 4, 0.5, drafted=4, accepted=1, passes=3)]
    console = Console(record=True, width=300, file=io.StringIO())
    console.print(_table(summarize(runs, COSTS, greedy=True)))
    accept = {line.split("│")[2].strip(): line.split("│")[9].strip() for line in console.export_text().splitlines() if line.startswith("│ a")}
    assert accept == {"off": "-", "ngram": "-", "auto": "25%"}
