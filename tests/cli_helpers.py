"""Running `specllm` as a user does, in a real process, and reading what it said (shared by the CLI tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def specllm(env: dict, *args, stdin: bytes = b"", prefix: tuple = (), timeout: float = 180) -> subprocess.CompletedProcess:
    """`specllm ARGS` in a real process. Generating commands get one thread unless the test sets
    --threads: llama.cpp's threads wait for each other at every step, which crawls on a busy machine."""
    args = [str(a) for a in args]
    if args[:1] in (["run"], ["chat"], ["bench"]) and not {"-t", "--threads"} & set(args):
        args = [args[0], "-t", "1", *args[1:]]
    command = [*prefix, sys.executable, "-m", "specllm", *args]
    done = subprocess.run(command, input=stdin, capture_output=True, env=env, timeout=timeout, cwd=ROOT)
    done.stdout, done.stderr = done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    return done


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
