"""Cost-aware speculation (`--spec auto`): at every step, draft from the n-gram cache, from the draft
model, or not at all, and how much.

One rule for both sources: a step is worth  E[tokens committed] - R * E[seconds]  where R is the
running throughput (tokens per second). Until the draft model is in use, the n-gram proposal's best
prefix is drafted when it is worth more than plain decoding by a margin (it costs no drafting time,
and only drafting it shows whether the text is being copied); else the draft model when it is, by
its own margin. Once the draft model is in use, every step weighs all four by that worth: plain
decoding, an n-gram prefix, the draft model, and an n-gram prefix the draft model continues in the
same batch (its catch-up is being paid anyway, and a one-hot copy is exact). Seconds
come from the measured cost curve (`CostModel`: a target pass over k tokens at this context, a
draft-model step, the draft model reading committed tokens). Acceptance is learned during the
generation (`estimates.py`, from the priors of `priors.py`):
  - an n-gram proposal's first token by the kind of match (an n-gram seen once before, or several
    times always followed by the same token, or by different ones, or a copy of this generation's
    own output), how far the context agrees with it, and whether the previous draft was fully
    accepted; each further token by the depth into the copy; apart, a token that follows the end of
    a sentence, in the draft or just before it (where extractive summaries leave their source and
    code edits do not). A proposal
    not drafted is scored against what the step committed instead, so a copy shows itself before
    any draft risks a pass;
  - the draft model's tokens by one acceptance rate for the decision to consult it (optimistic,
    mean plus one deviation, while its losses stay within the exploration budget), and by its
    confidence (top probability) for how far to draft once consulted. Before it is consulted its
    rate is a prior: pessimistic, unless the target's own top probability on its first tokens shows
    it sure of itself (where a small draft of its family agrees with it most), which raises the
    prior and widens what its first use may lose.
The draft model must read every committed token it has not seen before it drafts: the whole prompt
before its first use, then whatever n-gram and plain steps committed since. The first use is an
investment, made only when what the draft model is expected to win over the tokens likely left (as
many as the generation has run so far, and a few more) exceeds it, or when it is cheaper than the exploration
budget times the share of tokens it would draft (the share n-gram drafts did not commit); from
then on every token committed without it costs what reading it will cost, and the draft model is
retired for the generation when it cannot win back what it would still need, or when what it lost
exceeds the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from specllm.engine import priors
from specllm.engine.costmodel import CostModel
from specllm.engine.estimates import Beta, NgramEstimates
from specllm.engine.ngram import NgramProposal

COLD, ACTIVE, RETIRED = "cold", "active", "retired"  # the draft model's standing in a generation


@dataclass(frozen=True)
class Plan:
    """What to draft at this step: the source, the estimates behind each n-gram token, the most
    tokens the draft model may draft (after the n-gram tokens, when `then_model`)."""

    source: str | None  # "ngram", "draft" or None (plain decoding)
    ngram_keys: tuple[Beta, ...] = ()
    draft_tokens: int = 0
    then_model: bool = False  # an n-gram draft the draft model continues


class CostAwarePolicy:
    """Learns acceptance, costs and throughput from step outcomes; answers what to draft."""

    def __init__(
        self,
        costs: CostModel,
        draft_max: int = 32,
        has_draft_model: bool = False,
        sentence_end: Callable[[int], bool] = lambda token: False,
    ):
        self.costs = costs
        self.draft_max = min(draft_max, max(costs.batch_seconds) - 1)  # stay within the measured curve
        self.throughput = 1.0 / costs.verify(1)  # R: start from plain decoding's speed
        self.context: int | None = None  # tokens in the target's KV cache at this step (None: calibration depth)
        self.output_start: int | None = None  # where this generation's own output begins (None: not known)
        self.ngram_estimates = NgramEstimates(sentence_end)  # kept for the decoder's life (a chat's turns)
        self.ngram_gain = 0.0  # seconds n-gram drafts have saved in this generation against plain decoding: how long a draft may be
        # draft-model learning
        self.has_draft_model = has_draft_model
        self.draft_acceptance = Beta.prior(priors.DRAFT_PRIOR)
        self.draft_observed = False  # whether that rests on the draft model's own outcomes yet (else its prior)
        self.confidence = [Beta.prior(mean) for mean in priors.CONFIDENCE_PRIORS]
        self.sureness_total, self.sureness_seen = 0.0, 0  # the target's top probabilities on this generation's tokens while the draft model is cold: sum, count
        self.sure_target = False  # the draft model's prior was raised by how sure the target is
        self.sureness_may_pay = False  # whether at the raised prior the draft model would pay on this curve (set at the first step)
        self.model_state = COLD
        self.committed = self.ngram_committed = 0  # tokens of this generation, and those committed by n-gram steps
        self.tokens_left = 0
        self.budget: float | None = 0.0  # seconds the draft model may lose in this generation (None: set at its first step)
        self.model_net = 0.0  # seconds the draft model has saved (negative: lost) against plain decoding
        self.entry_seconds = 0.0  # what its first catch-up cost beyond one step: the investment

    # -- what the drafter tells the policy --------------------------------------------------

    def begin(self, prompt_length: int) -> None:
        """A generation starts after `prompt_length` tokens; its first step says how long it may run."""
        self.output_start = prompt_length
        self.model_state = COLD if self.has_draft_model else RETIRED
        self.committed = self.ngram_committed = 0
        # What a bet may risk rests on this generation's copies: an earlier answer's savings say nothing
        # of this one's matches (a server's next request, a chat's next turn); what was learned of
        # acceptance carries over.
        self.ngram_gain = 0.0
        self.budget = None
        self.model_net = self.entry_seconds = 0.0
        self.sureness_total, self.sureness_seen, self.sure_target, self.sureness_may_pay = 0.0, 0, False, False
        if not self.draft_observed:  # a prior raised in an earlier turn does not carry over; what was learned does
            self.draft_acceptance = Beta.prior(priors.DRAFT_PRIOR)

    def at_step(self, context: int, tokens_left: int) -> None:
        """This step's target context (tokens in its KV cache) and how many tokens may still come
        (capped at the horizon over which the draft model's first use must pay back)."""
        self.context, self.tokens_left = context, min(tokens_left, priors.HORIZON)
        if self.budget is None:  # the generation's first step
            self.budget = priors.EXPLORATION_SHARE * self.tokens_left * self.cost(1)
            self.sureness_may_pay = self.has_draft_model and self._best_model_length(priors.SURE_TARGET_DRAFT_PRIOR)[0] > 0

    # -- the choice -------------------------------------------------------------------------

    def plan(self, proposal: NgramProposal | None, pending: int) -> Plan:
        """The n-gram proposal's best prefix if it beats plain decoding, else the draft model (which
        would first read `pending` committed tokens) if it does, else plain decoding."""
        best_k, best_model = self._best_model_length() if self.model_in_play else (0, 0.0)
        keep_model = self._keep_model(pending, best_k)
        # While the draft model stays in use, every token committed without it must be read later.
        owed = (self.costs.draft_token_seconds or self.costs.draft_seconds) if keep_model else 0.0
        if keep_model and self.model_state == ACTIVE:
            return self._with_model(self._ngram_bet(proposal) if proposal is not None and proposal.tokens else [], owed)
        keys = self.ngram_draft(proposal) if proposal is not None and proposal.tokens else []
        survive, committed = 1.0, 1.0
        for key in keys:
            survive *= key.mean
            committed += survive
        rate = self.target_rate()
        plain = 1.0 - rate * (self.cost(1) + owed)
        ngram = committed - rate * (self.cost(len(keys) + 1) + owed * committed) if keys else plain
        # The n-gram cache goes first whenever its draft is worth verifying: it costs no drafting
        # time, and only drafting it keeps showing whether the text is being copied.
        if keys and ngram > plain + priors.MARGIN:
            return Plan("ngram", tuple(keys))
        if keep_model and best_k and best_model > plain + priors.MODEL_MARGIN:
            return Plan("draft", draft_tokens=min(self.draft_max, self.tokens_left - 1))
        return Plan(None)

    def _with_model(self, keys: list[Beta], owed: float) -> Plan:
        """While the draft model is in use, every choice by the same worth: plain decoding, a prefix
        of the n-gram proposal (estimates `keys`), the draft model after such a prefix (it reads the
        prefix in the batch it reads committed tokens in), or the draft model alone; each beyond
        plain decoding by its margin (the n-gram's alone, the draft model's where it drafts)."""
        rate, room = self.target_rate(), min(self.draft_max, self.tokens_left - 1)
        if room < 1:
            return Plan(None)
        per_token = self.costs.draft_token_seconds or self.costs.draft_seconds
        verify = np.array([self.cost(n) for n in range(room + 2)])
        # Against an n-gram draft, the draft model counts at its learned acceptance: the optimism
        # that keeps it consulted while its losses stay within budget would outbid sure copies.
        alpha = self.draft_acceptance.mean if keys else self._model_acceptance()
        k = np.arange(1, room + 1)
        model_tokens = alpha * (1 - alpha**k) / (1 - alpha) if alpha < 1 else k.astype(float)  # accepted, of k, after an accepted prefix
        survive = np.cumprod([1.0] + [key.mean for key in keys[:room]])  # the n-gram prefix of j tokens all accepted, j = 0..
        committed = np.cumsum(survive)  # expected tokens it commits (the target's own included)
        j = np.arange(len(survive))
        alone = committed[1:] - rate * (verify[j[1:] + 1] + owed * committed[1:]) - priors.MARGIN
        fits = j[:, None] + k[None, :] <= room
        size = np.minimum(j[:, None] + k[None, :] + 1, room + 1)
        seconds = verify[size] + k[None, :] * self.costs.draft_seconds + j[:, None] * per_token
        then_model = np.where(fits, committed[:, None] + survive[:, None] * model_tokens[None, :] - rate * seconds, -np.inf)
        then_model -= priors.MODEL_MARGIN
        plain = 1.0 - rate * (verify[1] + owed)
        best_alone = int(np.argmax(alone)) if len(alone) else -1
        prefix, length = np.unravel_index(int(np.argmax(then_model)), then_model.shape)
        if then_model[prefix, length] > plain and (best_alone < 0 or then_model[prefix, length] >= alone[best_alone]):
            if prefix == 0:
                return Plan("draft", draft_tokens=room)
            return Plan("ngram", tuple(keys[:prefix]), room - int(prefix), then_model=True)
        if best_alone >= 0 and alone[best_alone] > plain:
            return Plan("ngram", tuple(keys[: best_alone + 1]))
        return Plan(None)

    def _ngram_bet(self, proposal: NgramProposal) -> list[Beta]:
        """The estimates behind as many of the proposal's tokens as a bet may risk."""
        return self.ngram_keys(proposal, min(len(proposal.tokens), self.draft_max, self._bet_cap(proposal.span)))

    @property
    def model_in_play(self) -> bool:
        """Whether the draft model may still be consulted in this generation."""
        return self.model_state != RETIRED

    def _keep_model(self, pending: int, best_k: int) -> bool:
        """Whether the draft model is (still, or now first) worth its catch-up in this generation
        (`best_k`: its best draft length at the learned acceptance, 0 when none beats plain)."""
        if self.model_state == RETIRED or self.tokens_left < 2:
            return False
        owed = self.costs.catch_up(pending) - self.costs.draft_seconds  # beyond the one step any use costs
        gain_per_token = self.model_gain_per_token(best_k)
        gain = gain_per_token * self.expected_tokens_left() * self._model_share()
        if self.model_state == COLD:
            if owed + self.costs.draft_seconds <= self.budget * self._model_share():
                # cheaper to find out than the exploration budget, spent in proportion to what it
                # would draft: where the n-gram cache commits most tokens, knowing is worth less
                return True
            if gain_per_token <= 0:
                # Its acceptance stays at the prior while it is unused and what it must read only
                # grows: it cannot become worth consulting in this generation (once the target has
                # shown how sure it is, which may raise the prior).
                if not self.wants_target_sureness:
                    self.model_state = RETIRED
                return False
            # Worth reading the prompt for once what it is expected to win over the tokens likely
            # left exceeds the reading: a long prompt waits until the generation shows it is long
            # (a short answer would never pay the reading back), and the n-gram cache has had its
            # chance to show a copy by then.
            return gain > owed
        if self.model_net + self.entry_seconds < -self.budget or gain < owed:
            self.model_state = RETIRED  # it lost its budget, or cannot win back what it would still need
            return False
        return True

    def expected_tokens_left(self) -> float:
        """How many more tokens this generation is likely to run: as many as it has run so far (a
        generation that has run t tokens is about as likely as not to run t more; a RAG answer stops
        after 20, a code edit runs to the limit), plus the prior length of an answer just begun, at
        most the tokens asked for."""
        return min(self.tokens_left, self.committed + priors.LENGTH_PRIOR)

    def _model_share(self) -> float:
        """The expected share of the tokens left that the draft model would draft: the share of this
        generation's tokens that n-gram drafts did not commit (a Laplace estimate: half at first)."""
        return (self.committed - self.ngram_committed + 1) / (self.committed + 2)

    def model_gain_per_token(self, k: int | None = None) -> float:
        """Seconds the draft model saves per committed token at its learned acceptance, at draft
        length k (default: the best), against plain decoding (0 when no length beats plain)."""
        if k is None:
            k, _ = self._best_model_length()
        if not k:
            return 0.0
        alpha = self._model_acceptance()
        committed = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
        return self.cost(1) - (k * self.costs.draft_seconds + self.cost(k + 1)) / committed

    def _model_acceptance(self) -> float:
        """The draft model's acceptance to decide by: once it is in use, optimistic while its losses
        stay within the exploration budget (a few unlucky first tokens must not end a source that
        pays, and the budget bounds what optimism may cost), else the learned mean."""
        if self.model_state == ACTIVE and self.model_net + self.entry_seconds >= -(self.budget or 0.0):
            return self.draft_acceptance.optimistic
        return self.draft_acceptance.mean

    def _best_model_length(self, alpha: float | None = None) -> tuple[int, float]:
        """The draft length of highest worth at acceptance `alpha` (default: the learned one; 0 when
        none beats plain), and its worth."""
        alpha, rate = self._model_acceptance() if alpha is None else alpha, self.target_rate()
        best_k, best = 0, 1.0 - rate * self.cost(1)
        survive, committed = 1.0, 1.0
        for k in range(1, max(min(self.draft_max, self.tokens_left - 1), 0) + 1):
            survive *= alpha
            committed += survive
            worth = committed - rate * (k * self.costs.draft_seconds + self.cost(k + 1))
            if worth > best:
                best_k, best = k, worth
        return best_k, best

    # -- n-gram ---------------------------------------------------------------------------

    def ngram_keys(self, proposal: NgramProposal, k: int) -> list[Beta]:
        """The estimate behind each of k drafted tokens of an n-gram proposal."""
        return self.ngram_estimates.keys(proposal, k, self.output_start)

    def ngram_draft(self, proposal: NgramProposal) -> list[Beta]:
        """The estimates behind the proposal's tokens worth drafting: as many as pay (none: draft nothing)."""
        keys = self._ngram_bet(proposal)
        return keys[: self.best_length([estimate.mean for estimate in keys])]

    def _bet_cap(self, span: int) -> int:
        """The longest n-gram draft whose extra verification cost, should all of it be wrong, stays
        within one single-token pass plus CAP_GROWTH times what n-gram drafts have saved so far (less
        CAP_SHRINK times what they have lost); or half the agreeing span when that is longer. On a
        flat curve (a GPU) that is every length at once, on a steep one (a CPU) a token or two until
        copies have paid for longer bets, and where bets keep failing they shrink. Every length is
        judged by its own cost, not only those up to the first that costs too much: CPU curves are
        not monotone (on a 2-core Zen 5 a batch of 16 costs 8.3 single tokens, 15 and 17 10.2-10.3),
        and a cheap size is as safe a bet as the smaller ones."""
        one, gain = self.cost(1), self.ngram_gain
        allowed = one + (priors.CAP_GROWTH if gain > 0 else priors.CAP_SHRINK) * gain
        longest = next((k for k in range(self.draft_max, 1, -1) if self.cost(k + 1) - one <= allowed), 1)
        return max(longest, span // 2)

    def cost(self, k: int) -> float:
        """Seconds of a target pass over k tokens at this step's context."""
        return self.costs.verify(k, self.context)

    def best_length(self, acceptance: list[float]) -> int:
        """argmax over k of E[committed | k drafted] - R * (time of verifying k+1 tokens)."""
        rate = self.target_rate()
        best_k, best_value = 0, 1.0 - rate * self.cost(1)
        survive, expected = 1.0, 1.0
        for k, a in enumerate(acceptance, start=1):
            survive *= a
            expected += survive
            value = expected - rate * self.cost(k + 1)
            if value > best_value:
                best_k, best_value = k, value
        return best_k

    # -- the draft model, once consulted ------------------------------------------------------

    def confidence_estimate(self, confidence: float) -> Beta:
        return self.confidence[int(np.searchsorted(priors.CONFIDENCE_EDGES, confidence, side="right")) - 1]

    def worth_including(self, acceptance: list[float], next_acceptance: float) -> bool:
        """With the draft model's next token in hand (its step already paid): does verifying it
        pay, one more row in the target's batch after the k drafted so far, or as the first of a
        longer draft that pays?"""
        survive = float(np.prod(acceptance)) if acceptance else 1.0
        return self._worth_drafting_on(len(acceptance), survive, next_acceptance, drafted=1)

    def worth_looking_further(self, acceptance: list[float]) -> bool:
        """After k drafted tokens: is drafting on worth it, for tokens that would be accepted about
        as often as the last one and verified in a bigger batch?"""
        return self._worth_drafting_on(len(acceptance), float(np.prod(acceptance)), acceptance[-1])

    def _worth_drafting_on(self, k: int, survive: float, acceptance: float, drafted: int = 0) -> bool:
        """After k tokens in the batch (all accepted with probability `survive`): does some number of
        further tokens pay, each accepted with probability `acceptance`, a draft step each (bar the
        first `drafted`, in hand) and a row each? Not only the next one: CPU curves are not convex
        (a 7B on 2 cores verifies 5 tokens for 0.89 passes more than 4, then 8 more for 1.5), and a
        dear size on the way to a cheap one is worth crossing when the draft model is sure."""
        rate, room = self.target_rate(), max(min(self.draft_max, self.tokens_left - 1) - k, 1)  # the drafter keeps to its room
        allowed = self.cost(1) + priors.CAP_GROWTH * max(self.model_net + self.entry_seconds, 0.0)
        value, alive = 0.0, survive
        base = before = self.cost(k + 1)
        for j in range(1, room + 1):
            size = self.cost(k + 1 + j)
            if j > 1 and size - base > allowed:
                break
            alive *= acceptance
            step = self.costs.draft_seconds if j > drafted else 0.0
            value += alive - rate * (step + size - before)
            if value > 0:
                return True
            before = size
        return False

    def copy_beats_model(self, acceptance: list[float], copy: list[float]) -> bool:
        """After k tokens from the draft model: is appending an n-gram copy (tokens accepted with
        `copy`'s estimates, costing only their rows in the batch) worth more than drafting on with the
        model (each token about as likely as its last, a draft step and a row each)?"""
        k, rate = len(acceptance), self.target_rate()
        survive = float(np.prod(acceptance))
        copy_value, alive = 0.0, survive
        for estimate in copy:
            alive *= estimate
            copy_value += alive
        copy_value -= rate * (self.cost(k + 1 + len(copy)) - self.cost(k + 1))
        model_value, best, alive = 0.0, 0.0, survive
        for j in range(1, len(copy) + 1):
            alive *= acceptance[-1]
            model_value += alive - rate * (self.costs.draft_seconds + self.cost(k + 1 + j) - self.cost(k + j))
            best = max(best, model_value)
        return copy_value > best

    def target_rate(self) -> float:
        """R, the value of a second in tokens: the running throughput, shrunk towards plain
        decoding's rate so that a lucky streak does not make ordinary good drafts look poor."""
        plain = 1.0 / self.cost(1)
        return plain + priors.RATE_SHRINK * (self.throughput - plain)

    # -- learning -------------------------------------------------------------------------

    def observe(
        self,
        source: str | None,
        drafted: int,
        accepted: int,
        seconds: float,
        keys: list[Beta],
        model_drafted: int | None = None,
        model_from: int = 0,
        model_seconds: float = 0.0,
    ) -> None:
        """One verified step (`seconds`: drafting and verifying): acceptance (censored), throughput,
        and, for the draft model's tokens, its estimates and what it saved against plain decoding.
        The model wrote `model_drafted` of the drafted tokens (default: all of a "draft" step), from
        position `model_from` on (after an n-gram draft it continued, in `model_seconds`); a copy it
        ran into may follow them."""
        for i, estimate in enumerate(keys[: accepted + 1]):
            estimate.observe(i < accepted, i == accepted and accepted < drafted)
        committed = accepted + 1
        self.committed += committed
        if drafted:
            self.ngram_estimates.observe_draft(drafted, accepted, from_ngram=source == "ngram")
        if source == "ngram" and drafted:
            copied = min(committed, model_from) if model_from else committed  # the n-gram part's tokens
            self.ngram_committed += copied
            self.ngram_gain += copied * self.cost(1) - (seconds - model_seconds)
        plain_rate = 1.0 / self.cost(1)
        if seconds > 0:
            self.throughput += priors.THROUGHPUT_DECAY * (committed / seconds - self.throughput)
            self.throughput = max(self.throughput, plain_rate)  # never aim below plain decoding
        own = (drafted if source == "draft" else 0) if model_drafted is None else model_drafted
        if own and accepted >= model_from:  # the model's tokens were reached
            model_accepted = min(accepted - model_from, own)
            self.draft_acceptance.observe(model_accepted, model_accepted < own)
            self.draft_observed = True
        if source == "draft":
            self.model_net += committed * self.cost(1) - seconds
        elif model_drafted is not None and model_from:
            self.model_net += min(max(accepted - model_from, 0), model_drafted) * self.cost(1) - model_seconds

    def observe_declined(self, keys: list[Beta], proposed: list[int], committed: list[int]) -> None:
        """An n-gram proposal (estimates `keys`) was not drafted and the step committed `committed`."""
        self.ngram_estimates.observe_declined(keys, proposed, committed)

    def observe_model_use(self, caught_up: int) -> None:
        """The draft model was consulted, after reading `caught_up` committed tokens."""
        if self.model_state == COLD:
            self.model_state = ACTIVE
            self.entry_seconds = self.costs.catch_up(caught_up) - self.costs.draft_seconds
            if self.sure_target and self.budget is not None:
                self.budget *= priors.SURE_TARGET_BUDGET  # consulted on the target's word, not to explore

    def observe_model_lost(self) -> None:
        """The draft model could not be loaded at its first use: plain decoding and n-gram drafts from here on."""
        self.has_draft_model, self.sureness_may_pay = False, False
        self.model_state = RETIRED

    @property
    def wants_target_sureness(self) -> bool:
        """Whether the target's top probability on the tokens it commits can still change a decision:
        while the draft model is cold and has shown nothing of its own (in an earlier turn), until
        SURE_TARGET_TOKENS tokens have shown how sure the target is, and only where the raised prior
        would make the draft model pay (on a CPU where a draft step costs 0.4-0.7 of a pass it would
        not, and reading each committed row's top probability costs 0.3-0.5 ms there, a tenth of a
        pass on a GPU)."""
        return (
            self.sureness_may_pay
            and self.model_state == COLD
            and not self.draft_observed
            and self.sureness_seen < priors.SURE_TARGET_TOKENS
        )

    def observe_target_sureness(self, top_probabilities: list[float]) -> None:
        """The target's top probability on each token a step committed. Once SURE_TARGET_TOKENS are
        seen, a target sure of itself on average raises the draft model's prior for this generation,
        where that prior leaves it out (where it pays at the prior, a raised one would only make it
        outbid sure n-gram copies)."""
        if not self.wants_target_sureness:
            return
        self.sureness_total += sum(top_probabilities)
        self.sureness_seen += len(top_probabilities)
        if self.sureness_seen < priors.SURE_TARGET_TOKENS:
            return
        if self.sureness_total / self.sureness_seen >= priors.SURE_TARGET and self.model_gain_per_token() <= 0:
            self.draft_acceptance = Beta.prior(priors.SURE_TARGET_DRAFT_PRIOR, priors.SURE_TARGET_PRIOR_WEIGHT)
            self.sure_target = True

    def observe_wasted_model_time(self, seconds: float) -> None:
        """The draft model was consulted and declined to draft: its time bought nothing."""
        self.model_net -= seconds
