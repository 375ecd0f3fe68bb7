"""Resharding inside one logical mesh: plan the steps, run them in memory, cost them.

A plan is a tuple of ``Step`` values (``reshard_steps``, cached: specs are hashable).
``apply_steps`` executes a plan on every device's local array in one process: it is the
reference semantics of the steps and what the in-process executor runs.
``CollectiveModel`` prices the steps with an alpha-beta (latency-bandwidth) model per
mesh axis; ``axis_links`` and ``mesh_links`` say which link each mesh axis uses.

A step's *group* along a mesh axis is the devices that differ only in that axis's
coordinate (``BOTH_AXES``: the whole mesh); a device's index in its group is
``LogicalMesh.axis_index``. What each kind of step does is in ``kinds``.

A dimension split S01 holds chunk i*m + j: S0 refined by axis 1. So S01 → R gathers
axis 1 (giving S0) and then axis 0; R → S01 slices axis 0 and then axis 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping

import numpy as np

from meshplan.cost.cluster import Cluster, LinkSpec
from meshplan.reshard.kinds import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, SLICE, StepKind, step_kind
from meshplan.sharding import BOTH_AXES, LogicalMesh, ShardingSpec, placement_axes, placement_of

Coord = tuple[int, int]


@dataclass(frozen=True)
class Step:
    kind: StepKind            # a kind's plan.json name is converted
    axis: int                 # mesh axis 0, 1, or 2 for both axes (whole mesh)
    dim: int | None = None    # tensor dim (None for all_reduce)
    to_dim: int | None = None  # all_to_all only: the dim the split moves to (from ``dim``)

    def __post_init__(self):
        if isinstance(self.kind, str):
            object.__setattr__(self, "kind", step_kind(self.kind))
        if self.axis not in (0, 1, BOTH_AXES):
            raise ValueError(f"step {self.kind} has mesh axis {self.axis}; expected 0, 1 or 2 (both)")
        if (self.dim is None) == self.kind.takes_dim:
            raise ValueError(f"step {self.kind} {'needs' if self.dim is None else 'takes no'} tensor dim")
        if (self.to_dim is None) == self.kind.takes_to_dim or (self.to_dim is not None and self.to_dim == self.dim):
            raise ValueError(f"step {self.kind}: to_dim is for all_to_all only, and differs from dim")

    def __str__(self) -> str:
        if self.to_dim is not None:
            return f"{self.kind}(axis={self.axis}, dim={self.dim}->{self.to_dim})"
        return f"{self.kind}(axis={self.axis})" if self.dim is None else f"{self.kind}(axis={self.axis}, dim={self.dim})"

    def spec_after(self, spec: ShardingSpec) -> ShardingSpec:
        """The layout the step leaves behind."""
        return self.kind.spec_after(self, spec)

    def attributes(self) -> dict:
        """The attributes of the step's collective node: axis, and dim / to_dim where set."""
        attrs = {"axis": self.axis}
        if self.dim is not None:
            attrs["dim"] = self.dim
        if self.to_dim is not None:
            attrs["to_dim"] = self.to_dim
        return attrs

    def to_dict(self) -> dict:
        return {"kind": self.kind.name, "axis": self.axis, "dim": self.dim, "to_dim": self.to_dim}

    @classmethod
    def from_dict(cls, data: dict) -> "Step":
        def number(key):
            value = data.get(key)
            return None if value is None else int(value)

        return cls(str(data["kind"]), int(data["axis"]), number("dim"), number("to_dim"))


# --- planning ------------------------------------------------------------------------

