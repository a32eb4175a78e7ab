"""Logits to probabilities, and sampling. Pure numpy: no model, an explicit Generator.

The same warping is applied to the target's and the draft's logits, so that rejection
sampling compares like with like (house style: p_target and q_draft share temperature,
top-k, top-p and min-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specllm.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"--temp must be 0 or more, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise UsageError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and self.seed < 0:
            raise UsageError(f"--seed must be 0 or more, got {self.seed}")
        return self


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities over the whole vocabulary after temperature, top-k, top-p and min-p.

    `logits` is one row (V,) or several (n, V); the result has the same shape, float64,
    each row summing to 1. Tokens cut by a filter get probability exactly 0.
    """
    if params.greedy:
        raise ValueError("warp() is for temperature > 0; use argmax at temperature 0")
    rows = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    probs = np.vstack([_warp_row(row, params) for row in rows])
    return probs if np.ndim(logits) == 2 else probs[0]


def _warp_row(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    scaled = row / params.temperature
    keep = _top_candidates(scaled, params.top_k)
    # Softmax over the survivors only; everything else stays at probability 0.
    z = scaled[keep] - scaled[keep].max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1
        keep, p = keep[order[:cut]], p[order[:cut]]
    if params.min_p > 0.0:
        mask = p >= params.min_p * p.max()
        keep, p = keep[mask], p[mask]
    out = np.zeros_like(row)
    out[keep] = p / p.sum()
    return out


def _top_candidates(scaled: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the top-k logits (all finite ones when top_k is 0 or >= V)."""
    finite = np.isfinite(scaled)
    if top_k <= 0 or top_k >= scaled.size:
        return np.flatnonzero(finite)
    idx = np.argpartition(-scaled, top_k - 1)[:top_k]
    return idx[finite[idx]]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from a probability row (inverse CDF on one uniform)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))


def argmax(logits: np.ndarray) -> int:
    """Greedy choice; ties go to the lowest token id, as in llama.cpp."""
    return int(np.argmax(logits))
