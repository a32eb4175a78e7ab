"""Draft sources behind one interface: the n-gram cache, a draft model, and their chain.

A drafter proposes up to `max_tokens` tokens that continue the committed history. A
proposal carries the draft distributions it sampled from (`q_draft`, one row per token; None
for a token drawn deterministically, one-hot q, as the n-gram cache's are), or None when every
token is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from specllm.engine import priors
from specllm.engine.ngram import NgramCache, NgramProposal
from specllm.engine.protocol import Backend
from specllm.engine.sampling import SamplingParams, argmax, draw_from, warp_support


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    # A warped draft probability row (V,) per token, None for one-hot on it (an n-gram token), or None: all one-hot.
    # A list, not a stacked array: at 151,936 tokens a row is 1.2 MB, and one-hot rows need none.
    q_draft: Sequence[np.ndarray | None] | None
    source: str  # "ngram" or "draft": where the draft begins
    span: int = 0  # n-gram: how many tokens of context agree with the copied text; draft model: 0
    model_seconds: float = 0.0  # time the draft model spent on this proposal (its catch-up, and its load at a first use, included)
    # Each token's source where `auto` mixes them in one draft (a copy the draft model continues, or
    # the model's tokens and the copy they ran into); empty: every token is `source`'s.
    sources: tuple[str, ...] = ()

    def token_sources(self) -> list[str]:
        return list(self.sources[: len(self.tokens)]) if self.sources else [self.source] * len(self.tokens)


class Drafter(Protocol):
    def propose(self, history: list[int], max_tokens: int, params: SamplingParams, rng: np.random.Generator) -> Draft | None: ...

    def commit(self, history: list[int]) -> None: ...

    def start(self, prompt: list[int]) -> None:
        """A generation begins after `prompt` (commit it); what follows is the target's own output."""

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float, target_rows: np.ndarray) -> None:
        """How the last step fared (`draft` may be empty; `target_rows`: the target's logits for the
        committed tokens, valid only during the call); drafters that do not learn ignore it."""


MEMORY_TOKENS = 8192  # how much text of earlier, abandoned histories the n-gram cache remembers


class NgramDrafter:
    """Proposes what followed the longest recent match of the history's tail: in the history
    first, else in the memory of earlier histories this drafter served (a server's previous
    requests and answers, a chat's rewritten turns)."""

    source = "ngram"

    def __init__(
        self,
        n_min: int,
        n_max: int,
        ends_generation: Callable[[int], bool] = lambda token: False,
        sentence_end: Callable[[int], bool] = lambda token: False,
    ):
        self.cache = NgramCache(n_min, n_max)
        self.memory = NgramCache(n_min, n_max)
        self.output_start = 0  # where the generation being drafted for begins in the history
        self.ends_generation = ends_generation  # the target's end-of-generation tokens (a chat's turn ends)
        self.sentence_end = sentence_end  # the target's tokens that end a sentence

    def propose(self, history, max_tokens, params, rng) -> Draft | None:
        self.commit(history)
        proposal = self.proposal(max_tokens)
        if proposal is None:
            return None
        return Draft(proposal.tokens, None, self.source, proposal.span)

    def proposal(self, max_tokens: int) -> NgramProposal | None:
        """The history's own match, else the memory's (its `source` is -1: not this history's text)."""
        proposal = self.cache.propose(max_tokens)
        if (proposal is None or not proposal.tokens) and len(self.memory):
            proposal = self._propose_from_memory(max_tokens)
        return self._marked(self._up_to_end(proposal), self.cache.tokens)

    def _propose_from_memory(self, max_tokens: int) -> NgramProposal | None:
        """The memory's match, its agreeing span counted within this generation's own tokens (at least
        the matched n-gram): an earlier prompt that ends as this one does says nothing of whether the
        answers agree (the same code around a gap with other files beside it, or a line typed since)."""
        proposal = self.memory.propose_after(self.cache.tokens, max_tokens)
        if proposal is None:
            return None
        own = len(self.cache.tokens) - self.output_start
        return replace(proposal, span=min(proposal.span, max(own, proposal.match_length)))

    def proposal_after(self, text: list[int], max_tokens: int) -> NgramProposal | None:
        """The history's continuation of `text`'s end (the history and tokens drafted after it), or None."""
        return self._marked(self._up_to_end(self.cache.propose_after(text, max_tokens, source_offset=0)), text)

    def _marked(self, proposal: NgramProposal | None, text: list[int]) -> NgramProposal | None:
        """The proposal, marked where a sentence has just begun before it (`text`, which it continues,
        ends a sentence within its last SENTENCE_START tokens): where a summary leaves its source."""
        if proposal is None or not any(self.sentence_end(token) for token in text[-priors.SENTENCE_START :]):
            return proposal
        return replace(proposal, sentence_start=True)

    def _up_to_end(self, proposal: NgramProposal | None) -> NgramProposal | None:
        """The proposal up to its first end-of-generation token: copied text often runs on past the end
        of a turn (a code edit's last line, then the prompt's `<|im_end|>` and the next turn's header),
        and a generation that accepts the end stops there, so nothing after it can be committed."""
        if proposal is None or not proposal.tokens:
            return None
        end = next((i for i, token in enumerate(proposal.tokens) if self.ends_generation(token)), None)
        return proposal if end is None else replace(proposal, tokens=proposal.tokens[: end + 1])

    def commit(self, history: list[int]) -> None:
        """Bring the index in line with the history (usually: append the newly committed tokens).
        A history that abandons what the index holds sends the old text to the memory."""
        known = self.cache.tokens
        n = len(known)
        if n > len(history) or (n and known[n - 1] != history[n - 1]):
            n = common_prefix(known, history)
            self._remember(known[max(n - self.cache.n_max, 0) :])  # the abandoned text, with the n-grams into it
            self.cache.truncate(n)
        self.cache.extend(history[n:])

    def start(self, prompt: list[int]) -> None:
        self.commit(prompt)
        self.output_start = len(prompt)

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float, target_rows: np.ndarray) -> None:
        pass  # fixed drafters do not learn

    def _remember(self, tokens: list[int]) -> None:
        """Keep abandoned text for later matches; past twice the memory's size, the oldest half goes
        (rebuilding the index then, not at every call, keeps remembering cheap)."""
        if len(tokens) <= self.cache.n_max:
            return  # too short to hold a match the history does not have
        self.memory.extend(tokens)
        if len(self.memory) > 2 * MEMORY_TOKENS:
            self.memory.drop_oldest(len(self.memory) - MEMORY_TOKENS)


