"""The cost-aware policy on synthetic cost curves and acceptance sequences."""

import numpy as np
import pytest

from specllm.backend import DeferredBackend, LoadOptions

from specllm.engine.auto import AutoDrafter
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder, generate_plain
from specllm.engine.drafters import ModelDrafter, NgramDrafter
from specllm.engine.ngram import NgramProposal
from specllm.engine import auto, priors
from specllm.engine.policy import ACTIVE, COLD, RETIRED, CostAwarePolicy
from specllm.engine.sampling import SamplingParams
from tests.fakes import BIG_GPU, FakeBackend

GPU = CostModel({k: 0.010 + 0.0001 * k for k in (1, 2, 4, 8, 16, 32)}, draft_seconds=0.002)
# CPU-like: measured shape for a 1.5B model on 2 cores, with a cheap batch of 5.
CPU = CostModel({1: 0.073, 2: 0.107, 3: 0.13, 4: 0.122, 5: 0.153, 8: 0.226, 16: 0.27}, draft_seconds=0.034)
# Measured later on the same machine with every size timed (relative to one token's 32.4 ms).
CPU_2 = CostModel({k: 0.0324 * r for k, r in {1: 1.0, 2: 1.87, 3: 2.59, 4: 3.17, 5: 3.85, 6: 4.58, 7: 5.26, 8: 6.97, 16: 8.75}.items()}, draft_seconds=0.021)


def _proposal(span: int, seen: int = 1, consistent: bool = True, available: int = 31) -> NgramProposal:
    return NgramProposal(list(range(available)), min(span, 4), span, seen, consistent)


def _feed(policy, source, drafted, accepted, seconds, span=4, rounds=1):
    for _ in range(rounds):
        keys = policy.ngram_keys(_proposal(span), drafted)
        policy.observe(source, drafted, accepted, seconds, keys)


def test_flat_verification_cost_drafts_long():
    policy = CostAwarePolicy(GPU.copy(), draft_max=31)
    _feed(policy, "ngram", 8, 6, 0.011, rounds=5)
    assert len(policy.ngram_draft(_proposal(4))) >= 16


def test_steep_cost_and_poor_acceptance_stop_drafting():
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 2, 0, 0.107, rounds=6)
    assert len(policy.ngram_draft(_proposal(4))) == 0


def test_cheap_batch_size_is_exploited():
    """On this curve a batch of 4 costs less than one of 3, so drafting 2 tokens is never best:
    whatever the acceptance, 3 drafted tokens (batch 4) do better for less."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    chosen = {policy.best_length([a] * 15) for a in np.linspace(0.05, 0.99, 60)}
    assert 2 not in chosen
    assert 3 in chosen  # the cheap size is used for middling acceptance
    assert 0 in chosen and 15 in chosen  # and the extremes: no draft, the longest draft


def test_recovers_when_acceptance_returns():
    """After failures, short matches are declined, but a copy in progress (a long agreeing span)
    is still drafted; once copies are accepted, short matches are drafted again."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 2, 0, 0.107, rounds=6)
    assert len(policy.ngram_draft(_proposal(4))) == 0
    assert len(policy.ngram_draft(_proposal(20))) > 0
    _feed(policy, "ngram", 8, 8, 0.226, span=20, rounds=4)
    assert len(policy.ngram_draft(_proposal(4))) > 0


# Shaped like the machine files in ../shared/machines: a 2-core AVX2 CPU (batch of 2: 1.44 tokens,
# the 0.5B draft 0.38 of a pass, reading a token in a batch 0.13); BIG_GPU (tests/fakes.py) is a GPU
# with a large target (batches nearly flat, the draft step 0.09 of a pass).
AVX2 = CostModel({1: 0.083, 2: 0.120, 3: 0.156, 4: 0.203, 5: 0.241, 6: 0.230, 7: 0.268, 8: 0.348, 16: 0.454, 32: 1.04},
                 draft_seconds=0.032, draft_token_seconds=0.011)  # fmt: skip


def _start(policy, prompt_length=300, tokens_left=128):
    policy.begin(prompt_length)
    policy.at_step(prompt_length - 1, tokens_left)


