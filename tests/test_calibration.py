"""The cost curve is measured so that other work on the machine cannot become its curve for good."""

import io
import json
import time
from pathlib import Path
import numpy as np
import pytest

from specllm.backend import LoadOptions
from specllm.costs_cache import load_costs, load_learned, save_costs
from specllm.engine import costmodel
from specllm.engine.costmodel import CostModel, measure_costs
from specllm.engine.sampling import SamplingParams
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import specllm_here
from tests.fakes import VirtualClock


def _true_cost(k: int) -> float:
    return 0.030 * (1 + 0.3 * (k - 1))


class TimedBackend:
    """A backend whose timed passes cost `_true_cost` on a virtual clock, `slowdown` times as much
    while the clock is inside `burst` (other work sharing the cores)."""

    n_ctx = 4096

    def __init__(self, clock: VirtualClock, burst=(0.0, 0.0), slowdown: float = 1.0):
        self.clock, self.burst, self.slowdown = clock, burst, slowdown
        self.n_past = 0

    def tokenize(self, text: str) -> list[int]:
        return [3 + (i % 50) for i in range(len(text) // 3)]

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        busy = self.burst[0] <= self.clock.now < self.burst[1]
        if rows:  # a timed pass (filling the context, which asks for no logits, takes no virtual time)
            self.clock.now += _true_cost(len(tokens)) * (self.slowdown if busy else 1.0)
        self.n_past += len(tokens)
        return np.zeros((len(rows), 8), dtype=np.float32)

    def rewind(self, n_past: int) -> None:
        self.n_past = min(self.n_past, n_past)

    def snapshot(self) -> int:
        return self.n_past

    def restore(self, snapshot: int) -> None:
        self.n_past = snapshot


def _measure(monkeypatch, backend: TimedBackend) -> CostModel:
    monkeypatch.setattr(costmodel, "time", backend.clock)
    return measure_costs(backend, None, max_batch=32)


def _worst_error(costs: CostModel) -> float:
    one = costs.verify(1)
    return max(abs(costs.verify(k) / one - _true_cost(k) / _true_cost(1)) / (_true_cost(k) / _true_cost(1)) for k in range(2, 33))


def test_a_quiet_machine_gets_its_curve_and_it_is_steady(monkeypatch):
    costs = _measure(monkeypatch, TimedBackend(VirtualClock()))
    assert _worst_error(costs) < 1e-9 and costs.steady
    assert abs(costs.verify(1) - _true_cost(1)) < 1e-9


def test_a_burst_of_other_work_does_not_become_the_curve(monkeypatch):
    """Other work triples every pass for the first sixth of the calibration, where the old method
    timed one token alone: each batch is priced against the token timed beside it and the median
    round, so the curve stays within 5% of the machine's."""
    quiet = _measure(monkeypatch, TimedBackend(VirtualClock()))
    length = sum(_true_cost(k) + _true_cost(1) for k in range(2, 33)) * 3  # the three rounds, roughly
    costs = _measure(monkeypatch, TimedBackend(VirtualClock(), burst=(0.0, length / 6), slowdown=3.0))
    assert _worst_error(costs) < 0.05
    assert abs(costs.verify(1) / quiet.verify(1) - 1) < 0.05


CONTEXT_COST = 3e-6  # seconds per batch token per cached token: a pass 8% dearer after 768 more


class SlowingBackend(TimedBackend):
    """Passes grow with the cached tokens, and from the first pass timed after more than 300 of them
    on, the machine runs 30% slower (other work starting): the shape of a real miscalibration, where
    the deeper context was timed while the machine ran slower than for the shallow timings."""

    def __init__(self, clock: VirtualClock):
        super().__init__(clock)
        self.slow = False

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        started, cached = self.clock.now, self.n_past
        out = super().evaluate(tokens, rows)
        if rows:
            self.slow = self.slow or cached > 300
            seconds = self.clock.now - started + CONTEXT_COST * len(tokens) * cached
            self.clock.now = started + seconds * (1.3 if self.slow else 1.0)
        return out


def test_the_context_cost_is_timed_in_pairs_that_a_slowing_machine_cannot_skew(monkeypatch):
    """Timed a few seconds apart, a deep pass on a slower machine looks like context cost (the old
    method read 4x the true slope here; on a real machine, 7x); each deep timing paired with a
    shallow one right after reads the slope at the machine's speed of the moment."""
    costs = _measure(monkeypatch, SlowingBackend(VirtualClock()))
    assert abs(costs.context_seconds / (1.3 * CONTEXT_COST) - 1) < 0.05
    assert costs.depth == 256


class DippedBackend(TimedBackend):
    """Batches of 16 cost 15% less than the trend (a size the kernels favour: always), and the
    first three passes of 22 cost 30% less (a lucky draw: every later one costs the trend)."""

    def __init__(self, clock: VirtualClock):
        super().__init__(clock)
        self.passes_of_22 = 0

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        started = self.clock.now
        out = super().evaluate(tokens, rows)
        if rows:
            self.clock.now = started + (self.clock.now - started) * self._share(len(tokens))
        return out

    def _share(self, k: int) -> float:
        """What a timed pass of k tokens costs against the trend."""
        if k == 16:
            return 0.85
        if k == 22:
            self.passes_of_22 += 1
            return 0.7 if self.passes_of_22 <= 3 else 1.0
        return 1.0


def test_a_size_that_timed_cheap_by_chance_is_timed_again_and_a_favoured_one_stays_cheap(monkeypatch):
    """The policy drafts to whichever size looks cheapest: a low median drawn by chance (22) must not
    become the curve, while a size that is cheap every time (16) keeps its place below its neighbours."""
    costs = _measure(monkeypatch, DippedBackend(VirtualClock()))
    one = costs.verify(1)
    assert abs(costs.verify(22) / one - _true_cost(22) / _true_cost(1)) < 0.01 * _true_cost(22) / _true_cost(1)
    assert costs.verify(16) < 0.9 * min(costs.verify(15), costs.verify(17))
    assert abs(costs.verify(16) / one - 0.85 * _true_cost(16) / _true_cost(1)) < 0.01


class OutputRowsBackend(TimedBackend):
    """A draft model whose pass costs a step, each token it reads, and each row of logits it gives
    (the output layer: a fifth of a 0.5B model's weights)."""

    STEP, TOKEN, ROW = 0.012, 0.002, 0.001

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        if rows:
            self.clock.now += self.STEP + self.TOKEN * (len(tokens) - 1) + self.ROW * len(rows)
        self.n_past += len(tokens)
        return np.zeros((len(rows), 8), dtype=np.float32)


def test_the_draft_model_is_timed_as_drafting_runs_it(monkeypatch):
    """A catch-up asks for its last row of logits only, and a step reads its row (confidence and
    token): calibrated with every row of the batch, the 0.5B's catch-up rate came out 30% dearer
    than its catch-ups run on a 2-core EPYC, and the step without its reading 0.3 ms cheaper."""
    clock = VirtualClock()
    monkeypatch.setattr(costmodel, "time", clock)
    reading = 0.0005
    monkeypatch.setattr(costmodel, "read_greedy_row", lambda row: setattr(clock, "now", clock.now + reading))
    draft = OutputRowsBackend(clock)
    costs = measure_costs(TimedBackend(clock), draft, max_batch=32)
    assert costs.draft_seconds == pytest.approx(draft.STEP + draft.ROW + reading)
    assert costs.draft_token_seconds == pytest.approx(draft.TOKEN)  # not TOKEN + ROW: one row, read once
    assert costs.catch_up(32) == pytest.approx(draft.STEP + 31 * draft.TOKEN + draft.ROW + reading)


def test_a_machine_busy_through_the_calibration_is_known_to_be(monkeypatch):
    """Other work doubling every pass for the second half of the calibration: the single-token
    timings disagree, so the curve is marked unsteady (and not cached, below)."""
    length = sum(_true_cost(k) + _true_cost(1) for k in range(2, 33)) * 3
    costs = _measure(monkeypatch, TimedBackend(VirtualClock(), burst=(length / 2, 10 * length), slowdown=2.0))
    assert not costs.steady


def test_a_curve_measured_on_a_busy_machine_serves_the_run_but_is_not_cached(monkeypatch, tiny_pair, tmp_path):
    options = LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0)
    cache = tmp_path / "costs.json"
    for steady in (False, True):
        engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig(strategy="auto"), options, options, cost_cache=cache)
        measured = CostModel({k: 0.01 * k for k in range(1, 33)}, steady=steady)
        monkeypatch.setattr("specllm.session.measure_costs", lambda *args, **kwargs: measured)
        assert engine.costs() is measured  # this run decides by it either way
        saved = load_costs(cache, engine._cost_key(32))
        assert (saved is not None) == steady, f"steady={steady}"
        engine.close()


