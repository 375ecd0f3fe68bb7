"""Executing a cross-mesh resharding (a ``CrossMeshTransfer``): with mpi4py across ranks, or in memory.

:class:`CrossMeshResharder` moves one tensor from mesh A to mesh B following a
:class:`~meshplan.reshard.tasks.CrossMeshTransfer` and its :class:`~meshplan.reshard.simulator.Schedule`.
First the source ranks run the transfer's ``prepare`` steps (intra-A collectives on
per-axis communicators of A, rearranging ``src_spec`` into ``send_spec``); then every rank walks the schedule's entries in order and takes part in the ones that name
it; a task with one receiver is a ``Send``/``Recv``, a task with more is a ``Bcast`` from
the chosen sender over the group communicator {sender} ∪ receivers. Then the recorded
all-gathers run inside B (``Allgather`` over each mesh-axis group). Only buffer-based
calls are used, never pickled objects: on numpy arrays on the host path, on device
memory through ``buffers.MpiView`` on the device path (see ``buffers``).

Every rank runs its part of the tasks in the one global order, and each call blocks only
ranks of its own task, so the earliest unfinished task always has all its ranks waiting
in it: no deadlock.

:func:`reshard_in_memory` is the same data movement on a dict of arrays, for the
in-process executor and for tests.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from meshplan.reshard.simulator import Schedule
from meshplan.reshard.steps import apply_steps
from meshplan.reshard.tasks import CrossMeshTransfer, box_slices
from meshplan.runtime.buffers import HOST
from meshplan.runtime.collectives import axis_communicator, perform
from meshplan.runtime.waiting import wait_all

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


def _check_source(transfer: CrossMeshTransfer, rank: int, shape: tuple[int, ...] | None) -> None:
    """A source rank's shard has the shape its ``src_spec`` gives (``None``: no shard)."""
    want = tuple(b - a for a, b in transfer.src_box(rank))
    if shape is None or tuple(shape) != want:
        raise ValueError(f"rank {rank} of the source mesh needs its {transfer.src_spec} shard of shape {want}, "
                         f"got {shape}")


def reshard_in_memory(src_locals: Mapping[int, np.ndarray], transfer: CrossMeshTransfer,
                      schedule: Schedule | None = None) -> dict[int, np.ndarray]:
    """Every B rank's shard under ``dst_spec`` from every A rank's shard under ``src_spec``.

    ``src_locals`` maps each rank of the source mesh to its local array; the transfer's
    ``prepare`` steps rearrange them into ``send_spec`` first. Without a schedule every
    task is sent by its first sender.
    """
    for rank in transfer.src_mesh.ranks:
        local = src_locals.get(rank)
        _check_source(transfer, rank, None if local is None else np.shape(local))
    dtype = np.asarray(src_locals[transfer.src_mesh.ranks[0]]).dtype
    held = {rank: np.asarray(src_locals[rank]) for rank in transfer.src_mesh.ranks}
    if transfer.prepare:   # rearrange inside A: src_spec → send_spec
        mesh = transfer.src_mesh
        moved = apply_steps({mesh.coord(r): held[r] for r in mesh.ranks}, transfer.prepare, mesh)
        held = {r: moved[mesh.coord(r)] for r in mesh.ranks}
    out = {}
    for rank in transfer.dst_mesh.ranks:
        box = transfer.sent_box(rank)
        out[rank] = np.empty(tuple(b - a for a, b in box), dtype=dtype)
    for index, sender in _entries(transfer, schedule):
        task = transfer.tasks[index]
        piece = held[sender][box_slices(task.slice, transfer.send_box(sender))]
        for rank in task.receivers:
            out[rank][box_slices(task.slice, transfer.sent_box(rank))] = piece
    if transfer.allgathers:
        mesh = transfer.dst_mesh
        gathered = apply_steps({mesh.coord(r): out[r] for r in mesh.ranks}, [s.as_step() for s in transfer.allgathers], mesh)
        out = {r: gathered[mesh.coord(r)].copy() for r in mesh.ranks}
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

    def __init__(self, transfer: CrossMeshTransfer, schedule: Schedule | None, comm, dtype=np.float32,
                 buffers=HOST):
        from mpi4py import MPI

        self._MPI = MPI
        self.transfer = transfer
        self.buffers = buffers
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
        # The rearrangement inside A: one communicator per mesh axis its steps use, split
        # from comm by every rank (source ranks by coordinate, the others get none).
        self._send_box = transfer.send_box(self.rank) if self.is_source else None
        self._prepare_comms = {axis: axis_communicator(comm, MPI, transfer.src_mesh, axis)
                               for axis in sorted({step.axis for step in transfer.prepare})}

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

    def run(self, local):
        """Source ranks pass their shard, the others ``None``; destination ranks get
        their shard, the others ``None``. Tensors are of the ``buffers`` kind the
        resharder was built with (numpy arrays on the host path)."""
        rs, rank, b = self.transfer, self.rank, self.buffers
        src_box = dst_box = None
        if self.is_source:
            local = self._check_local(local)
            local, src_box = self._prepare(local), self._send_box
        assembler = None
        if self.is_destination:
            dst_box = rs.sent_box(rank)
            assembler = b.assembler(tuple(stop - start for start, stop in dst_box), self.dtype)
        for index, sender in self.entries:
            task = rs.tasks[index]
            if rank != sender and rank not in task.receivers:
                continue
            if rank == sender:
                buf = b.take(local, box_slices(task.slice, src_box))
            else:
                buf = b.empty(task.shape, self.dtype)
            if len(task.receivers) == 1:
                if rank == sender:
                    request = self._p2p.Isend(b.mpi_bytes(buf), dest=task.receivers[0], tag=_TAG)
                else:
                    request = self._p2p.Irecv(b.mpi_bytes(buf), source=sender, tag=_TAG)
            else:
                request = self._groups[(sender, *task.receivers)].Ibcast(b.mpi_bytes(buf), root=0)
            wait_all([request], self._MPI)
            if rank != sender:
                assembler.put(box_slices(task.slice, dst_box), buf)
        if assembler is None:
            return None
        out = assembler.finish()
        for step, comm in zip(rs.allgathers, self._gather):
            out = perform(step.as_step(), out, comm, self._MPI, b)
        return out

    def _check_local(self, local):
        _check_source(self.transfer, self.rank, None if local is None else self.buffers.shape(local))
        if np.dtype(local.dtype) != self.dtype:
            raise ValueError(f"rank {self.rank}: resharder built for {self.dtype}, got {local.dtype}")
        return local

    def _prepare(self, local):
        """This source rank's shard rearranged from ``src_spec`` into ``send_spec`` (the
        transfer's ``prepare`` steps, collective over the source mesh's axis groups, so
        every source rank calls it); the shard itself when there are no steps."""
        for step in self.transfer.prepare:
            local = perform(step, local, self._prepare_comms[step.axis], self._MPI, self.buffers)
        return local

    def free(self) -> None:
        """Release the communicators (collective over the members of each)."""
        for comm in [*self._groups.values(), *self._gather, *self._prepare_comms.values(), self._p2p]:
            if comm is not None:
                comm.Free()
        self._groups, self._gather, self._prepare_comms, self._p2p = {}, [], {}, None


__all__ = ["CrossMeshResharder", "reshard_in_memory"]