def test_draft_model_is_not_consulted_where_it_cannot_pay():
    """On the AVX2 curve a draft step plus a bigger batch costs more than the tokens it can add at a
    realistic acceptance, and reading a 300-token prompt first costs 40 target passes: never consulted."""
    policy = CostAwarePolicy(AVX2.copy(), draft_max=31, has_draft_model=True)
    _start(policy)
    assert policy.plan(None, pending=300).source is None
    assert policy.model_gain_per_token() <= 0


def test_draft_model_is_consulted_where_it_pays_back_its_catch_up():
    """With a 32B target on a GPU the draft model pays at the pessimistic prior: it is consulted
    at once; asked for 2 tokens after a 20000-token prompt it would not pay back the reading."""
    policy = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    _start(policy)
    plan = policy.plan(None, pending=300)
    assert plan.source == "draft" and plan.draft_tokens >= 8
    late = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    _start(late, prompt_length=20000, tokens_left=3)
    assert late.plan(None, pending=20000).source is None


def test_draft_model_exploration_is_bounded_and_ends_for_good():
    """Where every drafted token is rejected, the draft model is retired once its losses pass the
    exploration budget (2% of the plain time of the tokens asked for), and never consulted again."""
    policy = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    _start(policy)
    budget, consulted, retired_at = policy.budget, 0, None
    for step in range(128):
        policy.at_step(299 + step, 128 - step)
        plan = policy.plan(None, pending=1)
        if policy.model_state == RETIRED and retired_at is None:
            retired_at = step
        if plan.source != "draft":
            continue
        assert retired_at is None  # never again once retired
        consulted += 1
        policy.observe_model_use(300 if consulted == 1 else 1)
        drafted = min(plan.draft_tokens, 4)
        policy.observe("draft", drafted, 0, drafted * BIG_GPU.draft_seconds + BIG_GPU.verify(drafted + 1), [])
    assert retired_at is not None and 1 <= consulted <= 10
    assert -(policy.model_net + policy.entry_seconds) <= budget + 4 * BIG_GPU.draft_seconds + BIG_GPU.verify(5)


def test_exploration_budget_is_spent_in_proportion_to_what_the_draft_model_would_draft():
    """After the n-gram cache has committed nearly every token, a catch-up that the full exploration
    budget would cover is not paid for: the draft model would draft little of what is left. After as
    many plain steps it is paid for."""
    copying = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    plain = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    for policy in (copying, plain):
        _start(policy)
    for step in range(8):
        copying.at_step(299 + 8 * step, 128 - 8 * step)
        copying.observe("ngram", 7, 7, BIG_GPU.verify(8), copying.ngram_keys(_proposal(32), 7))
    for step in range(64):
        plain.at_step(299 + step, 128 - step)
        plain.observe(None, 0, 0, BIG_GPU.verify(1), [])
    for policy in (copying, plain):
        policy.at_step(363, 64)
    assert copying.committed == plain.committed == 64
    assert BIG_GPU.catch_up(364) < copying.budget  # the whole budget would pay for reading the text
    assert plain.plan(None, pending=364).source == "draft"
    assert copying.plan(None, pending=364).source is None


def test_draft_length_stops_where_it_no_longer_pays():
    policy = CostAwarePolicy(CPU.copy(), has_draft_model=True)
    assert policy.worth_including([], 0.95)
    assert not policy.worth_including([], 0.2)
    assert not policy.worth_looking_further([0.5] * 6)
    assert policy.worth_looking_further([0.99])


def test_auto_is_lossless_at_temperature_zero():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    greedy = SamplingParams(temperature=0.0)
    reference = generate_plain(FakeBackend(seed=0), prompt, 40, greedy, None)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(FakeBackend(seed=1), 0.0), CostAwarePolicy(GPU.copy(), has_draft_model=True))
    decoder = Decoder(FakeBackend(seed=0), drafter, lambda history, limit: limit)
    tokens = [e for e in decoder.generate(prompt, 40, greedy, np.random.default_rng(0))][-1].tokens
    assert tokens == reference


