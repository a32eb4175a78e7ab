"""Shared fixtures: a temporary home for every test, tiny generated GGUFs, and real models.

Isolation. `isolated_home` (autouse) points everything specllm writes at a fresh temporary folder
for each test: the cache (`SPECLLM_CACHE`: costs.json, downloads), the config (`XDG_CONFIG_HOME`),
`XDG_CACHE_HOME` (pip, matplotlib, ...) and Hugging Face (`HF_HOME`, offline). The user's verified
models are the one thing shared: the test's cache holds links to them (plus copies of their
`.verified` sidecars, so nothing is hashed again), and a link is replaced, never written through.
After the session, `pytest_sessionfinish` fails the run if the user's cache or config folders gained
or changed a file other than a verified model download (tests/user_files.py records them at startup).
`process_signals` (autouse) puts back the SIGINT and SIGTERM handlers and `sys.unraisablehook` that
`specllm.cli.main` installs in-process, and forgets any signal it noted and left unhandled.

Calibration results (costs.json) are measured once per session per model set and configuration: a
test starts with a copy of what earlier tests of this session measured, in its own folder, and what
it measures is added to that session copy (a temporary file too), never to the user's cache.

Tiers. Real models come from `specllm.models.store.resolve_model` (the user's verified cache,
downloading on first use). A failed fetch is an error in the test, never a skip: a real-model test
that silently skips is a gap, not a pass. Every test that uses a real-model fixture is marked `real`
here, so `-m "not real"` never downloads; tiny models carry a generated tokenizer. Tests marked
`slow` (long generations, large statistical samples, on tiny models) are left out of the fast tier,
`-m "not real and not slow"`, and run in the full suite.
The default pair is loaded once per session (`qwen_engine`), shared by the tests that only read it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings
from hypothesis.configuration import set_hypothesis_home_dir

from specllm.backend import LoadOptions
from specllm.cli import interrupt
from specllm.engine import auto, decode, drafters
from specllm.engine.costmodel import CostModel
from specllm.models.store import resolve_model
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.cli_helpers import ROOT
from tests.fakes import VirtualClock
from tests.tiny_gguf import TINY_VOCAB, write_tiny_gguf
from tests.user_files import USER_CACHE, USER_ENV, builtin_registry, user_files, user_files_changed

# Helpers that assert as the test modules they came from did: pytest explains their failures too.
pytest.register_assert_rewrite("tests.lossless_helpers", "tests.server_helpers")

DRAFT_NOISE = 0.1  # the tiny draft's weights: the target's plus this much noise (partial agreement)
REAL_MODEL_FIXTURES = {"smollm2_path", "qwen_pair", "qwen_engine"}
COMPACT_VOCAB = 4096  # the generated tokenizer's control tokens, bytes and merges (under 900), then fillers
# What rich (and specllm) read to colour a stream, or to size one: set in a developer's shell or a CI
# runner (FORCE_COLOR=1 put progress bars in `pull`'s captured stderr; TERM=dumb, as some CI logs
# have, took the colours a pretend terminal expects), they made tests pass or fail by where they ran.
# Every test starts from an ordinary terminal's TERM and none of the others; tests that want them set them.
TERMINAL_OVERRIDES = ("FORCE_COLOR", "NO_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")

# Hypothesis draws the same examples every run, as every other random test here has a fixed seed: a
# red CI is then a bug to read, not a draw to retry. `--hypothesis-profile explore` draws new ones.
# No example database: tests write only to temporary folders (it was .hypothesis/ in the checkout).
hypothesis_settings.register_profile("specllm", database=None, derandomize=True)
hypothesis_settings.register_profile("explore", database=None)
hypothesis_settings.load_profile("specllm")


def pytest_configure(config):
    config.addinivalue_line("markers", "real: uses real GGUF models fetched into the cache (slow)")
    config.addinivalue_line("markers", "slow: long generations and large statistical samples on tiny models")
    config._specllm_user_files = user_files()
    config._specllm_hypothesis_home = tempfile.mkdtemp(prefix="specllm-hypothesis-")
    set_hypothesis_home_dir(config._specllm_hypothesis_home)  # its constants cache, out of the checkout


def pytest_unconfigure(config):
    home = getattr(config, "_specllm_hypothesis_home", None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


# -- isolation -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def session_costs(tmp_path_factory) -> Path:
    """This session's calibrations (costs.json entries), shared between tests through copies."""
    return tmp_path_factory.mktemp("session-costs") / "costs.json"


