"""Sharding strategies of ONNX operators on a 2-D logical mesh.

Rules (in ``meshplan.ops``, one registry entry per op type) are written for ONE mesh
axis, as a placement per operand (inputs, then outputs): a tensor dim index to split
that dim, ``R`` (replicated) or ``P`` (partial sum). ``node_strategies`` combines a rule for
axis 0 with a rule for axis 1 (the same dim split on both axes becomes S01), drops what
the shapes cannot divide, and always puts the all-replicated strategy first: an operator
with no rule gets only that one, which is always correct.

Partial placements are only offered on floating-point tensors, never on parameters (a
weight is sliced, not split into addends), and nonlinear operators never take them.
Shape-like constant inputs (a Reshape target, Slice starts, reduction axes…) are always
replicated; when a split changes one (Reshape's target, Expand's shape), the strategy
carries a *rewrite*: the new int64 value of that input on every device (the local shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from meshplan.intra.segments import consistent, tensor_segments
from meshplan.model.graph import Graph, Node
from meshplan.ops import entry, ops_with_rules, rule_of
from meshplan.ops.view import P, R, NoRule, OpView, Place, Rule
from meshplan.sharding import S0, S01, S1, LogicalMesh, ShardingSpec

__all__ = ["Strategy", "derive", "local_attributes", "node_strategies", "ops_with_rules", "rule_strategies",
           "source_specs", "tied_sources", "tied_spec"]


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[ShardingSpec | None, ...]     # one per node input; None for an omitted optional input
    outputs: tuple[ShardingSpec | None, ...]    # one per node output; None for an omitted optional output
    rewrites: tuple[tuple[int, tuple[int, ...]], ...] = ()   # input index → its new int64 value on every device

    def __str__(self) -> str:
        def show(specs):
            return ",".join("_" if s is None else str(s) for s in specs)
        return f"{show(self.inputs)}->{show(self.outputs)}"

    @property
    def is_replicated(self) -> bool:
        return all(s is None or s.is_replicated for s in self.inputs + self.outputs)


# --- expansion over the 2-D mesh ---------------------------------------------------------

def _normalize(op: OpView, rule: Rule) -> Rule:
    ins, outs = rule
    ins = tuple(ins) + (R,) * (len(op.ins) - len(ins))
    ins = tuple(None if info is None else p for p, info in zip(ins, op.ins))
    outs = tuple(None if info is None else p for p, info in zip(outs, op.outs))
    return ins, outs


def _allowed(op: OpView, rule: Rule, partial_bias: int | None) -> bool:
    """Partial only on floating tensors, and on a weight only as a bias (the entry's
    ``partial_bias``: Gemm's C, MatMulNBits' bias): a partial weight is stored whole on one
    device of each partial group and as zeros on the others (see shard_emit), which lets
    the bias ride along with a partial product; any other partial weight would be correct
    but never useful."""
    for index, (place, info) in enumerate(zip(rule[0] + rule[1], op.ins + op.outs)):
        if place != P:
            continue
        if not np.issubdtype(info.dtype, np.floating):
            return False
        if info.is_param and index != partial_bias:
            return False
    return True


def _combine(p0: Place | None, p1: Place | None, shape: tuple[int, ...], mesh: LogicalMesh,
             segments=None) -> ShardingSpec | None | bool:
    """The spec of one operand under rule placements for axis 0 and 1 (of a tensor whose
    dims have ``segments``); False if it does not fit."""
    if p0 is None:
        return None
    dims = ["R"] * len(shape)
    partial = []
    if p0 == P:
        partial.append(0)
    elif p0 != R:
        dims[p0] = S0
    if p1 == P:
        partial.append(1)
    elif p1 != R:
        dims[p1] = S01 if dims[p1] == S0 else S1
    spec = ShardingSpec(tuple(dims), tuple(partial))
    if segments:
        spec = spec.with_segments(segments)
    for d, size in enumerate(shape):
        shards = spec.shards(d, mesh)
        if shards == 1:
            continue
        if segments and d in segments:
            if not spec.dim_fits(d, size, mesh):
                return False
        elif size < shards or size % shards:
            return False
    return spec


def _conflicts(r0: Rule, r1: Rule) -> bool:
    """Two different rules that split the same dim of one operand do not compose."""
    return r0 != r1 and any(isinstance(a, int) and a == b for a, b in zip(r0[0] + r0[1], r1[0] + r1[1]))


def node_strategies(node: Node, graph: Graph, mesh: LogicalMesh,
                    constants: Mapping[str, np.ndarray] | None = None, opset: int | None = None) -> list[Strategy]:
    """The sharding strategies of ``node`` on ``mesh``, all-replicated first, deduplicated.

    ``constants`` holds the values of small initializers (reduction axes, Slice bounds,
    Pad pads…); a rule that needs a value it cannot find offers nothing. ``opset`` is
    the model's default-domain opset (it changes Softmax's semantics); None is read
    conservatively. A parameter expression input must be derivable in its spec from
    slices of its sources (``derive``), and a tied source takes one layout (``tied_spec``).
    """
    found = rule_strategies(node, graph, mesh, constants, opset)
    if graph.views and any(name and graph.tensors[name].ranged for name in node.inputs + node.outputs):
        # a ranged plan: the strategy must hold at the other sizes looked at too
        for view in graph.views.values():
            held = {(s.inputs, s.outputs) for s in rule_strategies(node, view, mesh, constants, opset)}
            found = [s for s in found if (s.inputs, s.outputs) in held]
    if not any(name and graph.tensors[name].is_param for name in node.inputs):
        return found
    return [s for s in found if s.is_replicated or _parameters_allow(node, s, graph, mesh, constants, opset)]


def rule_strategies(node: Node, graph: Graph, mesh: LogicalMesh,
                    constants: Mapping[str, np.ndarray] | None = None, opset: int | None = None) -> list[Strategy]:
    """``node_strategies`` as the rules give them, before the parameters' conditions."""
    op = OpView(node, graph, constants or {}, opset)
    replicated = Strategy(
        tuple(None if i is None else ShardingSpec.replicated(len(i.shape)) for i in op.ins),
        tuple(None if o is None else ShardingSpec.replicated(len(o.shape)) for o in op.outs),
    )
    op_entry = entry(node.op_type, node.domain)
    rule_fn = rule_of(node.op_type, node.domain)
    if rule_fn is None or not op.ins or op.ins[0] is None or any(o is None for o in op.outs[:1]):
        return [replicated]
    try:
        rules = [_normalize(op, rule) for rule in rule_fn(op)]
    except NoRule:
        return [replicated]
    everything_r = _normalize(op, ((), tuple(R for _ in op.outs)))
    rules = [everything_r] + [r for r in dict.fromkeys(rules) if r != everything_r and _allowed(op, r, op_entry.partial_bias)]
    per_axis = [rules if mesh.shape[axis] > 1 else [everything_r] for axis in (0, 1)]
    shapes = [None if i is None else i.split_sizes for i in op.ins + op.outs]
    segmented = tensor_segments(graph)
    operand_segments = [segmented.get(name) if name else None for name in list(node.inputs) + list(node.outputs)]
    rewrite = op_entry.rewrite
    found: dict[Strategy, None] = {replicated: None}
    for r0 in per_axis[0]:
        for r1 in per_axis[1]:
            if _conflicts(r0, r1):
                continue
            specs = [_combine(a, b, shape, mesh, segs)
                     for a, b, shape, segs in zip(r0[0] + r0[1], r1[0] + r1[1], shapes, operand_segments)]
            if any(s is False for s in specs) or (op_entry.segments is None and not consistent(specs, shapes, mesh)):
                continue
            strategy = Strategy(tuple(specs[:len(op.ins)]), tuple(specs[len(op.ins):]))
            if rewrite is not None:
                rewrites = rewrite(op, strategy.inputs, strategy.outputs, mesh)
                if rewrites is None:
                    continue
                strategy = Strategy(strategy.inputs, strategy.outputs, rewrites)
            found[strategy] = None
    if any(info is not None and info.is_data_dependent for info in op.ins + op.outs):
        return [s for s in found if _keeps_dynamic_whole(s, op.ins + op.outs)]
    return list(found)