def test_loading_the_draft_model_at_its_first_use_is_not_a_cost_of_drafting(virtual_clock):
    """A draft model loaded when `auto` first consults it (a second here) would, were the load timed
    with its catch-up, make reading tokens look hundreds of times dearer on the learned curve, and
    count as a loss that retires the model at once: the load is a one-off, as it was at start."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1]
    reference = generate_plain(FakeBackend(seed=0), prompt, 40, greedy, None)

    def load(path, options):
        virtual_clock.now += 1.0
        return FakeBackend(seed=0, clock=virtual_clock, pass_seconds=BIG_GPU.catch_up)

    draft = DeferredBackend("draft.gguf", LoadOptions(n_gpu_layers=0), load=load)
    policy = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0, n_vocab=8), policy)
    target = FakeBackend(seed=0, clock=virtual_clock, pass_seconds=BIG_GPU.verify)
    events = list(Decoder(target, drafter, lambda history, limit: limit).generate(prompt, 40, greedy, np.random.default_rng(0)))
    assert events[-1].tokens == reference and draft.loaded
    assert policy.model_state == ACTIVE and policy.model_net > 0
    assert policy.costs.draft_seconds < 2 * BIG_GPU.draft_seconds and policy.costs.draft_token_seconds < 2 * BIG_GPU.draft_token_seconds


def test_long_bets_follow_the_curve_and_what_copying_has_saved():
    """On a steep CPU curve a fresh policy bets one token on a short match, and longer once n-gram
    drafts have saved time; on a flat GPU curve, where a wrong long draft costs little, long at once."""
    cpu = CostAwarePolicy(CPU_2.copy(), draft_max=15)
    assert cpu._bet_cap(2) == 1
    for _ in range(3):  # three copies of 8 tokens, each verified for what a batch of 9 costs
        cpu.observe("ngram", 8, 8, CPU_2.verify(9), cpu.ngram_keys(_proposal(2), 8))
    assert cpu._bet_cap(2) >= 8
    assert CostAwarePolicy(GPU.copy(), draft_max=31)._bet_cap(2) == 31


# A 2-core Zen 5's curve (single tokens a pass), measured: a batch of 16 is cheaper than 12 to 15 and 17.
DIPPED = CostModel({k: 0.048 * r for k, r in {1: 1.0, 2: 1.82, 4: 2.91, 8: 7.25, 12: 8.72, 15: 10.29, 16: 8.34, 17: 10.21, 24: 12.41, 32: 13.71}.items()}, draft_seconds=0.033)


def test_a_bet_may_take_a_cheap_size_beyond_a_dear_one():
    """What a bet may risk decides every length by its own cost: once copies have saved enough to
    risk a batch of 16, 15 drafted tokens may be bet even though 11 to 14 (batches of 12-15) cost more."""
    policy = CostAwarePolicy(DIPPED.copy(), draft_max=31)
    one = DIPPED.verify(1)
    policy.observe("ngram", 8, 8, 9 * one - 0.51 * (DIPPED.verify(16) - 2 * one), policy.ngram_keys(_proposal(2), 8))
    assert DIPPED.verify(16) - one <= one + 2 * policy.ngram_gain < DIPPED.verify(15) - one  # the bet covers 16, not 15
    assert policy._bet_cap(2) == 15
    assert len(policy.ngram_draft(_proposal(20))) == 15  # and a long copy is drafted to it


# An Apple M2 Max's shape for a 1.5B target (estimated from published figures): a batch of 8 costs 2.25 tokens.
SLOPED = CostModel({k: 0.02 * r for k, r in {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.25, 16: 3.0, 32: 3.0}.items()}, draft_seconds=0.013)


def test_bets_that_keep_failing_shrink_what_a_bet_may_risk():
    """Where a generation's matches keep failing (a short answer listing the prompt's headings) its
    bets shrink to single tokens, and copies that pay grow them again."""
    policy = CostAwarePolicy(SLOPED.copy(), draft_max=31)
    fresh = policy._bet_cap(2)
    assert fresh >= 4
    for _ in range(2):  # two bets of that length, wrong from their first token
        policy.observe("ngram", fresh, 0, SLOPED.verify(fresh + 1), policy.ngram_keys(_proposal(2), fresh))
    assert policy._bet_cap(2) == 1
    for _ in range(3):
        policy.observe("ngram", 8, 8, SLOPED.verify(9), policy.ngram_keys(_proposal(2), 8))
    assert policy._bet_cap(2) >= fresh


def test_what_a_bet_may_risk_rests_on_this_generations_copies():
    """A server's next request (a chat's next turn) starts with one pass of risk again: an earlier
    answer's copies say nothing of this one's matches. What was learned of acceptance carries over."""
    policy = CostAwarePolicy(CPU_2.copy(), draft_max=15)
    policy.begin(10)
    for _ in range(3):
        policy.observe("ngram", 8, 8, CPU_2.verify(9), policy.ngram_keys(_proposal(2), 8))
    assert policy._bet_cap(2) >= 8
    learned = policy.ngram_keys(_proposal(2), 1)[0].mean
    policy.begin(200)
    assert policy._bet_cap(2) == 1
    assert policy.ngram_keys(_proposal(2), 1)[0].mean == learned


def test_a_draft_cut_where_the_text_ends_teaches_no_rejection():
    """A server cuts a draft at the token where a stop string or an editor's short line ends the text:
    the draft model's tokens beyond the cut were never verified, so they count as neither right nor
    wrong; and a step that asked for no draft learns nothing of the one before it."""
    import types

    from specllm.engine.drafters import Draft

    model = types.SimpleNamespace(steps=0, catch_up_seconds=0.0)
    drafter = AutoDrafter(NgramDrafter(2, 4), model, CostAwarePolicy(GPU.copy(), has_draft_model=True))
    drafter._asked, drafter._model_drafted, drafter._model_from = True, 5, 1  # a copied token, then 5 of the model's
    before = (drafter.policy.draft_acceptance.accepted, drafter.policy.draft_acceptance.rejected)
    drafter.feedback(Draft([4, 5], None, "ngram"), 2, 0.001, 0.01, np.zeros((3, 8), dtype=np.float32))  # the text ends at the model's first
    after = drafter.policy.draft_acceptance
    assert (after.accepted - before[0], after.rejected - before[1]) == pytest.approx((1, 0))
    # The last step of a length-limited run has no room to draft, and the decoder asks for nothing:
    # the proposal before it (the model's 5 tokens, its load) must not be counted again.
    drafter._loading, net = 0.5, drafter.policy.model_net
    drafter.feedback(Draft([], None, "target"), 0, 0.0, 0.01, np.zeros((1, 8), dtype=np.float32))
    assert (after.accepted - before[0], after.rejected - before[1]) == pytest.approx((1, 0)) and drafter.policy.model_net == net


def test_an_ngram_followed_by_different_tokens_is_trusted_less():
    """A match whose n-gram was followed by different tokens before is drafted less than a unique one."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 3, 3, 0.122, span=6, rounds=3)
    assert len(policy.ngram_draft(_proposal(6))) > 0
    assert len(policy.ngram_draft(_proposal(6, seen=3, consistent=False))) == 0


