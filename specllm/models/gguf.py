"""Check a GGUF file before llama.cpp sees it, and read what the vocabulary check needs.

gguf's own GGUFReader decodes every metadata array in Python (seconds for a 150k-token
vocabulary), so this walks the header with the package's type tables instead: it skips
arrays without decoding them, and fingerprints the token list by hashing its raw bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from specllm.errors import SpecllmError

_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_LENGTH = struct.Struct("<Q")  # a string's byte length, before its bytes
_KEEP = (
    "general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
)  # fmt: skip


@dataclass
class GGUFInfo:
    path: Path
    size: int
    metadata: dict = field(default_factory=dict)  # the scalar keys in _KEEP
    n_tokens: int = 0  # entries of tokenizer.ggml.tokens
    tokens_digest: str = ""  # sha256 of the raw token list: equal digests, equal vocabularies
    tensor_count: int = 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))


def inspect(path: str | Path) -> GGUFInfo:
    """Validate `path` as a complete GGUF file; raise SpecllmError naming the file and the problem."""
    path = Path(path)
    if not path.exists():
        raise SpecllmError(f"model file not found: {path}")
    if path.is_dir():
        raise SpecllmError(f"{path}: is a directory, not a GGUF file")
    if not os.access(path, os.R_OK):
        raise SpecllmError(f"{path}: permission denied")
    size = path.stat().st_size
    if size == 0:
        raise SpecllmError(f"{path}: the file is empty")
    with open(path, "rb") as fh:
        if fh.read(4) != struct.pack("<I", gguf.GGUF_MAGIC):
            raise SpecllmError(f"{path}: not a GGUF file (wrong magic bytes)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _walk(path, data)
            except (struct.error, OverflowError, _PastEnd):  # OverflowError: a length that points past 2**63
                raise SpecllmError(f"{path}: truncated GGUF: the file ends inside its header ({size} bytes)") from None
            except (IndexError, ValueError, KeyError) as exc:
                raise SpecllmError(f"{path}: damaged GGUF header ({exc})") from None


class _PastEnd(Exception):
    """The header claims more bytes than the file has."""


def _walk(path: Path, data: mmap.mmap) -> GGUFInfo:
    info = GGUFInfo(path, len(data))
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise SpecllmError(f"{path}: unsupported GGUF version {version}")
    info.tensor_count = tensor_count
    # every key and tensor takes 13 and 24 bytes at least: a count the file cannot hold is a lie, not minutes of walking
    if kv_count * 13 + tensor_count * 24 > len(data):
        raise _PastEnd()
    offset = 24
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for _ in range(kv_count):
        key, offset = _string(data, offset)
        if key in keys:  # llama.cpp refuses it too; and zeros past a lying count read as empty keys
            raise ValueError(f"duplicate key {key!r}")
        keys.add(key)
        (vtype,), offset = struct.unpack_from("<I", data, offset), offset + 4
        start = offset
        value, offset = _value(data, offset, gguf.GGUFValueType(vtype))
        if key in _KEEP:
            info.metadata[key] = value
        elif key == "general.alignment":
            alignment = int(value)
        elif key == "tokenizer.ggml.tokens":
            info.n_tokens = struct.unpack_from("<Q", data, start + 4)[0]
            info.tokens_digest = hashlib.sha256(data[start:offset]).hexdigest()
    data_end = 0
    for _ in range(tensor_count):
        name, offset = _string(data, offset)
        (n_dims,) = struct.unpack_from("<I", data, offset)
        if n_dims > 4:  # GGML_MAX_DIMS
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
        ttype, tensor_offset = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        n_elements = 1
        for d in dims:
            n_elements *= d
        data_end = max(data_end, tensor_offset + n_elements // block * block_bytes)
    if offset > len(data):
        raise _PastEnd()
    data_start = -(-offset // alignment) * alignment
    if data_start + data_end > len(data):
        missing = data_start + data_end - len(data)
        raise SpecllmError(f"{path}: truncated GGUF: the tensor data needs {missing} more bytes than the file has")
    return info


def _string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise _PastEnd()
    return data[offset + 8 : end].decode("utf-8", "replace"), end


def _skip_strings(data: mmap.mmap, offset: int, count: int) -> int:
    """The offset after `count` strings starting at `offset`, read by their lengths alone."""
    length_at = _LENGTH.unpack_from
    if count * 8 > len(data) - offset:
        raise _PastEnd()
    for _ in range(count):
        offset += 8 + length_at(data, offset)[0]
    if offset > len(data):
        raise _PastEnd()
    return offset


def _value(data: mmap.mmap, offset: int, vtype: gguf.GGUFValueType):
    if vtype == gguf.GGUFValueType.STRING:
        return _string(data, offset)
    if vtype == gguf.GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        item_type = gguf.GGUFValueType(item_type)
        if item_type in _SCALARS:  # skip fixed-size items without decoding them
            return None, offset + count * struct.calcsize(_SCALARS[item_type])
        if item_type == gguf.GGUFValueType.STRING:  # a vocabulary or its merges: 150k strings, lengths only
            return None, _skip_strings(data, offset, count)
        if count * 12 > len(data) - offset:  # only arrays of arrays come here: 12 bytes each at least
            raise _PastEnd()
        for _ in range(count):
            _, offset = _value(data, offset, item_type)
        return None, offset
    fmt = _SCALARS[vtype]
    return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