def _keeps_dynamic_whole(strategy: Strategy, infos) -> bool:
    """A data-dependent dim is never split (its size is known only at run time), and a
    node that reads or writes such a tensor takes no shape-constant rewrite (its shape
    constants may follow the run-time size)."""
    if strategy.rewrites:
        return False
    for info, spec in zip(infos, strategy.inputs + strategy.outputs):
        if info is not None and spec is not None and any(spec.dims[axis] != R for axis in info.dynamic):
            return False
    return True


# --- parameter expressions ----------------------------------------------------------------

def derive(graph: Graph, tensor: str, spec: ShardingSpec, mesh: LogicalMesh,
           constants: Mapping[str, np.ndarray] | None = None,
           opset: int | None = None) -> tuple[tuple[Node, Strategy], ...] | None:
    """How a device obtains the parameter expression ``tensor`` in ``spec``: the chain's
    nodes, sources first, each with the strategy that gives its consumer what it needs;
    the sources are then sliced as those strategies' inputs say. None when no strategy
    of the chain yields ``spec`` (a plain initializer needs no steps)."""
    if not graph.tensors[tensor].is_derived:
        return ()
    key = ("derive", tensor, spec, mesh.shape, None if constants is None else len(constants))
    if key not in graph.memo:
        graph.memo[key] = _derive(graph, tensor, spec, mesh, constants, opset)
    return graph.memo[key]


