"""Resharding inside one logical mesh: plan the collectives, run them in memory, cost them.

A plan is a tuple of ``Step`` values (``reshard_steps``, cached: specs are hashable).
``apply_steps`` executes a plan on every device's local array in one process: it is the
reference semantics of the steps and what the in-process executor runs. ``shard`` and
``unshard`` convert between a full tensor and the per-device arrays of a spec.
``CollectiveModel`` prices the steps with an alpha-beta (latency-bandwidth) model per
mesh axis; ``axis_links`` says which link each logical axis of a submesh uses.

Step semantics, for the device at (i, j) of an (n, m) mesh. The *group* of an axis is
the devices that differ only in that axis's coordinate (axis 2: the whole mesh), and a
device's index in its group is i (axis 0), j (axis 1) or i*m + j (axis 2):

- ``all_reduce(axis)``: every device gets the sum over its group; removes that partial axis.
- ``all_gather(axis, dim)``: every device gets the group's arrays concatenated along
  ``dim`` in group-index order.
- ``reduce_scatter(axis, dim)``: the group's sum, cut into k equal chunks along ``dim``;
  the device keeps the chunk at its group index.
- ``slice(axis, dim)``: no communication; the device keeps the chunk of ``dim`` at its
  group index.

A dimension split S01 holds chunk i*m + j: S0 refined by axis 1. So S01 → R gathers
axis 1 (giving S0) and then axis 0; R → S01 slices axis 0 and then axis 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np

from meshplan.cost.cluster import Cluster, LinkSpec
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SLICE = "all_reduce", "all_gather", "reduce_scatter", "slice"
ALL_TO_ALL = "all_to_all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SLICE, ALL_TO_ALL)
BOTH_AXES = 2

Coord = tuple[int, int]


@dataclass(frozen=True)
class Step:
    kind: str                 # one of KINDS
    axis: int                 # mesh axis 0, 1, or 2 for both axes (whole mesh)
    dim: int | None = None    # tensor dim (None for all_reduce)
    to_dim: int | None = None  # all_to_all only: the dim the split moves to (from ``dim``)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown resharding step kind {self.kind!r} (known: {', '.join(KINDS)})")
        if self.axis not in (0, 1, BOTH_AXES):
            raise ValueError(f"step {self.kind} has mesh axis {self.axis}; expected 0, 1 or 2 (both)")
        if (self.dim is None) != (self.kind == ALL_REDUCE):
            raise ValueError(f"step {self.kind} {'needs' if self.dim is None else 'takes no'} tensor dim")
        if (self.to_dim is None) != (self.kind != ALL_TO_ALL) or (self.to_dim is not None and self.to_dim == self.dim):
            raise ValueError(f"step {self.kind}: to_dim is for all_to_all only, and differs from dim")

    def __str__(self) -> str:
        if self.kind == ALL_TO_ALL:
            return f"{self.kind}(axis={self.axis}, dim={self.dim}->{self.to_dim})"
        return f"{self.kind}(axis={self.axis})" if self.dim is None else f"{self.kind}(axis={self.axis}, dim={self.dim})"


# --- planning ------------------------------------------------------------------------

_AXES = {R: (), S0: (0,), S1: (1,), S01: (0, 1)}
_PLACEMENT = {axes: p for p, axes in _AXES.items()}


def _is_prefix(axes: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return target[: len(axes)] == axes


@lru_cache(maxsize=65536)
def reshard_steps(src: ShardingSpec, dst: ShardingSpec) -> tuple[Step, ...]:
    """The collectives that turn a tensor laid out as ``src`` into ``dst`` (same mesh).

    Order: free slices first (they shrink what later steps move), then the partial axes
    dst does not keep (reduce-scatter when dst splits a dim along that axis and the dim
    can take it, else all-reduce), then the splits dst does not share — an all-to-all
    when dst splits another dim along that axis next, else an all-gather — then the
    remaining slices. A partial axis in dst must already be partial in src.
    """
    if len(src.dims) != len(dst.dims):
        raise ValueError(f"cannot reshard {src} to {dst}: ranks differ ({len(src.dims)} vs {len(dst.dims)})")
    if not set(dst.partial) <= set(src.partial):
        raise ValueError(
            f"cannot reshard {src} to {dst}: a partial spec is reachable only from a spec partial over the same axes"
        )
    state = [_AXES[p] for p in src.dims]
    want = [_AXES[p] for p in dst.dims]
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
        if target_dim is not None and _is_prefix(state[target_dim] + (a,), want[target_dim]):
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
            if to is not None:
                steps.append(Step(ALL_TO_ALL, axis, d, to))
                state[to] = state[to] + (axis,)
            else:
                steps.append(Step(ALL_GATHER, axis, d))
            state[d] = state[d][:-1]
    free_slices()
    final = ShardingSpec(tuple(_PLACEMENT[axes] for axes in state), tuple(sorted(partial)))
    assert final == dst, f"resharding plan {src} -> {dst} ended at {final}"
    return tuple(steps)


# --- in-memory execution ----------------------------------------------------------------

def _groups(axis: int, mesh: LogicalMesh) -> list[list[Coord]]:
    """Device coordinates of each group of ``axis``, in group-index order."""
    n, m = mesh.shape
    if axis == 0:
        return [[(i, j) for i in range(n)] for j in range(m)]
    if axis == 1:
        return [[(i, j) for j in range(m)] for i in range(n)]
    return [[(i, j) for i in range(n) for j in range(m)]]


def _check_split(array: np.ndarray, k: int, dim: int, step: Step) -> int:
    if array.ndim <= dim or array.shape[dim] % k:
        raise ValueError(f"{step}: dim {dim} of local shape {array.shape} does not split into {k}")
    return array.shape[dim] // k


def _chunks(array: np.ndarray, k: int, dim: int, step: Step) -> list[np.ndarray]:
    _check_split(array, k, dim, step)
    return [c.copy() for c in np.split(array, k, axis=dim)]


def _chunk(array: np.ndarray, k: int, index: int, dim: int, step: Step) -> np.ndarray:
    size = _check_split(array, k, dim, step)
    if k == 1:
        return array
    where = (slice(None),) * dim + (slice(index * size, (index + 1) * size),)
    return array[where].copy()


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
        for group in _groups(step.axis, mesh):
            arrays = [current[c] for c in group]
            k = len(group)
            if step.kind == ALL_REDUCE:
                total = _sum(arrays)
                result.update((c, total) for c in group)
            elif step.kind == ALL_GATHER:
                whole = np.concatenate(arrays, axis=step.dim) if k > 1 else arrays[0]
                result.update((c, whole) for c in group)
            elif step.kind == REDUCE_SCATTER:
                result.update(zip(group, _chunks(_sum(arrays), k, step.dim, step)))
            elif step.kind == ALL_TO_ALL:
                pieces = [_chunks(a, k, step.to_dim, step) for a in arrays]   # pieces[j][i]: from j to i
                for index, c in enumerate(group):
                    parts = [pieces[j][index] for j in range(k)]
                    result[c] = np.concatenate(parts, axis=step.dim) if k > 1 else parts[0]
            else:  # SLICE
                for index, c in enumerate(group):
                    result[c] = _chunk(arrays[index], k, index, step.dim, step)
        current = result
    return current


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total


def _partial_index(spec: ShardingSpec, mesh: LogicalMesh, coord: Coord) -> tuple[int, int]:
    """(index among the addends, number of addends) of the device at ``coord``."""
    i, j = coord
    n, m = mesh.shape
    return {(): (0, 1), (0,): (i, n), (1,): (j, m), (0, 1): (i * m + j, n * m)}[spec.partial]


def _addends(full: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` deterministic, unequal arrays whose sum (in order) is ``full``.

    The addends after the first are small integers, so for integer-valued data the sum
    is exact in floating point too. Booleans cannot be summed: the first holds the value.
    """
    if count == 1:
        return [full]
    if full.dtype == np.bool_:
        return [full] + [np.zeros_like(full) for _ in range(count - 1)]
    base = np.arange(full.size, dtype=np.int64).reshape(full.shape)
    rest = [((base * (p + 2) + 3 * p + 1) % 7 - 3).astype(full.dtype) for p in range(1, count)]
    first = full.copy()
    for r in rest:
        first -= r
    return [first] + rest


