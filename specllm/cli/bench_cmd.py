"""`specllm bench`: every strategy side by side on the same prompts, with the theory beside it."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from specllm.backend import system_info
from specllm.bench.harness import BenchSettings, parting_points, run_bench, summarize, text_should_equal_off, undrafted_pass_ratio, without_failures
from specllm.bench.workloads import load_prompts
from specllm.cli import common as c
from specllm.cli import options as o
from specllm.cli.app import Command, app
from specllm.cli import interrupt
from specllm.cli.interrupt import Terminated
from specllm.errors import SpecllmError, UsageError
from specllm.session import STRATEGIES, SpecConfig


@app.command(cls=Command)
def bench(
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Spec-Bench style JSONL (question_id, category, turns). [default: built-in set]")] = None,
    categories: Annotated[Optional[str], typer.Option("--categories", help="Comma-separated categories to keep.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="At most this many prompts per category.")] = None,
    strategies: Annotated[str, typer.Option("--strategies", help=f"Comma-separated, from {', '.join(STRATEGIES)}; `off` always runs as the reference.")] = "ngram,auto",
    max_tokens: o.MaxTokens = o.BENCH_MAX_TOKENS,
    temp: o.Temp = o.BENCH_TEMP,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (-1: a random one, which --json records).")] = 0,
    repeats: Annotated[int, typer.Option("--repeats", help="Runs of every prompt per strategy.")] = 1,
    warm: Annotated[bool, o.flag("--warm", help="Keep each strategy's decoder between prompts: its n-gram memory of earlier prompts and answers, what auto learned, and its KV cache only where no other strategy ran in between (inflates results).")] = False,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Write everything as JSON to this file.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG chart (needs matplotlib).")] = None,
    model: o.Model = None,
    draft: o.Draft = None,
    draft_max: o.DraftMax = o.SPEC.draft_max,
    draft_p_min: o.DraftPMin = o.SPEC.draft_p_min,
    ngram_min: o.NgramMin = o.SPEC.ngram_min,
    ngram_max: o.NgramMax = o.SPEC.ngram_max,
    ctx_size: o.CtxSize = o.LOAD.n_ctx,
    threads: o.Threads = o.LOAD.n_threads,
    gpu_layers: o.GpuLayers = o.LOAD.n_gpu_layers,
    gpu_layers_draft: o.GpuLayersDraft = o.LOAD.n_gpu_layers,
    exact: o.Exact = o.LOAD.exact,
    flash_attn: o.FlashAttn = o.LOAD.flash_attn,
) -> None:
    """Measure plain decoding against each speculation strategy on the same prompts."""
    o.check_common(max_tokens, ctx_size, threads, exact, gpu_layers, gpu_layers_draft, flash_attn)
    for flag, value in (("--repeats", repeats), ("--limit", limit)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    chosen = _strategies(strategies)
    params = o.sampling_params(temp, o.SAMPLING.top_k, o.SAMPLING.top_p, o.SAMPLING.min_p, seed)
    seed = params.seed if params.seed is not None else o.random_seed()  # -1 (random): every run draws from seed + repeat
    plot_format = _plot_format(plot) if plot is not None else None
    for flag, target in (("--json", json_file), ("--plot", plot)):
        _check_output(flag, target, prompts)
    if json_file is not None and plot is not None and json_file.resolve() == plot.resolve():
        raise UsageError(f"--json and --plot name the same file, {json_file}: the chart would overwrite the report")
    wanted = _split(categories)
    if categories is not None and not wanted:
        raise UsageError(f"--categories {categories!r} names no category")
    workload = load_prompts(prompts, wanted, limit)
    spec = SpecConfig("ngram+draft", draft_max, draft_p_min, ngram_min, ngram_max).validate()
    engine = c.open_engine(model, draft, spec, ctx_size, threads, gpu_layers, gpu_layers_draft, exact, flash_attn)
    if any(s in ("draft", "ngram+draft") for s in chosen) and engine.draft is None:
        chosen = [s for s in chosen if s not in ("draft", "ngram+draft")]
        if chosen == ["off"]:  # nothing asked for is left to measure against off
            raise UsageError(f"--strategies {strategies} needs a draft model: pass --draft PATH or a preset that has one")
        c.warn("no draft model: skipping the draft and ngram+draft strategies")
    _check_prompts_fit(engine, workload, str(prompts) if prompts else "built-in workloads")
    costs = c.cost_curve(engine)
    settings = BenchSettings(chosen, max_tokens, params, seed, repeats, warm)
    runs, stopped = _collect(engine, workload, settings)
    runs, failed = without_failures(runs)
    for run in failed:
        c.warn(f"{run.strategy} failed on question_id {run.prompt.id} ({run.prompt.category}, repeat {run.repeat + 1}): {run.error}; "
               "every strategy's run of that prompt and repeat is left out of the figures")  # fmt: skip
    engine.keep_learned()
    partial = stopped is not None
    learned = engine.learned_costs() if "auto" in chosen else costs
    rows = summarize(runs, learned, params.greedy, (ngram_min, ngram_max), calibrated=costs if learned is not costs else None)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    if rows:  # none where a stop came before any prompt was finished by every strategy
        out.print(_widen(out, _table(rows)))
        out.print(_bars(rows))
    report = _report(engine, settings, costs, learned, rows, runs, workload, partial, prompts, failed)
    if report["undrafted_pass_ratio"] is not None:
        out.print(_noise_line(report["undrafted_pass_ratio"]))
    out.print(_curve_line(costs))
    parting = _parting_line(runs, engine.target.exact, params.greedy)
    if parting:
        out.print(parting)
    if learned is not costs:
        out.print(_learned_line(costs, learned, engine.learned_before))
    if json_file is not None:
        _write(json_file, json.dumps(report, indent=1))
    if plot is not None:
        _plot(rows, plot, plot_format)
    if stopped is not None:
        raise stopped  # exit 130 or 143, once the partial results are out
    if failed:
        raise SpecllmError(f"{len(failed)} of {len(workload) * len(chosen) * repeats} runs failed (see the warnings); the figures leave their prompts out")


def _strategies(text: str) -> list[str]:
    chosen = _split(text) or []
    if not chosen:
        raise UsageError(f"--strategies {text!r} names no strategy; choose from {', '.join(STRATEGIES)}")
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise UsageError(f"unknown strategies {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    return ["off"] + [s for s in dict.fromkeys(chosen) if s != "off"]


def _split(text: str | None) -> list[str] | None:
    return [part.strip() for part in text.split(",") if part.strip()] if text else None


def _collect(engine, workload, settings):
    """Run everything with a progress bar. Ctrl-C or SIGTERM keeps what finished, marked partial:
    the runs, and the signal's exception (None when all finished) to raise once they are reported."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    total = len(workload) * len(settings.strategies) * settings.repeats
    runs = []
    bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=c.stderr, transient=True, disable=not sys.stderr.isatty())
    with bar:
        task = bar.add_task("warming up", total=total)
        try:
            interrupt.raise_pending()  # a signal dropped while measuring (noted): nothing to run
            for run in run_bench(engine, workload, settings):
                interrupt.raise_pending()  # one dropped during this run (a template's finalizer): the run is cut, as it would have been
                runs.append(run)
                bar.update(task, advance=1, description=f"{run.prompt.category} {run.strategy} {run.stats.tok_per_s:.1f} tok/s")
        except (KeyboardInterrupt, Terminated) as stop:
            interrupt.handled()  # raised again once the partial results are out
            said = "terminated" if isinstance(stop, Terminated) else "interrupted"
            kept = _complete_prompts(runs, settings.strategies)
            if kept:
                left = f"; {len(runs) - len(kept)} finished run(s) left out: another strategy has not run their prompt" if len(kept) < len(runs) else ""
                c.stderr.print(f"{said}: reporting the {len(kept)} of {total} runs whose prompts every strategy finished (partial{left})", soft_wrap=True)
            else:
                c.stderr.print(f"{said} before any prompt was finished by every strategy: nothing to compare ({len(runs)} of {total} runs finished)", soft_wrap=True)
            return kept, stop
    return runs, None


