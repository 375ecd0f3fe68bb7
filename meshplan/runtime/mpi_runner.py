"""The per-rank executor under mpiexec.

Each rank loads its own program, receives its stage's boundary tensors for every
microbatch by cross-mesh resharding (broadcasts and sends on group communicators),
runs them in order (fill-drain), performs the collectives inside its stage's mesh, and
hands its outputs on — all with mpi4py's buffer-based calls (never pickled objects).
Rank 0 also collects the model outputs and writes them once.

Failure handling: start-up checks (plan, rank count, files, inputs) run on every rank
and the ranks agree on the outcome with one Allreduce, so all of them exit 1 and the
lowest failing rank reports; a failure after that aborts the whole job.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.errors import MeshplanError, RunError
from meshplan.plan_format import OUTPUT_COLLECTOR, Plan, local_name, read_plan, require_programs
from meshplan.reshard.simulator import Schedule
from meshplan.reshard.steps import Step
from meshplan.reshard.tasks import CrossMeshTransfer
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.mpi_support import cuda_aware, load_mpi
from meshplan.process_memory import peak_rss_bytes
from meshplan.rank_layout import RankLayout, gather_layout, launch_advice, layout_mismatch
from meshplan.providers import CPU, CUDA, cuda_device_count, cuda_provider, cuda_usable
from meshplan.runtime.buffers import HOST, DeviceBuffers, byte_view
from meshplan.runtime.collectives import axis_communicator, perform
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder
from meshplan.runtime.program import ProgramRunner
from meshplan.runtime.sessions import check_program_files, providers_for
from meshplan.runtime.waiting import set_sleeping, wait_all
from meshplan.runtime.tensors import join_microbatches, read_inputs, split_microbatches, write_outputs


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

    def memory_rows(self) -> list[dict]:
        """Per rank: its peak resident set (host memory) next to its program's bytes."""
        return [{"rank": rank, "peak_rss_bytes": rss, "program_bytes": held}
                for rank, (rss, held) in enumerate(zip(self.peak_rss_bytes, self.program_bytes))]

    @property
    def median_latency(self) -> float:
        return statistics.median(self.latencies)


def _world():
    MPI = load_mpi()

    return MPI, MPI.COMM_WORLD


def abort_job(code: int = 1) -> None:
    """End every rank of the job (after a rank has reported its failure)."""
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


