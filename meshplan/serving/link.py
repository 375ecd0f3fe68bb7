"""The engine and the HTTP front in two processes, over one connection.

``meshplan serve`` runs its HTTP front (``front``: the app, the tokenizer, the text of
every response) in a process of its own, so that rank 0's engine steps the job without
sharing its interpreter: with the front on a thread beside it, 8 streaming clients made
a step of the 1 MB sample plan cost 4-6x what ``meshplan generate``'s does, the engine
waiting for the interpreter while the front wrote text and events. Over the connection
(a ``multiprocessing.connection.Connection`` on a socket pair, pickled tuples) go only
token ids and the engine's events, batched: one message per engine turn however many
requests run.

The front sends ``("submit", id, specs)`` (one spec per choice: what the engine needs of
a ``Work``), answered ``("submitted", id, outcome)`` (None, "full" or "stopping");
``("cancel", id, choice, reason)``; ``("metrics", id)``, answered with the Prometheus
text of the engine's registry (every metric lives with the engine). The engine sends
``("events", [(id, choice, event), ...])``, ``("stopping",)`` once it takes no new
request, and ``("close",)`` when the front may end. Either end that finds the connection
closed takes it as the other's end: the front ends with the job, and an engine whose
front is gone stops.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from meshplan.serving.batching import Work
from meshplan.serving.engine import QueueFull, Stopping

# what the engine needs of a request's choice (the rest of ``Work`` is the engine's own or the front's)
SPEC_FIELDS = ("prompt", "max_tokens", "sampler", "ignore_eos", "logprobs", "echo", "adjust", "arrived")


def spec(work: Work) -> dict:
    return {name: getattr(work, name) for name in SPEC_FIELDS}


class _Sender:
    def __init__(self, connection):
        self.connection, self._lock = connection, threading.Lock()

    def send(self, message) -> bool:
        """False where the other end has gone."""
        with self._lock:
            try:
                self.connection.send(message)
                return True
            except (OSError, ValueError):
                return False


class EngineEnd(_Sender):
    """Rank 0's side: the front's messages to the engine (a thread that reads them), the
    engine's events out once a turn (``flush``)."""

    def __init__(self, engine, connection, metrics):
        super().__init__(connection)
        self.engine, self.metrics = engine, metrics
        self.works: dict[int, list[Work]] = {}
        self.outbox: list = []
        self.told_stopping = False
        self.sweep = False               # some request may have ended since the last turn
        self.gone = threading.Event()    # the front closed the connection, or the link failed
        self.failure: str | None = None  # what failed, where it did

    def start(self) -> None:
        threading.Thread(target=self._read, name="front-link", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                message = self.connection.recv()
                kind = message[0]
                if kind == "submit":
                    self._submit(message[1], message[2])
                elif kind == "cancel":
                    works = self.works.get(message[1])
                    if works is not None and message[2] < len(works):
                        self.engine.cancel(works[message[2]], message[3])
                        self.sweep = True
                elif kind == "metrics":
                    self.send(("metrics", message[1], self.metrics.text()))
        except (EOFError, OSError):
            pass
        except Exception as exc:   # (a message it cannot read: the server cannot go on as it should)
            self.failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.gone.set()
        self.engine.wake.set()

    def _submit(self, ident: int, specs: list[dict]) -> None:
        works = [Work(**one, emit=self._emitter(ident, index)) for index, one in enumerate(specs)]
        works[0].followers = works[1:]
        outcome = None
        try:
            self.engine.submit(works[0])
            self.works[ident] = works
        except QueueFull:
            outcome = "full"
        except Stopping:
            outcome = "stopping"
        self.send(("submitted", ident, outcome))

    def _emitter(self, ident: int, index: int):
        outbox = self.outbox

        def emit(event) -> None:
            outbox.append((ident, index, event))
        return emit

    def flush(self) -> None:
        """The events of the turn, in one message (the engine's thread, once a turn)."""
        if self.engine.stopping and not self.told_stopping:
            self.send(("stopping",))
            self.told_stopping = True
        if self.outbox:
            events, self.outbox[:] = list(self.outbox), []
            self.send(("events", events))
            self.sweep = True
        if self.sweep:   # requests that ended (or that the front ended) are no more the link's
            self.sweep = False
            for ident, works in list(self.works.items()):   # (the reader adds requests meanwhile)
                if all(w.finished is not None or w.cancelled for w in works):
                    self.works.pop(ident, None)

    def close(self) -> None:
        self.flush()
        self.send(("close",))


class EngineLink(_Sender):
    """The front's side: what ``app`` calls the engine (``submit``, awaited; ``cancel``;
    ``stopping``) and its metrics (``text``, awaited). A thread reads the engine's messages
    and hands each event to its request's ``Work.emit``."""

    def __init__(self, connection):
        super().__init__(connection)
        self.stopping = False
        self.closed = threading.Event()   # the engine said close, or its connection ended
        self._ids = itertools.count()
        self._works: dict[int, list[Work]] = {}
        self._answers: dict[int, tuple] = {}   # id → (loop, future)
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._read, name="engine-link", daemon=True).start()

    async def submit(self, work: Work) -> None:
        ident = next(self._ids)
        works = [work, *work.followers]
        for index, one in enumerate(works):
            one.link = (ident, index)
        with self._lock:
            self._works[ident] = works
        outcome = await self._ask(ident, ("submit", ident, [spec(w) for w in works]))
        if outcome is not None:
            with self._lock:
                self._works.pop(ident, None)
            raise QueueFull() if outcome == "full" else Stopping()

    def cancel(self, work: Work, reason: str = "cancelled") -> None:
        """The engine stops the choice; no event of it is awaited any more (the engine sends
        none for what the front ended)."""
        ident, index = work.link
        self.send(("cancel", ident, index, reason))
        work.finished = work.finished or reason
        self._forget(ident)

    def _forget(self, ident: int) -> None:
        """A request whose every choice has ended."""
        with self._lock:
            works = self._works.get(ident)
            if works is not None and all(w.finished is not None for w in works):
                del self._works[ident]

    async def text(self) -> bytes:
        """The engine's metrics, as Prometheus text."""
        ident = next(self._ids)
        return await self._ask(ident, ("metrics", ident))

    async def _ask(self, ident: int, message):
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._answers[ident] = (asyncio.get_running_loop(), future)
        if self.closed.is_set() or not self.send(message):
            self._answers.pop(ident, None)
            raise Stopping()
        return await future

    def _answer(self, ident: int, value) -> None:
        with self._lock:
            found = self._answers.pop(ident, None)
        if found is not None:
            _settle(*found, value)

    def _read(self) -> None:
        try:
            while True:
                message = self.connection.recv()
                kind = message[0]
                if kind == "events":
                    for ident, index, event in message[1]:
                        works = self._works.get(ident)
                        if works is None:
                            continue
                        works[index].emit(event)
                        if event[0] in ("done", "error"):
                            works[index].finished = event[1] if event[0] == "done" else "error"
                            self._forget(ident)
                elif kind in ("submitted", "metrics"):
                    self._answer(message[1], message[2])
                elif kind == "stopping":
                    self.stopping = True
                elif kind == "close":
                    break
        except (EOFError, OSError):
            pass
        self.stopping = True
        with self._lock:   # what the engine never answered: the job has ended
            answers, self._answers = list(self._answers.values()), {}
            works, self._works = [w for ws in self._works.values() for w in ws if w.finished is None], {}
        for loop, future in answers:
            _settle(loop, future, Stopping())
        for work in works:
            work.emit(("error", "the job ended", 500))
        self.closed.set()


def _settle(loop, future, value) -> None:
    """An awaited answer, on its loop's thread (an exception is raised there); dropped once
    that loop has closed."""
    def settle() -> None:
        if not future.done():
            (future.set_exception if isinstance(value, BaseException) else future.set_result)(value)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
