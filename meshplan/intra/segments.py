"""Segmented dims: where a split by heads is not a contiguous cut of a dim.

An operator whose heads live in a packed or shared dim says so through its registry
entry's ``segments`` hook (GroupQueryAttention: its packed QKV input is the query, key and
value segments, each of its own number of heads; its key/value cache has fewer heads than
the query). ``tensor_segments`` takes those as seeds and carries them back to the tensors
that compute them, through every producer whose rule splits the segmented dim together
with a dim of its inputs (the bias Add, the MatMul or MatMulNBits of the projection, the
weight's own dims, a parameter's chain): so the projection's weight is split per segment
and each device's Q, K and V columns line up with its heads.

A strategy must split each index space the same way on every operand: ``consistent``
compares, per placement, the parts each device holds of every operand it splits (as
fractions of the dim), so a segmented tensor never meets a plainly split one.
"""

from __future__ import annotations

from fractions import Fraction

from meshplan.model.graph import Graph
from meshplan.ops import entry, rule_of
from meshplan.ops.view import NoRule, OpView
from meshplan.sharding import LogicalMesh, Segments, ShardingSpec, segment_count

CONFLICT: Segments = ((0, 0),)   # two seeds disagree: the dim is never split


def tensor_segments(graph: Graph) -> dict[str, dict[int, Segments]]:
    """Tensor → dim → its segments, for every tensor a segmented dim reaches (cached)."""
    if "segments" in graph.memo:
        return graph.memo["segments"]
    found: dict[str, dict[int, Segments]] = {}
    pending: list[tuple[str, int]] = []

    def add(name: str, dim: int, segments: Segments) -> None:
        known = found.setdefault(name, {})
        if dim in known:
            if known[dim] != segments and known[dim] != CONFLICT:
                known[dim] = CONFLICT
            return
        known[dim] = segments
        pending.append((name, dim))

    chain_nodes = {id(node): node for node in graph.chains.values()}
    nodes = list(graph.nodes) + list(chain_nodes.values())
    for node in nodes:
        hook = entry(node.op_type, node.domain).segments
        if hook is None:
            continue
        op = OpView(node, graph, {}, graph.opset)
        operands = list(node.inputs) + list(node.outputs)
        for index, dims in hook(op).items():
            for dim, segments in dims.items():
                if operands[index]:
                    add(operands[index], dim, tuple(segments))
    producers = {out: node for node in nodes for out in node.outputs if out}
    while pending:
        name, dim = pending.pop()
        segments = found[name][dim]
        node = producers.get(name)
        rule_fn = rule_of(node.op_type, node.domain) if node is not None else None
        if rule_fn is None or segments == CONFLICT or entry(node.op_type, node.domain).segments is not None:
            continue   # an operator that declares segments relates its operands' heads itself
        try:
            rules = list(rule_fn(OpView(node, graph, {}, graph.opset)))
        except (NoRule, ValueError, TypeError, IndexError, KeyError):
            continue
        out_index = node.outputs.index(name)
        size = graph.tensors[name].shape[dim]
        for ins, outs in rules:
            if out_index >= len(outs) or outs[out_index] != dim:
                continue
            for k, place in enumerate(ins):
                source = node.inputs[k] if k < len(node.inputs) else ""
                if not source or not isinstance(place, int):
                    continue
                width = graph.tensors[source].shape[place]
                if width % size == 0:
                    ratio = width // size
                    add(source, place, tuple((s * ratio, h) for s, h in segments))
    graph.memo["segments"] = found
    return found


def _pattern(spec: ShardingSpec, dim: int, size: int, mesh: LogicalMesh) -> tuple:
    """What each device (in split order) holds of ``dim``: merged runs as fractions of it."""
    count = spec.shards(dim, mesh)
    segments = spec.segments_of(dim) or ((size, count),)
    held = []
    for index in range(count):
        runs: list[list[Fraction]] = []
        offset = 0
        for length, heads in segments:
            chunks = segment_count(heads, count)
            part = index * chunks // count
            start, end = Fraction(offset + part * length // chunks, size), Fraction(offset + (part + 1) * length // chunks, size)
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
            offset += length
        held.append(tuple(tuple(run) for run in runs))
    return tuple(held)


def consistent(specs, shapes, mesh: LogicalMesh) -> bool:
    """Whether every operand split along the same mesh axes holds the same parts of its dim."""
    if not any(spec is not None and spec.segments for spec in specs):
        return True
    seen: dict[str, tuple] = {}
    for spec, shape in zip(specs, shapes):
        if spec is None:
            continue
        for dim, placement in enumerate(spec.dims):
            if placement == "R":
                continue
            pattern = _pattern(spec, dim, shape[dim], mesh)
            if seen.setdefault(placement, pattern) != pattern:
                return False
    return True