def test_a_long_agreeing_span_is_drafted_long_at_once_a_short_one_is_not():
    """Copying shows as a long agreeing run: draft it long from the first proposal."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    assert len(policy.ngram_draft(_proposal(20, available=15))) >= 8
    # a short match risks at most one pass: on this curve a batch of 4 costs less than one of 3
    assert len(policy.ngram_draft(_proposal(2, available=15))) <= 3


def test_copies_that_end_early_do_not_shorten_drafts_deep_into_a_copy():
    """Continuation is learned by depth into the copy: phrases that run out after a token or two
    make short matches drafted short, but a copy that has agreed for 20 tokens is still drafted long."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 4, 1, 0.122, span=3, rounds=8)  # first token right, the second wrong
    assert len(policy.ngram_draft(_proposal(3, available=15))) <= 1
    assert len(policy.ngram_draft(_proposal(20, available=15))) >= 8
    _feed(policy, "ngram", 8, 2, 0.226, span=20, rounds=8)  # and when deep copies end early too
    assert len(policy.ngram_draft(_proposal(20, available=15))) <= 3


def test_a_deep_context_makes_long_drafts_dearer():
    """Attention makes every batch token cost more as the context grows: the same estimates buy a
    shorter draft after 8000 cached tokens than after 256."""
    deep_cpu = CostModel(dict(CPU.batch_seconds), CPU.draft_seconds, depth=256, context_seconds=6e-6)
    policy = CostAwarePolicy(deep_cpu, draft_max=15)
    acceptance = [0.95] + [0.9] * 14
    policy.context = 256
    shallow = policy.best_length(acceptance)
    policy.context = 8192
    assert 0 < policy.best_length(acceptance) < shallow


def test_a_copy_of_the_generations_own_output_is_trusted_less_than_a_copy_of_the_prompt():
    """The same long agreeing span is drafted when its source is the prompt, not when the model is
    repeating a phrase of its own (on a CPU such repeats ran on too rarely to pay)."""
    policy = CostAwarePolicy(CPU_2.copy(), draft_max=15)
    policy.output_start = 100
    from_prompt = NgramProposal(list(range(15)), 4, 12, source=40)
    from_output = NgramProposal(list(range(15)), 4, 12, source=120)
    assert len(policy.ngram_draft(from_prompt)) >= 3
    assert len(policy.ngram_draft(from_output)) == 0


