"""How far llama.cpp's batched and one-token logits may differ, from the numerics rather than one CPU.

A batch of tokens and the same tokens one at a time take different kernels. llama.cpp's CPU flash
attention (on by default) rounds the query to f16 and, for a single query row, accumulates the
softmax-weighted sum of V in f16, while a batch of rows goes through a tiled kernel; the KV cache
holds f16; and the matrix products sum in another order (a gemv per token against a tiled gemm
per batch, whose tiles and SIMD lanes, 8 floats for AVX2 and 16 for AVX-512, differ by machine).
f16 keeps 11 significant bits (relative step 2**-11 = 4.9e-4), so the two paths disagree by a few
f16 steps of the logits' own scale. The SIMD width only changes the order in which roundings
happen, not their size, so the bound holds on AVX2, AVX-512 and NEON alike; GPU kernels (CUDA,
Metal) also use f16 attention and stay within it.

Measured on the tiny f32 models (logits' standard deviation ~6): at most 7e-4 of the row's standard
deviation on AVX-512 (4e-3 absolute; with an f32 KV cache and flash attention off it drops to
1.6e-6, which pins the cause), 1.9e-3 absolute on an AVX2 machine. ROW_TOL allows 1e-2, about 14
times the worst seen, while a wrong row (another position, a stale KV cache) is off by at least a
third of a standard deviation: 30 times ROW_TOL, so the checks still fail on the wrong row.
"""

from __future__ import annotations

import numpy as np

ROW_TOL = 1e-2  # max |batched - one-token| over a row, as a fraction of that row's standard deviation


def row_gaps(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row: the largest absolute difference, in units of the expected row's standard deviation."""
    actual, expected = np.atleast_2d(actual), np.atleast_2d(expected)
    return np.abs(actual - expected).max(axis=1) / expected.std(axis=1)


def assert_same_rows(actual: np.ndarray, expected: np.ndarray, what: str = "rows") -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    gaps = row_gaps(actual, expected)
    worst = int(np.argmax(gaps))
    assert gaps[worst] < ROW_TOL, f"{what}: row {worst} differs by {gaps[worst]:.2e} std (tolerance {ROW_TOL})"


def tie_tolerance(row: np.ndarray) -> float:
    """How far apart two logits of `row` may be and still swap order between the two paths:
    each may move by ROW_TOL standard deviations."""
    return 2 * ROW_TOL * float(np.std(row))
