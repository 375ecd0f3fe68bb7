"""meshplan's sharding specs in ONNX's own words (IR 11 multi-device annotations).

ONNX describes a tensor's layout by the axes it splits and the devices that hold each
piece: ``ShardingSpecProto.sharded_dim`` lists the split axes, each with one
``SimpleShardedDimProto`` (the axis' size as ``dim_value`` or ``dim_param``, and
``num_shards``); the pieces are numbered row-major over those axes, and ``device[k]`` is
the device that holds piece k — or, through ``index_to_device_group_map``, the group of
devices that each hold a copy of it. A ``DeviceLayout`` is that description as a value:

- ``dims``: the split axes in axis order, each with its size and its number of pieces;
- ``holders``: per piece, the devices holding it (None: the devices are not named);
- ``partial``: the standard has no field for addends, so a partial tensor carries, beside
  it, the groups of devices whose values sum to their piece (the node metadata entry
  ``meshplan.partial``); empty for a whole tensor;
- ``segments``: a dim split by heads (``ShardingSpec.segments``, docs/architecture.md
  "Segmented dims") is described as its distinct pieces, with its segments beside it (the
  metadata entry ``meshplan.segments``). Key/value heads shared by several devices (one
  segment of fewer heads than devices) are exact in the standard alone: one piece per
  head, held by a group of devices. A packed QKV dim is not: each device holds a chunk of
  every segment, which ``num_shards`` pieces of the dim in order cannot say, so a reader
  needs the segments to know what a piece holds.

``encode`` gives the layout of a spec on a logical mesh (devices named by the mesh's
ranks), ``decode`` finds the spec that has a layout on a mesh; the proto functions convert
to and from ``ShardingSpecProto``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from math import prod

import onnx

from meshplan.sharding import PLACEMENTS, LogicalMesh, Segments, ShardingSpec, placement_axes, segment_count

PARTIAL_KEY = "meshplan.partial"      # node metadata: {tensor: [[device, ...], ...]} addend groups
SEGMENTS_KEY = "meshplan.segments"    # node metadata: {tensor: {axis: [[size, heads], ...]}}


@dataclass(frozen=True)
class SplitDim:
    axis: int
    shards: int
    size: int | str | None = None     # dim_value, dim_param, or not given


@dataclass(frozen=True)
class DeviceLayout:
    dims: tuple[SplitDim, ...]
    holders: tuple[tuple[int, ...], ...] | None
    partial: tuple[tuple[int, ...], ...] = ()
    segments: tuple[tuple[int, Segments], ...] = ()

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the layout names, in ascending order."""
        return tuple(sorted({d for group in self.holders or () for d in group}))

    @property
    def shards(self) -> int:
        return prod(d.shards for d in self.dims)

    def renumbered(self, order) -> "DeviceLayout":
        """The same layout with device ``order[k]`` called ``k`` (a stage's ranks → its positions)."""
        index = {device: k for k, device in enumerate(order)}
        holders = None if self.holders is None else tuple(tuple(sorted(index[d] for d in g)) for g in self.holders)
        partial = tuple(sorted(tuple(sorted(index[d] for d in g)) for g in self.partial))
        return DeviceLayout(self.dims, holders, partial, self.segments)

    def same_as(self, other: "DeviceLayout") -> bool:
        """The same split (axes and piece counts), partial groups and — where both name
        them — holders. Sizes and segments describe the tensor and are not compared."""
        if [(d.axis, d.shards) for d in self.dims] != [(d.axis, d.shards) for d in other.dims]:
            return False
        if self.holders is not None and other.holders is not None and self.holders != other.holders:
            return False
        return sorted(self.partial) == sorted(other.partial)

    def describe(self) -> str:
        """``axis 1 in 4 over devices 0-3``-style text for messages."""
        split = ", ".join(f"axis {d.axis} in {d.shards}" for d in self.dims) or "whole"
        where = f" on devices {','.join(map(str, self.devices))}" if self.holders is not None else ""
        return split + (" as addends" if self.partial else "") + where


