"""The decode loops. Both yield events; neither prints.

`generate` is the speculative loop (and, with no drafter, plain decoding through the very
same sampler). `generate_plain` is the minimal reference that tests compare against.

The target's KV cache always holds every committed token but the last; each step evaluates
`[last, *draft]` in one batch and asks for exactly those k+1 rows of logits.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from specllm.engine.drafters import Draft, Drafter, common_prefix
from specllm.engine.protocol import Backend
from specllm.engine.sampling import Randoms, SamplingParams, argmax, draw
from specllm.engine.verify import verify
from specllm.errors import SpecllmError

# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillDone:
    prompt_tokens: int
    reused_tokens: int  # already in the KV cache from an earlier turn
    seconds: float


@dataclass(frozen=True)
class TokenCommitted:
    token: int
    text: str  # complete UTF-8 characters only; may be "" while a character is split
    source: str  # "ngram" or "draft" (an accepted drafted token) or "target"


@dataclass(frozen=True)
class StepDone:
    source: str | None  # where the draft came from; None when nothing was drafted
    drafted: int
    accepted: int
    committed: int
    draft_seconds: float
    verify_seconds: float
    seconds: float  # wall time of the whole step
    model_seconds: float = 0.0  # the part of draft_seconds spent in the draft model (its catch-up included)
    sources: tuple[str, ...] = ()  # each drafted token's source where the draft mixed them (`Draft.sources`)


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop", "length", "context" or "interrupted"
    tokens: list[int] = field(default_factory=list)  # generated tokens (without the end-of-generation token)
    text: str = ""


Event = PrefillDone | TokenCommitted | StepDone | Done

# A budget policy: given the history and the most tokens allowed, how many to draft now.
DraftBudget = Callable[[list[int], int], int]


def fixed_budget(draft_max: int) -> DraftBudget:
    return lambda history, limit: min(draft_max, limit)


def all_the_room(history: list[int], limit: int) -> int:  # noqa: ARG001
    """The budget of a drafter that sizes its drafts itself (`--spec auto`'s): the most allowed."""
    return limit


def check_prompt_fits(n_tokens: int, n_ctx: int) -> None:
    """Refuse a prompt that leaves the context no room for a token of the reply (front ends call it
    before they spend minutes measuring, `generate` again)."""
    if n_tokens >= n_ctx:
        raise SpecllmError(f"the prompt has {n_tokens} tokens but the context holds {n_ctx}; raise --ctx-size or shorten the prompt")


# -- the speculative loop -----------------------------------------------------------------


class Decoder:
    """Generation state for one conversation: the target, an optional drafter, and the history.

    Calling `generate` again with a prompt that extends the history (a chat's next turn)
    evaluates only the new tokens. One generation runs at a time: starting another abandons the
    one before (resuming it raises). Where something else changed the target's KV cache meanwhile
    (another decoder of the same engine, a calibration; a backend's `kv_edits` tells), the history
    is read again from the start, so the text stays the same, only slower.
    """

    def __init__(self, target: Backend, drafter: Drafter | None = None, budget: DraftBudget | None = None):
        self.target = target
        self.drafter = drafter
        self.budget = budget or fixed_budget(8)
        self.history: list[int] = []  # committed tokens; the target's KV cache holds history[:-1]
        self._kv_edits = None  # the target's `kv_edits` when its KV cache last held what this decoder put there
        self._generation = 0  # the latest `generate` that ran: an older one resumed raises

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams,
        rng: np.random.Generator,
        stop: Callable[[], bool] | None = None,
        find_text_end: Callable[[list[str]], int | None] | None = None,
    ) -> Iterator[Event]:
        """Generate after `prompt`. `stop` is asked before each step whether to end. `find_text_end`,
        given the text of each of a draft's tokens, returns the index of the token at which the
        caller's text ends (a stop string completed, the line an editor's completion ends before), or
        None; the draft is cut after that token, since nothing past it would be shown. (Not before
        it: above temperature 0 a draft model's token decides where its draft ends only as the last
        token drafted, verified like the others; leaving it out for the target's own draw instead
        would skew the distribution.) `params` out of their ranges raise InvalidSampling, as the
        command line and the server refuse them (a negative temperature would sample the least
        likely tokens first); `rng` None: a fresh one."""
        params = params.validate()
        prompt = self._checked(prompt)
        check_prompt_fits(len(prompt), self.target.n_ctx)
        self._generation += 1
        generation = self._generation
        yield self._prefill(prompt, stop)
        self._resumed(generation)
        if len(self.history) < len(prompt):  # stopped while reading the prompt
            yield Done("interrupted", [], "")
            return
        rng = np.random.default_rng() if rng is None else rng  # the draft model samples from it above temperature 0
        randoms = None if params.greedy else Randoms.drawn_from(rng)  # the target's draws by position; `rng` is the drafter's
        text = _TextStream(self.target)
        generated: list[int] = []
        reason = "length"
        while len(generated) < max_tokens:
            if stop is not None and stop():
                reason = "interrupted"
                break
            if not self._holds_kv():  # another decoder of this engine used the target while this one was paused
                self._read(self.history, 0)
            room = self.target.n_ctx - self.target.n_past - 1  # KV slots left after `last`
            if room < 0:
                reason = "context"
                break
            limit = min(room, max_tokens - len(generated) - 1)
            ended = yield from self._step(limit, params, rng, randoms, text, generated, generation, find_text_end)
            if ended:
                reason = "stop"
                break
        tail = text.flush()
        if tail:
            yield TokenCommitted(-1, tail, "target")
        yield Done(reason, generated, text.text)

    def _checked(self, prompt) -> list[int]:
        """The prompt as a list of token ids (any sequence of integers: a list, a tuple, a numpy array),
        refused where empty or where an id is not in the target's vocabulary (llama.cpp would fail the
        pass with a bare status, or abort the process reading the token's text)."""
        try:
            prompt = [operator.index(token) for token in prompt]
        except TypeError:
            raise SpecllmError("the prompt must be a sequence of integer token ids") from None
        if not prompt:
            raise SpecllmError("the prompt is empty")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.target.n_vocab:
            raise SpecllmError(
                f"the prompt holds token id {low if low < 0 else high}, not in the vocabulary (0 to {self.target.n_vocab - 1})"
            )
        return prompt

    def _resumed(self, generation: int) -> None:
        """Refuse to go on with a generation that a later `generate` call on this decoder replaced: the
        history and the KV caches are that one's now."""
        if generation != self._generation:
            raise SpecllmError("this generation was abandoned: a later generate() call on the same decoder took its place")

    def _holds_kv(self) -> bool:
        """Whether the target's KV cache is as this decoder left it (always, for a backend that does not count its edits)."""
        return getattr(self.target, "kv_edits", None) == self._kv_edits

    def _step(self, limit: int, params, rng, randoms: Randoms | None, text: _TextStream, generated: list[int], generation: int, find_text_end=None):
        """One speculative step: draft at most `limit` tokens, verify them in one target pass, commit
        what passed and the target's own token (to `generated`), yielding each token and then the
        step's figures; returns whether the target ended the generation."""
        step_started = time.perf_counter()
        draft, draft_seconds = self._propose(limit, params, rng, text, find_text_end)
        started = time.perf_counter()
        verdict, rows = self._verify(draft, params, randoms)
        verify_seconds = time.perf_counter() - started
        if self.drafter is not None:
            self.drafter.feedback(draft, verdict.accepted, draft_seconds, verify_seconds, rows[: verdict.accepted + 1])
        new = draft.tokens[: verdict.accepted] + [verdict.token]
        sources = draft.token_sources()[: verdict.accepted] + ["target"]
        ended = False
        for kept, (token, source) in enumerate(zip(new, sources), start=1):
            self.history.append(token)
            if self.target.is_eog(token):  # the end: the target's token after it is not committed
                ended = True
                break
            generated.append(token)
            yield TokenCommitted(token, text.push(token), source)
            self._resumed(generation)
        self._settle()
        yield StepDone(
            draft.source if draft.tokens else None,
            len(draft.tokens),
            verdict.accepted,
            kept,
            draft_seconds,
            verify_seconds,
            time.perf_counter() - step_started,
            draft.model_seconds,
            draft.sources[: len(draft.tokens)],
        )
        self._resumed(generation)
        return ended

    def _prefill(self, prompt: list[int], stop: Callable[[], bool] | None = None) -> PrefillDone:
        """Make the target's KV cache hold prompt[:-1], reusing what it already holds; `stop` is asked
        between batches of the target's n_batch (the batches one evaluation would read), and where it
        says stop, history holds what was read (the next prompt reuses it)."""
        started = time.perf_counter()
        reused = common_prefix(self.history[:-1], prompt[:-1]) if self.history and self._holds_kv() else 0
        reused = min(reused, self.target.n_past)
        self.history = list(prompt[: reused + 1])  # true of the KV cache whatever stops the reading (an exception too)
        read = self._read(prompt, reused, stop)
        self.history = list(prompt[: read + 1])
        if self.drafter is not None and len(self.history) == len(prompt):
            self.drafter.start(self.history)
        return PrefillDone(len(prompt), reused, time.perf_counter() - started)

    def _read(self, tokens: list[int], start: int, stop: Callable[[], bool] | None = None) -> int:
        """Make the target's KV cache hold tokens[:-1], keeping the first `start` it holds, in batches
        of its n_batch, asking `stop` between them; returns how many it holds."""
        self.target.rewind(start)
        read = start
        while read < len(tokens) - 1 and not (stop is not None and stop()):
            batch = tokens[read : min(read + self.target.n_batch, len(tokens) - 1)]
            self.target.evaluate(batch, [])
            read += len(batch)
        self._kv_edits = getattr(self.target, "kv_edits", None)
        return read

    def _propose(self, limit: int, params, rng, text: _TextStream, find_text_end=None) -> tuple[Draft, float]:
        """The drafter's draft, cut after the token where `find_text_end` says the text ends (the
        drafters themselves stop at the target's end tokens)."""
        started = time.perf_counter()
        draft = None
        if self.drafter is not None and limit > 0:
            size = self.budget(self.history, limit)
            if size > 0:
                draft = self.drafter.propose(self.history, size, params, rng)
        if draft is not None and draft.tokens and find_text_end is not None:
            end = find_text_end(text.peek(draft.tokens))
            if end is not None:
                q_draft = None if draft.q_draft is None else draft.q_draft[: end + 1]
                draft = replace(draft, tokens=draft.tokens[: end + 1], q_draft=q_draft)
        return draft or Draft([], None, "target"), time.perf_counter() - started

    def _verify(self, draft: Draft, params, randoms: Randoms | None):
        last, position = self.history[-1], len(self.history)  # row i chooses the token at position + i
        k = len(draft.tokens)
        logits = self.target.evaluate([last, *draft.tokens], list(range(k + 1)), copy=False)
        self._kv_edits = getattr(self.target, "kv_edits", None)  # holds history[:-1] still: a generation abandoned mid-step leaves it reusable
        return verify(logits, draft.tokens, draft.q_draft, params, lambda i: randoms.at(position + i)), logits

    def _settle(self) -> None:
        """Rewind the target to hold history[:-1] and tell the drafter what was committed."""
        if self._holds_kv():  # else another decoder used it while this step's tokens were taken: read again at the next step
            self.target.rewind(len(self.history) - 1)
            self._kv_edits = getattr(self.target, "kv_edits", None)
        if self.drafter is not None:
            self.drafter.commit(self.history)