def test_each_generation_marks_where_its_own_output_starts():
    """A chat's next turn: the previous reply is part of the prompt, so copying it is copying context."""
    drafter = AutoDrafter(NgramDrafter(1, 3), None, CostAwarePolicy(GPU.copy()))
    decoder = Decoder(FakeBackend(seed=0), drafter, lambda history, limit: limit)
    greedy, rng = SamplingParams(temperature=0.0), np.random.default_rng(0)
    first = [e for e in decoder.generate([1, 2, 3], 10, greedy, rng)][-1].tokens
    assert drafter.policy.output_start == 3
    follow_up = [1, 2, 3, *first, 4, 5]
    for _ in decoder.generate(follow_up, 10, greedy, rng):
        pass
    assert drafter.policy.output_start == len(follow_up)


def test_a_proposal_not_drafted_is_scored_against_what_was_committed():
    """On a steep curve a short match is not worth a draft at its prior; when plain steps keep
    committing exactly what it proposed, the policy learns the text is a copy and drafts it. Where
    they commit something else, it keeps declining."""
    copying, elsewhere = CostAwarePolicy(CPU_2.copy(), draft_max=15), CostAwarePolicy(CPU_2.copy(), draft_max=15)
    proposal = _proposal(3)
    assert copying.ngram_draft(proposal) == [] and elsewhere.ngram_draft(proposal) == []
    for _ in range(10):
        copying.observe_declined(copying.ngram_keys(proposal, 15), proposal.tokens, proposal.tokens[:1])
        elsewhere.observe_declined(elsewhere.ngram_keys(proposal, 15), proposal.tokens, [99])
    assert len(copying.ngram_draft(proposal)) > 0
    assert elsewhere.ngram_draft(proposal) == []


def test_what_a_plain_step_commits_scores_the_proposal_it_declined():
    """Through the drafter: the proposal declined at one step is scored by the token the next step sees."""
    policy = CostAwarePolicy(CPU_2.copy(), draft_max=15)
    drafter = AutoDrafter(NgramDrafter(2, 4), None, policy)
    history = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6]  # "5 6" was followed by 7 before: a short match
    drafter.start(history)
    assert drafter.propose(history, 15, SamplingParams(temperature=0.0), np.random.default_rng(0)) is None
    before = {key: (beta.accepted, beta.rejected) for key, beta in policy.ngram_estimates.first.items()}
    drafter.propose(history + [7], 15, SamplingParams(temperature=0.0), np.random.default_rng(0))
    gained = [key for key, beta in policy.ngram_estimates.first.items() if key in before and beta.accepted == before[key][0] + 1]
    assert gained and all(policy.ngram_estimates.first[key].rejected == before[key][1] for key in gained)


# Shaped like ../shared/machines/flat-gpu-synthetic.json: batches nearly flat, a draft step 0.35 of a
# pass, reading a token in a batch 0.011 of one.
FLAT = CostModel({k: 0.012 * (1 + 0.02 * (k - 1)) for k in (1, 2, 4, 8, 16, 32)}, draft_seconds=0.0042, draft_token_seconds=0.00013)


def test_a_few_unlucky_first_drafts_do_not_end_a_draft_model_that_may_pay():
    """Where the draft model pays at its prior, two rejected drafts leave it consulted (its acceptance
    is judged optimistically while its losses stay within the exploration budget)."""
    policy = CostAwarePolicy(FLAT.copy(), draft_max=31, has_draft_model=True)
    _start(policy, prompt_length=30)
    assert policy.plan(None, pending=30).source == "draft"
    policy.observe_model_use(30)
    for step in range(2):
        policy.observe("draft", 2, 0, 2 * FLAT.draft_seconds + FLAT.verify(3), [])
        policy.at_step(30 + step, 127 - step)
    assert policy.draft_acceptance.mean < 0.35  # the mean alone would no longer consult it
    assert policy.plan(None, pending=1).source == "draft"



