"""The llama.cpp backend on tiny generated GGUFs, and GGUF validation on broken files.

Batched and one-by-one evaluation agree to llama.cpp's f16 attention rounding (tests/logit_noise.py
says why and by how much); any larger difference means wrong rows, wrong positions or a stale KV cache.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from specllm.backend import ContextFull, DeferredBackend, LlamaBackend, LoadOptions
from specllm.engine.decode import _TextStream, generate_plain
from specllm.engine.sampling import SamplingParams
from specllm.errors import SpecllmError
from specllm.models import gguf
from tests.fakes import FakeBackend
from tests.logit_noise import ROW_TOL, assert_same_rows, row_gaps, tie_tolerance
from tests.tiny_gguf import TINY_VOCAB, truncate_in_header, truncate_in_tensor_data, write_unknown_architecture

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."


def _load(path, n_ctx=256, n_batch=512) -> LlamaBackend:
    return LlamaBackend(path, LoadOptions(n_ctx=n_ctx, n_threads=1, n_gpu_layers=0, n_batch=n_batch))


@pytest.fixture(scope="module")
def target_path(tiny_pair):
    return tiny_pair[0]


@pytest.fixture()
def model(target_path):
    backend = _load(target_path)
    yield backend
    backend.close()


def _one_by_one(model: LlamaBackend, tokens: list[int]) -> np.ndarray:
    model.rewind(0)
    return np.vstack([model.evaluate([t], [0]) for t in tokens])


def test_tiny_model_loads_and_generates(model):
    assert model.n_vocab == TINY_VOCAB and model.n_ctx >= 256
    prompt = model.tokenize(TEXT)
    greedy = generate_plain(model, prompt, 12, SamplingParams(temperature=0.0), None)
    assert len(greedy) == 12
    assert generate_plain(model, prompt, 12, SamplingParams(temperature=0.0), None) == greedy


def test_evaluate_returns_exactly_the_requested_rows(model):
    tokens = model.tokenize(TEXT)
    rows = [0, 3, 7, len(tokens) - 1]
    batched = model.evaluate(tokens, rows)
    assert batched.shape == (len(rows), model.n_vocab)
    assert model.n_past == len(tokens)
    sequential = _one_by_one(model, tokens)
    assert_same_rows(batched, sequential[rows])
    # Each returned row is the one requested, told apart from every other position's row by far more
    # than the tolerance: a row off by one (or from another batch) would fail the check above.
    distances = np.array([row_gaps(np.broadcast_to(row, sequential.shape), sequential) for row in batched])
    assert list(distances.argmin(axis=1)) == rows
    others = [np.delete(d, r).min() for d, r in zip(distances, rows)]
    assert min(others) > 10 * ROW_TOL, others
    # The ranking the sampler sees: the top token is the same wherever its margin is clear of the noise.
    for row, got in zip(sequential[rows], batched):
        first, second = np.sort(row)[-2:][::-1]
        if first - second > tie_tolerance(row):
            assert int(np.argmax(got)) == int(np.argmax(row))
    model.rewind(0)
    assert model.evaluate(tokens, []).shape == (0, model.n_vocab)


def test_rewind_then_reevaluate_reproduces_the_logits(model, target_path):
    tokens = model.tokenize(TEXT)
    first = model.evaluate(tokens, list(range(len(tokens))))
    cut = 6
    other = tokens[:cut] + model.tokenize(" elephants painted the") + tokens[-3:]
    model.rewind(cut)
    assert model.n_past == cut
    rewound = model.evaluate(other[cut:], list(range(len(other) - cut)))
    fresh = _load(target_path)
    expected = fresh.evaluate(other, list(range(len(other))))[cut:]
    assert_same_rows(rewound, expected, "after rewind")
    # The same last three tokens after a different middle: the context must matter by far more
    # than the tolerance, else this test could not see a stale KV cache.
    assert row_gaps(rewound[-1], first[-1])[0] > 10 * ROW_TOL
    model.rewind(cut)
    again = model.evaluate(tokens[cut:], list(range(len(tokens) - cut)))
    assert_same_rows(again, first[cut:], "re-evaluated after rewind")


def test_a_restored_snapshot_holds_the_kv_cache_it_was_taken_from(model):
    tokens = model.tokenize(TEXT)
    cut = 10
    model.evaluate(tokens[:cut], [])
    snapshot = model.snapshot()
    expected = model.evaluate(tokens[cut:], list(range(len(tokens) - cut)))
    model.rewind(3)
    other = model.tokenize(" elephants painted the zebras in purple stripes")[: cut - 3]
    model.evaluate(other, [])  # a cache as long, holding other text
    stale = model.evaluate(tokens[cut:], list(range(len(tokens) - cut)))
    assert row_gaps(stale[-1], expected[-1])[0] > 10 * ROW_TOL  # the cache's content shows in the rows
    model.restore(snapshot)
    assert model.n_past == cut
    assert_same_rows(model.evaluate(tokens[cut:], list(range(len(tokens) - cut))), expected, "after restore")


def test_every_change_of_the_kv_cache_is_counted(model):
    """`kv_edits` tells a decoder whether the cache is still as it left it (decoders of one engine
    share the model): every evaluation, rewind that drops something and restore counts; nothing else."""
    tokens = model.tokenize(TEXT)
    seen = [model.kv_edits]
    model.evaluate(tokens[:6], [])
    seen.append(model.kv_edits)
    snapshot = model.snapshot()
    model.rewind(6)  # drops nothing
    model.tokenize(TEXT)
    model.token_bytes(tokens[0])
    model.snapshot()
    seen.append(model.kv_edits)
    model.rewind(2)
    seen.append(model.kv_edits)
    model.restore(snapshot)
    seen.append(model.kv_edits)
    assert seen[1] > seen[0] and seen[2] == seen[1] and seen[3] > seen[2] and seen[4] > seen[3]


def test_prefill_longer_than_n_batch_is_split_into_chunks(target_path):
    small = _load(target_path, n_batch=16)
    tokens = small.tokenize(TEXT * 3)
    assert len(tokens) > 3 * 16
    rows = [0, 15, 16, 17, 31, 32, len(tokens) - 1]  # on both sides of the chunk boundaries
    chunked = small.evaluate(tokens, rows)
    assert small.n_past == len(tokens)
    whole = _load(target_path).evaluate(tokens, rows)
    assert_same_rows(chunked, whole, "chunked prefill")  # chunks of 16 take other gemm tiles than one of 54


def test_flash_attention_off_reaches_llama_cpp(target_path):
    """`--flash-attn off` loads the model with llama.cpp's other attention path: a token's logits after
    a few hundred cached ones differ in rounding from flash attention's (`on`), and only in rounding."""
    rows = {}
    for setting in ("on", "off"):
        backend = LlamaBackend(target_path, LoadOptions(n_ctx=512, n_threads=1, n_gpu_layers=0, flash_attn=setting))
        tokens = backend.tokenize(TEXT * 20)[:300]
        backend.evaluate(tokens[:-1], [])
        rows[setting] = backend.evaluate(tokens[-1:], [0]).copy()
        assert backend.flash_attn == setting
        backend.close()
    assert not np.array_equal(rows["on"], rows["off"])
    assert_same_rows(rows["on"], rows["off"], "flash attention on against off")


