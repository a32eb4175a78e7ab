"""The chat loop behind `specllm chat`: read a line, run a command or a turn, stream the reply.

One Decoder lives for the whole session, so each turn evaluates only what the conversation
added since the last one (target and draft), and the n-gram cache spans every turn.
Replies go to `out` (stdout) and nothing else does; notes, command output, the live status
line and summaries go to stderr. Input comes from a `read_line(prompt)` callable, so tests
drive the loop with a list of lines.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

import numpy as np

from specllm.chat import (
    ChatSettings,
    Command,
    Conversation,
    MultiLine,
    apply_set,
    command_names,
    encode_messages,
    end_of_input_keys,
    help_text,
    parse_command,
    reasoning_splitter,
    thinking_variables,
)
from specllm.cli.display import (
    RESET,
    LiveStatus,
    ReasoningWriter,
    ReplyWriter,
    TokenWriter,
    colour_allowed,
    dumb_terminal,
    status_text,
    stream_reply,
    summary_text,
)
from specllm.cli.common import cost_curve, draft_lost
from specllm.cli import interrupt
from specllm.cli.interrupt import StopOnSignal, Terminated
from specllm.engine.stats import Stats
from specllm.errors import SpecllmError, UsageError, one_line
from specllm.session import DRAFT_STRATEGIES, STRATEGIES

ReadLine = Callable[[str], str]  # returns a line without its newline; EOFError at the end
PROMPT, CONTINUATION = ">>> ", "... "
CLEAR_HINT = "/clear starts a new conversation"


def leave_hint() -> str:
    return f"Use {end_of_input_keys()} or /bye to leave."


class ChatLoop:
    def __init__(
        self,
        engine,
        conversation: Conversation,
        settings: ChatSettings,
        strategy: str,
        *,
        out=None,
        interactive: bool = False,
        live: bool = False,
        summaries: bool = False,
        colour: bool = False,
        think: bool = True,
    ):
        self.engine, self.conversation, self.settings, self.strategy = engine, conversation, settings, strategy
        self.out = out or sys.stdout
        self.interactive, self.live, self.summaries, self.colour = interactive, live, summaries, colour
        self.decoder = engine.decoder(strategy)
        self.started_with = strategy  # off and ngram load no draft model, so /spec draft cannot use one
        self.think = think
        self.variables = thinking_variables(engine.target, think)  # --no-think: the template's switch
        self.rng = np.random.default_rng(settings.params.seed)
        self.session = Stats()  # every event of every turn: /stats
        self.replies = 0
        self.unsent = 0  # messages refused (too long) or cut off by the input's end: a script's exit says so
        self.block = MultiLine()
        self.stopped_by: int | None = None  # the signal that stopped the last reply
        self.draft_lost_said = False  # whether the chat said that the draft model could not be loaded
        self.failure: SpecllmError | None = None  # why the reply in hand failed (a target pass), until said

    # -- reading -------------------------------------------------------------------------

    def run(self, read_line: ReadLine) -> None:
        """Until /bye or the end of input. Ctrl-C at a terminal prompt only says how to leave."""
        while True:
            try:
                interrupt.raise_pending()  # a Ctrl-C dropped between turns (a template's finalizer) is one at the prompt
                line = read_line(CONTINUATION if self.block.open else PROMPT)
            except EOFError:
                if self.interactive and self.block.open:  # Ctrl-D ends the block, as it ends a shell's here-document: sent
                    self.handle(MultiLine.QUOTES)
                    continue
                if self.block.cancel():
                    self.unsent += 1
                    self.note('The input ended inside a """ block; that message was not sent.')
                return  # (at a terminal the reader has ended the prompt's line)
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                interrupt.handled()
                self.err.write("\n")
                self.note("Multi-line message dropped." if self.block.cancel() else leave_hint())
                continue
            except Terminated:
                if self.interactive:
                    self.err.write("\n")  # "Terminated." on a line of its own, not after what was typed
                raise
            if not self.handle(line):
                return

    def handle(self, line: str) -> bool:
        """One line of input; False when the session should end."""
        pasted = "\n" in line and not self.block.open  # a block pasted at the prompt (bracketed paste)
        if self.block.open or (self.block.starts(line) and (not pasted or MultiLine.wraps(line))):
            text = self.block.feed(line)
            if text is not None and text.strip():
                self.send(text.strip("\n"))
            return True
        if pasted:  # one message, whatever its first word or its first line's quotes (a module's docstring)
            if line.strip():
                self.send(line.strip("\n"))
            return True
        command = parse_command(line)
        if command is not None:
            return self.command(command)
        if line.strip():
            self.send(line.strip())
        return True

    # -- commands ------------------------------------------------------------------------

    def command(self, command: Command) -> bool:
        if not command.known:
            self.note(f"Unknown command {command.name}. Commands: {command_names()} (/help explains them).")
        elif command.name == "/bye":
            return False
        elif command.name == "/help":
            self.note(f"{help_text()}\n{leave_hint()} Ctrl-C stops a reply.")
        elif command.name == "/stats":
            self.note(self.stats_text())
        elif command.name == "/set":
            self.set(command.args)
        elif command.name == "/spec":
            self.spec(command.args)
        elif command.name == "/clear":
            self.conversation.clear()
            self.note("New conversation.")
        return True

    def set(self, args: list[str]) -> None:
        if not args:
            self.note(self.settings.describe())
            return
        try:
            settings = apply_set(self.settings, args)
        except UsageError as exc:
            self.note(f"{exc}; nothing changed.")
            return
        if args[0].lower() == "seed" or settings.params.seed != self.settings.params.seed:  # seed N starts N's draws afresh, as --seed N
            self.rng = np.random.default_rng(settings.params.seed)
        self.settings = settings
        self.note(f"Now {settings.describe()}.")

    def spec(self, args: list[str]) -> None:
        choices = "|".join(STRATEGIES)
        if len(args) != 1 or args[0].lower() not in STRATEGIES:  # as /set's names: /spec NGRAM is /spec ngram
            unknown = f"No strategy {' '.join(args)!r}. " if args else ""
            self.note(f"{unknown}Speculation: {self.strategy}. Change it with /spec {choices}.")
            return
        strategy = args[0].lower()
        if strategy == "draft" and self.engine.draft is None:
            start = ("start the chat with --draft PATH or a preset that has one" if self.started_with in DRAFT_STRATEGIES else
                     f"a chat started with --spec {self.started_with} loads none; start it with --spec {'|'.join(DRAFT_STRATEGIES)}")
            self.note(f"No draft model is loaded: {start}. Speculation stays {self.strategy}.")
            return
        if strategy == "auto" and not self._cost_curve():
            return
        try:
            self.decoder = self.engine.decoder(strategy)  # clears the KV caches
        except SpecllmError as exc:  # a draft model that failed to load when auto first used it
            self.note(f"{exc}. Speculation stays {self.strategy}.")
            return
        self.strategy = strategy
        alone = strategy in ("auto", "ngram+draft") and (self.engine.draft is None or getattr(self.engine.draft, "error", None) is not None)
        alone = " (no draft model loaded: the n-gram cache alone)" if alone else ""
        self.note(f"Speculation: {strategy}{alone}. The next turn reads the conversation again.")

    def _cost_curve(self) -> bool:
        """`auto` plans by this machine's cost curve: where none is cached for these models it is
        measured now (1-3 min on 2 cores, said on stderr, as at the start of a chat). At a terminal
        Ctrl-C stops the measuring and keeps the strategy and the conversation (False)."""
        try:
            cost_curve(self.engine, announce=self.err.isatty())
        except KeyboardInterrupt:
            if not self.interactive:
                raise
            interrupt.handled()
            self.err.write("\n")
            self.decoder = self.engine.decoder(self.strategy)  # the measuring used the target's cache: the next turn reads the conversation again
            self.note(f"Measuring stopped: speculation stays {self.strategy}.")
            return False
        return True

    def stats_text(self) -> str:
        s = self.session
        lines = [
            f"{self.replies} replies · {self.context_text()} · spec {self.strategy}",
            f"generated: {status_text(s)} · {s.seconds:.2f}s",
            f"prompts: {s.prompt_tokens} tok, {s.reused_tokens} reused from the KV cache, prefill {s.prefill_seconds:.2f}s",
            f"settings: {self.settings.describe()}",
        ]
        return "\n".join(lines)

    def context_text(self) -> str:
        """How much of the context the conversation takes, or that it leaves no room for a message.
        A reply cut at a full context leaves a conversation that, re-encoded with its turn's end,
        no longer fits at all: "42 of 40" would be no answer."""
        held, n_ctx = self.tokens_so_far(), self.engine.target.n_ctx
        if held < n_ctx and self.room_for_a_message():
            return f"conversation {held} of {n_ctx} context tokens"
        hint = CLEAR_HINT if self.conversation.messages else "--ctx-size gives a larger context"  # /clear keeps the system prompt
        return f"the conversation leaves no room in the {n_ctx}-token context: the next message will not fit ({hint})"

    def room_for_a_message(self) -> bool:
        """Whether a message of one character would be sent (send() refuses a prompt of n_ctx tokens or more)."""
        shortest = self.conversation.all_messages() + [{"role": "user", "content": "x"}]
        return len(encode_messages(self.engine.target, shortest, variables=self.variables)) < self.engine.target.n_ctx

    # -- turns ---------------------------------------------------------------------------

    def send(self, text: str) -> None:
        """One turn: refuse what cannot fit, else generate and keep the reply (partial ones too)."""
        target = self.engine.target
        prompt = encode_messages(target, self.conversation.all_messages() + [{"role": "user", "content": text}], variables=self.variables)
        if len(prompt) >= target.n_ctx:
            self.refuse(prompt, target.n_ctx)
            return
        self.conversation.add("user", text)
        reason, reply, reasoning = self.reply(prompt)
        if reason == "error":
            self.failed(reply, reasoning)
            return
        if not reply and reason in ("interrupted", "context", "length"):
            self.conversation.withdraw()  # nothing to keep (a thinking model may have reasoned): the conversation stays as it was
            why, hint = {
                "context": ("no room was left for a reply", CLEAR_HINT),
                "interrupted": ("interrupted before the reply began", None),
                "length": (f"max_tokens {self.settings.max_tokens} was reached before any answer", "/set max_tokens N allows longer replies"),
            }[reason]
            self.note(f"({why}; the message was not kept{'; ' + hint if hint else ''})")
        else:
            self.conversation.add("assistant", reply, reasoning)  # the answer whole, its reasoning apart (see reasoning_apart)
            self.replies += 1
            self.explain(reason, bool(reasoning) and not reply)
        # A signal during the reply's last step ends it as "length" or "stop", not "interrupted": it still counts.
        if self.stopped_by == signal.SIGTERM:
            raise Terminated()  # after the step, the reply's line ended and kept, as `run` does (exit 143)
        if self.stopped_by is not None and not self.interactive:
            raise KeyboardInterrupt  # a script stops on Ctrl-C, as `run` does (exit 130)

    def failed(self, reply: str, reasoning: str | None) -> None:
        """A target pass failed mid-reply (llama.cpp out of memory for a batch): what came is kept, as
        after a Ctrl-C. A script ends there (one line, exit 1, as `run` does); at a terminal the chat
        goes on, from a fresh decoder, and the user may try again, shorten the conversation or leave."""
        failure, self.failure = self.failure, None
        if reply:
            self.conversation.add("assistant", reply, reasoning)
            self.replies += 1
        else:
            self.conversation.withdraw()
        if not self.interactive:
            raise failure
        kept = "the partial reply is kept" if reply else "the message was not kept"
        self.note(f"(the reply failed: {one_line(failure)}; {kept}; {CLEAR_HINT} if it fails again)")

    def tokens_so_far(self) -> int:
        messages = self.conversation.all_messages()
        return len(encode_messages(self.engine.target, messages, add_assistant=False, variables=self.variables)) if messages else 0

    def check_system_prompt(self) -> None:
        """A system prompt that leaves the context no room for a message is refused at the start:
        /clear keeps it, so no message could ever be sent."""
        check_system_prompt(self.engine, self.conversation.system, self.think)

    def refuse(self, prompt: list[int], n_ctx: int) -> None:
        self.unsent += 1
        held = self.tokens_so_far()
        hint = f"{CLEAR_HINT}; --ctx-size gives a larger context." if self.conversation.messages else "A shorter message or --ctx-size makes room."
        if held >= n_ctx:  # a reply cut at a full context, re-encoded with its turn's end: no message could fit
            self.note(f"Message not sent: the conversation already takes {held} tokens, all of the {n_ctx}-token context "
                      f"(the last reply filled it). {hint}")
            return
        self.note(
            f"Message not sent: the conversation would need {len(prompt)} tokens "
            f"({held} so far + {len(prompt) - held} for this message) and the context holds {n_ctx}. " + hint
        )

    def explain(self, reason: str, reasoning_alone: bool = False) -> None:
        """Why a kept reply ended where it did; `reasoning_alone`: a thinking model's reply with no answer."""
        if reason == "stop" and reasoning_alone:  # its end token in (or right after) its thinking block: stdout had nothing
            self.note("(the model ended its reply with reasoning and no answer)")
        elif reason == "context":
            n_ctx = self.engine.target.n_ctx
            self.note(f"(the context is full at {n_ctx} tokens: the reply was cut short and kept; {CLEAR_HINT})")
        elif reason == "length":
            self.note(f"(the reply reached max_tokens {self.settings.max_tokens}; /set max_tokens N allows longer ones)")
        elif reason == "interrupted" and self.interactive:
            self.note("(interrupted; the partial reply is kept)")

    def reply(self, prompt: list[int]) -> tuple[str, str, str | None]:
        """Stream one reply to `out` (a thinking model's reasoning to stderr); returns (finish reason,
        the answer: what the conversation keeps, a thinking model's reasoning: None for others)."""
        stats, done = Stats(), None
        live = LiveStatus(self.live)
        splitter = reasoning_splitter(self.engine.target, prompt)
        reply = ReplyWriter(splitter, TokenWriter(self.out, colour=self.colour), ReasoningWriter(live, self.err))
        stopper = StopOnSignal(terminate=True)  # SIGTERM too: the reply stops after its step and is kept
        try:
            with stopper, live:
                events = self.decoder.generate(
                    prompt, self.settings.max_tokens, self.settings.params, self.rng, stop=stopper.requested
                )
                done = stream_reply(events, reply, live, stats, self.session)
        except KeyboardInterrupt:
            if not self.interactive:
                raise
            interrupt.handled()
            # A second Ctrl-C lands mid-step: the KV caches may not match the history, so start afresh.
            self.decoder = self.engine.decoder(self.strategy)
        except SpecllmError as exc:  # a target pass that failed: the caches may not match the history either
            self.failure = exc
            self.decoder = self.engine.decoder(self.strategy)
        self.stopped_by = stopper.received
        reply.finish()
        reason = "error" if self.failure is not None else done.finish_reason if done is not None else "interrupted"
        text = "".join(reply.written)
        self.out.write("" if text.endswith("\n") or not text else "\n")
        if self.interactive and _isatty(self.out):
            self.out.write("\n")
        self.out.flush()
        if self.summaries:
            self.note(summary_text(stats), dim=True)
        lost = draft_lost(self.engine)
        if lost and not self.draft_lost_said:
            self.draft_lost_said = True
            self.note(f"warning: {lost}")
        return reason, text, "".join(splitter.reasoning) if splitter.thinks else None

    # -- output --------------------------------------------------------------------------

    @property
    def err(self):
        return sys.stderr

    def note(self, text: str, dim: bool = False) -> None:
        """Everything that is not a reply: stderr, dimmed at a terminal unless NO_COLOR."""
        style = "\x1b[2m" if dim and colour_allowed(self.err) else ""
        self.err.write(f"{style}{text}{RESET if style else ''}\n")
        self.err.flush()

    def banner(self) -> None:
        name = getattr(self.engine.target, "path", None)
        name = f" with {name.name}" if name is not None else ""
        self.note(f"Chatting{name} (spec {self.strategy}). /help lists the commands. {leave_hint()}", dim=True)


