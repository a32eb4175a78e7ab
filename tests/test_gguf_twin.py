"""scripts/gguf_twin.py: a model's layout with synthetic weights, which llama.cpp loads and runs."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFReader, quants

from specllm.backend import LlamaBackend, LoadOptions
from specllm.errors import SpecllmError
from specllm.models import gguf
from tests.script_loader import load_script

twin = load_script("gguf_twin")


@pytest.fixture(scope="module")
def tiny_target(tiny_pair) -> GGUFReader:
    """The tiny target as the gguf package reads it, once for the module: it reads the 49152-token
    vocabulary field by field in Python, seconds on a busy 2-core machine."""
    return GGUFReader(tiny_pair[0])


@pytest.mark.parametrize("kind", sorted(twin.BLOCKS))
def test_every_block_layout_gives_small_finite_weights(kind):
    """Decoded by the gguf package's own dequantization: a scale written at the wrong offset would
    leave random bytes as the scale (weights in the thousands, or NaN)."""
    block, values, _, _ = twin.BLOCKS[kind]
    out = io.BytesIO()
    twin._write_tensor(out, {"name": "blk.0.ffn_up.weight", "type": kind, "bytes": 64 * block}, np.random.default_rng(0))
    weights = quants.dequantize(np.frombuffer(out.getvalue(), np.uint8).reshape(64, block), GGMLQuantizationType[kind])
    assert weights.size == 64 * values and np.isfinite(weights).all()
    assert 0 < np.abs(weights).max() < 0.05 and weights.std() > 1e-4


def test_a_twin_has_the_models_layout_and_runs_through_llama_cpp(tiny_pair, tiny_target, tmp_path):
    model = tiny_pair[0]
    twin.write_header(model, tmp_path / "tiny")
    twin.expand(tmp_path / "tiny", tmp_path / "twin.gguf")
    original, copy = tiny_target, GGUFReader(tmp_path / "twin.gguf")
    assert (tmp_path / "twin.gguf").stat().st_size == model.stat().st_size
    assert list(copy.fields) == list(original.fields)
    layout = [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in original.tensors]
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in copy.tensors] == layout
    assert not all(np.array_equal(a.data, b.data) for a, b in zip(original.tensors, copy.tensors))  # synthetic weights
    backend = LlamaBackend(tmp_path / "twin.gguf", LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0))
    try:
        logits = backend.evaluate(backend.tokenize("The quick brown fox"), [0, 1])
        assert logits.shape == (2, backend.n_vocab) and np.isfinite(logits).all()
    finally:
        backend.close()


def test_a_resized_twin_runs_and_at_the_models_own_sizes_is_its_layout(tiny_pair, tiny_target, tmp_path):
    model = tiny_pair[0]  # 2 layers, 64 wide, 4 heads of 16, a feed-forward of 128
    same = twin.resize(model, tmp_path / "same", layers=2, embd=64, ffn=128, heads=4, kv_heads=4)
    assert same["size"] == model.stat().st_size
    assert {(t["name"], t["type"], t["bytes"]) for t in same["tensors"]} == {
        (t.name, t.tensor_type.name, int(t.n_bytes)) for t in tiny_target.tensors
    }
    bigger = twin.resize(model, tmp_path / "bigger", layers=3, embd=128, ffn=256, heads=4, kv_heads=2)
    assert len(bigger["tensors"]) == len(same["tensors"]) + 9
    twin.expand(tmp_path / "bigger", tmp_path / "bigger.gguf")
    backend = LlamaBackend(tmp_path / "bigger.gguf", LoadOptions(n_ctx=256, n_threads=1, n_gpu_layers=0))
    try:
        logits = backend.evaluate(backend.tokenize("The quick brown fox"), [0])
        assert np.isfinite(logits).all()
        fields = GGUFReader(tmp_path / "bigger.gguf").fields
        assert [fields[f"llama.{key}"].contents() for key in ("block_count", "embedding_length", "attention.head_count_kv")] == [3, 128, 2]
    finally:
        backend.close()


def _lying_header(tensor_count: int, kv_count: int, body: bytes, size: int) -> bytes:
    head = struct.pack("<I", GGUF_MAGIC) + struct.pack("<IQQ", 3, tensor_count, kv_count) + body
    return head + bytes(size - len(head))


def _key(name: bytes, vtype: int) -> bytes:
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype)


@pytest.mark.parametrize(
    "kind, header",
    [
        # a vocabulary whose first string claims 2**64 - 9 bytes: an offset past 2**63
        ("string length", _lying_header(0, 1, _key(b"tokenizer.ggml.tokens", 9) + struct.pack("<IQQ", 8, 2, 2**64 - 9), 200)),
        ("array count", _lying_header(0, 2, _key(b"x", 9) + struct.pack("<IQ", 10, 2**62), 200)),
        ("key count", _lying_header(0, 2**63, b"", 4_000_000)),  # zeros after it: empty keys, 13 bytes each
        ("tensor count", _lying_header(2**40, 0, b"", 4_000_000)),
        ("zeros past the keys", _lying_header(0, 1000, b"", 4_000_000)),
    ],
    ids=lambda case: case if isinstance(case, str) else "",
)
def test_inspect_refuses_a_lying_header_at_once(tmp_path, monkeypatch, kind, header):
    """Counts and lengths the file cannot hold are a damaged header: one line, no traceback, and no
    walk over what the counts claim (13 bytes a key over a 1.6 GB file of zeros took minutes)."""
    path = tmp_path / "lying.gguf"
    path.write_bytes(header)
    strings = []  # every key and tensor name read
    read_string = gguf._string
    monkeypatch.setattr(gguf, "_string", lambda data, offset: strings.append(offset) or read_string(data, offset))
    with pytest.raises(SpecllmError, match="truncated GGUF|damaged GGUF") as caught:
        gguf.inspect(path)
    assert str(path) in str(caught.value) and len(strings) <= 2
