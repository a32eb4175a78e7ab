"""Speculative acceptance: the step that keeps speculative decoding lossless.

Given the target's rows for `[last, *draft]` (k+1 rows) and the draft's distributions,
decide how many drafted tokens to keep and which token the target adds after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from specllm.engine.sampling import SamplingParams, argmax, draw_from, sample, warp_support


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafted tokens were kept
    token: int  # the target's own token after them: bonus or resampled


def verify_greedy(target_logits: np.ndarray, draft: list[int]) -> Verdict:
    """Temperature 0: keep the longest prefix equal to the target's argmax."""
    for i, token in enumerate(draft):
        choice = argmax(target_logits[i])
        if choice != token:
            return Verdict(i, choice)
    return Verdict(len(draft), argmax(target_logits[len(draft)]))


def verify_sampled(
    p_target: np.ndarray,
    draft: list[int],
    q_draft: Sequence[np.ndarray | None] | None,
    randoms: Callable[[int], np.random.Generator],
) -> Verdict:
    """Temperature > 0: rejection sampling (Leviathan et al., Chen et al.).

    `p_target` are warped probabilities, k+1 rows. `q_draft` are the draft's warped
    probabilities, k rows (a row None: that token was drawn deterministically, one-hot q, as the
    n-gram cache's are), or None when every token was. `randoms(i)` gives the uniforms of row i.
    Accept token x with probability min(1, p/q); at the first rejection sample from
    normalize(max(0, p - q)); when every token passes, sample the bonus from the last row.

    A one-hot token is verified by the target's own draw from its row, kept when the draw is the
    token: kept with probability p(x) = min(1, p/q), and the draw otherwise falls in p off x,
    normalize(max(0, p - q)), so this is the same rule. It is also plain decoding's draw at that
    position (`Randoms`): what the n-gram cache drafts never changes which token is committed.
    """
    rows = p_target if isinstance(p_target, _WarpedRows) else _DenseRows(p_target)
    for i, token in enumerate(draft):
        q_row = None if q_draft is None else q_draft[i]
        if q_row is None:
            choice = rows.draw(i, randoms(i))
            if choice == token:
                continue
            return Verdict(i, choice)
        rng = randoms(i)
        q_x = float(q_row[token])
        if q_x > 0.0 and rng.random() * q_x < rows.probability(i, token):
            continue
        return Verdict(i, rows.draw_residual(i, q_row, token, rng))
    bonus = len(draft)
    return Verdict(bonus, rows.draw(bonus, randoms(bonus)))


def residual(p_row: np.ndarray, q_row: np.ndarray | None, token: int) -> np.ndarray:
    """normalize(max(0, p - q)) by token id; q is one-hot on `token` when None."""
    if q_row is None:
        out = p_row.copy()
        out[token] = 0.0
    else:
        out = np.maximum(p_row - q_row, 0.0)
    total = out.sum()
    if total <= 0.0:  # p == q: a rejection has probability 0, so any row is fine; stay on p
        return p_row
    return out / total


def verify(
    target_logits: np.ndarray,
    draft: list[int],
    q_draft: Sequence[np.ndarray | None] | None,
    params: SamplingParams,
    randoms: Callable[[int], np.random.Generator],
) -> Verdict:
    """Dispatch on temperature. `target_logits` are raw rows; warping happens here, lazily."""
    if params.greedy:
        return verify_greedy(target_logits, draft)
    return verify_sampled(_WarpedRows(target_logits, params), draft, q_draft, randoms)


class _WarpedRows:
    """Target probabilities warped row by row as they are asked for (rows after a rejection are
    never warped), each kept as the tokens that survive the filters and their probabilities: the
    acceptance test reads one of them and the residual is nonzero only among them, so no step
    builds a whole-vocabulary row (each cost about 0.2 ms at 151,936 tokens, and a rejection's
    residual and its draw as much again)."""

    def __init__(self, logits: np.ndarray, params: SamplingParams):
        self.logits, self.params = logits, params
        self._support: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def support(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i as the tokens with any probability and theirs (`warp_support`)."""
        if i not in self._support:
            self._support[i] = warp_support(np.asarray(self.logits[i]), self.params)
        return self._support[i]

    def probability(self, i: int, token: int) -> float:
        """warp(logits[i])[token]."""
        keep, p = self.support(i)
        at = np.flatnonzero(keep == token)
        return float(p[at[0]]) if at.size else 0.0

    def draw(self, i: int, rng: np.random.Generator) -> int:
        """A token from row i, as sample(warp(logits[i]), rng) draws it, without the whole row."""
        keep, p = self.support(i)
        return draw_from(keep, p, self.logits.shape[-1], rng)

    def draw_residual(self, i: int, q_row: np.ndarray, token: int, rng: np.random.Generator) -> int:
        """sample(residual(warp(logits[i]), q_row, token), rng): max(0, p - q) is 0 wherever p is."""
        keep, p = self.support(i)
        out = np.maximum(p - q_row[keep], 0.0)
        total = out.sum()
        if total <= 0.0:  # p == q: a rejection has probability 0, so any row is fine; stay on p
            return self.draw(i, rng)
        return draw_from(keep, out / total, self.logits.shape[-1], rng)


class _DenseRows:
    """Whole rows of warped probabilities (a caller's own), behind `_WarpedRows`' methods."""

    def __init__(self, p_target: np.ndarray):
        self.p_target = p_target

    def probability(self, i: int, token: int) -> float:
        return self.p_target[i][token]

    def draw(self, i: int, rng: np.random.Generator) -> int:
        return sample(self.p_target[i], rng)

    def draw_residual(self, i: int, q_row: np.ndarray, token: int, rng: np.random.Generator) -> int:
        return sample(residual(self.p_target[i], q_row, token), rng)