class ModelDrafter:
    """A smaller model of the same tokenizer drafts token by token while it is confident."""

    source = "draft"

    def __init__(self, model: Backend, p_min: float, n_vocab: int | None = None, ends_generation: Callable[[int], bool] = lambda token: False):
        self.model = model
        self.p_min = p_min
        self.n_vocab = n_vocab or model.n_vocab  # the target's: q rows must line up with p rows
        self.ends_generation = ends_generation  # the target's end-of-generation tokens (the draft model's own may differ)
        model.rewind(0)
        self.kv_tokens: list[int] = []  # what the draft model's KV cache holds, in order
        self._kv_edits = getattr(model, "kv_edits", None)  # the model's count of KV edits when it held kv_tokens
        self.caught_up = 0  # tokens read by the last proposal's catch-up (what `pending` said)
        self.catch_up_seconds = 0.0  # the time of that catch-up's one pass (it gives the first draft token's logits)
        self.steps = 0  # one-token passes of the last proposal: one per drafted token, bar the last where the draft
        # stopped after it (room, end of generation, `look_further`) rather than on the confidence of the next

    def propose(self, history, max_tokens, params, rng, keep_going=None, look_further=None) -> Draft | None:
        """Draft token by token while `keep_going(confidence)` (default: confidence >= p_min), and
        after each drafted token evaluate the next only if `look_further(tokens drafted so far)` (default: always).

        Confidence is the draft's top probability, judged before sampling, so that stopping
        never depends on the token drawn and each drafted token stays an exact sample of q_draft.
        """
        if max_tokens <= 0:
            return None
        keep_going = keep_going or (lambda confidence: confidence >= self.p_min)
        started = time.perf_counter()
        logits = self._catch_up(history)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        self.steps = 0
        while True:
            if params.greedy:
                confidence, token = read_greedy_row(logits)
                if not keep_going(confidence):
                    break
            else:
                # sample(warp(logits)) from the surviving tokens alone; q's whole row only for verification
                keep, p = warp_support(logits, params)
                if not keep_going(float(p.max())):
                    break
                token = draw_from(keep, p, logits.size, rng)
                q_row = np.zeros(logits.size)
                q_row[keep] = p
                rows.append(q_row)
            tokens.append(token)
            if len(tokens) >= max_tokens or self.model.is_eog(token) or self.ends_generation(token) or self.model.n_past + 1 > self.model.n_ctx:
                break  # nothing after an end of generation (the target's, or what the draft model takes for one) can be committed
            if look_further is not None and not look_further(tokens):
                break
            logits = self._fit(self.model.evaluate([token], [0], copy=False)[0])
            self.kv_tokens.append(token)
            self.steps += 1
        self._kv_edits = getattr(self.model, "kv_edits", None)
        if not tokens:  # not confident: an empty draft, so the time spent reading is still accounted
            return Draft([], None, self.source, model_seconds=time.perf_counter() - started)
        return Draft(tokens, rows or None, self.source, model_seconds=time.perf_counter() - started)

    def load(self) -> float:
        """Load a draft model deferred until its first use (`backend.DeferredBackend`); the seconds
        it took (0 when it was loaded already)."""
        if getattr(self.model, "loaded", True):
            return 0.0
        started = time.perf_counter()
        self.model.load()
        return time.perf_counter() - started

    def pending(self, history: list[int]) -> int:
        """How many committed tokens the draft model must read before it can draft (at least 1)."""
        return max(len(history) - common_prefix(self.kv_tokens, history), 1)

    def commit(self, history: list[int]) -> None:
        """Drop KV entries that the committed history contradicts (rejected drafts); all of them where
        something else changed the model's KV cache since (another decoder, a pass cut short)."""
        if getattr(self.model, "kv_edits", None) != self._kv_edits:
            self.model.rewind(0)
            self.kv_tokens.clear()
        keep = common_prefix(self.kv_tokens, history)
        if keep < len(self.kv_tokens):
            self.model.rewind(keep)
            del self.kv_tokens[keep:]
        self._kv_edits = getattr(self.model, "kv_edits", None)

    def start(self, prompt: list[int]) -> None:
        self.commit(prompt)

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float, target_rows: np.ndarray) -> None:
        pass  # p-min decides alone; `auto` learns from the outcomes instead

    def _catch_up(self, history: list[int]) -> np.ndarray:
        """Feed the draft model every committed token it has not seen; return its next-token logits."""
        self.commit(history)
        keep = len(self.kv_tokens)
        if keep == len(history):  # the row for the last token is gone with its batch: recompute it
            keep -= 1
            self.model.rewind(keep)
            del self.kv_tokens[keep:]
        new = history[keep:]
        self.caught_up = len(new)
        started = time.perf_counter()
        # A target token the draft model's smaller vocabulary lacks (the vocabulary check allows a few) would
        # make llama.cpp refuse the batch: it reads token 0 there; verification keeps the output exact.
        own = self.model.n_vocab
        readable = new if max(new) < own else [token if token < own else 0 for token in new]
        logits = self.model.evaluate(readable, [len(new) - 1], copy=False)[0]
        self.catch_up_seconds = time.perf_counter() - started
        self.kv_tokens.extend(new)
        return self._fit(logits)

    def _fit(self, logits: np.ndarray) -> np.ndarray:
        """Cut or pad (with -inf) the draft's row to the target's vocabulary size."""
        if logits.size == self.n_vocab:
            return logits
        out = np.full(self.n_vocab, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.size)
        out[:n] = logits[:n]
        return out


