"""How bytes travel between the ranks of a job: the one place that calls MPI for tensors.

``Transport`` is built once per rank when a job starts (collectively: every rank builds it
in the same order) and holds every communicator the plan needs: one per mesh axis of every
stage (``collective``), one executor per cross-mesh resharding (``reshard``), one broadcast
group per model input (``bcast_input``), and the job's own communicator for whole tensors
between two ranks (data-dependent transfers, outputs to rank 0, state pieces), the call
header and the statistics. The job says *what* moves; the transport moves it. Its parts:
``collectives`` (a mesh-axis step), ``cross_mesh_mpi`` (a resharding's schedule) and
``waiting`` (waits that yield the core).

Where a tensor lives while it travels is the buffers' business (``buffers``): host memory
(numpy arrays; CUDA outputs staged through the host), or device memory handed to a
CUDA-aware MPI. ``choose_buffers`` decides it from the provider and the MPI. A transport
over another library (NCCL for ranks on distinct GPUs) is another class with these
methods; the in-process executors use ``inprocess.in_memory_exchange`` and
``cross_mesh_mpi.reshard_in_memory``, the same data movement in memory.

Start-up (``world``, ``agree``) and the end of a failed job (``abort_job``) are here too:
they are how the ranks of one job talk before and after it has tensors to move.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from meshplan.errors import MeshplanError, ReportedElsewhere, RunError
from meshplan.mpi_support import cuda_aware, load_mpi
from meshplan.plan_format import Plan
from meshplan.providers import CPU, CUDA, cuda_provider
from meshplan.reshard.simulator import Schedule
from meshplan.reshard.steps import Step
from meshplan.reshard.tasks import CrossMeshTransfer
from meshplan.runtime.buffers import HOST, DeviceBuffers, byte_view
from meshplan.runtime.collectives import AxisGroup, axis_communicator
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder
from meshplan.runtime.waiting import wait_all
from meshplan.sharding import LogicalMesh

_HEADER_TAG = 1 << 23     # a header sent to an idle rank on its own


def world():
    """mpi4py's MPI module and COMM_WORLD."""
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
    MPI, comm = world()
    comm.Abort(code)


def agree(comm, MPI, error: MeshplanError | None) -> None:
    """All ranks learn whether any failed; the lowest failing rank raises its own error."""
    flag = np.array([comm.rank if error is not None else comm.size], dtype=np.int64)
    first = np.empty_like(flag)
    comm.Allreduce(flag, first, op=MPI.MIN)
    if first[0] == comm.size:
        return
    if error is not None and first[0] == comm.rank:
        raise error
    raise ReportedElsewhere("start-up failed on another rank")


def gather_rows(comm, row: np.ndarray) -> np.ndarray | None:
    """Every rank's int64 ``row`` (all of one length) on rank 0, a [ranks, length] array;
    None elsewhere."""
    row = np.ascontiguousarray(row, dtype=np.int64)
    everyone = np.empty((comm.size, row.size), dtype=np.int64) if comm.rank == 0 else None
    comm.Gather(row, everyone, root=0)
    return everyone


TRANSFERS = ("auto", "host", "device")


