"""The cost-aware policy on synthetic cost curves and acceptance sequences."""

import numpy as np

from specllm.costmodel import CostModel
from specllm.decode import Decoder, generate_plain
from specllm.drafters import Draft, ModelDrafter, NgramDrafter
from specllm.policy import AutoDrafter, CostAwarePolicy
from specllm.sampling import SamplingParams
from tests.fakes import FakeBackend

GPU = CostModel({k: 0.010 + 0.0001 * k for k in (1, 2, 4, 8, 16, 32)}, draft_seconds=0.002)
# CPU-like: measured shape for a 1.5B model on 2 cores, with a cheap batch of 5.
CPU = CostModel({1: 0.073, 2: 0.107, 3: 0.13, 4: 0.122, 5: 0.153, 8: 0.226, 16: 0.27}, draft_seconds=0.034)


def _feed(policy, source, drafted, accepted, seconds, match_length=4, rounds=1):
    for _ in range(rounds):
        estimate = policy.ngram_estimate(match_length)
        policy.observe(Draft([0] * drafted, None, source, match_length), accepted, seconds, [estimate] * drafted)


def test_flat_verification_cost_drafts_long():
    policy = CostAwarePolicy(GPU.copy(), draft_max=31)
    _feed(policy, "ngram", 8, 6, 0.011, rounds=5)
    assert policy.ngram_length(31, 4) >= 16


def test_steep_cost_and_poor_acceptance_stop_drafting():
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 2, 0, 0.107, rounds=6)
    assert policy.ngram_length(15, 4) == 0


def test_cheap_batch_size_is_exploited():
    """On this curve a batch of 4 costs less than one of 3, so drafting 2 tokens is never best:
    whatever the acceptance, 3 drafted tokens (batch 4) do better for less."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    chosen = {policy.best_length([a] * 15, 0.0) for a in np.linspace(0.05, 0.99, 60)}
    assert 2 not in chosen
    assert 3 in chosen  # the cheap size is used for middling acceptance
    assert 0 in chosen and 15 in chosen  # and the extremes: no draft, the longest draft


def test_recovers_when_acceptance_returns():
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    _feed(policy, "ngram", 2, 0, 0.107, rounds=6)
    assert policy.ngram_length(15, 4) == 0
    policy.last_full = True
    for _ in range(4):  # the "after a full accept" estimate learns independently and quickly
        estimate = policy.ngram_estimate(4)
        estimate.observe(8, False)
    assert policy.ngram_length(15, 4) > 0


def test_draft_model_backs_off_when_it_does_not_pay_and_retries_later():
    policy = CostAwarePolicy(CPU.copy())
    for _ in range(3):
        policy.observe(Draft([1, 2], None, "draft"), 0, 0.034 * 2 + 0.107, [policy.confidence_estimate(0.5)] * 2)
    assert not policy.consult_draft()
    skipped = 1
    while not policy.consult_draft():
        skipped += 1
    assert 1 <= skipped <= 64


def test_draft_length_stops_where_it_no_longer_pays():
    policy = CostAwarePolicy(CPU.copy())
    assert policy.worth_drafting_more([], 0.95)
    assert not policy.worth_drafting_more([], 0.2)
    assert not policy.worth_drafting_more([0.5] * 6, 0.5)


def test_auto_is_lossless_at_temperature_zero():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    greedy = SamplingParams(temperature=0.0)
    reference = generate_plain(FakeBackend(seed=0), prompt, 40, greedy, None)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(FakeBackend(seed=1), 0.0), CostAwarePolicy(GPU.copy()))
    decoder = Decoder(FakeBackend(seed=0), drafter, lambda history, limit: limit)
    tokens = [e for e in decoder.generate(prompt, 40, greedy, np.random.default_rng(0))][-1].tokens
    assert tokens == reference


def test_draft_model_is_not_consulted_where_it_cannot_pay():
    """A draft step at 69% of a target pass with batches near k times one token (measured on a
    2-core CPU) cannot beat plain decoding even at 100% acceptance; on a GPU-like curve it can."""
    cpu = CostModel({1: 0.032, 2: 0.057, 4: 0.098, 8: 0.228, 16: 0.262}, draft_seconds=0.022)
    assert not CostAwarePolicy(cpu).draft_model_can_pay()
    assert not CostAwarePolicy(cpu).consult_draft()
    assert CostAwarePolicy(GPU.copy()).draft_model_can_pay()


def test_failing_proposals_are_retried_ever_more_rarely_and_success_resets():
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    tries = []
    for step in range(600):
        k = policy.ngram_length(8, 3)
        if k:
            tries.append(step)
            estimate = policy.ngram_estimate(3)
            policy.observe(Draft([0] * k, None, "ngram", 3), 0, 0.107, [estimate] * k)
    assert 3 <= len(tries) <= 10  # first tries, then after 8, 16, 32, ... declined proposals
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps)
    policy.observe(Draft([0], None, "ngram", 3), 1, 0.057, [policy.ngram_estimate(3)])
    assert policy.explore_every == 8


def test_a_long_agreeing_span_is_drafted_long_at_once_a_short_one_is_not():
    """Copying shows as a long agreeing run: draft it long from the first proposal."""
    policy = CostAwarePolicy(CPU.copy(), draft_max=15)
    assert policy.ngram_length(15, 20) >= 8
    assert policy.ngram_length(15, 2) <= 1
