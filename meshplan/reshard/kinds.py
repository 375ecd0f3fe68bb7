"""The kinds of intra-mesh resharding step; each kind owns its semantics.

For a ``Step`` (kind, mesh axis, tensor ``dim``, all-to-all's ``to_dim``) a kind says:

- ``spec_after``: the layout the step leaves behind;
- ``seconds``: its cost under a collective model (``steps.CollectiveModel``);
- ``apply``: its numpy semantics on one group's arrays, in group-index order (the
  reference that ``steps.apply_steps`` runs);
- ``emit``: the node a program gets for it, through the program builder's
  ``collective(step, source, out)`` or ``local_slice(step, source, out)``;
- ``perform``: how a rank runs it, through a communicator of the step's axis group
  (duck-typed: ``all_reduce(x, spare)``, ``all_gather(x, dim)``, ``reduce_scatter(x, dim)``,
  ``all_to_all(x, dim, to_dim)``, ``slice(x, dim)``; ``runtime.collectives`` has the MPI one);
  ``spare``: nothing reads ``x`` afterwards, so a step may write its result into it.

``name`` is the step's string in plan.json, ``op_type`` its collective node in the
``meshplan`` domain (``None`` for a local slice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from meshplan.sharding import ShardingSpec


class StepKind(ABC):
    name: str
    op_type: str | None = None
    takes_dim = True          # the step names a tensor dim
    takes_to_dim = False      # all-to-all only: the dim the split moves to

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<step kind {self.name}>"

    @abstractmethod
    def spec_after(self, step, spec: ShardingSpec) -> ShardingSpec:
        ...

    @abstractmethod
    def seconds(self, step, model, local_bytes: float, mesh) -> tuple[float, float]:
        """(seconds, local bytes after the step) for ``local_bytes`` per device."""

    @abstractmethod
    def apply(self, step, arrays: list[np.ndarray]) -> list[np.ndarray]:
        ...

    def emit(self, step, program, source: str, out: str) -> None:
        program.collective(step, source, out)

    @abstractmethod
    def perform(self, step, x, group, spare=False):
        ...


class AllReduce(StepKind):
    """Every device gets the sum over its group; the partial axis goes."""

    name, op_type, takes_dim = "all_reduce", "AllReduce", False

    def spec_after(self, step, spec):
        return spec.reduced(step.axis)

    def seconds(self, step, model, local_bytes, mesh):
        return model.all_reduce_seconds(local_bytes, step.axis, mesh), local_bytes

    def apply(self, step, arrays):
        return [_sum(arrays)] * len(arrays)

    def perform(self, step, x, group, spare=False):
        return group.all_reduce(x, spare)


class AllGather(StepKind):
    """Every device gets the group's arrays concatenated along ``dim`` in group-index order."""

    name, op_type = "all_gather", "AllGather"

    def spec_after(self, step, spec):
        return spec.coarsened(step.dim, step.axis)

    def seconds(self, step, model, local_bytes, mesh):
        k = mesh.axis_size(step.axis)
        return model.all_gather_seconds(local_bytes * k, step.axis, mesh), local_bytes * k

    def apply(self, step, arrays):
        return [np.concatenate(arrays, axis=step.dim) if len(arrays) > 1 else arrays[0]] * len(arrays)

    def perform(self, step, x, group, spare=False):
        return group.all_gather(x, step.dim)


class ReduceScatter(StepKind):
    """The group's sum cut into k chunks along ``dim``; a device keeps the chunk at its group index."""

    name, op_type = "reduce_scatter", "ReduceScatter"

    def spec_after(self, step, spec):
        return spec.reduced(step.axis).refined(step.dim, step.axis)

    def seconds(self, step, model, local_bytes, mesh):
        return model.reduce_scatter_seconds(local_bytes, step.axis, mesh), local_bytes / mesh.axis_size(step.axis)

    def apply(self, step, arrays):
        return _chunks(_sum(arrays), len(arrays), step.dim, step)

    def perform(self, step, x, group, spare=False):
        return group.reduce_scatter(x, step.dim)


class AllToAll(StepKind):
    """The split moves from ``dim`` to ``to_dim``: chunk i of ``to_dim`` goes to member i,
    which concatenates what it receives along ``dim``."""

    name, op_type, takes_to_dim = "all_to_all", "AllToAll", True

    def spec_after(self, step, spec):
        return spec.coarsened(step.dim, step.axis).refined(step.to_dim, step.axis)

    def seconds(self, step, model, local_bytes, mesh):
        k = mesh.axis_size(step.axis)
        return model.all_to_all_seconds(local_bytes * k, step.axis, mesh), local_bytes

    def apply(self, step, arrays):
        k = len(arrays)
        pieces = [_chunks(a, k, step.to_dim, step) for a in arrays]   # pieces[j][i]: from j to i
        received = [[pieces[j][i] for j in range(k)] for i in range(k)]
        return [np.concatenate(parts, axis=step.dim) if k > 1 else parts[0] for parts in received]

    def perform(self, step, x, group, spare=False):
        return group.all_to_all(x, step.dim, step.to_dim)


class Slice(StepKind):
    """No communication: a device keeps the chunk of ``dim`` at its group index."""

    name = "slice"

    def spec_after(self, step, spec):
        return spec.refined(step.dim, step.axis)

    def seconds(self, step, model, local_bytes, mesh):
        return 0.0, local_bytes / mesh.axis_size(step.axis)

    def apply(self, step, arrays):
        k = len(arrays)
        return [_chunk(a, k, index, step.dim, step) for index, a in enumerate(arrays)]

    def emit(self, step, program, source, out):
        program.local_slice(step, source, out)

    def perform(self, step, x, group, spare=False):
        return group.slice(x, step.dim)


ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SLICE = AllReduce(), AllGather(), ReduceScatter(), AllToAll(), Slice()
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SLICE, ALL_TO_ALL)
_BY_NAME = {k.name: k for k in KINDS}
_BY_OP_TYPE = {k.op_type: k for k in KINDS if k.op_type}


def step_kind(name: str) -> StepKind:
    """The kind named ``name`` in plan.json."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown resharding step kind {name!r} (known: {', '.join(_BY_NAME)})") from None


def kind_of_op(op_type: str) -> StepKind:
    """The kind whose collective node is ``op_type``."""
    try:
        return _BY_OP_TYPE[op_type]
    except KeyError:
        raise ValueError(f"unknown collective {op_type} (known: {', '.join(_BY_OP_TYPE)})") from None


def _check_split(array: np.ndarray, k: int, dim: int, step) -> int:
    if array.ndim <= dim or array.shape[dim] % k:
        raise ValueError(f"{step}: dim {dim} of local shape {array.shape} does not split into {k}")
    return array.shape[dim] // k


def _chunks(array: np.ndarray, k: int, dim: int, step) -> list[np.ndarray]:
    _check_split(array, k, dim, step)
    return [c.copy() for c in np.split(array, k, axis=dim)]


def _chunk(array: np.ndarray, k: int, index: int, dim: int, step) -> np.ndarray:
    size = _check_split(array, k, dim, step)
    if k == 1:
        return array
    where = (slice(None),) * dim + (slice(index * size, (index + 1) * size),)
    return array[where].copy()


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total
