"""`specllm chat` as a person uses it at a terminal: pastes, Ctrl-D in a block, a resized window,
TERM=dumb. Some tests run the chat in a pseudo-terminal (on a FakeEngine, no model), bounded by
deadlines; they skip where there is no pty.
"""

from __future__ import annotations

import io
import os
import select
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specllm.chat import ChatSettings, Conversation
from specllm.cli import display
from specllm.cli.chat_loop import ChatLoop
from specllm.cli.display import LiveStatus, colour_allowed
from specllm.cli.interrupt import Terminated
from specllm.engine.sampling import SamplingParams
from specllm.engine.stats import Stats
from tests.fakes import FakeEngine, reader, reference_reply

pty = pytest.importorskip("pty")
ROOT = Path(__file__).resolve().parent.parent

# The chat of `specllm chat -m fake`, its model a FakeEngine: what a pty test drives.
FAKE_CHAT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from specllm.cli import common
from tests.fakes import FakeEngine
common.open_engine = lambda *args, **kwargs: FakeEngine()
from specllm.cli import main
main(["chat", "-m", "fake", "--temp", "0", "-n", "6"] + sys.argv[1:])
"""


class Terminal:
    """`specllm chat` on a FakeEngine in a pseudo-terminal: keys in, every byte it writes out."""

    def __init__(self, *args: str, env: dict | None = None, rows: int = 24, columns: int = 80):
        self.output = b""
        pid, fd = pty.fork()
        if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
            try:
                os.chdir(ROOT)
                environment = {**os.environ, "TERM": "xterm-256color", **(env or {})}
                environment.pop("NO_COLOR", None)
                os.execvpe(sys.executable, [sys.executable, "-c", FAKE_CHAT, *args], environment)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        import fcntl  # (where pty is, these are)
        import struct
        import termios

        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))  # rows x columns, as a window

    def read_until(self, wanted: bytes, seconds: float = 60.0) -> bytes:
        """Everything it writes until `wanted` appears in what came after this call began."""
        start, deadline = len(self.output), time.monotonic() + seconds
        while wanted not in self.output[start:]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {wanted!r} in {seconds}s; it wrote {self.output[start:][-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.5))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child has gone (EIO)
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"it ended before {wanted!r}; it wrote {self.output[start:][-2000:]!r}")
                self.output += chunk
        return self.output[start:]

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def finish(self, seconds: float = 30.0) -> int:
        """Its exit code, after reading what it wrote last; killed if it outlives `seconds`."""
        deadline, open_ = time.monotonic() + seconds, True
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.2) if open_ else ([], [], time.sleep(0.05))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: every end of the terminal closed
                    chunk = b""
                self.output += chunk
                open_ = bool(chunk)
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        raise AssertionError(f"still running after {seconds}s; it wrote {self.output[-2000:]!r}")


@pytest.fixture
def terminal():
    made = []

    def start(*args, **kwargs) -> Terminal:
        made.append(Terminal(*args, **kwargs))
        return made[-1]

    yield start
    for term in made:  # a failed test leaves no process behind
        try:
            os.kill(term.pid, signal.SIGKILL)
            os.waitpid(term.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


GNU_READLINE = False
try:
    import readline as _readline

    GNU_READLINE = "libedit" not in (_readline.__doc__ or "") and getattr(_readline, "_READLINE_VERSION", 0) >= 0x0801
except ImportError:  # pragma: no cover
    pass


@pytest.mark.skipif(not GNU_READLINE, reason="bracketed paste is GNU readline's (8.1 on)")
def test_a_block_pasted_at_the_prompt_is_one_message_and_ctrl_d_leaves_one_newline(terminal):
    """A terminal sends a paste between ESC[200~ and ESC[201~ only to a program that asked for them
    (ESC[?2004h); without that every pasted line was a message of its own, each with a reply."""
    term = terminal()
    assert b"\x1b[?2004h" in term.read_until(b">>> ")
    term.type("\x1b[200~def f(x):\r    return x\r\rprint(f(1))\x1b[201~")
    term.type("\r")
    term.read_until(b">>> ")
    term.type("/stats\r")
    assert b"1 replies" in term.read_until(b">>> ")
    term.type("\x04")
    assert term.finish() == 0
    assert term.output.endswith(b">>> \x1b[?2004l\r\r\n")  # one newline at Ctrl-D (readline's), no blank line


def test_a_dumb_terminal_gets_no_escape_sequences(terminal):
    """TERM=dumb (Emacs' shell): the live status line's cursor movements, the dim notes and the
    bracketed paste switch all came out as garbage there."""
    term = terminal("--spec", "ngram", env={"TERM": "dumb"})
    term.read_until(b">>> ")
    term.type("hello\r")
    term.read_until(b">>> ")
    term.type("/bye\r")
    assert term.finish() == 0
    assert b"\x1b" not in term.output, term.output
    assert reference_reply([{"role": "user", "content": "hello"}], 6).encode() in term.output


# -- the loop, at a (pretend) terminal --------------------------------------------------------


def terminal_loop(**kwargs):
    out = io.StringIO()
    settings = ChatSettings(SamplingParams(temperature=0.0), 5)
    return ChatLoop(FakeEngine(), Conversation(), settings, "ngram", out=out, interactive=True, **kwargs), out


def test_a_pasted_block_whose_first_word_looks_like_a_command_is_a_message(capsys):
    """What readline hands over for a pasted block: one line holding its newlines. It is a message,
    as in ollama, whatever its first word: `/set temp 1` followed by a question was a /set that failed."""
    loop, out = terminal_loop()
    block = "/set temp 1\nwhat does this line do?"
    loop.run(reader([block]))
    assert loop.conversation.messages[0] == {"role": "user", "content": block}
    assert out.getvalue() == reference_reply([{"role": "user", "content": block}], 5) + "\n"
    assert "nothing changed" not in capsys.readouterr().err and loop.settings.params.temperature == 0


def test_ctrl_d_in_a_block_at_a_terminal_sends_it_and_the_chat_goes_on(capsys):
    """Ctrl-D ends the block as it ends a shell's here-document; it ended the chat and dropped the
    lines typed. (A script that ends inside a block still refuses it: test_chat_cli.py.)"""
    loop, out = terminal_loop()
    loop.run(reader(['"""', "line one", "line two", EOFError(), "after"]))
    first = reference_reply([{"role": "user", "content": "line one\nline two"}], 5)
    assert [m["content"] for m in loop.conversation.messages] == ["line one\nline two", first, "after", out.getvalue().splitlines()[1]]
    assert loop.unsent == 0 and "not sent" not in capsys.readouterr().err


def test_sigterm_at_the_prompt_ends_the_line_typed_first(capsys):
    """`Terminated.` came right after the half-typed line (`>>> half typTerminated.`)."""
    loop, _ = terminal_loop()
    with pytest.raises(Terminated):
        loop.run(reader([Terminated()]))
    assert capsys.readouterr().err == "\n"


# -- the live status line ---------------------------------------------------------------------


def a_terminal(stream):
    stream.isatty = lambda: True
    return stream


def test_the_status_line_follows_a_resized_terminal(monkeypatch):
    """The status row and the scroll region were fixed at the reply's start: after a resize the
    status was drawn over the text (smaller) or left in the middle of it, and clearing the old last
    row at the end erased a line of the reply (larger)."""
    out, err = a_terminal(io.StringIO()), a_terminal(io.StringIO())
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TERM", "xterm")
    size = SimpleNamespace(lines=24, columns=80)
    monkeypatch.setattr(display.shutil, "get_terminal_size", lambda *args: size)
    stats = Stats()
    with LiveStatus(True) as live:
        live.update(stats, force=True)
        assert "\x1b[1;23r" in err.getvalue() and "\x1b[24;1H" in err.getvalue()
        size.lines = 40
        err.truncate(0), err.seek(0)
        live.update(stats, force=True)
        drawn = err.getvalue()
        assert "\x1b[1;39r" in drawn and "\x1b[40;1H" in drawn and "\x1b[24;1H" not in drawn
        size.lines = 30
        err.truncate(0), err.seek(0)
    ended = err.getvalue()
    assert "\x1b[30;1H\x1b[2K" in ended and "\x1b[40;1H" not in ended  # the status row of now is cleared, no line of text


def test_a_dumb_terminal_has_no_live_line_and_no_colour(monkeypatch):
    monkeypatch.setattr(sys, "stdout", a_terminal(io.StringIO()))
    monkeypatch.setattr(sys, "stderr", a_terminal(io.StringIO()))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "dumb")
    assert not LiveStatus(True).enabled and not colour_allowed(sys.stderr)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert LiveStatus(True).enabled and colour_allowed(sys.stderr)
