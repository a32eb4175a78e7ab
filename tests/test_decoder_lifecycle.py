"""A decoder as a library user drives it: several generations on one decoder, generations abandoned
midway, two decoders sharing one engine's models, prompts of every shape. At temperature 0 the text
must always be plain decoding's; what cannot work must fail with one clear `SpecllmError`."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from specllm.backend import DeferredBackend, LoadOptions
from specllm.engine.decode import Decoder, Done, PrefillDone, TokenCommitted, fixed_budget, generate_plain
from specllm.engine.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.engine.sampling import SamplingParams
from specllm.errors import SpecllmError
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import ROOT
from tests.fakes import FakeBackend

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
OTHER = [5, 4, 7, 6, 5, 4]


class WholeContextBackend(FakeBackend):
    """A fake whose logits depend on every token its KV cache holds (FakeBackend's, on the last two
    only): a cache that holds another conversation's tokens anywhere changes the text."""

    def logits_after(self, context):
        mix = sum((i + 1) * token for i, token in enumerate(context)) % self.n_vocab
        return super().logits_after(context) + self.table[mix, (context[-1] + 1) % self.n_vocab]


class CountingBackend(WholeContextBackend):
    """A fake that counts the edits of its KV cache (`kv_edits`), as `LlamaBackend` does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_edits = 0

    def evaluate(self, tokens, rows, copy=True):
        self.kv_edits += 1
        return super().evaluate(tokens, rows, copy)

    def rewind(self, n_past):
        if n_past < self.n_past:
            self.kv_edits += 1
        super().rewind(n_past)


def _plain(prompt, n):
    return generate_plain(WholeContextBackend(seed=0), prompt, n, GREEDY, None)


def _tokens(events) -> list[int]:
    return next(e for e in events if isinstance(e, Done)).tokens


def _generate(decoder, prompt, n, params=GREEDY, seed=0):
    return list(decoder.generate(prompt, n, params, np.random.default_rng(seed)))


def _decoder(target, draft_model=None, kind="ngram+draft"):
    drafters = {"off": [], "ngram": [NgramDrafter(1, 3)], "draft": [], "ngram+draft": [NgramDrafter(2, 3)]}[kind]
    if kind in ("draft", "ngram+draft"):
        drafters.append(ModelDrafter(draft_model, p_min=0.0))
    drafter = ChainDrafter(drafters) if len(drafters) > 1 else drafters[0] if drafters else None
    return Decoder(target, drafter, fixed_budget(4))


# -- two decoders, one pair of models ---------------------------------------------------------


@pytest.mark.parametrize("kinds", [("ngram+draft", "draft"), ("off", "ngram"), ("draft", "off")])
def test_two_decoders_sharing_their_models_each_give_plain_decodings_text(kinds):
    """Two decoders of one engine share its target and draft model: a chat turn of one after the
    other's generation reused what it took for its own KV cache, and read the other's tokens there."""
    target, draft = CountingBackend(seed=0), CountingBackend(seed=1)
    first, second = (_decoder(target, draft, kind) for kind in kinds)
    _generate(first, PROMPT, 12)
    _generate(second, OTHER, 12)
    turn = first.history + [4, 5]
    events = _generate(first, turn, 12)
    assert _tokens(events) == _plain(turn, 12)
    assert next(e for e in events if isinstance(e, PrefillDone)).reused_tokens == 0  # read again, all of it
    turn = second.history + [6]
    assert _tokens(_generate(second, turn, 12)) == _plain(turn, 12)


def test_generations_of_two_decoders_taken_in_turns_each_give_plain_decodings_text():
    """Two generations consumed side by side (a comparison shown live), each paused while the other
    steps: each reads its history again where the other used the models meanwhile."""
    target, draft = CountingBackend(seed=0), CountingBackend(seed=1)
    first, second = _decoder(target, draft, "ngram+draft"), _decoder(target, draft, "draft")
    streams = (first.generate(PROMPT, 30, GREEDY, np.random.default_rng(0)), second.generate(OTHER, 30, GREEDY, np.random.default_rng(0)))
    events = [[], []]
    for pair in itertools.zip_longest(*streams):
        for mine, event in zip(events, pair):
            if event is not None:
                mine.append(event)
    assert _tokens(events[0]) == _plain(PROMPT, 30)
    assert _tokens(events[1]) == _plain(OTHER, 30)


def test_a_draft_model_another_decoder_used_drafts_as_a_fresh_one():
    """The draft model's KV cache, changed by another decoder's drafter, is read again: the drafts
    (not only the verified text) are those of a draft model that saw this history alone."""
    draft = CountingBackend(seed=1)
    mine, other = ModelDrafter(draft, p_min=0.0), ModelDrafter(draft, p_min=0.0)
    history = PROMPT + [4, 5]
    history += mine.propose(history, 4, GREEDY, None).tokens + [6]  # every drafted token kept: nothing to rewind
    other.propose(OTHER, 4, GREEDY, None)
    fresh = ModelDrafter(CountingBackend(seed=1), p_min=0.0).propose(history, 4, GREEDY, None)
    assert mine.propose(history, 4, GREEDY, None).tokens == fresh.tokens


# -- one decoder, generations abandoned -------------------------------------------------------


@pytest.mark.parametrize("stop_after", range(1, 12))
@pytest.mark.parametrize("how", ["close", "break"])
def test_a_generation_abandoned_at_any_event_leaves_a_decoder_that_reuses_its_cache(stop_after, how):
    target, draft = CountingBackend(seed=0), CountingBackend(seed=1)
    decoder = _decoder(target, draft)
    generation = decoder.generate(PROMPT, 30, GREEDY, np.random.default_rng(0))
    if how == "close":
        for _ in range(stop_after):
            next(generation)
        generation.close()
    else:
        for seen, _ in enumerate(generation, start=1):
            if seen == stop_after:
                break
    turn = decoder.history + [4]  # the next turn after what was shown
    events = _generate(decoder, turn, 16)
    assert _tokens(events) == _plain(turn, 16)
    assert next(e for e in events if isinstance(e, PrefillDone)).reused_tokens >= len(PROMPT) - 1
    assert _tokens(_generate(decoder, OTHER, 16)) == _plain(OTHER, 16)


def test_an_abandoned_generation_resumed_after_a_later_one_is_refused():
    """Resuming a generation after another started on the same decoder went on from the other's
    history and KV cache, and wrote tokens of neither conversation."""
    decoder = _decoder(CountingBackend(seed=0), CountingBackend(seed=1))
    old = decoder.generate(PROMPT, 30, GREEDY, np.random.default_rng(0))
    for _ in range(3):
        next(old)
    assert _tokens(_generate(decoder, OTHER, 10)) == _plain(OTHER, 10)
    with pytest.raises(SpecllmError, match="abandoned"):
        list(old)
    turn = decoder.history + [3]
    assert _tokens(_generate(decoder, turn, 10)) == _plain(turn, 10)  # the later one's conversation goes on


class FailingBackend(WholeContextBackend):
    """A fake whose `fail_at`-th evaluation raises once its batch is in the KV cache (a Ctrl-C as
    llama.cpp's pass returns); it reads prompts in batches of 3."""

    def __init__(self, *args, fail_at=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_batch, self.fail_at, self.passes = 3, fail_at, 0

    def evaluate(self, tokens, rows, copy=True):
        out = super().evaluate(tokens, rows, copy)
        self.passes += 1
        if self.passes == self.fail_at:
            raise KeyboardInterrupt
        return out


def test_an_exception_while_a_prompt_is_read_leaves_a_history_the_cache_holds():
    """A prompt's reading cut short by an exception kept the earlier history, while the KV cache held
    part of the new prompt in its place: a turn that went on from the earlier history reused it."""
    target = FailingBackend(seed=0)  # no `kv_edits`: the history alone must stay true
    decoder = Decoder(target, NgramDrafter(1, 3), fixed_budget(4))
    _generate(decoder, PROMPT, 10)
    conversation = list(decoder.history)
    target.fail_at = target.passes + 2
    with pytest.raises(KeyboardInterrupt):
        _generate(decoder, PROMPT[:2] + OTHER * 2, 10)
    turn = conversation + [4]  # the earlier conversation goes on
    assert _tokens(_generate(decoder, turn, 10)) == _plain(turn, 10)


def test_an_exception_raised_by_the_consumer_leaves_a_usable_decoder():
    decoder = _decoder(CountingBackend(seed=0), CountingBackend(seed=1))
    with pytest.raises(ValueError):
        for event in decoder.generate(PROMPT, 30, GREEDY, np.random.default_rng(0)):
            if isinstance(event, TokenCommitted) and event.token == decoder.history[-1] and len(decoder.history) > len(PROMPT) + 3:
                raise ValueError("the consumer's own error")
    assert _tokens(_generate(decoder, PROMPT, 20)) == _plain(PROMPT, 20)


# -- prompts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [tuple, np.array, lambda p: [np.int64(t) for t in p]], ids=["tuple", "numpy array", "numpy ints"])
def test_a_prompt_may_be_any_sequence_of_integers(shape):
    decoder = _decoder(CountingBackend(seed=0), CountingBackend(seed=1))
    assert _tokens(_generate(decoder, shape(PROMPT), 12)) == _plain(PROMPT, 12)
    turn = shape(decoder.history + [4])
    assert _tokens(_generate(decoder, turn, 12)) == _plain(list(turn), 12)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "the prompt is empty"),
        (np.array([], dtype=np.int64), "the prompt is empty"),
        (PROMPT + [8], r"token id 8, not in the vocabulary \(0 to 7\)"),
        ([-1] + PROMPT, r"token id -1, not in the vocabulary"),
        ([1.5, 2], "integer token ids"),
        ("hello", "integer token ids"),
    ],
)
def test_a_prompt_that_is_not_token_ids_of_the_vocabulary_is_refused_in_one_line(prompt, message):
    decoder = _decoder(CountingBackend(seed=0), CountingBackend(seed=1))
    with pytest.raises(SpecllmError, match=message):
        _generate(decoder, prompt, 4)
    assert _tokens(_generate(decoder, PROMPT, 8)) == _plain(PROMPT, 8)  # nothing was touched


