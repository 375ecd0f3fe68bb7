"""``meshplan serve`` on every rank: the resident job, and on rank 0 the HTTP server.

Every rank loads its program once (``Job``); the other ranks follow rank 0's calls
(``Job.serve``). Rank 0 checks the plan (a model that generates), binds the port before
any rank goes on (a port in use is one line, like any start-up error), makes a warm-up
call, then runs the engine on its main thread (the one that calls MPI) and starts the
HTTP front as a process of its own (``front``, over a ``link``), handing it the socket.
SIGTERM or SIGINT: no new request is taken, what runs finishes, what waits is
refused, and the job closes with exit 0; a second signal ends what runs at once (an
error for each). A failure of the engine, whatever raised it (a call of the job, a draw,
a bug), gives every request in flight and waiting an error, lets those answers go out,
and aborts the job (``JobFailure``: exit 1, every rank ended by the launcher); a rank
that dies has the launcher end the others, and the front ends with rank 0 (its link
closes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshplan.errors import RunError
from meshplan.generation.driver import JobStepper, Request, prepare, warm_up_steps
from meshplan.generation.sampling import Sampler
from meshplan.model.llm import ModelFolder
from meshplan.runtime.threads import ThreadChoice, rank_cores
from meshplan.serving.batching import SlotBatch, Work, batch_for
from meshplan.serving.chat import ChatTemplate
from meshplan.serving.front import START_SECONDS as HTTP_START_SECONDS

START_SECONDS = HTTP_START_SECONDS + 30   # the front must say it serves within this (its imports, its tokenizer)


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
    front_pid: int | None = None     # the HTTP front's process


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
        ChatTemplate.of_folder(folder.path)   # (one that cannot be read stops the start, on every rank)
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
    """Rank 0 after start-up: warm up, start the HTTP front's process, run the engine here."""
    from meshplan.runtime.job import as_failure, driving
    from meshplan.serving.engine import Engine
    from meshplan.serving.front import Front
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
    metrics = ServerMetrics()
    metrics.slots.set(batch.rows)
    for rank, row in enumerate(memory):
        metrics.weight_bytes.labels(str(rank)).set(int(row[1]))
        metrics.cache_bytes.labels(str(rank)).set(cache[rank] if rank < len(cache) else 0)
    engine = Engine(batch, prepared.eos, metrics, options.max_queue)
    cores = rank_cores(job.threads)
    front = Front(name, shape.context, shape.vocab, batch.rows,
                  str(folder.tokenizer) if folder.tokenizer is not None else None, str(folder.path),
                  sorted(cores) if cores else None)
    process, end = _start_front(front, sock, engine, metrics)
    stop, hurry, signals = threading.Event(), threading.Event(), []

    def on_signal(*_) -> None:   # the first: what runs finishes; a second: it ends now
        signals.append(1)
        stop.set()
        if len(signals) > 1:
            hurry.set()
        engine.wake.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def watch() -> None:   # a front that ends on its own stops the engine too
        end.gone.wait()
        stop.set()
        engine.wake.set()
    threading.Thread(target=watch, name="front-watch", daemon=True).start()
    host, port = sock.getsockname()[:2]
    if on_started is not None:
        on_started(Started(f"http://{host}:{port}", name, job.size, batch.rows, isinstance(batch, SlotBatch),
                           shape.context, time.perf_counter() - loading, [int(r[1]) for r in memory], cache,
                           list(pids), [ThreadChoice.from_row(r[2:]) if r[2] else None for r in memory],
                           process.pid))
    try:
        engine.run(stop, hurry, after=end.flush)
    except Exception as exc:   # every request has its error (``Engine.fail_all``): they go out, the job ends
        _stop_front(process, end)
        raise as_failure(exc) from exc
    except BaseException:
        _stop_front(process, end)
        raise
    front_ended = end.gone.is_set()
    _stop_front(process, end)
    job.close()
    if end.failure is not None:
        raise RunError(f"the link to the HTTP server failed: {end.failure}")
    if front_ended:
        raise RunError("the HTTP server stopped on its own")
    return 0


def _start_front(front, sock, engine, metrics):
    """The front's process, serving on ``sock``; once it says it has started, the engine's
    end of the link, reading."""
    from multiprocessing.connection import Connection

    import meshplan
    from meshplan.serving.link import EngineEnd

    ours, theirs = socket.socketpair()
    env = dict(os.environ)   # (meshplan importable where it was imported from, installed or not)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(meshplan.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    process = subprocess.Popen([sys.executable, "-m", "meshplan.serving.front", str(sock.fileno()),
                                str(theirs.fileno())], pass_fds=(sock.fileno(), theirs.fileno()), env=env,
                               stdin=subprocess.DEVNULL)
    theirs.close()
    connection = Connection(ours.detach())
    try:
        connection.send(asdict(front))
        if not connection.poll(START_SECONDS):
            raise RunError(f"the HTTP server did not start within {START_SECONDS} s")
        said = connection.recv()
    except (EOFError, OSError):
        said = ("failed", f"its process ended (exit status {process.wait(10)})")
    except RunError:
        _end(process)
        raise
    if said[0] != "started":
        _end(process)
        raise RunError(f"the HTTP server did not start: {said[1]}")
    end = EngineEnd(engine, connection, metrics)
    end.start()
    return process, end


def _stop_front(process, end) -> None:
    """The last events out, the front told to end; it has a few seconds to answer them."""
    end.close()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        _end(process)


def _end(process) -> None:
    process.kill()
    process.wait()


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