def test_rows_read_in_place_are_the_rows_a_copy_holds(target_path):
    """`copy=False` (the decode loop's verification and the draft model's steps) gives llama.cpp's own
    buffer, read-only, the same rows a copy holds; a batch longer than n_batch still comes back whole."""
    small, other = _load(target_path, n_batch=16), _load(target_path, n_batch=16)
    tokens = small.tokenize(TEXT)[:12]
    rows = [0, 5, 11]
    in_place, copied = small.evaluate(tokens, rows, copy=False), other.evaluate(tokens, rows)
    assert not in_place.flags.writeable and copied.flags.writeable
    assert np.array_equal(in_place, copied)  # the same batch on the same model: the same numbers
    assert small.evaluate([7], [], copy=False).shape == (0, small.n_vocab)
    long = small.tokenize(TEXT * 3)[:40]  # three batches of 16 at most
    assert len(long) == 40
    small.rewind(0), other.rewind(0)
    assert np.array_equal(small.evaluate(long, [3, 20, 39], copy=False), other.evaluate(long, [3, 20, 39]))
    with pytest.raises(ValueError, match="not among"):  # a row past the batch would read past llama.cpp's buffer
        small.evaluate([5, 6], [2], copy=False)


def test_context_full_is_raised_past_n_ctx(model):
    tokens = [1000 + i for i in range(model.n_ctx - 2)]
    model.evaluate(tokens, [])
    with pytest.raises(ContextFull, match="context full"):
        model.evaluate([5, 6, 7], [0])
    assert model.n_past == model.n_ctx - 2  # nothing was evaluated
    assert model.evaluate([5, 6], [1]).shape == (1, model.n_vocab)  # exactly full is fine
    assert model.n_past == model.n_ctx


def test_tokenize_and_token_bytes_round_trip(model):
    text = "def f(x):\n    return x  # héllo wörld — 日本語 🙂\n"
    tokens = model.tokenize(text)
    assert b"".join(model.token_bytes(t) for t in tokens) == text.encode("utf-8")
    eos = model.tokenize("<|im_end|>", parse_special=True)
    assert len(eos) == 1 and model.is_eog(eos[0])
    assert model.token_text(eos[0]) == "<|im_end|>"
    assert model.token_bytes(eos[0]) == b""  # control tokens render as nothing
    assert not any(model.is_eog(t) for t in tokens)


