"""One intra-mesh resharding step (a ``resharding.Step``) on this rank's array, with mpi4py.

``perform`` is the MPI twin of ``resharding.apply_steps`` for one step: ``group`` is
the communicator of the step's mesh-axis group that this rank belongs to, its ranks
ordered by mesh coordinate (the order of ``LogicalMesh.axis_groups``). Only non-blocking
buffer-based calls are used, finished through ``wait_all`` (which yields the core while
it waits).
"""

from __future__ import annotations

import numpy as np

from ..errors import RunError
from ..resharding import Step
from .waiting import wait_all


def perform(step: Step, array: np.ndarray, group, MPI) -> np.ndarray:
    size = group.Get_size()
    x = np.ascontiguousarray(array)
    if step.kind == "all_reduce":
        out = np.empty_like(x)
        wait_all([group.Iallreduce(x, out, op=MPI.SUM)], MPI)
        return out
    if step.kind == "all_to_all":   # piece i of the to_dim split goes to member i
        send = np.ascontiguousarray(np.stack(np.split(x, size, axis=step.to_dim)))
        received = np.empty_like(send)
        wait_all([group.Ialltoall(send, received)], MPI)
        return np.ascontiguousarray(np.concatenate(list(received), axis=step.dim))
    if step.kind == "slice":
        piece = x.shape[step.dim] // size
        index = group.Get_rank()
        where = (slice(None),) * step.dim + (slice(index * piece, (index + 1) * piece),)
        return np.ascontiguousarray(x[where])
    moved = np.ascontiguousarray(np.moveaxis(x, step.dim, 0))
    if step.kind == "all_gather":
        out = np.empty((size,) + moved.shape, dtype=x.dtype)
        wait_all([group.Iallgather(moved, out)], MPI)
        out = out.reshape((size * moved.shape[0],) + moved.shape[1:])
    elif step.kind == "reduce_scatter":
        out = np.empty((moved.shape[0] // size,) + moved.shape[1:], dtype=x.dtype)
        wait_all([group.Ireduce_scatter_block(moved, out, op=MPI.SUM)], MPI)
    else:
        raise RunError(f"unknown collective {step.kind}")
    return np.ascontiguousarray(np.moveaxis(out, 0, step.dim))
