"""Every option that run, chat and bench share: its default, its help text and its check, once.

Defaults come from the engine's own dataclasses (`SpecConfig`, `SamplingParams`, `LoadOptions`), so
a command's signature names them (`draft_max: o.DraftMax = o.SPEC.draft_max`) instead of
repeating a number that could drift.
"""

from __future__ import annotations

from typing import Annotated, Optional

import numpy as np
import typer

from specllm.backend import FLASH_ATTN, LoadOptions
from specllm.cli.app import flag
from specllm.engine.sampling import SamplingParams
from specllm.errors import UsageError
from specllm.session import STRATEGIES, SpecConfig

SPEC = SpecConfig()  # --spec, --draft-max, --draft-p-min, --ngram-min, --ngram-max
SAMPLING = SamplingParams()  # --temp, --top-k, --top-p, --min-p, --seed
LOAD = LoadOptions()  # --ctx-size, --threads, --gpu-layers, --gpu-layers-draft, --exact, --flash-attn
MAX_TOKENS = 512  # run and chat
BENCH_MAX_TOKENS = 128  # bench: short generations, many prompts
BENCH_TEMP = 0.0  # bench: greedy, so every strategy's text can be compared with off's
COLOR = "auto"
MAX_THREADS = 512  # GGML_MAX_N_THREADS: llama.cpp crashes on more

# -- options shared by the generating commands (Typer `Annotated` aliases) ----------------
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Preset name, hf:ORG/REPO:QUANT (or hf:ORG/REPO/FILE.gguf), or path to a GGUF file.", show_default="the default preset")]
Draft = Annotated[Optional[str], typer.Option("--draft", "-md", help="Draft model: preset/model name, hf:ORG/REPO:QUANT, GGUF path, or auto (a compatible, much smaller model from the presets and the cache).", show_default="the preset's draft")]
Spec = Annotated[str, typer.Option("--spec", help=f"Speculation strategy: {', '.join(STRATEGIES)}.")]
DraftMax = Annotated[int, typer.Option("--draft-max", help="Most tokens drafted per step.")]
DraftPMin = Annotated[float, typer.Option("--draft-p-min", help="Draft model stops when its top probability falls below this.")]
NgramMin = Annotated[int, typer.Option("--ngram-min", help="Shortest n-gram the cache matches.")]
NgramMax = Annotated[int, typer.Option("--ngram-max", help="Longest n-gram the cache matches.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below this fraction of the best one (0: off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed (-1: random): with one, the text is the same whatever the n-gram cache drafts.", show_default="random")]
CtxSize = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens.")]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads.", show_default="all cores up to 8")]
GpuLayers = Annotated[int, typer.Option("--gpu-layers", "-ngl", help="Target layers on the GPU (-1: all when the build supports it).")]
GpuLayersDraft = Annotated[int, typer.Option("--gpu-layers-draft", "-ngld", help="Draft layers on the GPU (-1: all when supported).")]
Exact = Annotated[bool, flag("--exact", help="Batch-invariant kernels: at --temp 0 the text is bit-identical to plain decoding's (--spec off --exact), never parted by a near tie. Target on the CPU; verifications of 3-7 tokens at most, so speculation gains less.")]
FlashAttn = Annotated[str, typer.Option("--flash-attn", "-fa", help="llama.cpp's flash attention: auto (its choice), on, off. On a CPU, off makes generation after long prompts faster (verifying a draft most) and reading prompts slower: see the README.")]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt ('': none, not the template's default).")]
NoThink = Annotated[bool, flag("--no-think", help="A thinking model (Qwen3) answers without reasoning first (its template's enable_thinking switch). Reasoning goes to stderr, the answer to stdout.")]
Color = Annotated[str, typer.Option("--color", help="Colour tokens by source: auto, always, never.")]


FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed"}  # each sampling field's flag


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float, seed: int | None) -> SamplingParams:
    return SamplingParams(temp, top_k, top_p, min_p, None if seed == -1 else seed).validate(FLAGS)  # -1: random, as in llama.cpp


def random_seed() -> int:
    """A seed of the operating system's randomness, as `--seed` takes them (for `--seed -1`)."""
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))


def check_common(max_tokens: int, ctx_size: int, threads: int | None, exact: bool = False, gpu_layers: int = -1, gpu_layers_draft: int = -1, flash_attn: str = "auto") -> None:
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    if ctx_size < 8:
        raise UsageError(f"--ctx-size must be at least 8 tokens, got {ctx_size}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise UsageError(f"--threads must be between 1 and {MAX_THREADS}, got {threads}")
    for option, layers in (("--gpu-layers", gpu_layers), ("--gpu-layers-draft", gpu_layers_draft)):
        if layers < -1:
            raise UsageError(f"{option} must be -1 (all, where the build offloads) or 0 or more, got {layers}")
    if flash_attn not in FLASH_ATTN:
        raise UsageError(f"--flash-attn must be auto, on or off; got {flash_attn!r}")
    if exact and flash_attn == "off":
        raise UsageError("--exact needs flash attention (its per-row kernel keeps a token's attention the same in any batch): drop --flash-attn off")
    if exact and gpu_layers > 0:
        raise UsageError("--exact runs the target on the CPU (GPU kernels differ by batch size too): drop --gpu-layers")
