"""One intra-mesh resharding step (a ``steps.Step``) on this rank's tensor, with mpi4py.

``perform`` is the MPI twin of ``steps.apply_steps`` for one step: ``group`` is the
communicator of the step's mesh-axis group that this rank belongs to, its ranks ordered
by mesh coordinate (the order of ``LogicalMesh.axis_groups``). ``buffers`` says where the
tensor lives (``buffers.HOST``, or a ``DeviceBuffers`` whose tensors go to MPI as device
memory). The step's kind chooses the operation of :class:`AxisGroup`. Only non-blocking
buffer-based calls are used, finished through ``wait_all`` (which yields the core while
it waits).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from meshplan.reshard.steps import Step
from meshplan.sharding import LogicalMesh
from meshplan.runtime.buffers import HOST
from meshplan.runtime.waiting import wait_all


# Sums in these dtypes run in float32 and are rounded back once: not every MPI has them
# (Open MPI 4 has neither), and one rounding loses less than one per reduction step.
WIDENED = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def axis_communicator(comm, MPI, mesh: LogicalMesh, axis: int):
    """This rank's group along mesh ``axis`` (2: the whole mesh), ranks ordered by
    coordinate; ``None`` for a rank outside ``mesh``. Collective over ``comm``: every rank
    of it calls, in the same order."""
    color, key = MPI.UNDEFINED, 0
    member = comm.Get_rank() in mesh.ranks
    if member:
        coord = mesh.coord(comm.Get_rank())
        color, key = mesh.group_index(coord, axis), mesh.axis_index(coord, axis)
    split = comm.Split(color, key)
    return split if member else None


class AxisGroup:
    """The collectives of one mesh-axis group communicator on tensors of ``buffers``' kind
    (the communicator a step kind's ``perform`` calls)."""

    def __init__(self, group, MPI, buffers=HOST):
        self.group, self.MPI, self.buffers = group, MPI, buffers

    def all_reduce(self, x, spare: bool = False):
        """The sum over the group; ``spare``: nobody reads ``x`` afterwards, so a tensor in
        host memory is summed where it lies (``MPI_IN_PLACE``), no second buffer made."""
        if x.dtype in WIDENED:
            return self._narrowed(self.all_reduce(self._widened(x)), x.dtype)
        b = self.buffers
        if spare and b is HOST and isinstance(x, np.ndarray) and x.flags.c_contiguous and x.flags.writeable:
            wait_all([self.group.Iallreduce(self.MPI.IN_PLACE, b.mpi(x), op=self.MPI.SUM)], self.MPI)
            return x
        out = b.empty(b.shape(x), x.dtype)
        wait_all([self.group.Iallreduce(b.mpi(x), b.mpi(out), op=self.MPI.SUM)], self.MPI)
        return out

    def all_gather(self, x, dim: int):
        """gathered[i] is member i's piece."""
        b = self.buffers
        gathered = b.empty((self.group.Get_size(),) + b.shape(x), x.dtype)
        wait_all([self.group.Iallgather(b.mpi_bytes(x), b.mpi_bytes(gathered))], self.MPI)
        return b.unpack(gathered, dim)

    def reduce_scatter(self, x, dim: int):
        """Member i keeps the sum of piece i."""
        if x.dtype in WIDENED:
            return self._narrowed(self.reduce_scatter(self._widened(x), dim), x.dtype)
        b = self.buffers
        send = b.pack(x, dim, self.group.Get_size())
        out = b.empty(b.shape(send)[1:], x.dtype)
        wait_all([self.group.Ireduce_scatter_block(b.mpi(send), b.mpi(out), op=self.MPI.SUM)], self.MPI)
        return out

    def all_to_all(self, x, dim: int, to_dim: int):
        """Piece i of the ``to_dim`` split goes to member i."""
        b = self.buffers
        send = b.pack(x, to_dim, self.group.Get_size())
        received = b.empty(b.shape(send), x.dtype)
        wait_all([self.group.Ialltoall(b.mpi_bytes(send), b.mpi_bytes(received))], self.MPI)
        return b.unpack(received, dim)

    def _widened(self, x):
        return self.buffers.from_host(self.buffers.to_host(x).astype(np.float32))

    def _narrowed(self, x, dtype):
        return self.buffers.from_host(self.buffers.to_host(x).astype(dtype))

    def slice(self, x, dim: int):
        shape = self.buffers.shape(x)
        piece = shape[dim] // self.group.Get_size()
        index = self.group.Get_rank()
        box = tuple(slice(index * piece, (index + 1) * piece) if d == dim else slice(None) for d in range(len(shape)))
        return self.buffers.take(x, box)


def perform(step: Step, x, group, MPI, buffers=HOST, spare: bool = False):
    return step.kind.perform(step, x, AxisGroup(group, MPI, buffers), spare)
