"""One device's program of a sharded stage.

Starts from the stage's subgraph (cut with ``onnx.utils.Extractor``, weights loaded) and
rewrites it for the device at one coordinate of the stage's logical mesh:

- each weight is sliced to the shard the chosen strategy gives this device;
- shape constants the split changes (a Reshape target, an Expand shape) are replaced by
  the strategy's local values, and attributes that name sizes (MatMulNBits' K and N) by
  their local sizes;
- where a tensor's spec differs from what its consumer's strategy needs, the resharding
  steps are inserted: communication as collective nodes of the ``meshplan`` domain
  (``AllReduce``, ``AllGather``, ``ReduceScatter``, ``AllToAll`` with ``axis``, ``dim``
  and, for ``AllToAll``, ``to_dim`` attributes),
  local slicing as a standard ``Slice``;
- the stage's inputs arrive, and its outputs leave, in the specs the plan gives them
  (cross-mesh resharding moves them between stages);
- a parameter expression (a transposed or dequantized weight…) is built on the device
  from its sources' slices: the chain's nodes are replayed on them, each under the
  strategy ``derive`` gives it, once per layout the device needs;
- an initializer is stored once per layout, and where one device needs it whole and
  also split (a tied embedding), only whole: the split layouts are cut from it by
  ``Slice`` nodes.

A tensor held with spec X is named ``name@X`` in the program (just ``name`` when
replicated), so one tensor may exist in several layouts.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.model.graph import Graph
from meshplan.model.opsets import DEFAULT_OPSET
from meshplan.reshard.steps import Step, reshard_steps
from meshplan.sharding import LogicalMesh, ShardingSpec, take
from meshplan.intra.strategies import Strategy, derive, local_attributes, source_specs
from meshplan.ops import SMALL_CONSTANT_ELEMENTS
from meshplan.ops.view import LocalShape
from meshplan.emit.collective_order import order_by_levels
from meshplan.plan_format import COLLECTIVE_DOMAIN, local_name
from meshplan.emit.program_weights import PendingSlice, can_defer, placeholder

def replicated_strategy(node: onnx.NodeProto, graph: Graph) -> Strategy:
    def spec(name):
        return ShardingSpec.replicated(len(graph.tensors[name].shape)) if name else None

    return Strategy(tuple(spec(n) for n in node.input), tuple(spec(n) for n in node.output))


class _Builder:
    def __init__(self, stage: onnx.ModelProto, graph: Graph, mesh: LogicalMesh, rank: int,
                 pending: dict[str, PendingSlice] | None = None):
        self.graph = graph
        self.pending = pending
        self.mesh = mesh
        self.coord = mesh.coord(rank)
        self.weights = {t.name: t for t in stage.graph.initializer}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.value_info: dict[str, onnx.ValueInfoProto] = {}
        self.available: dict[str, dict[ShardingSpec, str]] = {}
        self.opset = next((o.version for o in stage.opset_import if o.domain in ("", "ai.onnx")), DEFAULT_OPSET)
        self.collectives: list[dict] = []   # what crosses each segment boundary, for plan.json
        self.constants = {t.name: numpy_helper.to_array(t) for t in stage.graph.initializer
                          if np.prod(t.dims) <= SMALL_CONSTANT_ELEMENTS and t.data_type != onnx.TensorProto.STRING}
        self.chain_nodes = {out: node for node in stage.graph.node for out in node.output if out in graph.chains}
        self.whole: set[str] = set()   # initializers this device also stores whole
        self._resharding: tuple[str, ShardingSpec, ShardingSpec] | None = None   # (tensor, spec, after) of the step emitted
        self.pending_after: list[onnx.NodeProto] = []   # nodes that go right after the node being emitted

    def _describe(self, name: str, tensor: str, spec: ShardingSpec) -> None:
        info = self.graph.tensors[tensor]
        elem = helper.np_dtype_to_tensor_dtype(info.dtype)
        shape = list(spec.local_shape(info.shape, self.mesh))
        for axis in info.dynamic + info.ranged:   # data-dependent or ranged: its size known at run time
            shape[axis] = None
        self.value_info[name] = helper.make_tensor_value_info(name, elem, shape)

    def provide(self, tensor: str, spec: ShardingSpec) -> str:
        name = local_name(tensor, spec)
        self.available.setdefault(tensor, {})[spec] = name
        self._describe(name, tensor, spec)
        return name

    def constant(self, name: str, value: np.ndarray) -> str:
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(value, name)
        return name

    def weight(self, tensor: str, spec: ShardingSpec | None) -> str:
        if spec is None or spec.is_replicated:
            self.initializers.setdefault(tensor, self.weights[tensor])
            return tensor
        name = local_name(tensor, spec)
        if tensor in self.whole and not spec.partial and name not in self.initializers:
            replicated = ShardingSpec.replicated(len(spec.dims))
            self.available.setdefault(tensor, {})[replicated] = self.weight(tensor, replicated)
            return self.ensure(tensor, spec)   # local slices of the whole weight
        if name not in self.initializers:
            source = self.weights[tensor]
            slices = spec.local_slices(tuple(source.dims), self.mesh, self.coord)
            zero = bool(spec.partial) and any(self.coord[a] != 0 for a in spec.partial)  # one device of each partial group holds the value
            if self.pending is not None and can_defer(source):
                shape = spec.local_shape(tuple(source.dims), self.mesh)
                self.initializers[name] = placeholder(name, source, tuple(shape))
                self.pending[name] = PendingSlice(source, tuple(slices), zero)
                return name
            full = numpy_helper.to_array(source)
            part = np.ascontiguousarray(take(full, slices))
            if zero:
                part = np.zeros_like(part)
            self.initializers[name] = numpy_helper.from_array(part, name)
        return name

    def needs(self, node, strategy: Strategy) -> None:
        """Note the initializers ``node`` reads whole under ``strategy`` (``whole``)."""
        for name, spec in zip(node.input, strategy.inputs):
            info = self.graph.tensors.get(name) if name else None
            if info is None or not info.is_param:
                continue
            spec = spec or ShardingSpec.replicated(len(info.shape))
            stored = source_specs(self.graph, name, spec, self.mesh, self.constants, self.opset) or {}
            self.whole.update(source for source, layout in stored.items() if layout.is_replicated)

    def parameter(self, tensor: str, spec: ShardingSpec | None) -> str:
        """The local name of parameter expression ``tensor`` in ``spec``, its chain replayed on
        this device's slices of its sources."""
        spec = spec or ShardingSpec.replicated(len(self.graph.tensors[tensor].shape))
        steps = derive(self.graph, tensor, spec, self.mesh, self.constants, self.opset)
        if steps is None:
            raise ValueError(f"parameter '{tensor}' cannot be built in layout {spec}")
        for node, strategy in steps:
            out, layout = node.outputs[0], strategy.outputs[0]
            if layout in self.available.get(out, {}):
                continue
            rewrites = dict(strategy.rewrites)
            inputs = []
            for k, (name, want) in enumerate(zip(node.inputs, strategy.inputs)):
                if not name:
                    inputs.append("")
                elif k in rewrites and isinstance(rewrites[k], LocalShape):
                    inputs.append(self.local_shape_input(f"{node.name}@{layout}/input{k}", name, rewrites[k]))
                elif k in rewrites:
                    inputs.append(self.constant(f"{node.name}@{layout}/input{k}/local",
                                                np.array(rewrites[k], dtype=np.int64)))
                elif name in self.weights:
                    inputs.append(self.weight(name, want))
                else:
                    inputs.append(self.available[name][want])
            local = onnx.NodeProto()
            local.CopyFrom(self.chain_nodes[out])
            local.name = node.name if layout.is_replicated else f"{node.name}@{layout}"
            del local.input[:]
            local.input.extend(inputs)
            del local.output[:]
            local.output.append(self.provide(out, layout))
            attrs = local_attributes(node, self.graph, strategy, self.mesh)
            for attribute in local.attribute:
                if attribute.name in attrs:
                    attribute.CopyFrom(helper.make_attribute(attribute.name, attrs[attribute.name]))
            self.nodes.append(local)
        return self.available[tensor][spec]

    def ensure(self, tensor: str, want: ShardingSpec) -> str:
        """The local name of ``tensor`` in layout ``want``, inserting resharding steps."""
        have = self.available[tensor]
        if want in have:
            return have[want]
        source = min(have, key=lambda s: len(reshard_steps(s, want)))
        spec, name = source, have[source]
        segments = dict(source.segments) | dict(want.segments)   # the tensor's, whichever spec carries them
        spec = spec.with_segments(segments)
        for step in reshard_steps(spec, want.with_segments(segments)):
            after = step.spec_after(spec)
            self._resharding = (tensor, spec, after)
            step.kind.emit(step, self, name, local_name(tensor, after))
            spec, name = after, self.provide(tensor, after)
        return name

    def collective(self, step: Step, source: str, out: str) -> None:
        """The step's collective node (``meshplan`` domain); ``ensure`` calls it through the step's kind.
        An all-gather of a segmented dim gathers the devices' parts in group order, then a
        ``Gather`` puts the dim back in order (and keeps one copy of a head several devices hold)."""
        tensor, spec, after = self._resharding
        attrs = step.attributes()
        op = step.kind.op_type
        gathered = out
        reorder = step.dim is not None and op == "AllGather" and self._reordered(tensor, spec, after, step.dim)
        if reorder:
            gathered = f"{out}/gathered"
        self.nodes.append(helper.make_node(op, [source], [gathered], name=f"{out}/{step.kind}", domain=COLLECTIVE_DOMAIN,
                                           **attrs))
        self.collectives.append({"tensor": tensor, "op": op, **attrs, "from_spec": str(spec), "to_spec": str(after)})
        if reorder:
            size = self.graph.tensors[tensor].shape[step.dim]
            group = next(g for g in self.mesh.axis_groups(step.axis) if self.mesh.ranks[self._index()] in g)
            held = np.concatenate([spec.local_indices(step.dim, size, self.mesh, self.mesh.coord(r)) for r in group])
            info = self.graph.tensors[tensor]
            shape = list(spec.local_shape(info.shape, self.mesh))
            shape[step.dim] = len(held)
            for axis in info.dynamic + info.ranged:   # its size known at run time
                shape[axis] = None
            self.value_info[gathered] = helper.make_tensor_value_info(
                gathered, helper.np_dtype_to_tensor_dtype(info.dtype), shape)
            self._take(gathered, out, step.dim, held, after.local_indices(step.dim, size, self.mesh, self.coord))

    def _index(self) -> int:
        return self.coord[0] * self.mesh.shape[1] + self.coord[1]

    def _reordered(self, tensor: str, spec: ShardingSpec, after: ShardingSpec, dim: int) -> bool:
        return spec.segmented(dim, self.mesh) is not None or after.segmented(dim, self.mesh) is not None

    def _take(self, source: str, out: str, dim: int, held: np.ndarray, wanted: np.ndarray) -> None:
        """``out`` = the positions ``wanted`` (of the full dim) picked from ``source``, which
        holds the positions ``held`` along ``dim``, by a ``Gather``."""
        first = {}
        for position, index in enumerate(held.tolist()):
            first.setdefault(index, position)
        picks = self.constant(f"{out}/indices", np.array([first[i] for i in wanted.tolist()], dtype=np.int64))
        self.nodes.append(helper.make_node("Gather", [source, picks], [out], name=f"{out}/reorder", axis=dim))

    def local_slice(self, step: Step, source: str, out: str) -> None:
        """A standard ``Slice`` keeping this device's chunk of ``step.dim``; ``ensure`` calls it
        through the step's kind."""
        tensor, spec, after = self._resharding
        if self._reordered(tensor, spec, after, step.dim):
            full = self.graph.tensors[tensor].shape[step.dim]
            self._take(source, out, step.dim, spec.local_indices(step.dim, full, self.mesh, self.coord),
                       after.local_indices(step.dim, full, self.mesh, self.coord))
            return
        size = spec.local_shape(self.graph.tensors[tensor].shape, self.mesh)[step.dim]
        index = self.mesh.axis_index(self.coord, step.axis)
        chunk = size // self.mesh.axis_size(step.axis)
        base = f"{out}/slice"
        if step.dim in self.graph.tensors[tensor].ranged:   # its size follows the call: bounds computed then
            self._runtime_slice(source, out, base, step.dim, index, self.mesh.axis_size(step.axis))
            return
        if self.opset < 10:  # Slice took attributes before opset 10
            self.nodes.append(helper.make_node("Slice", [source], [out], name=base, starts=[index * chunk],
                                               ends=[(index + 1) * chunk], axes=[step.dim]))
            return
        starts = self.constant(f"{base}/starts", np.array([index * chunk], dtype=np.int64))
        ends = self.constant(f"{base}/ends", np.array([(index + 1) * chunk], dtype=np.int64))
        axes = self.constant(f"{base}/axes", np.array([step.dim], dtype=np.int64))
        self.nodes.append(helper.make_node("Slice", [source, starts, ends, axes], [out], name=base))


    def _runtime_slice(self, source: str, out: str, base: str, dim: int, index: int, pieces: int) -> None:
        """Slice piece ``index`` of ``pieces`` of ``dim``, its bounds from the tensor's shape at run time."""
        size = f"{base}/size"
        self.nodes.append(helper.make_node("Shape", [source], [size], name=size, start=dim, end=dim + 1))
        chunk = f"{base}/chunk"
        self.nodes.append(helper.make_node("Div", [size, self.constant(f"{base}/pieces", np.array([pieces], np.int64))],
                                           [chunk], name=chunk))
        starts, ends = f"{base}/starts", f"{base}/ends"
        self.nodes.append(helper.make_node("Mul", [chunk, self.constant(f"{base}/index", np.array([index], np.int64))],
                                           [starts], name=starts))
        self.nodes.append(helper.make_node("Add", [starts, chunk], [ends], name=ends))
        axes = self.constant(f"{base}/axes", np.array([dim], dtype=np.int64))
        self.nodes.append(helper.make_node("Slice", [source, starts, ends, axes], [out], name=base))

    def local_shape_input(self, base: str, name: str, rewrite: LocalShape) -> str:
        """A shape input divided by the split at every size (``LocalShape``): computed now for a
        constant, by Div/Where nodes for one computed at run time."""
        if name in self.constants:
            return self.constant(f"{base}/local", np.array(rewrite.apply(self.constants[name].reshape(-1)),
                                                           dtype=np.int64))
        source = self.ensure(name, ShardingSpec.replicated(len(self.graph.tensors[name].shape)))
        divisors = self.constant(f"{base}/divisors", np.array(rewrite.divisors, dtype=np.int64))
        divided, keep, local = f"{base}/divided", f"{base}/keep", f"{base}/local"
        two = self.constant(f"{base}/two", np.array(2, dtype=np.int64))
        self.nodes.append(helper.make_node("Div", [source, divisors], [divided], name=divided))
        self.nodes.append(helper.make_node("Less", [source, two], [keep], name=keep))
        self.nodes.append(helper.make_node("Where", [keep, source, divided], [local], name=local))
        return local

    def global_shape(self, node: onnx.NodeProto, spec: ShardingSpec, out: str) -> str:
        """A Shape node on a split tensor: the local shape times the split, so that every shape
        computation downstream sees the whole tensor's (as in the model). Returns the name the
        Shape node writes."""
        rank = len(spec.dims)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else end)
        shards = np.array([spec.shards(d, self.mesh) for d in range(rank)][max(start, 0):min(end, rank)], np.int64)
        if not spec.split_axes() or (shards == 1).all():
            return out
        local = f"{out}/local"
        factor = self.constant(f"{out}/shards", shards)
        self.pending_after.append(helper.make_node("Mul", [local, factor], [out], name=f"{out}/whole"))
        return local