def _check_prompts_fit(engine, workload, source: str) -> None:
    """A prompt the context cannot hold would stop the bench at its turn, minutes in and with the
    runs before it lost, in an error that does not say which prompt: refuse it before measuring."""
    for prompt in workload:
        n = len(engine.encode(prompt.text))
        if n >= engine.target.n_ctx:
            raise SpecllmError(f"{source}: question_id {prompt.id} ({prompt.category}) has {n} tokens but the context holds "
                               f"{engine.target.n_ctx}; raise --ctx-size or leave the prompt out")  # fmt: skip


def _complete_prompts(runs, strategies):
    """Keep only prompts (and repeats) that every strategy finished, so ratios compare like with like."""
    done = {}
    for run in runs:
        done.setdefault((run.prompt.id, run.repeat), set()).add(run.strategy)
    return [r for r in runs if done[(r.prompt.id, r.repeat)] == set(strategies)]


def _table(rows) -> Table:
    """One row per category and strategy. No figure is ever cut short: where the table is wider than
    a terminal its cells wrap (at 160 columns "0.02-86.61" showed as "0.02-86.…"); see `_widen`."""
    names = ("category", "strategy", "prompts", "tokens", "tok/s", "speedup", "95% CI", "per run", "accept", "tok/pass",
             "time ngram/model/verify", "expected", "oracle", "of oracle", "same as off")  # fmt: skip
    cells = [
        (
            r["category"], r["strategy"], _prompts(r), str(r["tokens"]), f"{r['tok_per_s']:.1f}",
            _fmt(r["speedup"], "x"), _span(r["speedup_interval"]), _span(r["speedup_range"]),
            f"{r['acceptance_rate']:.0%}" if _drafted(r) else "-",
            f"{r['mean_accepted_length']:.2f}", _time_shares(r["time_split"]), _fmt(r["expected_speedup"], "x"),
            _fmt(r["oracle_speedup"], "x"), _fmt(r["share_of_oracle"], "", pct=True),
            r["identical_prompts"] or "-",
        )  # fmt: skip
        for r in rows
    ]
    table = Table(title="specllm bench (speedup = tok/s against off, same run)")
    for i, name in enumerate(names):
        table.add_column(name, justify="left" if i < 2 else "right", overflow="fold")
    for row in cells:
        table.add_row(*row)
    return table


