"""What plain decoding costs, and the best any drafting policy could do, on recorded text and a cost curve.

At temperature 0 a draft is accepted exactly as far as it agrees with plain decoding's text, so
with the text known, the cost of every possible step is known too. `ngram_oracle_cost` is the
cheapest use of the n-gram cache; `two_source_oracle_cost` the cheapest schedule of plain,
n-gram and draft-model steps (dynamic programming over positions), with the draft model paying
for reading the prompt before its first use and every token committed without it afterwards.
Both know where every draft ends. `told_ngram_cost` does not: it is an n-gram policy told, in
hindsight, how far proposals of each kind and agreeing span run in the whole category, the most
that deciding from those features can expect (a reference for the share of the oracles a policy
can reach, not a bound: a policy that learns within a generation may beat it).
"""

from __future__ import annotations

from specllm.engine.costmodel import CostModel
from specllm.engine.ngram import NgramCache, NgramProposal
from specllm.engine.estimates import proposal_kind, span_bucket

INF = float("inf")


def plain_cost(prompt: list[int], generated: list[int], costs: CostModel) -> float:
    """Seconds plain decoding spends on `generated` under the cost model: one pass a token, deeper each time."""
    return sum(costs.verify(1, len(prompt) - 1 + i) for i in range(len(generated)))


def ngram_agreement(prompt: list[int], generated: list[int], ngram_sizes, max_draft: int) -> list[tuple[int, int]]:
    """For each position of `generated`: (tokens the n-gram cache proposes there, how many of them are right)."""
    return [(len(p.tokens) if p is not None else 0, right) for p, right in ngram_proposals(prompt, generated, ngram_sizes, max_draft)]


def ngram_proposals(prompt: list[int], generated: list[int], ngram_sizes, max_draft: int) -> list[tuple[NgramProposal | None, int]]:
    """For each position of `generated`: the n-gram cache's proposal there (or None), and how many of its tokens are right."""
    cache = NgramCache(*ngram_sizes)
    cache.extend(prompt)
    out = []
    for i in range(len(generated)):
        proposal = cache.propose(min(max_draft, len(generated) - i - 1))
        right = 0
        if proposal is not None:
            for drafted, actual in zip(proposal.tokens, generated[i:]):
                if drafted != actual:
                    break
                right += 1
        out.append((proposal, right))
        cache.extend(generated[i : i + 1])
    return out


def ngram_oracle_cost(prompt: list[int], generated: list[int], costs: CostModel, ngram_sizes, max_draft: int) -> float:
    """The cheapest schedule of steps that each draft a prefix of the right part of the n-gram
    proposal (dynamic programming over positions). Not each step's best rate alone: on a curve
    where 3 tokens cost 2.0 passes and 2 cost 1.2, two right tokens and the copy's end are best
    drafted whole (3 tokens, 2.0), not one (2 tokens, 1.2, then a plain pass: 2.2)."""
    agreement = ngram_agreement(prompt, generated, ngram_sizes, max_draft)
    n = len(generated)
    best = [INF] * (n + 1)  # seconds to have committed the first i tokens
    best[0] = 0.0
    for i in range(n):
        context = len(prompt) - 1 + i  # the target's cache holds all but the last token
        for k in range(min(agreement[i][1], n - i - 1) + 1):  # draft k right tokens, commit k + 1
            best[i + k + 1] = min(best[i + k + 1], best[i] + costs.verify(k + 1, context))
    return best[n]


def draft_run_lengths(generated: list[int], draft_argmax: list[int], offset: int) -> list[int]:
    """For each position i of `generated`: how many tokens from i on the draft model's greedy guesses get
    right in a row (`draft_argmax[offset + i]` is its guess for generated[i], given the text before it)."""
    runs = [0] * (len(generated) + 1)
    for i in range(len(generated) - 1, -1, -1):
        j = offset + i
        runs[i] = runs[i + 1] + 1 if 0 <= j < len(draft_argmax) and draft_argmax[j] == generated[i] else 0
    return runs[: len(generated)]


