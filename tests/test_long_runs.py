"""Long generations on the compact tiny GGUF pair (the generated tokenizer cut to 4096 tokens,
random weights, f32: conftest.py's `compact_pair`, four times faster a step than `tiny_pair`).

- `--spec auto` generating until the context is full keeps memory flat: the n-gram index and the
  Python heap grow by a bounded amount per token held in the context, and nothing is left behind
  between generations.
- Greedy output over 1200 tokens, several prompts, every strategy, is the output of plain decoding.
  Batched evaluation takes other float paths than one-token evaluation, so a near tie can
  resolve differently; a divergence passes only at such a tie (both paths rank the two tokens
  within the rounding noise of tests/logit_noise.py) and the comparison then resumes from the
  speculative prefix.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from specllm.backend import LoadOptions
from specllm.engine.decode import Done, StepDone, generate_plain
from specllm.engine.sampling import SamplingParams
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.fakes import LogitsRecorder
from tests.logit_noise import tie_tolerance

pytestmark = pytest.mark.slow  # 1200-token generations and context fills: the full suite, not the fast tier

N_CTX = 2048
FILL_CTX = 1024
GREEDY = SamplingParams(temperature=0.0)
LONG = 1200
MAX_FLIPS = 3
PROMPTS = {
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "question": "Write a Python function that reverses a string.",
    "echo": "Summarise: the cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
}
STRATEGIES = ["off", "ngram", "draft", "ngram+draft", "auto"]


def _open(pair, n_ctx: int) -> Engine:
    options = LoadOptions(n_ctx=n_ctx, n_threads=1, n_gpu_layers=0)
    engine = Engine(ModelPaths(*pair), SpecConfig("auto"), options, options, cost_cache=None)
    engine.costs()  # measured once, outside the memory checks
    for token in range(engine.target.n_vocab):  # the token-text cache is bounded by the vocabulary: fill it now
        engine.target.token_bytes(token)
    return engine


@pytest.fixture(scope="module")
def engine(compact_pair):
    engine = _open(compact_pair, N_CTX)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def filling_engine(compact_pair):
    """A context of FILL_CTX for the memory checks: filled twice per temperature under tracemalloc,
    which slows Python down several times; the heap's growth is measured over 666 tokens of it."""
    engine = _open(compact_pair, FILL_CTX)
    yield engine
    engine.close()


class _NeverEnds:
    """The target with its end-of-generation tokens treated as ordinary text.

    Random weights at temperature > 0 sample an end token sooner or later, and where depends on
    how the policy drafted (timing-dependent): a generation meant to fill the context must not stop.
    Greedy runs of 1200 tokens on a 4096-token vocabulary reach one too (the end token is one of
    4096, not of 49152): both the plain and the speculative run read it as text.
    """

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def is_eog(self, token: int) -> bool:
        return False


def _fill_context(engine: Engine, params: SamplingParams, marks=(0.25, 0.9)):
    """Generate with auto until the context is full; traced heap size when the history crosses each mark."""
    decoder = engine.decoder("auto")
    decoder.target = _NeverEnds(decoder.target)
    prompt = engine.encode(PROMPTS["code"])
    heap, done = {}, None
    for event in decoder.generate(prompt, 10 * engine.target.n_ctx, params, np.random.default_rng(0)):
        if isinstance(event, StepDone):
            for mark in marks:
                if mark not in heap and len(decoder.history) >= mark * engine.target.n_ctx:
                    gc.collect()
                    heap[mark] = (len(decoder.history), tracemalloc.get_traced_memory()[0])
        elif isinstance(event, Done):
            done = event
    return decoder, done, heap


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_auto_until_the_context_is_full_keeps_memory_flat(filling_engine, temperature):
    engine = filling_engine
    params = SamplingParams(temperature=temperature, seed=0)
    tracemalloc.start()
    try:
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        decoder, done, heap = _fill_context(engine, params)
        assert done.finish_reason == "context"
        assert len(decoder.history) == FILL_CTX + 1  # the KV cache holds every token but the last
        cache = decoder.drafter.ngram.cache
        assert len(cache.tokens) <= FILL_CTX + 1
        assert len(cache._index) <= (cache.n_max - cache.n_min + 1) * FILL_CTX
        assert len(decoder.drafter.model.kv_tokens) <= FILL_CTX
        (t1, m1), (t2, m2) = heap[0.25], heap[0.9]
        per_token = (m2 - m1) / (t2 - t1)
        assert per_token < 1500, f"{per_token:.0f} bytes of Python heap per generated token"
        del decoder, done
        gc.collect()
        after_first = tracemalloc.get_traced_memory()[0]
        _fill_context(engine, params)  # a second generation: nothing of the first one may stay
        gc.collect()
        after_second = tracemalloc.get_traced_memory()[0]
        assert after_second - after_first < 64 * 1024, (start, after_first, after_second)
    finally:
        tracemalloc.stop()


def _plain(engine: Engine, prompt: list[int], max_tokens: int):
    recorder = LogitsRecorder(_NeverEnds(engine.target))
    return generate_plain(recorder, prompt, max_tokens, GREEDY, None), recorder.rows


@pytest.fixture(scope="module")
def plain_runs(engine):
    runs = {}
    for name, text in PROMPTS.items():
        prompt = engine.encode(text)
        runs[name] = (prompt, *_plain(engine, prompt, LONG))
    return runs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_greedy_runs_equal_plain_decoding(engine, plain_runs, strategy):
    accepted = 0
    for name, (prompt, plain, plain_rows) in plain_runs.items():
        decoder = engine.decoder(strategy)
        decoder.target = recorder = LogitsRecorder(_NeverEnds(decoder.target))  # as plain: an end token is text
        events = list(decoder.generate(prompt, LONG, GREEDY, np.random.default_rng(0)))
        spec = events[-1].tokens
        assert len(spec) == LONG
        accepted += sum(e.accepted for e in events if isinstance(e, StepDone))
        _compare(engine, prompt, spec, recorder.rows, plain, plain_rows, f"{strategy} on {name!r}")
    assert (accepted > 0) == (strategy != "off"), f"{strategy}: {accepted} drafted tokens accepted"  # the claim is about drafts


def _compare(engine, prompt, spec, spec_rows, plain, plain_rows, label) -> None:
    """spec must equal plain, except where the target's two best tokens tie within float noise."""
    done = 0
    for flips in range(MAX_FLIPS + 1):  # each pass either returns, fails, or resumes after one tie flip
        at = next((i for i, (a, b) in enumerate(zip(plain, spec[done:])) if a != b), None)
        if at is None:
            assert len(spec) - done == len(plain), label
            return
        i = done + at
        position = len(prompt) + i - 1
        p_row, s_row = plain_rows[position], spec_rows[position]
        chosen = (int(np.argmax(p_row)), int(np.argmax(s_row)))
        margins = (float(p_row[chosen[0]] - p_row[chosen[1]]), float(s_row[chosen[1]] - s_row[chosen[0]]))
        tie = tie_tolerance(p_row)
        assert max(margins) < tie, f"{label}: token {i} differs: plain {chosen[0]}, speculative {chosen[1]}, margins {margins} (tie: {tie:.3f})"
        done = i + 1
        plain, plain_rows = _plain(engine, prompt + spec[:done], LONG - done)
    pytest.fail(f"{label}: more than {MAX_FLIPS} tie flips")
