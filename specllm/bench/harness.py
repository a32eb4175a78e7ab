"""The benchmark harness: every strategy on the same prompts, interleaved, in one process.

No printing here: `run_bench` yields one `Run` per generation and `summarize` turns runs into
the rows the CLI renders. Figures are ratios measured in the same run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from specllm.bench.oracle import ngram_oracle_cost as oracle_cost
from specllm.bench.oracle import plain_cost
from specllm.bench.workloads import Prompt
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Done
from specllm.engine.sampling import SamplingParams
from specllm.engine.stats import Stats
from specllm.errors import SpecllmError, UsageError, one_line


@dataclass
class Run:
    prompt: Prompt
    strategy: str
    repeat: int
    prompt_tokens: list[int]
    tokens: list[int]
    stats: Stats
    text: str = ""
    error: str | None = None  # why the run failed (its figures are left out, and its prompt's other runs with them)


@dataclass
class BenchSettings:
    strategies: list[str]
    max_tokens: int = 128
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int = 0
    repeats: int = 1
    warm: bool = False  # keep KV and n-gram state between prompts (inflates results; off by default)


def run_bench(engine, prompts: list[Prompt], settings: BenchSettings) -> Iterator[Run]:
    """Interleave strategies prompt by prompt, rotating their order from prompt to prompt and from
    repeat to repeat (two strategies: A B on one repeat, B A on the next), so drift hits all alike."""
    _warm_up(engine, prompts[0], settings)
    decoders = {}
    for repeat in range(settings.repeats):
        for index, prompt in enumerate(prompts):
            tokens = engine.encode(prompt.text)
            shift = (index + repeat) % len(settings.strategies)
            for strategy in settings.strategies[shift:] + settings.strategies[:shift]:
                if settings.warm and strategy in decoders:
                    decoder = decoders[strategy]
                else:
                    decoder = decoders[strategy] = engine.decoder(strategy)
                run = _one_run(decoder, prompt, strategy, repeat, tokens, settings)
                if run.error is not None:
                    decoders.pop(strategy)  # a --warm decoder left mid-step starts afresh
                yield run


def _one_run(decoder, prompt, strategy, repeat, tokens, settings) -> Run:
    """One generation; a failure of it (llama.cpp refusing a batch, out of memory for its KV cache)
    is kept as a failed run, so the bench goes on with the others and reports what finished."""
    stats, done = Stats(), None
    rng = np.random.default_rng(settings.seed + repeat)
    try:
        for event in decoder.generate(tokens, settings.max_tokens, settings.params, rng):
            stats.update(event)
            if isinstance(event, Done):
                done = event
    except UsageError:
        raise  # the same for every prompt: nothing to go on with
    except SpecllmError as exc:
        return Run(prompt, strategy, repeat, tokens, [], stats, "", error=one_line(exc))
    return Run(prompt, strategy, repeat, tokens, done.tokens, stats, done.text)


def without_failures(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """The runs to compare and the failed ones. A failed run takes its prompt's runs of the same
    repeat out with it: figures against off compare the same prompts, or they compare nothing."""
    failed = [r for r in runs if r.error is not None]
    dropped = {(r.prompt.id, r.repeat) for r in failed}
    return [r for r in runs if (r.prompt.id, r.repeat) not in dropped], failed


def _warm_up(engine, prompt: Prompt, settings: BenchSettings) -> None:
    tokens = engine.encode(prompt.text)
    for strategy in settings.strategies:
        decoder = engine.decoder(strategy)
        for _ in decoder.generate(tokens, 8, settings.params, np.random.default_rng(settings.seed)):
            pass


# -- figures ------------------------------------------------------------------------------


def summarize(runs: list[Run], costs: CostModel | None, greedy: bool, ngram_sizes=(2, 4), calibrated: CostModel | None = None) -> list[dict]:
    """One row per (category, strategy), plus an "all" category, with speedups against `off`.

    The oracle is priced by `costs`: the curve as learned over the run where `auto` ran (the
    calibration, refined by every pass it timed), which prices the sizes drafted to by what they
    cost in this run; by the `calibrated` curve alone too, when given."""
    rows = []
    categories = sorted({r.prompt.category for r in runs})
    order = list(dict.fromkeys(["off"] + [r.strategy for r in runs]))  # off, then as the run first took them, in every category
    for category in categories + (["all"] if len(categories) > 1 else []):
        chosen = [r for r in runs if category in ("all", r.prompt.category)]
        by_strategy: dict[str, list[Run]] = {}
        for run in chosen:
            by_strategy.setdefault(run.strategy, []).append(run)
        off = by_strategy.get("off")
        off_tok_s = _tok_per_s(off) if off else None
        oracle = oracle_speedup(off, costs, ngram_sizes) if off and costs and greedy else None
        by_calibration = oracle_speedup(off, calibrated, ngram_sizes) if off and calibrated and greedy else None
        for strategy, group in sorted(by_strategy.items(), key=lambda item: order.index(item[0])):
            row = _row(category, strategy, group, off, off_tok_s, oracle, costs, greedy)
            if calibrated is not None:
                row["oracle_speedup_calibrated"] = round(by_calibration, 3) if by_calibration else None
            rows.append(row)
    return rows


def _row(category, strategy, group, off, off_tok_s, oracle, costs, greedy) -> dict:
    total = Stats()
    for run in group:
        total.merge(run.stats)
    tok_s = _tok_per_s(group)
    speedup = tok_s / off_tok_s if off_tok_s else None
    compared = [(run, plain) for run, plain in _paired(group, off or []) if text_should_equal_off(run, greedy)]
    identical = sum(run.tokens == plain.tokens for run, plain in compared) if compared else None
    row = {
        "strategy": strategy,
        "category": category,
        "prompts": len({r.prompt.id for r in group}),
        "runs": len(group),  # prompts times repeats (fewer where a stop cut a repeat short)
        "tokens": total.tokens,
        "seconds": round(total.seconds, 3),
        "tok_per_s": round(tok_s, 2),
        "prompt_tokens": total.prompt_tokens,
        "prefill_tok_per_s": round(_prompt_tokens_read(group) / total.prefill_seconds, 1) if total.prefill_seconds else None,
        "speedup": round(speedup, 3) if speedup is not None else None,
        "speedup_range": _speedup_range(group, off) if strategy != "off" and off else None,
        "speedup_interval": _speedup_interval(group, off) if strategy != "off" and off else None,
        "acceptance_rate": round(total.acceptance_rate, 4),
        "mean_accepted_length": round(total.mean_accepted_length, 3),
        "per_position": [round(a / d, 3) if d else 0.0 for d, a in total.per_position],
        "draft_share": round(total.draft_seconds / total.seconds, 4) if total.seconds else 0.0,
        "time_split": _time_split(total),
        "by_source": {
            k: {"steps": v.steps, "drafted": v.drafted, "accepted": v.accepted, "mean_draft_length": round(v.drafted / v.steps, 2)}
            for k, v in total.by_source.items()
        },
        "undrafted_passes": total.undrafted_passes,
        "identical_to_off": identical == len(compared) if identical is not None else None,
        "identical_prompts": f"{identical}/{len(compared)}" if identical is not None else None,
        "oracle_speedup": round(oracle, 3) if oracle else None,
        "share_of_oracle": round(speedup / oracle, 3) if oracle and speedup else None,
    }
    row["expected_speedup"] = _expected(total, costs)
    row["expected_speedup_independent"] = _expected(total, costs, independent=True)  # the textbook's α^(i+1), for reference
    return row


def _prompt_tokens_read(group: list[Run]) -> int:
    """Tokens the prefills read: each prompt but what the KV cache held already (a `--warm` run's) and
    its last token, which the first generation pass reads."""
    return sum(max(r.stats.prompt_tokens - r.stats.reused_tokens - 1, 0) for r in group)


def _time_split(total: Stats) -> dict[str, float]:
    """Shares of the generation time: drafting from the n-gram cache (the lookup and the policy),
    in the draft model (its catch-up included), verifying; what is left is the loop's own."""
    if not total.seconds:
        return {"ngram": 0.0, "draft_model": 0.0, "verify": 0.0}
    return {
        "ngram": round((total.draft_seconds - total.model_seconds) / total.seconds, 4),
        "draft_model": round(total.model_seconds / total.seconds, 4),
        "verify": round(total.verify_seconds / total.seconds, 4),
    }


def _tok_per_s(group: list[Run]) -> float:
    seconds = sum(r.stats.seconds for r in group)
    return sum(r.stats.tokens for r in group) / seconds if seconds else 0.0


def _speedup_range(group: list[Run], off: list[Run]) -> list[float] | None:
    """Lowest and highest speedup of single runs against off's run of the same prompt and repeat.

    On a busy or throttling machine a run's speed drifts by several percent; a category's speedup
    whose range spans 1.0 cannot tell a small loss from noise. None with fewer than two pairs.
    """
    ratios = [
        _tok_per_s([run]) / _tok_per_s([plain])
        for run, plain in _paired(group, off)
        if run.stats.seconds and plain.stats.seconds and plain.stats.tokens
    ]
    return [round(min(ratios), 3), round(max(ratios), 3)] if len(ratios) >= 2 else None


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); `_t_975` beyond.
T_975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
         2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)  # fmt: skip


