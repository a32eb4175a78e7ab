"""Signals and failures in the middle of a command: nothing is lost, nothing is swallowed.

A Ctrl-C is raised where Python next runs bytecode; where that is a finalizer (an unfinished
generator collected, a jinja template's among them), Python prints the KeyboardInterrupt as
"Exception ignored in ..." and drops it, and the command went on to exit 0. These tests drop one
there on purpose (`drop_a_ctrl_c`: the signal delivered to the main thread inside a generator's
`finally` while it is closed), at the points where it was seen or could be, and check that the
command still ends as Ctrl-C ends it. Then a draft model that `--spec auto` loads only at its
first use and that fails to load there (removed or replaced since the start).
"""

from __future__ import annotations

import io
import json
import shutil
import signal
import threading

import numpy as np
import pytest

from specllm.backend import DeferredBackend, LoadOptions
from specllm.chat import ChatSettings, Conversation
from specllm.cli import bench_cmd, chat_loop, interrupt, run_cmd
from specllm.cli.chat_loop import ChatLoop
from specllm.engine.auto import AutoDrafter
from specllm.engine.decode import Decoder, generate_plain
from specllm.engine.drafters import ModelDrafter, NgramDrafter
from specllm.engine.policy import RETIRED, CostAwarePolicy
from specllm.engine.sampling import SamplingParams
from specllm.errors import SpecllmError
from specllm.session import Engine
from tests.cli_helpers import specllm_here
from tests.fakes import BIG_GPU, FakeBackend, FakeEngine, reader


def drop_a_ctrl_c(sig: int = signal.SIGINT) -> None:
    """A real SIGINT (or `sig`), raised inside a generator's finalizer: Python reports it as unraisable and drops it."""

    def unfinished():
        try:
            yield
        finally:  # runs when the generator is collected; the handler runs inside pthread_kill, here
            signal.pthread_kill(threading.main_thread().ident, sig)

    generator = unfinished()
    next(generator)
    del generator


@pytest.fixture
def installed(isolated_home):  # after it: it sets the SIGINT handler a terminal gives
    """specllm's own handlers, as `main` installs them, for a test that drives a chat loop directly
    (conftest's `process_signals` restores the process afterwards)."""
    interrupt.install()


def dropping_first(function):
    def wrapped(*args, **kwargs):
        drop_a_ctrl_c()
        return function(*args, **kwargs)

    return wrapped


RUN = ["run", "--spec", "off", "-n", "8", "--temp", "0", "-p", "Hello"]


def test_a_ctrl_c_dropped_before_the_generation_starts_stops_it(home, tiny_pair, monkeypatch):
    """Between the load and the generation (the chat template rendered, the reasoning splitter built)."""
    monkeypatch.setattr(run_cmd, "reasoning_splitter", dropping_first(run_cmd.reasoning_splitter))
    done = specllm_here(home, *RUN, "-m", tiny_pair[0])
    assert (done.returncode, done.stdout, done.stderr.strip()) == (130, "", "Interrupted.")


def test_a_ctrl_c_dropped_after_the_text_is_out_still_ends_with_130(home, tiny_pair, monkeypatch):
    """After the generation's own handler is gone (keeping what auto learned): the text stays, exit 130."""
    full = specllm_here(home, *RUN, "-m", tiny_pair[0])
    monkeypatch.setattr(Engine, "keep_learned", dropping_first(Engine.keep_learned))
    done = specllm_here(home, *RUN, "-m", tiny_pair[0])
    assert full.returncode == 0 and full.stdout.strip()
    assert (done.returncode, done.stdout, done.stderr.strip()) == (130, full.stdout, "Interrupted.")


def test_a_ctrl_c_dropped_while_a_chat_script_renders_a_message_ends_the_chat(home, tiny_pair, monkeypatch):
    """The template renders the message before the reply's own handler is set: that reply stops at
    once, and no later message is answered (exit 130, as a Ctrl-C during the reply)."""
    monkeypatch.setattr(chat_loop, "encode_messages", dropping_first(chat_loop.encode_messages))
    done = specllm_here(home, "chat", "--spec", "off", "-n", "8", "--temp", "0", "-m", tiny_pair[0], stdin=b"Hello\nAgain\n")
    assert done.returncode == 130 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == "Interrupted." and "Exception ignored" not in done.stderr


def test_a_ctrl_c_dropped_between_turns_at_a_terminal_is_one_at_the_prompt(installed, capsys):
    """At a terminal a Ctrl-C between turns only says how to leave, as one at the prompt does; the next
    message is answered in full, and a Ctrl-C handled so leaves nothing for the command's end."""
    loop = ChatLoop(FakeEngine(), Conversation(), ChatSettings(SamplingParams(temperature=0.0), 12), "ngram", out=io.StringIO(), interactive=True)
    real_stats = loop.stats_text
    loop.stats_text = dropping_first(real_stats)
    loop.run(reader(["/stats", "write code"]))
    assert loop.replies == 1 and loop.conversation.messages[-1]["content"] and interrupt.pending() is None
    assert "Use Ctrl-D or /bye to leave." in capsys.readouterr().err


