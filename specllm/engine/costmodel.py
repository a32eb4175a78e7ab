"""What a target pass and a draft step cost on this machine, with these models.

`measure_costs` times the target on every batch size 1..max_batch at a typical prompt's depth,
then how much each cached token adds (and the draft model: one step, and its rate reading a batch, each
as drafting runs them: the step with what it reads from its row, the batch with its last row only): 45-180 s for
batches up to 32 with the default pair on 2 cores, once per machine and model set (the result is
cached). `CostModel` answers `verify(k, context)` (seconds to evaluate a batch of k tokens after
`context` cached ones) and keeps learning from the timings of real steps as generation goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specllm.engine.drafters import read_greedy_row

LEARNING_RATE = 0.1  # weight of one observed step in the running estimate
# One timing counts as at most this many times what was expected (or this fraction of it): a pass the
# machine stalled for a second must not make a size look dear for good. Unbounded, a few such passes
# took a batch of 4 on the 2-core Xeon from 1.73 single passes to 4.76 (timed again: 1.72), and auto,
# which never drafts to a dear size, could not learn otherwise; a real change is still learned, in steps.
OUTLIER_FACTOR = 2.0
RECENT_SINGLES = 3  # one-token passes whose median tells the machine's speed now (one stalled pass does not)
DEEP_SHARE = 0.1  # a pass beyond the timed context teaches the growth there when its extrapolated part is this much of it


@dataclass
class CostModel:
    batch_seconds: dict[int, float]  # measured seconds for a target batch of k tokens, at `depth`
    draft_seconds: float = 0.0  # one draft-model step (one token)
    depth: int = 0  # tokens in the KV cache when batch_seconds were measured
    context_seconds: float = 0.0  # added per batch token per context token beyond `depth` (attention)
    draft_token_seconds: float = 0.0  # the draft model reading one more committed token in a batch (0: not measured)
    steady: bool = True  # measured on a machine that was not busy with other work (not saved: a busy curve is not cached)
    passes: int = 0  # timed passes folded in since calibration (this process's and, kept in the cache, earlier ones')
    # Beyond the deepest context the growth was timed at (`reach`), each cached token adds this many
    # times `context_seconds`: learned from the passes there, which teach nothing about the sizes.
    deep_growth: float = 1.0
    # the latest one-token passes against the curve (after the rescale each made): how much slower than
    # it the machine runs right now, which a batch's timing is read at (not saved: it is this moment's)
    _recent: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    # every size from 0 to the largest measured, interpolated once: `verify` runs dozens of times a step
    _dense: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    _dense_of: dict | None = field(default=None, init=False, repr=False, compare=False)

    def verify(self, k: int, context: int | None = None) -> float:
        """Seconds for one target pass over k tokens after `context` cached ones (default: the calibration depth).

        Between measured sizes: interpolated. Context: each batch token attends to every cached
        one, so a pass grows by k * context_seconds per context token (measured with a 1.5B model
        on 2 cores: from depth 256 to 1024 one token's pass grows 10%, a batch of 32's 32%), and
        by deep_growth times that beyond `reach`.
        """
        if self._dense_of is not self.batch_seconds:  # first use, or a curve replaced
            self._densify()
        seconds = self._dense[k] if k < len(self._dense) else self._beyond_sizes(k)
        if context is None:
            return seconds
        return max(seconds + self._context_term(k, context), 0.5 * seconds)

    def catch_up(self, n: int) -> float:
        """Seconds for the draft model to read `n` committed tokens it has not seen and give its first
        draft token's logits: one step, plus each further token at its batched rate (a step's cost
        where that was never measured, which overprices rather than underprices)."""
        per_token = self.draft_token_seconds or self.draft_seconds
        return self.draft_seconds + max(n - 1, 0) * per_token

    def _densify(self) -> None:
        """Every size up to the largest measured: measured, or interpolated for a hand-made or partial curve."""
        sizes = sorted(self.batch_seconds)
        self._dense = np.interp(np.arange(sizes[-1] + 1), sizes, [self.batch_seconds[k] for k in sizes]).tolist()
        self._dense_of = self.batch_seconds

    def _beyond_sizes(self, k: int) -> float:
        """Beyond the measurements: grow linearly with the last slope."""
        sizes = sorted(self.batch_seconds)
        a, b = sizes[-2], sizes[-1]
        slope = (self.batch_seconds[b] - self.batch_seconds[a]) / (b - a)
        return self.batch_seconds[b] + slope * (k - b)

    @property
    def reach(self) -> int:
        """The deepest context the growth per cached token was timed at (`_context_slope`)."""
        return DEEPER * self.depth

    def _context_term(self, k: int, context: int) -> float:
        beyond = max(context - self.reach, 0)
        return self.context_seconds * k * (context - self.depth + (self.deep_growth - 1.0) * beyond)

    def copy(self) -> "CostModel":
        return CostModel(dict(self.batch_seconds), self.draft_seconds, self.depth, self.context_seconds, self.draft_token_seconds,
                         passes=self.passes, deep_growth=self.deep_growth)  # fmt: skip

    def relative(self, k: int) -> float:
        return self.verify(k) / self.verify(1)

    def observe_verify(self, k: int, seconds: float, context: int | None = None) -> None:
        """Fold a real step's timing (after `context` cached tokens) into the estimate for its batch size.

        One token's passes, the commonest, tell how fast the machine runs now: other work on it slows
        every pass alike, so they rescale the whole model (every size and the draft model) rather
        than one token's cost alone. Were one token learned apart, a machine slowed by 10% would
        make every batch look 10% cheaper beside it, and drafts that cannot pay would be chosen
        (seen live: `auto` drafted more, and lost, in the runs where plain decoding was slowest).
        Other sizes learn their own cost at that speed, from passes within the context the growth
        was timed to. Deeper, the growth is extrapolated and a pass's misfit is the context's: there
        it teaches `deep_growth`. Read back into its size, it stayed there: after one bench of
        prompts of 2,000-3,400 tokens (a 2-core Xeon), a batch of 32 was believed to cost 8.7 single
        tokens at the calibration depth where it costs 6.6, and 16 4.4 for 4.0; at the short contexts
        that followed, `auto` would have drafted shorter than pays (replay: code edits 3.03x -> 2.83x).

        A batch's timing is read at the speed the latest one-token passes show (the median of the last
        RECENT_SINGLES, against the curve as they left it), as the calibration times each size beside one
        token: the rescale follows a change of speed over a dozen passes, and a batch timed in that
        while would teach its size the change (other work starting, then the run ending, leaves a
        size dearer for good). The learned curve kept on the 2-core Xeon over 17,000 passes had a batch
        of 16 at 4.63 single passes where the calibration and direct timings say 3.85 (how it got there
        is not known), and auto planning by it replays summaries 6% slower."""
        if k == 1:
            expected = self.verify(1, context)
            if expected <= 0:
                return
            ratio = _bounded(seconds, expected) / expected
            factor = 1.0 + LEARNING_RATE * (ratio - 1.0)
            if factor != 1.0:  # a pass as the curve says (a replay's) changes nothing
                self._rescale(factor)
            self._recent = (self._recent + [ratio / factor])[-RECENT_SINGLES:]
            self.passes += 1
            return
        seconds /= self.speed()
        if context is not None and context > self.reach and self.context_seconds > 0:
            extrapolated = self.context_seconds * k * (context - self.reach)  # what deep_growth scales
            expected = self.verify(k, context)
            if extrapolated < DEEP_SHARE * expected:
                return  # too small a part of the pass to tell from its noise
            self.deep_growth = max(self.deep_growth + LEARNING_RATE * (_bounded(seconds, expected) - expected) / extrapolated, 0.0)
        elif k in self.batch_seconds:
            at_depth = _bounded(seconds - (self._context_term(k, context) if context is not None else 0.0), self.batch_seconds[k])
            self.batch_seconds[k] += LEARNING_RATE * (at_depth - self.batch_seconds[k])
            if self._dense_of is self.batch_seconds and k - 1 in self.batch_seconds and (k + 1 in self.batch_seconds or k + 1 == len(self._dense)):
                self._dense[k] = self.batch_seconds[k]  # no size is interpolated beside it (a calibrated curve)
            else:
                self._dense_of = None  # interpolated sizes beside it move too
        else:
            return  # a size never calibrated: nothing to refine
        self.passes += 1

    def speed(self) -> float:
        """How much slower than the curve the machine runs now, as the latest one-token passes show (1: as it says)."""
        return float(np.median(self._recent)) if len(self._recent) == RECENT_SINGLES else 1.0  # fewer: one stall would be it

    def _rescale(self, factor: float) -> None:
        """Every cost times `factor`: the machine runs that much slower (or faster) than measured."""
        dense = self._dense_of is self.batch_seconds
        self.batch_seconds = {k: v * factor for k, v in self.batch_seconds.items()}
        if dense:  # interpolation commutes with scaling
            self._dense = [v * factor for v in self._dense]
            self._dense_of = self.batch_seconds
        self.draft_seconds *= factor
        self.draft_token_seconds *= factor
        self.context_seconds *= factor

    def observe_draft(self, seconds_per_token: float) -> None:
        seconds_per_token /= self.speed()  # read at the curve's speed, as a batch is
        self.draft_seconds += LEARNING_RATE * (_bounded(seconds_per_token, self.draft_seconds) - self.draft_seconds)

    def observe_catch_up(self, n: int, seconds: float) -> None:
        """Fold a real catch-up (the draft model reading n > 1 tokens in one batch) into the per-token rate."""
        if n > 1 and self.draft_token_seconds:
            per_token = _bounded(max(seconds / self.speed() - self.draft_seconds, 0.0) / (n - 1), self.draft_token_seconds)
            self.draft_token_seconds += LEARNING_RATE * (per_token - self.draft_token_seconds)

    def curve(self) -> list[dict]:
        base = self.verify(1)
        return [
            {"batch": k, "ms": round(s * 1000, 2), "relative": round(s / base, 3)}
            for k, s in sorted(self.batch_seconds.items())
        ]

    def to_dict(self) -> dict:
        return {
            "batch_seconds": {str(k): v for k, v in self.batch_seconds.items()},
            "draft_seconds": self.draft_seconds,
            "depth": self.depth,
            "context_seconds": self.context_seconds,
            "draft_token_seconds": self.draft_token_seconds,
            "passes": self.passes,
            "deep_growth": self.deep_growth,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(
            {int(k): float(v) for k, v in data["batch_seconds"].items()},
            float(data.get("draft_seconds", 0.0)),
            int(data.get("depth", 0)),
            float(data.get("context_seconds", 0.0)),
            float(data.get("draft_token_seconds", 0.0)),
            passes=int(data.get("passes", 0)),
            deep_growth=float(data.get("deep_growth", 1.0)),
        )


SMALL_BATCH_REPEATS = 16  # one token and the draft step are timed this many times in all (they are cheap and noisy)
CALIBRATION_ROUNDS = 3  # every size is timed once a round; its cost is the median of the rounds
CALIBRATION_DEPTH = 256  # tokens already in the KV cache when timing: a typical prompt's length
DEEPER = 4  # the context growth is timed at four times that depth: a long prompt's
CONTEXT_ROUNDS = 5  # pairs of timings (deeper, then at the calibration depth) for the context growth
# One token's timings, spread over the whole calibration, varying more than this (upper quartile over
# lower) mean other work shared the cores for a good part of it: the curve serves this run but is
# not cached. A burst in under a quarter of the timings leaves the quartiles (and the medians) alone.
# 1.25 flagged an idle machine once (the target alone, 1.5B, 2 cores); other work taking a core
# made one token 3x slower here.
BUSY_SPREAD = 1.5
JITTER_SECONDS = 0.002  # passes shorter than this vary with the scheduler, not with other work: not judged
# A size that timed cheaper than both its neighbours is timed this many more rounds, beside them: the
# policy drafts to whichever size looks cheapest, so a low median drawn by chance becomes the size it
# pays for at every step. On this project's machine (2026-12-03) a batch of 22 was calibrated at 9.1
# single tokens, between 21's 9.9 and 23's 12.1, and cost 13.5 in five later rounds; `auto` ran code
# edits at 1.40x where the same curve replayed 1.62x. 16 and 32 stayed cheaper than their
# neighbours in those rounds too: sizes the kernels favour, which the extra rounds keep.
DIP_ROUNDS = 4
CALIBRATION_METHOD = f"depth={CALIBRATION_DEPTH},paired-rounds={CALIBRATION_ROUNDS},every-size,context-pairs,draft-batch,dips+{DIP_ROUNDS},largest,draft-as-drafted"  # part of the cache key: a new method measures again


def measure_costs(target, draft=None, max_batch: int = 16, context: int = CALIBRATION_DEPTH, repeats: int = CALIBRATION_ROUNDS) -> CostModel:
    """Time every target batch size 1..max_batch (and a draft step) at a realistic depth; leaves both KV caches empty.

    Depth matters: every batch token attends to every cached token, so a pass grows with the
    context, a batch faster than one token. Sizes are timed at a typical prompt's depth and
    the growth per cached token is measured apart (see the end).

    Every size is timed, none interpolated: CPU kernels favour some sizes (same machine, batch
    of 16: 8.3 single tokens, of 15: 10.2, of 32: 14.5, of 31: 16.1), so a curve drawn between
    a few sizes misprices the ones between. One untimed pass of the largest batch first (llama.cpp
    sizes its compute buffers on first use), then `repeats` rounds over every size, then more rounds
    of any size cheaper than both its neighbours (`_confirm_dips`).

    A user's machine is rarely idle, and a burst of other work during one size's timing would be
    cached as that machine's curve for good (seen: a browser-sized burst made batches of 2-4 cost
    what one token does, and of 9-11 k tokens each). So each batch is timed right after one token,
    and its cost is that ratio (a burst hitting both cancels), its median over the rounds (a burst
    hitting one round is outvoted) times one token's median over the whole calibration. A batch is
    held between one token's cost and k times it, which the hardware guarantees. `steady` says
    whether one token's timings agreed (BUSY_SPREAD): a curve measured on a busy machine is used,
    not cached. Last, one token and the largest batch are timed in pairs at a deeper context and
    at the calibration depth, which gives what each cached token adds to a pass
    (`CostModel.verify(k, context)`); the target needs `snapshot` and `restore` for that.
    """
    sizes = batch_sizes(max_batch, target.n_ctx)
    filler = filler_tokens(target, min(context, target.n_ctx - max(sizes)))
    batch = filler_tokens(target, max(sizes))
    time_batch(target, filler, batch)
    if draft is not None:
        time_batch(draft, filler, batch[:1])
    rounds = max(repeats, 1)
    ones: list[float] = []
    ratios: dict[int, list[float]] = {k: [] for k in sizes[1:]}
    draft_timings: list[float] = []
    draft_batch_timings: list[float] = []  # the draft model reading the whole batch as a catch-up: its rate
    for _ in range(rounds):
        for k in sizes[1:]:
            one = time_batch(target, filler, batch[:1])
            ones.append(one)
            ratios[k].append(time_batch(target, filler, batch[:k]) / one)
        if draft is not None:
            # As drafting runs them: a step reads its row (confidence, token); a catch-up asks for its
            # last row only (every row's logits made the 0.5B's batch of 32 cost 27% more on a 2-core EPYC).
            draft_timings += [time_batch(draft, filler, batch[:1], read=read_greedy_row) for _ in range(max(1, SMALL_BATCH_REPEATS // rounds))]
            draft_batch_timings.append(time_batch(draft, filler, batch, rows=[len(batch) - 1], read=read_greedy_row))
    _confirm_dips(target, filler, batch, ratios, ones)
    while len(ones) < SMALL_BATCH_REPEATS:  # a short curve: time one token enough on its own
        ones.append(time_batch(target, filler, batch[:1]))
    one = float(np.median(ones))
    context_seconds = _context_slope(target, filler, batch)
    target.rewind(0)
    if draft is not None:
        draft.rewind(0)
    batch_seconds = {1: one} | {k: one * min(max(float(np.median(r)), 1.0), k) for k, r in ratios.items()}
    draft_seconds = float(np.median(draft_timings)) if draft is not None else 0.0
    draft_token_seconds = 0.0
    if draft is not None and len(batch) > 1:
        draft_token_seconds = max(float(np.median(draft_batch_timings)) - draft_seconds, 0.0) / (len(batch) - 1)
    steady = one < JITTER_SECONDS or timing_spread(ones) <= BUSY_SPREAD
    return CostModel(batch_seconds, draft_seconds, len(filler), context_seconds, draft_token_seconds, steady)


def _confirm_dips(target, filler: list[int], batch: list[int], ratios: dict[int, list[float]], ones: list[float]) -> None:
    """Time each size that looks cheaper than its neighbours, and the neighbours, DIP_ROUNDS
    more rounds (each beside one token, as before): a dip drawn by chance is outvoted, a size the
    kernels favour stays cheap."""
    medians = {k: float(np.median(r)) for k, r in ratios.items()}
    # The largest size has one neighbour, and long copies draft to it most: it is judged against that one.
    dips = [k for k in medians if k - 1 in medians and medians[k] < min(medians[k - 1], medians.get(k + 1, float("inf")))]
    suspects = sorted({j for k in dips for j in (k - 1, k, k + 1) if j in medians})
    for _ in range(DIP_ROUNDS):
        for k in suspects:
            one = time_batch(target, filler, batch[:1])
            ones.append(one)
            ratios[k].append(time_batch(target, filler, batch[:k]) / one)


def timing_spread(timings: list[float]) -> float:
    """How far repeated timings of the same pass disagree: the upper quartile over the lower."""
    low, high = np.percentile(timings, [25, 75])
    return float(high / low) if low > 0 else float("inf")


def _context_slope(target, filler: list[int], batch: list[int]) -> float:
    """Seconds a pass grows per batch token per extra context token: one token and the largest batch
    timed after DEEPER times as much context as `filler` (or as much as the context holds, at least
    twice) and right after at `filler`'s depth, in CONTEXT_ROUNDS pairs (0 where the context is too
    small to tell).

    The deeper cache is filled once and brought back from a snapshot for each pair, so the two
    timings of a pair are a second apart: a growth of 8% of a pass is measured against a machine
    whose speed drifts by a third within a minute. Timed minutes apart, as before, the slope came
    out 2e-6 to 5.5e-5 on one machine (2-core EPYC, 2026-12-04); in pairs, 7.8e-6 to 1.2e-5."""
    depth = len(filler)
    deep = min(DEEPER * depth, target.n_ctx - len(batch))  # a small context: as deep as it holds
    if depth == 0 or deep < 2 * depth:
        return 0.0
    deep_filler = filler_tokens(target, deep)
    _hold(target, deep_filler)
    snapshot = target.snapshot()
    sizes = (1, len(batch))
    growth: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(CONTEXT_ROUNDS):
        target.restore(snapshot)
        deep_seconds = {k: time_batch(target, deep_filler, batch[:k]) for k in sizes}
        for k in sizes:
            growth[k].append(deep_seconds[k] - time_batch(target, filler, batch[:k]))
    medians = {k: float(np.median(g)) for k, g in growth.items()}
    # Least squares for growth_k = slope * k * (deep - depth) over the two sizes.
    slope = sum(k * g for k, g in medians.items()) / (sum(k * k for k in medians) * (deep - depth))
    return max(slope, 0.0)


def batch_sizes(max_batch: int, n_ctx: int) -> list[int]:
    """The batch sizes timed for a curve up to max_batch in a context of n_ctx tokens: all of them."""
    return list(range(1, min(max_batch, n_ctx) + 1))


def filler_tokens(backend, n: int) -> list[int]:
    """n tokens of repeated code to fill a KV cache with (what they say does not change a pass's cost)."""
    tokens = backend.tokenize("def f(x):\n    return x * 2\n" * 16)
    return (tokens * (n // max(len(tokens), 1) + 1))[:n]


def _hold(backend, filler: list[int]) -> None:
    """Make the KV cache hold `filler`: fillers of any length share their prefix, so keep what is cached."""
    if backend.n_past != len(filler):
        backend.rewind(min(backend.n_past, len(filler)))
        if len(filler) > backend.n_past:
            backend.evaluate(filler[backend.n_past :], [])


def time_batch(backend, filler: list[int], batch: list[int], rows: list[int] | None = None, read=None) -> float:
    """Seconds for one pass over `batch` after `filler` (evaluated once and kept), with the logits of
    `rows` (default: every row, as verification asks) read in place, and `read` of the last of them."""
    _hold(backend, filler)
    started = time.perf_counter()
    logits = backend.evaluate(batch, list(range(len(batch))) if rows is None else rows, copy=False)
    if read is not None:
        read(logits[-1])
    elapsed = time.perf_counter() - started
    backend.rewind(len(filler))
    return elapsed


def _bounded(seconds: float, expected: float) -> float:
    """A timing as learning may count it: within OUTLIER_FACTOR of what was expected (as is, where nothing was)."""
    if expected <= 0:
        return seconds
    return min(max(seconds, expected / OUTLIER_FACTOR), expected * OUTLIER_FACTOR)
