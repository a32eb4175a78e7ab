"""Losslessness of the verification step under stress (hypothesis).

For random target/draft logits, vocabulary sizes, warping settings (temperature, top-k, top-p,
min-p applied to both, as the decoder does) and draft lengths, the distribution of each token
the step commits is computed EXACTLY from the acceptance rule and `residual` (no sampling) and
compared with the target's row to 1e-9. A scripted random source ties that arithmetic to what
`verify_sampled` actually does with its uniforms; one sampled run closes the loop.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specllm.engine.sampling import SamplingParams, sample, warp
from specllm.engine.verify import Verdict, residual, verify_sampled
from tests.stat_helpers import chi_square_pvalue

EXACT = 1e-9
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, one_hot: bool = False):
    """(p_target (k+1, V), q_draft (k, V) or None, draft tokens, params)."""
    vocab = draw(st.integers(2, 40))
    k = draw(st.integers(0, 5))
    params = SamplingParams(
        temperature=draw(st.floats(0.05, 3.0)),
        top_k=draw(st.integers(0, vocab + 2)),
        top_p=draw(st.floats(0.05, 1.0)),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.9))),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.floats(0.1, 8.0))
    target = rng.normal(size=(k + 1, vocab)) * scale
    relation = draw(st.sampled_from(["independent", "close", "equal"]))
    draft = {
        "independent": rng.normal(size=(k, vocab)) * scale,
        "close": target[:k] + rng.normal(size=(k, vocab)) * 0.1,
        "equal": target[:k].copy(),
    }[relation]
    if draw(st.booleans()):  # tokens one model cannot produce at all (llama.cpp gives -inf for them)
        target[rng.random(target.shape) < 0.2] = -np.inf
        draft[rng.random(draft.shape) < 0.2] = -np.inf
        target[:, rng.integers(vocab)] = 0.0  # every row keeps at least one finite logit
        draft[:, rng.integers(vocab)] = 0.0
    p_target = warp(target, params)
    if one_hot:  # an n-gram draft: fixed tokens, q one-hot; the target may give them probability 0
        return p_target, None, [draw(st.integers(0, vocab - 1)) for _ in range(k)], params
    q_draft = warp(draft, params) if k else np.zeros((0, vocab))
    tokens = [int(rng.choice(vocab, p=q_draft[i])) for i in range(k)]
    return p_target, q_draft, tokens, params


def committed_distribution(p_row: np.ndarray, q_row: np.ndarray | None, drafted: int | None) -> np.ndarray:
    """Exact distribution of the token committed at one position, by enumerating the rule.

    Model draft: the drafted token x ~ q_row, kept with probability min(1, p(x)/q(x)), else the
    token comes from residual(p, q, x). One-hot draft: x is fixed and q(x) = 1 (the code keeps x
    when the target's own draw y ~ p_row is x: with probability p(x), else y falls in p off x,
    residual(p, None, x)). No draft left: the bonus token, sampled from p_row itself.
    """
    if drafted is None:
        return p_row.copy()
    out = np.zeros_like(p_row)
    weights = {drafted: 1.0} if q_row is None else {int(x): float(q_row[x]) for x in np.flatnonzero(q_row)}
    for x, weight in weights.items():
        q_x = 1.0 if q_row is None else q_row[x]
        keep = min(1.0, p_row[x] / q_x)
        out[x] += weight * keep
        if keep < 1.0:
            out += weight * (1.0 - keep) * residual(p_row, q_row, x)
    return out


def check_every_position(p_target, q_draft, tokens) -> None:
    """Given the drafted prefix was accepted, each position commits a token distributed as p_target's row."""
    for i in range(len(tokens) + 1):
        drafted = tokens[i] if i < len(tokens) else None
        q_row = None if q_draft is None or drafted is None else q_draft[i]
        exact = committed_distribution(p_target[i], q_row, drafted)
        assert np.all(exact >= -EXACT)
        np.testing.assert_allclose(exact, p_target[i], rtol=0, atol=EXACT, err_msg=f"position {i}")