def test_a_ctrl_c_pressed_at_a_terminal_prompt_is_handled_there(installed, capsys):
    """A KeyboardInterrupt the chat handles (Ctrl-C at the prompt) is no signal left for the command's end."""

    def press_ctrl_c(prompt):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    lines = iter([press_ctrl_c, lambda prompt: "/bye"])
    loop = ChatLoop(FakeEngine(), Conversation(), ChatSettings(SamplingParams(temperature=0.0), 12), "ngram", out=io.StringIO(), interactive=True)
    loop.run(lambda prompt: next(lines)(prompt))
    assert interrupt.pending() is None


BENCH = ["bench", "-t", "1", "-c", "1024", "-n", "8", "--limit", "1", "--strategies", "off,ngram"]


def test_a_ctrl_c_dropped_during_a_bench_run_stops_the_bench_there(home, tiny_pair, monkeypatch, tmp_path):
    """Dropped during the fourth run (its prompt rendered by the template): the bench reports what the
    signal found finished, marked partial, and exits 130, as a Ctrl-C raised there does."""
    real_run_bench = bench_cmd.run_bench

    def dropped_in_the_fourth_run(engine, workload, settings):
        for n, run in enumerate(real_run_bench(engine, workload, settings), 1):
            if n == 4:
                drop_a_ctrl_c()
            yield run

    monkeypatch.setattr(bench_cmd, "run_bench", dropped_in_the_fourth_run)
    report = tmp_path / "bench.json"
    done = specllm_here(home, *BENCH, "-m", tiny_pair[0], "--json", report)
    assert done.returncode == 130, done.stderr
    assert "interrupted: reporting the 2 of 8 runs whose prompts every strategy finished" in done.stderr
    assert json.loads(report.read_text())["partial"] is True and done.stderr.strip().endswith("Interrupted.")


# -- a draft model loaded at its first use, failing there ------------------------------------