def shard_program(stage: onnx.ModelProto, graph: Graph, strategies: dict[str, Strategy],
                  mesh: LogicalMesh, rank: int, input_specs: dict[str, ShardingSpec],
                  output_specs: dict[str, ShardingSpec], collectives: list | None = None,
                  pending: dict[str, PendingSlice] | None = None) -> onnx.ModelProto:
    """The program of ``rank`` (a device of ``mesh``) for a stage cut from the canonical
    model; its inputs arrive in ``input_specs`` and its outputs leave in ``output_specs``.
    ``collectives``, when given, receives one entry per collective node (the tensor, the
    operation and its layout before and after: the specs at the segment boundaries).
    ``pending``, when given, receives the slices of external weights the program holds
    as placeholders (``program_weights.write_program`` streams them); without it, weights
    are sliced in memory."""
    build = _Builder(stage, graph, mesh, rank, pending)
    weights = build.weights
    for value in stage.graph.input:
        if value.name not in weights:
            build.provide(value.name, input_specs[value.name])
    by_name = {node.name: node for node in graph.nodes}
    planned = [node for node in stage.graph.node if node.output[0] not in graph.chains]
    for node in planned:
        build.needs(node, strategies.get(node.name) or replicated_strategy(node, graph))
    for node in planned:
        strategy = strategies.get(node.name) or replicated_strategy(node, graph)
        attrs = local_attributes(by_name[node.name], graph, strategy, mesh) if node.name in strategies else {}
        rewrites = dict(strategy.rewrites)
        inputs = []
        for k, name in enumerate(node.input):
            spec = strategy.inputs[k] if k < len(strategy.inputs) else None
            if not name:
                inputs.append("")
            elif k in rewrites and isinstance(rewrites[k], LocalShape):
                inputs.append(build.local_shape_input(f"{node.name}/input{k}", name, rewrites[k]))
            elif k in rewrites:
                inputs.append(build.constant(f"{node.name}/input{k}/local", np.array(rewrites[k], dtype=np.int64)))
            elif name in weights:
                inputs.append(build.weight(name, spec))
            elif graph.tensors[name].is_derived:
                inputs.append(build.parameter(name, spec))
            elif node.op_type == "Shape" and k == 0 and spec not in build.available.get(name, {}) \
                    and build.available.get(name):
                # a shape is the same in any layout: read the tensor as it is held (no gather)
                spec = next(iter(build.available[name]))
                strategy = Strategy((spec,) + strategy.inputs[1:], strategy.outputs, strategy.rewrites)
                inputs.append(build.available[name][spec])
            else:
                inputs.append(build.ensure(name, spec))
        outputs = [build.provide(name, spec) if name else "" for name, spec in zip(node.output, strategy.outputs)]
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and strategy.inputs[0] is not None:
            outputs[0] = build.global_shape(node, strategy.inputs[0], outputs[0])
        local = onnx.NodeProto()
        local.CopyFrom(node)
        del local.input[:]
        local.input.extend(inputs)
        del local.output[:]
        local.output.extend(outputs)
        for attribute in local.attribute:
            if attribute.name in attrs:
                attribute.CopyFrom(helper.make_attribute(attribute.name, attrs[attribute.name]))
        build.nodes.append(local)
        build.nodes.extend(build.pending_after)
        build.pending_after.clear()
    outputs = [build.value_info[build.ensure(v.name, output_specs[v.name])] for v in stage.graph.output]
    inputs = [build.value_info[local_name(v.name, input_specs[v.name])] for v in stage.graph.input if v.name not in weights]
    boundary = {v.name for v in inputs + outputs}
    program = helper.make_graph(
        order_by_levels(build.nodes, [v.name for v in outputs]), stage.graph.name, inputs, outputs,
        list(build.initializers.values()),
        value_info=[v for name, v in build.value_info.items() if name not in boundary],
    )
    if collectives is not None:
        collectives.extend(build.collectives)
    model = helper.make_model(program, opset_imports=list(stage.opset_import) + [helper.make_opsetid(COLLECTIVE_DOMAIN, 1)])
    model.ir_version = stage.ir_version
    return model
