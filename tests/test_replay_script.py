"""scripts/replay_policy.py: scoring auto against recorded greedy text on a virtual clock."""

import json
import time

import numpy as np
import pytest

from specllm.engine import auto, decode, drafters
from specllm.engine.costmodel import CostModel
from tests.replay_data import CHECKED_CURVES, CPU_CURVES, CURVES, DATA, SEVEN_B
from tests.script_loader import load_script


def _load():
    return load_script("replay_policy")


def _streams(prompt, generated, category):
    return {"eog": 999, "max_tokens": len(generated), "streams": [
        {"id": "1", "category": category, "prompt": prompt, "tokens": generated, "stopped": False}]}


def test_a_copy_is_drafted_and_costs_less_than_plain_decoding():
    replay = _load()
    source = [(i * 7) % 97 + 3 for i in range(120)]  # no repeated bigrams: every match is unique
    data = _streams(source, source[:100], "copy")  # the answer repeats the prompt
    flat = CostModel({k: 0.010 + 0.0002 * k for k in (1, 2, 4, 8, 16, 32)})
    figures = replay.simulate(data, flat, draft_max=31)["copy"]
    assert figures["prompts"] == 1 and figures["auto"] < figures["plain"] / 2  # the replay also checks the text equals the recording
    assert figures["ngram_oracle"] <= figures["auto"] and figures["oracle"] <= figures["ngram_oracle"] + 1e-12
    assert decode.time is time and auto.time is time and drafters.time is time  # the virtual clock is put back


def test_a_copy_ends_with_the_token_the_target_ended_with():
    """A recording keeps the end-of-generation token the target chose: a copy of the prompt's turn,
    its end token included, is then drafted up to that token and no further (what follows it in the
    prompt, the next turn's header, can never be committed), and costs less than where the recording
    does not say which token ended it (its copy of the end counts as wrong, the draft runs on)."""
    replay = _load()
    end = 500
    answer = [(i * 7) % 97 + 3 for i in range(60)]
    prompt = answer + [end] + [(i * 11) % 89 + 200 for i in range(40)]  # the turn, its end, what follows
    curve = CostModel({k: 0.01 + 0.002 * k for k in (1, 2, 4, 8, 16, 32)})  # a drafted token costs a fifth of a pass
    told = _streams(prompt, answer, "copy")
    told["streams"][0].update(stopped=True, end=end)
    told["max_tokens"] = 128  # room to draft past the end
    untold = json.loads(json.dumps(told))
    del untold["streams"][0]["end"]  # the recording's generic end token (999) then ends the text
    with_end = replay.simulate(told, curve, draft_max=31)["copy"]
    without = replay.simulate(untold, curve, draft_max=31)["copy"]
    assert with_end["plain"] == without["plain"] and with_end["auto"] < without["auto"]


def test_text_full_of_chance_matches_on_a_steep_curve_costs_what_plain_decoding_costs():
    """Random tokens from 8 symbols: n-gram matches everywhere, continuations by chance. On a CPU-like
    curve no draft pays, and the policy must not lose more than 1% finding that out."""
    replay = _load()
    rng = np.random.default_rng(0)
    prompt, generated = [int(t) for t in rng.integers(3, 11, 60)], [int(t) for t in rng.integers(3, 11, 120)]
    steep = CostModel({1: 0.03, 2: 0.057, 4: 0.1, 8: 0.22, 16: 0.28, 32: 0.45})
    figures = replay.simulate(_streams(prompt, generated, "chance"), steep, draft_max=31)["chance"]
    assert figures["auto"] <= 1.01 * figures["plain"]
    assert figures["oracle"] < figures["plain"]  # some chance matches were right: a policy that knew could have gained


def test_the_fixed_threshold_baseline_pays_every_draft_step_and_reads_what_it_must():
    """The draft model alone, drafting while its confidence is at least a threshold: priced by hand."""
    replay = _load()
    costs = CostModel({1: 1.0, 2: 1.0, 4: 1.0}, draft_seconds=0.1, draft_token_seconds=0.01)
    stream = {"prompt": [1, 2, 3], "tokens": [5, 6, 7, 8], "draft": {
        "argmax": [5, 6, 9, 8], "confidence": [0.9] * 4, "off_path": {"4": [[4, 0.1]]}}}
    reading = 0.1 + 0.01  # the prompt but its last token, read before the first step
    # 0.5: three steps drafting 5 6 9 (9 wrong, its continuation cut by the end), one pass of 4 commits
    # 5 6 7; then the last token alone
    assert replay.threshold_cost(stream, costs, 0.5, 8) == pytest.approx(reading + 3 * 0.1 + 1.0 + 1.0)
    # 0.95: every step pays a draft step that shows a lower confidence and drafts nothing
    assert replay.threshold_cost(stream, costs, 0.95, 8) == pytest.approx(reading + 3 * (0.1 + 1.0) + 1.0)
    # a fully accepted draft: the draft model then reads its last drafted token with the target's next one
    whole = {"prompt": [1, 2, 3], "tokens": [5, 6], "draft": {"argmax": [5, 6], "confidence": [0.9] * 2, "off_path": {}}}
    assert replay.threshold_cost(whole, costs, 0.5, 8) == pytest.approx(reading + 0.1 + 1.0 + 0.01)


