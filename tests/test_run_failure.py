"""A target pass that fails in the middle of `run` (llama.cpp out of memory for a batch): the text
generated so far is kept (on stdout, and in `--json` with the error), then one line and exit 1."""

from __future__ import annotations

import json

import pytest

from specllm.engine.decode import Decoder, TokenCommitted
from specllm.errors import SpecllmError
from tests.cli_helpers import specllm_here

FAILURE = "llama.cpp failed to evaluate a batch of 4 tokens (status 1)"


@pytest.fixture
def fails_after_three_tokens(monkeypatch):
    plain = Decoder.generate

    def generate(self, *args, **kwargs):
        committed = []
        for event in plain(self, *args, **kwargs):
            if isinstance(event, TokenCommitted) and event.token >= 0:
                committed.append(event.token)
                if len(committed) > 3:
                    raise SpecllmError(FAILURE)
            yield event

    monkeypatch.setattr(Decoder, "generate", generate)


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
