"""The n-gram cache: drafts from text that repeats in the token history.

An incremental index maps every n-gram (n_min..n_max) to its latest positions where it
ended with at least one token after it. Proposing looks up the last n tokens, longest n first,
and offers what followed the latest occurrence, or an older one that the history has been
copying (a common line of code, a phrase, recurs in the text; the copy's source is where the
text agrees for longest). Appending a token costs O(n_max - n_min + 1) dict updates, so the
cache stays fast however long the context grows.
"""

from __future__ import annotations

from dataclasses import dataclass

SPAN_MAX = 32  # how far back a match is followed: a long agreeing run means the text is being copied
OCCURRENCES = 8  # the latest positions of each n-gram kept: where the text being copied may be
# An older occurrence is the source when the history agrees with the text before it for this many
# tokens (and longest): on recorded text (dev.jsonl and the check set) the right tokens proposed
# rose 6-8% in code edits and 4% in summaries against the latest occurrence alone, other text
# unchanged; replayed, code edits gained up to 2%, summaries up to 4%. At 8 tokens retrieval lost
# up to 7% on the Zen 5 curves: the longest of several short agreements overstates a copy.
COPY_SPAN = 16


@dataclass(frozen=True)
class NgramProposal:
    tokens: list[int]
    match_length: int  # n of the n-gram that matched
    span: int = 0  # how many tokens before the continuation agree with the history's tail (<= SPAN_MAX)
    seen: int = 1  # earlier occurrences of the matched n-gram
    consistent: bool = True  # every earlier occurrence was followed by the same token
    source: int = 0  # position in the history of the continuation's first token
    sentence_start: bool = False  # a sentence has just begun before it (`NgramDrafter` tells, from the history's last tokens)


class NgramCache:
    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # n-gram -> [end positions of its latest earlier occurrences (oldest first), occurrences, always the same next token]
        self._index: dict[tuple[int, ...], list] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            # The n-grams ending at the previous position now have a continuation: index them.
            end = len(self.tokens) - 2
            following = self.tokens[-1]
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1 : end + 1])
                entry = self._index.get(key)
                if entry is None:
                    self._index[key] = [[end], 1, True]
                else:
                    ends = entry[0]
                    entry[2] = entry[2] and self.tokens[ends[-1] + 1] == following
                    ends.append(end)
                    if len(ends) > OCCURRENCES:
                        del ends[0]
                    entry[1] += 1

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (a new conversation, an edited history)."""
        if length >= len(self.tokens):
            return
        # Rare (a chat turn that rewrites the tail): rebuilding is simpler than undoing and exact.
        kept = self.tokens[:length]
        self.tokens, self._index = [], {}
        self.extend(kept)

    def propose(self, max_tokens: int) -> NgramProposal | None:
        """The continuation of the longest recent match of the history's tail, or None."""
        return self.propose_after(self.tokens, max_tokens, source_offset=0)

    def propose_after(self, tail: list[int], max_tokens: int, source_offset: int | None = None) -> NgramProposal | None:
        """The continuation, in this cache's text, of the longest match of `tail`'s end (another
        history's, for a memory of earlier text). `source` is the continuation's position plus
        `source_offset`, or -1 when None: the text is not part of the history being drafted for."""
        if max_tokens <= 0:
            return None
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            entry = self._index.get(tuple(tail[-n:]))
            if entry is not None:
                ends, seen, consistent = entry
                spans = [(self._span(end, n, tail), end) for end in ends]
                span, end = max(spans)  # the longest agreement (ties: the latest)
                if span < COPY_SPAN:  # no copy's source: the latest occurrence
                    span, end = spans[-1]
                continuation = self.tokens[end + 1 : end + 1 + max_tokens]
                source = end + 1 + source_offset if source_offset is not None else -1
                return NgramProposal(continuation, n, span, seen, consistent, source)
        return None

    def drop_oldest(self, n: int) -> None:
        """Forget the first n tokens (a bounded memory keeps the most recent text)."""
        kept = self.tokens[n:]
        self.tokens, self._index = [], {}
        self.extend(kept)

    def _span(self, end: int, n: int, tail: list[int]) -> int:
        """Length of the agreement between `tail`'s end and this cache's text ending at `end`."""
        text, span = self.tokens, n
        while span < SPAN_MAX and end - span >= 0 and span < len(tail) and text[end - span] == tail[-span - 1]:
            span += 1
        return span


SENTENCE_FINAL = (".", "!", "?", "。", "！", "？")


def ends_sentence(piece: bytes) -> bool:
    """Whether a token's text ends a sentence: final punctuation with nothing but closing quotes,
    brackets and whitespace around it ('.', '.\\n\\n', '!"', ' ?'), not a word ('Mr.') or code ('.append').
    A copy crosses it less often than it runs on inside a sentence."""
    text = piece.decode("utf-8", "replace").strip()
    return bool(text) and not any(c.isalnum() for c in text) and text.rstrip("\"'’”)]").endswith(SENTENCE_FINAL)