class _TextStream:
    """Turns token bytes into text without ever emitting half a UTF-8 character."""

    def __init__(self, backend: Backend):
        import codecs

        self.backend = backend
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token: int) -> str:
        piece = self._decoder.decode(self.backend.token_bytes(token))
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text's end: the bytes of a character the generation's end cut (a token limit inside a
        character of several tokens) are dropped, not shown as "\\ufffd": the rest never comes."""
        self._decoder.reset()
        return ""

    def peek(self, tokens: list[int]) -> list[str]:
        """The pieces `push` would give for these tokens, the stream left as it was."""
        state = self._decoder.getstate()
        try:
            return [self._decoder.decode(self.backend.token_bytes(token)) for token in tokens]
        finally:
            self._decoder.setstate(state)


# -- the reference -------------------------------------------------------------------------


def generate_plain(
    target: Backend, prompt: list[int], max_tokens: int, params: SamplingParams, rng: np.random.Generator
) -> list[int]:
    """Plain decoding, one token per target pass, same prefill and sampler (and the same draw at
    each position for the same `rng`): the reference."""
    target.rewind(0)
    if len(prompt) > 1:
        target.evaluate(prompt[:-1], [])
    randoms = None if params.greedy else Randoms.drawn_from(rng)
    last, out = prompt[-1], []
    while len(out) < max_tokens and target.n_past < target.n_ctx:
        logits = target.evaluate([last], [0], copy=False)[0]
        last = argmax(logits) if params.greedy else draw(logits, params, randoms.at(len(prompt) + len(out)))
        if target.is_eog(last):
            break
        out.append(last)
    return out
