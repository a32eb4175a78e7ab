"""`--spec auto`'s drafter: asks the policy what to draft, drafts it, and tells the policy how it went.

It owns the two sources (the n-gram cache and, when there is one, the draft model) and the
measurements of this machine that the policy reads through its cost model; the policy's state is
the policy's own, changed only through its methods.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from specllm.engine.costmodel import CostModel
from specllm.engine.drafters import Draft, ModelDrafter, NgramDrafter, max_softmax
from specllm.engine.estimates import Beta
from specllm.engine.policy import CostAwarePolicy
from specllm.errors import SpecllmError


class AutoDrafter:
    def __init__(self, ngram: NgramDrafter, model: ModelDrafter | None, policy: CostAwarePolicy):
        self.ngram, self.model, self.policy = ngram, model, policy
        self._keys: list[Beta] = []  # the estimate behind each drafted token, updated when the outcome is known
        self._copy = None  # an n-gram continuation the draft model ran into while drafting
        self._model_drafted = 0  # tokens the draft model wrote in the last draft (a copy may follow them)
        self._model_from = 0  # where they begin in it: after the n-gram tokens it continued, else 0
        self._declined = None  # an n-gram proposal not drafted: (history length then, its tokens, their estimates)
        self._loading = 0.0  # seconds this step spent loading the draft model (deferred until its first use)
        self._asked = False  # whether this step asked for a proposal (the decoder asks none where there is no room)
        self.model_error: SpecllmError | None = None  # why the draft model could not be loaded at its first use (then it is dropped)

    def propose(self, history, max_tokens, params, rng) -> Draft | None:
        self._asked = True
        self.ngram.commit(history)
        self._learn_from_declined(history)
        self.policy.at_step(len(history) - 1, max_tokens + 1)  # the target's cache holds all but the last token
        self._keys, self._model_drafted, self._model_from, self._loading = [], 0, 0, 0.0
        proposal = self.ngram.proposal(min(max_tokens, self.policy.draft_max))
        pending = self.model.pending(history) if self.model is not None and self.policy.model_in_play else 0
        plan = self.policy.plan(proposal, pending)
        if plan.source == "ngram":
            self._keys = list(plan.ngram_keys)
            copy = Draft(proposal.tokens[: len(self._keys)], None, "ngram", proposal.span)
            return self._continue_with_model(copy, history, min(max_tokens, len(copy.tokens) + plan.draft_tokens), params, rng) if plan.then_model else copy
        if proposal is not None:  # scored by what this step commits: one token, unless the draft model drafts
            scored = len(proposal.tokens) if plan.source == "draft" else 1
            self._declined = (len(history), proposal.tokens, self.policy.ngram_keys(proposal, scored))
        if plan.source == "draft":
            return self._propose_from_model(history, min(max_tokens, plan.draft_tokens), params, rng)
        return None

    def _learn_from_declined(self, history) -> None:
        """An n-gram proposal that was not drafted is scored against what the step committed instead:
        free evidence of whether the text is being copied, before any draft risks a pass on it."""
        if self._declined is None:
            return
        start, tokens, keys = self._declined
        self._declined = None
        self.policy.observe_declined(keys, tokens, history[start:])

    def _continue_with_model(self, copy: Draft, history, max_tokens, params, rng) -> Draft:
        """The n-gram draft, then what the draft model drafts after it (it reads the copy with the
        committed tokens it has not seen, in one batch): one verification for both."""
        n = len(copy.tokens)
        if max_tokens <= n or self.ngram.ends_generation(copy.tokens[-1]):
            return copy  # no room left, or the copy ends the generation
        extension = self._propose_from_model(history + copy.tokens, max_tokens - n, params, rng, after=[key.mean for key in self._keys])
        if extension is None:  # the draft model could not be loaded
            return copy
        if not extension.tokens:
            return replace(copy, model_seconds=extension.model_seconds)
        self._model_from = n
        q_draft = extension.q_draft
        if q_draft is not None:  # the copy's tokens are one-hot: an n-gram draft is exact
            q_draft = [None] * n + list(q_draft)
        sources = ("ngram",) * n + ("draft",) * len(extension.tokens)
        return replace(copy, tokens=copy.tokens + extension.tokens, q_draft=q_draft, model_seconds=extension.model_seconds, sources=sources)

    def _propose_from_model(self, history, max_tokens, params, rng, after: list[float] = ()) -> Draft | None:
        """The draft model's draft after `history` (which may end in an n-gram draft whose tokens'
        estimates are `after`: they count in what each further token is worth); None where the
        draft model could not be loaded."""
        acceptance: list[float] = list(after)

        def keep_going(confidence: float) -> bool:
            estimate = self.policy.confidence_estimate(confidence)
            if not self.policy.worth_including(acceptance, estimate.mean):
                return False
            acceptance.append(estimate.mean)
            self._keys.append(estimate)
            return True

        def look_further(drafted: list[int]) -> bool:
            if not self.policy.worth_looking_further(acceptance):
                return False
            self._copy = self._copy_ahead(history + drafted, acceptance)
            return not self._copy

        self._copy, self._model_drafted = None, 0
        try:
            self._loading = self.model.load()  # a one-off, as at start: no part of what drafting costs
        except SpecllmError as exc:  # (`DeferredBackend`: the file removed or damaged since the start, memory taken by now)
            # the generation goes on without it, lossless as ever; the front ends say why (`model_error`)
            self.model_error = exc
            self.model = None
            self.policy.observe_model_lost()
            return None
        started = time.perf_counter()
        draft = self.model.propose(history, max_tokens, params, rng, keep_going=keep_going, look_further=look_further)
        seconds = time.perf_counter() - started
        caught_up = self.model.caught_up
        self.policy.observe_model_use(caught_up)
        if caught_up > 1:
            self.policy.costs.observe_catch_up(caught_up, self.model.catch_up_seconds)
        if not draft.tokens:  # the draft model was not confident enough: its time bought nothing
            self.policy.observe_wasted_model_time(seconds)
            return replace(draft, model_seconds=self._loading + seconds)
        draft = replace(draft, model_seconds=self._loading + seconds)
        self._model_drafted = len(draft.tokens)
        return self._append_copy(draft, max_tokens - len(draft.tokens)) if self._copy else draft

    def _copy_ahead(self, text: list[int], acceptance: list[float]):
        """The n-gram draft to append when the text the draft model is writing has become a copy the
        n-gram cache drafts for free, and appending it is worth more than drafting on with the model
        (its tokens and the estimates behind them), or None."""
        proposal = self.ngram.proposal_after(text, self.policy.draft_max - len(acceptance))
        if proposal is None:
            return None
        keys = self.policy.ngram_draft(proposal)
        if keys and self.policy.copy_beats_model(acceptance, [key.mean for key in keys]):
            return proposal.tokens[: len(keys)], keys
        return None

    def _append_copy(self, draft: Draft, room: int) -> Draft:
        """The draft model's tokens, then the copy it ran into (one-hot: an n-gram draft is exact)."""
        tokens, keys = self._copy
        tokens, keys = tokens[:room], keys[:room]
        self._keys += keys
        q_draft = draft.q_draft
        if q_draft is not None:
            q_draft = list(q_draft) + [None] * len(tokens)
        sources = ("draft",) * len(draft.tokens) + ("ngram",) * len(tokens)
        return replace(draft, tokens=draft.tokens + tokens, q_draft=q_draft, sources=sources)

    def commit(self, history) -> None:
        self.ngram.commit(history)
        if self.model is not None:
            self.model.commit(history)

    def start(self, prompt) -> None:
        self._declined = None
        self.ngram.start(prompt)
        if self.model is not None:
            self.model.commit(prompt)
        self.policy.begin(len(prompt))

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float, target_rows: np.ndarray) -> None:
        if not self._asked:  # the decoder had no room to draft and asked nothing: the last proposal's state is not this step's
            self._keys, self._model_drafted, self._model_from, self._loading = [], 0, 0, 0.0
        if self.policy.wants_target_sureness:  # 0.3-0.9 ms a row on a CPU, for the first few tokens only
            self.policy.observe_target_sureness([max_softmax(row) for row in target_rows])
        costs = self.policy.costs
        loading = self._loading  # in the step's time (the user waited for it), not in what the policy learns
        model_seconds = draft.model_seconds - loading
        costs.observe_verify(len(draft.tokens) + 1, verify_seconds, self.policy.context)
        if draft.source == "draft" and self.model.steps:  # the proposal's time beyond its catch-up, per one-token pass
            costs.observe_draft((model_seconds - self.model.catch_up_seconds) / self.model.steps)
        source = draft.source if draft.tokens else None
        model_drafted = min(self._model_drafted, max(len(draft.tokens) - self._model_from, 0))  # a draft cut where the text ends
        self.policy.observe(
            source, len(draft.tokens), accepted, draft_seconds - loading + verify_seconds, self._keys, model_drafted, self._model_from, model_seconds
        )
        self._asked = False


def auto_drafter(
    costs: CostModel,
    draft_max: int,
    ngram_sizes: tuple[int, int],
    model: ModelDrafter | None = None,
    ends_generation: Callable[[int], bool] = lambda token: False,
    sentence_end: Callable[[int], bool] = lambda token: False,
) -> AutoDrafter:
    """`--spec auto`'s drafter, wired alike wherever it runs (a command's engine, the replays that judge
    the policy): the n-gram cache (n-grams of `ngram_sizes`; the target's end tokens end its copies),
    the draft model when there is one, and the policy deciding by `costs` (its own copy to refine),
    with drafts of at most `draft_max` tokens; `sentence_end` tells the target's tokens that end a sentence."""
    policy = CostAwarePolicy(costs, draft_max=draft_max, has_draft_model=model is not None, sentence_end=sentence_end)
    return AutoDrafter(NgramDrafter(*ngram_sizes, ends_generation, sentence_end), model, policy)
