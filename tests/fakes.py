"""A fake model with known distributions, implementing the Backend protocol.

Row logits depend on the token being evaluated and on the token before it *as held in the
KV cache*, so a wrong rewind or a position mix-up changes the output and fails a test.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import numpy as np

from specllm.chat import encode_messages
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder, Done, PrefillDone, StepDone, TokenCommitted, fixed_budget
from specllm.engine.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.engine.sampling import SamplingParams


class VirtualClock:
    """`time` for the engine's modules (the `virtual_clock` fixture; the calibration's tests): a pass
    costs what a cost curve says, so what the policy measures agrees with the curve it plans by (a
    fake runs in microseconds; against a curve of milliseconds every draft would look lost)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# A large GPU's curve (shaped like the machine files in ../shared/machines: batches nearly flat, a
# draft step a tenth of a pass), so `auto` consults the draft model at once; for fakes on a VirtualClock.
BIG_GPU = CostModel({1: 0.0294, 2: 0.0318, 4: 0.0353, 8: 0.0441, 16: 0.0426, 32: 0.047}, draft_seconds=0.0026,
                    draft_token_seconds=0.0001)  # fmt: skip


class FakeBackend:
    """`clock` and `pass_seconds`: each evaluation of k tokens advances the clock by pass_seconds(k)."""

    def __init__(
        self, n_vocab: int = 8, seed: int = 0, eog: int | None = None, n_ctx: int = 512, sharpness: float = 2.0,
        clock: VirtualClock | None = None, pass_seconds=None,
    ):  # fmt: skip
        self.clock, self.pass_seconds = clock, pass_seconds
        rng = np.random.default_rng(seed)
        self.table = rng.normal(size=(n_vocab, n_vocab, n_vocab)).astype(np.float32) * sharpness
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.n_batch = n_ctx
        self.eog = eog
        self.kv: list[int] = []
        self.evaluations: list[int] = []  # batch sizes, for counting target passes

    @property
    def n_past(self) -> int:
        return len(self.kv)

    def logits_after(self, context: list[int]) -> np.ndarray:
        """The exact next-token logits after a token sequence (what a test computes the truth from)."""
        prev = context[-2] if len(context) > 1 else 0
        return self.table[prev, context[-1]].copy()

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return [ord(c) % self.n_vocab for c in text]

    def token_bytes(self, token: int) -> bytes:
        return chr(ord("a") + token).encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def evaluate(self, tokens, rows, copy=True) -> np.ndarray:
        if self.n_past + len(tokens) > self.n_ctx:
            raise RuntimeError("fake context full")
        self.evaluations.append(len(tokens))
        if self.clock is not None:
            self.clock.now += self.pass_seconds(len(tokens))
        wanted = set(rows)
        out = []
        for i, token in enumerate(tokens):
            self.kv.append(int(token))
            if i in wanted:
                out.append(self.logits_after(self.kv))
        return np.array(out, dtype=np.float32).reshape(len(out), self.n_vocab)

    def rewind(self, n_past: int) -> None:
        del self.kv[n_past:]


class Priced:
    """A real backend whose evaluations also advance a virtual clock by what `seconds(k)` says k
    tokens cost, so that `--spec auto` decides from a cost curve, not from how busy the machine is."""

    def __init__(self, inner, clock: VirtualClock, seconds):
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evaluate(self, tokens, rows, copy=True):
        self.clock.now += self.seconds(len(tokens))
        return self.inner.evaluate(tokens, rows, copy)


class LogitsRecorder:
    """Wraps a backend and keeps every logits row it returns, by absolute KV position.

    A committed token's position is never evaluated again (the KV cache is only rewound to the
    last committed token), so the last row kept for a position is the one that chose the token.
    """

    def __init__(self, inner):
        self.inner = inner
        self.rows: dict[int, np.ndarray] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evaluate(self, tokens, rows, copy=True):
        start = self.inner.n_past
        out = self.inner.evaluate(tokens, rows, copy)
        for row, logits in zip(rows, out):
            self.rows[start + row] = logits.copy()
        return out


