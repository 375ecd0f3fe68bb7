"""Executing a cross-mesh resharding (a ``CrossMeshTransfer``): with mpi4py across ranks, or in memory.

:class:`CrossMeshResharder` moves one tensor from mesh A to mesh B following a
:class:`~meshplan.cross_mesh.CrossMeshTransfer` and its :class:`~meshplan.cross_mesh.Schedule`:
every rank walks the schedule's entries in order and takes part in the ones that name
it; a task with one receiver is a ``Send``/``Recv``, a task with more is a ``Bcast`` from
the chosen sender over the group communicator {sender} ∪ receivers. Then the recorded
all-gathers run inside B (``Allgather`` over each mesh-axis group). Only buffer-based
calls on numpy arrays are used, never pickled objects.

Every rank runs its part of the tasks in the one global order, and each call blocks only
ranks of its own task, so the earliest unfinished task always has all its ranks waiting
in it: no deadlock.

:func:`reshard_in_memory` is the same data movement on a dict of arrays, for the
in-process executor and for tests.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..cross_mesh import AllGatherStep, CrossMeshTransfer, Schedule, box_slices
from .waiting import wait_all

_TAG = 7701


def _entries(transfer: CrossMeshTransfer, schedule: Schedule | None) -> list[tuple[int, int]]:
    """(task index, sender) in execution order."""
    if schedule is None:
        return [(i, t.senders[0]) for i, t in enumerate(transfer.tasks)]
    if schedule.tasks != transfer.tasks:
        raise ValueError("the schedule was made for different cross-mesh tasks")
    for e in schedule.entries:
        if e.sender not in transfer.tasks[e.task].senders:
            raise ValueError(f"schedule sends task {e.task} from rank {e.sender}, which does not hold its slice")
    return [(e.task, e.sender) for e in schedule.entries]


def _check_source(transfer: CrossMeshTransfer, rank: int, local: np.ndarray | None) -> np.ndarray:
    want = tuple(b - a for a, b in transfer.src_box(rank))
    if local is None or tuple(local.shape) != want:
        got = None if local is None else tuple(local.shape)
        raise ValueError(f"rank {rank} of the source mesh needs its {transfer.src_spec} shard of shape {want}, got {got}")
    return local


def reshard_in_memory(src_locals: Mapping[int, np.ndarray], transfer: CrossMeshTransfer,
                      schedule: Schedule | None = None) -> dict[int, np.ndarray]:
    """Every B rank's shard under ``dst_spec`` from every A rank's shard under ``src_spec``.

    ``src_locals`` maps each rank of the source mesh to its local array; without a
    schedule every task is sent by its first sender.
    """
    for rank in transfer.src_mesh.ranks:
        _check_source(transfer, rank, src_locals.get(rank))
    dtype = np.asarray(src_locals[transfer.src_mesh.ranks[0]]).dtype
    out = {}
    for rank in transfer.dst_mesh.ranks:
        box = transfer.sent_box(rank)
        out[rank] = np.empty(tuple(b - a for a, b in box), dtype=dtype)
    for index, sender in _entries(transfer, schedule):
        task = transfer.tasks[index]
        piece = src_locals[sender][box_slices(task.slice, transfer.src_box(sender))]
        for rank in task.receivers:
            out[rank][box_slices(task.slice, transfer.sent_box(rank))] = piece
    for step in transfer.allgathers:
        for group in transfer.dst_mesh.axis_groups(step.axis):
            whole = np.concatenate([out[r] for r in group], axis=step.dim)
            for r in group:
                out[r] = whole.copy()
    return out


class CrossMeshResharder:
    """One tensor transfer between two meshes of ``comm``'s ranks (mesh ranks are ranks
    of ``comm``).

    Construction is collective over ``comm``: every rank must construct the same
    resharders (same transfer, same schedule) in the same order, because it creates
    the communicators: a duplicate of ``comm`` for the sends, one group communicator per
    distinct {sender} ∪ receivers set of a broadcast, and one per all-gather group.
    Call :meth:`free` (also collective) to release them.

    ``run(local)`` is collective too: source ranks pass their shard, every other rank
    ``None``; destination ranks get their shard under ``dst_spec``, the others ``None``.
    """

    def __init__(self, transfer: CrossMeshTransfer, schedule: Schedule | None, comm, dtype=np.float32):
        from mpi4py import MPI

        self._MPI = MPI
        self.transfer = transfer
        self.dtype = np.dtype(dtype)
        if self.dtype.itemsize != transfer.itemsize:
            raise ValueError(f"dtype {self.dtype} has {self.dtype.itemsize} bytes per item, "
                             f"the transfer was planned for {transfer.itemsize}")
        self.entries = _entries(transfer, schedule)
        self.rank = comm.Get_rank()
        for r in (*transfer.src_mesh.ranks, *transfer.dst_mesh.ranks):
            if not 0 <= r < comm.Get_size():
                raise ValueError(f"mesh rank {r} is not a rank of the communicator (size {comm.Get_size()})")
        self._p2p = comm.Dup()
        self._groups: dict[tuple[int, ...], object] = {}
        self._gather: list[object] = []
        world = comm.Get_group()
        try:
            for index, sender in self.entries:
                receivers = transfer.tasks[index].receivers
                members = (sender, *receivers)
                if len(receivers) > 1 and members not in self._groups:
                    self._groups[members] = self._create(comm, world, members)
            for step in transfer.allgathers:
                mine = None
                for group in transfer.dst_mesh.axis_groups(step.axis):
                    made = self._create(comm, world, tuple(group))
                    if made is not None:
                        mine = made
                self._gather.append(mine)
        finally:
            world.Free()

    def _create(self, comm, world, members: tuple[int, ...]):
        """A communicator over ``members`` (in that order, so ``members[0]`` is rank 0);
        only the members take part, ``None`` elsewhere."""
        if self.rank not in members:
            return None
        group = world.Incl(list(members))
        try:
            return comm.Create_group(group, _TAG)
        finally:
            group.Free()

    @property
    def is_source(self) -> bool:
        return self.rank in self.transfer.src_mesh.ranks

    @property
    def is_destination(self) -> bool:
        return self.rank in self.transfer.dst_mesh.ranks

    def run(self, local: np.ndarray | None) -> np.ndarray | None:
        rs, rank = self.transfer, self.rank
        src_box = dst_box = None
        if self.is_source:
            local = _check_source(rs, rank, local)
            if local.dtype != self.dtype:
                raise ValueError(f"rank {rank}: resharder built for {self.dtype}, got {local.dtype}")
            src_box = rs.src_box(rank)
        out = None
        if self.is_destination:
            dst_box = rs.sent_box(rank)
            out = np.empty(tuple(b - a for a, b in dst_box), dtype=self.dtype)
        for index, sender in self.entries:
            task = rs.tasks[index]
            if rank != sender and rank not in task.receivers:
                continue
            if rank == sender:
                buf = np.ascontiguousarray(local[box_slices(task.slice, src_box)])
            else:
                buf = np.empty(task.shape, dtype=self.dtype)
            if len(task.receivers) == 1:
                if rank == sender:
                    request = self._p2p.Isend(buf, dest=task.receivers[0], tag=_TAG)
                else:
                    request = self._p2p.Irecv(buf, source=sender, tag=_TAG)
            else:
                request = self._groups[(sender, *task.receivers)].Ibcast(buf, root=0)
            wait_all([request], self._MPI)
            if rank != sender:
                out[box_slices(task.slice, dst_box)] = buf
        if out is not None:
            for step, comm in zip(rs.allgathers, self._gather):
                out = self._allgather(out, step, comm)
        return out

    @staticmethod
    def _allgather(local: np.ndarray, step: AllGatherStep, comm) -> np.ndarray:
        moved = np.ascontiguousarray(np.moveaxis(local, step.dim, 0))
        gathered = np.empty((comm.Get_size(),) + moved.shape, dtype=local.dtype)
        from mpi4py import MPI

        wait_all([comm.Iallgather(moved, gathered)], MPI)
        whole = gathered.reshape((-1,) + moved.shape[1:])
        return np.ascontiguousarray(np.moveaxis(whole, 0, step.dim))

    def free(self) -> None:
        """Release the communicators (collective over the members of each)."""
        for comm in [*self._groups.values(), *self._gather, self._p2p]:
            if comm is not None:
                comm.Free()
        self._groups, self._gather, self._p2p = {}, [], None


__all__ = ["CrossMeshResharder", "reshard_in_memory"]