class ChainDrafter:
    """The n-gram cache first; the draft model only when the cache has nothing."""

    def __init__(self, drafters: list):
        self.drafters = drafters

    def propose(self, history, max_tokens, params, rng) -> Draft | None:
        for drafter in self.drafters:
            draft = drafter.propose(history, max_tokens, params, rng)
            if draft is not None and (draft.tokens or drafter is self.drafters[-1]):
                return draft  # an empty draft only from the last: it carries the time spent
        return None

    def commit(self, history: list[int]) -> None:
        for drafter in self.drafters:
            drafter.commit(history)

    def start(self, prompt: list[int]) -> None:
        for drafter in self.drafters:
            drafter.start(prompt)

    def feedback(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float, target_rows: np.ndarray) -> None:
        pass  # fixed drafters do not learn


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. Runs every step on whole histories, so the usual
    case (one is a prefix of the other) is settled by one C-level list comparison."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def read_greedy_row(logits: np.ndarray) -> tuple[float, int]:
    """What a greedy draft step reads from its row of logits besides the pass: its confidence and its
    token (the calibration times a draft step with it: 0.3 ms a row of 151,936, a fifth of a small
    draft model's step on a GPU). The argmax gives the row's maximum too: one pass over it fewer."""
    token = argmax(logits)
    return _max_softmax(logits, logits[token]), token


def max_softmax(logits: np.ndarray) -> float:
    """Probability of the most likely token at temperature 1: the exponentials in float32, summed in
    float64 (a relative error near 1e-7; over a 151,936-token vocabulary float64 took 2.4 ms a
    draft step, float32 0.4 ms)."""
    return _max_softmax(logits, logits.max())


def _max_softmax(logits: np.ndarray, top) -> float:
    """max_softmax, given the row's maximum; the exponentials in place of the differences (one
    allocation, not two)."""
    z = logits - top
    z = np.exp(z, out=z) if z.dtype == np.float32 else np.exp(z, dtype=np.float32)  # llama.cpp's rows are float32
    return float(1.0 / z.sum(dtype=np.float64))
