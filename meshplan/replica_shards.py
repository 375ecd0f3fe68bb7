"""How the R data-parallel replicas of a pipeline stage share a tensor of the update (ZeRO-1).

Each replica of a stage holds the stage's weights whole, but the optimizer's slots only in
part: a tensor of shape (n, ...) whose first dim R divides is cut into R equal row blocks,
replica r holding block r (layout ``S1`` over a [1, R] mesh of the stage's ranks, so that a
checkpoint's manifest and ``meshplan export`` read it like any sharded state); a tensor
whose first dim R does not divide, or a 0-d one, is held whole by replica 0 (the others
hold its first 0 rows). The accumulated gradients are summed into those blocks (a
reduce-scatter), each replica updates its blocks, and the updated weights are gathered
whole again (an all-gather): the bytes a ring all-reduce would have moved, the optimizer's
memory and work divided by R.
"""

from __future__ import annotations

import numpy as np


def splits(shape, replicas: int) -> bool:
    """Whether a tensor of ``shape`` is cut into ``replicas`` equal row blocks."""
    return replicas > 1 and len(shape) > 0 and int(shape[0]) % replicas == 0 and int(shape[0]) > 0


def piece(value: np.ndarray, replicas: int, replica: int) -> np.ndarray:
    """Replica ``replica``'s part of ``value`` (a view)."""
    if replicas < 2:
        return value
    if splits(value.shape, replicas):
        rows = value.shape[0] // replicas
        return value[replica * rows:(replica + 1) * rows]
    if value.ndim == 0:
        if replica:
            raise ValueError("a 0-d tensor is not split over replicas")
        return value
    return value if replica == 0 else value[:0]


def counts(shape, replicas: int) -> list[int]:
    """The elements of each replica's part of a tensor of ``shape``."""
    total = int(np.prod(shape, dtype=np.int64))
    if splits(shape, replicas):
        return [total // replicas] * replicas
    return [total] + [0] * (replicas - 1)


def piece_shape(shape, replicas: int, replica: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if replicas < 2:
        return shape
    if splits(shape, replicas):
        return (shape[0] // replicas,) + shape[1:]
    return shape if replica == 0 or not shape else (0,) + shape[1:]


def layout(shape, ranks: list[int]) -> dict:
    """A checkpoint manifest's layout of a slot held so by the replicas ``ranks``."""
    if splits(shape, len(ranks)):
        return {"spec": "S1" + "R" * (len(shape) - 1), "segments": None, "logical_mesh": [1, len(ranks)],
                "devices": list(ranks), "holders": list(ranks)}
    return {"spec": "R" * len(shape), "segments": None, "logical_mesh": [1, 1], "devices": [ranks[0]],
            "holders": [ranks[0]]}


def held_bytes(shape, itemsize: int, replicas: int) -> float:
    """The bytes replica 0 (the one that holds most) keeps of a tensor of ``shape``."""
    return float(np.prod(piece_shape(shape, replicas, 0), dtype=np.int64)) * itemsize
