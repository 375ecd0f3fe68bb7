"""One intra-mesh resharding step (a ``resharding.Step``) on this rank's tensor, with mpi4py.

``perform`` is the MPI twin of ``resharding.apply_steps`` for one step: ``group`` is
the communicator of the step's mesh-axis group that this rank belongs to, its ranks
ordered by mesh coordinate (the order of ``LogicalMesh.axis_groups``). ``buffers``
says where the tensor lives (``buffers.HOST``, or a ``DeviceBuffers`` whose tensors go
to MPI as device memory). Only non-blocking buffer-based calls are used, finished
through ``wait_all`` (which yields the core while it waits).
"""

from __future__ import annotations

from meshplan.errors import RunError
from meshplan.reshard.steps import Step
from meshplan.sharding import LogicalMesh
from meshplan.runtime.buffers import HOST
from meshplan.runtime.waiting import wait_all


def axis_communicator(comm, MPI, mesh: LogicalMesh, axis: int):
    """This rank's group along mesh ``axis`` (2: the whole mesh), ranks ordered by
    coordinate; ``None`` for a rank outside ``mesh``. Collective over ``comm``: every rank
    of it calls, in the same order."""
    color, key = MPI.UNDEFINED, 0
    member = comm.Get_rank() in mesh.ranks
    if member:
        i, j = mesh.coord(comm.Get_rank())
        color, key = {0: (j, i), 1: (i, j), 2: (0, i * mesh.shape[1] + j)}[axis]
    split = comm.Split(color, key)
    return split if member else None


def perform(step: Step, x, group, MPI, buffers=HOST):
    size = group.Get_size()
    b = buffers
    shape = b.shape(x)
    if step.kind == "all_reduce":
        out = b.empty(shape, x.dtype)
        wait_all([group.Iallreduce(b.mpi(x), b.mpi(out), op=MPI.SUM)], MPI)
        return out
    if step.kind == "all_gather":     # gathered[i] is member i's piece
        gathered = b.empty((size,) + shape, x.dtype)
        wait_all([group.Iallgather(b.mpi(x), b.mpi(gathered))], MPI)
        return b.unpack(gathered, step.dim)
    if step.kind == "reduce_scatter":  # member i keeps the sum of piece i
        send = b.pack(x, step.dim, size)
        out = b.empty(b.shape(send)[1:], x.dtype)
        wait_all([group.Ireduce_scatter_block(b.mpi(send), b.mpi(out), op=MPI.SUM)], MPI)
        return out
    if step.kind == "all_to_all":     # piece i of the to_dim split goes to member i
        send = b.pack(x, step.to_dim, size)
        received = b.empty(b.shape(send), x.dtype)
        wait_all([group.Ialltoall(b.mpi(send), b.mpi(received))], MPI)
        return b.unpack(received, step.dim)
    if step.kind == "slice":
        piece = shape[step.dim] // size
        index = group.Get_rank()
        box = tuple(slice(index * piece, (index + 1) * piece) if d == step.dim else slice(None) for d in range(len(shape)))
        return b.take(x, box)
    raise RunError(f"unknown collective {step.kind}")