def _widen(out: Console, table: Table) -> Table:
    """A file or a pipe takes the table at its full width (rich squeezed it into 160 columns, cutting
    figures); a terminal keeps its own width, where cells wrap rather than lose digits."""
    if not out.is_terminal:
        out.width = max(out.width, out.measure(table, options=out.options.update_width(10_000)).maximum)
    return table


def _prompts(row) -> str:
    """The row's prompts, and how many times each ran where that is more than once: 3x2, not 6 prompts."""
    prompts, runs = row["prompts"], row["runs"]
    if runs == prompts:
        return str(prompts)
    return f"{prompts}x{runs // prompts}" if runs % prompts == 0 else f"{prompts} ({runs} runs)"


def _drafted(row) -> int:
    """Tokens the row's runs drafted: with none, acceptance is no 0%, there was nothing to accept."""
    return sum(source["drafted"] for source in row["by_source"].values())


def _time_shares(shares) -> str:
    """Where the time went, in percent: n-gram drafting, the draft model (its catch-up included), verification."""
    return "{:.0f}/{:.0f}/{:.0f}%".format(*(100 * shares[k] for k in ("ngram", "draft_model", "verify")))


def _span(pair) -> str:
    return "{:.2f}-{:.2f}".format(*pair) if pair else "-"


