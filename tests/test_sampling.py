from collections import Counter

import numpy as np
import pytest
from scipy import stats as scistats

from specllm.engine.drafters import max_softmax
from specllm.engine.sampling import SamplingParams, argmax, draw, pick, sample, warp
from specllm.errors import UsageError


def test_temperature_only_is_softmax():
    logits = np.array([1.0, 2.0, 3.0, -1.0])
    probs = warp(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    assert np.allclose(probs, expected)


def test_top_k_keeps_k_most_likely():
    logits = np.array([0.0, 5.0, 1.0, 4.0, 3.0])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert set(np.flatnonzero(probs)) == {1, 3}
    assert probs.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs_in = np.array([0.5, 0.3, 0.15, 0.05])
    probs = warp(np.log(probs_in), SamplingParams(temperature=1.0, top_k=0, top_p=0.79, min_p=0.0))
    assert set(np.flatnonzero(probs)) == {0, 1}
    probs = warp(np.log(probs_in), SamplingParams(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0))
    assert set(np.flatnonzero(probs)) == {0, 1, 2}


def test_min_p_cuts_relative_to_best():
    probs_in = np.array([0.6, 0.3, 0.06, 0.04])
    probs = warp(np.log(probs_in), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.09))
    assert set(np.flatnonzero(probs)) == {0, 1, 2}


def test_rows_are_warped_independently():
    logits = np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0))
    assert probs.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def test_negative_infinity_logits_never_sampled():
    logits = np.array([-np.inf, 0.0, 0.0])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert probs[0] == 0.0


def test_sample_matches_distribution():
    rng = np.random.default_rng(1)
    probs = np.array([0.1, 0.2, 0.0, 0.7])
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4)
    assert counts[2] == 0
    _, pvalue = scistats.chisquare(counts[[0, 1, 3]], 20000 * probs[[0, 1, 3]])
    assert pvalue > 1e-3


def _reference_warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """warp() as the definition reads: the whole row in float64, one full stable sort for top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    keep = np.flatnonzero(np.isfinite(scaled))
    if 0 < params.top_k < scaled.size:
        keep = np.sort(keep[np.argsort(-scaled[keep], kind="stable")[: params.top_k]])
    p = np.exp(scaled[keep] - scaled[keep].max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1
        keep, p = keep[order[:cut]], p[order[:cut]]
    if params.min_p > 0.0:
        mask = p >= params.min_p * p.max()
        keep, p = keep[mask], p[mask]
    out = np.zeros(scaled.size)
    out[keep] = p / p.sum()
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),  # the defaults: top-k 40, top-p 0.95, min-p 0.05
        SamplingParams(temperature=0.3, top_k=5, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0),  # top-p over the whole row
        SamplingParams(temperature=1.0, top_k=0, top_p=0.999, min_p=0.0),  # past the few largest
        SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
        SamplingParams(temperature=1.2, top_k=0, top_p=0.95, min_p=0.05),  # both, on the whole row: the shorter wins
        SamplingParams(temperature=2.0, top_k=0, top_p=0.5, min_p=0.002),
    ],
)
def test_warp_of_a_large_vocabulary_equals_the_definition(params):
    """warp() filters on float32 logits, applies min-p before top-p and sorts only the few most likely
    tokens for top-p (a 151,936-token row took 3.9 ms, 27 ms with top-p over the whole row): the same
    tokens survive, with the same probabilities to float64 rounding, as when the whole row is warped
    in float64 in the definition's order."""
    rng = np.random.default_rng(7)
    for spread in (1.0, 3.0, 8.0):  # flat to peaked rows: top-p needs thousands of tokens to one
        logits = (rng.standard_normal(20000) * spread).astype(np.float32)
        logits[rng.choice(20000, 50, replace=False)] = -np.inf
        got, expected = warp(logits, params), _reference_warp(logits, params)
        assert np.array_equal(np.flatnonzero(got), np.flatnonzero(expected))
        assert np.abs(got - expected).max() < 1e-12


