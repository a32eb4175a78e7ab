"""Where a generated text ends before the model stops: at a stop string (`StopText`), before a
line indented too little (`IndentCut`, llama.cpp's `n_indent`), and where a draft would meet
either (`find_filtered_end`). Text pieces in, text out; pure, no I/O.
"""

from __future__ import annotations

import copy


class StopText:
    """Text pieces in, text out, ending at the first stop string. A tail that could begin a
    stop string is held back until the next piece shows whether it does.

    Each stop string is followed as Knuth-Morris-Pratt follows a pattern: how much of it the text's
    tail begins (`_matched`), moved on by each new character, so a piece costs its own length
    whatever the stop strings' (a long one used to cost its length squared at every piece)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._borders = [_borders(s) for s in self.stops]  # never changed: copies share them
        self._matched = (0,) * len(self.stops)  # a tuple, replaced: copies (find_filtered_end) keep their own
        self.held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else piece
        text = self.held + piece
        matched, cut = [], len(text)
        for stop, borders, k in zip(self.stops, self._borders, self._matched):
            k, end = _follow(stop, borders, k, piece)
            if end is not None:  # its first occurrence ends in this piece: one never fitted in the text before
                cut = min(cut, len(self.held) + end - len(stop))
            matched.append(k)
        if cut < len(text):
            self.stopped, self.held = True, ""
            return text[:cut]
        self._matched = tuple(matched)
        keep = max(matched)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self.held, self._matched = self.held, "", (0,) * len(self.stops)
        return "" if self.stopped else held


def _borders(stop: str) -> list[int]:
    """For each prefix of `stop`, the length of its longest proper prefix that is also its suffix."""
    borders, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = borders[k - 1]
        if stop[i] == stop[k]:
            k += 1
        borders[i] = k
    return borders


def _follow(stop: str, borders: list[int], k: int, piece: str) -> tuple[int, int | None]:
    """How much of `stop` the text's tail begins after `piece`, having begun `k` before it; and where
    in the piece the stop string first ends, if it does (None)."""
    for i, char in enumerate(piece):
        while k and stop[k] != char:
            k = borders[k - 1]
        if stop[k] == char:
            k += 1
            if k == len(stop):
                return k, i + 1
    return k, None


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
