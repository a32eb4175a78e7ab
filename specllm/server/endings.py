"""Where a generated text ends before the model stops: at a stop string (`StopText`), before a
line indented too little (`IndentCut`, llama.cpp's `n_indent`), and where a draft would meet
either (`find_filtered_end`). Text pieces in, text out; pure, no I/O.
"""

from __future__ import annotations

import copy


class StopText:
    """Text pieces in, text out, ending at the first stop string. A tail that could begin a
    stop string is held back until the next piece shows whether it does."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else piece
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max((k for s in self.stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


class IndentCut:
    """Text pieces in, text out, ending before the first line (after the first) indented less than
    `n_indent` spaces or tabs, as llama.cpp's server does for editors (the rest of a block, and no
    more); the short line's indentation is kept, as there. Unlike llama.cpp's, a blank line (a
    carriage return's too) does not end it: it says nothing of where the block ends. A new line's
    indentation is held back until its first character shows whether the line ends the text."""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self.held = ""  # the indentation of a line begun, its code not seen yet
        self.at_line_start = False  # the first line (the one being typed) is never checked
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped or self.n_indent <= 0:
            return "" if self.stopped else piece
        out = []
        for char in piece:
            if char == "\n":
                out.append(self.held + char)
                self.held, self.at_line_start = "", True
            elif self.at_line_start and char in " \t\r":
                self.held += char
            elif self.at_line_start and len(self.held.replace("\r", "")) < self.n_indent:
                self.stopped = True
                out.append(self.held)
                break
            else:
                out.append(self.held + char)
                self.held, self.at_line_start = "", False
        return "".join(out)

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


def find_filtered_end(stop_text: StopText, indent_cut: IndentCut, pieces: list[str]) -> int | None:
    """The index of the first piece at which the two filters, as the committed text left them, would
    end the text (a stop string completed, a line indented too little begun), or None. They are
    tried on shallow copies: their state is strings and flags (a stop list they never change)."""
    stops, cut = copy.copy(stop_text), copy.copy(indent_cut)
    for i, piece in enumerate(pieces):
        cut.push(stops.push(piece))
        if stops.stopped or cut.stopped:
            return i
    return None