def shard(full: np.ndarray, spec: ShardingSpec, mesh: LogicalMesh) -> dict[Coord, np.ndarray]:
    """Each device's local array of ``full`` laid out as ``spec``.

    A partial spec splits the value into unequal addends (see ``_addends``), one per
    position along the partial axes; devices that differ only along other axes hold
    the same addend.
    """
    full = np.asarray(full)
    if not spec.is_valid_for(full.shape, mesh):
        raise ValueError(f"spec {spec} does not fit shape {full.shape} on mesh {mesh.shape}")
    n, m = mesh.shape
    count = _partial_index(spec, mesh, (n - 1, m - 1))[1]
    addends = _addends(full, count)
    out = {}
    for i in range(n):
        for j in range(m):
            part = addends[_partial_index(spec, mesh, (i, j))[0]]
            out[(i, j)] = part[spec.local_slices(full.shape, mesh, (i, j)) + (...,)].copy()
    return out


def unshard(locals_: Mapping[Coord, np.ndarray], spec: ShardingSpec, mesh: LogicalMesh) -> np.ndarray:
    """The full tensor: splits concatenated, partial addends summed."""
    n, m = mesh.shape
    first = np.asarray(locals_[(0, 0)])
    if first.ndim != len(spec.dims):
        raise ValueError(f"local arrays have rank {first.ndim}, spec {spec} has rank {len(spec.dims)}")
    shape = tuple(size * spec.shards(d, mesh) for d, size in enumerate(first.shape))
    pieces: dict[int, np.ndarray] = {}
    for i in range(n):
        for j in range(m):
            index = _partial_index(spec, mesh, (i, j))[0]
            if index not in pieces:
                pieces[index] = np.empty(shape, dtype=first.dtype)
            pieces[index][spec.local_slices(shape, mesh, (i, j))] = locals_[(i, j)]
    return _sum([pieces[k] for k in sorted(pieces)])


