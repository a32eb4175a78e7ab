"""scripts/compare_peers.py: llama.cpp's speculative modes beside specllm's strategies, per category."""

import json
import subprocess
import sys

import pytest

from tests.script_loader import SCRIPTS, load_script

SCRIPT = SCRIPTS / "compare_peers.py"

PEERS = """\
translation
1 translation plain=20.0 draft-simple=10.0(acc 50.0%) ngram-simple=20.0(acc -%) ngram-simple,draft-simple=(acc -%)
code_edit
2 code_edit plain=10.0 draft-simple=5.0(acc 100.0%) ngram-simple=40.0(acc 100.0%) ngram-simple,draft-simple=20.0(acc 100.0%)
"""


def _load():
    return load_script("compare_peers")


def _run(prompt, strategy, tokens, seconds, repeat=0):
    return {"prompt": prompt, "strategy": strategy, "repeat": repeat, "tokens": tokens, "seconds": seconds}


def _report():
    runs = [
        _run("1", "off", 100, 5.0), _run("1", "auto", 100, 5.0),  # 20 tok/s both
        _run("2", "off", 20, 2.0), _run("2", "auto", 20, 0.5),  # 10 and 40 tok/s
        _run("2", "off", 20, 2.0, repeat=1), _run("2", "auto", 20, 0.5, repeat=1),
    ]
    return {"settings": {"repeats": 2}, "runs": runs}


def test_peer_lines_are_parsed_a_mode_without_a_speed_left_out_and_idle_modes_named():
    peers = _load().parse_peers(PEERS)
    assert peers["1"] == ("translation", {"plain": 20.0, "draft-simple": 10.0, "ngram-simple": 20.0}, {"ngram-simple"})
    assert peers["2"][1]["ngram-simple,draft-simple"] == 20.0


def test_categories_are_weighted_by_the_tokens_off_generated():
    compare = _load()
    speeds, weights = compare.specllm_speeds(_report())
    assert weights == {"1": 100, "2": 20}  # repeats averaged
    categories = {"1": "translation", "2": "code_edit"}
    ours = compare.category_ratios(speeds, categories, weights, "off")
    assert ours["code_edit"]["auto"] == pytest.approx(4.0)
    assert ours["all"]["auto"] == pytest.approx((5.0 + 2.0) / (5.0 + 0.5))  # plain time over auto's time
    theirs = compare.category_ratios({p: s for p, (_, s, _) in compare.parse_peers(PEERS).items()}, categories, weights, "plain")
    assert theirs["translation"]["draft-simple"] == pytest.approx(0.5)
    assert theirs["all"]["ngram-simple"] == pytest.approx((5.0 + 2.0) / (5.0 + 0.5))
    assert "ngram-simple,draft-simple" not in theirs["translation"]  # no speed printed for that prompt
    assert theirs["all"]["ngram-simple,draft-simple"] == pytest.approx(2.0)  # only where it ran


def test_the_table_names_auto_against_the_best_peer(tmp_path):
    (tmp_path / "peers.txt").write_text(PEERS)
    (tmp_path / "bench.json").write_text(json.dumps(_report()))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "peers.txt"), str(tmp_path / "bench.json")],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["code_edit"].endswith("| 4.00x | 1.00 |")  # auto 4x, ngram-simple 4x: level
    assert rows["translation"].endswith("| 1.00x | 1.00 |")
    assert out.splitlines()[-2].endswith("llama.cpp 17.14 tok/s, specllm 17.14 tok/s")  # 120 tokens in 7 s each
    assert out.splitlines()[-1].startswith("llama.cpp runs that drafted nothing: 1, against plain 1.00x")
