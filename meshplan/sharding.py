"""Sharding specs: how a tensor is laid out over a 2-D logical mesh.

For each tensor dimension a spec says R (replicated), S0 / S1 (split along mesh axis 0 /
1) or S01 (split along both, axis 0 major); a spec can also be *partial* over one or both
mesh axes (each device holds an addend; a sum over those axes completes the tensor).
Printed forms: ``S0R``, ``RS1``, ``S01R``, ``RR+P1`` (partial over axis 1), ``R+P01``.

A ``LogicalMesh`` is a view of a physical submesh as an (n, m) grid of ranks, row-major:
the device at coordinate (i, j) is ``ranks[i * m + j]``. A collective's mesh axis is 0, 1
or ``BOTH_AXES`` (2: the whole mesh, axis 0 major).

A placement is the tuple of mesh axes that split a dimension, major first (R: (), S0:
(0,), S1: (1,), S01: (0, 1)); ``placement_axes`` and ``placement_of`` convert.
"""

from __future__ import annotations

from functools import lru_cache

import re
from dataclasses import dataclass, field
from math import prod

import numpy as np

R, S0, S1, S01 = "R", "S0", "S1", "S01"
PLACEMENTS = (R, S0, S1, S01)
BOTH_AXES = 2
_TOKEN = re.compile(r"S01|S0|S1|R")
_AXES = {R: (), S0: (0,), S1: (1,), S01: (0, 1)}
_PLACEMENT = {axes: p for p, axes in _AXES.items()}


def placement_axes(placement: str) -> tuple[int, ...]:
    """The mesh axes that split a dimension placed as ``placement``, major first."""
    return _AXES[placement]


def placement_of(axes: tuple[int, ...]) -> str:
    """The placement that splits along ``axes`` (major first); ValueError if there is none."""
    try:
        return _PLACEMENT[tuple(axes)]
    except KeyError:
        raise ValueError(f"no placement splits along mesh axes {tuple(axes)} in that order") from None


def mesh_axes(axis: int) -> tuple[int, ...]:
    """The mesh axes a collective along ``axis`` spans: (0, 1) for ``BOTH_AXES``."""
    return (0, 1) if axis == BOTH_AXES else (axis,)


@dataclass(frozen=True)
class LogicalMesh:
    shape: tuple[int, int]
    ranks: tuple[int, ...]

    def __post_init__(self):
        n, m = self.shape
        if n < 1 or m < 1 or len(self.ranks) != n * m:
            raise ValueError(f"logical mesh {self.shape} needs {n * m} ranks, got {len(self.ranks)}")

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def coord(self, rank: int) -> tuple[int, int]:
        index = self.ranks.index(rank)
        return divmod(index, self.shape[1])

    def axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """Groups of ranks that communicate along ``axis`` (0, 1, or 2 meaning both axes)."""
        n, m = self.shape
        if axis == 0:
            return [tuple(self.ranks[i * m + j] for i in range(n)) for j in range(m)]
        if axis == 1:
            return [tuple(self.ranks[i * m + j] for j in range(m)) for i in range(n)]
        return [tuple(self.ranks)]

    def axis_size(self, axis: int) -> int:
        return prod(self.shape[a] for a in mesh_axes(axis))

    def position(self, coord: tuple[int, int], axes: tuple[int, ...]) -> tuple[int, int]:
        """(index, count): where the device at ``coord`` stands among the devices that
        differ from it only along ``axes`` (major first), and how many there are."""
        index = 0
        for a in axes:
            index = index * self.shape[a] + coord[a]
        return index, prod(self.shape[a] for a in axes)

    def axis_index(self, coord: tuple[int, int], axis: int) -> int:
        """The device's index in its group along ``axis`` (0, 1 or ``BOTH_AXES``)."""
        return self.position(coord, mesh_axes(axis))[0]

    def group_index(self, coord: tuple[int, int], axis: int) -> int:
        """Which group along ``axis`` the device belongs to (its index along the other axes)."""
        return self.position(coord, tuple(a for a in (0, 1) if a not in mesh_axes(axis)))[0]


# A dim's segments: ((size, heads), ...) in order, summing to the dim's size.
Segments = tuple[tuple[int, int], ...]


def segment_count(heads: int, shards: int) -> int:
    """How many chunks a segment of ``heads`` heads is cut into over ``shards`` devices:
    one per device, or one per head where there are fewer heads than devices (each head
    then held by ``shards / heads`` devices)."""
    return min(heads, shards)


def segments_fit(segments: Segments, shards: int) -> bool:
    """Every segment splits over ``shards`` devices in whole heads (or whole heads each
    held by an equal number of devices)."""
    for size, heads in segments:
        count = segment_count(heads, shards)
        if heads < 1 or size % heads or heads % count or shards % count:
            return False
    return True


