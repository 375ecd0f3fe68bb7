"""``meshplan run`` under mpiexec, and what every driver of a job shares.

``run_rank`` is a driver of the resident job (``job.Job``): every rank loads its program
once, then rank 0 makes ``--repeat`` calls on one inputs file and writes the outputs once.
In each call a rank receives its stage's boundary tensors for every microbatch by
cross-mesh resharding (broadcasts and sends on group communicators), runs them in order
(fill-drain), performs the collectives inside its stage's mesh, and hands its outputs on —
all with mpi4py's buffer-based calls (never pickled objects). This module also holds the
start-up agreement, the mesh communicators, the transfer path and the trace writer.

Failure handling: start-up checks (plan, rank count, files, inputs) run on every rank
and the ranks agree on the outcome with one Allreduce, so all of them exit 1 and the
lowest failing rank reports; a failure after that aborts the whole job.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.errors import MeshplanError, RunError
from meshplan.plan_format import Plan
from meshplan.reshard.simulator import Schedule
from meshplan.reshard.steps import Step
from meshplan.reshard.tasks import CrossMeshTransfer
from meshplan.sharding import LogicalMesh
from meshplan.mpi_support import cuda_aware, load_mpi
from meshplan.process_memory import peak_rss_bytes
from meshplan.providers import CPU, CUDA, cuda_provider
from meshplan.runtime.buffers import HOST, DeviceBuffers
from meshplan.runtime.collectives import axis_communicator, perform
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder
from meshplan.runtime.tensors import read_inputs, write_outputs
from meshplan.runtime.threads import ThreadChoice


class ReportedElsewhere(MeshplanError):
    """Start-up failed on another rank, which reports it; this rank only exits 1."""


class JobFailure(RunError):
    """A rank failed after start-up: the whole job must be aborted."""


@dataclass
class RunReport:
    ranks: int
    provider: str
    transfer_path: str
    latencies: list[float]
    estimate_seconds: float
    batch_size: int
    trace_events: list[dict] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)   # per rank: the process's peak resident memory
    program_bytes: list[int] = field(default_factory=list)    # per rank: its program file and weights files
    idle_ranks: list[int] = field(default_factory=list)       # ranks the plan leaves idle (no program)
    threads: list = field(default_factory=list)               # per rank: its ThreadChoice (None: idle)

    def memory_rows(self) -> list[dict]:
        """Per rank: its peak resident set (host memory) next to its program's bytes."""
        return [{"rank": rank, "peak_rss_bytes": rss, "program_bytes": held, "idle": rank in self.idle_ranks}
                for rank, (rss, held) in enumerate(zip(self.peak_rss_bytes, self.program_bytes))]

    @property
    def median_latency(self) -> float:
        return statistics.median(self.latencies)


def _world():
    MPI = load_mpi()

    return MPI, MPI.COMM_WORLD


ABORT_GRACE_SECONDS = 0.5