@pytest.fixture(autouse=True)
def process_signals():
    """The process as the test found it: `specllm.cli.main` installs its SIGINT and SIGTERM handlers
    and an unraisable hook and leaves them (a command's process ends with it), and a signal it noted
    and did not honour would stop the next test's generation at its start."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if _main_thread() else {}
    hook = sys.unraisablehook
    yield
    interrupt.handled()
    sys.unraisablehook = hook
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch, session_costs) -> Path:
    """A temporary home for this test; the user's verified models linked into its cache."""
    home = tmp_path_factory.mktemp("home")
    cache = home / "cache"
    _link_verified_models(USER_CACHE / "models", cache / "models")
    if session_costs.is_file():
        shutil.copyfile(session_costs, cache / "costs.json")
    for name in ("SPECLLM_CONFIG", "SPECLLM_DEBUG", "TRANSFORMERS_OFFLINE", *TERMINAL_OVERRIDES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("SPECLLM_CACHE", str(cache))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg-cache"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Ctrl-C as at a terminal: a shell that starts pytest in the background hands it SIGINT ignored,
    # and Python then never installs the handler that turns it into KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if _main_thread() else None
    yield home
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
    _keep_new_costs(cache / "costs.json", session_costs)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@pytest.fixture
def home(tmp_path, session_costs) -> dict:
    """The environment of a `specllm` process: an empty model cache (with this session's
    calibrations), its own config, offline Hugging Face, no colours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECLLM_", "HF_"))}
    cache = tmp_path / "cache"
    cache.mkdir()
    if session_costs.is_file():
        shutil.copyfile(session_costs, cache / "costs.json")
    env |= {
        "SPECLLM_CACHE": str(cache),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "NO_COLOR": "1",
        "PYTHONPATH": str(ROOT),
    }
    yield env
    _keep_new_costs(cache / "costs.json", session_costs)


def _link_verified_models(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    if not source.is_dir():
        return
    for sidecar in source.glob("*.verified"):
        model = sidecar.with_name(sidecar.name[: -len(".verified")])
        if model.is_file():
            (dest / model.name).symlink_to(model)
            shutil.copyfile(sidecar, dest / sidecar.name)  # its stamp holds the linked file's size and mtime


def _keep_new_costs(cache: Path, session: Path) -> None:
    """Add the calibrations this test measured to the session's copy (never overwriting one)."""
    try:
        measured = json.loads(cache.read_text("utf-8"))
        known = json.loads(session.read_text("utf-8")) if session.is_file() else {}
    except (OSError, ValueError):
        return  # no costs measured, or a test that damages the file on purpose
    if not isinstance(measured, dict) or not isinstance(known, dict):
        return
    new = {  # calibrations only: what a test's passes taught one (`learned`) stays with that test
        key: {field: v for field, v in value.items() if field != "learned"}
        for key, value in measured.items()
        if key not in known and isinstance(value, dict)
    }
    if new:
        session.write_text(json.dumps(known | new), "utf-8")


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_specllm_user_files", None)
    if before is None:
        return
    changed = user_files_changed(before)
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test run wrote into the user's cache or config folders: " + ", ".join(changed)
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def virtual_clock(monkeypatch) -> VirtualClock:
    """The engine's modules read this clock instead of `time` for the test (they use perf_counter only)."""
    clock = VirtualClock()
    for module in (decode, auto, drafters):
        monkeypatch.setattr(module, "time", clock)
    return clock


# -- models ----------------------------------------------------------------------------------


def _fetch(name: str) -> Path:
    """A real model through the project's own code, into the user's cache (their settings, not the test's)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in set(os.environ) - set(USER_ENV):
            patch.delenv(key)
        for key, value in USER_ENV.items():
            patch.setenv(key, value)
        patch.delenv("SPECLLM_CONFIG", raising=False)
        patch.setenv("SPECLLM_CACHE", str(USER_CACHE))
        return resolve_model(name, builtin_registry())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _fetch("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): the default preset's Qwen2.5-Coder 1.5B and 0.5B."""
    return _fetch("qwen2.5-coder-1.5b"), _fetch("qwen2.5-coder-0.5b")


# What one pass of the default pair's target costs by batch size on a 2-core CPU (specllm's own
# calibration, AVX-512, 2 threads; tests/data holds the whole curve), for `--spec auto` in tests:
# which drafts auto tries depends on the curve, whether its output is plain decoding's must not, and
# measuring the curve takes 50 s on 2 cores (timings belong in the benchmark, not in tests).
DEFAULT_PAIR_COSTS = CostModel({1: 0.0311, 2: 0.0569, 4: 0.0919, 8: 0.1745, 16: 0.1782, 32: 0.3286},
                               draft_seconds=0.0184, depth=256, context_seconds=4.95e-06, draft_token_seconds=0.0060)  # fmt: skip


@pytest.fixture(scope="session")
def qwen_engine(qwen_pair):
    """The default pair loaded once for the session (1024 tokens of context, 2 threads), for tests
    that take fresh decoders from it; `auto` runs on DEFAULT_PAIR_COSTS instead of calibrating."""
    options = LoadOptions(n_ctx=1024, n_threads=2)
    engine = Engine(ModelPaths(*qwen_pair), SpecConfig(strategy="ngram+draft"), options, options, cost_cache=None)
    engine.costs = lambda max_batch=None: DEFAULT_PAIR_COSTS.copy()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_pair(tiny_dir) -> tuple[Path, Path]:
    """(target, draft): tiny random models sharing the generated tokenizer; the draft mostly agrees."""
    target = write_tiny_gguf(tiny_dir / "tiny-target.gguf", 0)
    draft = write_tiny_gguf(tiny_dir / "tiny-draft.gguf", 1, base_seed=0, noise=DRAFT_NOISE)
    return target, draft


@pytest.fixture(scope="session")
def compact_pair(tiny_dir) -> tuple[Path, Path]:
    """tiny_pair's kind with COMPACT_VOCAB tokens (every text tokenizes as with tiny_pair): for long
    generations and statistical tests, where the output layer (vocabulary x 64 floats read at every
    step) is most of a tiny model's time and 49152 tokens make each step four times slower."""
    cut = {"drop_last_tokens": TINY_VOCAB - COMPACT_VOCAB}
    # Seed 2: after `S y S` (test_lossless_real.py's prompt) the n-gram proposal y keeps a middling
    # probability, so verification both accepts and rejects it (with seed 0, top-k 3 excludes it).
    target = write_tiny_gguf(tiny_dir / "compact-target.gguf", 2, **cut)
    draft = write_tiny_gguf(tiny_dir / "compact-draft.gguf", 1, base_seed=2, noise=DRAFT_NOISE, **cut)
    return target, draft