def test_top_k_ties_at_the_edge_go_to_the_lower_token_ids():
    logits = np.zeros(1000)
    logits[[10, 500]] = 3.0
    logits[[900, 20, 700, 40]] = 2.0  # three places left for four equal logits
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0))
    assert list(np.flatnonzero(probs)) == [10, 20, 40, 500, 700]
    few = np.array([-np.inf] * 6 + [1.0, 2.0])  # fewer finite logits than k: only those
    assert list(np.flatnonzero(warp(few, SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)))) == [6, 7]


def test_top_p_ties_at_the_edge_go_to_the_lower_token_ids():
    """Sixty equal probabilities beside a likelier token: top-p keeps the lowest ids of the tie,
    as one stable sort of the whole row would, though only the few largest are sorted."""
    logits = np.full(5000, -30.0)
    logits[4000] = 2.0
    logits[np.arange(100, 4900, 80)] = 1.0
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0)
    assert np.array_equal(np.flatnonzero(warp(logits, params)), np.flatnonzero(_reference_warp(logits, params)))


def test_a_sparse_row_is_sampled_exactly():
    """sample() draws a top-k row over its tokens (Gumbel-max, the noise hashed from the uniform and
    each token's id): the counts follow the row."""
    rng = np.random.default_rng(3)
    probs = np.zeros(50000)
    support = np.sort(rng.choice(50000, 12, replace=False))
    probs[support] = rng.random(12) + 0.05
    probs /= probs.sum()
    counts = Counter(sample(probs, rng) for _ in range(30000))
    assert set(counts) <= set(support.tolist())
    _, pvalue = scistats.chisquare([counts[t] for t in support], 30000 * probs[support])
    assert pvalue > 1e-3


def test_a_small_change_in_the_row_rarely_changes_the_draw():
    """Rows a little apart (llama.cpp rounds a token in a batch differently from one alone) draw the
    same token for the same uniform unless they nearly tie: different draws at most about as often
    as the rows' total variation distance allows, where inverse CDF over the ids moves every boundary
    after a changed token (here it would differ 3-4 times as often)."""
    rng = np.random.default_rng(5)
    flips = total = 0.0
    for _ in range(40):
        tokens = np.sort(rng.choice(5000, 30, replace=False))
        p = rng.dirichlet(np.full(30, 0.3))
        q = p * np.exp(rng.normal(0, 0.02, 30))  # logits a few hundredths apart
        q /= q.sum()
        uniforms = rng.random(500)
        flips += sum(pick(tokens, p, u) != pick(tokens, q, u) for u in uniforms)
        total += 500 * 0.5 * np.abs(p - q).sum()  # the expected draws a maximal coupling would change
    assert flips <= 2 * total


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0),  # survivors listed by probability
        SamplingParams(temperature=0.6, top_k=0, top_p=1.0, min_p=0.02),  # listed by id
        SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0),  # nothing filtered: the whole row
    ],
)
def test_drawing_from_the_survivors_is_sampling_the_warped_row(params):
    """draw() skips the whole-vocabulary row a plain step's token came from: for the same uniform it
    must give exactly the token sample(warp()) gives."""
    rng = np.random.default_rng(9)
    for spread in (0.5, 2.0, 6.0):
        logits = (rng.standard_normal(20000) * spread).astype(np.float32)
        logits[rng.choice(20000, 30, replace=False)] = -np.inf
        for seed in range(40):
            assert draw(logits, params, np.random.default_rng(seed)) == sample(warp(logits, params), np.random.default_rng(seed))


def test_the_draft_models_confidence_is_its_top_probability():
    rng = np.random.default_rng(5)
    for spread in (0.5, 2.0, 6.0):
        logits = (rng.standard_normal(151936) * spread).astype(np.float32)
        z = np.exp(logits.astype(np.float64) - logits.max())
        assert max_softmax(logits) == pytest.approx(1.0 / z.sum(), rel=1e-5)
    assert max_softmax(np.array([0.0, -np.inf, -np.inf], dtype=np.float32)) == 1.0


def test_argmax_prefers_lowest_id_on_tie():
    assert argmax(np.array([1.0, 3.0, 3.0])) == 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=-0.1),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-1),
        SamplingParams(min_p=1.0),
    ],
)
def test_impossible_values_are_usage_errors(params):
    with pytest.raises(UsageError):
        params.validate()
