"""What the engine needs from a model: the whole of it. `specllm.backend` implements it with llama.cpp;
tests and the replay script implement it with fakes."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Backend(Protocol):
    """What the decode loop needs from a model."""

    n_vocab: int
    n_ctx: int
    n_batch: int  # the most tokens one evaluation reads at once (a longer input is read in such batches)
    n_past: int  # tokens held in the KV cache
    # Optional, read with getattr: `kv_edits`, a count of the changes to the KV cache, by which a
    # decoder sees that another user of the model changed it (None where a backend does not count).

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def evaluate(self, tokens: Sequence[int], rows: Sequence[int], copy: bool = True) -> np.ndarray:
        """Append `tokens` to the KV cache; the logits of `rows`. `copy=False`: the caller reads them
        before the model's next evaluate, so they may be the model's own buffer."""

    def rewind(self, n_past: int) -> None: ...