def test_the_targets_top_probability_is_recorded_and_replayed_on_each_generated_token():
    """`record` keeps the target's top probability on every token after the prompt (one batched pass
    over the text); the replayed target's rows carry it, so `auto` reads what it would read live."""
    from tests.fakes import FakeBackend

    replay = _load()
    target, sequence = FakeBackend(seed=3), [1, 4, 2, 7, 5, 5, 0, 3, 6]
    recorded = replay.record_target(target, sequence, prompt_length=4)
    truth = [drafters.max_softmax(target.logits_after(sequence[:i])) for i in range(4, len(sequence))]
    assert recorded == pytest.approx(truth, abs=1e-4) and target.n_past == 0
    rows = replay.ReplayBackend(sequence, 0, 8, CostModel({1: 0.01, 2: 0.02}), replay.Clock(), 4, recorded).evaluate(sequence[:4], [3])
    assert drafters.max_softmax(rows[0]) == pytest.approx(recorded[0], abs=1e-4) and int(rows[0].argmax()) == sequence[4]

def test_a_bench_report_replays_on_the_cost_model_its_run_used(tmp_path):
    """`--costs` takes a `bench --json` report: its whole cost model, the draft model's step and reading
    rate included, as the run's passes refined it where `auto` ran (an older report without it: as
    calibrated; older still: the draft step from its relative cost)."""
    replay = _load()
    costs = CostModel({1: 0.04, 2: 0.066, 4: 0.12}, draft_seconds=0.027, depth=256, context_seconds=2e-6, draft_token_seconds=0.009)
    report = {"verify_cost": costs.curve(), "verify_cost_depth": 256, "draft_cost_relative": 0.675, "costs": costs.to_dict()}
    (tmp_path / "new.json").write_text(json.dumps(report))
    assert replay.load_curve(str(tmp_path / "new.json"), 32) == costs
    learned = CostModel({1: 0.04, 2: 0.07, 4: 0.13}, draft_seconds=0.027, depth=256, context_seconds=2e-6, draft_token_seconds=0.009)
    (tmp_path / "learned.json").write_text(json.dumps(report | {"costs_learned": learned.to_dict()}))
    assert replay.load_curve(str(tmp_path / "learned.json"), 32) == learned
    del report["costs"]
    (tmp_path / "old.json").write_text(json.dumps(report))
    old = replay.load_curve(str(tmp_path / "old.json"), 32)
    assert old.draft_seconds == pytest.approx(0.027) and old.batch_seconds == costs.batch_seconds and old.draft_token_seconds == 0


def test_a_costs_cache_replays_on_its_newest_curve_with_a_draft_model(tmp_path):
    """`costs.json` keeps one curve per calibration method, newest last: a user replaying their own
    cache gets the curve `auto` uses now, not the first one ever measured, as its passes refined it."""
    replay = _load()
    oldest, newest, alone = (CostModel({1: t, 2: 2 * t}, draft_seconds=d) for t, d in ((0.05, 0.02), (0.04, 0.03), (0.03, 0.0)))
    (tmp_path / "costs.json").write_text(json.dumps({"a": oldest.to_dict(), "b": newest.to_dict(), "c (target alone)": alone.to_dict()}))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == newest
    learned = CostModel({1: 0.04, 2: 0.09}, draft_seconds=0.03, passes=40)
    (tmp_path / "costs.json").write_text(json.dumps({"a": oldest.to_dict(), "b": newest.to_dict() | {"learned": learned.to_dict()}}))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == learned