# -- what auto learned, kept for the next process ----------------------------------------------

SECOND_A_PASS = CostModel({k: 1.0 + 0.1 * k for k in range(1, 33)})  # the tiny model's passes take milliseconds: every one moves it


def _generate_auto(engine: Engine, text: str = "Repeat exactly: def add(a, b): return a + b") -> None:
    list(engine.decoder("auto").generate(engine.encode(text), 12, SamplingParams(temperature=0.0), np.random.default_rng(0)))


def test_what_auto_learned_is_kept_beside_its_calibration_for_the_next_process(tiny_pair, tmp_path):
    options = LoadOptions(n_ctx=512, n_threads=1)
    cache = tmp_path / "costs.json"
    first = Engine(ModelPaths(tiny_pair[0]), SpecConfig("auto"), options, options, cost_cache=cache)
    key = first._cost_key(32)
    save_costs(cache, key, SECOND_A_PASS)
    _generate_auto(first)
    first.keep_learned()
    learned = first.learned_costs()
    first.close()
    assert learned.passes > 0 and load_costs(cache, key).batch_seconds == SECOND_A_PASS.batch_seconds  # the calibration stays

    second = Engine(ModelPaths(tiny_pair[0]), SpecConfig("auto"), options, options, cost_cache=cache)
    assert second.costs().batch_seconds == SECOND_A_PASS.batch_seconds
    assert second.learned_costs().batch_seconds == learned.batch_seconds and second.learned_before == learned.passes
    _generate_auto(second)
    save_costs(cache, key, CostModel({k: 2.0 * k for k in range(1, 33)}))  # calibrated again meanwhile (another process)
    second.keep_learned()  # grew from the calibration the cache no longer holds: not kept
    assert "learned" not in json.loads(cache.read_text("utf-8"))[key]
    second.close()

    third = Engine(ModelPaths(tiny_pair[0]), SpecConfig("auto"), options, options, cost_cache=cache)
    assert third.learned_costs().batch_seconds == {k: 2.0 * k for k in range(1, 33)} and third.learned_before == 0
    third.keep_learned()  # no pass timed: nothing to keep
    assert "learned" not in json.loads(cache.read_text("utf-8"))[key]
    third.close()


