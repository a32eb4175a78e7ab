"""The cost curve is measured so that other work on the machine cannot become its curve for good."""

import numpy as np

from specllm.backend import LoadOptions
from specllm.engine import costmodel
from specllm.engine.costmodel import CostModel, load_costs, measure_costs
from specllm.session import Engine, ModelPaths, SpecConfig
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

    def evaluate(self, tokens, rows) -> np.ndarray:
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

    def evaluate(self, tokens, rows) -> np.ndarray:
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

    def evaluate(self, tokens, rows) -> np.ndarray:
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