# Shaped like tests/data/epyc-avx2-2core-7b-shaped-twin.json: a 7B target on 2 cores (a pass 0.21 s, a
# batch of 4 at 2.5 passes), the draft model's step 0.12 of a pass, its reading of a token 0.04.
SEVEN_B = CostModel({k: 0.208 * r for k, r in {1: 1.0, 2: 1.69, 3: 2.29, 4: 2.53, 8: 6.48, 16: 7.98, 32: 16.04}.items()},
                    draft_seconds=0.026, draft_token_seconds=0.0085)  # fmt: skip


def _plain_until_the_draft_model(policy, top: float, prompt_length=60, tokens=40) -> list[str]:
    """Plain steps, the target's top probability `top` on each token, until the draft model is first
    consulted: the draft model's standing before each step, then "draft" if it was consulted."""
    states = []
    for step in range(tokens):
        policy.at_step(prompt_length - 1 + step, 128 - step)
        states.append(policy.model_state)
        if policy.plan(None, pending=prompt_length + step).source == "draft":
            return [*states, "draft"]
        policy.observe(None, 0, 0, SEVEN_B.verify(1), [])
        if policy.wants_target_sureness:
            policy.observe_target_sureness([top])
    return states


def test_a_target_sure_of_itself_brings_in_a_draft_model_its_prior_would_leave_out():
    """On a 7B target's 2-core curve the draft model pays only near 0.8 acceptance: at its prior (0.6)
    never. Where the target is sure of its tokens (a top probability of 0.9: math and code, where the
    draft agrees 88-93% of the time) its prior is raised once SURE_TARGET_TOKENS show it, and it is
    consulted; where the target is unsure (0.6: translation, questions) it is retired then, not before."""
    n = priors.SURE_TARGET_TOKENS
    sure = CostAwarePolicy(SEVEN_B.copy(), draft_max=31, has_draft_model=True)
    _start(sure, prompt_length=60)
    states = _plain_until_the_draft_model(sure, 0.9)
    assert states == [COLD] * (n + 1) + ["draft"] and sure.sure_target
    unsure = CostAwarePolicy(SEVEN_B.copy(), draft_max=31, has_draft_model=True)
    _start(unsure, prompt_length=60)
    states = _plain_until_the_draft_model(unsure, 0.6)
    assert states[: n + 1] == [COLD] * (n + 1) and set(states[n + 1 :]) == {RETIRED} and not unsure.sure_target


def test_a_draft_model_consulted_on_the_targets_word_survives_two_unlucky_drafts():
    """Two drafts rejected at their first token cost 3 passes here, more than the exploration budget:
    a draft model consulted to explore is retired, one consulted because the target was sure is not."""
    def after_two_misses(top: float):
        policy = CostAwarePolicy(SEVEN_B.copy(), draft_max=31, has_draft_model=True)
        _start(policy, prompt_length=60)
        if top:
            _plain_until_the_draft_model(policy, top)
        else:
            policy.model_state = COLD  # consulted by exploration alone, as where its prior pays
        policy.observe_model_use(80)
        policy.observe("draft", 3, 3, SEVEN_B.catch_up(80) + 2 * SEVEN_B.draft_seconds + SEVEN_B.verify(4), [])  # its reading, then all accepted
        for _ in range(2):
            policy.at_step(100, 100)
            policy.observe("draft", 3, 0, 3 * SEVEN_B.draft_seconds + SEVEN_B.verify(4), [])
        policy.at_step(101, 99)
        policy.plan(None, pending=1)
        return policy.model_state

    assert after_two_misses(0.9) == ACTIVE
    assert after_two_misses(0.0) == RETIRED


def test_a_sure_draft_model_drafts_past_a_dear_batch_size_once_it_has_saved_enough():
    """On a 7B's 2-core curve a fourth drafted token makes the batch 0.89 passes dearer, while a batch
    of 16 costs less than one of 15: one token at a time, a draft accepted 98% of the time stops at 3.
    Looking further, it drafts on towards the cheap sizes, as far as what the draft model has saved
    lets a failed draft cost (nothing saved yet: one pass more than the batch it has)."""
    policy = CostAwarePolicy(SEVEN_B.copy(), draft_max=31, has_draft_model=True)
    _start(policy, prompt_length=60)
    assert not policy.worth_looking_further([0.98] * 3)
    policy.model_net = 10 * SEVEN_B.verify(1)  # ten passes saved
    assert policy.worth_looking_further([0.98] * 3)
    assert not policy.worth_looking_further([0.6] * 3)