@SETTINGS
@given(cases())
def test_model_draft_commits_the_target_distribution_exactly(case):
    p_target, q_draft, tokens, _ = case
    check_every_position(p_target, q_draft, tokens)


@SETTINGS
@given(cases(one_hot=True))
def test_one_hot_draft_commits_the_target_distribution_exactly(case):
    p_target, _, tokens, _ = case
    check_every_position(p_target, None, tokens)


@SETTINGS
@given(cases(), st.booleans())
def test_residual_is_a_distribution_off_the_rejected_token(case, one_hot):
    p_target, q_draft, tokens, _ = case
    assume(tokens)
    q_row = None if one_hot else q_draft[0]
    res = residual(p_target[0], q_row, tokens[0])
    assert np.all(res >= 0) and abs(res.sum() - 1.0) < EXACT
    if one_hot and p_target[0][tokens[0]] < 1.0:
        assert res[tokens[0]] == 0.0  # a rejected n-gram token is never the resample
    # residual mass only where the target has more than the draft
    if q_row is not None and not np.allclose(p_target[0], q_row, atol=0):
        assert np.all(res[p_target[0] <= q_row] == 0.0)


class ScriptedRng:
    """Hands out the given uniforms in order, as `numpy.random.Generator.random` would."""

    def __init__(self, uniforms):
        self.uniforms = list(uniforms)

    def random(self) -> float:
        return self.uniforms.pop(0)


def drawn(probs: np.ndarray, u: float) -> int:
    """The token `sample` draws from `probs` with the uniform u (its exactness is test_sampling.py's)."""
    return sample(probs, ScriptedRng([u]))


@SETTINGS
@given(cases(), st.booleans(), st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.floats(0.0, 1.0, exclude_max=True)), min_size=6, max_size=6))
def test_verify_sampled_follows_the_enumerated_rule(case, one_hot, uniforms):
    """With scripted uniforms, two for each row i (u_i, v_i): keep drafted model token i iff
    u_i * q_i(x_i) < p_i(x_i), else the resample is v_i's draw from the residual (`sample`);
    keep one-hot token i iff u_i's draw from p_i is x_i, else that draw; the bonus is
    u_k's pick from the last row. This is the rule `committed_distribution` enumerates (for one-hot
    tokens the pick is y with probability p(y)), so its exactness carries over to the code."""
    p_target, q_draft, tokens, _ = case
    if one_hot:
        q_draft = None
    verdict = verify_sampled(p_target, tokens, q_draft, lambda i: ScriptedRng(uniforms[i]))
    for i, x in enumerate(tokens):
        u, v = uniforms[i]
        if q_draft is None:
            pick = drawn(p_target[i], u)
            if pick != x:
                assert verdict == Verdict(i, pick)
                return
        elif not u * q_draft[i, x] < p_target[i][x]:
            assert verdict == Verdict(i, drawn(residual(p_target[i], q_draft[i], x), v))
            return
    assert verdict == Verdict(len(tokens), drawn(p_target[len(tokens)], uniforms[len(tokens)][0]))


def test_sampled_first_tokens_follow_the_target():
    """One sampled check, with warping on both sides and a 4-token draft from a disagreeing model."""
    rng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02)
    vocab, k = 24, 4
    p_target = warp(rng.normal(size=(k + 1, vocab)) * 2.0, params)
    q_draft = warp(rng.normal(size=(k, vocab)) * 2.0, params)
    firsts = []
    for _ in range(20000):
        tokens = [sample(q_draft[i], rng) for i in range(k)]
        verdict = verify_sampled(p_target, tokens, q_draft, lambda i: rng)
        firsts.append(tokens[0] if verdict.accepted else verdict.token)
    assert chi_square_pvalue(firsts, dict(enumerate(p_target[0]))) > 1e-4