def _speedup_interval(group: list[Run], off: list[Run]) -> list[float] | None:
    """A 95% confidence interval for the speedup, from how it varies between repeats.

    Each repeat measures the figure again on the same prompts, so the per-repeat speedups are
    replicates of it: a t-interval on their logarithms (the figure is a ratio). It answers whether
    a gap of a few percent is timing noise. None with fewer than two complete repeats.
    """
    prompts = {r.prompt.id for r in group}
    mine, plain = _by_repeat(group), _by_repeat(off)
    logs = []
    for repeat, runs in mine.items():
        reference = plain.get(repeat, [])
        if {r.prompt.id for r in runs} == prompts == {r.prompt.id for r in reference}:
            measured, baseline = _tok_per_s(runs), _tok_per_s(reference)
            if measured > 0 and baseline > 0:
                logs.append(math.log(measured / baseline))
    if len(logs) < 2:
        return None
    mean, sd = float(np.mean(logs)), float(np.std(logs, ddof=1))
    t = _t_975(len(logs) - 1)
    half = t * sd / math.sqrt(len(logs))
    return [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def _t_975(df: int) -> float:
    """Student's t 97.5% quantile: the table to 30 degrees of freedom, then the Cornish-Fisher series
    (within 1e-4 there). Not the normal's 1.96: with 32 repeats it is 2.04, and 1.96 an interval 4% too narrow."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)


def undrafted_pass_ratio(runs: list[Run]) -> dict | None:
    """The timing noise of this run, measured in it: every run of a drafting strategy that drafted
    nothing (and spent no time in a draft model) made only plain passes, as `off` did on the same
    prompt, so its time per pass against off's says how far identical work drifted. Mean, standard
    error and range of those ratios; None with fewer than two such runs. A category's speedup
    inside that range of 1.0 is not told apart from timing noise by this run."""
    plain_only = [r for r in runs if r.strategy != "off" and not r.stats.drafted and not r.stats.model_seconds]
    ratios = [
        (run.stats.seconds / run.stats.target_passes) / (plain.stats.seconds / plain.stats.target_passes)
        for run, plain in _paired(plain_only, [r for r in runs if r.strategy == "off"])
        if run.stats.target_passes and plain.stats.target_passes and plain.stats.seconds
    ]
    if len(ratios) < 2:
        return None
    return {
        "runs": len(ratios),
        "mean": round(float(np.mean(ratios)), 4),
        "standard_error": round(float(np.std(ratios, ddof=1)) / math.sqrt(len(ratios)), 4),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def text_should_equal_off(run: Run, greedy: bool) -> bool:
    """Whether a run's text should be off's (the same prompt and repeat, so the same seed): at
    temperature 0 always; above it where the draft model had no part (an n-gram token is verified
    by the target's own draw at its position, off's draw; a draft-model token by rejection
    sampling, which keeps the distribution, not the draws)."""
    return greedy or not run.stats.model_seconds


def parting_points(runs: list[Run], greedy: bool) -> dict[int, int]:
    """For every run whose tokens should be off's (`text_should_equal_off`) and differ from off's
    run of the same prompt and repeat: the index of the first token that differs (keyed by
    id(run)), where a near tie may have flipped."""
    parts = {}
    compared = [r for r in runs if r.strategy != "off" and text_should_equal_off(r, greedy)]
    for run, plain in _paired(compared, [r for r in runs if r.strategy == "off"]):
        if run.tokens != plain.tokens:
            differ = (i for i, (a, b) in enumerate(zip(run.tokens, plain.tokens)) if a != b)
            parts[id(run)] = next(differ, min(len(run.tokens), len(plain.tokens)))
    return parts


def _paired(group: list[Run], off: list[Run]) -> Iterator[tuple[Run, Run]]:
    """Each run with off's run of the same prompt and repeat (runs without one are left out)."""
    reference = {(r.prompt.id, r.repeat): r for r in off}
    for run in group:
        plain = reference.get((run.prompt.id, run.repeat))
        if plain is not None:
            yield run, plain


def _by_repeat(runs: list[Run]) -> dict[int, list[Run]]:
    grouped: dict[int, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run.repeat, []).append(run)
    return grouped


def _expected(total: Stats, costs: CostModel | None, independent: bool = False) -> float | None:
    """The speedup the textbook formula expects from the measured acceptance, draft length and costs,
    over the run's steps: its drafted passes at the formula's tokens and cost, its plain passes (no
    draft: `auto` declining, the n-gram cache finding nothing) at one token for one pass.

    The tokens a drafted pass commits come from the measured acceptance at each draft position
    (`expected_tokens`); `independent` takes the textbook's α^(i+1) instead, which assumes each token
    accepted apart from the others and under-reads copies, accepted whole or not at all."""
    if not costs or not total.draft_steps or not total.drafted:
        return None
    gamma = total.drafted / total.draft_steps  # per pass that verified a draft (a mixed draft is one, not one per source)
    per_token_draft = total.draft_seconds / total.drafted
    c = per_token_draft / costs.verify(1)
    v = costs.relative(round(gamma) + 1)
    cost = gamma * c + v  # a drafted pass, in single passes
    if independent:
        drafting = expected_speedup(total.acceptance_rate, gamma, c, v)
    else:
        drafting = expected_tokens([a / d if d else 0.0 for d, a in total.per_position], gamma) / cost
    steps, plain = total.draft_steps, total.undrafted_passes
    return round((steps * drafting * cost + plain) / (steps * cost + plain), 3)


def expected_tokens(accepted_through: list[float], gamma: float) -> float:
    """Tokens a pass verifying γ drafted tokens commits: 1 + Σ_{i<γ} a_i, a_i the measured share of
    drafts reaching position i that were accepted through it (the textbook's α^(i+1); a fractional
    γ takes that share of its last position)."""
    whole = int(gamma)
    shares = list(accepted_through) + [0.0] * (whole + 1)
    return 1.0 + sum(shares[:whole]) + (gamma - whole) * shares[whole]


def expected_speedup(alpha: float, gamma: float, c: float, v: float) -> float:
    """(1 - α^(γ+1)) / ((1 - α)(γc + v)): tokens per pass over the pass's cost relative to plain decoding.

    α: per-token acceptance, γ: tokens drafted per step, c: cost of drafting one token relative
    to one target token, v: cost of verifying γ+1 tokens relative to one.
    """
    if alpha >= 1.0:
        committed = gamma + 1
    else:
        committed = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return committed / (gamma * c + v)


def oracle_speedup(off: list[Run], costs: CostModel, ngram_sizes=(2, 4)) -> float | None:
    """The best any n-gram policy could do: replay off's text, drafting only prefixes of the
    proposal's correct part, in the cheapest schedule under the cost curve (`ngram_oracle_cost`)."""
    plain = spent = 0.0
    max_draft = max(costs.batch_seconds) - 1
    for run in off:
        decoded = _with_end(run)
        plain += plain_cost(run.prompt_tokens, decoded, costs)
        spent += oracle_cost(run.prompt_tokens, decoded, costs, ngram_sizes, max_draft)
    return plain / spent if spent else None


END = -1  # the end-of-generation token, as the oracle sees it: never drafted (drafters stop before one), matching no token


def _with_end(run: Run) -> list[int]:
    """The tokens the run's passes chose: a generation the target ended chose its end token too, in
    a pass of its own for plain decoding (off's passes are one more than its tokens) or as a step's
    own token; the measured times include that pass, and so must the oracle's."""
    return run.tokens + [END] if run.stats.finish_reason == "stop" else run.tokens
