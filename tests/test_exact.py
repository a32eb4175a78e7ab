"""`--exact`: llama.cpp kernels whose batched rows equal single tokens' bit for bit, so greedy
speculation gives plain decoding's text with no near tie left to flip.

Without it a batched verification's logits differ from a single token's by up to ~0.5 on the
default pair (tests/test_lossless_real.py tolerates the flips that causes). Three CPU kernels do
it (`specllm.backend` says which); `exact` switches each off, and a model whose kernels still
differ is refused at load rather than trusted. Switches llama.cpp reads once per process are
tested in a process of their own.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import specllm.backend as backend
from specllm.backend import LlamaBackend, LoadOptions, check_batch_invariance, gpu_layers
from specllm.errors import SpecllmError
from tests.cli_helpers import ROOT, assert_one_error, specllm_here
from tests.fakes import FakeBackend

# Where the kernels have no other path (x86-64 builds: AVX2 or AVX-512, as the README's CPU users
# have), exact loads must succeed; elsewhere (an ARM CPU's int8 matrix kernels take two rows at a
# time) they may be refused, never wrong.
MUST_LOAD = platform.machine().lower() in ("x86_64", "amd64")


class BatchNoise(FakeBackend):
    """A fake whose batched rows carry a little rounding noise, as llama.cpp's batched kernels do."""

    path = "noisy.gguf"

    def evaluate(self, tokens, rows, copy=True):
        out = super().evaluate(tokens, rows, copy)
        return out + np.float32(1e-3) if len(tokens) > 1 else out


def test_a_model_whose_batched_rows_differ_is_refused_in_one_line():
    with pytest.raises(SpecllmError) as caught:
        check_batch_invariance(BatchNoise(n_vocab=16))
    message = str(caught.value)
    assert "noisy.gguf" in message and "exact kernels are not available here" in message and "\n" not in message


def test_a_model_whose_batched_rows_agree_passes_and_keeps_no_kv():
    model = FakeBackend(n_vocab=16)
    check_batch_invariance(model)
    assert model.n_past == 0 and model.evaluations == [1, len(model.tokenize(backend.EXACT_CHECK_TEXT)[:8])]


def test_exact_loads_take_the_cpu_and_switch_off_the_batch_kernels(tiny_pair, monkeypatch):
    """No extra buffer types (repacked layouts), the tiled kernel's switch, flash attention's
    per-row kernel, V cached in another type than K; and the target on the CPU whatever was asked."""
    import llama_cpp

    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")  # the loader sets it to 0; this test's end takes it away again
    seen = {}
    load, init = llama_cpp.llama_model_load_from_file, llama_cpp.llama_init_from_model

    def spy_load(path, params):
        seen["extra"], seen["ngl"] = params.use_extra_bufts, params.n_gpu_layers
        return load(path, params)

    def spy_init(model, params):
        seen["flash"], seen["k"], seen["v"] = params.flash_attn_type, params.type_k, params.type_v
        return init(model, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy_load)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", spy_init)
    monkeypatch.setattr(backend, "check_batch_invariance", lambda model: None)  # tiny models are F32: see below
    options = LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=7, exact=True)
    model = LlamaBackend(tiny_pair[0], options)
    model.close()
    assert gpu_layers(options) == 0 and seen["ngl"] == 0 and seen["extra"] is False
    assert os.environ["GGML_CPU_TILED_MM"] == "0"
    assert seen["flash"] == 1 and seen["k"] != seen["v"]


def test_an_exact_model_is_exact_or_refused(tiny_pair, monkeypatch):
    """The tiny models' F32 weights go through llamafile's matrix kernel for batches of 2 or more
    on x86 and ARM builds (no switch for it): such a model is refused; where it loads, its batched
    rows must equal single tokens'."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")  # not left to the processes later tests start
    try:
        model = LlamaBackend(tiny_pair[0], LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0, exact=True))
    except SpecllmError as refused:
        assert "exact kernels are not available here" in str(refused)
        return
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog")
    alone = np.vstack([np.array(model.evaluate([t], [0])) for t in tokens])
    model.rewind(0)
    together = np.array(model.evaluate(tokens, list(range(len(tokens)))))
    model.close()
    assert np.array_equal(alone, together)


def test_exact_with_gpu_layers_is_a_usage_error(home):
    done = specllm_here(home, "run", "--exact", "--gpu-layers", "4", "-p", "hi")
    assert_one_error(done, 2, "--exact runs the target on the CPU")


# -- the default pair, in processes of their own -------------------------------------------------

EXACT_SCRIPT = """
import json, sys
import numpy as np
from specllm.backend import LoadOptions
from specllm.engine.decode import StepDone
from specllm.engine.sampling import SamplingParams
from specllm.session import Engine, ModelPaths, SpecConfig

