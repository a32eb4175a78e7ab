"""Tiny random-weight llama GGUFs for fast backend tests, and broken GGUFs for error paths.

The tokenizer is generated here (`tiny_tokenizer`): a gpt2 byte-level BPE of 49152 tokens laid out
as SmolLM2-135M's (the same 17 control tokens first, `<|im_end|>` the end token, a ChatML chat
template), so text round-trips and the vocabulary checks behave as with real models, and the fast
tier needs no download. A real GGUF's tokenizer can still be copied (`tokenizer_from`). The network
is a few f32 layers of width 64 that llama.cpp evaluates in well under a millisecond.

The output projection is scaled by `sharpness` (the standard deviation of the logits), so
the next-token distributions are peaked: a handful of tokens hold most of the mass, which
makes sampling non-trivial and the outcome space of a few tokens small.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

TOKENIZER_SCALARS = {
    "tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str",
    "tokenizer.ggml.bos_token_id": "u32", "tokenizer.ggml.eos_token_id": "u32",
    "tokenizer.ggml.unknown_token_id": "u32", "tokenizer.ggml.padding_token_id": "u32",
    "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_space_prefix": "bool",
    "tokenizer.chat_template": "str",
}  # fmt: skip


@dataclass(frozen=True)
class Tokenizer:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    scalars: tuple[tuple[str, str, object], ...]  # (key, kind, value)


@functools.lru_cache(maxsize=None)
def read_tokenizer(path: str) -> Tokenizer:
    """The tokenizer fields of a GGUF. GGUFReader takes seconds on a real model: cached per process."""
    reader = gguf.GGUFReader(path)

    def strings(key: str) -> tuple[str, ...]:
        field = reader.fields[key]
        return tuple(bytes(field.parts[i]).decode("utf-8") for i in field.data)

    types = reader.fields["tokenizer.ggml.token_type"]
    scalars = []
    for key, kind in TOKENIZER_SCALARS.items():
        field = reader.fields.get(key)
        if field is not None:
            value = field.contents()
            scalars.append((key, kind, value))
    return Tokenizer(
        tokens=strings("tokenizer.ggml.tokens"),
        token_types=tuple(int(types.parts[i][0]) for i in types.data),
        merges=strings("tokenizer.ggml.merges"),
        scalars=tuple(scalars),
    )


# -- a generated tokenizer ------------------------------------------------------------------

TINY_VOCAB = 49152  # SmolLM2's size, so messages about vocabulary sizes read as with the real family
CONTROL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
)  # fmt: skip
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
N_MERGES = 600
# The text the merges are learned from: English and Python, so prompts of either get multi-byte tokens.
CORPUS = """
The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. Write a Python function
that reverses a string. Summarise the following text in three sentences. In three sentences, why did the
Roman Empire split into east and west? Tell me a long story about a cat that sat on the mat. Add type hints
and a concise docstring to this function; keep everything else exactly the same and reply with the code only.
def add(a, b):
    return a + b

def sub(a, b):
    return a - b

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

for i in range(10):
    print(f"{i}: {i * i}")
import os, sys, json
with open(path, "r", encoding="utf-8") as handle:
    data = json.load(handle)
"""
_PIECES = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-character table: byte b is token text byte_symbols()[b] (a space is 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


def _learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on the pieces of `text`: the most frequent adjacent pair is merged, `n_merges` times."""
    symbols = byte_symbols()
    words = Counter(tuple(symbols[b] for b in piece.encode("utf-8")) for piece in _PIECES.findall(text))
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))  # ties broken by the text: deterministic
        merges.append(best)
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    """Control tokens, the 256 bytes, the learned merges, then filler words up to TINY_VOCAB tokens.

    Fillers are normal tokens no merge produces: the model can generate them (they read as words),
    a prompt never tokenizes to them. Built in well under a second, once per process.
    """
    merges = _learn_merges(CORPUS, N_MERGES)
    tokens = [*CONTROL_TOKENS, *byte_symbols()]
    known = set(tokens)
    for left, right in merges:
        if left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
    tokens += [f"Ġfiller{i}" for i in range(TINY_VOCAB - len(tokens))]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))  # 3: control, 1: normal
    scalars = (
        ("tokenizer.ggml.model", "str", "gpt2"), ("tokenizer.ggml.pre", "str", "smollm"),
        ("tokenizer.ggml.bos_token_id", "u32", 1), ("tokenizer.ggml.eos_token_id", "u32", 2),
        ("tokenizer.ggml.unknown_token_id", "u32", 0), ("tokenizer.ggml.padding_token_id", "u32", 2),
        ("tokenizer.ggml.add_bos_token", "bool", False), ("tokenizer.ggml.add_space_prefix", "bool", False),
        ("tokenizer.chat_template", "str", CHATML),
    )  # fmt: skip
    return Tokenizer(tuple(tokens), tuple(types), tuple(f"{a} {b}" for a, b in merges), scalars)


