"""Terminal rendering: streamed text on stdout, live statistics on stderr.

The engine knows nothing of this module; it renders `Stats` snapshots. When stdout and stderr
are the same terminal, the status line lives on the bottom row, outside a scroll region in
which the text streams; when stdout is redirected, it is a single redrawn line on stderr.
`stream_reply` is the loop over a decoder's events that `run` and `chat` share.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from specllm.engine.decode import Done, StepDone, TokenCommitted
from specllm.engine.stats import Stats
from specllm.reasoning import REASONING, ThinkSplitter

SOURCE_STYLES = {"ngram": "\x1b[32m", "draft": "\x1b[36m"}  # green, cyan; the target's own tokens stay plain
RESET = "\x1b[0m"


def colour_allowed(stream) -> bool:
    """A terminal that is not dumb, and NO_COLOR unset or empty (no-color.org, and rich, read an empty one as unset)."""
    return stream.isatty() and not os.environ.get("NO_COLOR") and not dumb_terminal() and escapes_understood(stream)


def escapes_understood(stream) -> bool:
    """Whether the terminal `stream` writes to acts on escape sequences (colours, cursor moves). A Windows
    console does only once a program turns on its virtual-terminal mode (Windows Terminal has it on; the
    console of Windows 10's cmd.exe and PowerShell has not), and shows them as text till then: turned on
    here, and where that fails (before Windows 10) no escapes at all."""
    if sys.platform != "win32":
        return True
    import ctypes

    try:
        kernel32, handle = _windows_console(stream)
        mode = ctypes.c_uint32()
        if not kernel32.GetConsoleMode(ctypes.c_void_p(handle), ctypes.byref(mode)):
            return False  # not a console
        if mode.value & VIRTUAL_TERMINAL:
            return True
        return bool(kernel32.SetConsoleMode(ctypes.c_void_p(handle), ctypes.c_uint32(mode.value | VIRTUAL_TERMINAL)))
    except (AttributeError, ImportError, OSError, ValueError):  # no console handle (a stand-in stream)
        return False


VIRTUAL_TERMINAL = 0x0004  # ENABLE_VIRTUAL_TERMINAL_PROCESSING, a console output mode


def _windows_console(stream):
    """Windows' kernel32 and the console handle under `stream` (Windows only)."""
    import ctypes
    import msvcrt

    return ctypes.windll.kernel32, msvcrt.get_osfhandle(stream.fileno())


def dumb_terminal() -> bool:
    """TERM=dumb (Emacs' shell, some CI logs): no colours and no cursor movement, as rich decides."""
    return os.environ.get("TERM", "").lower() in ("dumb", "unknown")


def use_colour(choice: str, stream) -> bool:
    if choice == "always":
        return True
    if choice == "never":
        return False
    if choice == "auto":
        return colour_allowed(stream)
    from specllm.errors import UsageError

    raise UsageError(f"--color must be auto, always or never; got {choice!r}")


class TokenWriter:
    """Writes generated text to stdout as it comes, optionally coloured by where tokens came from."""

    def __init__(self, stream=None, colour: bool = False):
        self.stream = stream or sys.stdout
        self.colour = colour

    def write(self, text: str, source: str) -> None:
        if not text:
            return
        style = SOURCE_STYLES.get(source) if self.colour else None
        self.stream.write(f"{style}{text}{RESET}" if style else text)
        self.stream.flush()


class ReasoningWriter:
    """A thinking model's reasoning on stderr, dim on a terminal, while the answer goes to stdout.
    Under a status line redrawn on stderr's last row (stdout elsewhere) it is written in whole
    lines, each clearing the status first, which the next update draws again below it."""

    def __init__(self, live: "LiveStatus", stream=None):
        self.stream = stream or sys.stderr
        self.by_line = live.enabled and not live.shared_terminal
        self.dim = "\x1b[2m" if colour_allowed(self.stream) else ""
        self._line = ""
        self._ends_line = True

    def write(self, text: str) -> None:
        if self.by_line:
            *lines, self._line = (self._line + text).split("\n")
            for line in lines:
                self._put(f"\r\x1b[2K{line}\n")
        else:
            sys.stdout.flush()  # the same terminal: what came before stays before
            self._put(text)

    def end(self) -> None:
        """Reasoning is over: its last line ends, so the answer starts on a line of its own."""
        if self._line:
            self._put(f"\r\x1b[2K{self._line}\n")
            self._line = ""
        elif not self._ends_line:
            self._put("\n")

    def _put(self, text: str) -> None:
        self.stream.write(f"{self.dim}{text}{RESET}" if self.dim else text)
        self.stream.flush()
        self._ends_line = text.endswith("\n")


def write_reply(pieces, answer: TokenWriter, reasoning: ReasoningWriter, source: str) -> str:
    """(REASONING | CONTENT, text) pieces to their writers; returns the answer's text among them."""
    written = []
    for kind, text in pieces:
        if kind == REASONING:
            reasoning.write(text)
        else:
            reasoning.end()
            answer.write(text, source)
            written.append(text)
    return "".join(written)


class ReplyWriter:
    """A reply as it is committed: through the splitter, a thinking model's reasoning to `reasoning`
    and the answer to `writer`; `shown` False (run --json) splits the text and writes none of it."""

    def __init__(self, splitter: ThinkSplitter, writer: TokenWriter, reasoning: ReasoningWriter, shown: bool = True):
        self.splitter, self.writer, self.reasoning, self.shown = splitter, writer, reasoning, shown
        self.written: list[str] = []  # the answer as written: what a chat keeps, a hard stop's too

    def push(self, text: str, source: str) -> None:
        pieces = self.splitter.push(text)
        if self.shown:
            self.written.append(write_reply(pieces, self.writer, self.reasoning, source))

    def finish(self) -> None:
        """What the splitter held back at the end (a tag's start, blanks); the reasoning's last line ends."""
        pieces = self.splitter.finish()
        if self.shown:
            self.written.append(write_reply(pieces, self.writer, self.reasoning, "target"))
            self.reasoning.end()


def stream_reply(events, reply: ReplyWriter, live: "LiveStatus", stats: Stats, *also: Stats) -> Done | None:
    """A decoder's events to the reply's writers; `stats` (and each of `also`) reduces every event,
    and the live status line shows `stats` after each step. Returns the Done event that ends them."""
    done = None
    for event in events:
        stats.update(event)
        for more in also:
            more.update(event)
        if isinstance(event, TokenCommitted):
            reply.push(event.text, event.source)
        elif isinstance(event, StepDone):
            live.update(stats)
        elif isinstance(event, Done):
            done = event
    return done


def status_text(stats: Stats) -> str:
    """One line: speed, acceptance by source, mean accepted length."""
    parts = [f"{stats.tokens} tok", f"{stats.tok_per_s:.1f} tok/s"]
    for name in ("ngram", "draft"):
        source = stats.by_source.get(name)
        if source and source.drafted:
            parts.append(f"{name} {source.accepted}/{source.drafted} ({source.acceptance_rate:.0%})")
    if stats.drafted:
        parts.append(f"accept {stats.acceptance_rate:.0%}")
    parts.append(f"{stats.mean_accepted_length:.2f} tok/pass")
    return " · ".join(parts)


def summary_text(stats: Stats) -> str:
    prompt = f"prompt {stats.prompt_tokens} tok"
    if stats.reused_tokens:
        prompt += f" ({stats.reused_tokens} reused)"
    if stats.prefill_seconds > 0:
        prompt += f" in {stats.prefill_seconds:.2f}s"
    reason = f" · {stats.finish_reason}" if stats.finish_reason else ""
    return f"{prompt} · {status_text(stats)} · {stats.seconds:.2f}s{reason}"


class LiveStatus:
    """A status line on stderr, redrawn at most `hz` times a second; a no-op when disabled."""

    def __init__(self, enabled: bool, hz: float = 8.0):
        self.enabled = enabled and not dumb_terminal() and escapes_understood(sys.stderr)  # else the escapes would show
        self.shared_terminal = self.enabled and sys.stdout.isatty() and escapes_understood(sys.stdout)
        self.interval = 1.0 / hz
        self._last = 0.0
        self._rows = 0
        self.dim = "\x1b[2m" if colour_allowed(sys.stderr) else ""

    def __enter__(self) -> "LiveStatus":
        if self.shared_terminal:
            self._rows = shutil.get_terminal_size().lines
            # Make room at the bottom, then keep the text scrolling above the last row.
            sys.stdout.flush()
            sys.stderr.write(f"\n\x1b[1A\x1b7\x1b[1;{self._rows - 1}r\x1b8")
            sys.stderr.flush()
        return self

    def _follow_resize(self) -> None:
        """A resized terminal (SIGWINCH) resets or strands the scroll region, and the old last row is
        no longer the last: set the region again for the new height, room made at the bottom (IND,
        which keeps the column, then up) so that the status row never lands on the text."""
        rows = shutil.get_terminal_size().lines
        if rows != self._rows:
            self._rows = rows
            sys.stderr.write(f"\x1b7\x1b[r\x1b8\x1bD\x1b[1A\x1b7\x1b[1;{rows - 1}r\x1b8")

    def update(self, stats: Stats, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval):
            return
        self._last = now
        width = shutil.get_terminal_size().columns
        line = status_text(stats)[: width - 1]
        reset = RESET if self.dim else ""
        if self.shared_terminal:
            sys.stdout.flush()
            self._follow_resize()
            sys.stderr.write(f"\x1b7\x1b[{self._rows};1H\x1b[2K{self.dim}{line}{reset}\x1b8")
        else:
            sys.stderr.write(f"\r\x1b[2K{self.dim}{line}{reset}")
        sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.shared_terminal:
            sys.stdout.flush()
            self._follow_resize()  # else the clearing of a row that is no longer the last erases a line of text
            sys.stderr.write(f"\x1b7\x1b[r\x1b[{self._rows};1H\x1b[2K\x1b8")
        else:
            sys.stderr.write("\r\x1b[2K")
        sys.stderr.flush()