def _derive(graph, tensor, spec, mesh, constants, opset):
    node = graph.chains[tensor]
    for strategy in rule_strategies(node, graph, mesh, constants, opset):
        if strategy.outputs[0] != spec:
            continue
        steps: list[tuple[Node, Strategy]] = []
        rewritten = dict(strategy.rewrites)
        for k, (name, want) in enumerate(zip(node.inputs, strategy.inputs)):
            if not name or k in rewritten:
                continue
            found = derive(graph, name, want, mesh, constants, opset)
            if found is None:
                break
            steps.extend(step for step in found if step not in steps)
        else:
            return tuple(steps) + ((node, strategy),)
    return None


def source_specs(graph: Graph, tensor: str, spec: ShardingSpec, mesh: LogicalMesh,
                 constants: Mapping[str, np.ndarray] | None = None,
                 opset: int | None = None) -> dict[str, ShardingSpec] | None:
    """The slice of each source initializer a device stores to hold parameter ``tensor`` in
    ``spec`` (shape inputs a strategy rewrites are not stored); None if not derivable."""
    steps = derive(graph, tensor, spec, mesh, constants, opset)
    if steps is None:
        return None
    if not steps:
        return {tensor: spec}
    found: dict[str, ShardingSpec] = {}
    for node, strategy in steps:
        rewritten = dict(strategy.rewrites)
        for k, (name, want) in enumerate(zip(node.inputs, strategy.inputs)):
            if name and k not in rewritten and not graph.tensors[name].is_derived:
                found.setdefault(name, want)
    return found


def tied_sources(graph: Graph) -> dict[str, list[str]]:
    """Initializers the planner's nodes read in more than one form (the table itself and its
    transpose, or several slices of one fused weight): source → the forms read."""
    if "tied" not in graph.memo:
        forms: dict[str, list[str]] = {}
        read = {name for node in graph.nodes for name in node.inputs if name and graph.tensors[name].is_param}
        for name in sorted(read):
            for source in graph.tensors[name].sources or (name,):
                forms.setdefault(source, []).append(name)
        graph.memo["tied"] = {source: names for source, names in forms.items() if len(names) > 1}
    return graph.memo["tied"]


def tied_spec(graph: Graph, source: str, mesh: LogicalMesh, constants=None, opset=None) -> ShardingSpec | None:
    """The one split layout every device stores a tied ``source`` in on ``mesh``: the first
    dim split over every mesh axis (of size > 1) that every reader of every form can take;
    None when there is none (then each reader takes its own layout)."""
    key = ("tied", source, mesh.shape, None if constants is None else len(constants))
    if key in graph.memo:
        return graph.memo[key]
    info = graph.tensors[source]
    axes = tuple(a for a in (0, 1) if mesh.shape[a] > 1)
    placement = {(0,): S0, (1,): S1, (0, 1): S01}.get(axes)
    choice = None
    readers = [(form, node) for form in tied_sources(graph)[source] for node in graph.nodes if form in node.inputs]
    for dim in range(len(info.shape)) if placement else ():
        dims = ["R"] * len(info.shape)
        dims[dim] = placement
        candidate = ShardingSpec(tuple(dims))
        if not candidate.is_valid_for(info.shape, mesh):
            continue
        if all(_reader_takes(graph, form, node, source, candidate, mesh, constants, opset) for form, node in readers):
            choice = candidate
            break
    graph.memo[key] = choice
    return choice


def _reader_takes(graph, form, node, source, candidate, mesh, constants, opset) -> bool:
    for strategy in rule_strategies(node, graph, mesh, constants, opset):
        for name, spec in zip(node.inputs, strategy.inputs):
            if name == form and spec is not None:
                specs = source_specs(graph, form, spec, mesh, constants, opset)
                if specs is not None and specs.get(source) == candidate:
                    return True
    return False


def _parameters_allow(node: Node, strategy: Strategy, graph: Graph, mesh: LogicalMesh, constants, opset) -> bool:
    tied = tied_sources(graph)
    for name, spec in zip(node.inputs, strategy.inputs):
        if not name or spec is None or not graph.tensors[name].is_param:
            continue
        specs = source_specs(graph, name, spec, mesh, constants, opset)
        if specs is None:
            return False
        for source, stored in specs.items():
            if source in tied and not stored.is_replicated:
                wanted = tied_spec(graph, source, mesh, constants, opset)
                if wanted is not None and stored != wanted:
                    return False
    return True


def local_attributes(node: Node, graph: Graph, strategy: Strategy, mesh: LogicalMesh) -> dict:
    """The attributes of ``node`` that change on each device under ``strategy`` (MatMulNBits'
    K and N), by name; empty for most operators. They depend on the local shapes alone,
    the same on every device."""
    hook = entry(node.op_type, node.domain).local_attrs
    if hook is None or strategy.is_replicated:
        return {}
    op = OpView(node, graph, {}, None)

    def local(infos, specs):
        return [None if i is None or s is None else s.local_shape(i.shape, mesh) for i, s in zip(infos, specs)]

    return hook(op, local(op.ins, strategy.inputs), local(op.outs, strategy.outputs))