# -- a real engine (tiny generated models) ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_pair):
    options = LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0)
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("ngram+draft"), options, options)
    yield engine
    engine.close()


def _text(decoder, prompt, n=24):
    return next(e for e in decoder.generate(prompt, n, GREEDY, np.random.default_rng(0)) if isinstance(e, Done))


def test_two_decoders_of_one_engine_each_give_plain_decodings_text(tiny_engine):
    engine = tiny_engine
    prompts = [engine.encode("Tell me a long story about a cat."), engine.encode("def add(a, b):")]
    answers = [_text(engine.decoder("off"), prompt, 12).tokens for prompt in prompts]
    follow_ups = [engine.target.tokenize(" The cat sat on the mat."), engine.target.tokenize(" return a + b")]
    turns = [prompt + answer + more for prompt, answer, more in zip(prompts, answers, follow_ups)]
    references = [_text(engine.decoder("off"), turn).tokens for turn in turns]
    decoders = [engine.decoder("ngram+draft"), engine.decoder("draft")]
    assert [_text(decoder, prompt, 12).tokens for decoder, prompt in zip(decoders, prompts)] == answers
    assert [_text(decoder, turn).tokens for decoder, turn in zip(decoders, turns)] == references


CLOSED_ENGINE = """
import sys
import numpy as np
from specllm.backend import LoadOptions
from specllm.engine.sampling import SamplingParams
from specllm.errors import SpecllmError
from specllm.session import Engine, ModelPaths, SpecConfig

options = LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0)
engine = Engine(ModelPaths(sys.argv[1], sys.argv[2]), SpecConfig("ngram+draft"), options, options)
decoder = engine.decoder()
prompt = engine.encode("Write a Python function.")
list(decoder.generate(prompt, 4, SamplingParams(temperature=0.0), np.random.default_rng(0)))
engine.close()
engine.close()  # twice: nothing more to free
uses = {
    "generate": lambda: list(decoder.generate(prompt, 4, SamplingParams(temperature=0.0), np.random.default_rng(0))),
    "decoder": engine.decoder,
    "encode": lambda: engine.encode("Write a Python function."),
    "token_bytes": lambda: engine.target.token_bytes(12345),
    "is_eog": lambda: engine.target.is_eog(0),
    "draft": lambda: engine.draft.evaluate([1], [0]),
}
for name, use in uses.items():
    try:
        use()
        print(name, "worked")
    except SpecllmError as exc:
        print(name, exc)
"""


def test_an_engine_used_after_close_says_so(tiny_pair):
    """A closed engine's models (and a decoder it gave out) raise one clear error: llama.cpp read freed
    memory, and the process crashed (a token's text) or died of a segmentation fault (a rewind)."""
    done = subprocess.run([sys.executable, "-c", CLOSED_ENGINE, *map(str, tiny_pair)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["generate", "decoder", "encode", "token_bytes", "is_eog", "draft"]
    for line in lines:
        assert line.endswith("tiny-target.gguf is closed (Engine.close or LlamaBackend.close freed it): load it again to use it") or (
            line.startswith("draft ") and "tiny-draft.gguf is closed" in line
        ), line


def test_a_deferred_model_closed_before_its_first_use_is_never_loaded():
    """`auto` loads the draft model at its first use: after the engine's close that load would have
    left a model no one frees."""
    model = DeferredBackend("draft.gguf", LoadOptions(n_ctx=64, n_gpu_layers=0), load=lambda path, options: pytest.fail("loaded"))
    model.close()
    with pytest.raises(SpecllmError, match="draft.gguf is closed"):
        model.evaluate([1], [0])
