"""The speculative step's cheaper paths give exactly what the whole-vocabulary rows gave: the same
tokens for the same uniforms, the same verdicts, the same draft confidences (speed is the
benchmark's business; here only that nothing else changed)."""

from __future__ import annotations

import numpy as np
import pytest

from specllm.engine import verify as verify_module
from specllm.engine.drafters import ModelDrafter, max_softmax, read_greedy_row
from specllm.engine.sampling import Randoms, SamplingParams, draw, draw_from, sample, warp, warp_support
from specllm.engine.verify import verify, verify_sampled

PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),  # every filter off: the whole row
    SamplingParams(temperature=1e-3, top_k=0, top_p=1.0, min_p=0.0),  # most probabilities underflow to 0
    SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),
]


def _rows(rng, n, vocab=400, scale=3.0):
    rows = (rng.standard_normal((n, vocab)) * scale).astype(np.float32)
    rows[:, rng.integers(vocab, size=3)] += 6.0  # a few likely tokens, as real rows have
    return rows


@pytest.mark.parametrize("params", PARAMS)
def test_draw_from_the_survivors_is_sample_from_the_whole_row(params):
    rng = np.random.default_rng(1)
    for row in _rows(rng, 40):
        keep, p = warp_support(row, params)
        whole = warp(row, params)
        assert np.array_equal(whole[keep], p) and np.count_nonzero(whole) <= keep.size
        for seed in range(5):
            expected = sample(whole, np.random.default_rng(seed))
            assert draw_from(keep, p, row.size, np.random.default_rng(seed)) == expected
            assert draw(row, params, np.random.default_rng(seed)) == expected


def test_warp_support_is_for_temperature_above_0():
    with pytest.raises(ValueError):
        warp_support(np.zeros(4, dtype=np.float32), SamplingParams(temperature=0.0))


def _whole_rows_verdict(logits, draft, q_draft, params, randoms):
    """The verdict as computed from whole warped rows (the reference the lazy rows must equal)."""
    return verify_sampled(warp(logits, params), draft, q_draft, randoms)


@pytest.mark.parametrize("params", PARAMS)
def test_lazy_rows_give_the_whole_rows_verdicts(params):
    rng = np.random.default_rng(2)
    randoms = Randoms(7)
    for case in range(120):
        k = int(rng.integers(0, 5))
        target = _rows(rng, k + 1)
        drafted = _rows(rng, k)
        if case % 5 == 0:
            drafted = target[:k].copy()  # q == p: residuals of mass 0 stay on p
        elif case % 2:
            drafted = target[:k] + rng.standard_normal((k, 400)).astype(np.float32)  # a draft close to the target: residuals far from p
        draft, q_draft = [], []
        for i in range(k):
            if case % 3 == 1 and i % 2:  # one-hot rows (n-gram tokens) mixed in
                draft.append(int(rng.integers(400)))
                q_draft.append(None)
                continue
            q_row = warp(drafted[i], params)
            draft.append(sample(q_row, np.random.default_rng(case * 10 + i)))
            q_draft.append(q_row)
        expected = _whole_rows_verdict(target, draft, q_draft, params, lambda i: randoms.at(100 * case + i))
        assert verify(target, draft, q_draft, params, lambda i: randoms.at(100 * case + i)) == expected


def test_lazy_rows_warp_each_row_once_and_only_rows_reached():
    logits = _rows(np.random.default_rng(3), 4)
    params = SamplingParams(temperature=0.9)
    rows = verify_module._WarpedRows(logits, params)
    assert rows.probability(1, 5) == warp(logits[1], params)[5]
    assert rows.support(1) is rows.support(1)
    assert sorted(rows._support) == [1]


class _Rows:
    """A draft model whose rows are fixed by what its KV cache holds (a fake for ModelDrafter)."""

    def __init__(self, vocab=400, seed=4):
        self.n_vocab, self.n_ctx, self.n_past = vocab, 256, 0
        self.table = _rows(np.random.default_rng(seed), 64, vocab)
        self.kv: list[int] = []

    def evaluate(self, tokens, rows, copy=True):
        self.kv += list(tokens)
        self.n_past = len(self.kv)
        return np.array([self.table[(sum(self.kv[: len(self.kv) - len(tokens) + r + 1]) * 31) % 64] for r in rows])

    def rewind(self, n_past):
        del self.kv[n_past:]
        self.n_past = len(self.kv)

    def is_eog(self, token):
        return False


def _reference_draft(model, history, max_tokens, params, rng):
    """ModelDrafter's sampled draft as it was computed from whole warped rows."""
    model.rewind(0)
    logits = model.evaluate(history, [len(history) - 1])[0]
    tokens, rows = [], []
    while True:
        q_row = warp(logits, params)
        if not q_row.max() >= 0.0:
            break
        token = sample(q_row, rng)
        tokens.append(token)
        rows.append(q_row)
        if len(tokens) >= max_tokens:
            break
        logits = model.evaluate([token], [0])[0]
    return tokens, rows


@pytest.mark.parametrize("params", PARAMS)
def test_a_sampled_draft_is_the_one_whole_rows_gave(params):
    history = [3, 1, 4, 1, 5]
    for seed in range(6):
        drafter = ModelDrafter(_Rows(), p_min=0.0)
        draft = drafter.propose(history, 6, params, np.random.default_rng(seed))
        tokens, rows = _reference_draft(_Rows(), history, 6, params, np.random.default_rng(seed))
        assert draft.tokens == tokens
        assert all(np.array_equal(q, r) for q, r in zip(draft.q_draft, rows, strict=True))


def test_a_greedy_draft_steps_confidence_is_max_softmax_bit_for_bit():
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        for scale in (0.5, 2.0, 8.0):
            row = (rng.standard_normal(5000) * scale).astype(dtype)
            z = np.exp(row - row.max(), dtype=np.float32)
            assert read_greedy_row(row) == (float(1.0 / z.sum(dtype=np.float64)), int(np.argmax(row)))
            assert max_softmax(row) == read_greedy_row(row)[0]
    assert read_greedy_row(np.array([0.0, -np.inf], dtype=np.float32)) == (1.0, 0)
