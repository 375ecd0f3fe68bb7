"""A static batch dimension rewritten to the microbatch size.

Exporters often write the batch as a number (torch's dynamo exporter does unless told
otherwise): the inputs are ``[8, 16]``, and the batch size 8 sits in Reshape targets and
in constants the exporter folded (position ids and causal masks expanded to the batch).
To pipeline B microbatches, the per-device programs must compute on batch/B samples, so
the canonical model (folded at the full batch, every shape constant an initializer) is
rewritten as if its batch were split B ways on a mesh axis of size B:

- the batch axis of each batched input is split; every operator but a reshape takes the
  strategy of its sharding rule that splits the inputs carrying the batch where they
  carry it, and its outputs carry it where that strategy splits them; a shape input the
  split changes (an Expand shape) becomes the strategy's local value, as in a sharded
  stage's program;
- a reshape (Reshape, Flatten, Squeeze, Unsqueeze) keeps the microbatch index where it is
  in the row-major order of the elements, which may put it inside a merged dimension
  (``[seq, batch, …]`` flattened to ``[seq·batch, …]``, as torch's MultiheadAttention
  does); a Reshape target gets its microbatch value;
- a constant that must be split along the batch (a mask or position table the exporter
  expanded to it) is cut to the first microbatch's part, which is correct only because
  every microbatch's part of it is the same: that is checked;
- anything else — an operator without a strategy that keeps the batch apart (a reduction
  over the batch, a Reshape that spreads a microbatch over dimensions, an operator
  without a sharding rule), a constant that differs between microbatches, a non-batched
  input or tensor with the batch size where the batch must be, an output without the
  batch or with it inside a dimension — is refused naming the node or tensor, never
  computed wrong.

Finally onnx's shape inference must give every tensor its expected microbatch shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

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


@dataclass(frozen=True)
class _Choice:
    """How one node runs on a microbatch."""

    outputs: dict[int, tuple[int, int]]                 # output index → where it carries the batch
    rewrites: dict[int, tuple[int, ...]] = field(default_factory=dict)   # shape input index → its local value
    cuts: dict[int, tuple[int, int]] = field(default_factory=dict)       # constant input index → where to cut it
    attrs: dict = field(default_factory=dict)           # attributes with local values (MatMulNBits' K, N)


# Where a tensor carries the batch: (axis, outer). The axis has size outer × parts × inner,
# the microbatch index in the middle: outer is 1 unless a Reshape merged dimensions before
# the batch into it (torch's MultiheadAttention flattens [seq, batch, …] into [seq·batch, …]).
Place = tuple[int, int]

_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


class _Batch:
    """Where every tensor carries the batch, found node by node in graph order."""

    def __init__(self, graph: Graph, model: onnx.ModelProto, inputs: dict[str, int], parts: int, read: ReadTensor):
        self.graph, self.parts, self.read = graph, parts, read
        name, axis = next(iter(inputs.items()))
        self.size = graph.tensors[name].shape[axis]
        self.inputs = {name: (axis, 1) for name, axis in inputs.items()}
        self.mesh = LogicalMesh((parts, 1), tuple(range(parts)))
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.constants = {name: numpy_helper.to_array(t) for name, t in self.initializers.items()
                          if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims) <= SMALL_CONSTANT_ELEMENTS}
        self.place: dict[str, Place] = {}
        self.demanded: dict[str, Place] = {}     # tensor computed from constants → where a consumer needs the batch
        self.producer = graph.producers()
        self.chosen: list[_Choice | None] = []
        self._strategies: dict[int, list[Strategy]] = {}
        self._cuttable: dict[tuple[str, Place], str | None] = {}

    def assign(self) -> None:
        """Choose how each node runs; start over when a consumer needs a tensor computed
        from constants to follow the batch (an expansion the folding left in the graph)."""
        while True:
            try:
                self._pass()
                return
            except _Restart:
                continue

    def _pass(self) -> None:
        self.place = dict(self.inputs)
        self.chosen = []
        for index, node in enumerate(self.graph.nodes):
            carried = {i: self.place[name] for i, name in enumerate(node.inputs) if name in self.place}
            wanted = {i: self.demanded[name] for i, name in enumerate(node.outputs) if name in self.demanded}
            if not carried and not wanted:
                self.chosen.append(None)
                continue
            if node.op_type in _RESHAPES and node.domain in ("", "ai.onnx") and carried:
                choice = self._reshape(node, carried, wanted)
            else:
                choice = self._by_rule(index, node, carried, wanted)
            self.chosen.append(choice)
            for i, place in choice.outputs.items():
                self.place[node.outputs[i]] = place

    # --- reshapes: follow the batch through the row-major order ------------------------

    def _reshape(self, node, carried: dict[int, Place], wanted: dict[int, Place]) -> _Choice:
        """The microbatch index keeps its place in the row-major order of the elements:
        whatever comes before it (``pre`` values of index) stays before it. It lands in the
        output dim whose prefix product divides ``pre`` and whose size holds the rest of
        ``pre`` times the microbatch count."""
        if set(carried) != {0}:
            raise self._refuse(node, carried, "its shape input carries the batch")
        (axis, outer), = carried.values()
        src, dst = self.graph.tensors[node.inputs[0]].shape, self.graph.tensors[node.outputs[0]].shape
        pre = prod(src[:axis]) * outer
        found = None
        for j, size in enumerate(dst):
            before = prod(dst[:j])
            if pre % before == 0 and size % ((pre // before) * self.parts) == 0:
                found = (j, pre // before)
                break
        if found is None or any(place != found for place in wanted.values()):
            raise self._refuse(node, carried, f"the new shape does not keep each microbatch of {self.size // self.parts}"
                                              " sample(s) inside one dimension")
        local = tuple(size // self.parts if j == found[0] else size for j, size in enumerate(dst))
        rewrites = {}
        if node.op_type == "Reshape":
            if node.inputs[1] not in self.initializers:
                raise self._refuse(node, carried, "its shape is computed when the model runs")
            rewrites[1] = local
        return _Choice({0: found}, rewrites)

    # --- every other operator: its sharding rule ---------------------------------------

    def _by_rule(self, index: int, node, carried: dict[int, Place], wanted: dict[int, Place]) -> _Choice:
        """The strategy that splits the carried inputs and the wanted outputs where they
        carry the batch, every output somewhere, and the fewest other inputs. Every split a
        rule allows (a Reshape excepted) computes each index of the dim on its own, so a
        batch inside a dim (outer > 1) splits the same way."""
        outers = {outer for _, outer in list(carried.values()) + list(wanted.values())}
        if len(outers) > 1:
            raise self._refuse(node, carried, "its inputs carry the batch at different places inside their dims")
        outer = outers.pop()
        if outer != 1 and node.op_type in _RESHAPES:
            raise PlanError(f"{node.op_type} node '{node.name}' would have to reshape constants with the batch inside"
                            " a dimension", hint="use --microbatches 1")
        if index not in self._strategies:
            self._strategies[index] = node_strategies(node, self.graph, self.mesh, self.constants, self.graph.opset)
        best, best_cost, blocker = None, None, None
        for strategy in self._strategies[index]:
            if any(s is not None and s.partial for s in strategy.inputs + strategy.outputs):
                continue
            if any(_split_axis(strategy.inputs[i]) != axis for i, (axis, _) in carried.items()):
                continue
            if any(_split_axis(strategy.outputs[i]) != axis for i, (axis, _) in wanted.items()):
                continue
            if any(name and _split_axis(spec) is None for name, spec in zip(node.outputs, strategy.outputs)):
                continue
            others = {i: _split_axis(spec) for i, (name, spec) in enumerate(zip(node.inputs, strategy.inputs))
                      if name and i not in carried and _split_axis(spec) is not None}
            problem = next((p for i, axis in others.items() if (p := self._can_cut(node.inputs[i], (axis, outer)))), None)
            if problem:
                blocker = blocker or problem
                continue
            if best is None or len(others) < best_cost:
                best, best_cost = strategy, len(others)
        if best is None:
            raise PlanError(blocker) if blocker else self._no_rule(node, carried, wanted)
        cuts = {}
        for i, (name, spec) in enumerate(zip(node.inputs, best.inputs)):
            axis = _split_axis(spec)
            if not name or i in carried or axis is None:
                continue
            if name in self.initializers:
                cuts[i] = (axis, outer)
            elif name not in self.demanded:
                self.demanded[name] = (axis, outer)
                raise _Restart
        outputs = {i: (_split_axis(spec), outer) for i, (name, spec) in enumerate(zip(node.outputs, best.outputs)) if name}
        return _Choice(outputs, dict(best.rewrites), cuts, local_attributes(node, self.graph, best, self.mesh))

    def _can_cut(self, name: str, place: Place) -> str | None:
        """Why tensor ``name`` (not carrying the batch) cannot be split at ``place``; None
        if it can: a constant the same for every microbatch, or a tensor computed from
        constants (its producer is then asked to split it)."""
        if (name, place) not in self._cuttable:
            self._cuttable[name, place] = self._cut_problem(name, place)
        return self._cuttable[name, place]

    def _cut_problem(self, name: str, place: Place) -> str | None:
        axis, outer = place
        size = self.graph.tensors[name].shape[axis]
        if name in self.graph.inputs:
            return (f"input '{name}' has size {size} at axis {axis} where the batch must be, but is not a batched input"
                    f" (name it with --batch-dim {name}:{axis})")
        if name in self.initializers:
            if size % (outer * self.parts):
                return f"constant '{name}' has size {size} at axis {axis} where the batch must be"
            parts = np.split(_batch_view(self.read(self.initializers[name]), place, self.parts), self.parts, axis=axis + 1)
            if not all(np.array_equal(p, parts[0]) for p in parts[1:]):
                return (f"constant '{name}' {list(self.graph.tensors[name].shape)} differs between the microbatches"
                        f" along the batch axis (axis {axis}); rewriting it would change the results")
            return None
        return None if name in self.producer else f"tensor '{name}' cannot be cut along the batch axis"

    def cut(self, value: np.ndarray, place: Place) -> np.ndarray:
        """A constant's part for the first microbatch."""
        axis = place[0]
        first = np.split(_batch_view(value, place, self.parts), self.parts, axis=axis + 1)[0]
        shape = value.shape[:axis] + (value.shape[axis] // self.parts,) + value.shape[axis + 1:]
        return np.ascontiguousarray(first).reshape(shape)

    def _refuse(self, node, carried: dict[int, Place], reason: str) -> PlanError:
        i, (axis, _) = next(iter(carried.items()))
        return PlanError(f"the batch cannot be kept apart at {node.op_type} node '{node.name}' (its input "
                         f"'{node.inputs[i]}' carries the batch at axis {axis}): {reason}", hint="use --microbatches 1")

    def _no_rule(self, node, carried: dict[int, Place], wanted: dict[int, Place]) -> PlanError:
        if not carried:
            i, (axis, _) = next(iter(wanted.items()))
            return PlanError(f"tensor '{node.outputs[i]}' (output of {node.op_type} node '{node.name}') is needed per"
                             f" microbatch along axis {axis}, which {node.op_type} cannot give",
                             hint="use --microbatches 1")
        if rule_of(node.op_type, node.domain) is None:
            return self._refuse(node, carried, f"meshplan has no sharding rule for {node.op_type}")
        return self._refuse(node, carried, "the operator combines values across the batch axis")


def _split_axis(spec: ShardingSpec | None) -> int | None:
    """The dim a spec on the one-axis mesh splits (None: replicated, absent or partial)."""
    if spec is None or spec.partial:
        return None
    split = [d for d, p in enumerate(spec.dims) if p != "R"]
    return split[0] if split else None


def _batch_view(value: np.ndarray, place: Place, parts: int) -> np.ndarray:
    """``value`` with its batch axis spread into (outer, parts, inner)."""
    axis, outer = place
    inner = value.shape[axis] // (outer * parts)
    return value.reshape(value.shape[:axis] + (outer, parts, inner) + value.shape[axis + 1:])


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
        if name not in batch.place:
            raise PlanError(f"model output '{name}' does not carry the batch", hint="use --microbatches 1")
        axis, outer = batch.place[name]
        if outer != 1:
            raise PlanError(f"model output '{name}' carries the batch inside its axis {axis}, after {outer} other"
                            " indices: its microbatches would not be contiguous", hint="use --microbatches 1")
        done.axes[name] = axis
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

    for proto, node, choice in zip(model.graph.node, graph.nodes, batch.chosen):
        if choice is None:
            continue
        for i, local in choice.rewrites.items():
            name = node.inputs[i]
            dtype = helper.tensor_dtype_to_np_dtype(batch.initializers[name].data_type)
            proto.input[i] = new_initializer(("shape", name, tuple(local)), name, np.array(local, dtype=dtype))
            if name not in done.shape_constants:
                done.shape_constants.append(name)
        for i, place in choice.cuts.items():
            name = node.inputs[i]
            proto.input[i] = new_initializer(("cut", name, place), name, batch.cut(batch.read(batch.initializers[name]), place))
            if name not in done.constants_cut:
                done.constants_cut.append(name)
        for key, value in choice.attrs.items():
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
            if name in batch.place:
                expected[batch.place[name][0]] //= batch.parts
            found = inferred.tensors.get(name)
            if found is None or list(found.shape) != expected:
                got = "unknown" if found is None else list(found.shape)
                raise PlanError(f"rewriting the static batch gives tensor '{name}' (output of {node.op_type} node"
                                f" '{node.name}') the shape {got}, expected {expected}", hint="use --microbatches 1")
