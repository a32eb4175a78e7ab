"""What `bench` prints means what it says: the expected speedup on copies, a run that fails."""

import json

import pytest

from specllm.bench.harness import BenchSettings, Run, expected_speedup, expected_tokens, oracle_speedup, run_bench, summarize, without_failures
from specllm.bench.workloads import Prompt
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder
from specllm.engine.drafters import NgramDrafter
from specllm.engine.sampling import SamplingParams
from specllm.engine.stats import SourceStats, Stats
from specllm.errors import SpecllmError
from tests.bench_helpers import FakeEngine
from tests.cli_helpers import specllm_here

COSTS = CostModel({k: 0.1 + 0.01 * (k - 1) for k in range(1, 10)})


def _copying_run(prompt: Prompt) -> Run:
    """10 drafted passes of 8 tokens each, accepted whole or not at all (a copy that holds or does
    not): α = 0.5 per token, yet a drafted pass commits 1 + 4 tokens, not the textbook's 2."""
    stats = Stats(tokens=50, committed=50, target_passes=10, seconds=1.0, drafted=80, accepted=40, draft_steps=10)
    stats.by_source["ngram"] = SourceStats(steps=10, drafted=80, accepted=40, lengths={8: 10})
    stats.per_position = [[10, 5] for _ in range(8)]
    return Run(prompt, "ngram", 0, [1, 2, 3], list(range(50)), stats)


def test_the_expected_speedup_reads_copies_accepted_whole_by_their_measured_acceptance_per_position():
    prompt = Prompt("1", "code_edit", "x")
    off = Run(prompt, "off", 0, [1, 2, 3], list(range(50)), Stats(tokens=50, committed=50, target_passes=50, seconds=5.0))
    row = next(r for r in summarize([off, _copying_run(prompt)], COSTS, greedy=True) if r["strategy"] == "ngram")
    cost = COSTS.relative(9)  # drafting took no time: a drafted pass costs its batch of 9
    assert row["mean_accepted_length"] == 5.0  # as committed: 50 tokens in 10 passes
    assert row["expected_speedup"] == pytest.approx(round(5.0 / cost, 3))  # by position: 1 + 8 * 0.5 tokens a pass
    assert row["expected_speedup_independent"] == pytest.approx(round(expected_speedup(0.5, 8, 0.0, cost), 3))
    assert row["expected_speedup_independent"] < 0.5 * row["expected_speedup"]  # the textbook's independent α under-reads copies


def test_expected_tokens_by_position_is_the_textbook_where_acceptance_is_independent():
    alpha, gamma = 0.7, 5
    survival = [alpha ** (i + 1) for i in range(8)]
    assert expected_tokens(survival, gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))
    assert expected_tokens([1.0, 0.5], 1.5) == pytest.approx(1 + 1.0 + 0.25)  # half of the second position
    assert expected_tokens([0.5], 3) == pytest.approx(1.5)  # positions never drafted accept nothing


class _FailingEngine(FakeEngine):
    """ngram's generation of prompt "1" fails in llama.cpp, after its first step."""

    def decoder(self, strategy):
        decoder = super().decoder(strategy)
        if strategy != "ngram":
            return decoder
        plain = decoder.generate

        def generate(tokens, *args, **kwargs):
            for n, event in enumerate(plain(tokens, *args, **kwargs)):
                if tokens == self.encode("hello") and n == 2:
                    raise SpecllmError("llama.cpp failed to evaluate a batch of 5 tokens (status 1)")
                yield event

        decoder.generate = generate
        return decoder


def test_a_run_that_fails_is_kept_as_failed_and_the_bench_goes_on():
    prompts = [Prompt("0", "a", "abcabcab"), Prompt("1", "a", "hello"), Prompt("2", "b", "xyzxyz")]
    settings = BenchSettings(["off", "ngram"], max_tokens=6, params=SamplingParams(temperature=0), repeats=2)
    runs = list(run_bench(_FailingEngine(), prompts, settings))
    assert len(runs) == 12  # every run, the failed ones among them
    kept, failed = without_failures(runs)
    assert [(r.prompt.id, r.strategy, r.repeat) for r in failed] == [("1", "ngram", 0), ("1", "ngram", 1)]
    assert "status 1" in failed[0].error
    assert {(r.prompt.id, r.repeat) for r in kept} == {("0", 0), ("2", 0), ("0", 1), ("2", 1)}  # off's run of prompt 1 out too
    rows = {(r["category"], r["strategy"]): r for r in summarize(kept, None, greedy=True)}
    assert rows[("a", "off")]["prompts"] == rows[("a", "ngram")]["prompts"] == 1


