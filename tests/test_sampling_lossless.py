"""Losslessness above temperature 0 under every sampler option a user can set.

The options are those of `SamplingParams`, which the command line (`--temp`, `--top-k`, `--top-p`,
`--min-p`, `--seed`), the chat's `/set`, the server's request fields and the Python API all fill
(the server ignores penalties, `logit_bias` and `response_format`: nothing of theirs reaches the
sampler). For each, on a fake target and a fake draft model of other logits, the first three
tokens' joint distribution under speculative decoding is the target's, computed exactly; with a
seed, n-gram drafts leave the text plain decoding's; and the edges (top-k 1, top-p 0, min-p near
1, the target filtering out the drafted token, p == q, a vanishing temperature) hold too.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest

from specllm.engine.auto import AutoDrafter
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder, Done, StepDone, fixed_budget, generate_plain
from specllm.engine.drafters import ModelDrafter, NgramDrafter
from specllm.engine.policy import CostAwarePolicy
from specllm.engine.sampling import InvalidSampling, SamplingParams, argmax, draw, sample, warp
from specllm.engine.verify import residual, verify, verify_sampled
from tests.fakes import FakeBackend
from tests.lossless_helpers import make_drafter, repeating_prompt, sequence_distribution, tiny_models  # noqa: F401 - fixtures
from tests.stat_helpers import chi_square_pvalue, exact_distribution

V, LENGTH = 5, 3
PROMPT = [1, 2, 1, 2, 1]  # repeats: the n-gram cache drafts from it
SAMPLES = 6000
# `auto` plans by this GPU-like curve on the virtual clock it prices, so it drafts from both sources (as in test_decode.py)
AUTO_COSTS = CostModel({k: 0.01 + 0.0001 * k for k in (1, 2, 4, 8, 16)}, draft_seconds=0.001, draft_token_seconds=0.0001)


def _params(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


# Each option alone, its edges, and together (the defaults: top-k 40 is more than the fake's 5 tokens)
OPTIONS = {
    "temperature 0.5": _params(0.5),
    "temperature 1.7": _params(1.7),
    "top-k 2": _params(top_k=2),
    "top-k 1": _params(top_k=1),
    "top-p 0.6": _params(top_p=0.6),
    "top-p 0": _params(top_p=0.0),
    "top-p tiny": _params(top_p=1e-9),
    "min-p 0.3": _params(min_p=0.3),
    "min-p 0.999": _params(min_p=0.999),
    "defaults": SamplingParams(),
    "all together": _params(1.3, top_k=4, top_p=0.8, min_p=0.1),
}
FAST = {"top-k 1", "all together"}  # the rest in the full suite


def _cases():
    for name, params in OPTIONS.items():
        marks = () if name in FAST else (pytest.mark.slow,)
        yield pytest.param(params, id=name, marks=marks)


def _exact_distribution(params: SamplingParams) -> dict:
    """The target's own distribution of its first LENGTH tokens after PROMPT, by enumeration."""
    return exact_distribution(FakeBackend(n_vocab=V, seed=0), PROMPT, LENGTH, params)


def _drafter(kind: str, clock):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    draft = FakeBackend(n_vocab=V, seed=1, clock=clock, pass_seconds=AUTO_COSTS.catch_up)  # other logits: rejections happen
    if kind == "draft":
        return ModelDrafter(draft, p_min=0.0)
    return AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0), CostAwarePolicy(AUTO_COSTS.copy(), has_draft_model=True))


def _sample(kind: str, params: SamplingParams, clock, samples: int):
    target = FakeBackend(n_vocab=V, seed=0, clock=clock, pass_seconds=AUTO_COSTS.verify)
    decoder = Decoder(target, _drafter(kind, clock), fixed_budget(LENGTH))
    rng = np.random.default_rng(4)
    sequences, outcomes, drafted_at = [], Counter(), Counter()
    for _ in range(samples):
        for event in decoder.generate(PROMPT, LENGTH, params, rng):
            if isinstance(event, StepDone) and event.drafted:
                outcomes["accepted"] += event.accepted
                outcomes["rejected"] += event.accepted < event.drafted
                drafted_at[event.source] += event.drafted
            elif isinstance(event, Done):
                sequences.append(tuple(event.tokens))
    return sequences, outcomes, drafted_at


def _check(sequences, expected: dict) -> None:
    if len(expected) == 1:  # a filter leaves one token a position: that one sequence, every time
        assert set(sequences) == set(expected)
    else:
        assert chi_square_pvalue(sequences, expected) > 1e-4


