"""A fake model with known distributions, implementing the Backend protocol.

Row logits depend on the token being evaluated and on the token before it *as held in the
KV cache*, so a wrong rewind or a position mix-up changes the output and fails a test.
"""

from __future__ import annotations

import numpy as np


class FakeBackend:
    def __init__(self, n_vocab: int = 8, seed: int = 0, eog: int | None = None, n_ctx: int = 512, sharpness: float = 2.0):
        rng = np.random.default_rng(seed)
        self.table = rng.normal(size=(n_vocab, n_vocab, n_vocab)).astype(np.float32) * sharpness
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
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

    def evaluate(self, tokens, rows) -> np.ndarray:
        if self.n_past + len(tokens) > self.n_ctx:
            raise RuntimeError("fake context full")
        self.evaluations.append(len(tokens))
        wanted = set(rows)
        out = []
        for i, token in enumerate(tokens):
            self.kv.append(int(token))
            if i in wanted:
                out.append(self.logits_after(self.kv))
        return np.array(out, dtype=np.float32).reshape(len(out), self.n_vocab)

    def rewind(self, n_past: int) -> None:
        del self.kv[n_past:]


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

    def evaluate(self, tokens, rows):
        start = self.inner.n_past
        out = self.inner.evaluate(tokens, rows)
        for row, logits in zip(rows, out):
            self.rows[start + row] = logits.copy()
        return out
