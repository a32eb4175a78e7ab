"""Running `specllm` as a user does and reading what it said (shared by the CLI tests).

`specllm` starts a real process: for what only a process shows (signals, a closed pipe, a hook in
`sitecustomize`, dropped privileges, llama.cpp aborting). `specllm_here` runs the same entry point,
`specllm.cli.main(argv)`, in this process with the same environment, stdin bytes and exit code, and
stdout and stderr read back as text: a tenth of a second instead of a second of interpreter start,
imports and model loading per command.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _argv(args) -> list[str]:
    """Generating commands get one thread unless the test sets --threads: llama.cpp's threads wait
    for each other at every step, which crawls on a busy machine."""
    args = [str(a) for a in args]
    if args[:1] in (["run"], ["chat"], ["bench"]) and not {"-t", "--threads"} & set(args):
        args = [args[0], "-t", "1", *args[1:]]
    return args


def specllm(env: dict, *args, stdin: bytes = b"", prefix: tuple = (), timeout: float = 180) -> subprocess.CompletedProcess:
    """`specllm ARGS` in a real process."""
    command = [*prefix, sys.executable, "-m", "specllm", *_argv(args)]
    done = subprocess.run(command, input=stdin, capture_output=True, env=env, timeout=timeout, cwd=ROOT)
    done.stdout, done.stderr = done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    return done


class CommandTimedOut(BaseException):
    """An in-process command ran past its timeout (a BaseException: main's `except Exception` lets it by)."""


def specllm_here(env: dict, *args, stdin: bytes = b"", timeout: float = 180) -> subprocess.CompletedProcess:
    """`specllm ARGS` through `specllm.cli.main` in this process: `env` is the whole environment
    for the call, stdin is piped bytes (UTF-8, strict, as a UTF-8 locale reads them), and the exit
    code is main's `sys.exit` code. Bounded as a subprocess is: a timer raises CommandTimedOut.
    The process's environment, streams and signal handlers are restored afterwards."""
    from specllm.cli import main

    def expire(signum, frame):
        raise CommandTimedOut(f"specllm {' '.join(argv)} still running after {timeout} s")

    argv = _argv(args)
    saved_env, saved_streams = dict(os.environ), (sys.stdin, sys.stdout, sys.stderr)
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGALRM)}
    streams = [io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", write_through=True) for data in (stdin, b"", b"")]
    os.environ.clear()
    os.environ.update(env)
    sys.stdin, sys.stdout, sys.stderr = streams
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
    out, err = (stream.buffer.getvalue().decode("utf-8", "replace") for stream in streams[1:])
    return subprocess.CompletedProcess(["specllm", *argv], code, out, err)


def assert_one_error(done: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Exit `code`, stdout empty, stderr exactly one `Error: ...` line holding every fragment."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    assert done.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def cache_leftovers(env: dict) -> list[str]:
    """Model files in the cache (costs.json, a finished measurement, is not one)."""
    models = Path(env["SPECLLM_CACHE"]) / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []
