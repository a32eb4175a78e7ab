"""Temperature > 0 through llama.cpp on the compact tiny pair (conftest.py's `compact_pair`), shared
by test_lossless_real.py and test_sampling_lossless.py: the module-scoped fixtures `tiny_models`
(target, draft and a separate copy of the target that computes the truth) and `repeating_prompt`
(one the n-gram cache drafts for), each test module importing them; `sequence_distribution`, the
exact distribution of the generated tokens, and `make_drafter`, a fresh drafter of a kind.
"""

from __future__ import annotations

import numpy as np
import pytest

from specllm.backend import LlamaBackend, LoadOptions
from specllm.engine.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.engine.sampling import SamplingParams, warp

TINY = LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0)


@pytest.fixture(scope="module")
def tiny_models(compact_pair):
    target, draft = (LlamaBackend(path, TINY) for path in compact_pair)
    truth = LlamaBackend(compact_pair[0], TINY)  # a separate copy computes the exact distribution
    yield target, draft, truth
    for model in (target, draft, truth):
        model.close()


def next_probs(model: LlamaBackend, context: list[int], params: SamplingParams) -> np.ndarray:
    model.rewind(0)
    return warp(model.evaluate(context, [len(context) - 1])[0], params)


@pytest.fixture(scope="module")
def repeating_prompt(tiny_models):
    """`S y S`: the n-gram cache proposes y, chosen so that the target gives y a middling probability."""
    _, _, truth = tiny_models
    params = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    head = truth.tokenize("def add(a, b):")
    candidates = np.argsort(-next_probs(truth, head, params))[:3]
    scored = [(float(next_probs(truth, head + [int(y)] + head, params)[y]), int(y)) for y in candidates]
    p_y, y = max(scored)
    assert 0.1 < p_y < 0.9, f"the n-gram proposal should be accepted sometimes, rejected sometimes: {scored}"
    return head + [y] + head


def sequence_distribution(truth: LlamaBackend, prompt: list[int], length: int, params: SamplingParams) -> dict:
    """P(generated tokens) by walking every continuation the warping allows (an EOG ends a sequence)."""
    dist: dict[tuple, float] = {}

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == length:
            dist[seq] = dist.get(seq, 0.0) + prob
            return
        probs = next_probs(truth, prompt + list(seq), params)
        for token in np.flatnonzero(probs):
            if truth.is_eog(int(token)):
                dist[seq] = dist.get(seq, 0.0) + prob * probs[token]
            else:
                walk(seq + (int(token),), prob * probs[token])

    walk((), 1.0)
    return dist


def make_drafter(kind: str, draft: LlamaBackend, n_vocab: int):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    draft.rewind(0)  # a ModelDrafter starts from an empty KV cache (Engine.decoder does the same)
    model = ModelDrafter(draft, p_min=0.0, n_vocab=n_vocab)
    return model if kind == "draft" else ChainDrafter([NgramDrafter(1, 3), model])
