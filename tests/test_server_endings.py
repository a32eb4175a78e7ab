"""Stop strings (`server.endings.StopText`): what is cut, against the first implementation kept
here as the reference, and how much work a long stop string costs."""

from __future__ import annotations

import numpy as np

from specllm.server.endings import IndentCut, StopText, find_filtered_end


class ReferenceStopText:
    """StopText as it was first written: each piece looks for every stop string in the held tail and
    the piece, and holds back the longest tail that begins one (its work grows with the square of a
    stop string's length at every piece)."""

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


def random_text(rng: np.random.Generator, alphabet: str, size: int) -> str:
    return "".join(rng.choice(list(alphabet), size=size))


def random_pieces(rng: np.random.Generator, text: str) -> list[str]:
    """The text in pieces of 0 to 6 characters, as tokens come (an empty one now and then)."""
    pieces, i = [], 0
    while i < len(text):
        n = int(rng.integers(0, 7))
        pieces.append(text[i : i + n])
        i += n
    return pieces


def random_stops(rng: np.random.Generator, alphabet: str) -> list[str]:
    sizes = [int(rng.integers(0, 9)) if rng.random() < 0.8 else int(rng.integers(9, 40)) for _ in range(int(rng.integers(0, 5)))]
    return [random_text(rng, alphabet, n) for n in sizes]


def test_stop_strings_cut_what_the_reference_cuts_piece_by_piece():
    """Random stop strings over small alphabets (so they overlap, repeat themselves and begin one
    another), random texts in random pieces: every piece's output, the held tail, the stop and the
    flush are the reference's; and where a draft's pieces would end the text, from any point, too."""
    rng = np.random.default_rng(20261207)
    for trial in range(3000):
        alphabet = ["ab", "abc", "a\n ", "ab\n"][trial % 4]
        stops = random_stops(rng, alphabet)
        text = random_text(rng, alphabet, int(rng.integers(0, 80)))
        if stops and rng.random() < 0.3:  # a stop string that does come, after a near miss
            stop = stops[int(rng.integers(len(stops)))]
            text += stop[: len(stop) // 2] + stop + text
        new, old = StopText(stops), ReferenceStopText(stops)
        for piece in random_pieces(rng, text):
            if rng.random() < 0.2:
                draft = random_pieces(rng, random_text(rng, alphabet, int(rng.integers(0, 20))))
                n_indent = int(rng.integers(0, 3))
                expected = find_filtered_end(old, IndentCut(n_indent), draft)
                before = dict(vars(new))
                assert find_filtered_end(new, IndentCut(n_indent), draft) == expected, (stops, text, draft)
                assert vars(new) == before  # tried on a copy: left as it was
            assert new.push(piece) == old.push(piece), (stops, text)
            assert (new.held, new.stopped) == (old.held, old.stopped), (stops, text)
        assert new.flush() == old.flush()
        assert new.push("ab") == old.push("ab")  # after a flush, as after a fresh start


class CountingStr(str):
    """A stop string that counts the characters read out of it (an index: 1, a slice: its length)."""

    reads = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        CountingStr.reads += len(part)
        return part


def test_a_long_stop_string_costs_work_in_step_with_the_text_not_its_square():
    """An answer that copies most of a 10,000-character stop string (a client's stop set to the code
    after the cursor, which the model writes out again), then leaves it: the text is held back all
    the way, then sent whole; the characters read out of the stop strings stay within a few per
    character of text and of stop string, where reading every prefix at every piece cost ~L^2/2 a
    piece. One stop string begins itself at every position (the longest fall back)."""
    rng = np.random.default_rng(7)
    size = 10_000
    for text in (random_text(rng, "ab \n", size), "a" * size):
        stop = CountingStr(text)
        stops = StopText([stop, CountingStr("x" * 50)])
        budget = 20 * (size + 50)
        CountingStr.reads = 0
        for i in range(0, size - 8, 4):
            assert stops.push(text[i : i + 4]) == ""  # held back: it may be the stop string
            assert CountingStr.reads < budget, f"{CountingStr.reads} characters read after {i + 4} of text"
        assert stops.held == text[: size - 8]
        assert stops.push("c") == text[: size - 8] + "c" and stops.held == "" and not stops.stopped
        assert CountingStr.reads < budget
        assert stops.push(text) == "" and stops.stopped  # and it still ends where the stop string is