def _fmt(value, unit: str, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if pct else f"{value:.2f}{unit}"


def _bars(rows, width: int = 40) -> str:
    """A terminal bar chart of speedup per category and strategy; '|' marks 1.0x."""
    shown = [r for r in rows if r["strategy"] != "off" and r["speedup"] is not None]
    top = max([2.0] + [r["speedup"] for r in shown])
    one = round(width / top)
    lines = [f"speedup against off ('|' marks 1.0x, full width {top:.1f}x)"]
    for r in shown:
        n = min(width, round(r["speedup"] * width / top))
        bar = "".join("|" if i == one else "█" if i < n else " " for i in range(width + 1))
        lines.append(f"{r['category'][:14]:>14} {r['strategy']:<12} {bar} {r['speedup']:.2f}x")
    return "\n".join(lines)


def _noise_line(noise) -> str:
    low, high = noise["range"]
    return (
        f"timing noise: in the {noise['runs']} runs that drafted nothing (plain passes only, like off's), a pass took "
        f"{noise['mean']:.3f}x of off's on the same prompt (standard error {noise['standard_error']:.3f}; per run {low:.2f}-{high:.2f})"
    )


def _curve_line(costs) -> str:
    line = f"verify cost at {costs.depth} cached tokens (batch: x one token): "
    line += ", ".join(f"{p['batch']}: {p['relative']:.2f}" for p in costs.curve())
    if costs.context_seconds:
        line += f"; each 1000 more cached tokens add {costs.context_seconds * 1e3 / costs.verify(1):.2%} of one token's pass per batch token"
    return line


def _learned_line(calibrated, learned, earlier: int = 0, moved: float = 0.05) -> str:
    """The sizes whose cost relative to one token timed passes moved by more than `moved`: the run's
    own, after the `earlier` passes of runs before it (kept in the cache)."""
    changes = [
        f"{k}: {calibrated.relative(k):.2f} -> {learned.relative(k):.2f}"
        for k in sorted(learned.batch_seconds)
        if k > 1 and abs(learned.relative(k) / calibrated.relative(k) - 1) > moved
    ]
    if abs(learned.deep_growth - calibrated.deep_growth) > moved:  # a ratio to the growth timed, 1 as calibrated
        changes.append(f"beyond {learned.reach} cached tokens each adds {learned.deep_growth:.2f}x the growth timed before it")
    passes = f"{learned.passes - earlier} passes of this run's auto" + (f" after {earlier} of earlier runs" if earlier else "")
    prefix = f"cost curve refined by {passes} (the oracle is priced by it): "
    return prefix + (", ".join(changes) if changes else f"no size moved by more than {moved:.0%}")


def _parting_line(runs, exact: bool, greedy: bool) -> str | None:
    """Texts that part from off's where they should equal it (`text_should_equal_off`: at
    temperature 0 every text, above it those the draft model had no part in): near ties flipped by
    llama.cpp's batch kernels, or, with exact kernels, a bug (None: without exact kernels, no text parts)."""
    compared = sum(r.strategy != "off" and text_should_equal_off(r, greedy) for r in runs)
    parted = len(parting_points(runs, greedy))
    if not compared:
        return None
    if not exact:
        if not parted:
            return None
        moved = "flips near ties" if greedy else "flips near ties and moves draws near the edge between two tokens"
        return (f"{parted} of {compared} texts part from off's: llama.cpp rounds a token in a batch differently "
                f"from one alone, which {moved}; --exact rules that out (slower)")  # fmt: skip
    if not parted:
        return f"exact kernels: all {compared} texts equal off's, token for token"
    return f"exact kernels, yet {parted} of {compared} texts part from off's: a bug, please report it (with --json)"


def _report(engine, settings, costs, learned, rows, runs, workload, partial, prompts_file, failed=()) -> dict:
    parts = parting_points(runs, settings.params.greedy)
    return {
        "partial": partial,
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_name(),
            "cpu_count": os.cpu_count(),
            "threads": engine.target.n_threads,
            "gpu_layers": {"target": engine.target.n_gpu_layers, "draft": engine.draft.n_gpu_layers if engine.draft else None},
            "llama_cpp": system_info(),
            "exact_kernels": engine.target.exact,
            "exact_batch": engine.target.exact_batch,  # the largest verification exact kernels allow
            "flash_attn": engine.target.flash_attn,  # as asked: auto is llama.cpp's choice
        },
        "models": {
            role: {"path": str(info.path), "bytes": info.size, "architecture": info.architecture}
            for role, info in (("target", engine.target_info), ("draft", engine.draft_info))
            if info is not None
        },
        "settings": {
            "prompts_file": str(prompts_file) if prompts_file else "built-in",
            "prompts": len(workload),
            "strategies": settings.strategies,
            "max_tokens": settings.max_tokens,
            "temperature": settings.params.temperature,
            "seed": settings.seed,
            "repeats": settings.repeats,
            "warm": settings.warm,
            "spec": {k: v for k, v in vars(engine.spec).items() if k != "strategy"},  # the strategies are above (ngram+draft only loaded the draft)
        },
        "verify_cost": costs.curve(),
        "verify_cost_depth": costs.depth,
        "verify_context_us": round(costs.context_seconds * 1e6, 4),  # per batch token per cached token beyond the depth
        "draft_cost_relative": round(costs.draft_seconds / costs.verify(1), 3) if costs.draft_seconds else None,
        "costs": costs.to_dict(),  # the calibration (auto starts from it, or from what earlier runs refined of it)
        "costs_learned": learned.to_dict(),  # the same, refined by auto's timed passes (`passes`; earlier runs' too): what prices the oracle
        "costs_learned_earlier_passes": engine.learned_before if learned is not costs else None,
        "results": rows,
        "undrafted_pass_ratio": undrafted_pass_ratio(runs),  # timing noise: runs that drafted nothing against off's
        "failed": [  # runs that failed: their prompt's runs of that repeat are in no figure
            {"prompt": r.prompt.id, "category": r.prompt.category, "strategy": r.strategy, "repeat": r.repeat, "error": r.error} for r in failed
        ],
        "runs": [
            {"prompt": r.prompt.id, "category": r.prompt.category, "strategy": r.strategy, "repeat": r.repeat, **r.stats.to_dict(),
             "parts_from_off_at": parts.get(id(r))}  # fmt: skip
            for r in runs
        ],
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text + "\n", "utf-8")
    except OSError as exc:
        raise SpecllmError(f"cannot write {path}: {exc.strerror or exc}") from None


