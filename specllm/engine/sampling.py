"""Logits to probabilities, and sampling. Pure numpy: no model, an explicit Generator.

The same warping is applied to the target's and the draft's logits, so that rejection
sampling compares like with like (house style: p_target and q_draft share temperature,
top-k, top-p and min-p).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from specllm.errors import UsageError


class InvalidSampling(UsageError):
    """A sampling value out of its range; `field` is its SamplingParams field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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

    def validate(self, names: Mapping[str, str] = MappingProxyType({})) -> "SamplingParams":
        """These values, or InvalidSampling for the first out of its range, named as `names` spells
        its field (a command's flags, a chat's settings, a request's fields; default: the field's name)."""
        checks = (
            ("temperature", bool(np.isfinite(self.temperature)), "a finite number", ""),
            ("temperature", self.temperature >= 0, "0 or more", ""),
            ("top_k", self.top_k >= 0, "0 (off) or more", ""),
            # 0, as OpenAI's API and llama.cpp allow it: the most likely token only
            ("top_p", 0.0 <= self.top_p <= 1.0, "in [0, 1]", " (0: the most likely token only)"),
            ("min_p", 0.0 <= self.min_p < 1.0, "in [0, 1)", ""),
            ("seed", self.seed is None or self.seed >= 0, "0 or more", " (-1: random)"),
        )
        for field, ok, want, note in checks:
            if not ok:
                raise InvalidSampling(field, f"{names.get(field, field)} must be {want}, got {getattr(self, field)}{note}")
        return self


class Randoms:
    """A generation's random draws, keyed by position: the uniforms that choose the token at position
    j come from a stream of their own (numpy's counter-based Philox, keyed by the generation, its
    counter at j), not from what earlier steps happened to draw. So the target's own draw at j is
    the same whether plain decoding reached j or a step verified a drafted token there, and an
    n-gram token, verified by that draw (`verify_sampled`), cannot change a seeded text: however
    much the n-gram cache drafts (which depends on timings and on earlier requests), the seed gives
    plain decoding's text. The draft model's own draws do not come from here."""

    def __init__(self, key: int):
        self.key = key

    @classmethod
    def drawn_from(cls, rng: np.random.Generator | None) -> "Randoms":
        """A generation's key from the caller's generator (one draw: a seeded generator gives the same key)."""
        return cls(int((rng or np.random.default_rng()).integers(2**63)))

    def at(self, position: int) -> np.random.Generator:
        """The uniforms of position j, in order (2**64 blocks apart: no position's stream runs into the next)."""
        return np.random.Generator(np.random.Philox(key=self.key, counter=position << 64))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities over the whole vocabulary after temperature, top-k, top-p and min-p.

    `logits` is one row (V,) or several (n, V); the result has the same shape, float64,
    each row summing to 1. Tokens cut by a filter get probability exactly 0.
    """
    if params.greedy:
        raise ValueError("warp() is for temperature > 0; use argmax at temperature 0")
    rows = np.atleast_2d(np.asarray(logits))
    probs = np.zeros(rows.shape, dtype=np.float64)
    for row, out in zip(rows, probs):
        keep, p = _warp_row(row, params)
        out[keep] = p
    return probs if np.ndim(logits) == 2 else probs[0]


def _warp_row(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that survive the filters, and their probabilities."""
    # Top-k on the raw logits (dividing by the temperature keeps their order), then float64 on the
    # survivors only: over a 151,936-token vocabulary the whole row in float64 took 3.9 ms a row.
    keep = _top_candidates(row, params.top_k)
    kept = row[keep].astype(np.float64)
    with np.errstate(over="ignore"):
        scaled = kept / params.temperature
        top = scaled.max()
        if not np.isfinite(top):  # a temperature under ~1e-307 overflows a logit to inf (inf - inf: NaN): the best first at 0
            scaled, top = (kept - kept.max()) / params.temperature, 0.0
    # Softmax over the survivors only; everything else stays at probability 0.
    p = np.exp(scaled - top)
    p /= p.sum()
    # Min-p and top-p each keep the most likely tokens, down to a floor or until a mass: together, the
    # shorter of the two. Min-p first, a comparison, so that top-p sorts only what min-p keeps (with
    # top-k off, a whole row at temperature 1.2 took 21 ms to sort).
    if params.min_p > 0.0:
        mask = p >= params.min_p * p.max()
        keep, p = keep[mask], p[mask]
    if params.top_p < 1.0:
        # The smallest set of most likely tokens whose mass (of the whole row) reaches top_p, at least one.
        order = _most_likely_first(p, params.top_p)
        cut = int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1
        keep, p = keep[order[:cut]], p[order[:cut]]
    return keep, p / p.sum()


SUBSAMPLE = 16  # top-k looks first at every 16th logit: see `_top_candidates`


