"""One thread owns the decoder and serves a bounded FIFO queue of jobs, one at a time.

A job carries its prompt tokens and settings in, and its messages out through a callback
(`post`) that the HTTP layer points at an asyncio queue: ("start", None) when its turn comes,
("text", piece) as text is committed (stop strings held back and cut), then ("done", Result)
or ("error", ApiError). A job's `cancel` (client gone) stops its generation at the next step.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specllm.engine.decode import Decoder, Done, PrefillDone, TokenCommitted
from specllm.engine.sampling import SamplingParams
from specllm.engine.stats import Stats
from specllm.errors import SpecllmError
from specllm.server.endings import IndentCut, StopText, find_filtered_end
from specllm.server.parsing import ApiError, busy

log = logging.getLogger("specllm.server")
SHUTTING_DOWN = "the server is shutting down"
LEFT = ApiError(499, "the client closed the request", kind="client_closed")


@dataclass
class Result:
    text: str
    finish_reason: str  # the engine's: stop, length, context, interrupted
    stopped_by_text: bool  # a stop string ended it
    stats: Stats
    cut: bool = False  # a line indented too little, or the time limit, ended it (llama.cpp's `n_indent`, `t_max_predict_ms`)


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    post: Callable[[str, object], None]
    stop: list[str] = field(default_factory=list)
    n_indent: int = 0  # end before a new line indented less than this (0: never)
    time_limit: float = 0.0  # seconds: once a new line has come, end when generating has taken this long (0: never)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    def __init__(self, make_decoder: Callable[[], Decoder], queue_size: int = 8, draft_error: Callable[[], Exception | None] = lambda: None):
        self.make_decoder = make_decoder
        self.decoder = make_decoder()
        self.draft_error = draft_error  # why `auto`'s draft model could not be loaded at its first use, or None
        self.draft_lost_said = False
        self.queue_size = queue_size
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.closing = threading.Event()
        self.aborting = threading.Event()
        self.busy = False
        self.served = 0
        self.recent: list[Result] = []  # the last few requests' results (for tests)
        self._thread = threading.Thread(target=self._run, name="specllm-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self.closing.is_set():
            raise busy(SHUTTING_DOWN)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self._drop_left()
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                waiting = "1 request is" if self.queue_size == 1 else f"{self.queue_size} requests are"
                raise busy(f"the server is busy: {waiting} already waiting; retry later") from None

    def _drop_left(self) -> None:
        """Take out the waiting jobs whose clients have left (answered, so their handlers end): their
        places go to those who ask now. In the loop's thread, the only one that adds jobs."""
        for job in self._take_waiting():
            if job is not None and job.cancelled.is_set():
                job.post("error", LEFT)
            else:
                self.jobs.put_nowait(job)

    def queued(self) -> int:
        return self.jobs.qsize()

    def stop_accepting(self) -> None:
        """Refuse new jobs and those still waiting; the running one goes on (abort() stops it)."""
        self.closing.set()
        self._drain()

    def abort(self) -> None:
        self.aborting.set()

    def close(self, timeout: float = 30.0) -> None:
        self.stop_accepting()
        self.abort()
        if self._thread.is_alive():
            self.jobs.put(None, timeout=timeout)
            self._thread.join(timeout)

    def _drain(self) -> None:
        for job in self._take_waiting():
            if job is not None:
                job.post("error", busy(SHUTTING_DOWN))

    def _take_waiting(self) -> list[Job | None]:
        """Every job in the queue, in order, taken out of it."""
        waiting = []
        while True:
            try:
                waiting.append(self.jobs.get_nowait())
            except queue.Empty:
                return waiting

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.closing.is_set():
                job.post("error", busy(SHUTTING_DOWN))
            elif job.cancelled.is_set():  # its client left while it waited: answer so its handler ends
                job.post("error", LEFT)
            else:
                self.busy = True
                try:
                    self._serve(job)
                finally:
                    self.busy = False
                    self._say_draft_lost()

    def _say_draft_lost(self) -> None:
        """Once, in the server's log: `auto` went on without a draft model that failed to load at its
        first use (run and chat warn the same way); every request is served as before, without it."""
        error = None if self.draft_lost_said else self.draft_error()
        if error is not None:
            self.draft_lost_said = True
            # no formatter of the server's own: the line reads as `run`'s warnings do
            log.warning("warning: the draft model could not be loaded at its first use; requests go on without it "
                        "(the same texts, perhaps slower): %s", error)  # fmt: skip

    def _serve(self, job: Job) -> None:
        job.post("start", None)
        stats, text, indent, done = Stats(), StopText(job.stop), IndentCut(job.n_indent), None
        pieces = []
        rng = np.random.default_rng(job.params.seed)
        started = None  # when generating began (the prompt read)
        new_line = timed_out = False

        def out_of_time() -> bool:
            nonlocal timed_out
            if job.time_limit and new_line and not timed_out:
                timed_out = time.perf_counter() - started > job.time_limit
            return timed_out

        def should_stop() -> bool:
            return job.cancelled.is_set() or text.stopped or indent.stopped or self.aborting.is_set() or out_of_time()

        filtered = bool(text.stops) or indent.n_indent > 0
        find_text_end = functools.partial(find_filtered_end, text, indent) if filtered else None
        try:
            for event in self.decoder.generate(job.prompt, job.max_tokens, job.params, rng, stop=should_stop, find_text_end=find_text_end):
                if isinstance(event, TokenCommitted) and (text.stopped or indent.stopped):
                    continue  # committed in the step that met a stop string or a short line, after it: neither sent nor counted
                stats.update(event)
                if isinstance(event, TokenCommitted):
                    piece = indent.push(text.push(event.text))
                    if piece:
                        pieces.append(piece)
                        job.post("text", piece)
                        new_line = new_line or "\n" in piece
                elif isinstance(event, PrefillDone):
                    started = time.perf_counter()
                elif isinstance(event, Done):
                    done = event
        except SpecllmError as exc:
            self._fail(job, ApiError(500, f"generation failed: {exc}", code="generation_failed", kind="server_error"))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: the client hears of it, the server keeps serving
            log.exception("generation failed")
            self._fail(job, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))
            return
        tail = indent.push(text.flush()) + indent.flush()
        if tail:
            pieces.append(tail)
            job.post("text", tail)
        result = Result("".join(pieces), done.finish_reason, text.stopped, stats, indent.stopped or timed_out)
        self.served += 1
        self.recent = (self.recent + [result])[-16:]
        if done.finish_reason == "interrupted" and self.aborting.is_set() and not (text.stopped or result.cut):  # a second signal
            job.post("error", busy(f"{SHUTTING_DOWN}: this generation was cut short after {stats.tokens} tokens"))
        else:
            job.post("done", result)

    def _fail(self, job: Job, error: ApiError) -> None:
        """A failed step may leave the KV cache out of step with the history: start afresh."""
        try:
            self.decoder = self.make_decoder()
        except Exception:  # noqa: BLE001
            log.exception("could not rebuild the decoder")
        job.post("error", error)
