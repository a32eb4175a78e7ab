"""The command line: Typer commands and rich rendering. The only package that prints."""

from __future__ import annotations

import errno
import io
import os
import sys

import typer

# Each module registers its commands on `app`.
from specllm.cli import bench_cmd, chat_cmd, models_cmd, run_cmd, serve_cmd  # noqa: E402,F401 - each registers its commands
from specllm.cli.app import app
from specllm.cli.common import utf8_streams
from specllm.cli import interrupt
from specllm.cli.interrupt import Terminated
from specllm.errors import SpecllmError, UsageError, one_line

# Typer re-exports click's exception classes, or (Typer >= 0.2x, which no longer needs click) those
# of the click copy it vendors: take them from Typer, so either kind of install is mapped.
_click_errors = sys.modules[typer.BadParameter.__module__]
ClickException = _click_errors.ClickException


def _error(message: str) -> None:
    try:
        print(f"Error: {message}", file=sys.stderr)
    except (OSError, ValueError):  # stderr closed, its descriptor taken by a file Python opened: the exit code still tells
        pass


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps failures to one stderr line and the documented exit codes.

    The command runs through click's make_context/invoke rather than click's (or Typer's) main,
    which would turn Ctrl-C into exit code 1 or 0 and a closed pipe into exit code 1.
    """
    interrupt.install()  # SIGTERM: exit 143; a signal lost on the way (noted) still ends the command
    _stand_in_for_closed_streams()
    utf8_streams()  # every command's text, whatever the system's code page
    command = typer.main.get_command(app)
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with command.make_context("specllm", args) as ctx:
            command.invoke(ctx)
        interrupt.raise_pending()  # a Ctrl-C dropped where Python could not raise it (a finalizer): exit 130 all the same
    except typer.Exit as exc:
        _flush_stdout()
        sys.exit(exc.exit_code)
    except ClickException as exc:
        _usage_error(exc, _subcommand(command, args))
    except (KeyboardInterrupt, typer.Abort):
        interrupt.handled()
        _quiet_stdout()
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        interrupt.handled()
        _quiet_stdout()
        print("Terminated.", file=sys.stderr)
        sys.exit(143)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(0)
    except SystemExit as exc:
        if isinstance(exc.__context__, BrokenPipeError):  # rich ends a closed pipe with exit code 1
            _quiet_stdout()
            sys.exit(0)
        raise
    except OSError as exc:  # SpecllmError explains the files it knows; this is what is left: mostly stdout
        _error(_describe_os_error(exc))
        _quiet_stdout()
        sys.exit(1)
    except UsageError as exc:
        _error(str(exc))
        sys.exit(2)
    except SpecllmError as exc:
        _error(str(exc))
        if os.environ.get("SPECLLM_DEBUG"):
            raise
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback on request
        if os.environ.get("SPECLLM_DEBUG"):
            raise
        _error(f"unexpected {type(exc).__name__}: {one_line(exc)} (a bug; SPECLLM_DEBUG=1 shows the traceback)")
        sys.exit(1)
    _flush_stdout()


def _subcommand(command, args: list[str]) -> str | None:
    """The command `args` name (`run` in `run -p hi -n`), or None."""
    return next((arg for arg in args if arg in getattr(command, "commands", {})), None)


def _usage_error(exc, subcommand: str | None = None) -> None:
    """Click's usage errors as one line (its own show() prints the usage block first), pointing at
    the help of the command they concern."""
    message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if not message.strip():  # no arguments: Typer has already printed the help
        pass
    elif "\n" in message.strip():  # no arguments (plain click): the message is the help text
        exc.show()
    else:
        command = ctx.command_path if ctx is not None else "specllm"  # a missing value: click names no command
        if command == "specllm" and subcommand is not None:
            command += f" {subcommand}"
        hint = f" (see `{command} --help`)" if exc.exit_code == 2 else ""
        _error(message + hint)
    sys.exit(exc.exit_code)


def _describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or one_line(exc)
    return f"{exc.filename}: {reason}" if exc.filename else f"cannot write the output: {reason}"


class _ClosedOutput(io.TextIOBase):
    """stdout when the process started with it closed: the first write fails as writing to a closed
    descriptor does (`echo hi >&-`), and main says so in one line; `serve`, which writes nothing
    there, runs."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def isatty(self) -> bool:
        return False


def _stand_in_for_closed_streams() -> None:
    """Started with a standard stream closed (`<&-`, `>&-`), Python leaves it None: reading stdin or
    writing stdout raised AttributeError (reported as a bug), and print(file=None), every error line,
    wrote to stdout, among the generated text. A closed stdin reads as an empty one (`</dev/null`)."""
    if sys.stdin is None:
        sys.stdin = open(os.devnull)  # noqa: SIM115 - for the process's life
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the process's life: what would go there is lost, as the user asked
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()


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