@pytest.mark.parametrize("kind", ["draft", "ngram", "auto"])
@pytest.mark.parametrize("params", list(_cases()))
def test_sampled_sequences_follow_the_target_under_each_option(kind, params, virtual_clock):
    """The first three tokens jointly, drafts covering them, are distributed as the target's own
    under each option; drafted tokens were both kept and rejected (a check over sequences that no
    draft touched would prove nothing; where a filter leaves one token a position, drafts at least)."""
    expected = _exact_distribution(params)
    one = len(expected) == 1
    sequences, outcomes, drafted_at = _sample(kind, params, virtual_clock, 400 if one else SAMPLES)
    assert sum(drafted_at.values()) >= 100 and (one or min(outcomes["accepted"], outcomes["rejected"]) >= 50), outcomes
    if kind == "auto" and not one:  # where the text is certain, copies are never rejected: auto rightly stays with them
        assert drafted_at["draft"] >= 20 and drafted_at["ngram"] >= 20, drafted_at
    _check(sequences, expected)


@pytest.mark.parametrize("params", list(_cases()))
def test_a_seeded_text_is_plain_decodings_whatever_the_ngram_cache_drafts(params):
    """With a seed, n-gram drafts (one-hot: kept when the target's own draw at their position is
    them) leave the text plain decoding's, under each option (README: `--seed`)."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for seed in range(6):
        reference = generate_plain(FakeBackend(seed=0), prompt, 40, params, np.random.default_rng(seed))
        decoder = Decoder(FakeBackend(seed=0), NgramDrafter(1, 3), fixed_budget(4))
        events = list(decoder.generate(prompt, 40, params, np.random.default_rng(seed)))
        assert events[-1].tokens == reference
        assert sum(e.drafted for e in events if isinstance(e, StepDone)) > 0


def test_a_draft_of_another_warping_still_commits_the_target_distribution():
    """Rejection sampling needs the drafted token to be a sample of the q it reports, not q to be
    warped as p is: a draft at another temperature, unfiltered, against a target at top-k 1, top-p
    tiny or min-p near 1 commits the target's row exactly (enumerated, no sampling)."""
    rng = np.random.default_rng(2)
    for target_params in (_params(top_k=1), _params(top_p=1e-9), _params(0.7, min_p=0.95), _params(0.4, top_k=2, top_p=0.5)):
        for _ in range(50):
            p_row = warp(rng.normal(size=V) * 3, target_params)
            q_row = warp(rng.normal(size=V) * 3, _params(2.0))
            committed = np.zeros(V)
            for x in range(V):  # x drafted with probability q(x), kept with min(1, p/q), else the residual
                keep = min(1.0, p_row[x] / q_row[x])
                committed[x] += q_row[x] * keep
                committed += q_row[x] * (1.0 - keep) * residual(p_row, q_row, x)
            np.testing.assert_allclose(committed, p_row, rtol=0, atol=1e-12)


