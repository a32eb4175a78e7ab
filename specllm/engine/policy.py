"""Cost-aware speculation (`--spec auto`): what to draft, and how much, at every step.

The rule: a drafted token is worth its cost when the tokens it is expected to add exceed
what the time it costs would earn at the running throughput R (tokens per second). So at
each step we maximise  E[committed] - R * E[seconds]  using
  - the cost model: target pass time for a batch of k tokens, draft-model step time;
  - acceptance estimates learned during this generation. An n-gram proposal's first token
    is judged by the kind of match (an n-gram seen once before, or several times always
    followed by the same token, or by different ones, or a copy of this generation's own
    output), how far the context agrees with it, and whether the previous draft was fully
    accepted; each further token by how drafted tokens after an accepted one have fared at
    the same depth into the copy (a copy that has run 16 tokens is likelier to run on than
    one that has run 4). The draft model's tokens are judged by its own confidence. Beta
    priors keep early estimates sane.
With flat verification costs (a GPU) this drafts long; with steep costs and poor acceptance
it stops drafting; it consults the draft model only while that has been paying.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specllm.engine.costmodel import CostModel
from specllm.engine.drafters import Draft, ModelDrafter, NgramDrafter
from specllm.engine.ngram import NgramProposal

PRIOR_WEIGHT = 2.0
THROUGHPUT_DECAY = 0.1  # weight of one step in the running throughput
# Priors of n-gram acceptance. A first token: from the generation's record so far (starting at
# FIRST_PRIOR), raised for long agreeing spans (8-15, 16+ tokens: the text is being copied),
# low for an n-gram that was followed by different tokens before.
FIRST_PRIOR = 0.5
COPY_PRIOR = {8: 0.9, 16: 0.95}
MIXED_PRIOR = 0.25
# A match whose source is this generation's own output (the model repeating a phrase of its own)
# rarely runs on: on dev.jsonl, 68% of such first tokens at spans of 8+ were right and 21-32%
# ran 3 tokens, in every category, against 96-100% and 88-97% for copies of the prompt in
# summaries and code edits. It starts where a short common phrase does.
OWN_PRIOR = 0.5
# A further token after an accepted one: copies of unique text run on, common phrases soon end;
# and the longer the context has agreed with the source (depth: agreeing span + tokens drafted
# before this one), the likelier the copy goes on; not so for the model's own phrases.
# Learned per (group, depth bucket).
CONTINUATION_PRIOR = {"unique": 0.9, "repeated": 0.6, "own": 0.6}
DEPTH_PRIOR = {32: 0.97, 16: 0.95, 8: 0.9}  # depth bucket -> at least this prior, copies of the prompt
# Long drafts are bets: at most 1 + CAP_GROWTH * (n-gram tokens accepted so far in this
# generation), or half the agreeing span when that is longer.
CAP_GROWTH = 2
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.01)
MAX_BACKOFF = 64
DRAFT_MARGIN = 1.1  # the draft model must promise 10% over plain decoding at full acceptance


@dataclass
class Beta:
    """Acceptance of one drafted token, counted with censoring (tokens after a rejection are unseen)."""

    accepted: float
    rejected: float

    @classmethod
    def prior(cls, mean: float) -> "Beta":
        return cls(mean * PRIOR_WEIGHT, (1 - mean) * PRIOR_WEIGHT)

    @property
    def mean(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += rejected


class CostAwarePolicy:
    """Learns acceptance and throughput from step outcomes; answers how much to draft."""

    def __init__(self, costs: CostModel, draft_max: int = 32):
        self.costs = costs
        self.draft_max = min(draft_max, max(costs.batch_seconds) - 1)  # stay within the measured curve
        self.throughput = 1.0 / costs.verify(1)  # R: start from plain decoding's speed
        self.context: int | None = None  # tokens in the target's KV cache at this step (None: calibration depth)
        self.output_start: int | None = None  # where this generation's own output begins (None: not known)
        self.first: dict[tuple[str, int, bool], Beta] = {}  # by (kind, span bucket, last_full)
        self.first_pool = Beta.prior(FIRST_PRIOR)  # every first token: the prior of kinds not seen yet
        self.continuation: dict[tuple[str, int], Beta] = {}  # by (unique, repeated or own, depth bucket)
        self.ngram_accepted = 0  # n-gram tokens accepted in this generation: how long a draft may be
        self.last_full = True  # was the previous draft fully accepted?
        self.confidence = [Beta.prior(min(0.95, (lo + hi) / 2)) for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])]
        self.draft_gain = 0.0  # running advantage of consulting the draft model, in tokens per step
        self.skip_draft = 0  # steps left before the draft model is consulted again
        self.backoff = 1
        # Decided once, on the calibrated costs: noisy step timings must not flip it mid-generation,
        # since a first consultation makes the draft model read the whole context.
        self.use_draft_model = self.draft_model_can_pay()

    # -- n-gram ---------------------------------------------------------------------------

    def ngram_keys(self, proposal: NgramProposal, k: int) -> list[Beta]:
        """The estimate behind each of k drafted tokens: the first token's, then the continuation's by depth."""
        kind = _kind(proposal, self.output_start)
        first_key = (kind, _span_bucket(proposal.span), self.last_full)
        if first_key not in self.first:
            if kind == "mixed":
                prior = MIXED_PRIOR
            elif kind == "own":
                prior = min(self.first_pool.mean, OWN_PRIOR)
            else:
                prior = max(self.first_pool.mean, COPY_PRIOR.get(first_key[1], 0.0))
            self.first[first_key] = Beta.prior(prior)
        group = kind if kind in ("unique", "own") else "repeated"
        return [self.first[first_key]] + [self._continuation(group, proposal.span + i) for i in range(1, k)]

    def _continuation(self, group: str, depth: int) -> Beta:
        key = (group, _depth_bucket(depth))
        if key not in self.continuation:
            lift = DEPTH_PRIOR.get(key[1], 0.0) if group != "own" else 0.0
            self.continuation[key] = Beta.prior(max(CONTINUATION_PRIOR[group], lift))
        return self.continuation[key]

    def ngram_draft(self, proposal: NgramProposal) -> list[Beta]:
        """The estimates behind the proposal's tokens worth drafting: as many as pay (none: draft nothing)."""
        cap = max(1 + CAP_GROWTH * self.ngram_accepted, proposal.span // 2)
        keys = self.ngram_keys(proposal, min(len(proposal.tokens), self.draft_max, cap))
        return keys[: self.best_length([estimate.mean for estimate in keys], 0.0)]

    def cost(self, k: int) -> float:
        """Seconds of a target pass over k tokens at this step's context."""
        return self.costs.verify(k, self.context)

    def best_length(self, acceptance: list[float], draft_seconds: float) -> int:
        """argmax over k of E[committed | k drafted] - R * (time of verifying k+1 tokens)."""
        rate = self.target_rate()
        best_k, best_value = 0, 1.0 - rate * self.cost(1)
        survive, expected = 1.0, 1.0
        for k, a in enumerate(acceptance, start=1):
            survive *= a
            expected += survive
            value = expected - rate * (self.cost(k + 1) + draft_seconds)
            if value > best_value:
                best_k, best_value = k, value
        return best_k

    # -- draft model ----------------------------------------------------------------------

    def consult_draft(self) -> bool:
        """Whether to ask the draft model now: only if it can pay at all, and not while backing off."""
        if not self.use_draft_model:
            return False
        if self.skip_draft > 0:
            self.skip_draft -= 1
            return False
        return True

    def draft_model_can_pay(self) -> bool:
        """Even if every drafted token were accepted, would some draft length beat plain decoding?

        On a CPU where a draft step costs a large share of a target pass and batches cost
        nearly k times one token, no length does, and consulting the model only loses time.
        """
        one = self.costs.verify(1)
        return any(
            (k + 1) * one > DRAFT_MARGIN * (k * self.costs.draft_seconds + self.costs.verify(k + 1))
            for k in range(1, self.draft_max + 1)
        )

    def confidence_estimate(self, confidence: float) -> Beta:
        return self.confidence[int(np.searchsorted(CONFIDENCE_EDGES, confidence, side="right")) - 1]

    def worth_drafting_more(self, acceptance: list[float], next_acceptance: float) -> bool:
        """After k drafted tokens: does drafting the next (one more draft step, a bigger batch) pay?"""
        k = len(acceptance)
        survive = float(np.prod(acceptance)) if acceptance else 1.0
        gain = survive * next_acceptance
        cost = self.costs.draft_seconds + self.cost(k + 2) - self.cost(k + 1)
        return gain > self.target_rate() * cost

    def target_rate(self) -> float:
        """R, the value of a second in tokens: the running throughput, shrunk halfway towards plain
        decoding's rate so that a lucky streak does not make ordinary good drafts look poor."""
        plain = 1.0 / self.cost(1)
        return plain + 0.5 * (self.throughput - plain)

    # -- learning -------------------------------------------------------------------------

    def observe(self, draft: Draft, accepted: int, seconds: float, acceptance_keys: list[Beta]) -> None:
        """One verified step: update acceptance (censored), throughput and the draft model's standing."""
        drafted = len(draft.tokens)
        for i, estimate in enumerate(acceptance_keys[: accepted + 1]):
            estimate.observe(i < accepted, i == accepted and accepted < drafted)
        if drafted:
            self.last_full = accepted == drafted
        if draft.source == "ngram":
            self.first_pool.observe(accepted > 0, accepted == 0)
            self.ngram_accepted += accepted
        committed = accepted + 1
        plain_rate = 1.0 / self.cost(1)
        if seconds > 0:
            self.throughput += THROUGHPUT_DECAY * (committed / seconds - self.throughput)
            self.throughput = max(self.throughput, plain_rate)  # never aim below plain decoding
        if draft.source == "draft":
            # The step's advantage over what plain decoding would have made in the same time.
            self.score_draft(committed - plain_rate * seconds)

    def score_draft(self, advantage: float) -> None:
        """Keep a running advantage of consulting the draft model; back off while it is negative."""
        self.draft_gain += 0.25 * (advantage - self.draft_gain)
        if self.draft_gain < 0:
            self.skip_draft, self.backoff = self.backoff, min(self.backoff * 2, MAX_BACKOFF)
        else:
            self.backoff = 1


class AutoDrafter:
    """The n-gram cache first, sized by the policy; the draft model when it pays."""

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter | None, policy: CostAwarePolicy):
        self.ngram, self.model, self.policy = ngram, model, policy
        self._keys: list[Beta] = []

    def propose(self, history, max_tokens, params, rng) -> Draft | None:
        self.ngram.commit(history)
        self.policy.context = len(history) - 1  # the target's cache holds all but the last token
        self._keys = []  # the estimate behind each drafted token, updated when the outcome is known
        proposal = self.ngram.cache.propose(min(max_tokens, self.policy.draft_max))
        if proposal is not None and proposal.tokens:
            self._keys = self.policy.ngram_draft(proposal)
            if self._keys:
                return Draft(proposal.tokens[: len(self._keys)], None, "ngram", proposal.span)
        if self.model is not None and self.policy.consult_draft():
            return self._propose_from_model(history, min(max_tokens, self.policy.draft_max), params, rng)
        return None

    def _propose_from_model(self, history, max_tokens, params, rng) -> Draft | None:
        acceptance: list[float] = []

        def keep_going(confidence: float) -> bool:
            estimate = self.policy.confidence_estimate(confidence)
            if not self.policy.worth_drafting_more(acceptance, estimate.mean):
                return False
            acceptance.append(estimate.mean)
            self._keys.append(estimate)
            return True

        started = time.perf_counter()
        draft = self.model.propose(history, max_tokens, params, rng, keep_going=keep_going)
        if draft is None:  # the draft model was not confident: its time bought nothing
            self.policy.score_draft(-(time.perf_counter() - started) / self.policy.cost(1))
        return draft

    def commit(self, history) -> None:
        self.ngram.commit(history)
        if self.model is not None:
            self.model.commit(history)

    def start(self, prompt) -> None:
        self.commit(prompt)
        self.policy.output_start = len(prompt)

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        costs = self.policy.costs
        costs.observe_verify(len(draft.tokens) + 1, verify_seconds, self.policy.context)
        if draft.source == "draft" and draft.tokens:
            costs.observe_draft(draft_seconds / len(draft.tokens))
        self.policy.observe(draft, accepted, draft_seconds + verify_seconds, self._keys)


def _span_bucket(span: int) -> int:
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


def _kind(proposal: NgramProposal, output_start: int | None) -> str:
    """mixed: the n-gram was followed by different tokens before; own: it copies this generation's
    output; unique: the n-gram occurred once before; agreed: every occurrence had the same next token."""
    if proposal.seen > 1 and not proposal.consistent:
        return "mixed"
    if output_start is not None and proposal.source >= output_start:
        return "own"
    return "unique" if proposal.seen == 1 else "agreed"
