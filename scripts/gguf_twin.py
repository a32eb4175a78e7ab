"""A GGUF twin: a model's metadata and tensor layout, with synthetic weights of the same types.

What a pass costs depends on the tensors' shapes and quantization types, not on their values, so a
twin times like the model it copies. It is how a machine that cannot fetch the model (a GPU lent for
a few minutes, with no network) measures a cost curve for it: the header (metadata, tokenizer, tensor
infos; 6 MB for Qwen2.5-Coder 1.5B) travels, the weights (1.1 GB) are made there.

    python scripts/gguf_twin.py header MODEL.gguf PREFIX      # PREFIX.head (the file's bytes before its data) and PREFIX.json
    python scripts/gguf_twin.py expand PREFIX OUT.gguf        # the twin; needs numpy only
    python scripts/gguf_twin.py resize MODEL.gguf PREFIX --layers 64 --embd 5120 --ffn 27648 --heads 40 --kv-heads 8

`resize` writes the header of a bigger (or smaller) model of the same family and tokenizer, for a
size not at hand (Qwen2.5-Coder 32B from the 1.5B, above): every layer's tensors at the new widths,
each of its quantization types, and where the model mixes two types for one tensor across layers
(attn_v and ffn_down in the Q4_K_M files: half their layers Q6_K), each type where it lies in the
source, in proportion (at the source's own sizes, the source's layout exactly).

Quantized blocks are random bytes with their scales set small, so that the weights stay within a few
hundredths and activations stay finite (no value in a kernel's way: no NaN, no denormal).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# ggml type -> (bytes per block, values per block, byte offsets of the block's float16 scales, the scale)
# chosen so that |weight| stays under about 0.04 (e.g. Q8_0: d * int8, Q4_K: d * 6-bit scale * 4-bit quant)
BLOCKS = {
    "Q4_0": (18, 32, (0,), 2e-3),
    "Q5_0": (22, 32, (0,), 2e-3),
    "Q8_0": (34, 32, (0,), 2e-4),
    "Q2_K": (84, 256, (80, 82), 1e-4),
    "Q3_K": (110, 256, (108,), 1e-4),
    "Q4_K": (144, 256, (0, 2), 2e-5),
    "Q5_K": (176, 256, (0, 2), 1e-5),
    "Q6_K": (210, 256, (208,), 1e-5),
}
CHUNK_BLOCKS = 1 << 16  # blocks written at a time (9 MB of Q4_K)


def write_header(model: Path, prefix: Path) -> dict:
    """The model's bytes before its tensor data, and where each tensor lies and of what type."""
    from gguf import GGUFReader  # only here: the machine that expands a twin may not have it

    reader = GGUFReader(model)
    tensors = [
        {"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "bytes": int(t.n_bytes)}
        for t in reader.tensors
    ]
    layout = {"source": model.name, "data_offset": int(reader.data_offset), "size": model.stat().st_size, "tensors": tensors}
    with open(model, "rb") as f:
        Path(f"{prefix}.head").write_bytes(f.read(layout["data_offset"]))
    Path(f"{prefix}.json").write_text(json.dumps(layout, indent=1))
    return layout


def resize(model: Path, prefix: Path, layers: int, embd: int, ffn: int, heads: int, kv_heads: int) -> dict:
    """The header and layout of `model` at other sizes (see the module's docstring)."""
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    sizes = {"block_count": layers, "embedding_length": embd, "feed_forward_length": ffn,
             "attention.head_count": heads, "attention.head_count_kv": kv_heads, "rope.dimension_count": embd // heads}  # fmt: skip
    kv = embd // heads * kv_heads
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    shapes = {  # ggml order (first: the row length)
        "token_embd.weight": (embd, vocab), "output.weight": (embd, vocab), "output_norm.weight": (embd,),
        "attn_norm.weight": (embd,), "ffn_norm.weight": (embd,), "attn_q.weight": (embd, embd), "attn_q.bias": (embd,),
        "attn_k.weight": (embd, kv), "attn_k.bias": (kv,), "attn_v.weight": (embd, kv), "attn_v.bias": (kv,),
        "attn_output.weight": (embd, embd), "ffn_gate.weight": (embd, ffn), "ffn_up.weight": (embd, ffn), "ffn_down.weight": (ffn, embd),
    }  # fmt: skip
    per_layer: dict[str, dict[int, object]] = {}  # tensor name within a layer -> its type in each layer
    for tensor in reader.tensors:
        if tensor.name.startswith("blk."):
            _, layer, name = tensor.name.split(".", 2)
            per_layer.setdefault(name, {})[int(layer)] = tensor.tensor_type
    source_layers = len(next(iter(per_layer.values())))
    writer = GGUFWriter(f"{prefix}.gguf-header", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.removeprefix(f"{arch}.")
        if key in sizes and name.startswith(f"{arch}."):
            writer.add_key_value(name, sizes[key], field.types[0])
        elif field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), GGUFValueType.ARRAY, field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), field.types[0])

    def add(name: str, kind, shape: tuple) -> None:
        values, block = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape))
        writer.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), elements // values * block, raw_dtype=kind)

    for tensor in reader.tensors:
        if not tensor.name.startswith("blk."):
            add(tensor.name, tensor.tensor_type, shapes[tensor.name])
    for layer in range(layers):
        for name, kinds in per_layer.items():  # each type where it lies in the source, in proportion
            add(f"blk.{layer}.{name}", kinds[layer * source_layers // layers], shapes[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    header = Path(f"{prefix}.gguf-header").read_bytes()
    Path(f"{prefix}.gguf-header").unlink()
    data_offset = GGUFWriter.ggml_pad(len(header), writer.data_alignment)
    tensors, offset = [], data_offset
    for name, info in writer.tensors[0].items():
        tensors.append({"name": name, "type": info.dtype.name, "offset": offset, "bytes": info.nbytes})
        offset += GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment)
    layout = {"source": f"{model.name} resized", "data_offset": data_offset, "size": offset, "tensors": tensors}
    Path(f"{prefix}.head").write_bytes(header.ljust(data_offset, b"\0"))
    Path(f"{prefix}.json").write_text(json.dumps(layout, indent=1))
    return layout


def expand(prefix: Path, out: Path, seed: int = 0) -> None:
    """Write the twin: the header as it was, each tensor's bytes synthetic, the file as long as the model.
    It is written beside OUT and renamed when whole: a twin cut short (a full disk, a type not in
    BLOCKS) never stands where a later run would take it for whole."""
    layout = json.loads(Path(f"{prefix}.json").read_text())
    head = Path(f"{prefix}.head").read_bytes()
    rng = np.random.default_rng(seed)
    part = out.with_name(out.name + ".part")
    try:
        with open(part, "wb") as f:
            f.write(head)
            for tensor in sorted(layout["tensors"], key=lambda t: t["offset"]):
                f.seek(tensor["offset"])
                _write_tensor(f, tensor, rng)
            f.truncate(layout["size"])
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)