def segment_indices(segments: Segments, index: int, shards: int) -> np.ndarray:
    """The positions along a segmented dim held by device ``index`` of ``shards``: in each
    segment, chunk ``index * count // shards`` of its ``count`` equal chunks, concatenated."""
    pieces, offset = [], 0
    for size, heads in segments:
        count = segment_count(heads, shards)
        chunk = size // count
        start = offset + (index * count // shards) * chunk
        pieces.append(np.arange(start, start + chunk))
        offset += size
    return np.concatenate(pieces)


@dataclass(frozen=True)
class ShardingSpec:
    """``segments`` (dim → its segments) describes the tensor, not the layout: a split of a
    segmented dim holds a chunk of every segment (a packed QKV projection split by heads:
    each device its query, key and value columns), and a segment of fewer heads than
    devices has each head held by several devices (key/value heads shared by the devices
    whose query heads read them). Every spec of one tensor carries the same segments, so
    they take no part in equality or in the printed form."""

    dims: tuple[str, ...]
    partial: tuple[int, ...] = ()     # mesh axes the tensor is a partial sum over, sorted
    segments: tuple[tuple[int, Segments], ...] = field(default=(), compare=False)

    def __post_init__(self):
        for placement in self.dims:
            if placement not in PLACEMENTS:
                raise ValueError(f"bad placement {placement!r} in spec {self.dims}")
        used = [a for p in self.dims for a in placement_axes(p)]
        if len(used) != len(set(used)):
            raise ValueError(f"spec {self} splits more than one dimension along the same mesh axis")
        if set(used) & set(self.partial):
            raise ValueError(f"spec {self} is both split and partial along the same mesh axis")
        if tuple(sorted(set(self.partial))) != self.partial or not set(self.partial) <= {0, 1}:
            raise ValueError(f"bad partial axes {self.partial}")

    # --- construction and printing ---------------------------------------------------

    @classmethod
    def of(cls, spec: "ShardingSpec | str") -> "ShardingSpec":
        """``spec`` itself, or parsed from its printed form."""
        return cls.parse(spec) if isinstance(spec, str) else spec

    @classmethod
    def replicated(cls, rank: int) -> "ShardingSpec":
        return cls((R,) * rank)

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        """'S0R' → (S0, R); 'RR+P1' → partial over axis 1; '()', '' or '()+P0' for 0-d tensors."""
        body, _, partial = text.partition("+P")
        body = "" if body == "()" else body      # a 0-d tensor's spec prints as ()
        tokens = _TOKEN.findall(body)
        if "".join(tokens) != body:
            raise ValueError(f"cannot parse sharding spec {text!r}")
        axes = tuple(int(c) for c in partial) if partial else ()
        return cls(tuple(tokens), tuple(sorted(axes)))

    def __str__(self) -> str:
        text = "".join(self.dims) or "()"
        return text + (f"+P{''.join(map(str, self.partial))}" if self.partial else "")

    # --- properties ------------------------------------------------------------------

    @property
    def is_replicated(self) -> bool:
        return all(p == R for p in self.dims) and not self.partial

    def split_axes(self) -> dict[int, int]:
        """Mesh axis → tensor dim it splits."""
        return {axis: dim for dim, p in enumerate(self.dims) for axis in placement_axes(p)}

    def dim_axes(self, dim: int) -> tuple[int, ...]:
        """The mesh axes that split dimension ``dim``, major first."""
        return placement_axes(self.dims[dim])

    def with_segments(self, segments) -> "ShardingSpec":
        """The same layout of a tensor whose dims have ``segments`` (dim → segments)."""
        found = tuple(sorted((int(d), tuple(segs)) for d, segs in dict(segments).items() if d < len(self.dims)))
        return ShardingSpec(self.dims, self.partial, found)

    def segments_of(self, dim: int) -> Segments | None:
        return dict(self.segments).get(dim)

    def _like(self, dims, partial) -> "ShardingSpec":
        return ShardingSpec(tuple(dims), tuple(partial), self.segments)

    def refined(self, dim: int, axis: int) -> "ShardingSpec":
        """``dim`` split further along mesh ``axis`` (0, 1 or ``BOTH_AXES``), as the minor
        split; ValueError if no placement does that."""
        placement = placement_of(self.dim_axes(dim) + mesh_axes(axis))
        return self._like(self.dims[:dim] + (placement,) + self.dims[dim + 1:], self.partial)

    def coarsened(self, dim: int, axis: int) -> "ShardingSpec":
        """``dim`` no longer split along mesh ``axis``, its minor split; ValueError otherwise."""
        axes, removed = self.dim_axes(dim), mesh_axes(axis)
        if axes[len(axes) - len(removed):] != removed:
            raise ValueError(f"dimension {dim} of {self} is not split last along mesh axis {axis}")
        placement = placement_of(axes[:len(axes) - len(removed)])
        return self._like(self.dims[:dim] + (placement,) + self.dims[dim + 1:], self.partial)

    def reduced(self, axis: int) -> "ShardingSpec":
        """No longer partial along mesh ``axis`` (0, 1 or ``BOTH_AXES``)."""
        return self._like(self.dims, tuple(a for a in self.partial if a not in mesh_axes(axis)))

    def normalised(self, mesh: LogicalMesh) -> "ShardingSpec":
        """The same layout without splits along mesh axes of size 1."""
        def placement(p: str) -> str:
            return placement_of(tuple(a for a in placement_axes(p) if mesh.shape[a] > 1))

        return self._like(tuple(placement(p) for p in self.dims), self.partial)

    def shards(self, dim: int, mesh: LogicalMesh) -> int:
        return prod(mesh.axis_size(a) for a in self.dim_axes(dim))

    def segmented(self, dim: int, mesh: LogicalMesh) -> Segments | None:
        """The segments of ``dim`` where they change what a split holds, else None."""
        segments = self.segments_of(dim) if self.segments else None
        shards = self.shards(dim, mesh)
        if segments is None or shards == 1:
            return None
        if len(segments) == 1 and segment_count(segments[0][1], shards) == shards:
            return None   # one segment cut once per device: the plain split
        return segments

    def dim_fits(self, dim: int, size: int, mesh: LogicalMesh) -> bool:
        """Whether dim ``dim`` of ``size`` splits as this spec says."""
        shards = self.shards(dim, mesh)
        segments = self.segments_of(dim) if self.segments and shards > 1 else None
        if segments is not None:
            return sum(s for s, _ in segments) == size and segments_fit(segments, shards)
        return size % shards == 0

    def is_valid_for(self, shape: tuple[int, ...], mesh: LogicalMesh) -> bool:
        """Rank matches and every split dimension divides evenly."""
        return len(shape) == len(self.dims) and all(self.dim_fits(d, size, mesh) for d, size in enumerate(shape))

    def local_size(self, dim: int, size: int, mesh: LogicalMesh) -> int:
        segments = self.segmented(dim, mesh)
        if segments is None:
            return size // self.shards(dim, mesh)
        shards = self.shards(dim, mesh)
        return sum(s // segment_count(h, shards) for s, h in segments)

    def local_shape(self, shape: tuple[int, ...], mesh: LogicalMesh) -> tuple[int, ...]:
        return _local_shape(self, self.segments, tuple(shape), tuple(mesh.shape))

    def local_indices(self, dim: int, size: int, mesh: LogicalMesh, coord: tuple[int, int]) -> np.ndarray:
        """The positions along ``dim`` that the device at ``coord`` holds, in its order."""
        index, count = mesh.position(coord, self.dim_axes(dim))
        segments = self.segmented(dim, mesh)
        if segments is None:
            step = size // count
            return np.arange(index * step, (index + 1) * step)
        return segment_indices(segments, index, count)

    def local_bytes(self, shape: tuple[int, ...], itemsize: int, mesh: LogicalMesh) -> int:
        return prod(self.local_shape(shape, mesh)) * itemsize

    def local_slices(self, shape: tuple[int, ...], mesh: LogicalMesh, coord: tuple[int, int]) -> tuple:
        """The part of the full tensor that the device at ``coord`` holds: a slice per dim,
        or the positions it holds (an int array) along a segmented dim (``take`` applies
        either)."""
        out = []
        for d, size in enumerate(shape):
            if self.segmented(d, mesh) is not None:
                out.append(self.local_indices(d, size, mesh, coord))
                continue
            index, count = mesh.position(coord, self.dim_axes(d))
            step = size // count
            out.append(slice(index * step, (index + 1) * step))
        return tuple(out)


def take(array, slices: tuple):
    """``array`` cut by ``local_slices``: slices, and index arrays one dim at a time."""
    plain = tuple(s if isinstance(s, slice) else slice(None) for s in slices)
    part = array[plain + (...,)]
    for d, s in enumerate(slices):
        if not isinstance(s, slice):
            part = np.take(part, s, axis=d)
    return part


def put(array, slices: tuple, value) -> None:
    """Write ``value`` into the part of ``array`` that ``local_slices`` names."""
    if all(isinstance(s, slice) for s in slices):
        array[slices] = value
        return
    index = tuple(np.arange(n)[s] for n, s in zip(array.shape, slices))
    array[np.ix_(*index)] = value


@lru_cache(maxsize=1 << 16)
def _local_shape(spec: ShardingSpec, segments: tuple, shape: tuple[int, ...],
                 mesh_shape: tuple[int, int]) -> tuple[int, ...]:
    """``ShardingSpec.local_shape``, which depends on the mesh's shape alone: the planner
    asks for the same few hundred thousand times. (``segments`` is in the key: specs that
    differ in it alone are equal.)"""
    mesh = LogicalMesh(mesh_shape, tuple(range(mesh_shape[0] * mesh_shape[1])))
    return tuple(spec.local_size(d, size, mesh) for d, size in enumerate(shape))
