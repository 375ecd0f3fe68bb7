"""Sharding specs: how a tensor is laid out over a 2-D logical mesh.

For each tensor dimension a spec says R (replicated), S0 / S1 (split along mesh axis 0 /
1) or S01 (split along both, axis 0 major); a spec can also be *partial* over one or both
mesh axes (each device holds an addend; a sum over those axes completes the tensor).
Printed forms: ``S0R``, ``RS1``, ``S01R``, ``RR+P1`` (partial over axis 1), ``R+P01``.

A ``LogicalMesh`` is a view of a physical submesh as an (n, m) grid of ranks, row-major:
the device at coordinate (i, j) is ``ranks[i * m + j]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

R, S0, S1, S01 = "R", "S0", "S1", "S01"
PLACEMENTS = (R, S0, S1, S01)
_TOKEN = re.compile(r"S01|S0|S1|R")


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
        return self.shape[0] if axis == 0 else self.shape[1] if axis == 1 else self.size


def _axes_of(placement: str) -> tuple[int, ...]:
    return {R: (), S0: (0,), S1: (1,), S01: (0, 1)}[placement]


@dataclass(frozen=True)
class ShardingSpec:
    dims: tuple[str, ...]
    partial: tuple[int, ...] = ()     # mesh axes the tensor is a partial sum over, sorted

    def __post_init__(self):
        for placement in self.dims:
            if placement not in PLACEMENTS:
                raise ValueError(f"bad placement {placement!r} in spec {self.dims}")
        used = [a for p in self.dims for a in _axes_of(p)]
        if len(used) != len(set(used)):
            raise ValueError(f"spec {self} splits more than one dimension along the same mesh axis")
        if set(used) & set(self.partial):
            raise ValueError(f"spec {self} is both split and partial along the same mesh axis")
        if tuple(sorted(set(self.partial))) != self.partial or not set(self.partial) <= {0, 1}:
            raise ValueError(f"bad partial axes {self.partial}")

    # --- construction and printing ---------------------------------------------------

    @classmethod
    def replicated(cls, rank: int) -> "ShardingSpec":
        return cls((R,) * rank)

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        """'S0R' → (S0, R); 'RR+P1' → partial over axis 1; '' or '+P0' for scalars."""
        body, _, partial = text.partition("+P")
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
        return {axis: dim for dim, p in enumerate(self.dims) for axis in _axes_of(p)}

    def shards(self, dim: int, mesh: LogicalMesh) -> int:
        return prod(mesh.axis_size(a) for a in _axes_of(self.dims[dim]))

    def is_valid_for(self, shape: tuple[int, ...], mesh: LogicalMesh) -> bool:
        """Rank matches and every split dimension divides evenly."""
        return len(shape) == len(self.dims) and all(size % self.shards(d, mesh) == 0 for d, size in enumerate(shape))

    def local_shape(self, shape: tuple[int, ...], mesh: LogicalMesh) -> tuple[int, ...]:
        return tuple(size // self.shards(d, mesh) for d, size in enumerate(shape))

    def local_bytes(self, shape: tuple[int, ...], itemsize: int, mesh: LogicalMesh) -> int:
        return prod(self.local_shape(shape, mesh)) * itemsize

    def local_slices(self, shape: tuple[int, ...], mesh: LogicalMesh, coord: tuple[int, int]) -> tuple[slice, ...]:
        """The part of the full tensor that the device at ``coord`` holds."""
        i, j = coord
        n, m = mesh.shape
        out = []
        for d, size in enumerate(shape):
            placement = self.dims[d]
            index, count = {R: (0, 1), S0: (i, n), S1: (j, m), S01: (i * m + j, n * m)}[placement]
            step = size // count
            out.append(slice(index * step, (index + 1) * step))
        return tuple(out)