def _write_tensor(f, tensor: dict, rng: np.random.Generator) -> None:
    kind, size = tensor["type"], tensor["bytes"]
    if kind == "F32":
        value = 1.0 if tensor["name"].endswith("norm.weight") else None  # norms scale by one; biases and others small
        data = np.full(size // 4, value, np.float32) if value else (rng.standard_normal(size // 4) * 0.02).astype(np.float32)
        f.write(data.tobytes())
        return
    if kind == "F16":
        f.write((rng.standard_normal(size // 2) * 0.02).astype(np.float16).tobytes())
        return
    if kind not in BLOCKS:
        raise SystemExit(f"{tensor['name']}: type {kind} is not supported (add its block layout to BLOCKS)")
    block, _, scales, scale = BLOCKS[kind]
    half = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    left = size // block
    while left:
        n = min(left, CHUNK_BLOCKS)
        blocks = rng.integers(0, 256, (n, block), dtype=np.uint8)
        for at in scales:
            blocks[:, at : at + 2] = half
        f.write(blocks.tobytes())
        left -= n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    header = commands.add_parser("header", help="write PREFIX.head and PREFIX.json from a GGUF")
    header.add_argument("model", type=Path)
    header.add_argument("prefix", type=Path)
    sized = commands.add_parser("resize", help="write PREFIX.head and PREFIX.json for the model's family at other sizes")
    sized.add_argument("model", type=Path)
    sized.add_argument("prefix", type=Path)
    for flag in ("--layers", "--embd", "--ffn", "--heads", "--kv-heads"):
        sized.add_argument(flag, type=int, required=True)
    twin = commands.add_parser("expand", help="write a twin GGUF from PREFIX.head and PREFIX.json")
    twin.add_argument("prefix", type=Path)
    twin.add_argument("out", type=Path)
    twin.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        run(args)
    except OSError as error:  # a file missing, unreadable or unwritable, a full disk
        raise SystemExit(f"Error: {error.filename or ''}{': ' if error.filename else ''}{error.strerror or error}") from None
    except (ValueError, KeyError) as error:  # not a GGUF file, or not a layout of this script's
        raise SystemExit(f"Error: {args.command}: {error}") from None


def run(args) -> None:
    if args.command == "resize" and (args.embd % args.heads or args.heads % args.kv_heads):
        raise SystemExit(f"Error: --embd {args.embd} must split into --heads {args.heads}, and those into --kv-heads {args.kv_heads} groups")
    if args.command in ("header", "resize"):
        if args.command == "header":
            layout = write_header(args.model, args.prefix)
        else:
            layout = resize(args.model, args.prefix, args.layers, args.embd, args.ffn, args.heads, args.kv_heads)
        print(f"{args.prefix}.head: {layout['data_offset']} bytes, {len(layout['tensors'])} tensors, a {layout['size'] / 1e9:.2f} GB model")
    else:
        expand(args.prefix, args.out, args.seed)


if __name__ == "__main__":
    main()
