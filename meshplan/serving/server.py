"""``meshplan serve`` on every rank: the resident job, and on rank 0 the HTTP server.

Every rank loads its program once (``Job``); the other ranks follow rank 0's calls
(``Job.serve``). Rank 0 checks the plan (a model that generates), binds the port before
any rank goes on (a port in use is one line, like any start-up error), makes a warm-up
call, then runs the engine on its main thread (the one that calls MPI) and uvicorn on
another. SIGTERM or SIGINT: no new request is taken, what runs finishes, what waits is
refused, and the job closes with exit 0; a second signal ends what runs at once (an
error for each). A failure of the engine, whatever raised it (a call of the job, a draw,
a bug), gives every request in flight and waiting an error, lets those answers go out,
and aborts the job (``JobFailure``: exit 1, every rank ended by the launcher); a rank
that dies has the launcher end the others.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshplan.errors import RunError
from meshplan.generation.driver import JobStepper, Request, prepare, warm_up_steps
from meshplan.generation.sampling import Sampler
from meshplan.model.llm import ModelFolder
from meshplan.runtime.threads import ThreadChoice, unpin_calling_thread
from meshplan.serving.batching import SlotBatch, Work, batch_for
from meshplan.serving.chat import ChatTemplate
from meshplan.serving.protocol import Limits

START_SECONDS = 30      # the HTTP server must be up within this


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    model_name: str | None = None
    prefill_chunk: int | None = None   # prompt positions per call (None: the plan's longest call)
    provider: str = "auto"
    transfer: str = "auto"
    cuda_graph: bool = True            # on CUDA: decode steps replayed as CUDA graphs
    prefix_cache: bool = True          # reuse cached positions of a prompt's beginning (``batching``)


@dataclass
class Started:
    """What rank 0 says once the server listens."""

    url: str
    model: str
    ranks: int
    slots: int
    continuous: bool
    context: int
    load_seconds: float
    weight_bytes: list[int] = field(default_factory=list)
    cache_bytes: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    threads: list = field(default_factory=list)


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise RunError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise RunError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                       hint="choose another --port" if exc.errno in (98, 48) else None) from None
    sock.set_inheritable(False)
    return sock


def serve_rank(plan_dir: str | Path, options: Options, on_started=None) -> int | None:
    """Every rank: serve until stopped. Rank 0 returns the exit status (0 after a stop by
    signal) and calls ``on_started(Started)`` once it listens; the others return None."""
    from meshplan.runtime.job import Job
    from meshplan.runtime.mpi_runner import _gather_memory
    from meshplan.runtime.transport import world

    plan_dir = Path(plan_dir)
    held: dict = {}
    loading = time.perf_counter()

    def check(plan) -> None:
        if options.max_queue < 1:
            raise RunError(f"--max-queue must be at least 1, got {options.max_queue}")
        prepared = prepare(plan, Request(ids=[[0]], max_new_tokens=1))
        if options.prefill_chunk is not None and not 1 <= options.prefill_chunk <= prepared.shape.chunk:
            raise RunError(f"--prefill-chunk must be from 1 to the plan's longest call ({prepared.shape.chunk}), "
                           f"got {options.prefill_chunk}")
        folder = ModelFolder.read(plan.model["path"])
        held["prepared"], held["folder"] = prepared, folder
        held["chat"] = ChatTemplate.of_folder(folder.path)
        held["socket"] = _listen(options.host, options.port)

    job = Job(plan_dir, options.provider, options.transfer, check=check, cache_in_place=True,
              graphs=options.cuda_graph, choose=None)
    comm = world()[1]
    memory = _gather_memory(job.plan, plan_dir, comm, job.threads)
    pids = comm.gather(os.getpid(), root=0)
    if not job.is_driver:
        # a signal to the launcher reaches every rank: rank 0 decides when the job ends (it
        # finishes what runs, then closes the job, and this rank with it)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        job.serve()
        return None
    sock = held["socket"]
    try:
        return _drive(job, held, options, sock, loading, memory, pids, on_started)
    finally:
        sock.close()


def _drive(job, held: dict, options: Options, sock, loading: float, memory, pids: list[int], on_started) -> int:
    """Rank 0 after start-up: warm up, serve HTTP on another thread, run the engine here."""
    import uvicorn

    from meshplan.runtime.job import as_failure, driving
    from meshplan.serving.app import build_app
    from meshplan.serving.engine import Engine
    from meshplan.serving.metrics import ServerMetrics

    prepared, folder = held["prepared"], held["folder"]
    shape = prepared.shape
    stepper = JobStepper(job)
    with driving(job):
        batch = batch_for(shape, stepper, prepared.pad_id, options.prefill_chunk, options.prefix_cache)
        # (a two-token prompt and its steps must fit the cache, as a request's must)
        _warm_up(batch, prepared.pad_id, max(1, min(warm_up_steps(job, options.cuda_graph), shape.context - 3)))
        cache = [int(b) for b in job.stats().state_bytes]
    model_file = Path(job.plan.model["path"])
    name = options.model_name or (folder.path.name if model_file.name == "model.onnx" else model_file.stem)
    limits = Limits(name, shape.context, shape.vocab, prepared.tokenizer, held["chat"], batch.rows)
    metrics = ServerMetrics()
    metrics.slots.set(batch.rows)
    for rank, row in enumerate(memory):
        metrics.weight_bytes.labels(str(rank)).set(int(row[1]))
        metrics.cache_bytes.labels(str(rank)).set(cache[rank] if rank < len(cache) else 0)
    engine = Engine(batch, prepared.tokenizer, prepared.eos, metrics, options.max_queue)
    app = build_app(engine, limits, metrics)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5))
    def http() -> None:   # on every core of the rank, not the one its engine's thread is pinned to
        unpin_calling_thread(job.threads)
        server.run(sockets=[sock])
    thread = threading.Thread(target=http, name="http", daemon=True)
    thread.start()
    began = time.monotonic()
    while not server.started and thread.is_alive() and time.monotonic() - began < START_SECONDS:
        time.sleep(0.01)
    if not server.started:
        job.close()
        raise RunError("the HTTP server did not start")
    stop, hurry, signals = threading.Event(), threading.Event(), []

    def on_signal(*_) -> None:   # the first: what runs finishes; a second: it ends now
        signals.append(1)
        stop.set()
        if len(signals) > 1:
            hurry.set()
        engine.wake.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    http_ended = threading.Event()

    def watch() -> None:   # an HTTP server that ends on its own stops the engine too
        thread.join()
        if not stop.is_set():
            http_ended.set()
            stop.set()
            engine.wake.set()
    threading.Thread(target=watch, name="http-watch", daemon=True).start()
    host, port = sock.getsockname()[:2]
    if on_started is not None:
        on_started(Started(f"http://{host}:{port}", name, job.size, batch.rows, isinstance(batch, SlotBatch),
                           shape.context, time.perf_counter() - loading, [int(r[1]) for r in memory], cache,
                           list(pids), [ThreadChoice.from_row(r[2:]) if r[2] else None for r in memory]))
    try:
        engine.run(stop, hurry)
    except Exception as exc:   # every request has its error (``Engine.fail_all``): they go out, the job ends
        _stop_http(server, thread)
        raise as_failure(exc) from exc
    except BaseException:
        _stop_http(server, thread)
        raise
    _stop_http(server, thread)
    job.close()
    if http_ended.is_set():
        raise RunError("the HTTP server stopped on its own")
    return 0


def _stop_http(server, thread) -> None:
    time.sleep(0.05)    # the last events reach their responses
    server.should_exit = True
    thread.join(10)


def _warm_up(batch, pad_id: int, steps: int = 1) -> None:
    """A prefill and ``steps`` decode steps in every slot, so that a request's first token is
    not the process's start-up (kernels, the allocator's first blocks, a decode step's CUDA
    graph)."""
    works = []
    tokens = 1 + steps
    while batch.accepts():
        work = Work([pad_id, pad_id], tokens, Sampler())
        batch.admit(work)
        works.append(work)
    while any(len(w.ids) < tokens for w in works):
        for work, token in batch.step():
            work.ids.append(token)
    for work in works:
        batch.release(work)
