"""The engine on rank 0: requests in, a step of the job per call, token ids out.

It runs on the thread that calls MPI (the main one) and works in token ids alone: the
text of a request (its tokenizer, stop strings, response bodies) is the front's
(``app``, ``text``), which runs in a process of its own under ``meshplan serve``
(``link``). The front submits ``Work`` (``submit``, which refuses when the queue is full
or the server stops) and gets events back through ``Work.emit``: with echo ``("prompt",
scores)`` first, then ``("token", id, score, end)`` per token (``score`` None without
logprobs; ``end`` True for an end token, which has no text), then ``("done",
finish_reason, usage)``, or ``("error", message, HTTP status)``. A request the front
cancels (its client went away, or a stop string ended its text) gets no more events.
Between two calls the engine takes new requests into free slots, drops cancelled ones and
frees finished ones, so a slot is free again within one step of its request's end.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from meshplan.serving.batching import Work


class QueueFull(Exception):
    """More requests wait than ``max_queue``: try again later (HTTP 429)."""


class Stopping(Exception):
    """The server is stopping and takes no new request (HTTP 503)."""


class Engine:
    def __init__(self, batch, eos_ids, metrics, max_queue: int):
        self.batch, self.eos = batch, set(int(e) for e in eos_ids)
        self.metrics, self.max_queue = metrics, max_queue
        self._lock = threading.Lock()
        self._inbox: deque[Work] = deque()
        self._queued = 0
        self.waiting: deque[Work] = deque()
        self.wake = threading.Event()
        self.stopping = False
        self._made = 0     # tokens of the step (the metrics take them once a step)

    # --- the front's side (any thread) ------------------------------------------------------------

    def submit(self, work: Work) -> None:
        """Queue a request; its other choices (``work.followers``) come in with it where the
        batch copies a prompt's cache into their rows, else each as a request of its own."""
        entries = [work]
        if work.followers and not getattr(self.batch, "copies", False):
            entries, work.followers = [work, *work.followers], []
        with self._lock:
            if self.stopping:
                raise Stopping()
            if self._queued >= self.max_queue:   # (a request of n choices waits as one)
                raise QueueFull()
            self._queued += len(entries)
            self._inbox.extend(entries)
            self.metrics.waiting.set(self._queued)
        self.wake.set()

    def cancel(self, work: Work, reason: str = "cancelled") -> None:
        """End a request the front is done with (``reason``: how, as the metrics count it)."""
        work.cancelled = reason
        self.wake.set()

    # --- the engine's side (the MPI thread) -------------------------------------------------------

    def run(self, stop: threading.Event, hurry: threading.Event | None = None, after=None) -> None:
        """Serve until ``stop`` is set and what runs has finished (what waits is refused), or
        as soon as ``hurry`` is set too (what runs gets an error, as what waits does).
        ``after()`` is called once a turn (the events of a step go out together)."""
        try:
            while True:
                if after is not None:
                    after()
                self._take_new(stop.is_set(), hurry is not None and hurry.is_set())
                if not self.batch.busy:   # nothing runs: wait for a request (or the stop)
                    if self.stopping and not self.waiting:
                        return
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                chosen = self.batch.step()
                for kind in self.batch.made:
                    self.metrics.calls.labels(kind).inc()
                self.batch.made.clear()
                for work, token in chosen:
                    self._deliver(work, token)
                self.metrics.tokens(self._made)
                self._made = 0
        except BaseException as exc:
            self.fail_all(f"the job failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            raise

    def fail_all(self, message: str) -> None:
        """Every request in flight or queued gets an error (the job cannot go on)."""
        with self._lock:
            self.stopping = True
            pending = list(self._inbox) + list(self.waiting) + list(self.batch.busy)
            self._inbox.clear()
        for work in pending:
            if work.finished is None:
                work.finished = "error"
                self.metrics.requests.labels("error").inc()
                work.emit(("error", message, 500))

    def _take_new(self, stop: bool, hurry: bool = False) -> None:
        with self._lock:
            if stop:
                self.stopping = True
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
        for work in [w for w in self.batch.busy if w.cancelled]:
            self._finish(work, work.cancelled)
        for work in self.batch.busy if hurry else []:
            self.batch.release(work)
            work.finished = "error"
            self.metrics.requests.labels("refused").inc()
            work.emit(("error", "the server is stopping", 503))
        for work in [w for w in self.waiting if w.cancelled or self.stopping]:
            self.waiting.remove(work)
            self._dequeued()
            if work.cancelled:
                self.metrics.requests.labels(work.cancelled).inc()
            else:
                work.finished = "error"
                self.metrics.requests.labels("refused").inc()
                work.emit(("error", "the server is stopping", 503))
        while self.waiting and self.batch.accepts(self.waiting[0]):
            work = self.waiting.popleft()
            self._dequeued()
            for one in [work, *work.followers]:
                one.eos = frozenset(self.eos)
            reused = getattr(self.batch, "reused", 0)
            self.batch.admit(work)
            self.metrics.prompt_tokens.inc(len(work.prompt))
            self.metrics.prefix_reused.inc(getattr(self.batch, "reused", 0) - reused)
        self.metrics.running.set(len(self.batch.busy))

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1
            self.metrics.waiting.set(self._queued)

    def _deliver(self, work: Work, token: int) -> None:
        now = time.perf_counter()
        if work.first_at is None:
            work.first_at = now
            self.metrics.ttft.observe(now - work.arrived)
        else:
            self.metrics.tpot.observe(now - work.last_at)
        work.last_at = now
        if len(work.ids) == 0 and work.echo:   # the prompt's scores, before its first token
            work.emit(("prompt", list(work.prompt_scores)))
        if work.max_tokens == 0:   # (echo alone: the prompt scored, nothing generated)
            self._finish(work, "length")
            return
        work.ids.append(token)
        self._made += 1
        end = token in self.eos and not work.ignore_eos
        score, work.score = work.score, None
        work.emit(("token", token, score, end))
        if end:
            self._finish(work, "stop")
        elif len(work.ids) >= work.max_tokens or self.batch.room(work) <= 0:
            self._finish(work, "length")

    def _finish(self, work: Work, reason: str) -> None:
        self.batch.release(work)
        work.finished = reason
        self.metrics.requests.labels(reason).inc()
        self.metrics.running.set(len(self.batch.busy))
        if not work.cancelled:   # (the front ended it: it waits for nothing more)
            work.emit(("done", reason, {"prompt_tokens": len(work.prompt), "completion_tokens": len(work.ids),
                                        "total_tokens": len(work.prompt) + len(work.ids)}))
