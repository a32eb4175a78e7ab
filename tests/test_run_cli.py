"""`specllm run` as a user runs it, on a real (small) model: SmolLM2-135M.

Piped stdin and the plain text on stdout go through a real `python -m specllm` process; the other
commands through the same entry point in this process (tests/cli_helpers.py's `specllm_here`),
which saves starting an interpreter and loading the model for each. `--spec auto` is not run
here: on a real model it first calibrates (27 s on 2 cores, timings that no test judges); auto's
output on a real pair is tests/test_lossless_real.py's claim, auto through the CLI is on tiny models.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.cli_helpers import specllm_here

STATS_KEYS = {"prompt_tokens", "seconds", "tok_per_s", "target_passes", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "by_source"}


def specllm(*args, stdin: str | None = None):
    """A real process (the environment is the test's temporary home, conftest.py)."""
    return subprocess.run(
        [sys.executable, "-m", "specllm", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def here(*args):
    return specllm_here(dict(os.environ), *args)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return ["-m", str(smollm2_path), "--temp", "0", "-c", "1024", "-t", "2", "--spec", "ngram"]


def test_piped_stdin_then_prompt_prints_only_text(smol):
    result = specllm("run", *smol, "-p", "Add type hints.", "-n", "24", "--spec", "ngram", stdin="def f(x): return x\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert result.stderr == ""  # not a terminal and not --verbose: nothing on stderr


def test_json_is_one_object_with_text_tokens_and_stats(smol):
    result = here("run", *smol, "-p", "Name three colours.", "-n", "16", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert {"text", "tokens", "stats", "finish_reason"} <= set(data)
    assert STATS_KEYS <= set(data["stats"])
    assert set(data["stats"]["by_source"]) >= {"ngram", "draft"}
    assert len(data["tokens"]) == data["stats"]["tokens"] <= 16


def test_text_mode_equals_json_text_and_every_strategy_agrees_at_temperature_zero(smol, smollm2_path):
    prompt = ["-p", "Repeat this line twice: the quick brown fox jumps over the lazy dog", "-n", "40"]
    texts = {}
    for spec in ("off", "ngram", "ngram+draft"):  # the draft: SmolLM2 itself, one-token kernels against the batch's
        data = json.loads(here("run", *smol, *prompt, "--spec", spec, "--draft", smollm2_path, "--json").stdout)
        texts[spec] = data["text"]
    assert texts["ngram"] == texts["off"] == texts["ngram+draft"]
    plain = specllm("run", *smol, *prompt, "--spec", "off")
    assert plain.stdout == texts["off"] + ("" if texts["off"].endswith("\n") else "\n")


def test_verbose_puts_statistics_on_stderr_only(smol):
    result = here("run", *smol, "-p", "Say hi.", "-n", "8", "--verbose")
    assert result.returncode == 0
    assert "tok/s" in result.stderr and "tok/s" not in result.stdout


def test_raw_prompt_skips_the_template(smol):
    result = here("run", *smol, "-p", "def add(a, b):", "--raw", "-n", "8", "--json")
    data = json.loads(result.stdout)
    templated = json.loads(here("run", *smol, "-p", "def add(a, b):", "-n", "8", "--json").stdout)
    assert data["stats"]["prompt_tokens"] < templated["stats"]["prompt_tokens"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temp", "-1"], "--temp"),
        (["-n", "0"], "--max-tokens"),
        (["--top-p", "1.5"], "--top-p"),
        (["--spec", "fast"], "--spec"),
    ],
)
def test_impossible_flags_are_usage_errors(smol, args, message):
    result = here("run", *smol, "-p", "x", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("Error:") and message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_random_runs_seed_is_in_its_json_and_draws_its_text_again(home, tiny_pair):
    """Without --seed a run draws a seed of its own; --json says which, and --seed with it gives the
    same text (any strategy: what the drafters propose never moves the draws)."""
    flags = ["run", "-m", tiny_pair[0], "-c", "512", "--temp", "1.0", "-n", "24", "-p", "hello", "--json"]
    first, second = (json.loads(specllm_here(home, *flags, "--spec", "off").stdout) for _ in range(2))
    assert first["seed"] != second["seed"] and first["text"] != second["text"]  # 24 tokens at temperature 1: apart
    again = json.loads(specllm_here(home, *flags, "--spec", "ngram", "--seed", str(first["seed"])).stdout)
    assert again["seed"] == first["seed"] and again["text"] == first["text"]