def test_a_draft_model_that_fails_to_load_at_its_first_use_is_dropped_and_the_text_goes_on(virtual_clock):
    """The load raised out of the generation (a traceback, the text so far cut off): now the generation
    goes on with the n-gram cache and plain steps, and the drafter keeps why for the front ends."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1]
    reference = generate_plain(FakeBackend(seed=0), prompt, 40, greedy, None)
    loads = []

    def fail(path, options):
        loads.append(path)
        raise SpecllmError(f"{path}: llama.cpp could not load it (unsupported architecture or damaged file)")

    draft = DeferredBackend("draft.gguf", LoadOptions(n_gpu_layers=0), load=fail)
    policy = CostAwarePolicy(BIG_GPU.copy(), draft_max=31, has_draft_model=True)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0, n_vocab=8), policy)
    target = FakeBackend(seed=0, clock=virtual_clock, pass_seconds=BIG_GPU.verify)
    events = list(Decoder(target, drafter, lambda history, limit: limit).generate(prompt, 40, greedy, np.random.default_rng(0)))
    assert events[-1].tokens == reference and events[-1].finish_reason == "length"
    assert len(loads) == 1 and "could not load" in str(drafter.model_error) and draft.error is drafter.model_error
    assert policy.model_state == RETIRED and not drafter.policy.model_in_play
    with pytest.raises(SpecllmError):  # not tried again: a new decoder of the engine leaves it out
        draft.load()
    assert len(loads) == 1


def test_a_deferred_draft_model_removed_or_replaced_since_the_start_is_not_loaded(tmp_path):
    path = tmp_path / "draft.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    gone = DeferredBackend(path, LoadOptions(), load=lambda p, o: pytest.fail("loaded"))
    replaced = DeferredBackend(path, LoadOptions(), load=lambda p, o: pytest.fail("loaded"))
    path.unlink()
    with pytest.raises(SpecllmError, match="the file is gone"):
        gone.load()
    path.write_bytes(b"GGUF" + bytes(50))
    with pytest.raises(SpecllmError, match="the file changed since this process started"):
        replaced.load()


@pytest.fixture
def auto_on_a_big_gpu(monkeypatch):
    """`--spec auto` priced as on a large GPU (it consults the draft model from the first steps)."""
    monkeypatch.setattr(Engine, "costs_known", lambda self: True)
    monkeypatch.setattr(Engine, "costs", lambda self: BIG_GPU.copy())
    monkeypatch.setattr(Engine, "learned_costs", lambda self: BIG_GPU.copy())


def removed_after_the_start(monkeypatch, draft):
    """Delete the draft file once the engine is open (a cache cleaned meanwhile)."""
    real_open = run_cmd.c.open_engine

    def open_then_remove(*args, **kwargs):
        engine = real_open(*args, **kwargs)
        draft.unlink()
        return engine

    monkeypatch.setattr(run_cmd.c, "open_engine", open_then_remove)


def test_run_goes_on_without_a_draft_model_removed_before_its_first_use(home, tiny_pair, tmp_path, monkeypatch, auto_on_a_big_gpu):
    """Minutes in, auto consults the draft model for the first time and its file is gone: the run
    keeps its text (that of plain decoding at temperature 0), says why in one line, and exits 0."""
    draft = tmp_path / "draft.gguf"
    shutil.copyfile(tiny_pair[1], draft)
    args = ["run", "-m", tiny_pair[0], "-n", "24", "--temp", "0", "-p", "Hello there", "--json"]
    plain = json.loads(specllm_here(home, *args, "--spec", "off").stdout)
    removed_after_the_start(monkeypatch, draft)
    done = specllm_here(home, *args, "--spec", "auto", "--draft", draft)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == plain["tokens"]
    warnings = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "the draft model could not be loaded at its first use" in warnings[0] and "the file is gone" in warnings[0]


def test_a_chat_goes_on_without_a_draft_model_removed_before_its_first_use(home, tiny_pair, tmp_path, monkeypatch, auto_on_a_big_gpu):
    """The chat says it once and answers every message; /spec draft then says the model cannot be loaded, and the chat goes on."""
    draft = tmp_path / "draft.gguf"
    shutil.copyfile(tiny_pair[1], draft)
    removed_after_the_start(monkeypatch, draft)
    script = b"Hello there\n/spec draft\nAgain\n"
    done = specllm_here(home, "chat", "-m", tiny_pair[0], "--draft", draft, "-n", "12", "--temp", "0", stdin=script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 2 and done.stderr.count("could not be loaded at its first use") == 1
    assert "Traceback" not in done.stderr and "the file is gone" in done.stderr.split("could not be loaded at its first use")[1]


# -- a signal during a chat reply's last step ------------------------------------------------


class SignalAtEvaluation:
    """Wraps a fake target: delivers `sig` to the main thread once `at` evaluations have run."""

    def __init__(self, target, sig, at):
        self.target, self.sig, self.at = target, sig, at
        real = target.evaluate

        def evaluate(tokens, rows, copy=True):
            out = real(tokens, rows, copy)
            if len(target.evaluations) == self.at:
                signal.pthread_kill(threading.main_thread().ident, self.sig)
            return out

        target.evaluate = evaluate


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, interrupt.Terminated)], ids=["sigint", "sigterm"])
def test_a_signal_during_the_last_step_of_a_scripts_reply_ends_the_chat(installed, sig, raised):
    """The reply reaches max_tokens in the step the signal came in (reason "length", not
    "interrupted"): the signal was dropped and the script went on to its next message."""
    engine = FakeEngine()
    SignalAtEvaluation(engine.target, sig, at=4)  # the prompt's pass, then three one-token steps: the third is the last
    out = io.StringIO()
    loop = ChatLoop(engine, Conversation(), ChatSettings(SamplingParams(temperature=0.0), 3), "off", out=out)
    with pytest.raises(raised):
        loop.run(reader(["write code", "and more"]))
    assert loop.replies == 1 and len(out.getvalue().splitlines()) == 1  # the reply kept, the next message not sent


def test_sigterm_during_the_last_step_of_a_reply_at_a_terminal_ends_the_chat(installed):
    engine = FakeEngine()
    SignalAtEvaluation(engine.target, signal.SIGTERM, at=4)
    loop = ChatLoop(engine, Conversation(), ChatSettings(SamplingParams(temperature=0.0), 3), "off", out=io.StringIO(), interactive=True)
    with pytest.raises(interrupt.Terminated):
        loop.run(reader(["write code", "and more"]))
    assert loop.replies == 1


class HardStopDropped:
    """Wraps a fake target: at evaluation `at`, a Ctrl-C asks the reply to stop, then a second one
    (the hard stop, `second`) lands in a finalizer, where Python drops it."""

    def __init__(self, target, at, second=signal.SIGINT):
        real = target.evaluate

        def evaluate(tokens, rows, copy=True):
            out = real(tokens, rows, copy)
            if len(target.evaluations) == at:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                drop_a_ctrl_c(second)
            return out

        target.evaluate = evaluate


def test_a_hard_stop_dropped_during_a_reply_at_a_terminal_is_no_ctrl_c_at_the_next_prompt(installed, capsys):
    """The stop after the step served it: it stayed noted, and the next prompt took it for a Ctrl-C
    of its own ("Use Ctrl-D or /bye to leave." under the reply)."""
    engine = FakeEngine()
    HardStopDropped(engine.target, at=2)
    loop = ChatLoop(engine, Conversation(), ChatSettings(SamplingParams(temperature=0.0), 8), "off", out=io.StringIO(), interactive=True)
    loop.run(reader(["write code"]))
    assert loop.stopped_by == signal.SIGINT and interrupt.pending() is None
    assert "to leave" not in capsys.readouterr().err


def test_a_sigterm_dropped_as_the_hard_stop_of_a_reply_still_ends_the_chat(installed):
    """The stop serves a dropped hard stop, and a SIGTERM still ends the command."""
    engine = FakeEngine()
    HardStopDropped(engine.target, at=2, second=signal.SIGTERM)
    loop = ChatLoop(engine, Conversation(), ChatSettings(SamplingParams(temperature=0.0), 8), "off", out=io.StringIO(), interactive=True)
    with pytest.raises(interrupt.Terminated):
        loop.run(reader(["write code", "and more"]))
    assert loop.replies == 1 and interrupt.pending() is None
