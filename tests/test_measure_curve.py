"""The scripts that measure a machine: measure_curve.py (a machine file from a real, tiny pair, which
the replay reads), measure_overlap.py (the draft model reading a prompt beside the target's decoding)
and gpu_kit.sh (both, where a GPU is lent for minutes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.script_loader import SCRIPTS, load_script


def test_a_measured_curve_is_a_machine_file_the_replay_reads(tiny_pair, tmp_path):
    command = [sys.executable, str(SCRIPTS / "measure_curve.py"), *map(str, tiny_pair), "--machine", "tiny pair, 1 thread",
               "--max-batch", "4", "--ctx-size", "512", "--threads", "1", "--gpu-layers", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["machine"] == "tiny pair, 1 thread" and report["gpu_layers"] == {"target": 0, "draft": 0}
    assert report["load_seconds"]["target"] > 0 and report["load_seconds"]["draft"] > 0
    (tmp_path / "curve.json").write_text(done.stdout)
    costs = load_script("replay_policy").load_curve(str(tmp_path / "curve.json"), 32)
    assert sorted(costs.batch_seconds) == [1, 2, 3, 4] and costs.draft_seconds > 0
    assert all(costs.batch_seconds[1] <= costs.batch_seconds[k] <= k * costs.batch_seconds[1] for k in (2, 3, 4))


@pytest.mark.skipif(shutil.which("bash") is None, reason="a bash script")
def test_the_gpu_kit_says_how_it_is_used_and_stops_in_one_line_without_its_kit(tmp_path):
    """`scripts/gpu_kit.sh` (run where a GPU is lent for minutes): its usage, and `measure` where the
    kit did not travel: one line on stderr naming the missing file, exit 1, nothing written."""
    script = str(SCRIPTS / "gpu_kit.sh")
    usage = subprocess.run(["bash", script], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "gpu_kit.sh measure" in usage.stderr
    folders = {name: str(tmp_path / name.lower()) for name in ("KIT", "WORK", "OUT")}
    done = subprocess.run(["bash", script, "measure"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **folders})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"measure: no {folders['KIT']}/site.tar.xz (made by build and pack, on a machine with nvcc)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_overlap_of_the_draft_models_reading_with_decoding_is_measured(tiny_pair):
    """`scripts/measure_overlap.py` on a real (tiny) pair: single-token steps timed alone and while the
    draft model reads a prompt in another thread, and what share of that reading they hid."""
    command = [sys.executable, str(SCRIPTS / "measure_overlap.py"), *map(str, tiny_pair), "--prompt", "64", "--steps", "4",
               "--rounds", "2", "--threads", "1", "--gpu-layers", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["prompt"] == 64 and len(report["rounds"]) == 2 and report["gpu_layers"] == {"target": 0, "draft": 0}
    for measured in report["rounds"]:
        assert measured["step_alone"] > 0 and measured["reading_alone"] > 0 and measured["steps_during_reading"] >= 1
        assert measured["both"] >= measured["reading_during_steps"]  # the reading ran inside the steps' window
        # what the report says was hidden is what its own timings give
        lost = measured["both"] - measured["steps_during_reading"] * measured["step_alone"]  # beyond those steps alone
        assert measured["hidden"] == pytest.approx(1 - lost / measured["reading_alone"])


@pytest.mark.parametrize("script", ["measure_curve.py", "measure_overlap.py"])
def test_a_model_that_does_not_load_is_one_line_and_exit_1(script, tiny_pair, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    done = subprocess.run([sys.executable, str(SCRIPTS / script), str(broken), str(tiny_pair[1])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"Error: {broken}: llama.cpp could not load it (unsupported architecture or damaged file)"]
