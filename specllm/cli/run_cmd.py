"""`specllm run`: one prompt in, generated text out."""

from __future__ import annotations

import functools
import json
import sys
from typing import Annotated, Optional

import numpy as np
import typer

from specllm.chat import reasoning_splitter
from specllm.cli import common as c
from specllm.cli import options as o
from specllm.cli.app import Command, app
from specllm.cli.display import LiveStatus, ReasoningWriter, ReplyWriter, TokenWriter, colour_allowed, stream_reply, summary_text, use_colour
from specllm.cli.interrupt import StopOnSignal
from specllm.engine.decode import Done, TokenCommitted, check_prompt_fits
from specllm.engine.stats import Stats
from specllm.errors import SpecllmError, one_line
from specllm.reasoning import ThinkSplitter
from specllm.session import SpecConfig


@app.command(cls=Command)
def run(
    context: typer.Context,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt; piped stdin comes before it.")] = None,
    model: o.Model = None,
    draft: o.Draft = None,
    spec: o.Spec = o.SPEC.strategy,
    draft_max: o.DraftMax = o.SPEC.draft_max,
    draft_p_min: o.DraftPMin = o.SPEC.draft_p_min,
    ngram_min: o.NgramMin = o.SPEC.ngram_min,
    ngram_max: o.NgramMax = o.SPEC.ngram_max,
    max_tokens: o.MaxTokens = o.MAX_TOKENS,
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
    raw: Annotated[bool, o.flag("--raw", help="Send the prompt as is, without the chat template (special tokens written in it read as such).")] = False,
    as_json: Annotated[bool, o.flag("--json", help="Print one JSON object (text, tokens, stats) instead of the text.")] = False,
    quiet: Annotated[bool, o.flag("--quiet", "-q", help="No statistics on stderr.")] = False,
    verbose: Annotated[bool, o.flag("--verbose", "-v", help="Closing statistics on stderr even when it is not a terminal.")] = False,
    color: o.Color = o.COLOR,
) -> None:
    """Generate a reply to a prompt (and piped stdin), streaming plain text to stdout."""
    params = o.sampling_params(temp, top_k, top_p, min_p, seed)
    o.check_common(max_tokens, ctx_size, threads, exact, gpu_layers, gpu_layers_draft, flash_attn)
    spec_config = SpecConfig(spec, draft_max, draft_p_min, ngram_min, ngram_max).validate()
    colour = use_colour(color, sys.stdout) and not as_json
    text = c.read_prompt(prompt)

    @functools.cache
    def encoded(engine) -> list[int]:
        return engine.encode(text, system, raw, think=not no_think)

    def fits(engine) -> None:  # asked before `auto` measures this machine (minutes): a prompt too long is said at once
        check_prompt_fits(len(encoded(engine)), engine.target.n_ctx)

    engine = c.open_engine(model, draft, spec_config, ctx_size, threads, gpu_layers, gpu_layers_draft, exact, flash_attn, think=not no_think, check=fits)
    tokens = encoded(engine)
    splitter = ThinkSplitter(thinks=False) if raw else reasoning_splitter(engine.target, tokens)  # a thinking model's reasoning apart
    stats = Stats()
    seed = params.seed if params.seed is not None else o.random_seed()  # --json says it: `--seed N` draws the same again
    writer = TokenWriter(colour=colour)
    live_enabled = sys.stderr.isatty() and not quiet and not verbose
    with StopOnSignal(terminate=True) as stopper, LiveStatus(live_enabled) as live:
        reply = ReplyWriter(splitter, writer, ReasoningWriter(live), shown=not as_json)
        events = engine.decoder().generate(tokens, max_tokens, params, np.random.default_rng(seed), stop=stopper.requested)
        committed: list[int] = []
        try:
            done = stream_reply(_noting(events, committed), reply, live, stats)
        except SpecllmError as exc:  # a pass that failed mid-generation (llama.cpp out of memory): what came is kept
            failure, done = exc, Done("error", committed)
        else:
            failure = None
        reply.finish()  # not after a hard stop (a second signal): the command ends at once, exit 130 or 143
    answer = "".join(splitter.content)
    if as_json:
        result = _json_result(done, stats, engine, spec_config.strategy, splitter) | {"seed": seed, "error": failure and one_line(failure)}
        print(json.dumps(result, ensure_ascii=False))
    elif answer and not answer.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if failure is not None:
        raise failure  # after the text (and JSON) so far: one line on stderr, exit 1
    engine.keep_learned()  # after the text and JSON are out
    if not quiet and (sys.stderr.isatty() or verbose):
        c.stderr.print(summary_text(stats), style="dim" if colour_allowed(sys.stderr) else None, soft_wrap=True)
    if splitter.thinks and not answer and done.finish_reason == "length" and not quiet:
        c.warn(f"stopped after {len(done.tokens)} tokens while the model was still reasoning, before any answer: raise --max-tokens, or --no-think")
    elif splitter.thinks and not answer and splitter.reasoning and done.finish_reason == "stop" and not quiet:
        # its end token inside (or right after) the block: stdout (a file) is empty, and that is not a failure of ours
        c.warn(f"the model ended its reply {'while still reasoning' if splitter.reasoning_open else 'after its reasoning'}, with no answer")
    elif done.finish_reason == "length" and not quiet and _defaulted(context, "max_tokens"):
        # a limit the user did not choose must not cut a reply unnoticed (a file rewritten through a pipe)
        c.warn(f"stopped at {max_tokens} tokens, the default --max-tokens: the reply may be cut short (raise -n)")
    lost = c.draft_lost(engine)
    if lost:  # said even with --quiet: the run was not what was asked for
        c.warn(lost)
    if done.finish_reason == "context" and not quiet:
        c.warn(f"stopped after {len(done.tokens)} tokens: the context of {engine.target.n_ctx} tokens is full (raise --ctx-size)")
    stopper.raise_if_stopped()  # Ctrl-C: exit 130; SIGTERM: exit 143 (the text and JSON are out)


def _noting(events, committed: list[int]):
    """The events, each committed token's id added to `committed` on the way (what a generation that
    fails midway has generated)."""
    for event in events:
        if isinstance(event, TokenCommitted) and event.token >= 0:
            committed.append(event.token)
        yield event


def _defaulted(context: typer.Context, name: str) -> bool:
    """Whether option `name` kept its default (the user did not give it). By the source's name: Typer
    carries a click of its own, whose ParameterSource is not the installed click's."""
    return context.get_parameter_source(name).name == "DEFAULT"


def _json_result(done: Done, stats: Stats, engine, strategy: str, splitter: ThinkSplitter) -> dict:
    """`text` is the answer; `reasoning` a thinking model's reasoning ("" when it gave none), null for
    a model that does not think (or `--raw`): the key is always there, whatever the model."""
    return {
        "text": "".join(splitter.content),
        "reasoning": "".join(splitter.reasoning) if splitter.thinks else None,
        "tokens": done.tokens,
        "finish_reason": done.finish_reason,
        "model": str(engine.target.path),
        "draft": str(engine.draft.path) if engine.draft else None,
        "spec": strategy,
        "stats": stats.to_dict(),
    }
