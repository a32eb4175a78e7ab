"""A tiny model given fill-in-the-middle tokens, for the /infill tests and the replay of edits.

`FIM_EDITS` renames three of the tiny tokenizer's unused control tokens as StarCoder's FIM tokens;
`ROOMY` loads it with room for other files beside llama.cpp's batch; `PREFIX`, `SUFFIX` and `EXTRA`
are an editor's request (the code before and after the gap, another file). The module-scoped
fixtures `fim_model` (the GGUF) and `fim_engine` (an n-gram engine on it) are imported by the test
modules that use them.
"""

from __future__ import annotations

import pytest

from specllm.backend import LoadOptions
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.tiny_gguf import write_tiny_gguf

# Three of the tiny tokenizer's unused control tokens renamed as StarCoder's FIM tokens, which
# llama.cpp finds by their text; it has <repo_name> and <file_sep> already.
FIM_EDITS = {7: "<fim_prefix>", 8: "<fim_suffix>", 9: "<fim_middle>"}
PREFIX = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return "
SUFFIX = "\n\n\nprint(add(1, 2), sub(3, 4))\n"
EXTRA = [{"filename": "stack.py", "text": "class Stack:\n    def push(self, item):\n        self.items.append(item)\n"}]
# Other files go where the context has room beside llama.cpp's batch of 2048 and the answer.
ROOMY = LoadOptions(n_ctx=4096, n_threads=1, n_gpu_layers=0)


@pytest.fixture(scope="module")
def fim_model(tiny_dir):
    return write_tiny_gguf(tiny_dir / "tiny-fim.gguf", 0, token_edits=FIM_EDITS, n_ctx_train=ROOMY.n_ctx)


@pytest.fixture(scope="module")
def fim_engine(fim_model):
    engine = Engine(ModelPaths(fim_model), SpecConfig("ngram"), ROOMY, ROOMY)
    yield engine
    engine.close()