def check_system_prompt(engine, system: str | None, think: bool = True) -> None:
    """Refuse a system prompt that leaves the context no room for a message (`think` False: as
    `--no-think` renders it); the chat command asks before `auto` measures this machine (minutes),
    so a refusal comes at once."""
    if system is None:
        return
    n_ctx, variables = engine.target.n_ctx, thinking_variables(engine.target, think)
    held = len(encode_messages(engine.target, [{"role": "system", "content": system}], add_assistant=False, variables=variables))
    if held >= n_ctx:
        raise UsageError(f"the system prompt alone takes {held} tokens and the context holds {n_ctx}: shorten it or raise --ctx-size")


def script_reader(stream) -> ReadLine:
    """Lines from a pipe or file: no prompts, no echo."""
    first = True

    def read(prompt: str) -> str:  # noqa: ARG001
        nonlocal first
        try:
            line = stream.readline()
        except UnicodeDecodeError as exc:
            raise SpecllmError(f"standard input is not valid UTF-8 (byte {exc.start})") from None
        except OSError as exc:  # main would call it a failure to write the output
            raise SpecllmError(f"cannot read standard input: {exc.strerror or exc}") from None
        if not line:
            raise EOFError
        try:  # a C locale decodes stdin with surrogateescape: undecodable bytes arrive as lone surrogates
            line.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SpecllmError(f"standard input is not valid UTF-8 (character {exc.start + 1} of the line)") from None
        if first:  # a BOM (Notepad, PowerShell) would make a first `/set ...` a message to the model
            line, first = line.removeprefix("\ufeff"), False
        return line.rstrip("\r\n")

    return read


