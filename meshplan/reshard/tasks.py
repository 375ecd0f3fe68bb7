"""Cross-mesh resharding, step 1: the unit tasks of moving a tensor between two meshes.

A tensor of shape ``shape`` laid out as ``src_spec`` on logical mesh A is needed as
``dst_spec`` on mesh B (disjoint ranks; the shapes of A and B may differ). Following
Zhuang et al., "On Optimizing the Communication of Model Parallelism" (MLSys 2023),
intersecting every device box of A with every device box of B gives the coarsest common
refinement of the two layouts; each piece becomes a :class:`UnitTask`: the slice, the A
ranks that hold all of it (``senders``) and the B ranks that need it (``receivers``). A
task picks ONE sender, which broadcasts the slice to all receivers (a plain send/recv
when there is one receiver).

With ``allow_local_allgather=True`` the tasks deliver a finer spec on B (a replicated B
axis becomes a split one), so a slice that every replica along that axis needs is sent
in pieces, one per replica, and an intra-B all-gather (:class:`AllGatherStep`) completes
the layout: Megatron's scatter + all-gather for equal meshes, the "local all-gather" for
unequal ones. With a ``send_spec`` the source ranks first reshard the tensor among
themselves (``CrossMeshTransfer.prepare``, intra-mesh steps from ``steps.reshard_steps``)
and the tasks send slices of ``send_spec`` shards (``send_spec.best_resharding`` picks it).

Everything here is pure planning (no MPI); ``meshplan.runtime.cross_mesh_mpi`` executes
a :class:`CrossMeshTransfer` with its ``simulator.Schedule``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import Sequence

from meshplan.reshard.kinds import ALL_GATHER
from meshplan.reshard.steps import Step, reshard_steps
from meshplan.sharding import LogicalMesh, ShardingSpec

Box = tuple[tuple[int, int], ...]   # (start, stop) per tensor dimension, full-tensor coordinates


@dataclass(frozen=True)
class UnitTask:
    """One data slice, who holds it on A and who needs it on B."""

    slice: Box
    senders: tuple[int, ...]      # A ranks holding the whole slice, in mesh order
    receivers: tuple[int, ...]    # B ranks needing it, in mesh order
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slice)

    def __str__(self) -> str:
        box = ",".join(f"{a}:{b}" for a, b in self.slice)
        return f"[{box}] {list(self.senders)}->{list(self.receivers)} {self.nbytes}B"

    def to_dict(self) -> dict:
        return {"slice": [list(p) for p in self.slice], "senders": list(self.senders),
                "receivers": list(self.receivers), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, data: dict) -> "UnitTask":
        return cls(tuple((int(a), int(b)) for a, b in data["slice"]), tuple(data["senders"]),
                   tuple(data["receivers"]), int(data["nbytes"]))


@dataclass(frozen=True)
class AllGatherStep:
    """All-gather inside B along mesh ``axis`` over tensor ``dim``: ``before`` → ``after``.

    The members of each group (``dst_mesh.axis_groups(axis)``, in that order) hold
    consecutive pieces of ``dim``; afterwards each holds their concatenation.
    """

    axis: int
    dim: int
    before: ShardingSpec
    after: ShardingSpec

    def as_step(self) -> Step:
        """The same all-gather as an intra-mesh step on B."""
        return Step(ALL_GATHER, self.axis, self.dim)

    def to_dict(self) -> dict:
        return {"axis": self.axis, "dim": self.dim, "before": str(self.before), "after": str(self.after)}

    @classmethod
    def from_dict(cls, data: dict) -> "AllGatherStep":
        return cls(int(data["axis"]), int(data["dim"]), ShardingSpec.parse(data["before"]), ShardingSpec.parse(data["after"]))


@dataclass(frozen=True)
class CrossMeshTransfer:
    """The whole transfer: the problem, the rearrangement inside A, the spec the tasks
    deliver on B, the all-gathers.

    Before the tasks, the source ranks may run ``prepare`` (intra-A resharding steps,
    ``src_spec`` → ``send_spec``); the tasks send slices of ``send_spec`` shards. With no
    rearrangement ``send_spec`` is ``src_spec`` and ``prepare`` is empty.
    """

    shape: tuple[int, ...]
    itemsize: int
    src_spec: ShardingSpec
    src_mesh: LogicalMesh
    dst_spec: ShardingSpec
    dst_mesh: LogicalMesh
    sent_spec: ShardingSpec                 # what the tasks deliver (dst_spec, or finer)
    allgathers: tuple[AllGatherStep, ...]   # in execution order, sent_spec → dst_spec
    tasks: tuple[UnitTask, ...]
    send_spec: ShardingSpec | None = None   # what the senders hold (None: src_spec)
    prepare: tuple[Step, ...] = ()          # intra-A steps, src_spec → send_spec

    def __post_init__(self):
        if self.send_spec is None:
            object.__setattr__(self, "send_spec", self.src_spec)
        object.__setattr__(self, "prepare", tuple(self.prepare))

    def src_box(self, rank: int) -> Box:
        return device_box(self.src_spec, self.shape, self.src_mesh, rank)

    def send_box(self, rank: int) -> Box:
        """What source ``rank`` holds after ``prepare``: the box its tasks slice from."""
        return device_box(self.send_spec, self.shape, self.src_mesh, rank)

    def sent_box(self, rank: int) -> Box:
        return device_box(self.sent_spec, self.shape, self.dst_mesh, rank)

    def dst_box(self, rank: int) -> Box:
        return device_box(self.dst_spec, self.shape, self.dst_mesh, rank)

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape), "itemsize": self.itemsize,
            "src_spec": str(self.src_spec), "src_mesh": _mesh_dict(self.src_mesh),
            "dst_spec": str(self.dst_spec), "dst_mesh": _mesh_dict(self.dst_mesh),
            "sent_spec": str(self.sent_spec), "allgathers": [s.to_dict() for s in self.allgathers],
            "tasks": [t.to_dict() for t in self.tasks],
            "send_spec": str(self.send_spec), "prepare": [s.to_dict() for s in self.prepare],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CrossMeshTransfer":
        """The inverse of :meth:`to_dict`; a dict without ``send_spec`` / ``prepare`` (an
        older plan) is a transfer without rearrangement."""
        src_spec = ShardingSpec.parse(data["src_spec"])
        send_spec = ShardingSpec.parse(data["send_spec"]) if "send_spec" in data else src_spec
        return cls(
            tuple(data["shape"]), int(data["itemsize"]),
            src_spec, _mesh_from(data["src_mesh"]),
            ShardingSpec.parse(data["dst_spec"]), _mesh_from(data["dst_mesh"]),
            ShardingSpec.parse(data["sent_spec"]), tuple(AllGatherStep.from_dict(s) for s in data["allgathers"]),
            tuple(UnitTask.from_dict(t) for t in data["tasks"]),
            send_spec, tuple(Step.from_dict(s) for s in data.get("prepare", ())),
        )


def _mesh_dict(mesh: LogicalMesh) -> dict:
    return {"shape": list(mesh.shape), "ranks": list(mesh.ranks)}


def _mesh_from(data: dict) -> LogicalMesh:
    return LogicalMesh(tuple(data["shape"]), tuple(data["ranks"]))


def device_box(spec: ShardingSpec, shape: Sequence[int], mesh: LogicalMesh, rank: int) -> Box:
    """The (start, stop) ranges of the full tensor that ``rank`` holds under ``spec``."""
    return tuple((s.start, s.stop) for s in spec.local_slices(tuple(shape), mesh, mesh.coord(rank)))


def box_slices(box: Box, within: Box | None = None) -> tuple[slice, ...]:
    """numpy slices of ``box``, in full-tensor coordinates or relative to ``within``."""
    if within is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(box, within))


def plan_resharding(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                    dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int = 4, *,
                    allow_local_allgather: bool = False,
                    allgather_axes: Sequence[int] | None = None,
                    send_spec: ShardingSpec | str | None = None) -> CrossMeshTransfer:
    """Unit tasks (and, with ``allow_local_allgather``, the intra-B all-gathers) for moving
    a tensor from ``src_spec`` on ``src_mesh`` to ``dst_spec`` on ``dst_mesh``.

    ``allgather_axes`` limits which B mesh axes may be gathered over (default: every
    replicated axis of size > 1; pass ``(1,)`` to gather only inside hosts).
    ``send_spec`` (default ``src_spec``) rearranges the tensor inside A first: the
    transfer records the intra-A steps ``src_spec`` → ``send_spec`` as ``prepare`` and
    its tasks send slices of ``send_spec`` shards (see :func:`best_resharding`).
    """
    shape = tuple(int(s) for s in shape)
    src_spec, dst_spec = ShardingSpec.of(src_spec), ShardingSpec.of(dst_spec)
    send_spec = src_spec if send_spec is None else ShardingSpec.of(send_spec)
    for name, spec, mesh in (("source", src_spec, src_mesh), ("destination", dst_spec, dst_mesh),
                             ("send", send_spec, src_mesh)):
        if spec.partial:
            raise ValueError(f"cross-mesh resharding needs a non-partial {name} spec, got {spec}")
        if not spec.is_valid_for(shape, mesh):
            raise ValueError(f"{name} spec {spec} does not divide shape {shape} on mesh {mesh.shape}")
    common = set(src_mesh.ranks) & set(dst_mesh.ranks)
    if common:
        raise ValueError(f"source and destination meshes share ranks {sorted(common)}")
    if itemsize < 1:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    prepare: tuple[Step, ...] = ()
    if send_spec != src_spec:
        try:
            prepare = reshard_steps(src_spec, send_spec)
        except ValueError as exc:
            raise ValueError(f"cannot rearrange {src_spec} into send spec {send_spec} inside the source mesh: {exc}") from exc
    sent_spec, steps = dst_spec, ()
    if allow_local_allgather:
        sent_spec, steps = _gather_plan(shape, dst_spec, dst_mesh, allgather_axes)
    tasks = _unit_tasks(shape, itemsize, send_spec, src_mesh, sent_spec, dst_mesh)
    return CrossMeshTransfer(shape, itemsize, src_spec, src_mesh, dst_spec, dst_mesh, sent_spec, steps, tuple(tasks),
                             send_spec, prepare)


def cross_mesh_tasks(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                     dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int = 4, *,
                     allow_local_allgather: bool = False,
                     allgather_axes: Sequence[int] | None = None) -> list[UnitTask]:
    """The unit tasks of :func:`plan_resharding` (which also records the all-gathers)."""
    return list(plan_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize,
                                allow_local_allgather=allow_local_allgather, allgather_axes=allgather_axes).tasks)


def _unit_tasks(shape, itemsize, src_spec, src_mesh, dst_spec, dst_mesh) -> list[UnitTask]:
    src_boxes = {r: device_box(src_spec, shape, src_mesh, r) for r in src_mesh.ranks}
    dst_boxes = {r: device_box(dst_spec, shape, dst_mesh, r) for r in dst_mesh.ranks}
    intervals, holders, needers = [], [], []
    for d, size in enumerate(shape):
        cuts = sorted({0, size} | {p for b in (*src_boxes.values(), *dst_boxes.values()) for p in b[d]})
        pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        intervals.append(pieces)
        # An A box and a B box intersect in exactly one piece of the refinement per
        # dimension, so the pieces are what intersecting all the boxes pairwise gives.
        holders.append([frozenset(r for r, box in src_boxes.items() if box[d][0] <= a and b <= box[d][1]) for a, b in pieces])
        needers.append([frozenset(r for r, box in dst_boxes.items() if box[d][0] <= a and b <= box[d][1]) for a, b in pieces])
    tasks = []
    for combo in itertools.product(*(range(len(p)) for p in intervals)):
        senders = frozenset(src_mesh.ranks).intersection(*(holders[d][k] for d, k in enumerate(combo)))
        receivers = frozenset(dst_mesh.ranks).intersection(*(needers[d][k] for d, k in enumerate(combo)))
        box = tuple(intervals[d][k] for d, k in enumerate(combo))
        assert senders and receivers, f"uncovered piece {box}"
        nbytes = prod(b - a for a, b in box) * itemsize
        tasks.append(UnitTask(box, tuple(r for r in src_mesh.ranks if r in senders),
                              tuple(r for r in dst_mesh.ranks if r in receivers), nbytes))
    return tasks


def _gather_plan(shape, dst_spec, dst_mesh, axes) -> tuple[ShardingSpec, tuple[AllGatherStep, ...]]:
    """Split the first dimension that can take it along every replicated B axis; the
    all-gathers undo those splits (the last split first)."""
    spec, steps = dst_spec, []
    used = dst_spec.split_axes()
    for axis in (0, 1):
        if axis in used or dst_mesh.axis_size(axis) < 2 or (axes is not None and axis not in axes):
            continue
        for d in range(len(spec.dims)):
            try:
                candidate = spec.refined(d, axis)
            except ValueError:     # the dim is split last along the other axis
                continue
            if candidate.is_valid_for(shape, dst_mesh) and shape[d] // candidate.shards(d, dst_mesh) > 0:
                steps.append(AllGatherStep(axis, d, candidate, spec))
                spec = candidate
                break
    return spec, tuple(reversed(steps))


def as_send_recv(tasks: Sequence[UnitTask]) -> list[UnitTask]:
    """The same transfer without broadcast: one task per (slice, receiver)."""
    return [UnitTask(t.slice, t.senders, (r,), t.nbytes) for t in tasks for r in t.receivers]