def test_a_prior_raised_by_a_sure_target_does_not_carry_into_the_next_generation():
    """A chat's next turn starts from the draft model's own record, or from its prior where it has
    none: not from how sure the target was in the last turn."""
    policy = CostAwarePolicy(SEVEN_B.copy(), draft_max=31, has_draft_model=True)
    _start(policy, prompt_length=60)
    _plain_until_the_draft_model(policy, 0.95)
    assert policy.draft_acceptance.mean == priors.SURE_TARGET_DRAFT_PRIOR
    _start(policy, prompt_length=200)
    assert policy.draft_acceptance.mean == priors.DRAFT_PRIOR and not policy.sure_target
    policy.observe_model_use(200)
    policy.observe("draft", 4, 4, 0.5, [])
    learned = policy.draft_acceptance.mean
    _start(policy, prompt_length=300)
    assert policy.draft_acceptance.mean == learned
    assert not policy.wants_target_sureness  # its own record decides now: the target's softmaxes are not read


def test_the_targets_sureness_is_read_only_while_it_can_change_a_decision(monkeypatch):
    """The target's top probability costs a softmax over its vocabulary per committed token: read on
    the first SURE_TARGET_TOKENS tokens while a draft model is cold, where a raised prior would make
    it pay (a 7B on 2 cores); never without a draft model, nor where it could not pay at the raised
    prior either (a 1.5B on 2 cores: a draft step 0.65 of a pass, a batch of 2 at 1.87)."""
    reads = []
    monkeypatch.setattr(auto, "max_softmax", lambda row: reads.append(1) or 0.5)
    greedy, prompt = SamplingParams(temperature=0.0), [1, 2, 3, 4, 5, 6, 7, 1]
    cases = ((None, SEVEN_B, 0), (ModelDrafter(FakeBackend(seed=1), 0.0), SEVEN_B, priors.SURE_TARGET_TOKENS),
             (ModelDrafter(FakeBackend(seed=1), 0.0), CPU_2, 0))  # fmt: skip
    for model, curve, expected in cases:
        reads.clear()
        policy = CostAwarePolicy(curve.copy(), draft_max=16, has_draft_model=model is not None)
        decoder = Decoder(FakeBackend(seed=0), AutoDrafter(NgramDrafter(1, 3), model, policy), lambda history, limit: limit)
        tokens = list(decoder.generate(prompt, 60, greedy, np.random.default_rng(0)))[-1].tokens
        assert len(tokens) == 60 and len(reads) == expected

def _first_model_use(curve: CostModel, prompt_length: int, tokens: int = 128) -> int | None:
    """The step at which the draft model is first consulted, plain decoding until then."""
    policy = CostAwarePolicy(curve.copy(), draft_max=31, has_draft_model=True)
    _start(policy, prompt_length=prompt_length)
    for step in range(tokens):
        policy.at_step(prompt_length - 1 + step, tokens - step)
        if policy.plan(None, pending=prompt_length + step).source == "draft":
            return step
        policy.observe(None, 0, 0, curve.verify(1), [])
    return None


def test_a_long_prompt_is_read_only_once_the_generation_shows_it_is_long():
    """Reading a 700-token prompt costs the draft model several target passes: not at the first
    steps (a retrieval answer may end after 20 tokens), but once the generation has run long enough
    for the draft model to win the reading back over as many tokens again."""
    first_use = _first_model_use(FLAT, 700)
    assert first_use is not None and 10 <= first_use < 100


def test_an_answer_just_begun_is_expected_to_run_a_few_tokens():
    """At the first step nothing shows how long the answer will run, but it will run a few tokens
    (the shortest recorded answers run 13-20): with a 32B target the draft model reads a 500-token
    prompt at once, since it wins that back within a dozen tokens, and a 3000-token one only once
    the answer has run."""
    assert _first_model_use(BIG_GPU, 500) == 0
    assert 10 <= _first_model_use(BIG_GPU, 3000) < 100


# Shaped like ../shared/machines/gpu-rtx3090-32b-estimated.json: a 32B target whose batches are nearly
# flat, a 0.5B draft step 0.09 of its pass.
BIG_FLAT = CostModel({k: 0.0294 * (1 + 0.01 * (k - 1)) for k in (1, 2, 4, 8, 16, 32)}, draft_seconds=0.0026, draft_token_seconds=0.0001)