def _check_output(flag: str, path: Path | None, prompts: Path | None = None) -> None:
    """Before minutes of measuring, refuse an output file that cannot be created at all, or that
    is the prompts file (a slip of tab completion would replace the user's workload)."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    if prompts is not None and path.exists() and prompts.exists() and path.samefile(prompts):
        raise UsageError(f"{flag} {path}: is the --prompts file; writing there would replace the prompts")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {path.parent} does not exist")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise UsageError(f"{flag} {path}: {'the file' if path.exists() else 'the folder ' + str(path.parent)} is not writable")


def _plot_format(path: Path) -> str:
    """The chart's format, before any measuring: its suffix's where matplotlib writes that, PNG
    where it has none (matplotlib would write PATH.png instead of PATH)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    suffix = path.suffix[1:].lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in known:
        raise UsageError(f"--plot {path}: matplotlib writes no .{suffix} files (it writes {', '.join(sorted(known))}); name a .png file")
    return suffix or "png"


def _plot(rows, path: Path, file_format: str = "png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["strategy"] != "off" and r["speedup"] is not None]
    categories = list(dict.fromkeys(r["category"] for r in shown))
    strategies = list(dict.fromkeys(r["strategy"] for r in shown))
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.2), 4))
    width = 0.8 / max(len(strategies), 1)
    for i, strategy in enumerate(strategies):
        values = [next((r["speedup"] for r in shown if r["category"] == cat and r["strategy"] == strategy), 0) for cat in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=strategy)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(strategies) - 1) / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup against off")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format=file_format)
    except OSError as exc:
        raise SpecllmError(f"cannot write {path}: {exc.strerror or exc}") from None
