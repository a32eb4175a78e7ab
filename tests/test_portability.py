"""Windows and macOS, simulated on Linux: a redirected stream in Windows' ANSI code page, Windows'
line ends and byte-order marks in piped text, a Windows console without escape sequences.

Windows reads and writes a standard stream that is a file or a pipe in its ANSI code page (cp1252 in
western Europe, strict), stderr with backslashreplace; `main` runs here on such streams.
"""

from __future__ import annotations

import ctypes
import io
import json
import signal
import sys
from pathlib import Path

import pytest

from specllm.cli import common as c
from specllm.cli import display, main
from specllm.cli.display import LiveStatus, colour_allowed
from tests.fakes import FakeEngine, Scripted

REPLY = ["おはよう", " café", " 🙂"]  # outside cp1252, in it, outside the Basic Multilingual Plane


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose replies are `script`, keeping the prompts `run` encoded and the messages `chat` sent."""

    def __init__(self, script):
        super().__init__()
        self.script, self.prompts, self.messages = script, [], []
        self.target.path = Path("fake.gguf")
        tokenize = self.target.tokenize

        def recording(text, *, add_special=False, parse_special=False):
            if not parse_special and text not in self.messages:  # a message's text, not the template's markup
                self.messages.append(text)
            return tokenize(text, add_special=add_special, parse_special=parse_special)

        self.target.tokenize = recording

    def encode(self, text, system=None, raw=False, think=True):
        self.prompts.append(text)
        return self.target.tokenize(text)

    def decoder(self, strategy=None):
        return Scripted(self.script)


class Terminal(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


def windows_streams(stdin: bytes = b"", encoding: str = "cp1252"):
    """stdin, stdout and stderr as Windows opens them on a pipe or a file."""
    return (
        io.TextIOWrapper(io.BytesIO(stdin), encoding=encoding),
        io.TextIOWrapper(io.BytesIO(), encoding=encoding, write_through=True),
        io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="backslashreplace", write_through=True),
    )


def specllm_on(streams, monkeypatch, engine, *argv) -> tuple[int, bytes, str]:
    """`specllm ARGV` through main on these streams and this engine: (exit code, stdout's bytes, stderr)."""
    monkeypatch.setattr(c, "open_engine", lambda *args, **kwargs: engine)
    monkeypatch.setenv("NO_COLOR", "1")
    stdin, stdout, stderr = streams
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, stdout.buffer.getvalue(), stderr.buffer.getvalue().decode("utf-8", "replace")


# -- text in Windows' ANSI code page --------------------------------------------------------


@pytest.mark.parametrize("as_json", [False, True])
def test_run_into_a_file_on_windows_writes_every_character_of_the_reply(monkeypatch, as_json):
    """`specllm run -p ... > out.txt` on Windows: a reply holding 'お' ended with an error and no text."""
    engine = ScriptedEngine(REPLY)
    code, out, err = specllm_on(windows_streams(), monkeypatch, engine, "run", "-p", "greet", *(["--json"] if as_json else []))
    assert code == 0, err
    text = out.decode("utf-8")
    assert (json.loads(text)["text"] if as_json else text) == "".join(REPLY) + ("" if as_json else "\n")


def test_chat_on_windows_reads_a_piped_utf8_script_and_writes_its_replies(monkeypatch):
    """A UTF-8 script piped to `chat` on Windows was read in cp1252: 'café' reached the model as
    'cafÃ©', and 'お' (a byte cp1252 lacks) ended the chat with "not valid UTF-8"."""
    engine = ScriptedEngine(["お茶です"])
    script = "Un café, s'il vous plaît\nお茶をください\n".encode()
    code, out, err = specllm_on(windows_streams(script), monkeypatch, engine, "chat", "-n", "4")
    assert code == 0, err
    assert [m for m in engine.messages if m != "お茶です"] == ["Un café, s'il vous plaît", "お茶をください"]
    assert out.decode("utf-8") == "お茶です\nお茶です\n"


def test_a_terminal_that_cannot_show_a_character_shows_a_stand_in_and_the_run_goes_on(monkeypatch):
    """A terminal in a legacy code page (a Linux console in Latin-1): shown replaced, never an error."""
    stdin, _, stderr = windows_streams()
    terminal = Terminal(io.BytesIO(), encoding="latin-1", write_through=True)
    code, out, err = specllm_on((stdin, terminal, stderr), monkeypatch, ScriptedEngine(REPLY), "run", "-p", "greet")
    assert code == 0, err
    assert out.decode("latin-1") == "???? café ?\n"


def test_streams_already_in_utf8_are_left_as_they_are(monkeypatch):
    streams = windows_streams(encoding="utf-8")
    for name, stream in zip(("stdin", "stdout", "stderr"), streams):
        monkeypatch.setattr(sys, name, stream)
    c.utf8_streams()
    assert [(s.encoding, s.errors) for s in streams] == [("utf-8", "strict"), ("utf-8", "strict"), ("utf-8", "backslashreplace")]


# -- line ends and byte-order marks -----------------------------------------------------------


def test_a_file_with_windows_line_ends_and_a_bom_piped_to_run_is_the_same_prompt_as_a_unix_one(monkeypatch):
    """`type code.py | specllm run -p ...`: the prompt held the BOM and every '\\r', and a stray '\\r'
    before the instruction, so the same file was another prompt on Windows."""
    prompts = []
    for data in (b"def f(x):\n    return x\n", b"\xef\xbb\xbfdef f(x):\r\n    return x\r\n"):
        engine = ScriptedEngine(["ok"])
        code, _, err = specllm_on(windows_streams(data, "utf-8"), monkeypatch, engine, "run", "-p", "add type hints")
        assert code == 0, err
        prompts += engine.prompts
    assert prompts == ["def f(x):\n    return x\n\nadd type hints"] * 2


def test_invalid_utf8_after_a_bom_names_the_byte_of_the_input(monkeypatch):
    code, out, err = specllm_on(windows_streams(b"\xef\xbb\xbfab\xff", "utf-8"), monkeypatch, ScriptedEngine([]), "run", "-p", "x")
    assert (code, out) == (1, b"")
    assert err.strip() == "Error: standard input is not valid UTF-8 (byte 5)"


# -- Windows' console and escape sequences ------------------------------------------------


class FakeKernel32:
    """GetConsoleMode and SetConsoleMode of one console; `settable` False: a console without
    virtual-terminal processing (before Windows 10), which refuses the mode."""

    def __init__(self, mode: int, settable: bool):
        self.mode, self.settable = mode, settable

    def GetConsoleMode(self, handle, mode_ref) -> int:  # noqa: N802 - the Windows API's name
        ctypes.cast(mode_ref, ctypes.POINTER(ctypes.c_uint32)).contents.value = self.mode
        return 1

    def SetConsoleMode(self, handle, mode) -> int:  # noqa: N802
        if not self.settable:
            return 0
        self.mode = getattr(mode, "value", mode)
        return 1


def windows_console(monkeypatch, mode: int, settable: bool) -> FakeKernel32:
    kernel32 = FakeKernel32(mode, settable)
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(display, "_windows_console", lambda stream: (kernel32, 7), raising=False)
    for variable in ("NO_COLOR", "TERM"):
        monkeypatch.delenv(variable, raising=False)
    terminal = Terminal(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    return kernel32


def test_windows_10_console_gets_its_escape_sequences_turned_on_before_colours(monkeypatch):
    """cmd.exe and PowerShell's console on Windows 10 show `←[32m` unless the program turns on
    virtual-terminal processing: it is turned on, then colours and the live line are used."""
    kernel32 = windows_console(monkeypatch, mode=0x3, settable=True)
    assert colour_allowed(sys.stdout) and LiveStatus(True).enabled
    assert kernel32.mode == 0x3 | 0x4  # ENABLE_VIRTUAL_TERMINAL_PROCESSING


def test_a_console_without_escape_sequences_gets_no_colours_and_no_live_line(monkeypatch):
    windows_console(monkeypatch, mode=0x3, settable=False)
    assert not colour_allowed(sys.stdout)
    assert not LiveStatus(True).enabled


def test_windows_terminal_which_has_them_on_is_left_as_it_is(monkeypatch):
    kernel32 = windows_console(monkeypatch, mode=0x7, settable=False)
    assert colour_allowed(sys.stdout) and LiveStatus(True).enabled and kernel32.mode == 0x7


def test_real_run_in_windows_code_page_writes_the_same_bytes_as_in_utf8(home, smollm2_path):
    """The real process: stdout in cp1252 (PYTHONIOENCODING stands in for Windows' redirected
    stdout) gets plain decoding's reply byte for byte, characters outside cp1252 included."""
    from tests.cli_helpers import specllm

    args = ("run", "-m", smollm2_path, "--spec", "ngram", "--temp", "0", "-n", "16", "-p", "Translate to Japanese: good morning")
    utf8 = specllm(home | {"PYTHONIOENCODING": "utf-8"}, *args)
    windows = specllm(home | {"PYTHONIOENCODING": "cp1252"}, *args)
    assert utf8.returncode == 0 and windows.returncode == 0, windows.stderr
    assert any(not ch.encode("cp1252", "ignore") for ch in utf8.stdout.strip())  # the test means something
    assert windows.stdout == utf8.stdout


def test_chat_names_the_keys_that_end_input_on_windows(monkeypatch):
    """Ctrl-D types ^D in a Windows console, which chat would send as a message: there the hints
    and /help name Ctrl-Z then Enter."""
    from specllm.chat import help_text
    from specllm.cli.chat_loop import leave_hint

    assert "Ctrl-D" in leave_hint() and "Ctrl-D" in help_text()
    monkeypatch.setattr(sys, "platform", "win32")
    assert "Ctrl-Z then Enter" in leave_hint() and "Ctrl-Z then Enter" in help_text()
    assert "Ctrl-D" not in leave_hint() + help_text()
