"""Chi-square goodness of fit with small bins merged, for distribution tests."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from scipy import stats as scistats

from specllm.engine.sampling import warp


def chi_square_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value that `samples` were drawn from `expected` (outcome -> probability)."""
    n = len(samples)
    counts = Counter(samples)
    unexpected = [s for s in counts if expected.get(s, 0.0) == 0.0]
    if unexpected:
        return 0.0  # an outcome of probability zero happened
    observed, predicted = [], []
    rest_obs, rest_exp = 0, 0.0
    for outcome, prob in expected.items():
        if prob * n >= min_expected:
            observed.append(counts.get(outcome, 0))
            predicted.append(prob * n)
        else:
            rest_obs += counts.get(outcome, 0)
            rest_exp += prob * n
    if rest_exp > 0:
        observed.append(rest_obs)
        predicted.append(rest_exp)
    predicted = np.array(predicted) * (n / np.sum(predicted))
    return float(scistats.chisquare(observed, predicted).pvalue)


def exact_distribution(truth, prompt: list[int], length: int, params) -> dict:
    """The distribution of `truth`'s first `length` tokens after `prompt` under `params`, by enumeration
    (`truth`: a fake backend with `logits_after` and a small `n_vocab`); sequences of probability 0 left out."""
    dist = {}
    for seq in itertools.product(range(truth.n_vocab), repeat=length):
        prob, context = 1.0, list(prompt)
        for token in seq:
            prob *= warp(truth.logits_after(context), params)[token]
            if prob == 0.0:
                break
            context.append(token)
        if prob > 0.0:
            dist[seq] = prob
    return dist