def test_a_costs_cache_replays_on_the_default_kernels_curve_not_an_exact_one(tmp_path):
    """An `--exact` run keeps a curve of its own (its kernels verify at most a few tokens); measured
    after the default one, it is the newest, but replaying on it would price every longer draft by
    extrapolation. A cache holding only exact curves still replays on its newest."""
    replay = _load()
    default, exact = CostModel({1: 0.06, 2: 0.09, 32: 0.7}, draft_seconds=0.03), CostModel({1: 0.07, 2: 0.1, 3: 0.14}, draft_seconds=0.03)
    cache = {"model|max=32|method|cpu": default.to_dict(), "model|max=3|method|cpu|exact kernels": exact.to_dict()}
    (tmp_path / "costs.json").write_text(json.dumps(cache))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == default
    (tmp_path / "costs.json").write_text(json.dumps({"model|max=3|method|cpu|exact kernels": exact.to_dict()}))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == exact


def test_a_costs_cache_replays_on_llama_cpps_flash_attention_default_not_a_setting_asked_for(tmp_path):
    """`--flash-attn off` keeps a curve of its own (on a 2-core EPYC a batch of 16 after 3,072 cached
    tokens 546 ms against 810): measured after the default one it is the newest, but a replay of the
    cache prices what `auto` does by default. A cache holding only such a curve replays on it."""
    replay = _load()
    default, off = CostModel({1: 0.06, 2: 0.09, 32: 0.7}, draft_seconds=0.03), CostModel({1: 0.06, 2: 0.08, 32: 0.5}, draft_seconds=0.03)
    cache = {"model|max=32|method|cpu": default.to_dict(), "model|max=32|method|cpu|flash attention off": off.to_dict()}
    (tmp_path / "costs.json").write_text(json.dumps(cache))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == default
    exact = CostModel({1: 0.07, 2: 0.1, 3: 0.14}, draft_seconds=0.03)
    (tmp_path / "costs.json").write_text(json.dumps({"model|max=3|method|cpu|exact kernels": exact.to_dict(), "model|max=32|method|cpu|flash attention off": off.to_dict()}))
    assert replay.load_curve(str(tmp_path / "costs.json"), 32) == off


PRIOR_CURVES = CURVES[:-1]  # where the draft model's prior alone decides whether it is consulted


class _Replays(dict):
    """Each curve's replay, made when a test first asks for it: xdist's workers share no fixture,
    and a worker that runs one curve's tests replays only that curve (1-2 s each)."""

    def __init__(self, recording: str = "dev-streams.json"):
        super().__init__()
        self.replay, self.data = _load(), json.loads((DATA / recording).read_text())

    def __missing__(self, curve: str) -> dict:
        costs = self.replay.load_curve(str(DATA / curve), 32)
        self[curve] = self.replay.simulate(self.data, costs, draft_max=max(costs.batch_seconds) - 1)  # --exact's: 7 at most
        return self[curve]


@pytest.fixture(scope="module")
def replayed() -> _Replays:
    return _Replays()


@pytest.fixture(scope="module")
def checked() -> _Replays:
    return _Replays("check-streams.json")


@pytest.mark.parametrize("curve", CHECKED_CURVES)
def test_on_prompts_apart_from_the_workload_the_promise_holds(checked, curve):
    """The check set (52 prompts of the workload's kinds that are not in it; no constant was tuned on
    them): on the CPU curves every category at least 0.97x plain, and code edits at least 80% of the
    n-gram oracle (83-88% on these curves). Not on the Xeon's curve without extra buffer types, where its
    four questions come to 0.969x: two answers of 15-16 tokens each lost a 2-token bet on a two-token
    match at their start (the README's check-set table; the same loss as the GPU curves' extraction)."""
    figures = checked[curve]
    assert not _below_the_promise(figures), _below_the_promise(figures)
    assert figures["code_edit"]["ngram_oracle"] / figures["code_edit"]["auto"] >= 0.80


@pytest.fixture(scope="module")
def long_prompts() -> _Replays:
    return _Replays("long-streams.json")


@pytest.mark.parametrize("curve", CURVES)
def test_on_prompts_of_thousands_of_tokens_the_promise_holds(long_prompts, curve):
    """Four prompts of 2,000-3,400 tokens (`long-prompts.jsonl`: two whole modules of CPython's
    standard library to edit, two sections of the language reference to summarise and to answer
    from; -n 256), where every pass pays for the deep context: every category at least 0.97x plain,
    and the two modules, re-typed, at least 1.3x."""
    figures = long_prompts[curve]
    assert not _below_the_promise(figures), _below_the_promise(figures)
    assert figures["code_edit"]["plain"] / figures["code_edit"]["auto"] >= 1.3


@pytest.fixture(scope="module")
def whole_module() -> _Replays:
    return _Replays("whole-module-streams.json")