class ChatFakeBackend(FakeBackend):
    """FakeBackend with a chat template, and text that round-trips: 'a' is token 0, 'b' token 1, ...

    `interrupt_at`: send SIGINT to this process once that many evaluations have run (a Ctrl-C mid-reply),
    `presses` times in a row.
    """

    add_bos = False

    def __init__(self, *args, interrupt_at: int | None = None, presses: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.interrupt_at, self.presses = interrupt_at, presses

    def tokenize(self, text, *, add_special=False, parse_special=False):
        return [(ord(ch) - ord("a")) % self.n_vocab for ch in text]

    def apply_chat_template(self, messages, add_assistant=True, tools=None, variables=None):
        rendered = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return rendered + ("<assistant>" if add_assistant else "")

    def evaluate(self, tokens, rows, copy=True):
        out = super().evaluate(tokens, rows, copy)
        if self.interrupt_at is not None and len(self.evaluations) == self.interrupt_at:
            for _ in range(self.presses):
                os.kill(os.getpid(), signal.SIGINT)
        return out


class FakeEngine:
    """What the chat loop needs from session.Engine: a target, an optional draft, fresh decoders."""

    def __init__(self, n_ctx=512, seed=0, eog=None, with_draft=False, interrupt_at=None, presses=1):
        self.target = ChatFakeBackend(seed=seed, n_ctx=n_ctx, eog=eog, interrupt_at=interrupt_at, presses=presses)
        self.draft = FakeBackend(seed=seed, n_ctx=n_ctx) if with_draft else None
        self.strategies: list[str] = []
        self.kept = 0  # keep_learned calls: the command's end, when what auto learned goes to the cache
        self.measured = True  # whether a cost curve is cached (False: `costs` measures it)
        self.measure = lambda: None  # what measuring does (a test may raise KeyboardInterrupt: Ctrl-C meanwhile)

    def decoder(self, strategy: str | None = None) -> Decoder:
        strategy = strategy or "auto"
        self.strategies.append(strategy)
        for model in (self.target, self.draft):
            if model is not None:
                model.rewind(0)
        drafters = []
        if strategy in ("auto", "ngram", "ngram+draft"):
            drafters.append(NgramDrafter(2, 4))
        if strategy in ("auto", "draft", "ngram+draft") and self.draft is not None:
            drafters.append(ModelDrafter(self.draft, 0.0))
        drafter = None if not drafters else drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)
        return Decoder(self.target, drafter, fixed_budget(4))

    def costs_known(self) -> bool:
        return self.measured

    def costs(self):
        if not self.measured:
            self.target.rewind(0)  # measuring uses the target's KV cache
            self.target.evaluate([1, 2, 3], [])
            self.measure()
            self.measured = True
        return SimpleNamespace(steady=True)  # what the chat reads of a curve

    def keep_learned(self) -> None:
        self.kept += 1

    def close(self) -> None:
        pass


def reference_reply(messages, max_tokens, n_ctx=512, seed=0, eog=None) -> str:
    """What a fresh plain decoder replies to these messages at temperature 0."""
    target = ChatFakeBackend(seed=seed, n_ctx=n_ctx, eog=eog)
    events = list(Decoder(target).generate(encode_messages(target, messages), max_tokens, SamplingParams(temperature=0.0), np.random.default_rng(0)))
    return events[-1].text


class Scripted:
    """A decoder that writes `script` (pieces of text, one a token) whatever the prompt, as a model
    would write it where a tiny model's own text is noise; it keeps the prompts it was given."""

    def __init__(self, script: list[str] | None = None):
        self.script: list[str] = list(script or [])
        self.prompts: list[list[int]] = []

    def generate(self, prompt, max_tokens, params, rng, stop=None, find_text_end=None):
        self.prompts.append(list(prompt))
        yield PrefillDone(len(prompt), 0, 0.0)
        for i, piece in enumerate(self.script):
            if stop is not None and stop():  # asked before each step, as the real loop asks
                yield Done("interrupted", list(range(i)), "".join(self.script[:i]))
                return
            yield TokenCommitted(i, piece, "target")
            yield StepDone(None, 0, 0, 1, 0.0, 0.001, 0.001)
        yield Done("stop", list(range(len(self.script))), "".join(self.script))


def reader(items):
    """A read_line that plays back lines; an exception instance is raised instead (Ctrl-C, Ctrl-D)."""
    queue = list(items)

    def read(prompt):
        item = queue.pop(0) if queue else EOFError()
        if isinstance(item, BaseException):
            raise item
        return item

    return read


PASS_FAILURE = "llama.cpp failed to evaluate a batch of 4 tokens (status 1)"


def fail_generations(monkeypatch, after: int, first_only: bool = False) -> None:
    """Every generation (only the first, with `first_only`) fails as a target pass that llama.cpp
    refuses would: with PASS_FAILURE once `after` tokens have been committed (0: before any)."""
    from specllm.errors import SpecllmError

    plain, calls = Decoder.generate, []

    def generate(self, *args, **kwargs):
        calls.append(1)
        failing = not first_only or len(calls) == 1
        if failing and after == 0:
            raise SpecllmError(PASS_FAILURE)
        committed = 0
        for event in plain(self, *args, **kwargs):
            if failing and isinstance(event, TokenCommitted) and event.token >= 0:
                committed += 1
                if committed > after:
                    raise SpecllmError(PASS_FAILURE)
            yield event

    monkeypatch.setattr(Decoder, "generate", generate)