def test_a_damaged_or_mismatched_learned_curve_is_left_for_the_calibration(tmp_path):
    cache = tmp_path / "costs.json"
    other_sizes = CostModel({1: 0.1, 2: 0.2}, passes=5).to_dict()
    # refined before passes beyond the timed context were told apart: its sizes may hold their context's cost
    before_deep_growth = {k: v for k, v in SECOND_A_PASS.to_dict().items() if k != "deep_growth"}
    for learned in ("garbage", {"batch_seconds": "garbage"}, other_sizes, before_deep_growth):
        cache.write_text(json.dumps({"k": SECOND_A_PASS.to_dict() | {"learned": learned}}), "utf-8")
        assert load_learned(cache, "k", SECOND_A_PASS) is None, learned
        assert load_costs(cache, "k") == SECOND_A_PASS  # the calibration beside it still serves
    assert load_learned(tmp_path / "missing.json", "k", SECOND_A_PASS) is None


def test_a_damaged_calibration_in_the_cache_is_measured_again(monkeypatch, tiny_pair, tmp_path):
    """An entry for this key with no sizes (`max()` of nothing crashed the run), only some of them
    (pricing a batch beyond them needs two), or a size costing NaN or nothing: measured again."""
    options = LoadOptions(n_ctx=256, n_threads=1)
    cache = tmp_path / "costs.json"
    measured = CostModel({k: 0.01 * k for k in range(1, 33)}, steady=False)  # not cached: each case starts damaged
    monkeypatch.setattr("specllm.session.measure_costs", lambda *args, **kwargs: measured)
    whole = {str(k): 0.01 * k for k in range(1, 33)}
    for sizes in ({}, {"1": 0.01}, {"1": 0.01, "2": 0.02}, whole | {"5": float("nan")}, whole | {"1": 0.0}):
        engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig("auto"), options, options, cost_cache=cache)
        cache.write_text(json.dumps({engine._cost_key(32): {"batch_seconds": sizes}}), "utf-8")
        assert not engine.costs_known(), sizes
        assert engine.costs() is measured and engine.learned_costs().batch_seconds == measured.batch_seconds
        engine.close()