def test_text_stream_never_emits_half_a_character(model):
    text = "naïve 🙂 日本語 — ok"
    tokens = model.tokenize(text)
    pieces = [model.token_bytes(t) for t in tokens]
    assert any(_is_partial(p) for p in pieces), "the text should split a character across tokens"
    stream = _TextStream(model)
    emitted = [stream.push(t) for t in tokens]
    emitted.append(stream.flush())
    assert "".join(emitted) == text
    assert not any("\ufffd" in piece for piece in emitted)
    shown = b""
    for token, piece in zip(tokens, emitted):
        shown += piece.encode("utf-8")
        assert text.encode("utf-8").startswith(shown)


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_a_deferred_model_loads_at_its_first_evaluation_and_only_then():
    loads = []

    def load(path, options):
        loads.append(path)
        return FakeBackend(n_ctx=options.n_ctx)

    model = DeferredBackend("draft.gguf", LoadOptions(n_ctx=64, n_gpu_layers=0), load=load)
    model.rewind(0)  # a fresh decoder clears every cache: nothing to drop yet
    assert (model.path.name, model.n_gpu_layers, model.n_past, model.loaded, loads) == ("draft.gguf", 0, 0, False, [])
    rows = model.evaluate([1, 2, 3], [2])
    assert loads == [model.path] and model.loaded and model.n_ctx == 64
    model.evaluate([4], [0])
    assert model.n_past == 4 and loads == [model.path]  # loaded once
    model.rewind(1)
    assert model.n_past == 1 and rows.shape == (1, FakeBackend().n_vocab)


def test_a_deferred_model_never_used_is_never_loaded():
    model = DeferredBackend("draft.gguf", LoadOptions(), load=lambda path, options: pytest.fail("loaded"))
    model.rewind(0)
    model.close()
    assert not model.loaded


@pytest.mark.parametrize("left_out, extra_buffers", [(None, True), ("AMX", True), ("extra", False)])
def test_models_load_without_the_weight_buffers_left_out(target_path, monkeypatch, left_out, extra_buffers):
    """Where llama.cpp's AMX buffer type could not be taken out alone, its every extra buffer type
    is turned off for each model; elsewhere they stay on, as llama.cpp chooses."""
    import llama_cpp

    import specllm.backend as backend

    backend.buffers_left_out()  # llama.cpp initialised first: it decides once per process
    monkeypatch.setattr(backend, "_buffers_left_out", left_out)
    asked = []
    load = llama_cpp.llama_model_load_from_file

    def spy(path, params):
        asked.append(params.use_extra_bufts)
        return load(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    model = _load(target_path)
    tokens = model.tokenize(TEXT)
    assert model.evaluate(tokens, [len(tokens) - 1]).shape == (1, model.n_vocab)
    model.close()
    assert asked == [extra_buffers]


def test_the_amx_buffer_type_leaves_the_loaders_list_and_the_others_move_up(monkeypatch):
    """llama.cpp's AMX kernels crashed every prompt's prefill on a 2-core Xeon with AMX; its
    repacked layouts (one token 1.3x faster there) must stay."""
    import specllm.backend as backend

    types = (ctypes.c_void_p * 4)(11, 22, 33, None)
    monkeypatch.setattr(backend, "extra_buffer_types", lambda: (types, [b"AMX", b"CPU_REPACK", b"OTHER"]))
    assert backend._drop_extra_buffer_type(b"AMX")
    assert list(types) == [22, 33, None, None]
    monkeypatch.setattr(backend, "extra_buffer_types", lambda: (None, []))
    assert not backend._drop_extra_buffer_type(b"AMX")  # a build whose list cannot be read: every extra type goes


def test_a_ggml_without_the_backend_registry_says_nothing_of_its_buffer_types(monkeypatch):
    import specllm.backend as backend

    monkeypatch.setattr(backend.ctypes, "CDLL", lambda path: object())  # found, but none of the entry points
    assert backend._ggml() is None and backend.extra_buffer_types() == (None, [])


def test_no_model_of_this_process_can_use_llama_cpps_amx_buffers():
    """On a build with AMX kernels (a CPU with AMX_INT8), the list the loader reads has no AMX left
    and llama.cpp's other extra buffer types stay in it; the cost curve's key says so."""
    import specllm.backend as backend

    left_out = backend.buffers_left_out()
    types, names = backend.extra_buffer_types()
    assert b"AMX" not in names
    if "AMX_INT8 = 1" in backend.system_info():
        assert left_out in ("AMX", "extra") and f"specllm: no {left_out} buffers" in backend.system_info()
    else:
        assert left_out is None and "specllm" not in backend.system_info()


# -- broken files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken(tmp_path_factory, target_path):
    folder = tmp_path_factory.mktemp("broken")
    (folder / "empty.gguf").write_bytes(b"")
    (folder / "text.gguf").write_text("this is not a model\n")
    (folder / "a-directory.gguf").mkdir()
    return {
        "missing": (folder / "missing.gguf", "not found"),
        "directory": (folder / "a-directory.gguf", "directory"),
        "empty": (folder / "empty.gguf", "empty"),
        "not GGUF": (folder / "text.gguf", "not a GGUF"),
        "truncated header": (truncate_in_header(target_path, folder / "cut-header.gguf"), "truncated"),
        "truncated data": (truncate_in_tensor_data(target_path, folder / "cut-data.gguf"), "truncated"),
        "unknown architecture": (write_unknown_architecture(folder / "arch.gguf"), None),
    }


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "not GGUF", "truncated header", "truncated data"])
def test_inspect_names_the_file_in_one_line(broken, kind):
    path, words = broken[kind]
    with pytest.raises(SpecllmError) as caught:
        gguf.inspect(path)
    message = str(caught.value)
    assert str(path) in message and words in message
    assert "\n" not in message


