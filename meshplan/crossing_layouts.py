"""How a crossing goes between two pipeline stages whose devices shard it differently.

Where stage a's T_a devices and stage b's T_b devices each shard their operators (each a
[1, T] mesh of its own: ``meshplan plan --train --tensor-parallel 2,1``), a tensor stage a
hands stage b leaves device i of a in the layout a's programs give it and is read by device j
of b in the layout b's programs give it. A ``Relayout`` says which device of a sends which
box of the tensor to which device of b, and how device j puts its pieces together:

- the receiver's box of the whole tensor is cut from the senders' boxes that overlap it,
  one sender a box (of the senders that hold the same box, receiver j takes the one at
  j modulo their number, so that replicated senders share the sending);
- where the sender's layout is a partial sum (its devices hold addends), every sender sends
  its addend of the box and the receiver adds them up;
- where the receiver's layout is a partial sum, its first device along the partial axis
  receives the value and the others hold zeros: the sum is the tensor.

Where the two stages' replica counts differ too, the meshes are [R, T], a row a replica,
and the layouts split a microbatch's samples over the rows as well (``make_stage_programs.
_across``): every device of the one stage sends to every device of the other that needs it.

Pure planning and numpy: the links (``runtime.pipeline_links``) move the pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshplan.sharding import LogicalMesh, ShardingSpec

Box = tuple[tuple[int, int], ...]


def spec_of_name(name: str, specs: dict[str, str]) -> str | None:
    """The layout a stage's program holds ``name`` in: ``specs``' (the program's inputs and
    outputs, by global name), else the layout its local name carries (``NAME@SPEC``), else
    None (replicated)."""
    if name in specs:
        return specs[name]
    base, at, text = name.rpartition("@")
    if not at:
        return None
    try:
        ShardingSpec.parse(text)
    except ValueError:
        return None
    return text


def base_name(name: str, specs: dict[str, str]) -> str:
    """``name`` without the layout its local name carries."""
    if name in specs or spec_of_name(name, {}) is None:
        return name
    return name.rpartition("@")[0]


@dataclass(frozen=True)
class Relayout:
    """A tensor of ``shape`` (whole) going from ``source`` on a [``sender_rows``,
    ``senders``] mesh to ``target`` on a [``receiver_rows``, ``receivers``] mesh (specs'
    printed forms). Its devices are numbered row-major. With one row on both sides each
    replica of a stage sends to the same replica of the other, a row of ``senders`` devices
    to one of ``receivers``; with rows (stages whose replica counts differ: a row a
    replica), every device of the one stage to every device of the other."""

    shape: tuple[int, ...]
    source: str
    target: str
    senders: int
    receivers: int
    dtype: str = "float32"
    sender_rows: int = 1
    receiver_rows: int = 1

    def to_dict(self) -> dict:
        found = {"shape": list(self.shape), "from": self.source, "to": self.target, "senders": self.senders,
                 "receivers": self.receivers, "dtype": self.dtype}
        if (self.sender_rows, self.receiver_rows) != (1, 1):
            found.update(sender_rows=self.sender_rows, receiver_rows=self.receiver_rows)
        return found

    @classmethod
    def from_dict(cls, data: dict) -> "Relayout":
        return cls(tuple(int(d) for d in data["shape"]), str(data["from"]), str(data["to"]), int(data["senders"]),
                   int(data["receivers"]), str(data.get("dtype", "float32")), int(data.get("sender_rows", 1)),
                   int(data.get("receiver_rows", 1)))

    @property
    def across_replicas(self) -> bool:
        """Whether its devices are all of both stages' (rows), not a replica's."""
        return (self.sender_rows, self.receiver_rows) != (1, 1)

    @cached_property
    def _specs(self) -> tuple[ShardingSpec, ShardingSpec, LogicalMesh, LogicalMesh]:
        src, dst = ShardingSpec.parse(self.source), ShardingSpec.parse(self.target)
        a = LogicalMesh((self.sender_rows, self.senders), tuple(range(self.sender_rows * self.senders)))
        b = LogicalMesh((self.receiver_rows, self.receivers), tuple(range(self.receiver_rows * self.receivers)))
        for spec, mesh, side in ((src, a, "sent"), (dst, b, "received")):
            if not ShardingSpec(spec.dims).is_valid_for(self.shape, mesh):
                raise ValueError(f"a tensor of shape {list(self.shape)} cannot be {side} as {spec} over "
                                 f"{mesh.size} device(s)")
        return src, dst, a, b

    def _box(self, spec: ShardingSpec, mesh: LogicalMesh, device: int) -> Box:
        whole = ShardingSpec(spec.dims)     # (a partial sum's addend covers its split box)
        return tuple((s.start, s.stop) for s in whole.local_slices(self.shape, mesh, mesh.coord(device)))

    def _adds(self, spec: ShardingSpec, mesh: LogicalMesh) -> bool:
        return any(mesh.axis_size(axis) > 1 for axis in spec.partial)

    def _first_of_sum(self, spec: ShardingSpec, mesh: LogicalMesh, device: int) -> bool:
        coord = mesh.coord(device)
        return all(coord[axis] == 0 for axis in spec.partial if mesh.axis_size(axis) > 1)

    @cached_property
    def routes(self) -> dict[int, list[tuple[int, Box]]]:
        """Receiver device → [(sender device, box of the whole tensor)], in sender order."""
        src, dst, a, b = self._specs
        boxes = [self._box(src, a, i) for i in range(a.size)]
        holders: dict[Box, list[int]] = {}
        for i, box in enumerate(boxes):
            holders.setdefault(box, []).append(i)
        found = {}
        for j in range(b.size):
            wanted = self._box(dst, b, j)
            pieces = []
            if self._first_of_sum(dst, b, j):
                if self._adds(src, a):
                    chosen = list(range(a.size))
                else:
                    chosen = sorted(group[j % len(group)] for group in holders.values())
                for i in chosen:
                    cut = tuple((max(p, q), min(r, s)) for (p, r), (q, s) in zip(boxes[i], wanted))
                    if all(lo < hi for lo, hi in cut):
                        pieces.append((i, cut))
            found[j] = pieces
        return found

    def sends(self, device: int) -> list[tuple[int, tuple[slice, ...]]]:
        """(receiver device, the slices of sender ``device``'s local tensor it gets)."""
        src, _, a, _ = self._specs
        held = self._box(src, a, device)
        return [(j, tuple(slice(lo - h, hi - h) for (lo, hi), (h, _) in zip(cut, held)))
                for j, pieces in sorted(self.routes.items()) for i, cut in pieces if i == device]

    def sources(self, device: int) -> list[int]:
        """The sender devices receiver ``device`` gets a piece from, in order."""
        return [i for i, _ in self.routes[device]]

    def joined(self, device: int, pieces: list) -> np.ndarray:
        """Receiver ``device``'s tensor from its pieces (in ``sources``' order)."""
        src, dst, a, b = self._specs
        wanted = self._box(dst, b, device)
        kind = np.asarray(pieces[0]).dtype if pieces else np.dtype(self.dtype)   # (the pieces' own: float16, ...)
        out = np.zeros(tuple(hi - lo for lo, hi in wanted), kind)
        adds = self._adds(src, a)
        for (_, cut), piece in zip(self.routes[device], pieces):
            where = tuple(slice(lo - w, hi - w) for (lo, hi), (w, _) in zip(cut, wanted))
            piece = np.reshape(piece, out[where].shape)    # (a scalar a run made as [1] is one value)
            if adds:
                out[where] += piece
            else:
                out[where] = piece
        return out


__all__ = ["Relayout", "base_name", "spec_of_name"]
