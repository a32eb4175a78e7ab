"""The edges of the context window: prompts that fill it to within a few tokens, with every strategy,
the KV caches after a generation the context's end stopped, sizes at the extremes, and inputs the
context cannot hold, refused before `--spec auto` spends minutes measuring the machine.

Models are tiny GGUFs (a generated tokenizer, random weights): llama.cpp itself refuses an evaluation
past the context (`ContextFull`), so a draft or its catch-up that asked for one more position would fail here.
"""

from __future__ import annotations

import numpy as np
import pytest

from specllm import session
from specllm.backend import LoadOptions
from specllm.engine.decode import Done, generate_plain
from specllm.engine.sampling import SamplingParams
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import assert_one_error, specllm_here
from tests.conftest import DEFAULT_PAIR_COSTS
from tests.tiny_gguf import write_tiny_gguf

STRATEGIES = ["off", "ngram", "draft", "ngram+draft", "auto"]
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20  # the n-gram cache drafts from it


@pytest.fixture(scope="module")
def edge_engine(tiny_pair):
    """The tiny pair in llama.cpp's smallest context (256 tokens: it rounds a small one up to that),
    `auto` on a fixed cost curve instead of a calibration."""
    options = LoadOptions(n_ctx=16, n_threads=1, n_gpu_layers=0)
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("ngram+draft"), options, options, cost_cache=None)
    engine.costs = lambda max_batch=None: DEFAULT_PAIR_COSTS.copy()
    yield engine
    engine.close()


def _generate(decoder, prompt, max_tokens, params, seed=1) -> Done:
    return [event for event in decoder.generate(prompt, max_tokens, params, np.random.default_rng(seed))][-1]


@pytest.mark.parametrize("left", [1, 2, 5, 9])
def test_a_prompt_that_fills_the_context_to_a_few_tokens_gives_plain_decodings_text_with_every_strategy(edge_engine, left):
    """Drafts (and the draft model's catch-up) never ask for a position past the context; the text is
    plain decoding's to the last token the context allows, and the finish reason says why it ended.
    The same decoder's next prompt, sharing a prefix with the full cache, reads on from that prefix."""
    engine, greedy = edge_engine, SamplingParams(temperature=0.0)
    n_ctx = engine.target.n_ctx
    assert n_ctx == 256 and engine.draft.load().n_ctx == n_ctx
    code = engine.target.tokenize(CODE)
    prompt = code[: n_ctx - left]
    again = code[:40] + engine.target.tokenize("\ndef mul(a, b):")
    full = generate_plain(engine.target, prompt, 1000, greedy, np.random.default_rng(0))
    after = generate_plain(engine.target, again, 24, greedy, np.random.default_rng(0))
    assert len(full) == left + 1  # the KV cache holds every token but the last: n_ctx + 1 in all
    for strategy in STRATEGIES:
        decoder = engine.decoder(strategy)
        done = _generate(decoder, prompt, 1000, greedy)
        assert (done.finish_reason, done.tokens) == ("context", full), strategy
        assert engine.target.n_past == n_ctx
        assert _generate(decoder, prompt, left + 1, greedy).finish_reason == "length"  # -n exactly the room: the limit came first
        done = _generate(decoder, again, 24, greedy)
        assert (done.finish_reason, done.tokens) == ("length", after), strategy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sampling_to_the_end_of_the_context_ends_there(edge_engine, strategy):
    """Above temperature 0 too: no pass past the context, and the end is the context's (or the model's own)."""
    engine = edge_engine
    prompt = engine.target.tokenize(CODE)[: engine.target.n_ctx - 6]
    for seed in range(3):
        done = _generate(engine.decoder(strategy), prompt, 1000, SamplingParams(temperature=0.8, seed=seed), seed)
        assert done.finish_reason == "context" and len(done.tokens) == 7 or done.finish_reason == "stop", (seed, done)


def _fresh_model(tmp_path):
    """A model of its own file, so no cost curve is cached for it: `auto` would measure one."""
    return write_tiny_gguf(tmp_path / "fresh.gguf", 0)


def _no_measuring(monkeypatch):
    def measure(*args, **kwargs):
        raise AssertionError("the cost curve was measured before the input was refused")

    monkeypatch.setattr(session, "measure_costs", measure)


def test_run_refuses_a_prompt_the_context_cannot_hold_before_measuring_the_machine(home, tmp_path, monkeypatch):
    """`--spec auto` measures the cost curve (1-3 min on 2 cores) on a machine without one: a prompt
    too long for the context was said only afterwards."""
    model = _fresh_model(tmp_path)
    _no_measuring(monkeypatch)
    done = specllm_here(home, "run", "-m", model, "-c", "256", "--spec", "auto", "-n", "4", stdin=("word " * 400).encode())
    assert_one_error(done, 1, "tokens but the context holds 256; raise --ctx-size or shorten the prompt")


def test_chat_refuses_a_system_prompt_that_leaves_no_room_before_measuring_the_machine(home, tmp_path, monkeypatch):
    model = _fresh_model(tmp_path)
    _no_measuring(monkeypatch)
    done = specllm_here(home, "chat", "-m", model, "-c", "256", "--spec", "auto", "--system", "word " * 400, stdin=b"hi\n")
    assert_one_error(done, 2, "the system prompt alone takes", "tokens and the context holds 256: shorten it or raise --ctx-size")


def test_a_context_size_beyond_llama_cpps_32_bits_is_refused_not_wrapped(home, tiny_pair):
    """llama.cpp reads the size as an unsigned 32-bit number: 2**32 + 256 ran in a context of 256
    tokens, and told the user to raise --ctx-size when it filled."""
    flags = ["run", "-m", tiny_pair[0], "--spec", "off", "--temp", "0", "-n", "300", "-p", "hello"]
    done = specllm_here(home, *flags, "-c", str(2**32 + 256))
    assert_one_error(done, 2, f"--ctx-size must be at most {2**31 - 1} tokens", f"got {2**32 + 256}")