def _top_candidates(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the top-k finite logits (ties at the k-th value: the lowest ids), or of all finite
    ones when top_k is 0 or >= V, in increasing order. The k-th value by a partition of the values
    alone, then a threshold: half the time of partitioning the indices. And only among the logits
    at least as large as the k-th largest of every SUBSAMPLE-th one: those k are in the row, so the
    row's k largest are among them (about SUBSAMPLE * k of 151,936: 0.21 -> 0.10 ms a row)."""
    if top_k <= 0 or top_k >= logits.size:
        return np.flatnonzero(np.isfinite(logits))
    pool = None
    thinned = logits[::SUBSAMPLE]
    if thinned.size > top_k:
        floor = np.partition(thinned, thinned.size - top_k)[thinned.size - top_k]
        pool = np.flatnonzero(logits >= floor)
    values = logits if pool is None else logits[pool]
    kth = np.partition(values, values.size - top_k)[values.size - top_k]
    idx = np.flatnonzero(values >= kth)
    if pool is not None:
        idx = pool[idx]
    if idx.size > top_k:
        above = idx[logits[idx] > kth]
        idx = np.union1d(above, idx[logits[idx] == kth][: top_k - above.size])
    return idx[np.isfinite(logits[idx])]


def _most_likely_first(p: np.ndarray, mass: float) -> np.ndarray:
    """Indices into `p`, most likely first (ties: lower index first), far enough to hold `mass`: the
    order of a full stable sort, of the few largest only when they hold it (sorting a whole
    vocabulary for top-p took 27 ms a row). Every value equal to the last one taken is taken too, so
    ties at the edge come in the full sort's order."""
    for n in (64, 1024, 16384):
        if n >= p.size:
            break
        edge = np.partition(p, p.size - n)[p.size - n]
        few = np.flatnonzero(p >= edge)
        if p[few].sum() >= mass:
            return few[np.argsort(-p[few], kind="stable")]
    return np.argsort(-p, kind="stable")


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from a probability row with one uniform (`pick`), over the tokens with any
    probability. Where nearly every token has some (filters off), by inverse CDF over the ids:
    hashing 151,936 ids would cost milliseconds a token."""
    positive = probs > 0
    if 0 < np.count_nonzero(positive) <= probs.size // 8:  # counted first: listing a dense row's support costs more
        support = np.flatnonzero(positive)
        return pick(support, probs[support], rng.random())
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """sample(warp(logits, params), rng): the same token for the same uniform, from the tokens that
    survive the filters without a whole-vocabulary row of probabilities (a plain step's token)."""
    keep, p = warp_support(np.asarray(logits), params)
    return draw_from(keep, p, logits.size, rng)


def warp_support(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One row's warp(logits, params) as the tokens that survive the filters and their
    probabilities (every other token's is 0), without the whole-vocabulary row."""
    if params.greedy:
        raise ValueError("warp_support() is for temperature > 0; use argmax at temperature 0")
    return _warp_row(logits, params)


def draw_from(keep: np.ndarray, p: np.ndarray, size: int, rng: np.random.Generator) -> int:
    """sample(row, rng) for the row of `size` tokens that holds `p` at `keep` and 0 elsewhere: the same
    token for the same uniform, without building the row where it is sparse (a token whose p is 0
    is never drawn either way: its Gumbel score is -inf)."""
    if keep.size > size // 8:  # few filters: the whole row, as `sample` takes it
        probs = np.zeros(size)
        probs[keep] = p
        return sample(probs, rng)
    order = np.argsort(keep)  # by token id, as `sample` lists them
    return pick(keep[order], p[order], rng.random())


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# splitmix64's finalizer's shifts and multipliers, as numpy scalars once (making them at every call
# was a third of a draw's `pick`)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_FACTORS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_ELEVEN = np.uint64(11)


def pick(tokens: np.ndarray, probs: np.ndarray, u: float) -> int:
    """The token one uniform `u` draws from `probs` (over `tokens`, by id): Gumbel-max, each token's
    Gumbel noise a hash of u's 53 bits and the token's id, so the draw is an exact sample, and two
    rows that differ a little (llama.cpp rounds a token in a batch differently from one alone) give
    the same token unless they nearly tie under that noise: inverse CDF over the ids moves the
    boundaries of every token after a changed one (on the default pair's rows at --temp 0.8, batch
    against single: 3.5% of draws differed, 1.9% by Gumbel-max; the argmax 1.4%)."""
    with np.errstate(over="ignore"):  # the hash multiplies modulo 2**64
        bits = _mix(np.uint64(int(u * 2**53)) ^ _mix(tokens.astype(np.uint64) + _GOLDEN))
    uniforms = (bits >> _ELEVEN).astype(np.float64) * 2.0**-53 + 2.0**-54  # in (0, 1)
    with np.errstate(divide="ignore"):  # a survivor whose probability underflowed to 0 (a low temperature): log -inf, never drawn
        return int(tokens[np.argmax(np.log(probs) - np.log(-np.log(uniforms)))])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: 64 well-mixed bits from 64."""
    x = (x ^ (x >> _SHIFTS[0])) * _FACTORS[0]
    x = (x ^ (x >> _SHIFTS[1])) * _FACTORS[1]
    return x ^ (x >> _SHIFTS[2])


def argmax(logits: np.ndarray) -> int:
    """Greedy choice; ties go to the lowest token id, as in llama.cpp."""
    return int(np.argmax(logits))
