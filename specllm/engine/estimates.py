"""What `--spec auto` learns during generation about how often drafted tokens are accepted.

`Beta` counts one kind of drafted token's outcomes. `NgramEstimates` keeps those of n-gram
drafts: the first token's by the kind of match, how far the context agrees with it and whether the
previous draft was fully accepted; each further token's by the depth into the copy; apart, any
token just after the end of a sentence, the first of a draft too when a sentence has just begun
(where extractive summaries leave their source and code edits do not).
Their priors and the data behind them are in `priors.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specllm.engine import priors
from specllm.engine.ngram import NgramProposal

# The most outcomes an estimate weighs: past it, the older ones count for less (both counts scaled
# to it, the mean kept), so what a server or a long chat learns keeps following the text it serves
# now. Twice the tokens of the default context: one generation never reaches it (the replays'
# busiest estimate saw 1,524 outcomes), a server reaches it within a day (an editor's /infill
# requests: the busiest estimate gained 7 outcomes a request, 20,000 after 3,000 requests).
WEIGHT_CAP = 8192


@dataclass
class Beta:
    """Acceptance of one drafted token, counted with censoring (tokens after a rejection are unseen)."""

    accepted: float
    rejected: float

    @classmethod
    def prior(cls, mean: float, weight: float = priors.PRIOR_WEIGHT) -> "Beta":
        return cls(mean * weight, (1 - mean) * weight)

    @property
    def mean(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def optimistic(self) -> float:
        """The mean plus one standard deviation: what it may well be, given how little has been seen."""
        n = self.accepted + self.rejected
        return min(self.mean + (self.accepted * self.rejected / (n * n * (n + 1))) ** 0.5, 1.0)

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += rejected
        weight = self.accepted + self.rejected
        if weight > WEIGHT_CAP:
            self.accepted *= WEIGHT_CAP / weight
            self.rejected *= WEIGHT_CAP / weight


class NgramEstimates:
    """The estimates behind n-gram drafts' tokens, kept for the decoder's life (a chat's turns)."""

    def __init__(self, sentence_end: Callable[[int], bool] = lambda token: False):
        self.sentence_end = sentence_end  # does this token end a sentence (`ngram.ends_sentence` of its text)?
        self.first: dict[tuple[str, int, bool], Beta] = {}  # by (kind, span bucket, last_full)
        self.first_pool = Beta.prior(priors.FIRST_PRIOR)  # every drafted first token: the prior of kinds not seen yet
        self.continuation: dict[tuple[str, int], Beta] = {}  # by (unique, repeated or own, depth bucket)
        self.after_sentence = Beta.prior(priors.SENTENCE_END_PRIOR)  # a token after a sentence's end (a draft's first: just after)
        self.last_full = True  # was the previous draft fully accepted?

    def keys(self, proposal: NgramProposal, k: int, output_start: int | None) -> list[Beta]:
        """The estimate behind each of k drafted tokens: the first token's, then the continuation's by
        depth (`output_start`: where this generation's own output begins, None when not known); any
        token that follows the end of a sentence, drafted or just committed, by the copies that ran on
        past one."""
        kind = proposal_kind(proposal, output_start)
        group = kind if kind in ("unique", "own") else "repeated"
        further = [
            self.after_sentence if self.sentence_end(proposal.tokens[i - 1]) else self._continuation(group, proposal.span + i)
            for i in range(1, k)
        ]
        first = self.after_sentence if proposal.sentence_start else self._first(kind, proposal.span)
        return [first, *further]

    def _first(self, kind: str, span: int) -> Beta:
        key = (kind, span_bucket(span), self.last_full)
        if key not in self.first:
            if kind == "mixed":
                prior = priors.MIXED_PRIOR
            elif kind == "own":
                prior = min(self.first_pool.mean, priors.OWN_PRIOR)
            else:
                prior = max(self.first_pool.mean, priors.COPY_PRIOR.get(key[1], 0.0))
            self.first[key] = Beta.prior(prior)
        return self.first[key]

    def _continuation(self, group: str, depth: int) -> Beta:
        key = (group, _depth_bucket(depth))
        if key not in self.continuation:
            lift = priors.DEPTH_PRIOR.get(key[1], 0.0) if group != "own" else 0.0
            self.continuation[key] = Beta.prior(max(priors.CONTINUATION_PRIOR[group], lift))
        return self.continuation[key]

    def observe_draft(self, drafted: int, accepted: int, from_ngram: bool) -> None:
        """A draft's outcome beyond its tokens' own estimates: whether it was fully accepted (the next
        first token is learned apart by it), and an n-gram draft's first token for the pool."""
        self.last_full = accepted == drafted
        if from_ngram:
            self.first_pool.observe(accepted > 0, accepted == 0)

    @staticmethod
    def observe_declined(keys: list[Beta], proposed: list[int], committed: list[int]) -> None:
        """An n-gram proposal (estimates `keys`) was not drafted and the step committed `committed`:
        its tokens are scored as far as the committed text goes, as if they had been drafted."""
        seen = min(len(committed), len(keys))
        right = next((i for i in range(seen) if proposed[i] != committed[i]), seen)
        for i, estimate in enumerate(keys[: min(right + 1, seen)]):
            estimate.observe(i < right, i == right)


def span_bucket(span: int) -> int:
    """Spans of 2, 3, 4, 5-7, 8-15 and 16+ tokens are learned apart."""
    for edge in (16, 8, 5):
        if span >= edge:
            return edge
    return span


def _depth_bucket(depth: int) -> int:
    """Depths under 8, 8-15, 16-31 and 32+ tokens into a copy are learned apart."""
    for edge in (32, 16, 8):
        if depth >= edge:
            return edge
    return 0


def proposal_kind(proposal: NgramProposal, output_start: int | None) -> str:
    """mixed: the n-gram was followed by different tokens before; own: it copies this generation's
    output; unique: the n-gram occurred once before; agreed: every occurrence had the same next token."""
    if proposal.seen > 1 and not proposal.consistent:
        return "mixed"
    if output_start is not None and proposal.source >= output_start:
        return "own"
    return "unique" if proposal.seen == 1 else "agreed"