def test_a_drafted_token_the_target_filters_out_is_always_rejected():
    """A drafted token the target's filters cut (top-k 1 here, as a logit bias banning it would) has
    p = 0: it is never kept, and the token committed instead is the target's."""
    target_logits = np.array([[0.0, 3.0, 1.0, 2.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = _params(top_k=1)
    q_row = warp(np.array([3.0, 0.0, 1.0, 2.0, -1.0]), _params())  # the draft likes token 0 best
    for key in range(300):
        streams = lambda i, key=key: np.random.default_rng([key, i])  # noqa: E731
        verdict = verify(target_logits, [0], [q_row], params, streams)
        assert (verdict.accepted, verdict.token) == (0, 1)
        verdict = verify(target_logits, [0], None, params, streams)  # an n-gram's token: one-hot q
        assert (verdict.accepted, verdict.token) == (0, 1)


def test_a_draft_equal_to_the_target_is_always_kept():
    """p == q: min(1, p/q) is 1 for every drafted token, so the all-zero residual is never drawn from."""
    rng = np.random.default_rng(9)
    for _ in range(300):
        p_target = warp(rng.normal(size=(4, V)) * 2, _params(0.9, min_p=0.2))
        tokens = [sample(row, rng) for row in p_target[:3]]
        verdict = verify_sampled(p_target, tokens, list(p_target[:3]), lambda i: rng)
        assert verdict.accepted == 3
    p_row = p_target[0]
    assert np.array_equal(residual(p_row, p_row, int(np.argmax(p_row))), p_row)  # all zeros: p stands in


# -- a vanishing temperature, the Python API ------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 1e-320, 5e-324])
def test_a_vanishing_temperature_is_the_greedy_limit(temperature):
    """Above 0 but so small that a logit over it overflows (under ~1e-307): all the mass on the best
    logit, split evenly between ties, as temperatures a little larger give it. (Was NaN: `--temp
    1e-310` ended in "unexpected ValueError: attempt to get argmax of an empty sequence".)"""
    params = _params(temperature)
    for row in (np.array([1.0, 3.0, -2.0, 3.0], dtype=np.float32), np.array([-1.0, -3.0, -2.0, -5.0], dtype=np.float32)):
        expected = warp(row, _params(1e-3))
        np.testing.assert_array_equal(warp(row, params), expected)
        for seed in range(20):
            assert expected[draw(row, params, np.random.default_rng(seed))] > 0


def test_a_vanishing_temperature_speculates_the_greedy_text():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    greedy = generate_plain(FakeBackend(seed=0), prompt, 30, SamplingParams(temperature=0.0), None)
    for drafter in (NgramDrafter(1, 3), ModelDrafter(FakeBackend(seed=1), 0.0)):
        decoder = Decoder(FakeBackend(seed=0), drafter, fixed_budget(4))
        events = list(decoder.generate(prompt, 30, _params(1e-310), np.random.default_rng(0)))
        assert events[-1].tokens == greedy


def test_a_low_temperature_draws_without_numpy_warnings():
    """At --temp 0.001 with top-p and min-p off, survivors' probabilities underflow to 0: the draw
    never takes them, and says nothing on stderr (numpy's "divide by zero encountered in log" did)."""
    row = np.zeros(1000, dtype=np.float32)
    row[:5] = [10.0, 9.0, 1.0, 0.5, 0.2]
    params = _params(0.001, top_k=40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(20):
            assert draw(row, params, np.random.default_rng(seed)) == argmax(row)
            assert sample(warp(row, params), np.random.default_rng(seed)) == argmax(row)
            assert warp(row, _params(1e-310))[0] == 1.0


@pytest.mark.parametrize(
    "params, field",
    [(_params(-1.0), "temperature"), (_params(float("nan")), "temperature"), (_params(top_p=1.5), "top_p"), (_params(min_p=1.0), "min_p")],
    ids=["negative temperature", "NaN temperature", "top-p over 1", "min-p 1"],
)
def test_the_python_api_refuses_sampling_values_out_of_range(params, field):
    """What the command line and the server refuse, `Decoder.generate` refuses too (a negative
    temperature sampled the least likely tokens first, silently)."""
    decoder = Decoder(FakeBackend(seed=0), NgramDrafter(1, 3), fixed_budget(4))
    with pytest.raises(InvalidSampling) as caught:
        list(decoder.generate([1, 2, 3], 8, params, np.random.default_rng(0)))
    assert caught.value.field == field


def test_the_python_api_samples_without_a_generator():
    """`rng` None above temperature 0 with a draft model: a fresh generator (the draft model's
    sampling failed with "'NoneType' object has no attribute 'random'")."""
    decoder = Decoder(FakeBackend(seed=0), ModelDrafter(FakeBackend(seed=1), 0.0), fixed_budget(3))
    events = list(decoder.generate([1, 2, 3], 12, _params(0.8), None))
    assert len(events[-1].tokens) == 12
    assert sum(e.drafted for e in events if isinstance(e, StepDone)) > 0


# -- through llama.cpp: every filter at once on the tiny GGUF pair --------------------------------


@pytest.mark.parametrize("kind", ["draft", "ngram+draft"])
def test_llama_cpp_rows_under_every_filter_follow_the_target(tiny_models, repeating_prompt, kind):  # noqa: F811
    """test_lossless_real.py checks top-k alone through llama.cpp; here temperature, top-k, top-p
    and min-p all cut the target's and the draft model's rows, a batch's rows against one token's."""
    target, draft, truth = tiny_models
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.8, min_p=0.1)
    expected = sequence_distribution(truth, repeating_prompt, 2, params)
    decoder = Decoder(target, make_drafter(kind, draft, target.n_vocab), fixed_budget(4))
    rng = np.random.default_rng(99)
    outcomes, steps = [], Counter()
    for _ in range(2000):
        for event in decoder.generate(repeating_prompt, 2, params, rng):
            if isinstance(event, StepDone) and event.drafted:
                steps["kept"] += event.accepted
                steps["rejected"] += event.accepted < event.drafted
            elif isinstance(event, Done):
                outcomes.append(tuple(event.tokens))
    assert len(expected) > 3 and min(steps["kept"], steps["rejected"]) >= 100, (len(expected), steps)
    assert chi_square_pvalue(outcomes, expected) > 1e-3