def write_tiny_gguf(
    path: str | Path,
    seed: int,
    *,
    tokenizer_from: str | Path | None = None,
    n_layers: int = 2,
    width: int = 64,
    n_heads: int = 4,
    n_ff: int = 128,
    sharpness: float = 6.0,
    base_seed: int | None = None,
    noise: float = 0.1,
    drop_last_tokens: int = 0,
    token_edits: dict[int, str] | None = None,
    architecture: str = "llama",
    n_ctx_train: int = 32768,  # as the default models: no --ctx-size a test uses passes it
    chat_template: str | None = None,
    tokenizer_scalars: dict[str, object] | None = None,
) -> Path:
    """Write a llama-architecture GGUF with f32 weights drawn from `numpy.random.default_rng(seed)`.

    With `base_seed`, the weights are those of `base_seed` plus `noise` times those of `seed`:
    a draft model that mostly agrees with its target but not exactly. `drop_last_tokens` cuts
    the vocabulary (and the merges producing the cut tokens), and `token_edits` (id -> text)
    renames tokens, for vocabulary-mismatch tests. The tokenizer is `tiny_tokenizer()` unless
    `tokenizer_from` names a GGUF to copy it from; `chat_template` replaces its chat template, and
    `tokenizer_scalars` other fields of TOKENIZER_SCALARS ({"tokenizer.ggml.add_bos_token": True}).
    """
    path = Path(path)
    tok = tiny_tokenizer() if tokenizer_from is None else read_tokenizer(str(tokenizer_from))
    if chat_template is not None:
        scalars = tuple((key, kind, chat_template if key == "tokenizer.chat_template" else value) for key, kind, value in tok.scalars)
        tok = replace(tok, scalars=scalars)
    if tokenizer_scalars:
        kept = tuple(scalar for scalar in tok.scalars if scalar[0] not in tokenizer_scalars)
        tok = replace(tok, scalars=kept + tuple((key, TOKENIZER_SCALARS[key], value) for key, value in tokenizer_scalars.items()))
    n_vocab = len(tok.tokens) - drop_last_tokens
    shapes = _tensor_shapes(n_layers, width, n_ff, n_vocab)
    weights = _weights(shapes, seed)
    if base_seed is not None:
        base = _weights(shapes, base_seed)
        norms = {name for name in weights if name.endswith("norm.weight")}
        weights = {name: w if name in norms else base[name] + noise * w for name, w in weights.items()}
    weights["output.weight"] *= sharpness

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}-{seed}")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(width)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(width // n_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, tok, n_vocab, token_edits or {})
    for name, array in weights.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_shapes(n_layers: int, width: int, n_ff: int, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """numpy shapes (GGUF writes them reversed, as llama.cpp's ne)."""
    shapes = {"token_embd.weight": (n_vocab, width)}
    for i in range(n_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (width,),
            f"blk.{i}.attn_q.weight": (width, width),
            f"blk.{i}.attn_k.weight": (width, width),
            f"blk.{i}.attn_v.weight": (width, width),
            f"blk.{i}.attn_output.weight": (width, width),
            f"blk.{i}.ffn_norm.weight": (width,),
            f"blk.{i}.ffn_gate.weight": (n_ff, width),
            f"blk.{i}.ffn_up.weight": (n_ff, width),
            f"blk.{i}.ffn_down.weight": (width, n_ff),
        }
    shapes |= {"output_norm.weight": (width,), "output.weight": (n_vocab, width)}
    return shapes


def _weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Norms at 1; matrices scaled by 1/sqrt(fan_in), so activations keep unit size; embeddings N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = np.ones(shape, dtype=np.float32)
            continue
        scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, tok: Tokenizer, n_vocab: int, edits: dict[int, str]) -> None:
    tokens = list(tok.tokens[:n_vocab])
    for token, text in edits.items():
        tokens[token] = text
    merges = list(tok.merges)
    if n_vocab < len(tok.tokens):
        dropped = set(tok.tokens[n_vocab:])
        merges = [m for m in merges if m.replace(" ", "", 1) not in dropped]
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", list(tok.token_types[:n_vocab]))
    writer.add_array("tokenizer.ggml.merges", merges)
    for key, kind, value in tok.scalars:
        if kind == "str":
            writer.add_string(key, value)
        elif kind == "u32":
            writer.add_uint32(key, int(value))
        else:
            writer.add_bool(key, bool(value))


# -- broken files ---------------------------------------------------------------------------


def truncate_in_header(source: str | Path, dest: str | Path, keep: int = 4096) -> Path:
    """The first `keep` bytes: the cut falls inside the metadata (the token list is far longer)."""
    dest = Path(dest)
    with open(source, "rb") as fh:
        dest.write_bytes(fh.read(keep))
    return dest


def truncate_in_tensor_data(source: str | Path, dest: str | Path, cut: int = 1000) -> Path:
    """All but the last `cut` bytes: the header is whole, the last tensor is not."""
    dest = Path(dest)
    data = Path(source).read_bytes()
    dest.write_bytes(data[:-cut])
    return dest


def write_unknown_architecture(path: str | Path, *, tokenizer_from: str | Path | None = None) -> Path:
    """A well-formed GGUF whose `general.architecture` llama.cpp does not know."""
    return write_tiny_gguf(path, 0, tokenizer_from=tokenizer_from, n_layers=1, architecture="nonsense")