def choose_buffers(transfer: str, session_provider: str, device_id: int, MPI, alone: bool = False) -> tuple[object, str]:
    """How this rank's tensors travel, and the sentence that says so.

    ``auto``: device memory when the programs run on CUDA and MPI is CUDA-aware, else
    host memory (what crosses ranks is staged through the host; the job keeps the rest on
    the GPU: ``Job(on_device=...)``). ``host``: always host memory. ``device``: OrtValues
    handed to MPI as they are; on CUDA that needs a CUDA-aware MPI (an error otherwise)
    unless the job is one rank (``alone``: nothing crosses); with the CPU provider they sit
    in host memory.
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
    if transfer == "device" and alone:
        buffers = DeviceBuffers("cuda", device_id, [cuda_provider(device_id), CPU])
        return buffers, "device memory (a job of one rank: nothing crosses to MPI)"
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
        self.groups = {axis: AxisGroup(group, MPI, buffers) for axis, group in self.axes.items()}

    def __call__(self, step: Step, array: np.ndarray, spare: bool = False) -> np.ndarray:
        return step.kind.perform(step, array, self.groups[step.axis], spare)   # (``collectives.perform``)

    def free(self) -> None:
        """Release the axis communicators (collective over each axis group)."""
        for group in self.axes.values():
            group.Free()
        self.axes, self.groups = {}, {}


class Transport:
    """Every communicator of one rank's part in a job (see the module); built collectively."""

    def __init__(self, plan: Plan, comm, MPI, buffers=HOST, inputs: list[str] | None = None):
        """``inputs``: the model inputs a call broadcasts, in the order ``bcast_input``
        numbers them (default: all of the plan's)."""
        self.MPI, self.buffers = MPI, buffers
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.axes = MeshCommunicators(plan, self.comm, MPI, buffers)
        self.resharders = [
            CrossMeshResharder(CrossMeshTransfer.from_dict(r.transfer), Schedule.from_dict(r.schedule), self.comm,
                               dtype=np.dtype(r.dtype), buffers=buffers)
            for r in plan.reshardings
        ]
        # one broadcast group per model input: rank 0 and the ranks whose stage reads it
        self.input_groups = []
        for name in inputs if inputs is not None else [t.name for t in plan.inputs]:
            readers = {r for s in plan.stages if name in s.inputs for r in s.devices} | {0}
            group = self.comm.Split(0 if self.rank in readers else MPI.UNDEFINED, self.rank)
            self.input_groups.append(group if self.rank in readers else None)
        self.input_sizes = [g.Get_size() if g is not None else 0 for g in self.input_groups]
        # the ranks a call's header reaches: rank 0 and the ranks of some stage; the plan's idle
        # ranks hear only of what they take part in (``header(everyone=True)``: the statistics,
        # the end), one message each, and sleep in between
        working = {r for s in plan.stages for r in s.devices} | {0}
        self.idle = [r for r in range(self.size) if r not in working]
        self.is_idle = self.rank in self.idle
        if self.idle:
            group = self.comm.Split(MPI.UNDEFINED if self.is_idle else 0, self.rank)
            self.headers = None if self.is_idle else group
        else:
            self.headers = self.comm
        self._posted: list = []    # sends in flight
        self._kept: list = []      # the arrays they read, alive until they are done

    # --- the call ------------------------------------------------------------------------------

    def header(self, header: np.ndarray, everyone: bool = False) -> None:
        """The call's header from rank 0 to the working ranks, and to the idle ones too where
        ``everyone`` (rank 0 says so; a call they take part in), waited for without holding a
        core (``waiting``): workers wait here between calls. An idle rank waits here all the
        time and sleeps while it does (``idle=True``): a call it takes no part in never wakes
        it, so it takes no core from the ranks that work beside it. A job of one rank has no
        one to tell."""
        if self.size == 1:
            return
        if self.is_idle:
            wait_all([self.comm.Irecv(header, source=0, tag=_HEADER_TAG)], self.MPI, idle=True)
            return
        requests = [self.headers.Ibcast(header, root=0)] if self.headers.Get_size() > 1 else []
        if everyone and self.rank == 0:
            requests += [self.comm.Isend(header, dest=r, tag=_HEADER_TAG) for r in self.idle]
        wait_all(requests, self.MPI)

    def reads_input(self, index: int) -> bool:
        """Whether this rank takes part in model input ``index``'s broadcast."""
        return self.input_groups[index] is not None

    def bcast_input(self, index: int, array: np.ndarray | None, shape: tuple, dtype) -> tuple[np.ndarray, int]:
        """Model input ``index`` from rank 0 (``array``) to the ranks that read it; returns
        the array and the bytes rank 0 sent."""
        group = self.input_groups[index]
        if array is None:
            array = np.empty(shape, dtype=dtype)
        if self.input_sizes[index] == 1:
            return array, 0
        if np.dtype(dtype) == np.dtype(object):
            array, sent = _bcast_strings(group, array if self.rank == 0 else None, shape)
        else:
            group.Bcast(byte_view(array), root=0)
            sent = array.nbytes
        return array, sent * (group.Get_size() - 1)

    def collective(self, step: Step, tensor, spare: bool = False):
        """A collective inside this rank's stage mesh (``collectives.perform``; ``spare``:
        nothing reads ``tensor`` afterwards)."""
        return self.axes(step, tensor, spare)

    def reshard(self, index: int, value):
        """Cross-mesh resharding ``index`` of the plan: a source rank gives its shard, a
        destination rank gets its own (None where it has none)."""
        return self.resharders[index].run(value)

    # --- whole tensors between two ranks -------------------------------------------------------

    def post(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Send ``array`` (host memory, C order) without waiting; ``finish_posted`` waits."""
        self._kept.append(array)
        self._posted.append(self.comm.Isend(byte_view(array), dest=dest, tag=tag))

    def finish_posted(self) -> None:
        wait_all(self._posted, self.MPI)
        self._posted, self._kept = [], []

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        self.comm.Send(byte_view(np.ascontiguousarray(array)), dest=dest, tag=tag)

    def recv(self, shape, dtype, source: int, tag: int) -> np.ndarray:
        array = np.empty(tuple(int(d) for d in shape), dtype=dtype)
        self.comm.Recv(byte_view(array), source=source, tag=tag)
        return array

    def post_with_shape(self, array: np.ndarray, dest: int, shape_tag: int, tag: int) -> None:
        """``post`` of the array's shape (int64), then of the array."""
        self.post(np.array(array.shape, dtype=np.int64), dest, shape_tag)
        self.post(array, dest, tag)

    def recv_with_shape(self, ndim: int, dtype, source: int, shape_tag: int, tag: int) -> np.ndarray:
        """What ``post_with_shape`` (or a shape ``send`` then the array) sent."""
        shape = self.recv((ndim,), np.int64, source, shape_tag)
        return self.recv(shape, dtype, source, tag)

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's ``payload`` on rank 0, in rank order; None elsewhere."""
        data = np.frombuffer(payload, dtype=np.uint8)
        counts = gather_rows(self.comm, np.array([data.size]))
        if self.rank != 0:
            self.comm.Gatherv(data, None, root=0)
            return None
        counts = counts[:, 0]
        received = np.empty(int(counts.sum()), dtype=np.uint8)
        self.comm.Gatherv(data, [received, counts, self.MPI.BYTE], root=0)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [received[offsets[i]:offsets[i + 1]].tobytes() for i in range(self.size)]

    def free(self) -> None:
        """Release every communicator (collective)."""
        self.axes.free()
        for resharder in self.resharders:
            resharder.free()
        for group in self.input_groups:
            if group is not None:
                group.Free()
        if self.headers is not None and self.headers is not self.comm:
            self.headers.Free()
        self.comm.Free()


def _bcast_strings(group, array: np.ndarray | None, shape: tuple) -> tuple[np.ndarray, int]:
    """A string tensor from the group's rank 0 to the others, as bytes: each item's UTF-8
    length, then every item's bytes."""
    count = int(np.prod(shape))
    if array is not None:
        items = [str(x).encode() for x in array.reshape(-1)]
        lengths = np.array([len(b) for b in items], dtype=np.int64)
        data = np.frombuffer(b"".join(items), dtype=np.uint8).copy()
    else:
        lengths = np.empty(count, dtype=np.int64)
    group.Bcast(lengths, root=0)
    if array is None:
        data = np.empty(int(lengths.sum()), dtype=np.uint8)
    group.Bcast(data, root=0)
    if array is not None:
        return array, lengths.nbytes + data.nbytes
    raw, offsets = data.tobytes(), np.concatenate([[0], np.cumsum(lengths)])
    items = [raw[offsets[i]:offsets[i + 1]].decode() for i in range(count)]
    return np.array(items, dtype=object).reshape(shape), lengths.nbytes + data.nbytes