def test_inspect_reads_a_good_file(target_path):
    info = gguf.inspect(target_path)
    assert info.architecture == "llama"
    assert info.n_tokens == TINY_VOCAB and info.tensor_count == 2 + 9 * 2 + 1
    assert info.metadata["tokenizer.ggml.model"] == "gpt2"


def test_unknown_architecture_passes_inspect_but_llama_cpp_refuses_it(broken):
    path, _ = broken["unknown architecture"]
    assert gguf.inspect(path).architecture == "nonsense"
    with pytest.raises(SpecllmError, match="could not load") as caught:
        _load(path)
    assert str(path) in str(caught.value)


def test_llama_cpp_refuses_truncated_tensor_data(broken):
    path, _ = broken["truncated data"]
    with pytest.raises(SpecllmError, match="could not load"):
        _load(path)


# -- signals during a load ---------------------------------------------------------------------


def _c_calls_back_into_python_after_a_ctrl_c() -> None:
    """What a load does when Ctrl-C lands in it: C code (libc's qsort here; llama.cpp's loader in
    life) calls a Python callback (llama.cpp's log), where Python runs the signal's handler."""
    import os
    import signal

    compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
    sent = []

    def by_value(a, b):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return a[0] - b[0]

    values = (ctypes.c_int * 4)(3, 1, 2, 0)
    ctypes.CDLL(None).qsort(values, len(values), ctypes.sizeof(ctypes.c_int), compare(by_value))


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "qsort"), reason="no C library with qsort to call back from")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the unheld signal, dropped by ctypes
def test_a_ctrl_c_during_a_load_is_delivered_when_the_load_returns():
    """Raised inside the callback, KeyboardInterrupt is printed and dropped by ctypes (the command went
    on and exited 0); held during the load, it reaches the command once the load returns."""
    from specllm.backend import _signals_held

    _c_calls_back_into_python_after_a_ctrl_c()  # unheld: lost in the callback, nothing raised here
    with pytest.raises(KeyboardInterrupt):
        with _signals_held():
            _c_calls_back_into_python_after_a_ctrl_c()


class _CtrlCAsThePassReturns:
    """llama_cpp as the backend calls it, but a Ctrl-C pressed during `llama_decode`: Python raises
    it as the call returns, the batch already in the KV cache."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def llama_decode(self, ctx, batch):
        self._lib.llama_decode(ctx, batch)
        raise KeyboardInterrupt


@pytest.mark.parametrize("held", [0, 5])
def test_a_pass_stopped_by_ctrl_c_leaves_a_cache_that_rewinds(model, held):
    """A chat whose first prefill or calibration pass met Ctrl-C starts afresh (rewind(0)): with the
    batch in the KV cache but not in `n_past`, that rewind kept it and every later pass failed."""
    tokens = model.tokenize(TEXT)
    expected = model.evaluate(tokens, [len(tokens) - 1])
    model.rewind(0)
    model.evaluate(tokens[:held], [])
    lib, model._lib = model._lib, _CtrlCAsThePassReturns(model._lib)
    with pytest.raises(KeyboardInterrupt):
        model.evaluate(tokens[held:], [])
    model._lib = lib
    assert model.n_past == len(tokens)
    model.rewind(0)
    assert_same_rows(model.evaluate(tokens, [len(tokens) - 1]), expected, "after the interrupted pass")
