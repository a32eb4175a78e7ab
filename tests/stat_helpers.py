"""Chi-square goodness of fit with small bins merged, for distribution tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats as scistats


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