def abort_job(code: int = 1) -> None:
    """End every rank of the job (after a rank has reported its failure). The launcher
    forwards each rank's output through its own pipes and stops forwarding when the abort
    kills the ranks, so this waits ``ABORT_GRACE_SECONDS`` first: once, on a loaded machine,
    a job ended 1 with nothing at all on stderr (the error line and MPICH's own lost)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_SECONDS)
    MPI, comm = _world()
    comm.Abort(code)


def _agree(comm, MPI, error: MeshplanError | None) -> None:
    """All ranks learn whether any failed; the lowest failing rank raises its own error."""
    flag = np.array([comm.rank if error is not None else comm.size], dtype=np.int64)
    first = np.empty_like(flag)
    comm.Allreduce(flag, first, op=MPI.MIN)
    if first[0] == comm.size:
        return
    if error is not None and first[0] == comm.rank:
        raise error
    raise ReportedElsewhere("start-up failed on another rank")



TRANSFERS = ("auto", "host", "device")


def choose_buffers(transfer: str, session_provider: str, device_id: int, MPI) -> tuple[object, str]:
    """Where this rank's tensors live and travel, and the sentence that says so.

    ``auto``: device memory when the programs run on CUDA and MPI is CUDA-aware, else
    host memory (CUDA outputs staged through the host). ``host``: always host memory.
    ``device``: OrtValues handed to MPI as they are; on CUDA that needs a CUDA-aware MPI
    (an error otherwise); with the CPU provider they sit in host memory.
    """
    if transfer not in TRANSFERS:
        raise RunError(f"unknown transfer path {transfer!r} (choose from {', '.join(TRANSFERS)})")
    on_cuda = session_provider == CUDA
    if not on_cuda:
        if transfer == "device":
            return DeviceBuffers("cpu", 0, [CPU]), "OrtValue buffers in host memory (CPU provider), passed to MPI by pointer"
        return HOST, "host memory (CPU provider)"
    if transfer == "host":
        return HOST, "host memory: CUDA outputs staged through the host (--transfer host)"
    aware = cuda_aware(MPI)
    if aware["value"]:
        buffers = DeviceBuffers("cuda", device_id, [cuda_provider(device_id), CPU])
        return buffers, f"device memory: CUDA buffers straight to CUDA-aware MPI ({aware['method']})"
    if transfer == "device":
        state = "is not CUDA-aware" if aware["value"] is False else "may not be CUDA-aware"
        raise RunError(f"--transfer device needs a CUDA-aware MPI; this one {state} ({aware['method']})",
                       hint="use --transfer auto or host to stage tensors through host memory")
    return HOST, f"host memory: CUDA outputs staged through the host (MPI not known to be CUDA-aware: {aware['method']})"


class MeshCommunicators:
    """One communicator per mesh axis of every stage, built once; ranks ordered by coordinate.

    Every rank takes part in every split (with MPI.UNDEFINED outside the stage), so all
    ranks must build this object together."""

    def __init__(self, plan: Plan, comm, MPI, buffers=HOST):
        self.MPI = MPI
        self.buffers = buffers
        self.axes: dict[int, object] = {}
        for stage in plan.stages:
            mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
            for axis in (0, 1, 2):
                group = axis_communicator(comm, MPI, mesh, axis)
                if group is not None:
                    self.axes[axis] = group

    def __call__(self, step: Step, array: np.ndarray) -> np.ndarray:
        return perform(step, array, self.axes[step.axis], self.MPI, self.buffers)

    def free(self) -> None:
        """Release the axis communicators (collective over each axis group)."""
        for group in self.axes.values():
            group.Free()
        self.axes = {}


def run_rank(plan_dir: str | Path, inputs_path: str | Path, output_path: str | Path | None,
             repeat: int = 1, provider: str = "auto", transfer: str = "auto") -> RunReport | None:
    """``meshplan run``: a driver of the resident job (``job.Job``) that makes ``repeat``
    calls on one inputs file and writes the outputs once. Rank 0 returns the report, the
    others None. State inputs in the file are set before every call (so each repetition is
    the same call); state outputs are gathered and written with the others."""
    from meshplan.runtime.job import Job

    plan_dir, inputs_path = Path(plan_dir), Path(inputs_path)
    output_path = Path(output_path) if output_path else None
    held: dict = {}

    def check(plan: Plan) -> None:
        if repeat < 1:
            raise RunError(f"--repeat must be at least 1, got {repeat}")
        held["inputs"] = read_inputs(inputs_path, plan)
        if output_path is not None:
            if output_path.suffix != ".npz":
                raise RunError(f"output file must end in .npz: {output_path}")
            if not output_path.parent.is_dir():
                raise RunError(f"output directory does not exist: {output_path.parent}")

    job = Job(plan_dir, provider, transfer, check=check)
    if not job.is_driver:
        job.serve()
        _gather_memory(job.plan, plan_dir, _world()[1], job.threads)
        return None
    plan = job.plan
    inputs = held["inputs"]
    state_given = {n: v for n, v in inputs.items() if n in job.state_inputs}
    latencies, outputs = [], {}
    try:
        for _ in range(repeat):
            if state_given:
                job.set_state(state_given)
            started = time.perf_counter()
            outputs = job.run({n: v for n, v in inputs.items() if n not in job.state_inputs})
            latencies.append(time.perf_counter() - started)
        stats = job.stats()
        if job.state_inputs:
            kept = job.get_state()
            outputs.update({entry["output"]: kept[entry["input"]] for entry in plan.state if entry["input"] in kept})
    except MeshplanError:
        job.close()
        raise
    job.close()
    memory = _gather_memory(plan, plan_dir, _world()[1], job.threads)
    if output_path is not None:
        write_outputs(output_path, {spec.name: outputs[spec.name] for spec in plan.outputs if spec.name in outputs})
    return RunReport(
        ranks=job.size, provider=job.provider, transfer_path=job.transfer_path,
        latencies=latencies, estimate_seconds=plan.estimate["latency_seconds"],
        batch_size=_batch_of(plan, inputs), trace_events=stats.trace,
        peak_rss_bytes=[int(m) for m in memory[:, 0]], program_bytes=[int(m) for m in memory[:, 1]],
        idle_ranks=plan.idle_ranks,
        threads=[ThreadChoice.from_row(row[2:]) if row[2] else None for row in memory],
    )


def _batch_of(plan: Plan, inputs: dict) -> int:
    """The batch the call ran: the plan's, or in a ranged plan the size of its batch dim."""
    dim = plan.batch.get("dim")
    if plan.is_ranged and dim:
        for spec in plan.inputs:
            if dim in spec.shape and spec.name in inputs:
                return int(np.shape(inputs[spec.name])[spec.shape.index(dim)])
    return plan.batch["size"]


def _resharders(plan: Plan, comm, buffers) -> list[CrossMeshResharder]:
    """One executor per cross-mesh resharding, built by every rank in plan order (collective)."""
    return [
        CrossMeshResharder(CrossMeshTransfer.from_dict(r.transfer), Schedule.from_dict(r.schedule), comm,
                           dtype=np.dtype(r.dtype), buffers=buffers)
        for r in plan.reshardings
    ]


def _gather_memory(plan: Plan, plan_dir: Path, comm, threads=None) -> np.ndarray | None:
    """[peak RSS, program bytes, *its ThreadChoice.row() (zeros on an idle rank)] of every
    rank, on rank 0 (a [ranks, 7] array; None elsewhere)."""
    program = plan.program_of_rank(comm.rank)   # None on an idle rank
    held = 0 if program is None else sum((plan_dir / f).stat().st_size
                                         for f in [program.file] + [d["file"] for d in program.data_files])
    mine = np.array([peak_rss_bytes(), held, *(threads.row() if threads is not None else [0] * 5)], dtype=np.int64)
    everyone = np.empty((comm.size, mine.size), dtype=np.int64) if comm.rank == 0 else None
    comm.Gather(mine, everyone, root=0)
    return everyone




def write_trace(path: str | Path, events: list[dict], ranks: int, memory: list[dict] | None = None) -> None:
    """Chrome trace format (opens in Perfetto or chrome://tracing); one process per rank,
    its metadata also giving the rank's peak RSS and program bytes where ``memory`` has them
    (``RunReport.memory_rows``)."""
    from meshplan.files import atomic_write_bytes

    extra = {row["rank"]: {k: v for k, v in row.items() if k != "rank"} for row in memory or []}
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}", **extra.get(r, {})}}
            for r in range(ranks)]
    body = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    atomic_write_bytes(Path(path), json.dumps(body).encode())