def _in_use(policy, drafts=4, accepted=8):
    """The draft model consulted at the first step, then `drafts` drafts of 8 with `accepted` accepted."""
    _start(policy, prompt_length=30)
    assert policy.plan(None, pending=30).source == "draft"
    policy.observe_model_use(30)
    for step in range(drafts):
        policy.observe("draft", 8, accepted, 8 * BIG_FLAT.draft_seconds + BIG_FLAT.verify(9), [], model_drafted=8)
        policy.at_step(30 + 9 * (step + 1), 120 - 9 * step)


def test_while_the_draft_model_is_in_use_both_sources_are_weighed_by_the_same_worth():
    """With a good draft model in use, a match that has been followed by different tokens before
    (a guess among several) loses to it; a copy in progress of text the generation keeps copying
    wins; and a short sure copy is continued by the draft model in the same batch."""
    policy = CostAwarePolicy(BIG_FLAT.copy(), draft_max=31, has_draft_model=True)
    _in_use(policy)
    assert policy.plan(_proposal(3, seen=3, consistent=False), pending=1).source == "draft"
    _feed(policy, "ngram", 16, 16, BIG_FLAT.verify(17), span=32, rounds=6)
    copy = policy.plan(_proposal(32), pending=1)
    assert copy.source == "ngram" and len(copy.ngram_keys) >= 16
    short = policy.plan(_proposal(32, available=2), pending=1)
    assert short.source == "ngram" and len(short.ngram_keys) == 2 and short.then_model and short.draft_tokens > 0


def test_a_draft_model_that_drafts_poorly_leaves_the_choice_to_the_ngram_cache():
    policy = CostAwarePolicy(BIG_FLAT.copy(), draft_max=31, has_draft_model=True)
    _in_use(policy, drafts=3, accepted=1)
    _feed(policy, "ngram", 16, 16, BIG_FLAT.verify(17), span=32, rounds=6)
    plan = policy.plan(_proposal(32), pending=1)
    assert plan.source == "ngram" and not plan.then_model


def test_past_the_end_of_a_sentence_a_copy_runs_on_by_what_the_generation_shows():
    """Token 7 ends a sentence. Where copies stopped there (an extractive summary leaving its
    source), a copy is drafted through the sentence's end and no further; where they ran on (code
    with comments), past it; a policy that cannot tell sentences apart learns only that its copies
    end somewhere around there, and drafts short."""
    def after(copies_cross: bool, sentence_end=lambda token: token == 7) -> int:
        policy = CostAwarePolicy(DIPPED.copy(), draft_max=31, sentence_end=sentence_end)
        for _ in range(4):
            policy.observe("ngram", 12, 12 if copies_cross else 8, DIPPED.verify(13), policy.ngram_keys(_proposal(20), 12))
        return len(policy.ngram_draft(_proposal(20)))

    assert after(copies_cross=False) == 8
    assert after(copies_cross=True) == 31
    assert after(copies_cross=False, sentence_end=lambda token: False) < 8


def test_a_copy_that_starts_as_a_sentence_begins_is_judged_by_how_copies_ran_on_past_sentence_ends():
    """A copy agreeing for 32 tokens whose next sentence has just begun (an extractive summary at
    the point where it may leave its source): where copies stopped at sentence ends, it is drafted
    short or not at all, not as the long copy its span suggests; where they ran on (code with
    comments), as long as the same copy inside a sentence."""
    def drafted(copies_cross: bool, sentence_start: bool) -> int:
        policy = CostAwarePolicy(DIPPED.copy(), draft_max=31, sentence_end=lambda token: token == 7)
        for _ in range(4):
            policy.observe("ngram", 12, 12 if copies_cross else 8, DIPPED.verify(13), policy.ngram_keys(_proposal(20), 12))
        for _ in range(4):  # long copies inside sentences were accepted whole
            policy.observe("ngram", 6, 6, DIPPED.verify(7), policy.ngram_keys(_proposal(32, available=6), 6))
        proposal = NgramProposal(list(range(10, 41)), 4, 32, sentence_start=sentence_start)  # no sentence end inside
        return len(policy.ngram_draft(proposal))

    assert drafted(copies_cross=True, sentence_start=False) == drafted(copies_cross=True, sentence_start=True) == 31
    assert drafted(copies_cross=False, sentence_start=True) <= 3 < 15 <= drafted(copies_cross=False, sentence_start=False)