target, prompt_file = sys.argv[1], sys.argv[2]
engine = Engine(ModelPaths(target), SpecConfig("ngram"), LoadOptions(n_ctx=1024, n_threads=2, exact=True), LoadOptions(), None)
model = engine.target
tokens = engine.encode(open(prompt_file).read())
depth = 300  # past 256 cached tokens: where flash attention would split one token's cache among threads
model.evaluate(tokens[:depth], [])
alone = np.vstack([np.array(model.evaluate([t], [0])) for t in tokens[depth : depth + 24]])
splits = {}
for sizes in ([24], [4] * 6, [3, 5, 16], [8, 8, 8], [2] * 12):
    model.rewind(depth)
    rows, at = [], depth
    for size in sizes:
        rows.append(np.array(model.evaluate(tokens[at : at + size], list(range(size)))))
        at += size
    splits[str(sizes)] = float(np.max(np.abs(np.vstack(rows) - alone)))
texts = {}
for strategy in ("off", "ngram"):
    events = list(engine.decoder(strategy).generate(tokens, 64, SamplingParams(temperature=0.0), np.random.default_rng(0)))
    drafted = sum(e.drafted for e in events if isinstance(e, StepDone))
    texts[strategy] = {"tokens": events[-1].tokens, "drafted": drafted}
print(json.dumps({"prompt_tokens": len(tokens), "splits": splits, "texts": texts}))
"""

# A code edit of about 400 tokens: the n-gram cache drafts from it at once.
EDIT = textwrap.dedent('''
    Add type hints to this module. Reply with the whole module.

    import re

    WORD = re.compile(r"[A-Za-z']+")


    def words(text):
        return [match.group(0).lower() for match in WORD.finditer(text)]


    def counts(text):
        table = {}
        for word in words(text):
            table[word] = table.get(word, 0) + 1
        return table


    def most_common(text, n=10):
        ranked = sorted(counts(text).items(), key=lambda item: (-item[1], item[0]))
        return ranked[:n]


    def lengths(text):
        table = {}
        for word in words(text):
            table.setdefault(len(word), []).append(word)
        return table


    def longest(text):
        found = words(text)
        return max(found, key=len) if found else None


    def sentences(text):
        parts = re.split(r"(?<=[.!?])\\s+", text.strip())
        return [part for part in parts if part]


    def average_length(text):
        found = words(text)
        return sum(len(word) for word in found) / len(found) if found else 0.0


    def palindromes(text):
        return sorted({word for word in words(text) if len(word) > 2 and word == word[::-1]})


    def vowels(text, letters="aeiou"):
        table = dict.fromkeys(letters, 0)
        for char in text.lower():
            if char in table:
                table[char] += 1
        return table


    def report(text, n=5):
        lines = [f"{word}: {count}" for word, count in most_common(text, n)]
        lines.append(f"longest: {longest(text)}")
        return "\\n".join(lines)
''')


def _in_a_process(home, script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=home, cwd=ROOT, timeout=timeout)


def test_greedy_speculation_is_plain_decoding_bit_for_bit(qwen_pair, home, tmp_path):
    """Past 256 cached tokens, every split of 24 tokens into batches gives the logits of one token at
    a time, to the bit; `off` and `ngram` (which drafts) give the same tokens."""
    prompt = tmp_path / "edit.txt"
    prompt.write_text(EDIT)
    done = _in_a_process(home, EXACT_SCRIPT, qwen_pair[0], prompt)
    if done.returncode and not MUST_LOAD and "exact kernels are not available here" in done.stderr:
        return  # refused where kernels cannot be switched: said, not wrong
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["prompt_tokens"] >= 324
    assert result["splits"] == {split: 0.0 for split in result["splits"]}
    off, ngram = result["texts"]["off"], result["texts"]["ngram"]
    assert ngram["drafted"] > 0 and len(off["tokens"]) == 64
    assert ngram["tokens"] == off["tokens"]


LATCHED_SCRIPT = """
import sys
from specllm.backend import LlamaBackend, LoadOptions
from specllm.errors import SpecllmError

first = LlamaBackend(sys.argv[2], LoadOptions(n_ctx=256, n_threads=2))
first.evaluate(first.tokenize(" one two three four five six seven eight nine ten"), [0])  # the tiled kernel's switch is read
try:
    LlamaBackend(sys.argv[1], LoadOptions(n_ctx=256, n_threads=2, exact=True))
except SpecllmError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_process_that_computed_before_asking_is_refused(qwen_pair, home):
    """llama.cpp reads the tiled kernel's switch at its first matrix product: a library user who
    evaluated a model before loading an exact one cannot have it, and is told so instead of
    getting batched rows that differ."""
    done = _in_a_process(home, LATCHED_SCRIPT, *qwen_pair)
    if MUST_LOAD:
        assert done.returncode == 3, done.stderr[-3000:]
    if done.returncode == 3:
        assert "exact kernels are not available here" in done.stdout
    else:
        assert done.returncode == 0, done.stderr[-3000:]