HISTORY_LINES = 1000  # lines typed that the up arrow brings back (bash keeps 500); a block pasted at once is one


def terminal_reader() -> ReadLine:
    """input() with readline's line editing and in-session history, the latest HISTORY_LINES lines
    of it (readline keeps every line typed, and a long chat of pasted code grew it without end);
    the prompt never lands in redirected stdout."""
    try:
        import readline  # (importing it is what gives input() editing and history)
    except ImportError:  # pragma: no cover - platforms without readline
        readline = None
    pasting = _paste_as_one(readline)

    def read(prompt: str) -> str:
        if _isatty(sys.stdout):
            line = input(prompt)
        else:
            sys.stderr.write(prompt)
            sys.stderr.flush()
            line = input()
        if readline is not None:
            _trim_history(readline)
        return line

    return _ending_the_line_at_eof(read, by_readline=pasting)


def _paste_as_one(readline) -> bool:
    """Bracketed paste: a block pasted at the prompt arrives as one line holding its newlines (one
    message, as in ollama) instead of a message per line. GNU readline 8.1 on has it on by default,
    but Python turns it off for its own prompt; libedit has no such setting, and a dumb terminal
    would print its escapes. True where it is on."""
    gnu = readline is not None and "libedit" not in (readline.__doc__ or "") and getattr(readline, "_READLINE_VERSION", 0) >= 0x0801
    if not gnu or not os.environ.get("TERM") or dumb_terminal():
        return False
    readline.parse_and_bind("set enable-bracketed-paste on")
    return True


def _ending_the_line_at_eof(read: ReadLine, by_readline: bool) -> ReadLine:
    """Ctrl-D leaves the cursor after the prompt: end that line, unless readline does (with
    bracketed paste on it writes a newline at the end of input itself)."""

    def read_to_the_end(prompt: str) -> str:
        try:
            return read(prompt)
        except EOFError:
            if not (by_readline and _isatty(sys.stdout)):  # without a terminal stdout input() does not use readline
                sys.stderr.write("\n")
            raise

    return read_to_the_end


def _trim_history(readline) -> None:
    """Forget the oldest lines typed beyond HISTORY_LINES (set_history_length bounds only a history file)."""
    try:
        while readline.get_current_history_length() > HISTORY_LINES:
            readline.remove_history_item(0)
    except (AttributeError, ValueError):  # pragma: no cover - a readline without them (libedit's quirks)
        pass


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
