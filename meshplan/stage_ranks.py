"""Whose rank is which in a pipelined training job, and how a crossing goes between stages
whose replicas differ in number.

Stage s has R_s data-parallel replicas, each of T devices (T = 1 unless the stage's
devices shard its operators), and its ranks follow the stages before it's: device j of
replica r of stage s is rank first(s) + r·T + j. Each replica takes its row block of every
microbatch (replica r of R: rows [r·m/R, (r + 1)·m/R) of a microbatch of m samples).

What a crossing carries from a stage of R_src replicas to one of R_dst:

- ``ROWS``: a tensor whose axis ``a`` holds the microbatch's samples: each replica of the
  destination gets its row block, put together from the pieces of the source replicas that
  overlap it (with R_src = R_dst, replica r to replica r);
- ``SAME``: a tensor every replica has alike (a state, a sum over the replicas, a value that
  does not depend on the samples): destination replica r' takes source replica r' mod R_src's;
- ``SUM``: a gradient that is a partial sum over a replica's samples: what the source
  replicas hold is shared out among the destination replicas so that their sum is the same
  (source r goes to destination r mod R_dst; a destination no source reaches gets zeros).

The gradients a replica of the last stage sends back are of its own loss, the mean over its
samples, and each stage turns a microbatch's gradients into sums by the count the loss was
a mean over. Once replicas of two stages hold different samples, no other stage has the
count of the samples it got gradients of: so where the stages' replica counts are not all
equal the last stage sends its gradients as sums already (``StageRunner``'s
``sum_gradients``) and the other stages take the count as 1 (``ONE``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.training.losses import COUNT
from meshplan.training.pipeline_step import per_microbatch
from meshplan.training.step_model import BACKWARD, FORWARD

ROWS, SAME, SUM, ONE = "rows", "same", "sum", "one"


def per_stage(replicas, stages: int) -> list[int]:
    """Each stage's replicas from a plan's record or an argument: one count for every stage,
    or one a stage."""
    if isinstance(replicas, (list, tuple)):
        found = [int(r) for r in replicas]
        if len(found) != stages or min(found, default=1) < 1:
            raise ValueError(f"{len(found)} replica counts for {stages} stages")
        return found
    return [int(replicas)] * stages


@dataclass(frozen=True)
class StageRanks:
    """The ranks of a pipeline whose stage s has ``replicas[s]`` replicas of ``tensor`` devices
    (``tensors[s]`` where the stages' differ)."""

    replicas: tuple[int, ...]
    tensor: int = 1
    tensors: tuple[int, ...] = ()

    @classmethod
    def of(cls, replicas, stages: int, tensor=1) -> "StageRanks":
        """``tensor``: one count for every stage, or one a stage."""
        if isinstance(tensor, (list, tuple)):
            found = tuple(per_stage(tensor, stages))
            if len(set(found)) > 1:
                return cls(tuple(per_stage(replicas, stages)), max(found), found)
            tensor = found[0]
        return cls(tuple(per_stage(replicas, stages)), int(tensor))

    @property
    def stages(self) -> int:
        return len(self.replicas)

    def devices(self, stage: int) -> int:
        """The devices of each replica of stage ``stage`` (that shard its operators)."""
        return self.tensors[stage] if self.tensors else self.tensor

    @property
    def size(self) -> int:
        return sum(r * self.devices(s) for s, r in enumerate(self.replicas))

    @property
    def uniform(self) -> bool:
        return len(set(self.replicas)) <= 1

    def width(self, stage: int) -> int:
        """Stage ``stage``'s ranks."""
        return self.replicas[stage] * self.devices(stage)

    def first(self, stage: int) -> int:
        """Stage ``stage``'s first rank."""
        return sum(self.width(s) for s in range(stage))

    def ranks(self, stage: int) -> list[int]:
        return list(range(self.first(stage), self.first(stage) + self.width(stage)))

    def rank(self, stage: int, replica: int, device: int = 0) -> int:
        return self.first(stage) + replica * self.devices(stage) + device

    def where(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, device) of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not one of the pipeline's {self.size}")
        stage = 0
        while rank >= self.first(stage) + self.width(stage):
            stage += 1
        replica, device = divmod(rank - self.first(stage), self.devices(stage))
        return stage, replica, device


def overlaps(src: int, r_src: int, dst: int, r_dst: int) -> bool:
    """Whether row block ``src`` of ``r_src`` and row block ``dst`` of ``r_dst`` share rows."""
    return src * r_dst < (dst + 1) * r_src and dst * r_src < (src + 1) * r_dst


def sources(kind: str, dst: int, r_src: int, r_dst: int) -> list[int]:
    """The source replicas destination replica ``dst`` receives from, in order (for ``SUM``
    where none reaches it: the one that sends it zeros)."""
    if kind == ROWS:
        return [s for s in range(r_src) if overlaps(s, r_src, dst, r_dst)]
    if kind in (SAME, ONE):
        return [dst % r_src]
    if kind == SUM:
        return [s for s in range(r_src) if s % r_dst == dst] or [dst % r_src]
    raise ValueError(f"unknown crossing kind {kind!r}")


def destinations(kind: str, src: int, r_src: int, r_dst: int) -> list[int]:
    """The destination replicas source replica ``src`` sends to, in order."""
    return [d for d in range(r_dst) if src in sources(kind, d, r_src, r_dst)]


def piece_for(kind: str, value: np.ndarray, axis: int | None, src: int, r_src: int, dst: int, r_dst: int):
    """What source replica ``src`` sends destination replica ``dst`` of its ``value``."""
    if kind == ROWS:
        value = np.asarray(value)
        held = value.shape[axis]
        total = held * r_src
        if total % r_dst:
            raise ValueError(f"{total} rows do not split into {r_dst} equal blocks")
        lo = max(dst * total // r_dst, src * held) - src * held
        hi = min((dst + 1) * total // r_dst, (src + 1) * held) - src * held
        return np.ascontiguousarray(np.take(value, np.arange(lo, hi), axis=axis)) if (lo, hi) != (0, held) \
            else value
    if kind == SUM and dst >= r_src:   # no source's sum comes here: zeros keep the total
        return np.zeros_like(np.asarray(value))
    if kind == ONE:
        return np.ones_like(np.asarray(value))
    return value


def joined(kind: str, pieces: list, axis: int | None):
    """Destination's tensor from the pieces of ``sources`` (in that order)."""
    if len(pieces) == 1:
        return pieces[0]
    if kind == ROWS:
        return np.concatenate([np.asarray(p) for p in pieces], axis=axis)
    if kind == SUM:
        total = np.array(pieces[0], copy=True)
        for p in pieces[1:]:
            total += p
        return total
    return pieces[0]


def kinds(crossings, ranks: StageRanks, rows: dict[int, int]) -> list[str]:
    """How each of ``crossings`` goes (``kind_of``); where the stages' replica counts differ,
    a microbatch's loss count that the last stage's forward sends is ``ONE``."""
    last = ranks.stages - 1
    return [ONE if not ranks.uniform and c.tensor == COUNT and c.src == last and c.made_in == FORWARD
            else kind_of(c, rows.get(index)) for index, c in enumerate(crossings)]


def kind_of(crossing, axis: int | None) -> str:
    """How ``crossing`` (a ``training.pipeline_step.Crossing``) goes between stages whose
    replicas differ: ``ROWS`` where its tensor has the samples on ``axis``; else ``SUM`` for a
    gradient a backward sends every microbatch, ``SAME`` for the rest."""
    if axis is not None:
        return ROWS
    return SUM if per_microbatch(crossing) and crossing.made_in == BACKWARD else SAME
