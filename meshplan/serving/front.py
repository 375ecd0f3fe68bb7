"""``meshplan serve``'s HTTP front: a process of its own beside rank 0's engine (``link``).

Rank 0 starts it once the job is warm (``python -m meshplan.serving.front LISTEN_FD
LINK_FD``), handing it the listening socket it bound and one end of the link, and sends
what it serves first (``Front``: the model's name and limits, where its tokenizer and
chat template are, the rank's cores, as a dict). The front reads request bodies, renders chat
templates, tokenizes, turns the engine's token ids into text and streams responses; it
answers ``("started",)``, or ``("failed", line)`` where it cannot start. Signals are the
engine's to decide on: the front ignores SIGINT and SIGTERM and ends when the engine
closes the link (or its connection ends: the job is gone), once the last events have
reached their responses.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

START_SECONDS = 30      # the HTTP server must be up within this


@dataclass
class Front:
    """What rank 0 tells the front it serves."""

    model: str
    context: int
    vocab: int | None
    slots: int
    tokenizer: str | None      # tokenizer.json, where the model folder has one
    folder: str                # the model folder (its chat template)
    cpus: list[int] | None     # the rank's cores (its engine's thread is pinned to one of them)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    listen_fd, link_fd = int(argv[0]), int(argv[1])
    connection = Connection(link_fd)
    try:
        front = Front(**connection.recv())
    except (EOFError, OSError):
        return 1
    try:
        server, thread, link = _start(front, socket.socket(fileno=listen_fd), connection)
    except Exception as exc:   # one line back to rank 0, which says it
        try:
            connection.send(("failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
        except OSError:
            pass
        return 1
    while not link.closed.wait(0.2) and thread.is_alive():
        pass    # (an HTTP server that ends on its own closes the link: the engine stops)
    time.sleep(0.05)    # the last events reach their responses
    server.should_exit = True
    thread.join(10)
    connection.close()
    return 0


def _start(front: Front, sock: socket.socket, connection: Connection):
    import uvicorn

    from meshplan.generation.driver import load_tokenizer
    from meshplan.serving.app import build_app
    from meshplan.serving.chat import ChatTemplate
    from meshplan.serving.link import EngineLink
    from meshplan.serving.protocol import Limits

    if front.cpus:
        try:
            os.sched_setaffinity(0, front.cpus)
        except OSError:
            pass
    tokenizer = load_tokenizer(front.tokenizer) if front.tokenizer else None
    limits = Limits(front.model, front.context, front.vocab, tokenizer, ChatTemplate.of_folder(Path(front.folder)),
                    front.slots)
    link = EngineLink(connection)
    server = uvicorn.Server(uvicorn.Config(build_app(link, limits, link), log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=5))
    # on a thread: uvicorn takes the main thread's signals, which are the engine's to decide on
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    thread.start()
    began = time.monotonic()
    while not server.started and thread.is_alive() and time.monotonic() - began < START_SECONDS:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("the HTTP server did not start")
    link.start()
    link.send(("started",))
    return server, thread, link


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