def test_a_size_learned_from_stalls_starts_again_from_its_calibration(tmp_path):
    """Learned before timings were bounded: a batch of 4 at 4.76 single passes where the calibration
    (and a direct timing) says 1.73. It starts again from its calibrated share of one token's pass
    as learned; sizes learned within bounds keep what they learned."""
    calibrated = CostModel({1: 0.07, 2: 0.1, 3: 0.127, 4: 0.121, 5: 0.16})
    learned = CostModel({1: 0.077, 2: 0.116, 3: 0.146, 4: 4.76 * 0.077, 5: 0.179}, passes=16779)
    cache = tmp_path / "costs.json"
    cache.write_text(json.dumps({"k": calibrated.to_dict() | {"learned": learned.to_dict()}}), "utf-8")
    loaded = load_learned(cache, "k", calibrated)
    assert loaded.batch_seconds == learned.batch_seconds | {4: pytest.approx(0.121 / 0.07 * 0.077)}
    assert loaded.passes == 16779
    for one in (0.0, float("nan")):  # damaged: the calibration serves, as for any damaged entry
        cache.write_text(json.dumps({"k": calibrated.to_dict() | {"learned": learned.to_dict() | {"batch_seconds": {"1": one, **{str(k): 0.1 for k in range(2, 6)}}}}}), "utf-8")
        assert load_learned(cache, "k", calibrated) is None


def test_a_flash_attention_setting_has_a_curve_of_its_own(tiny_pair, tmp_path):
    """Flash attention on or off changes what a pass costs at depth, a batch's most (a 2-core EPYC, 16
    tokens after 3,072 cached: 810 ms on, 546 ms off), so a curve measured one way is never the
    other's; `auto` (llama.cpp's choice) keeps the key curves had before the option."""
    cache = tmp_path / "costs.json"
    keys = {}
    for setting in ("auto", "on", "off"):
        options = LoadOptions(n_ctx=512, n_threads=1, flash_attn=setting)
        engine = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options, cost_cache=cache)
        keys[setting] = engine._cost_key(32)
        if setting == "auto":
            save_costs(cache, keys[setting], SECOND_A_PASS)
        else:
            assert not engine.costs_known()  # the default setting's curve does not serve it
        engine.close()
    assert len(set(keys.values())) == 3 and "flash attention" not in keys["auto"] and keys["off"].endswith("|flash attention off")