def _start(plan_dir: Path, inputs_path: Path, output_path: Path | None, provider: str, transfer: str,
           layout: RankLayout, comm, MPI):
    """This rank's start-up checks and session. No collective calls in here: a rank that
    fails part-way must still reach the agreement in ``_agree``."""
    plan = read_plan(plan_dir)
    require_programs(plan, plan_dir)
    if comm.size != plan.num_ranks:
        raise RunError(
            f"the plan needs {plan.num_ranks} ranks but the job has {comm.size}",
            hint=f"start it as mpiexec -n {plan.num_ranks} meshplan run ...",
        )
    hosts, per_host = plan.cluster["mesh"]
    mismatch = layout_mismatch(layout, hosts, per_host)
    if mismatch:
        raise RunError(mismatch, hint=launch_advice(per_host))
    program = plan.program_of_rank(comm.rank)
    path = check_program_files(plan, plan_dir, program)
    inputs = read_inputs(inputs_path, plan)
    if comm.rank == 0 and output_path is not None:
        if output_path.suffix != ".npz":
            raise RunError(f"output file must end in .npz: {output_path}")
        if not output_path.parent.is_dir():
            raise RunError(f"output directory does not exist: {output_path.parent}")
    threads = max(1, (os.cpu_count() or 1) // layout.local_size)
    device_id = layout.local_rank % cuda_device_count() if provider != "cpu" and cuda_usable() else 0
    session = ProgramRunner(path, providers_for(provider, device_id), threads=threads)
    buffers, path_text = choose_buffers(transfer, session.providers[0], device_id, MPI)
    set_sleeping(session.providers[0] != CUDA)   # GPU ranks leave the cores free: keep MPI progressing
    return plan, session, split_microbatches(inputs, plan), buffers, path_text


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
    """Run this rank's part of the plan; rank 0 returns the report, the others None."""
    MPI, comm = _world()
    plan_dir, inputs_path = Path(plan_dir), Path(inputs_path)
    output_path = Path(output_path) if output_path else None
    layout = gather_layout(comm, MPI)  # collective: every rank, before anything can fail
    error = None
    try:
        if repeat < 1:
            raise RunError(f"--repeat must be at least 1, got {repeat}")
        plan, session, micro_inputs, buffers, path_text = _start(plan_dir, inputs_path, output_path, provider, transfer,
                                                                 layout, comm, MPI)
    except MeshplanError as exc:
        error = exc
    except Exception as exc:  # anything else must still reach the agreement, or the others wait forever
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        error = RunError(f"rank {comm.rank} could not start: {text}")
    _agree(comm, MPI, error)
    try:
        communicators = MeshCommunicators(plan, comm, MPI, buffers)
        resharders = _resharders(plan, comm, buffers)
        report = _run_started(plan, session, micro_inputs, output_path, repeat, comm, MPI, communicators, resharders,
                              buffers)
        memory = _gather_memory(plan, plan_dir, comm)
        if report is not None:
            report.peak_rss_bytes = [int(m) for m in memory[:, 0]]
            report.program_bytes = [int(m) for m in memory[:, 1]]
        # MPI has a bounded number of communicators: a process that runs plan after plan
        # must hand them back (every rank reaches here together; a failed run aborts the job).
        communicators.free()
        for resharder in resharders:
            resharder.free()
        if report is not None:
            report.transfer_path = path_text
        return report
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise JobFailure(f"rank {comm.rank} failed: {text}") from exc


def _resharders(plan: Plan, comm, buffers) -> list[CrossMeshResharder]:
    """One executor per cross-mesh resharding, built by every rank in plan order (collective)."""
    return [
        CrossMeshResharder(CrossMeshTransfer.from_dict(r.transfer), Schedule.from_dict(r.schedule), comm,
                           dtype=np.dtype(r.dtype), buffers=buffers)
        for r in plan.reshardings
    ]


def _run_started(plan: Plan, session: ProgramRunner, micro_inputs, output_path, repeat, comm, MPI, communicators,
                 resharders, buffers):
    """Fill-drain over microbatches. Per microbatch a rank takes part in the reshardings
    that bring its stage's inputs (in plan order), runs its program, then in those that
    hand its outputs on (in plan order): every rank follows the same global order, stages
    only wait on earlier stages, so the blocking exchanges cannot deadlock."""
    rank = comm.rank
    stage = plan.stage_of_rank(rank)
    B = plan.microbatches
    arriving = [(r, x) for r, x in zip(plan.reshardings, resharders) if r.dst_stage == stage.index]
    leaving = [(r, x) for r, x in zip(plan.reshardings, resharders) if r.src_stage == stage.index]
    incoming = [(i, t) for i, t in enumerate(plan.transfers)
                if t.dst_rank == rank and t.src_rank != rank and t.dst_stage == OUTPUT_COLLECTOR]
    whole = [(i, t) for i, t in enumerate(plan.transfers) if t.dst_rank == rank and t.dst_stage == stage.index]
    outgoing = [(i, t) for i, t in enumerate(plan.transfers) if t.src_rank == rank and t.dst_rank != rank]
    local_outputs = [t for t in plan.transfers if t.dst_stage == OUTPUT_COLLECTOR and t.src_rank == rank == t.dst_rank]
    shape_tag = len(plan.transfers)
    trace: list[dict] = []
    latencies = []
    results: list[dict[str, np.ndarray]] = []
    for iteration in range(repeat):
        wait_all([comm.Ibarrier()], MPI)
        origin = MPI.Wtime()
        received = {(i, mb): np.empty(t.shape, dtype=t.dtype) for i, t in incoming if not t.is_dynamic
                    for mb in range(B)}
        requests = {key: comm.Irecv(byte_view(buf), source=plan.transfers[key[0]].src_rank, tag=key[0])
                    for key, buf in received.items()}
        # a data-dependent output: its shape comes first, on its own tag
        shapes = {(i, mb): np.empty(len(t.shape), dtype=np.int64) for i, t in incoming if t.is_dynamic
                  for mb in range(B)}
        shape_requests = [comm.Irecv(buf, source=plan.transfers[i].src_rank, tag=shape_tag + i)
                          for (i, _), buf in shapes.items()]
        sends, sent = [], []
        results = [dict() for _ in range(B)]
        for mb in range(B):
            feeds = {}
            waited = MPI.Wtime()
            for r, resharder in arriving:
                feeds[local_name(r.tensor, ShardingSpec.parse(r.dst_spec))] = resharder.run(None)
            for i, t in whole:   # a data-dependent tensor from an earlier stage: its shape, then it
                shape = t.shape
                if t.is_dynamic:
                    shape = np.empty(len(t.shape), dtype=np.int64)
                    comm.Recv(shape, source=t.src_rank, tag=shape_tag + i)
                value = np.empty(tuple(int(d) for d in shape), dtype=t.dtype)
                comm.Recv(byte_view(value), source=t.src_rank, tag=i)
                feeds[t.tensor] = buffers.from_host(value)
            for name in stage.inputs:
                if name in micro_inputs[mb]:   # model inputs: every rank reads them (replicated)
                    feeds[name] = buffers.from_host(micro_inputs[mb][name])
            started = MPI.Wtime()
            outs = session.run(feeds, communicators, buffers)
            finished = MPI.Wtime()
            if iteration == repeat - 1:
                if started - waited > 1e-5:
                    trace.append(_event("wait", rank, waited - origin, started - waited, mb))
                trace.append(_event(f"stage {stage.index}", rank, started - origin, finished - started, mb))
            for r, resharder in leaving:
                resharder.run(outs[local_name(r.tensor, ShardingSpec.parse(r.src_spec))])
            for i, t in outgoing:
                data = np.ascontiguousarray(buffers.to_host(outs[t.tensor]))
                if t.is_dynamic:
                    sent.append(np.array(data.shape, dtype=np.int64))
                    sends.append(comm.Isend(sent[-1], dest=t.dst_rank, tag=shape_tag + i))
                sent.append(data)
                sends.append(comm.Isend(byte_view(data), dest=t.dst_rank, tag=i))
            for t in local_outputs:
                results[mb][t.tensor] = buffers.to_host(outs[t.tensor])
        collected = [requests[(i, mb)] for i, t in incoming if t.dst_stage == OUTPUT_COLLECTOR and not t.is_dynamic
                     for mb in range(B)]
        wait_all(collected + shape_requests + sends, MPI)
        for (i, mb), shape in shapes.items():   # in microbatch order, as they were sent
            received[(i, mb)] = np.empty(tuple(int(d) for d in shape), dtype=plan.transfers[i].dtype)
            comm.Recv(byte_view(received[(i, mb)]), source=plan.transfers[i].src_rank, tag=i)
        for i, t in incoming:
            if t.dst_stage == OUTPUT_COLLECTOR:
                for mb in range(B):
                    results[mb][t.tensor] = received[(i, mb)]
        wait_all([comm.Ibarrier()], MPI)
        latencies.append(MPI.Wtime() - origin)
    events = _gather_trace(trace, comm, MPI)
    if rank != 0:
        return None
    if output_path is not None:
        write_outputs(output_path, join_microbatches(results, plan))
    return RunReport(
        ranks=comm.size, provider=session.providers[0], transfer_path="",
        latencies=latencies, estimate_seconds=plan.estimate["latency_seconds"],
        batch_size=plan.batch["size"], trace_events=events,
    )


def _gather_memory(plan: Plan, plan_dir: Path, comm) -> np.ndarray | None:
    """[peak RSS, program bytes] of every rank, on rank 0 (a [ranks, 2] array; None elsewhere)."""
    program = plan.program_of_rank(comm.rank)
    held = sum((plan_dir / f).stat().st_size for f in [program.file] + [d["file"] for d in program.data_files])
    mine = np.array([peak_rss_bytes(), held], dtype=np.int64)
    everyone = np.empty((comm.size, 2), dtype=np.int64) if comm.rank == 0 else None
    comm.Gather(mine, everyone, root=0)
    return everyone


def _event(name: str, rank: int, start: float, duration: float, mb: int) -> dict:
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6, "dur": duration * 1e6,
            "args": {"microbatch": mb}}


def _gather_trace(events: list[dict], comm, MPI) -> list[dict]:
    """Collect every rank's events on rank 0 as bytes (Gatherv on a byte buffer)."""
    payload = np.frombuffer(json.dumps(events).encode(), dtype=np.uint8)
    counts = np.zeros(comm.size, dtype=np.int64) if comm.rank == 0 else None
    comm.Gather(np.array([len(payload)], dtype=np.int64), counts, root=0)
    if comm.rank == 0:
        received = np.empty(int(counts.sum()), dtype=np.uint8)
        comm.Gatherv(payload, [received, counts, MPI.BYTE], root=0)
        merged, offset = [], 0
        for count in counts:
            merged.extend(json.loads(received[offset:offset + count].tobytes() or b"[]"))
            offset += count
        return merged
    comm.Gatherv(payload, None, root=0)
    return []


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
