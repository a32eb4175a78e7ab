import numpy as np
import pytest
from scipy import stats as scistats

from specllm.engine.sampling import SamplingParams, argmax, sample, warp
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


def test_argmax_prefers_lowest_id_on_tie():
    assert argmax(np.array([1.0, 3.0, 3.0])) == 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-1),
        SamplingParams(min_p=1.0),
    ],
)
def test_impossible_values_are_usage_errors(params):
    with pytest.raises(UsageError):
        params.validate()
