"""`specllm chat`: a conversation turn by turn, at a terminal or driven by a script through a pipe."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from specllm.chat import ChatSettings, Conversation
from specllm.cli import common as c
from specllm.cli import options as o
from specllm.cli.app import Command, app
from specllm.cli.chat_loop import ChatLoop, check_system_prompt, script_reader, terminal_reader
from specllm.cli.display import use_colour
from specllm.errors import SpecllmError
from specllm.session import SpecConfig


@app.command(cls=Command)
def chat(
    model: o.Model = None,
    draft: o.Draft = None,
    spec: o.Spec = o.SPEC.strategy,
    draft_max: o.DraftMax = o.SPEC.draft_max,
    draft_p_min: o.DraftPMin = o.SPEC.draft_p_min,
    ngram_min: o.NgramMin = o.SPEC.ngram_min,
    ngram_max: o.NgramMax = o.SPEC.ngram_max,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply (/set max_tokens changes it).")] = 2048,
    temp: o.Temp = o.SAMPLING.temperature,
    top_k: o.TopK = o.SAMPLING.top_k,
    top_p: o.TopP = o.SAMPLING.top_p,
    min_p: o.MinP = o.SAMPLING.min_p,
    seed: o.Seed = o.SAMPLING.seed,
    ctx_size: o.CtxSize = o.LOAD.n_ctx,
    threads: o.Threads = o.LOAD.n_threads,
    gpu_layers: o.GpuLayers = o.LOAD.n_gpu_layers,
    gpu_layers_draft: o.GpuLayersDraft = o.LOAD.n_gpu_layers,
    exact: o.Exact = o.LOAD.exact,
    flash_attn: o.FlashAttn = o.LOAD.flash_attn,
    system: o.System = None,
    no_think: o.NoThink = False,
    quiet: Annotated[bool, o.flag("--quiet", "-q", help="No statistics on stderr.")] = False,
    verbose: Annotated[bool, o.flag("--verbose", "-v", help="A summary after each reply even when stderr is not a terminal.")] = False,
    color: o.Color = o.COLOR,
) -> None:
    """Chat with a model. Lines typed (or piped in) are messages; /help lists the commands.

    Replies go to stdout and nothing else does, so a script can drive a chat through a pipe.
    """
    params = o.sampling_params(temp, top_k, top_p, min_p, seed)
    o.check_common(max_tokens, ctx_size, threads, exact, gpu_layers, gpu_layers_draft, flash_attn)
    spec_config = SpecConfig(spec, draft_max, draft_p_min, ngram_min, ngram_max).validate()
    colour = use_colour(color, sys.stdout)
    interactive = sys.stdin.isatty()
    engine = c.open_engine(model, draft, spec_config, ctx_size, threads, gpu_layers, gpu_layers_draft, exact, flash_attn, think=not no_think,
                           check=lambda engine: check_system_prompt(engine, system, not no_think))
    loop = ChatLoop(
        engine,
        Conversation(system),
        ChatSettings(params, max_tokens),
        spec_config.strategy,
        out=sys.stdout,
        interactive=interactive,
        live=sys.stderr.isatty() and not quiet,
        summaries=not quiet and (sys.stderr.isatty() or verbose),
        colour=colour,
        think=not no_think,
    )
    loop.check_system_prompt()
    if interactive and sys.stderr.isatty():
        loop.banner()
    try:
        loop.run(terminal_reader() if interactive else script_reader(sys.stdin))
    finally:
        engine.keep_learned()
    if loop.unsent and not interactive:  # the replies are out; a script learns that not every message was sent
        raise SpecllmError(f"{loop.unsent} message(s) of the script were not sent (said above)")