@pytest.mark.parametrize("curve", CURVES)
def test_a_whole_module_re_typed_to_its_end_keeps_near_the_oracle(whole_module, curve):
    """The first long prompt's module answered in full (2,301 tokens after 2,885: passes at 2.9-5.2k
    cached tokens, where verifying a long draft costs most): at least 1.3x plain and 85% of the n-gram
    oracle on every curve (1.32-2.98x and 87-98% on the CPU curves, 12.1x on the flat one)."""
    figures = whole_module[curve]["code_edit"]
    assert figures["plain"] / figures["auto"] >= 1.3
    assert figures["ngram_oracle"] / figures["auto"] >= 0.85


@pytest.fixture(scope="module")
def long_answers() -> _Replays:
    return _Replays("long-answers-streams.json")


@pytest.mark.parametrize("curve", CURVES)
def test_on_long_documents_recorded_after_the_constants_were_set_the_promise_holds(long_answers, curve):
    """Four more prompts of 1,500-3,300 tokens (`long-answers-prompts.jsonl`: two sections of the
    language reference to summarise, two to answer a question from; -n 256), recorded after every
    constant in `specllm.engine.priors` was set: every category at least 0.97x plain."""
    figures = long_answers[curve]
    assert not _below_the_promise(figures), _below_the_promise(figures)


@pytest.fixture(scope="module")
def held_out() -> _Replays:
    return _Replays("held-streams.json")


@pytest.mark.parametrize("curve", CURVES)
def test_on_a_third_set_recorded_after_the_constants_were_set_the_promise_holds(held_out, curve):
    """26 more prompts (`held-prompts.jsonl`: 18 Spec-Bench rows in neither the workload nor the check
    set, 3 of each large category and one coding, extraction and writing question; 8 code edits of
    other standard-library functions with the workload's four instructions), recorded after every
    constant in `specllm.engine.priors` was set: every category at least 0.97x plain (0.989x at the
    lowest), and on the CPU curves code edits at least 80% of the n-gram oracle (83-97%)."""
    figures = held_out[curve]
    assert not _below_the_promise(figures), _below_the_promise(figures)
    if curve in CPU_CURVES:
        assert figures["code_edit"]["ngram_oracle"] / figures["code_edit"]["auto"] >= 0.80


@pytest.mark.parametrize("curve", CURVES)
def test_auto_is_never_slower_than_plain_decoding_in_any_category(replayed, curve):
    """The promise, on the virtual clock (no timing noise): every category at least 0.97x plain."""
    below = _below_the_promise(replayed[curve])
    assert not below, below


def _below_the_promise(figures: dict) -> dict:
    """The categories under 0.97x plain, with their speedups."""
    return {c: round(f["plain"] / f["auto"], 3) for c, f in figures.items() if f["plain"] / f["auto"] < 0.97}


@pytest.mark.parametrize("curve", PRIOR_CURVES)
def test_a_draft_model_never_makes_auto_slower_than_the_ngram_cache_alone(replayed, curve):
    """In no category: where copies carry the text (retrieval, extraction) and answers are short, the
    draft model's reading of a long prompt must wait until the generation shows it can pay it back."""
    slower = {c: round(f["ngram_only"] / f["auto"], 3) for c, f in replayed[curve].items() if f["auto"] > 1.01 * f["ngram_only"]}
    assert not slower, slower


def test_the_draft_model_is_used_where_it_pays_and_left_alone_where_it_cannot(replayed):
    """On the CPUs the draft model costs 0.4-0.7 of a target pass: auto equals the n-gram cache alone.
    On the flat curve it drafts free-form text the n-gram cache cannot, well beyond plain decoding."""
    for curve in CPU_CURVES:
        assert replayed[curve]["all"]["auto"] == pytest.approx(replayed[curve]["all"]["ngram_only"])
    flat = replayed["flat-gpu-synthetic.json"]
    for category in ("math_reasoning", "qa", "translation"):
        assert flat[category]["plain"] / flat[category]["auto"] > 1.15
        assert flat[category]["auto"] < flat[category]["ngram_only"]



