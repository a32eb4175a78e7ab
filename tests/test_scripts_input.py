"""The developer scripts (`scripts/`) given what a user may give them: a file of another kind, a
missing one, an empty recording, a generation of no tokens, a count of zero. Each refuses in one
line on stderr (exit 1, or 2 for a flag argparse refuses) before any model loads, or replays what it
can; none overwrites a file that is not its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.replay_data import DATA
from tests.script_loader import SCRIPTS, load_script

CURVE = str(DATA / "zen3-avx2-2core.json")


def _script(name: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _one_line(done: subprocess.CompletedProcess, code: int, text: str) -> None:
    """Exit `code`, nothing on stdout, one line on stderr that holds `text`."""
    assert done.returncode == code and done.stdout == "", done.stderr
    lines = done.stderr.strip().splitlines()
    assert (len(lines) == 1 or code == 2) and text in lines[-1], done.stderr


def _recording(streams: list[dict], **fields) -> dict:
    return {"eog": 999, "max_tokens": 8, "sentence_ends": [], "streams": streams, **fields}


def _stream(id_: str, category: str, tokens: list[int], stopped: bool = False, **fields) -> dict:
    prompt = [(i * 7) % 97 + 3 for i in range(40)]
    return {"id": id_, "category": category, "prompt": prompt, "tokens": tokens, "stopped": stopped, **fields}


@pytest.mark.parametrize("script", ["replay_policy.py", "replay_session.py"])
def test_a_replay_given_files_of_the_wrong_kind_says_which_in_one_line(script, tmp_path):
    (tmp_path / "empty.json").write_text(json.dumps(_recording([])))
    (tmp_path / "text.json").write_text("not json\n")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "nothing.json").write_text("{}")
    recording = str(DATA / "dev-streams.json")
    _one_line(_script(script, "replay", tmp_path / "nope.json", "--costs", CURVE), 1, "nope.json: no such file")
    _one_line(_script(script, "replay", CURVE, "--costs", CURVE), 1, "a cost curve, not a recording")
    _one_line(_script(script, "replay", recording, "--costs", recording), 1, "a recording, not a cost curve")
    _one_line(_script(script, "replay", tmp_path / "empty.json", "--costs", CURVE), 1, "a recording of no prompts")
    _one_line(_script(script, "replay", tmp_path / "text.json", "--costs", CURVE), 1, "text.json: not JSON")
    _one_line(_script(script, "replay", recording, "--costs", CURVE, tmp_path / "list.json"), 1, "list.json: not a cost curve")
    _one_line(_script(script, "replay", recording, "--costs", tmp_path / "nothing.json"), 1, "nothing.json: not a cost curve")
    _one_line(_script(script, "replay", recording, "--costs", tmp_path), 1, "Is a directory")
    _one_line(_script(script, "replay", recording, "--costs", CURVE, "--max-batch", "1"), 2, "--max-batch: 1 is below 2")


def test_a_session_recording_replays_prompt_by_prompt_and_a_workload_recording_as_a_session(tmp_path):
    """`replay_session.py record` keeps each request's max_tokens (no recording-wide one), and its
    warm-up requests generate no token; `replay_policy.py record` keeps one for all. Each replay reads
    the other's recording: the generations of no tokens show a dash, not a division by zero."""
    text = [(i * 7) % 97 + 3 for i in range(30)]
    session = _recording(
        [_stream("0", "warm-up", [], max_tokens=0), _stream("1", "copy", text, max_tokens=30), _stream("2", "copy", text, max_tokens=30)]
    )
    del session["max_tokens"]
    (tmp_path / "session.json").write_text(json.dumps(session))
    done = _script("replay_policy.py", "replay", tmp_path / "session.json", "--costs", CURVE, "-v")
    assert done.returncode == 0, done.stderr
    warm_up = [line.split() for line in done.stdout.splitlines() if line.startswith("warm-up ")]
    assert warm_up[0] == ["warm-up", "0", "auto", "-", "oracle", "-"]  # its verbose line
    assert warm_up[1] == ["warm-up", "1"] + ["-"] * 7  # its category's row: nothing was timed
    assert [line.split()[:2] for line in done.stdout.splitlines() if line.startswith("all ")] == [["all", "3"]]
    workload = json.loads((DATA / "held-streams.json").read_text())
    workload["streams"] = workload["streams"][:3]
    (tmp_path / "workload.json").write_text(json.dumps(workload))
    done = _script("replay_session.py", "replay", tmp_path / "workload.json", "--costs", CURVE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split()[:2] == ["all", "3"]


def test_a_session_replay_of_requests_that_generated_nothing_says_so(tmp_path):
    (tmp_path / "warm.json").write_text(json.dumps(_recording([_stream("0", "infill", [], max_tokens=0)])))
    done = _script("replay_session.py", "replay", tmp_path / "warm.json", "--costs", CURVE)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "no request was answered with a token: nothing timed", done.stderr


def test_a_recording_whose_category_is_the_summary_rows_name_is_refused(tmp_path):
    (tmp_path / "all.json").write_text(json.dumps(_recording([_stream("0", "all", [5, 6])])))
    _one_line(_script("replay_policy.py", "replay", tmp_path / "all.json", "--costs", CURVE), 1, "the category 'all'")
    (tmp_path / "requests.jsonl").write_text(json.dumps({"endpoint": "completions", "prompt": "x", "category": "all"}) + "\n")
    _one_line(_script("replay_session.py", "record", "--requests", tmp_path / "requests.jsonl", "--out", tmp_path / "s.json"), 1, "requests.jsonl:1")


def test_a_session_recording_checks_every_request_before_the_model_loads(tmp_path):
    """A bad request on the last line used to stop the recording there, every answer before it lost."""
    good = {"endpoint": "completions", "prompt": "def add(a, b):", "max_tokens": 8}
    cases = {
        "not json": "a request is",
        json.dumps({"prompt": "x"}): 'a request is a JSON object with "endpoint"',
        json.dumps({"endpoint": "chat", "messages": "hi"}): "'messages' must be",
        json.dumps({"endpoint": "completions", "continue": True, "prompt": "x"}): "\"continue\" carries on a chat",
    }
    for line, message in cases.items():
        (tmp_path / "requests.jsonl").write_text(json.dumps(good) + "\n\n" + line + "\n")
        done = _script("replay_session.py", "record", "--requests", tmp_path / "requests.jsonl", "--out", tmp_path / "s.json", "--model", "nope.gguf")
        _one_line(done, 1, "requests.jsonl:3: " + ("not JSON" if line == "not json" else message))
    assert not (tmp_path / "s.json").exists()
    _one_line(_script("replay_session.py", "record", "--requests", tmp_path / "none.jsonl", "--out", tmp_path / "s.json"), 1, "none.jsonl: No such file")


def test_recording_into_a_file_that_is_not_a_recording_is_refused_and_the_file_kept(tmp_path):
    """`record --out` resumes a recording it finds there; a curve (or the prompts) named by a slip
    was replaced by the new recording."""
    curve = tmp_path / "curve.json"
    shutil.copy(CURVE, curve)
    before = curve.read_bytes()
    _one_line(_script("replay_policy.py", "record", "--out", curve, "-n", "4"), 1, "exists and is not a recording")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    _one_line(_script("replay_policy.py", "record", "--out", tmp_path / "prompts.jsonl"), 1, "exists and is not a recording")
    assert curve.read_bytes() == before


def _prompts(path):
    rows = [{"question_id": 1, "category": "copy", "turns": ["say a b c a b c a b"]}, {"question_id": 2, "category": "other", "turns": ["hello"]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_recording_resumes_only_with_its_own_max_tokens_and_model(tiny_pair, tmp_path):
    """A stopped recording resumes where it stopped: at its own -n (another was ignored, the new
    prompts then recorded at the old one), and with the model that made it (another's tokens were
    added beside its own, and replayed as the same text)."""
    target, draft = tiny_pair
    out, prompts = tmp_path / "rec.json", _prompts(tmp_path / "prompts.jsonl")
    common = ["--out", out, "--prompts", prompts, "-c", "256", "-m", target, "--draft", draft]
    done = _script("replay_policy.py", "record", *common, "-n", "6", "--limit", "1")
    assert done.returncode == 0, done.stderr
    first = json.loads(out.read_text())
    assert first["max_tokens"] == 6 and len(first["streams"]) == 1
    _one_line(_script("replay_policy.py", "record", *common, "-n", "8"), 1, "recorded with -n 6")
    assert json.loads(out.read_text()) == first
    other = json.loads(out.read_text())
    other["streams"][0]["prompt"] = other["streams"][0]["prompt"][1:]  # what another model's tokenizer made of it
    out.write_text(json.dumps(other))
    _one_line(_script("replay_policy.py", "record", *common), 1, "recorded with another model or other prompts")
    out.write_text(json.dumps(first))
    done = _script("replay_policy.py", "record", *common)  # no -n: the recording's own
    assert done.returncode == 0, done.stderr
    resumed = json.loads(out.read_text())
    assert resumed["max_tokens"] == 6 and resumed["streams"][0] == first["streams"][0] and len(resumed["streams"]) == 2


def test_compare_llama_cpp_refuses_counts_of_zero():
    """llama-cpp-python reads max_tokens 0 as "until the context is full": -n 0 compared a whole
    context's generation with specllm's none; --rounds 0 printed nan."""
    _one_line(_script("compare_llama_cpp.py", "-n", "0"), 2, "argument -n: 0 is below 1")
    _one_line(_script("compare_llama_cpp.py", "--rounds", "0"), 2, "argument --rounds: 0 is below 1")
    _one_line(_script("compare_llama_cpp.py", "-m", "nope.gguf", "-n", "4"), 1, "Error: model file not found: nope.gguf")


def test_compare_peers_leaves_out_a_prompt_off_answered_with_no_token(tmp_path):
    compare = load_script("compare_peers")
    runs = [
        {"prompt": "1", "strategy": "off", "tokens": 0, "seconds": 0.05}, {"prompt": "1", "strategy": "auto", "tokens": 0, "seconds": 0.05},
        {"prompt": "2", "strategy": "off", "tokens": 20, "seconds": 2.0}, {"prompt": "2", "strategy": "auto", "tokens": 20, "seconds": 1.0},
    ]  # fmt: skip
    speeds, weights = compare.specllm_speeds({"runs": runs})
    ratios = compare.category_ratios(speeds, {"1": "qa", "2": "code_edit"}, weights, "off")
    assert ratios["all"]["auto"] == pytest.approx(2.0) and "qa" not in ratios
    (tmp_path / "peers.txt").write_text("1 qa plain=20.0 ngram-simple=20.0(acc -%)\n2 code_edit plain=10.0 ngram-simple=20.0(acc 90.0%)\n")
    (tmp_path / "bench.json").write_text(json.dumps({"runs": runs}))
    done = _script("compare_peers.py", tmp_path / "peers.txt", tmp_path / "bench.json")
    assert done.returncode == 0, done.stderr
    _one_line(_script("compare_peers.py", tmp_path / "peers.txt", DATA / "dev-streams.json"), 1, "not a `specllm bench --json` report")


def test_agent_replay_stops_before_any_server_where_llama_cpp_server_cannot_start(tiny_pair, tmp_path):
    """specllm's session ran first, for minutes, and was lost when llama_cpp.server then failed to import."""
    workload = tmp_path / "w.jsonl"
    row = {"question_id": 1, "category": "code_edit", "source": "x lib/base64.py:f", "turns": ["Rename it.\n\n```python\ndef f():\n    pass\n```"]}
    workload.write_text(json.dumps(row) + "\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    failing = shutil.which("false") or "/bin/false"
    done = _script("agent_replay.py", "--workload", workload, "-m", tiny_pair[0], "--llama-python", failing, "--logs", logs, "--turns", "1")
    _one_line(done, 1, f"cannot start llama_cpp.server in {failing}")
    assert list(logs.iterdir()) == []  # no server was started
    _one_line(_script("agent_replay.py", "--turns", "0"), 2, "--turns: 0 is below 1")
    _one_line(_script("agent_replay.py", "--workload", tmp_path / "none.jsonl"), 1, "none.jsonl: No such file")


def test_profile_overhead_names_the_rows_a_category_has(tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl")
    _one_line(_script("profile_overhead.py", "--prompts", prompts, "--category", "copy", "--row", "3"), 1, "--row 3: ")
    _one_line(_script("profile_overhead.py", "--prompts", prompts, "--category", "nope"), 1, "no category nope")


def test_a_twin_cut_short_leaves_no_file_a_later_run_would_take_for_whole(tiny_pair, tmp_path):
    """`gpu_kit.sh measure` expands a twin only where none stands: one cut short by a type the script
    cannot write (or a full disk) stood there, and every later run measured a damaged model."""
    twin = load_script("gguf_twin")
    twin.write_header(tiny_pair[0], tmp_path / "tiny")
    layout = json.loads((tmp_path / "tiny.json").read_text())
    layout["tensors"][-1]["type"] = "IQ2_XXS"
    (tmp_path / "tiny.json").write_text(json.dumps(layout))
    done = _script("gguf_twin.py", "expand", tmp_path / "tiny", tmp_path / "twin.gguf")
    assert done.returncode == 1 and "is not supported" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.head", "tiny.json"]
    _one_line(_script("gguf_twin.py", "expand", tmp_path / "none", tmp_path / "twin.gguf"), 1, "none.json: No such file")


@pytest.mark.parametrize("script", ["measure_curve.py", "measure_overlap.py"])
def test_a_model_file_that_is_not_there_is_named_so(script, tiny_pair, tmp_path):
    _one_line(_script(script, tmp_path / "none.gguf", tiny_pair[1]), 1, f"Error: {tmp_path / 'none.gguf'}: no such file")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xz") is None, reason="a bash script, xz archives")
def test_the_gpu_kit_says_what_is_missing_to_pack_and_why_its_build_does_not_run(tmp_path):
    script = str(SCRIPTS / "gpu_kit.sh")
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(tmp_path), "WORK": str(tmp_path / "work"),
           "KIT": str(tmp_path / "kit"), "OUT": str(tmp_path / "out"), "SPECLLM_CACHE": str(tmp_path / "cache")}  # fmt: skip
    done = subprocess.run(["bash", script, "pack"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stderr.splitlines() == [f"pack: no llama-cpp-python wheel in {tmp_path}/work/wheel (made by build)"]
    (tmp_path / "work/wheel").mkdir(parents=True)
    (tmp_path / "work/wheel/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"")
    done = subprocess.run(["bash", script, "pack"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stderr.startswith(f"pack: no {tmp_path}/cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert not (tmp_path / "kit").exists()
    # a kit whose llama_cpp does not import: said so, not "this build does not offload here"
    (tmp_path / "site/llama_cpp").mkdir(parents=True)
    (tmp_path / "site/llama_cpp/__init__.py").write_text("raise ImportError('a library is missing')\n")
    (tmp_path / "kit").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "site"), "-cJf", str(tmp_path / "kit/site.tar.xz"), "."], check=True)
    subprocess.run(["tar", "-C", str(tmp_path / "kit"), "-cJf", str(tmp_path / "kit/heads.tar.xz"), "--files-from", "/dev/null"], check=True)
    done = subprocess.run(["bash", script, "measure"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and "measure: python3 cannot import llama_cpp from" in done.stderr
    assert "a library is missing" in (tmp_path / "out/times.txt").read_text()
