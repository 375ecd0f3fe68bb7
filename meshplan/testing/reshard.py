"""Oracles for resharding tests: a full tensor to per-device arrays of a spec and back.

``shard`` and ``unshard`` convert between a full tensor and the local arrays of every
coordinate of a logical mesh; ``simulate`` runs ``steps.apply_steps`` from a full tensor.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from meshplan.reshard.steps import Coord, Step, apply_steps
from meshplan.sharding import LogicalMesh, ShardingSpec, put, take


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


def _coords(mesh: LogicalMesh) -> list[Coord]:
    n, m = mesh.shape
    return [(i, j) for i in range(n) for j in range(m)]


def shard(full: np.ndarray, spec: ShardingSpec, mesh: LogicalMesh) -> dict[Coord, np.ndarray]:
    """Each device's local array of ``full`` laid out as ``spec``.

    A partial spec splits the value into unequal addends (see ``_addends``), one per
    position along the partial axes; devices that differ only along other axes hold
    the same addend.
    """
    full = np.asarray(full)
    if not spec.is_valid_for(full.shape, mesh):
        raise ValueError(f"spec {spec} does not fit shape {full.shape} on mesh {mesh.shape}")
    addends = _addends(full, mesh.position((0, 0), spec.partial)[1])
    return {c: take(addends[mesh.position(c, spec.partial)[0]], spec.local_slices(full.shape, mesh, c)).copy()
            for c in _coords(mesh)}


def unshard(locals_: Mapping[Coord, np.ndarray], spec: ShardingSpec, mesh: LogicalMesh) -> np.ndarray:
    """The full tensor: splits concatenated, partial addends summed in order."""
    first = np.asarray(locals_[(0, 0)])
    if first.ndim != len(spec.dims):
        raise ValueError(f"local arrays have rank {first.ndim}, spec {spec} has rank {len(spec.dims)}")
    def full_size(d: int, size: int) -> int:
        segmented = spec.segmented(d, mesh)
        return sum(s for s, _ in segmented) if segmented else size * spec.shards(d, mesh)

    shape = tuple(full_size(d, size) for d, size in enumerate(first.shape))
    pieces: dict[int, np.ndarray] = {}
    for c in _coords(mesh):
        index = mesh.position(c, spec.partial)[0]
        if index not in pieces:
            pieces[index] = np.empty(shape, dtype=first.dtype)
        put(pieces[index], spec.local_slices(shape, mesh, c), locals_[c])
    total = pieces[0].copy()
    for k in sorted(pieces)[1:]:
        total += pieces[k]
    return total


def simulate(value: np.ndarray | Mapping[Coord, np.ndarray], steps: tuple[Step, ...] | list[Step],
             mesh: LogicalMesh, src: ShardingSpec | None = None) -> dict[Coord, np.ndarray]:
    """``apply_steps`` on a full tensor laid out as ``src`` (default replicated) or on local arrays."""
    if isinstance(value, Mapping):
        return apply_steps(value, steps, mesh)
    value = np.asarray(value)
    return apply_steps(shard(value, src or ShardingSpec.replicated(value.ndim), mesh), steps, mesh)