def test_where_only_a_sure_target_brings_the_draft_model_in_it_pays(replayed, checked, held_out):
    """On the 7B-shaped curve the draft model is consulted where the target is sure of its first tokens:
    on all three recordings auto is faster than the n-gram cache alone, coding and math_reasoning by
    at least 4% (5-34%). It is a bet on what the draft model has not shown yet: a short answer that
    ends just after the draft model read its prompt loses it (the workload's 20-token translation,
    2.2% of its category), so no category may lose more than 3%. The draft model alone at its best
    threshold in hindsight still beats auto on these two categories (1.13-1.51x against 1.05-1.34x):
    auto waits for 20 of the target's tokens, and a few of its rejections end the draft model."""
    for figures in (replayed[SEVEN_B], checked[SEVEN_B], held_out[SEVEN_B]):
        assert figures["all"]["auto"] < figures["all"]["ngram_only"]
        for category in ("coding", "math_reasoning"):
            assert figures[category]["ngram_only"] / figures[category]["auto"] >= 1.04, category
        slower = {c: round(f["ngram_only"] / f["auto"], 3) for c, f in figures.items() if f["auto"] > 1.03 * f["ngram_only"]}
        assert not slower, slower

@pytest.mark.parametrize("curve", PRIOR_CURVES)
def test_auto_beats_the_draft_model_alone_at_its_best_fixed_threshold(replayed, curve):
    """auto is faster than the draft model drafting at every step while its confidence clears a
    threshold, the threshold chosen per category in hindsight: on the flat curve (that baseline 1.09-1.93x
    plain on free-form text) in every category; on the CPUs, where it mostly loses to plain decoding,
    in every category of several prompts (a threshold picked for one prompt fits that prompt: on the
    AVX2 curve it reaches 1.10x on the single coding prompt, where auto leaves the draft model out: 1.05x)."""
    several = {c: f for c, f in replayed[curve].items() if f["prompts"] > 1 or curve == "flat-gpu-synthetic.json"}
    behind = {c: (round(f["plain"] / f["auto"], 3), round(f["plain"] / f["threshold"], 3)) for c, f in several.items() if f["auto"] > f["threshold"]}
    assert not behind, behind


@pytest.mark.parametrize("curve", CURVES)
def test_copies_reach_most_of_the_two_source_oracle(replayed, curve):
    """Code edits re-type the code they were given: auto reaches at least 78% of the best schedule of
    both sources on every curve (the figures per curve are in the issue's notes)."""
    figures = replayed[curve]["code_edit"]
    assert figures["oracle"] / figures["auto"] >= 0.78


@pytest.mark.parametrize("curve", CURVES)
def test_auto_reaches_what_an_ngram_policy_told_each_category_copy_lengths_reaches(replayed, curve):
    """The told policy knows, in hindsight, how far the category's proposals of each kind and span run
    (it does not know where any one copy ends): no clairvoyant schedule is beaten by it, and auto,
    which learns those lengths as it goes, reaches at least 92% of it on the copying categories
    (code edits 97-104%, summaries 95-104% on these curves)."""
    for category, figures in replayed[curve].items():
        assert figures["oracle"] <= figures["told"] * (1 + 1e-9), category
    for category in ("code_edit", "summarization"):
        figures = replayed[curve][category]
        assert figures["told"] / figures["auto"] >= 0.92, (category, round(figures["plain"] / figures["auto"], 3), round(figures["plain"] / figures["told"], 3))


def test_passes_timed_exactly_as_the_curve_prices_them_teach_auto_nothing_new(monkeypatch):
    """The virtual clock charges every pass what the curve says: a draft model's catch-up, its one-token
    steps (a draft that stopped on the next token's confidence took one more step than it drafted)
    and the target's batches. What `auto` learns from those timings must leave the curve where it
    was; an estimate that mistook a step for catch-up would drift, and price the draft model wrong."""
    from specllm.engine.policy import CostAwarePolicy

    learned = []

    class Watched(CostAwarePolicy):
        def __init__(self, costs, *args, **kwargs):
            super().__init__(costs, *args, **kwargs)
            learned.append(costs)

    monkeypatch.setattr("specllm.engine.auto.CostAwarePolicy", Watched)  # what `auto_drafter` builds
    replay, data = _load(), json.loads((DATA / "dev-streams.json").read_text())
    data["streams"] = [s for s in data["streams"] if s["category"] in ("qa", "translation")]
    curve = replay.load_curve(str(DATA / "gpu-rtx3090-32b-estimated.json"), 32)  # the draft model: the main source there
    replay.simulate(data, curve, draft_max=31)
    assert len(learned) == len(data["streams"]) * 2  # auto with the draft model, and with the n-gram cache alone
    for costs in learned:
        assert costs.draft_token_seconds == pytest.approx(curve.draft_token_seconds, rel=1e-9)
        assert costs.draft_seconds == pytest.approx(curve.draft_seconds, rel=1e-9)
        assert all(costs.batch_seconds[k] == pytest.approx(v, rel=1e-9) for k, v in curve.batch_seconds.items())
