"""A target pass that fails in the middle of `run` or a `chat` script (llama.cpp out of memory for a batch): the text
generated so far is kept (on stdout, and in `--json` with the error), then one line and exit 1."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import specllm_here
from tests.fakes import PASS_FAILURE as FAILURE
from tests.fakes import fail_generations


@pytest.fixture
def fails_after_three_tokens(monkeypatch):
    fail_generations(monkeypatch, after=3)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_pass_failing_mid_generation_keeps_what_was_generated(home, tiny_pair, fails_after_three_tokens, as_json):
    """With --json the whole object was lost (only the error line came); the text now comes first."""
    args = ["run", "-m", tiny_pair[0], "--spec", "off", "--temp", "0", "-n", "12", "-c", "256", "-t", "1", "-p", "Count to ten."]
    done = specllm_here(home, *args, *(["--json"] if as_json else []))
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"Error: {FAILURE}"
    if as_json:
        result = json.loads(done.stdout)
        assert (result["finish_reason"], result["error"], len(result["tokens"])) == ("error", FAILURE, 3)
        assert result["text"]
    else:
        assert done.stdout.strip() and done.stdout.endswith("\n")  # the three tokens' text, its line ended


def test_a_run_that_does_not_fail_says_no_error_in_its_json(home, tiny_pair):
    args = ["run", "-m", tiny_pair[0], "--spec", "off", "--temp", "0", "-n", "4", "-c", "256", "-t", "1", "-p", "Hi.", "--json"]
    done = specllm_here(home, *args)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["error"] is None


def test_a_chat_script_ends_at_a_failed_pass_after_the_reply_so_far(home, tiny_pair, fails_after_three_tokens):
    """As `run`: the reply so far on stdout, its line ended, then one line (no traceback) and exit 1;
    the script's next message is not answered."""
    args = ["chat", "-m", tiny_pair[0], "--spec", "off", "--temp", "0", "-n", "12", "-c", "256", "-t", "1"]
    done = specllm_here(home, *args, stdin=b"Count to ten.\nAnd again.\n")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"Error: {FAILURE}"]
    alone = specllm_here(home, "run", *args[1:], "-p", "Count to ten.")  # the same three tokens, the same way
    assert done.stdout == alone.stdout and done.stdout.strip() and done.stdout.endswith("\n")