def _is_prefix(axes: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return target[: len(axes)] == axes


def reshard_steps(src: ShardingSpec, dst: ShardingSpec) -> tuple[Step, ...]:
    """The collectives that turn a tensor laid out as ``src`` into ``dst`` (same mesh).

    Order: free slices first (they shrink what later steps move), then the partial axes
    dst does not keep (reduce-scatter when dst splits a dim along that axis and the dim
    can take it, else all-reduce), then the splits dst does not share — an all-to-all
    when dst splits another dim along that axis next, else an all-gather — then the
    remaining slices. A partial axis in dst must already be partial in src. A segmented
    dim (``ShardingSpec.segments``) is never reduce-scattered into nor moved by an
    all-to-all: a device's part of it is not one run of the dim; all-gathers and slices of
    it are emitted with the reordering they need.
    """
    segmented = frozenset(dict(src.segments)) | frozenset(dict(dst.segments))
    return _plan_steps(src, dst, segmented)


@lru_cache(maxsize=65536)
def _plan_steps(src: ShardingSpec, dst: ShardingSpec, segmented: frozenset) -> tuple[Step, ...]:
    if len(src.dims) != len(dst.dims):
        raise ValueError(f"cannot reshard {src} to {dst}: ranks differ ({len(src.dims)} vs {len(dst.dims)})")
    if not set(dst.partial) <= set(src.partial):
        raise ValueError(
            f"cannot reshard {src} to {dst}: a partial spec is reachable only from a spec partial over the same axes"
        )
    state = [placement_axes(p) for p in src.dims]
    want = [placement_axes(p) for p in dst.dims]
    partial = set(src.partial)
    steps: list[Step] = []

    def used() -> set[int]:
        return {a for axes in state for a in axes} | partial

    def free_slices() -> None:
        for d, target in enumerate(want):
            for a in target[len(state[d]):]:
                if a in used() or not _is_prefix(state[d] + (a,), target):
                    break
                steps.append(Step(SLICE, a, d))
                state[d] = state[d] + (a,)

    free_slices()
    for a in sorted(partial - set(dst.partial)):
        target_dim = next((d for d, target in enumerate(want) if a in target), None)
        partial.discard(a)
        if (target_dim is not None and target_dim not in segmented
                and _is_prefix(state[target_dim] + (a,), want[target_dim])):
            steps.append(Step(REDUCE_SCATTER, a, target_dim))
            state[target_dim] = state[target_dim] + (a,)
        else:
            steps.append(Step(ALL_REDUCE, a))
        free_slices()
    for d in range(len(state)):
        while not _is_prefix(state[d], want[d]):
            axis = state[d][-1]
            # The split moves to a dim that needs this axis next: one all-to-all, not a
            # gather followed by a slice.
            to = next((e for e in range(len(state)) if e != d and _is_prefix(state[e] + (axis,), want[e])), None)
            if d in segmented or to in segmented:
                to = None
            if to is not None:
                steps.append(Step(ALL_TO_ALL, axis, d, to))
                state[to] = state[to] + (axis,)
            else:
                steps.append(Step(ALL_GATHER, axis, d))
            state[d] = state[d][:-1]
    free_slices()
    final = ShardingSpec(tuple(placement_of(axes) for axes in state), tuple(sorted(partial)))
    assert final == dst, f"resharding plan {src} -> {dst} ended at {final}"
    return tuple(steps)


# --- in-memory execution ----------------------------------------------------------------

def apply_steps(locals_: Mapping[Coord, np.ndarray], steps: tuple[Step, ...] | list[Step],
                mesh: LogicalMesh) -> dict[Coord, np.ndarray]:
    """Run resharding steps on every device's local array (the in-memory collectives).

    ``locals_`` maps each coordinate (i, j) of ``mesh`` to its local array; the result
    is a new dict. Devices of one group may share one result array: treat results as
    read-only. Sums run in group-index order, so every device of a group gets the same
    bits.
    """
    n, m = mesh.shape
    expected = {(i, j) for i in range(n) for j in range(m)}
    if set(locals_) != expected:
        raise ValueError(f"local arrays are given for {sorted(locals_)}, mesh {mesh.shape} has {sorted(expected)}")
    current = dict(locals_)
    for step in steps:
        result: dict[Coord, np.ndarray] = {}
        for group in mesh.axis_groups(step.axis):
            coords = [mesh.coord(r) for r in group]
            result.update(zip(coords, step.kind.apply(step, [current[c] for c in coords])))
        current = result
    return current


# --- cost model -----------------------------------------------------------------------

class CollectiveModel:
    """Alpha-beta cost of collectives along the axes of a logical mesh.

    ``links`` gives the link of mesh axis 0 and 1; a collective over both axes (axis 2)
    runs at the slower of the two. With k devices in a group, bandwidth bw and latency
    α of the axis's link (ring algorithms):

    - all-reduce of B bytes (the array each device holds): the faster of the ring,
      2(k−1)/k · B/bw + 2(k−1)·α (a reduce-scatter followed by an all-gather), and
      recursive doubling, ⌈log2 k⌉ · (α + B/bw), which MPI libraries use for short
      messages (on two devices it is one exchange: α + B/bw);
    - all-gather, B = the gathered result per device: (k−1)/k · B/bw + (k−1)·α;
    - reduce-scatter, B = the input per device: (k−1)/k · B/bw + (k−1)·α;
    - all-to-all, B = the tensor across the group (k × what each device holds): each
      device sends k−1 pieces of B/k² bytes, (k−1)/k² · B/bw + (k−1)·α.

    A group of one device costs nothing.
    """

    def __init__(self, links: Mapping[int, LinkSpec]):
        missing = {0, 1} - set(links)
        if missing:
            raise ValueError(f"links are needed for mesh axes 0 and 1; missing {sorted(missing)}")
        self.links = {0: links[0], 1: links[1]}

    def link(self, axis: int) -> LinkSpec:
        if axis in (0, 1):
            return self.links[axis]
        return min(self.links.values(), key=lambda l: (l.bandwidth, -l.latency))

    def _ring(self, nbytes: float, axis: int, mesh: LogicalMesh, rounds: int) -> float:
        k = mesh.axis_size(axis)
        if k == 1:
            return 0.0
        link = self.link(axis)
        return rounds * ((k - 1) / k * nbytes / link.bandwidth + (k - 1) * link.latency)

    def all_reduce_seconds(self, nbytes: float, axis: int, mesh: LogicalMesh) -> float:
        k = mesh.axis_size(axis)
        if k == 1:
            return 0.0
        link = self.link(axis)
        doubling = math.ceil(math.log2(k)) * (link.latency + nbytes / link.bandwidth)
        return min(self._ring(nbytes, axis, mesh, 2), doubling)

    def all_gather_seconds(self, nbytes: float, axis: int, mesh: LogicalMesh) -> float:
        return self._ring(nbytes, axis, mesh, 1)

    def reduce_scatter_seconds(self, nbytes: float, axis: int, mesh: LogicalMesh) -> float:
        return self._ring(nbytes, axis, mesh, 1)

    def all_to_all_seconds(self, nbytes: float, axis: int, mesh: LogicalMesh) -> float:
        k = mesh.axis_size(axis)
        if k == 1:
            return 0.0
        link = self.link(axis)
        return (k - 1) / (k * k) * nbytes / link.bandwidth + (k - 1) * link.latency

    def step_seconds(self, step: Step, local_bytes: float, mesh: LogicalMesh) -> tuple[float, float]:
        """(seconds, local bytes after the step) for a step on ``local_bytes`` per device."""
        return step.kind.seconds(step, self, local_bytes, mesh)


class MeasuredCollectiveModel(CollectiveModel):
    """Collective costs from measurements: ``measured(collective, nbytes, group_size,
    inter_host)`` (a profiled cost model's ``collective_seconds``, with the byte
    conventions above, except that an all-to-all's bytes are one device's send buffer)."""

    def __init__(self, links: Mapping[int, LinkSpec], measured, inter_host: Mapping[int, bool]):
        super().__init__(links)
        self.measured = measured
        self.inter_host = {0: inter_host[0], 1: inter_host[1], BOTH_AXES: inter_host[0] or inter_host[1]}

    def _ask(self, collective: str, nbytes: float, axis: int, mesh: LogicalMesh) -> float:
        k = mesh.axis_size(axis)
        return 0.0 if k == 1 else self.measured(collective, nbytes, k, self.inter_host[axis])

    def all_reduce_seconds(self, nbytes, axis, mesh):
        return self._ask(ALL_REDUCE.name, nbytes, axis, mesh)

    def all_gather_seconds(self, nbytes, axis, mesh):
        return self._ask(ALL_GATHER.name, nbytes, axis, mesh)

    def reduce_scatter_seconds(self, nbytes, axis, mesh):
        return self._ask(REDUCE_SCATTER.name, nbytes, axis, mesh)

    def all_to_all_seconds(self, nbytes, axis, mesh):
        return self._ask(ALL_TO_ALL.name, nbytes / mesh.axis_size(axis), axis, mesh)


def reshard_seconds(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int,
                    mesh: LogicalMesh, model: CollectiveModel) -> float:
    """Estimated time to reshard a tensor of ``shape`` from ``src`` to ``dst``: the sum of its steps.

    ``math.inf`` when no plan exists (dst partial over an axis src is not partial over),
    so that an edge cost table can hold every pair of specs.
    """
    if src == dst:
        return 0.0
    try:
        steps = reshard_steps(src, dst)
    except ValueError:
        if len(src.dims) != len(dst.dims):
            raise
        return math.inf
    local = float(src.local_bytes(tuple(shape), itemsize, mesh))
    total = 0.0
    for step in steps:
        seconds, local = model.step_seconds(step, local, mesh)
        total += seconds
    return total


def axis_links(cluster: Cluster, submesh: tuple[int, int], logical: tuple[int, int]) -> dict[int, LinkSpec]:
    """The link each axis of a logical mesh uses on a physical submesh.

    ``submesh`` is (hosts used, devices per host); the logical (n, m) mesh numbers its
    devices row-major over the submesh's devices (host-major).
    """
    hosts, per_host = submesh
    n, m = logical
    if n * m != hosts * per_host:
        raise ValueError(f"logical mesh {n}x{m} does not have the {hosts * per_host} devices of submesh {hosts}x{per_host}")
    return {axis: cluster.inter_host if crosses else cluster.intra_host
            for axis, crosses in enumerate(_submesh_crossings(per_host, n, m))}


@lru_cache(maxsize=None)
def _submesh_crossings(per_host: int, n: int, m: int) -> tuple[bool, ...]:
    """``_crossings`` of an n×m logical mesh numbered row-major over hosts of ``per_host``
    devices (asked for every layer of every view of the planner's tables: worked out once)."""
    return _crossings(LogicalMesh((n, m), tuple(range(n * m))), lambda rank: rank // per_host)


def mesh_links(cluster: Cluster, mesh: LogicalMesh) -> dict[int, LinkSpec]:
    """The link each axis of ``mesh`` uses, from its ranks' hosts on ``cluster``."""
    return _links(cluster, mesh, cluster.host_of)


def _links(cluster: Cluster, mesh: LogicalMesh, host_of: Callable[[int], int]) -> dict[int, LinkSpec]:
    """An axis whose groups span more than one host uses ``cluster.inter_host``, else
    ``cluster.intra_host``."""
    return {axis: cluster.inter_host if crosses else cluster.intra_host
            for axis, crosses in enumerate(_crossings(mesh, host_of))}


def _crossings(mesh: LogicalMesh, host_of: Callable[[int], int]) -> tuple[bool, ...]:
    """Whether each axis of ``mesh`` has a group of ranks on more than one host."""
    return tuple(any(len({host_of(rank) for rank in group}) > 1 for group in mesh.axis_groups(axis))
                 for axis in (0, 1))