def test_a_warm_decoder_whose_run_failed_is_not_used_again():
    engine = _FailingEngine()
    settings = BenchSettings(["off", "ngram"], max_tokens=6, params=SamplingParams(temperature=0), warm=True)
    list(run_bench(engine, [Prompt("0", "a", "abcabcab"), Prompt("1", "a", "hello"), Prompt("2", "b", "xyzxyz")], settings))
    assert engine.created[2:] == ["off", "ngram", "ngram"]  # a fresh ngram decoder after prompt 1's failure


def test_the_bench_command_reports_what_finished_when_one_run_fails(home, tmp_path, tiny_pair, monkeypatch):
    """One strategy failing on one prompt lost the whole bench (every finished run) in one error line."""
    plain = Decoder.generate
    prompts = tmp_path / "p.jsonl"
    rows = [{"question_id": 7, "category": "qa", "turns": ["Say hi."]}, {"question_id": 8, "category": "qa", "turns": ["Count to three."]}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def generate(self, prompt, max_tokens, *args, **kwargs):
        for n, event in enumerate(plain(self, prompt, max_tokens, *args, **kwargs)):
            if isinstance(self.drafter, NgramDrafter) and max_tokens == 6 and generate.prompts.pop(tuple(prompt), False):
                raise SpecllmError("llama.cpp failed to evaluate a batch of 4 tokens (status 1)")
            yield event

    generate.prompts = {}
    monkeypatch.setattr(Decoder, "generate", generate)
    from specllm.session import Engine

    encode = Engine.encode

    def encode_and_mark(self, text, *args, **kwargs):
        tokens = encode(self, text, *args, **kwargs)
        if text == "Say hi.":
            generate.prompts.setdefault(tuple(tokens), True)  # the first run of it fails (warm-up apart: 8 tokens)
        return tokens

    monkeypatch.setattr(Engine, "encode", encode_and_mark)
    out = tmp_path / "bench.json"
    args = ["bench", "-m", tiny_pair[0], "--prompts", prompts, "-n", "6", "-c", "256", "-t", "1", "--strategies", "ngram", "--json", out]
    done = specllm_here(home, *args)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "Error: 1 of 4 runs failed (see the warnings); the figures leave their prompts out"
    assert any(
        line.startswith("warning: ngram failed on question_id 7 (qa, repeat 1): llama.cpp failed to evaluate a batch of 4 tokens (status 1);")
        for line in lines
    )
    assert "specllm bench" in done.stdout  # the table of what finished
    report = json.loads(out.read_text())
    error = "llama.cpp failed to evaluate a batch of 4 tokens (status 1)"
    assert report["failed"] == [{"prompt": "7", "category": "qa", "strategy": "ngram", "repeat": 0, "error": error}]
    assert {r["prompt"] for r in report["runs"]} == {"8"}
    assert all(r["prompts"] == 1 for r in report["results"])


def test_the_oracle_counts_the_pass_that_chose_the_end_of_a_generation():
    """Plain decoding's text that the target ended took one pass more than it has tokens, and the
    measured times include it; the oracle priced 8 passes for a 9-pass run (4.0x for 4.5x)."""
    flat = CostModel({k: 1.0 for k in range(1, 9)})
    prompt, text = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]  # a plain pass, then the rest copied in one
    ended = Stats(tokens=8, committed=9, target_passes=9, seconds=0.9, finish_reason="stop")
    cut = Stats(tokens=8, committed=8, target_passes=8, seconds=0.8, finish_reason="length")
    p = Prompt("1", "code_edit", "x")
    assert oracle_speedup([Run(p, "off", 0, prompt, text, ended)], flat, (1, 2)) == pytest.approx(9 / 2)  # the end token the copy's bonus
    assert oracle_speedup([Run(p, "off", 0, prompt, text, cut)], flat, (1, 2)) == pytest.approx(8 / 2)