def encode(spec: ShardingSpec, shape, mesh: LogicalMesh, names: dict[int, str] | None = None) -> DeviceLayout:
    """The layout of a tensor of ``shape`` in ``spec`` on ``mesh`` (devices = its ranks).
    ``names`` gives the dim_param of dims that have one (a ranged plan's dims)."""
    names = names or {}
    coords = [mesh.coord(rank) for rank in mesh.ranks]
    dims, pieces, segmented = [], [], []
    for d in range(len(spec.dims)):
        shards = spec.shards(d, mesh)
        if shards == 1:
            continue
        index = [mesh.position(c, spec.dim_axes(d))[0] for c in coords]
        segments = spec.segmented(d, mesh)
        if segments is not None:
            keys = [tuple(i * segment_count(heads, shards) // shards for _, heads in segments) for i in index]
            distinct = sorted(set(keys))
            index = [distinct.index(k) for k in keys]
            shards = len(distinct)
            if shards == 1:          # every device holds the whole dim (one head, shared by all)
                continue
            segmented.append((d, tuple(segments)))
        dims.append(SplitDim(d, shards, names.get(d, shape[d] if d < len(shape) else None)))
        pieces.append(index)
    holders: list[list[int]] = [[] for _ in range(prod(d.shards for d in dims))]
    for k, rank in enumerate(mesh.ranks):
        flat = 0
        for dim, index in zip(dims, pieces):
            flat = flat * dim.shards + index[k]
        holders[flat].append(rank)
    partial: tuple = ()
    if spec.partial:
        groups: dict[tuple, list[int]] = {}
        for c, rank in zip(coords, mesh.ranks):
            groups.setdefault(tuple(c[a] for a in (0, 1) if a not in spec.partial), []).append(rank)
        partial = tuple(sorted(tuple(sorted(g)) for g in groups.values()))
    return DeviceLayout(tuple(dims), tuple(tuple(sorted(g)) for g in holders), partial, tuple(segmented))


def decode(layout: DeviceLayout, shape, mesh: LogicalMesh, segments=None) -> ShardingSpec | None:
    """The spec whose layout on ``mesh`` is ``layout`` (None if there is none); ``segments``
    (dim → its segments) are the tensor's segmented dims. Where several specs lay a tensor
    out the same way (a split along a mesh axis of size 1), the first one found."""
    wanted = {d.axis: d.shards for d in layout.dims}
    options = [[p for p in PLACEMENTS if (prod(mesh.shape[a] for a in placement_axes(p)) > 1) == (d in wanted)]
               for d in range(len(shape))]
    for dims, partial in itertools.product(itertools.product(*options), ((), (0,), (1,), (0, 1))):
        try:
            spec = ShardingSpec(tuple(dims), partial)
        except ValueError:
            continue
        if segments:
            spec = spec.with_segments(segments)
        if not spec.is_valid_for(tuple(shape), mesh):
            continue
        if encode(spec, shape, mesh).same_as(layout):
            return spec
    return None


# --- protobuf ------------------------------------------------------------------------------

def to_proto(layout: DeviceLayout, tensor: str) -> onnx.ShardingSpecProto:
    """``ShardingSpecProto`` of ``tensor`` in ``layout``: a piece held by one device names
    it; a piece held by several names a group key (-1, -2, …) that
    ``index_to_device_group_map`` expands."""
    proto = onnx.ShardingSpecProto(tensor_name=tensor)
    for group in layout.holders or ():
        if len(group) == 1:
            proto.device.append(group[0])
            continue
        key = -(len(proto.index_to_device_group_map) + 1)
        proto.device.append(key)
        entry = proto.index_to_device_group_map.add()
        entry.key = key
        entry.value.extend(group)
    for dim in layout.dims:
        sharded = proto.sharded_dim.add()
        sharded.axis = dim.axis
        simple = sharded.simple_sharding.add()
        if isinstance(dim.size, str):
            simple.dim_param = dim.size
        elif dim.size is not None:
            simple.dim_value = dim.size
        simple.num_shards = dim.shards
    return proto


class LayoutProblem(ValueError):
    """A ShardingSpecProto meshplan cannot read (its message says why)."""


def from_proto(proto: onnx.ShardingSpecProto, partial=(), segments=()) -> DeviceLayout:
    """The layout a ``ShardingSpecProto`` states (axes as written: negative ones are made
    positive by ``normalised``), with the partial groups and segments of the metadata."""
    groups = {entry.key: tuple(entry.value) for entry in proto.index_to_device_group_map}
    holders = tuple(tuple(sorted(groups.get(d, (d,)))) for d in proto.device) if len(proto.device) else None
    dims = []
    for sharded in proto.sharded_dim:
        if len(sharded.simple_sharding) != 1:
            raise LayoutProblem(f"axis {sharded.axis} is described by {len(sharded.simple_sharding)} simple shardings "
                                "(a fused axis); meshplan reads one per axis")
        simple = sharded.simple_sharding[0]
        which = simple.WhichOneof("dim")
        size = simple.dim_value if which == "dim_value" else simple.dim_param if which == "dim_param" else None
        if simple.num_shards < 1:
            raise LayoutProblem(f"axis {sharded.axis} has num_shards {simple.num_shards}")
        dims.append(SplitDim(int(sharded.axis), int(simple.num_shards), size))
    return DeviceLayout(tuple(dims), holders, tuple(tuple(sorted(g)) for g in partial), tuple(segments))


def normalised(layout: DeviceLayout, rank: int) -> DeviceLayout:
    """Axes made non-negative and put in ascending order (the pieces renumbered to match);
    LayoutProblem for an axis out of range, listed twice, or pieces that do not match the
    devices named."""
    dims = []
    for dim in layout.dims:
        if not -rank <= dim.axis < rank:
            raise LayoutProblem(f"axis {dim.axis} is out of range for a tensor of rank {rank}")
        dims.append(SplitDim(dim.axis % rank, dim.shards, dim.size))
    if len({d.axis for d in dims}) != len(dims):
        raise LayoutProblem("an axis is listed more than once")
    holders = layout.holders
    if holders is not None and len(holders) != prod(d.shards for d in dims):
        raise LayoutProblem(f"{len(holders)} device entries for {prod(d.shards for d in dims)} pieces")
    order = sorted(range(len(dims)), key=lambda k: dims[k].axis)
    if holders is not None and order != list(range(len(dims))):
        counts = [d.shards for d in dims]
        moved = []
        for target in itertools.product(*(range(counts[k]) for k in order)):
            index = [0] * len(dims)
            for k, value in zip(order, target):
                index[k] = value
            flat = 0
            for k in range(len(dims)):
                flat = flat * counts[k] + index[k]
            moved.append(holders[flat])
        holders = tuple(moved)
    segments = tuple((axis % rank, segs) for axis, segs in layout.segments)
    return DeviceLayout(tuple(dims[k] for k in order), holders, layout.partial, segments)


def metadata_entries(partial: dict[str, tuple], segments: dict[str, dict[int, Segments]]) -> dict[str, str]:
    """The node metadata entries for what the standard has no field for (omitted when empty)."""
    entries = {}
    if partial:
        entries[PARTIAL_KEY] = json.dumps({name: [list(g) for g in groups] for name, groups in partial.items()},
                                          separators=(",", ":"))
    if segments:
        entries[SEGMENTS_KEY] = json.dumps(
            {name: {str(axis): [list(s) for s in segs] for axis, segs in dims.items()} for name, dims in segments.items()},
            separators=(",", ":"))
    return entries


def read_metadata(entries: dict[str, str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``metadata_entries`` read back: {tensor: addend groups}, {tensor: ((axis, segments), …)};
    LayoutProblem for an entry that is not what they write."""
    partial, segments = {}, {}
    try:
        for name, groups in json.loads(entries.get(PARTIAL_KEY, "{}")).items():
            partial[name] = tuple(tuple(int(d) for d in g) for g in groups)
        for name, dims in json.loads(entries.get(SEGMENTS_KEY, "{}")).items():
            segments[name] = tuple((int(axis), tuple((int(s), int(h)) for s, h in segs)) for axis, segs in dims.items())
    except (ValueError, TypeError, AttributeError) as exc:
        raise LayoutProblem(f"malformed {PARTIAL_KEY} or {SEGMENTS_KEY} metadata ({exc})") from None
    return partial, segments
