"""A static batch dimension rewritten to the microbatch size.

Exporters often write the batch as a number (torch's dynamo exporter does unless told
otherwise): the inputs are ``[8, 16]``, and the batch size 8 sits in Reshape targets and
in constants the exporter folded (position ids and causal masks expanded to the batch).
To pipeline microbatches of ``8 / B`` samples, the per-device programs must compute on
that size, so the canonical model (folded at the full batch, every shape constant an
initializer) is rewritten as if its batch were split ``B`` ways, the way a sharded
strategy splits a batch dim on a mesh axis of size ``B``:

- the batch axis of each batched input is split; every node then takes the strategy
  (from its op's sharding rule) under which the inputs that carry the batch are split
  where they carry it, and its outputs carry it where that strategy splits them;
- a shape input the split changes (a Reshape target, an Expand shape) becomes the
  strategy's local value, as in a sharded stage's program;
- a constant the strategy needs split along the batch (a mask or position table the
  exporter expanded to the batch) is cut to its first microbatch, which is correct only
  because every microbatch's part of it is the same: that is checked;
- anything else — an operator without a strategy that keeps the batch apart (a reduction
  over the batch, a Reshape that moves the batch inside another dimension, an operator
  without a sharding rule), a constant that differs between microbatches, a non-batched
  input or tensor with the batch size where the batch must be, an output without the
  batch — is refused with the node or tensor it concerns, never computed wrong.

Finally onnx's shape inference must give every tensor its expected microbatch shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.errors import PlanError
from meshplan.intra.strategies import Strategy, local_attributes, node_strategies
from meshplan.model.fold import infer_shapes
from meshplan.model.graph import Graph, build_graph
from meshplan.ops import SMALL_CONSTANT_ELEMENTS, rule_of
from meshplan.sharding import LogicalMesh, ShardingSpec

ReadTensor = Callable[[onnx.TensorProto], np.ndarray]


@dataclass
class StaticBatchRewrite:
    """What ``rewrite_static_batch`` changed."""

    axes: dict[str, int] = field(default_factory=dict)       # batched input or output → its batch axis
    shape_constants: list[str] = field(default_factory=list)  # shape inputs given their microbatch value
    constants_cut: list[str] = field(default_factory=list)    # constants cut to their first microbatch


class _Batch:
    """The batch axis of every tensor: found node by node in graph order."""

    def __init__(self, graph: Graph, model: onnx.ModelProto, inputs: dict[str, int], parts: int, read: ReadTensor):
        self.graph, self.parts, self.read = graph, parts, read
        name, axis = next(iter(inputs.items()))
        self.size = graph.tensors[name].shape[axis]
        self.mesh = LogicalMesh((parts, 1), tuple(range(parts)))
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.constants = {name: numpy_helper.to_array(t) for name, t in self.initializers.items()
                          if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims) <= SMALL_CONSTANT_ELEMENTS}
        self.axis: dict[str, int] = dict(inputs)          # tensor → its batch axis
        self.demanded: dict[str, int] = {}                  # non-batched computed tensor → axis a consumer needs split
        self.producer = graph.producers()
        self.chosen: list[Strategy | None] = []
        self._strategies: dict[int, list[Strategy]] = {}
        self._cuttable: dict[tuple[str, int], str | None] = {}

    def split_axis(self, spec: ShardingSpec | None) -> int | None:
        if spec is None or spec.partial:
            return None
        split = [d for d, p in enumerate(spec.dims) if p != "R"]
        return split[0] if split else None

    def assign(self) -> None:
        """Choose each node's strategy; start over when a consumer needs a tensor computed
        before it split (an expansion to the batch the folding left in the graph)."""
        while True:
            try:
                self._pass()
                return
            except _Restart:
                continue

    def _pass(self) -> None:
        self.axis = {name: a for name, a in self.axis.items() if name in self.graph.inputs}
        self.chosen = []
        for index, node in enumerate(self.graph.nodes):
            carried = {i: self.axis[name] for i, name in enumerate(node.inputs) if name in self.axis}
            wanted = {i: self.demanded[name] for i, name in enumerate(node.outputs) if name in self.demanded}
            if not carried and not wanted:
                self.chosen.append(None)
                continue
            strategy = self._choose(index, node, carried, wanted)
            self.chosen.append(strategy)
            for name, spec in zip(node.outputs, strategy.outputs):
                axis = self.split_axis(spec)
                if name and axis is not None:
                    self.axis[name] = axis

    def _choose(self, index: int, node, carried: dict[int, int], wanted: dict[int, int]) -> Strategy:
        """The strategy that splits the carried inputs and the wanted outputs where they
        carry the batch, every output somewhere, and the fewest other inputs."""
        if index not in self._strategies:
            self._strategies[index] = node_strategies(node, self.graph, self.mesh, self.constants, self.graph.opset)
        best, best_cost, blocker = None, None, None
        for strategy in self._strategies[index]:
            if any(s is not None and s.partial for s in strategy.inputs + strategy.outputs):
                continue
            if any(self.split_axis(strategy.inputs[i]) != a for i, a in carried.items()):
                continue
            if any(self.split_axis(strategy.outputs[i]) != a for i, a in wanted.items()):
                continue
            if any(name and self.split_axis(spec) is None for name, spec in zip(node.outputs, strategy.outputs)):
                continue
            cost, problem = 0, None
            for i, (name, spec) in enumerate(zip(node.inputs, strategy.inputs)):
                axis = self.split_axis(spec)
                if not name or i in carried or axis is None:
                    continue
                problem = self._can_cut(name, axis)
                if problem:
                    break
                cost += 1
            if problem:
                blocker = blocker or problem
                continue
            if best is None or cost < best_cost:
                best, best_cost = strategy, cost
        if best is None:
            raise PlanError(blocker) if blocker else self._no_strategy(node, carried, wanted)
        for i, (name, spec) in enumerate(zip(node.inputs, best.inputs)):
            axis = self.split_axis(spec)
            if name and i not in carried and axis is not None and name in self.producer and name not in self.demanded:
                self.demanded[name] = axis
                raise _Restart
        return best

    def _can_cut(self, name: str, axis: int) -> str | None:
        """Why tensor ``name`` (not carrying the batch) cannot be split along ``axis``; None
        if it can: a constant the same for every microbatch, or a tensor computed from
        constants (its producer is then asked to split it)."""
        if (name, axis) not in self._cuttable:
            self._cuttable[name, axis] = self._cut_problem(name, axis)
        return self._cuttable[name, axis]

    def _cut_problem(self, name: str, axis: int) -> str | None:
        size = self.graph.tensors[name].shape[axis]
        if name in self.graph.inputs:
            return (f"input '{name}' has size {size} at axis {axis} where the batch must be, but is not a batched input"
                    f" (name it with --batch-dim {name}:{axis})")
        if name in self.initializers:
            value = self.read(self.initializers[name])
            parts = np.split(value, self.parts, axis=axis)
            if not all(np.array_equal(p, parts[0]) for p in parts[1:]):
                return (f"constant '{name}' {list(value.shape)} differs between the microbatches along the batch axis"
                        f" (axis {axis}); rewriting it would change the results")
            return None
        return None if name in self.producer else f"tensor '{name}' cannot be cut along the batch axis"

    def _no_strategy(self, node, carried: dict[int, int], wanted: dict[int, int]) -> PlanError:
        if not carried:
            i, axis = next(iter(wanted.items()))
            return PlanError(f"tensor '{node.outputs[i]}' (output of {node.op_type} node '{node.name}') is needed per"
                             f" microbatch along axis {axis}, which {node.op_type} cannot give",
                             hint="use --microbatches 1")
        i, axis = next(iter(carried.items()))
        if rule_of(node.op_type, node.domain) is None:
            reason = f"meshplan has no sharding rule for {node.op_type}"
        elif node.op_type in _RESHAPES:
            reason = f"the new shape does not keep each microbatch of {self.size // self.parts} sample(s) whole and outermost"
        else:
            reason = "the operator combines values across the batch axis"
        return PlanError(f"the batch cannot be kept apart at {node.op_type} node '{node.name}' (its input "
                         f"'{node.inputs[i]}' carries the batch at axis {axis}): {reason}", hint="use --microbatches 1")


_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


class _Restart(Exception):
    pass


def rewrite_static_batch(model: onnx.ModelProto, read: ReadTensor, inputs: dict[str, int], parts: int) -> StaticBatchRewrite:
    """Rewrite ``model`` (folded, static shapes) in place to run on 1/``parts`` of its batch.

    ``inputs`` maps each batched input to its batch axis; ``read`` gives an initializer's
    value (the large ones are read only when a strategy needs them cut). Raises PlanError
    naming what cannot be rewritten."""
    graph = build_graph(infer_shapes(model))
    for name, axis in inputs.items():
        size = graph.tensors[name].shape[axis]
        if size % parts:
            raise PlanError(f"the batch axis {axis} of input '{name}' has size {size}, not divisible by {parts}")
    batch = _Batch(graph, model, inputs, parts, read)
    batch.assign()
    done = StaticBatchRewrite(axes=dict(inputs))
    for name in graph.outputs:
        if name not in batch.axis:
            raise PlanError(f"model output '{name}' does not carry the batch", hint="use --microbatches 1")
        done.axes[name] = batch.axis[name]
    _apply(model, graph, batch, done)
    for value in list(model.graph.input) + list(model.graph.output):
        if value.name in done.axes:
            dim = value.type.tensor_type.shape.dim[done.axes[value.name]]
            dim.dim_value = graph.tensors[value.name].shape[done.axes[value.name]] // parts
    del model.graph.value_info[:]
    _check_shapes(model, graph, batch)
    return done


def _apply(model: onnx.ModelProto, graph: Graph, batch: _Batch, done: StaticBatchRewrite) -> None:
    """Give the nodes their local shape inputs, attributes and cut constants."""
    taken = {t.name for t in model.graph.initializer} | set(graph.tensors)
    made: dict[tuple, str] = {}
    added: list[onnx.TensorProto] = []

    def new_initializer(key: tuple, base: str, value: np.ndarray) -> str:
        if key not in made:
            name, k = f"{base}_microbatch", 1
            while name in taken:
                k += 1
                name = f"{base}_microbatch{k}"
            taken.add(name)
            added.append(numpy_helper.from_array(value, name))
            made[key] = name
        return made[key]

    for proto, node, strategy in zip(model.graph.node, graph.nodes, batch.chosen):
        if strategy is None:
            continue
        rewrites = dict(strategy.rewrites)
        for i, name in enumerate(node.inputs):
            if i in rewrites:
                original = batch.initializers[name]
                dtype = helper.tensor_dtype_to_np_dtype(original.data_type)
                value = np.array(rewrites[i], dtype=dtype)
                proto.input[i] = new_initializer(("shape", name, tuple(rewrites[i])), name, value)
                if name not in done.shape_constants:
                    done.shape_constants.append(name)
            elif name and name in batch.initializers and name not in batch.axis:
                axis = batch.split_axis(strategy.inputs[i])
                if axis is None:
                    continue
                value = batch.read(batch.initializers[name])
                first = np.split(value, batch.parts, axis=axis)[0]
                proto.input[i] = new_initializer(("cut", name, axis), name, np.ascontiguousarray(first))
                if name not in done.constants_cut:
                    done.constants_cut.append(name)
        for key, value in local_attributes(node, graph, strategy, batch.mesh).items():
            attribute = next(a for a in proto.attribute if a.name == key)
            attribute.CopyFrom(helper.make_attribute(key, value))
    model.graph.initializer.extend(added)
    used = {name for node in model.graph.node for name in node.input} | {v.name for v in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    if len(kept) != len(model.graph.initializer):
        dropped = {t.name for t in model.graph.initializer} - {t.name for t in kept}
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        inputs = [v for v in model.graph.input if v.name not in dropped]
        del model.graph.input[:]
        model.graph.input.extend(inputs)


def _check_shapes(model: onnx.ModelProto, graph: Graph, batch: _Batch) -> None:
    """Shape inference on the rewritten model must give every tensor its microbatch shape."""
    inferred = build_graph(infer_shapes(model))
    for node in graph.nodes:
        for name in node.outputs:
            if not name:
                continue
            expected = list(graph.tensors[name].shape)
            if name in batch.axis:
                expected[batch.axis[name]] //= batch.parts
            found = inferred.tensors.get(name)
            if found is None or list(found.shape) != expected:
                got = "unknown" if found is None else list(found.shape)
                raise PlanError(f"rewriting the static batch gives tensor '{name}' (output of {node.op_type} node"
                                f" '{node.name}') the shape {got}, expected {expected}", hint="use --microbatches 1")
