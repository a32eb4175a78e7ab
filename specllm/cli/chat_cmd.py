"""`specllm chat`: a conversation turn by turn, at a terminal or driven by a script through a pipe."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from specllm.chat import ChatSettings, Conversation
from specllm.cli import app
from specllm.cli import common as c
from specllm.cli.chat_loop import ChatLoop, script_reader, terminal_reader
from specllm.cli.display import use_colour
from specllm.session import SpecConfig


@app.command()
def chat(
    model: c.Model = None,
    draft: c.Draft = None,
    spec: c.Spec = "auto",
    draft_max: c.DraftMax = 8,
    draft_p_min: c.DraftPMin = 0.6,
    ngram_min: c.NgramMin = 2,
    ngram_max: c.NgramMax = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply (/set max_tokens changes it).")] = 2048,
    temp: c.Temp = 0.8,
    top_k: c.TopK = 40,
    top_p: c.TopP = 0.95,
    min_p: c.MinP = 0.05,
    seed: c.Seed = None,
    ctx_size: c.CtxSize = 4096,
    threads: c.Threads = None,
    gpu_layers: c.GpuLayers = -1,
    gpu_layers_draft: c.GpuLayersDraft = -1,
    system: c.System = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No statistics on stderr.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="A summary after each reply even when stderr is not a terminal.")] = False,
    color: c.Color = "auto",
) -> None:
    """Chat with a model. Lines typed (or piped in) are messages; /help lists the commands.

    Replies go to stdout and nothing else does, so a script can drive a chat through a pipe.
    """
    params = c.sampling_params(temp, top_k, top_p, min_p, seed)
    c.check_common(max_tokens, ctx_size, threads)
    spec_config = SpecConfig(spec, draft_max, draft_p_min, ngram_min, ngram_max).validate()
    colour = use_colour(color, sys.stdout)
    interactive = sys.stdin.isatty()
    engine = c.open_engine(model, draft, spec_config, ctx_size, threads, gpu_layers, gpu_layers_draft)
    loop = ChatLoop(
        engine,
        Conversation(system or None),
        ChatSettings(params, max_tokens),
        spec_config.strategy,
        out=sys.stdout,
        interactive=interactive,
        live=sys.stderr.isatty() and not quiet,
        summaries=not quiet and (sys.stderr.isatty() or verbose),
        colour=colour,
    )
    if interactive and sys.stderr.isatty():
        loop.banner()
    loop.run(terminal_reader() if interactive else script_reader(sys.stdin))
