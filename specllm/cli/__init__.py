"""The command line: Typer commands and rich rendering. The only package that prints."""

from __future__ import annotations

import os
import signal
import sys

import click
import typer

from specllm.errors import SpecllmError, UsageError

app = typer.Typer(
    name="specllm",
    help="Lossless speculative decoding for local GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module registers its commands on `app`.
from specllm.cli import models_cmd, run_cmd  # noqa: E402,F401

try:  # commands that may not exist yet in a partial checkout stay optional
    from specllm.cli import chat_cmd  # noqa: F401
except ImportError:  # pragma: no cover
    pass
try:
    from specllm.cli import bench_cmd  # noqa: F401
except ImportError:  # pragma: no cover
    pass


def _error(message: str) -> None:
    print(f"Error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps failures to one stderr line and the documented exit codes."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="specllm", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        _quiet_stdout()
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        _quiet_stdout()
        print("Terminated.", file=sys.stderr)
        sys.exit(143)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(0)
    except UsageError as exc:
        _error(str(exc))
        sys.exit(2)
    except SpecllmError as exc:
        _error(str(exc))
        if os.environ.get("SPECLLM_DEBUG"):
            raise
        sys.exit(1)
    _flush_stdout()


class Terminated(Exception):
    """SIGTERM, turned into an exception so that output already written is flushed."""


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise Terminated()


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()


def _quiet_stdout() -> None:
    """After a closed pipe, point stdout at devnull so the interpreter's final flush stays silent."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
