"""What the tests of a reply's text share (test_reasoning.py, test_reply_output.py, test_server_shared.py).

`QWEN3`: Qwen3's own chat template (tests/data/qwen3-chat-template.jinja), a thinking model's;
`text_of`: a prompt's tokens read back as the model reads them. `FRAKTUR`: two characters of four
bytes each, and `Forced`: a backend that writes a chosen sequence of tokens through the real decode
loop, so that a character of several tokens can be cut by the token limit. `check_every_cut`: a
reasoning splitter gives the same reasoning and answer however a reply is streamed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QWEN3 = (Path(__file__).parent / "data" / "qwen3-chat-template.jinja").read_text()
FRAKTUR = "𝔘𝔫"  # two characters of four bytes each: each is four tokens of a byte-level vocabulary


def text_of(engine, tokens) -> str:
    """The prompt's text as the model reads it, control tokens (<|im_start|>) left out."""
    return b"".join(engine.target.token_bytes(t) for t in tokens).decode("utf-8", "replace")


class Forced:
    """A backend whose logit rows pick `script`'s tokens in turn (and then token `after`), whatever
    the context; the rest (tokenizer, KV cache, token bytes) is `inner`'s."""

    def __init__(self, inner, script: list[int], after: int = 0):
        self.inner, self.script, self.after, self.rows = inner, list(script), after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evaluate(self, tokens, rows, copy=True):
        self.inner.evaluate(tokens, rows, copy)
        out = np.full((len(rows), self.inner.n_vocab), -10.0, dtype=np.float32)
        for row in range(len(rows)):
            out[row, self.script[self.rows] if self.rows < len(self.script) else self.after] = 10.0
            self.rows += 1
        return out


def check_every_cut(make_splitter, text: str, reasoning: str | None, answer: str) -> None:
    """`text` cut at every place and pushed in three pieces into a fresh `make_splitter()`: the same
    reasoning and answer as whole, and no piece empty (a tag or marker cut between pieces is held back)."""
    from specllm.reasoning import CONTENT, REASONING

    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            splitter = make_splitter()
            pieces = [p for part in (text[:i], text[i:j], text[j:]) for p in splitter.push(part)] + splitter.finish()
            assert "".join(t for kind, t in pieces if kind == REASONING) == (reasoning or "")
            assert "".join(t for kind, t in pieces if kind == CONTENT) == answer
            assert all(t for _, t in pieces)