def two_source_oracle_cost(
    prompt: list[int], generated: list[int], costs: CostModel, ngram_sizes, max_draft: int, draft_argmax: list[int] | None
) -> float:
    """The cheapest schedule of plain, n-gram and draft-model steps that produces `generated`.

    State: position i and whether the draft model is being kept in use (it then owes reading every
    token committed without it: `draft_token_seconds` each, paid at its next use). Entering costs
    reading the prompt and what came before i. Leaving is free; re-entering is priced as reading
    everything again (an overestimate, so the bound is slightly low where a pause would pay).
    `draft_argmax[i]` is the draft's greedy guess for generated[i] given the text before it.
    """
    n = len(generated)
    agreement = ngram_agreement(prompt, generated, ngram_sizes, max_draft)
    runs = draft_run_lengths(generated, draft_argmax, 0) if draft_argmax is not None else [0] * n
    per_token = costs.draft_token_seconds or costs.draft_seconds
    best = [[INF, INF] for _ in range(n + 1)]  # [not using the draft model, using it]
    best[0][0] = 0.0
    for i in range(n):
        context = len(prompt) - 1 + i
        limit = min(max_draft, n - i - 1)
        for using in (0, 1):
            here = best[i][using]
            if here == INF:
                continue
            if using:  # leaving the draft model is free
                best[i][0] = min(best[i][0], here)
            owed = per_token if using else 0.0
            proposed, right = agreement[i]
            for m in range(1, min(right, limit) + 2):  # commit m tokens: m - 1 drafted and right, and one more
                k_options = [m - 1] if m - 1 < right else range(m - 1, min(max(proposed, m - 1), limit) + 1)
                seconds = min(costs.verify(k + 1, context) for k in k_options)
                _relax(best, i + m, using, here + seconds + owed * m)
            if draft_argmax is None:
                continue
            enter = 0.0 if using else costs.catch_up(len(prompt) + i) - costs.draft_seconds
            run = runs[i]
            for k in range(1, limit + 1):
                accepted = min(k, run)
                full = accepted == k  # the last drafted token was never read by the draft model: one more owed
                seconds = enter + k * costs.draft_seconds + costs.verify(k + 1, context) + (per_token if full else 0.0)
                _relax(best, i + accepted + 1, 1, here + seconds)
                if k > run:
                    break  # drafting further past the first wrong token only costs more
    return min(best[n])


def _relax(best, i: int, using: int, value: float) -> None:
    if i < len(best) and value < best[i][using]:
        best[i][using] = value


def copy_lengths(proposals: list[list[tuple[NgramProposal | None, int]]], prompt_lengths: list[int], max_draft: int) -> dict:
    """Over some generations' n-gram proposals (`ngram_proposals` of each, after a prompt of the
    given length): by (kind, span bucket), the share of proposals whose first j tokens were all
    right, for j = 0..max_draft (1.0 at j = 0), and how many proposals that is."""
    counts: dict[tuple[str, int], list] = {}
    for positions, prompt_length in zip(proposals, prompt_lengths):
        for proposal, right in positions:
            if proposal is None or not proposal.tokens:
                continue
            key = (proposal_kind(proposal, prompt_length), span_bucket(proposal.span))
            entry = counts.setdefault(key, [[0] * (max_draft + 1), 0])
            for j in range(right + 1):
                entry[0][j] += 1
            entry[1] += 1
    return {key: ([c / n for c in survived], n) for key, (survived, n) in counts.items()}


def told_ngram_cost(prompt: list[int], proposals: list[tuple[NgramProposal | None, int]], lengths: dict, costs: CostModel) -> float:
    """Seconds on one generation for an n-gram policy that knows `lengths` (`copy_lengths` of its
    category): at each step it drafts the prefix of the proposal that commits the most tokens a
    second in expectation (plain decoding when none beats it), and commits what was right and one more."""
    i, spent = 0, 0.0
    n = len(proposals)
    while i < n:
        context = len(prompt) - 1 + i
        proposal, right = proposals[i]
        best_k, best = 0, 1.0 / costs.verify(1, context)
        if proposal is not None and proposal.tokens:
            survived = lengths[(proposal_kind(proposal, len(prompt)), span_bucket(proposal.span))][0]
            expected = 1.0
            for k in range(1, min(len(proposal.tokens), n - i - 1, len(survived) - 1) + 1):
                expected += survived[k]
                if expected / costs.verify(k + 1, context) > best:
                    best_k, best = k, expected / costs.verify(k + 1, context)
        spent += costs.verify(best_k + 1, context)
        i += min(best_k, right) + 1
    return spent
