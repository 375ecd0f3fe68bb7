"""Where a plan keeps each state (``plan.state``): its layout, its pieces, and how a whole
state is cut into them and put back together.

A state entry records the printed spec it is held in and, where a split dim holds heads
in segments (a key/value cache of fewer heads than devices: each head held by the devices
whose query heads read it), those segments: ``{"segments": [[dim, [[size, heads], …]], …]}``.
The spec alone would cut such a dim into contiguous runs, which is not what the programs
hold. Every reader of a state (the job on each rank, the in-process executor, ``meshplan
run``) takes its layout from here.
"""

from __future__ import annotations

import numpy as np

from meshplan.plan_format import Plan, local_name, state_segments
from meshplan.sharding import LogicalMesh, ShardingSpec, put, take


def state_spec(entry: dict) -> ShardingSpec:
    """The layout a state is held in, with its segmented dims."""
    spec = ShardingSpec.parse(entry["spec"])
    segments = state_segments(entry)
    return spec.with_segments(segments) if segments else spec


def state_updates(plan: Plan) -> dict[str, str]:
    """A training plan's state outputs → the inputs they are the new values of, by the local
    names a rank's program gives them (what ``ProgramRunner(updates=...)`` may write in
    place); none for other plans (a cache is written in place by its own rule)."""
    if not plan.training:
        return {}
    return {local_name(e["output"], state_spec(e)): local_name(e["input"], state_spec(e)) for e in plan.state}


def state_mesh(plan: Plan, entry: dict) -> LogicalMesh:
    stage = plan.stages[entry["stage"]]
    return LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))


def piece_of(whole: np.ndarray, spec: ShardingSpec, mesh: LogicalMesh, rank: int) -> np.ndarray:
    """The part of ``whole`` that ``rank`` holds, C-contiguous."""
    return np.ascontiguousarray(take(whole, spec.local_slices(whole.shape, mesh, mesh.coord(rank))))


def whole_shape(local_shape, spec: ShardingSpec, mesh: LogicalMesh) -> tuple[int, ...]:
    """The whole tensor's shape from one piece's."""
    shape = []
    for dim, size in enumerate(local_shape):
        segments = spec.segmented(dim, mesh)
        shape.append(sum(s for s, _ in segments) if segments is not None else int(size) * spec.shards(dim, mesh))
    return tuple(shape)


def distinct_holders(plan: Plan, entry: dict) -> list[int]:
    """One rank per distinct piece of the state (the lowest that holds it): a replicated dim,
    or a key/value head held by several ranks, is sent once."""
    spec, mesh = state_spec(entry), state_mesh(plan, entry)
    chosen, seen = [], set()
    probe = tuple(_probe_size(spec, d, mesh) for d in range(len(spec.dims)))
    for rank in plan.stages[entry["stage"]].devices:
        key = tuple(tuple(np.arange(n)[s].tolist()) if isinstance(s, slice) else tuple(s.tolist())
                    for n, s in zip(probe, spec.local_slices(probe, mesh, mesh.coord(rank))))
        if key not in seen:
            seen.add(key)
            chosen.append(rank)
    return chosen


def _probe_size(spec: ShardingSpec, dim: int, mesh: LogicalMesh) -> int:
    """A size of ``dim`` that the layout splits as it splits the real one."""
    segments = spec.segmented(dim, mesh)
    return sum(s for s, _ in segments) if segments is not None else spec.shards(dim, mesh)


def assemble(pieces: dict[int, np.ndarray], spec: ShardingSpec, mesh: LogicalMesh) -> np.ndarray:
    """The whole tensor from pieces (rank → its piece) that together cover it."""
    first = next(iter(pieces.values()))
    shape = whole_shape(first.shape, spec, mesh)
    whole = np.empty(shape, dtype=first.dtype)
    for rank, piece in pieces.items():
        put(whole, spec.local_slices(shape, mesh, mesh.coord(rank)), piece)
    return whole


def cache_position_axis(ndim: int) -> int:
    """The positions' axis of a key/value cache state: 2 of a 4-D one ([batch, heads,
    positions, head size]), else the second last."""
    return 2 if ndim == 4 else ndim - 2


def copy_cache_rows(array: np.ndarray, source: int, target: int, positions: int) -> None:
    """In place: the first ``positions`` positions of cache row ``source`` into row ``target``."""
    into = [target] + [slice(None)] * (array.ndim - 1)
    into[cache_position_axis(array.ndim)] = slice(0, positions)
    array[tuple(into)] = array[tuple([source] + into[1:])]
