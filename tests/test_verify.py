import numpy as np
import pytest

from specllm.engine.sampling import SamplingParams, sample
from specllm.engine.verify import residual, verify, verify_greedy, verify_sampled
from tests.stat_helpers import chi_square_pvalue


def _dist(rng, v, zeros=0):
    p = rng.random(v) ** 3
    p[rng.choice(v, zeros, replace=False)] = 0.0
    return p / p.sum()


def test_greedy_accepts_longest_matching_prefix():
    logits = np.eye(5)[[2, 3, 0, 4]] * 10  # the target's argmax per row: 2, 3, 0, 4
    assert verify_greedy(logits, [2, 3, 1]) == verify_greedy(logits, [2, 3, 1])
    verdict = verify_greedy(logits, [2, 3, 1])
    assert (verdict.accepted, verdict.token) == (2, 0)
    verdict = verify_greedy(logits, [2, 3, 0])
    assert (verdict.accepted, verdict.token) == (3, 4)  # all accepted: the bonus token
    verdict = verify_greedy(logits, [])
    assert (verdict.accepted, verdict.token) == (0, 2)


def test_residual_by_token_id():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.6, 0.2])
    assert np.allclose(residual(p, q, 1), [1.0, 0.0, 0.0])
    assert np.allclose(residual(p, None, 0), [0.0, 0.6, 0.4])


@pytest.mark.parametrize("case", ["disagree", "agree", "one-hot", "sparse"])
def test_first_token_is_distributed_as_target(case):
    """Whatever the draft, the first committed token follows p_target's first row exactly."""
    rng = np.random.default_rng(7)
    v, k = 6, 3
    p_target = np.vstack([_dist(rng, v, zeros=2 if case == "sparse" else 0) for _ in range(k + 1)])
    q_draft = {"agree": p_target[:k], "one-hot": None}.get(case)
    if case in ("disagree", "sparse"):
        q_draft = np.vstack([_dist(rng, v, zeros=2 if case == "sparse" else 0) for _ in range(k)])
    fixed = [int(np.argmin(p_target[0])), 1, 2]  # one-hot: a draft the target rarely picks
    samples = []
    for _ in range(30000):
        draft = fixed if q_draft is None else [sample(q_draft[i], rng) for i in range(k)]
        verdict = verify_sampled(p_target, draft, q_draft, lambda i: rng)
        samples.append(draft[0] if verdict.accepted else verdict.token)
    expected = dict(enumerate(p_target[0]))
    assert chi_square_pvalue(samples, expected) > 1e-4


def test_copied_tokens_are_verified_by_plain_decodings_draw_at_their_position():
    """An n-gram copy (one-hot: its rows are None in q_draft, not 1.2 MB of zeros each), alone, after
    the draft model's tokens or before them: at every copied position the committed token is the
    target's own draw there, the one plain decoding makes from the same row with the same stream,
    so a copy decides nothing about the text. Model tokens keep rejection sampling."""
    rng = np.random.default_rng(11)
    v = 8
    for layout in ("copy", "copy-then-model", "model-then-copy"):
        for trial in range(400):
            p_target = np.vstack([_dist(rng, v, zeros=trial % 3) for _ in range(6)])
            model_rows = [_dist(rng, v) for _ in range(2)]
            copy = [int(t) for t in rng.integers(0, v, 3)]
            sampled = [sample(row, rng) for row in model_rows]
            tokens, listed = {
                "copy": (copy, None),
                "copy-then-model": (copy + sampled, [None] * 3 + model_rows),
                "model-then-copy": (sampled + copy, model_rows + [None] * 3),
            }[layout]
            key = int(rng.integers(1 << 30))
            streams = lambda i: np.random.default_rng([key, i])  # noqa: E731 - a stream per row, as `Randoms` gives
            verdict = verify_sampled(p_target, tokens, listed, streams)
            for i in range(verdict.accepted + 1):
                copied = i == len(tokens) or listed is None or listed[i] is None
                if copied:  # the target's draw at row i (the bonus row included)
                    committed = tokens[i] if i < verdict.accepted else verdict.token
                    assert committed == sample(p_target[i], streams(i))


def test_statistical_check_detects_a_biased_verifier():
    """The check above can fail: always accepting the draft is caught."""
    rng = np.random.default_rng(3)
    p0, q0 = _dist(rng, 6), _dist(rng, 6)
    samples = [sample(q0, rng) for _ in range(30000)]
    assert chi_square_pvalue(samples, dict(enumerate(p0))) < 1e-6


def test_verify_dispatches_on_temperature():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])
    assert verify(logits, [1], None, SamplingParams(temperature=0), lambda i: rng).accepted == 1
    verdict = verify(logits, [1], None, SamplingParams(temperature=1.0, top_k=1), lambda i: rng)
    assert (verdict.accepted, verdict.token) == (1, 0)