def simulate(value: np.ndarray | Mapping[Coord, np.ndarray], steps: tuple[Step, ...] | list[Step],
             mesh: LogicalMesh, src: ShardingSpec | None = None) -> dict[Coord, np.ndarray]:
    """``apply_steps`` on a full tensor laid out as ``src`` (default replicated) or on local arrays."""
    if isinstance(value, Mapping):
        return apply_steps(value, steps, mesh)
    value = np.asarray(value)
    return apply_steps(shard(value, src or ShardingSpec.replicated(value.ndim), mesh), steps, mesh)


# --- cost model -----------------------------------------------------------------------

class CollectiveModel:
    """Alpha-beta cost of collectives along the axes of a logical mesh.

    ``links`` gives the link of mesh axis 0 and 1; a collective over both axes (axis 2)
    runs at the slower of the two. With k devices in a group, bandwidth bw and latency
    α of the axis's link (ring algorithms):

    - all-reduce of B bytes (the array each device holds): 2(k−1)/k · B/bw + 2(k−1)·α
      (a reduce-scatter followed by an all-gather);
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
        return self._ring(nbytes, axis, mesh, 2)

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
        k = mesh.axis_size(step.axis)
        if step.kind == ALL_REDUCE:
            return self.all_reduce_seconds(local_bytes, step.axis, mesh), local_bytes
        if step.kind == ALL_GATHER:
            return self.all_gather_seconds(local_bytes * k, step.axis, mesh), local_bytes * k
        if step.kind == REDUCE_SCATTER:
            return self.reduce_scatter_seconds(local_bytes, step.axis, mesh), local_bytes / k
        if step.kind == ALL_TO_ALL:
            return self.all_to_all_seconds(local_bytes * k, step.axis, mesh), local_bytes
        return 0.0, local_bytes / k


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
        return self._ask("all_reduce", nbytes, axis, mesh)

    def all_gather_seconds(self, nbytes, axis, mesh):
        return self._ask("all_gather", nbytes, axis, mesh)

    def reduce_scatter_seconds(self, nbytes, axis, mesh):
        return self._ask("reduce_scatter", nbytes, axis, mesh)

    def all_to_all_seconds(self, nbytes, axis, mesh):
        return self._ask("all_to_all", nbytes / mesh.axis_size(axis), axis, mesh)


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
    devices row-major over the submesh's devices (host-major). An axis whose groups span
    more than one host uses ``cluster.inter_host``, else ``cluster.intra_host``.
    """
    hosts, per_host = submesh
    n, m = logical
    if n * m != hosts * per_host:
        raise ValueError(f"logical mesh {n}x{m} does not have the {hosts * per_host} devices of submesh {hosts}x{per_host}")
    links = {}
    for axis, groups in ((0, [[i * m + j for i in range(n)] for j in range(m)]),
                         (1, [[i * m + j for j in range(m)] for i in range(n)])):
        crosses = any(len({rank // per_host for rank in group}) > 1 for group in groups)
        links[axis] = cluster.inter_host if crosses else cluster.intra_host
    return links