def test_exact_kernels_keep_the_key_their_curves_had(tiny_pair, tmp_path, monkeypatch):
    """Exact kernels turn flash attention on themselves: their curve stays keyed as before the option
    (`|exact kernels` last, as `scripts/replay_policy.py` tells it from the default kernels' curve)."""
    from specllm import backend

    monkeypatch.setattr(backend, "exact_batch", lambda model: 5)  # tiny models are F32: exact kernels would refuse them
    options = LoadOptions(n_ctx=512, n_threads=1, exact=True)
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options, cost_cache=tmp_path / "costs.json")
    key = engine._cost_key(32)
    engine.close()
    assert engine.target.flash_attn == "on" and key.endswith("|exact kernels") and "flash attention" not in key


def test_each_run_starts_from_what_the_runs_before_it_learned(tiny_pair, home, tmp_path):
    """`specllm run --spec auto`, twice, as a user runs it: the first keeps its passes' lesson in the
    cache, the second starts from it and adds its own; the calibration itself is never rewritten."""
    options = LoadOptions(n_ctx=512, n_threads=1)
    probe = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options)
    key = probe._cost_key(32)
    probe.close()
    home = home | {"SPECLLM_CACHE": str(tmp_path / "own-cache")}  # not the session's calibrations: this one is made up
    cache = tmp_path / "own-cache" / "costs.json"
    save_costs(cache, key, SECOND_A_PASS)
    args = ["run", "-m", tiny_pair[0], "--draft", tiny_pair[1], "--spec", "auto", "-c", "512", "-n", "8", "-p", "def add(a, b): return a + b"]
    passes = []
    for _ in range(2):
        done = specllm_here(home, *args)
        assert done.returncode == 0, done.stderr
        entry = json.loads(cache.read_text("utf-8"))[key]
        assert CostModel.from_dict(entry).batch_seconds == SECOND_A_PASS.batch_seconds
        passes.append(entry["learned"]["passes"])
    assert 0 < passes[0] < passes[1]


class _CalibratingEngine:
    """An engine with no cached curve whose calibration takes `seconds` of real time."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def costs_known(self) -> bool:
        return False

    def costs(self) -> CostModel:
        time.sleep(self.seconds)
        return CostModel({1: 0.03, 2: 0.04})


@pytest.mark.parametrize("terminal", [True, False])
def test_the_calibration_says_what_it_does_and_a_terminal_sees_it_run(monkeypatch, terminal):
    from rich.console import Console

    from specllm.cli import common

    out = io.StringIO()
    monkeypatch.setattr(common, "stderr", Console(file=out, force_terminal=terminal, width=100, highlight=False))
    costs = common.cost_curve(_CalibratingEngine(0.4), announce=True)
    assert costs.batch_seconds == {1: 0.03, 2: 0.04}
    text = out.getvalue()
    assert text.startswith("measuring the verification cost curve (once for these models")
    # On a terminal a spinner counts the seconds (then is erased); elsewhere the line is all there is.
    assert ("0:00:00" in text) is terminal
    assert text.count("\n") == 1 or terminal


def _save_many(path: str, name: str, rounds: int, start) -> None:
    """Save a curve under a key of this writer's at each round, reading the whole file back after each save."""
    start.wait(60)
    damaged = 0
    for i in range(rounds):
        save_costs(Path(path), f"{name}-{i}", CostModel({k: 0.01 * k + i for k in range(1, 33)}))
        try:
            json.loads(Path(path).read_text("utf-8"))
        except ValueError:
            damaged += 1
    raise SystemExit(min(damaged, 100))


def test_processes_saving_curves_at_once_keep_every_entry_and_a_whole_file(tmp_path):
    """A server and a run (or two runs) save their curves into one cache file: none may read it half
    written (a damaged cache is measured again, 1-3 min, and rewritten with one entry), nor drop the
    other's entry."""
    import multiprocessing

    path = tmp_path / "costs.json"
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    writers = [context.Process(target=_save_many, args=(str(path), name, 100, start)) for name in ("a", "b", "c")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0]  # no half-written file read back
    entries = json.loads(path.read_text("utf-8"))
    assert sorted(entries) == sorted(f"{name}-{i}" for name in "abc" for i in range(100))  # nobody's entry lost
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left
