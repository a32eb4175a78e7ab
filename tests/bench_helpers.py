"""Stand-ins for `specllm bench` tests (test_bench.py, test_bench_honesty.py, test_faults.py):
`FakeEngine`, the engine the harness drives, on tests/fakes.FakeBackend with an n-gram drafter
(not tests/fakes.FakeEngine, which stands in for a chat's engine), and `fake_matplotlib`, just
enough of matplotlib for `bench --plot`.
"""

from __future__ import annotations

import os
import sys
import types

from specllm.engine.decode import Decoder, fixed_budget
from specllm.engine.drafters import NgramDrafter
from tests.fakes import FakeBackend


class FakeEngine:
    def __init__(self):
        self.target = FakeBackend(seed=0)
        self.created: list[str] = []

    def encode(self, text: str) -> list[int]:
        return self.target.tokenize(text)

    def decoder(self, strategy):
        self.created.append(strategy)
        self.target.rewind(0)
        drafter = None if strategy == "off" else NgramDrafter(1, 3)
        return Decoder(self.target, drafter, fixed_budget(4))


def fake_matplotlib(monkeypatch) -> None:
    """Just enough matplotlib for `bench --plot`: savefig writes bytes to the path, as the real one does."""
    axes = types.SimpleNamespace(bar=lambda *a, **k: None, axhline=lambda *a, **k: None, set_xticks=lambda *a, **k: None,
                                 set_ylabel=lambda *a, **k: None, legend=lambda *a, **k: None)  # fmt: skip

    filetypes = {"png": "Portable Network Graphics", "svg": "Scalable Vector Graphics"}

    def savefig(path, format=None):  # as matplotlib's: without a format, the suffix's, or PNG at PATH.png
        path = str(path)
        if format is None:
            format = os.path.splitext(path)[1][1:] or "png"
            path += "" if os.path.splitext(path)[1] else ".png"
        if format not in filetypes:
            raise ValueError(f"Format {format!r} is not supported (supported formats: {', '.join(filetypes)})")
        with open(path, "wb") as out:
            out.write(b"\x89PNG" + bytes(100_000))

    figure = types.SimpleNamespace(tight_layout=lambda: None, savefig=savefig)
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda **kwargs: (figure, axes)
    backend_bases = types.ModuleType("matplotlib.backend_bases")
    backend_bases.FigureCanvasBase = types.SimpleNamespace(get_supported_filetypes=lambda: filetypes)
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use, matplotlib.pyplot, matplotlib.backend_bases = (lambda backend: None), pyplot, backend_bases
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", backend_bases)
