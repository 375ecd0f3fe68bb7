"""Reverse mode over an ONNX graph: the gradient of a scalar with respect to chosen tensors,
as standard ONNX nodes appended to the graph.

Each operator's rule lives in the op registry beside its sharding rule (``ops.registry.
gradient``; the words rules are written in: ``ops/grad_words.py``). Only float tensors
carry gradients: integer, boolean and shape paths carry none. A tensor read by several
operators (a tied embedding, a weight behind a Transpose or Cast, a broadcast bias) gets
the sum of its gradients. An operator on a gradient path with no rule is a
``GradientError`` naming the op and the node: never a silently wrong gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.ops import registry
from meshplan.ops.grad_words import Dim, GradientError, GradNode

FLOATS = (np.float16, np.float32, np.float64, np.dtype("bfloat16") if hasattr(np, "bfloat16") else np.float32)
PREFIX = "grad"


def is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


@dataclass
class _Tape:
    """The backward nodes being written, with the forward graph's shapes and dtypes."""

    shapes: dict[str, tuple[Dim, ...]]
    dtypes: dict[str, np.dtype]
    known: dict[str, np.ndarray]            # constant values (axes, shapes) rules may read
    nodes: list = field(default_factory=list)
    constants: list = field(default_factory=list)
    where: str = ""                         # the forward node being differentiated
    count: int = 0

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{PREFIX}/{self.where}/{hint}_{self.count}"

    def emit(self, op_type, inputs, outputs, attrs, domain) -> list[str]:
        names = [self.fresh(op_type) for _ in range(outputs)]
        dtype = self._result_dtype(op_type, inputs, attrs)
        attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.fresh(op_type + "_node"),
                                           domain=domain or None, **attrs))
        for name in names:
            if dtype is not None:
                self.dtypes[name] = dtype
        return names

    def constant(self, value: np.ndarray) -> str:
        name = self.fresh("const")
        self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        self.dtypes[name] = np.asarray(value).dtype
        self.known[name] = np.asarray(value)
        return name

    def shape_of(self, name):
        return self.shapes.get(name)

    def dtype_of(self, name):
        if name not in self.dtypes:
            raise GradientError(f"tensor '{name}' has no known element type")
        return self.dtypes[name]

    def _result_dtype(self, op_type, inputs, attrs):
        if op_type in ("Shape", "Size", "ArgMax", "ArgMin", "NonZero"):
            return np.dtype(np.int64)
        if op_type in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or"):
            return np.dtype(bool)
        if op_type == "Cast":
            return helper.tensor_dtype_to_np_dtype(attrs["to"])
        if op_type == "ConstantOfShape":
            return np.asarray(attrs["value"]).dtype if isinstance(attrs.get("value"), np.ndarray) else \
                np.dtype(np.float32)
        if op_type == "Where":
            return self.dtypes.get(inputs[1])
        return next((self.dtypes[i] for i in inputs if i in self.dtypes and is_float(self.dtypes[i])),
                    self.dtypes.get(inputs[0]) if inputs else None)


@dataclass
class Gradients:
    """The backward pass: its nodes and constants, and the gradient of each asked-for tensor
    (None where the scalar does not depend on it)."""

    nodes: list
    constants: list
    of: dict[str, str | None]


def graph_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    """Shapes (ints, symbols or None per dim) and dtypes of every tensor the model names,
    from its inputs, outputs, initializers and ``value_info`` (run shape inference first)."""
    shapes, dtypes = {}, {}
    graph = model.graph
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        kind = value.type.tensor_type
        if not value.type.HasField("tensor_type") or kind.elem_type == 0:
            continue
        dtypes[value.name] = np.dtype(helper.tensor_dtype_to_np_dtype(kind.elem_type))
        if kind.HasField("shape"):
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else
                                       (d.dim_param or None) for d in kind.shape.dim)
    for tensor in graph.initializer:
        dtypes[tensor.name] = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        shapes[tensor.name] = tuple(tensor.dims)
    return shapes, dtypes


def known_constants(model: onnx.ModelProto, limit: int = 64) -> dict[str, np.ndarray]:
    """Values of the small inline initializers and of Constant nodes (axes, shapes, pads)."""
    found = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(tensor.dims)) <= limit:
            found[tensor.name] = numpy_helper.to_array(tensor)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    found[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name == "value_ints":
                    found[node.output[0]] = np.asarray(list(attr.ints), dtype=np.int64)
                elif attr.name == "value_int":
                    found[node.output[0]] = np.asarray(attr.i, dtype=np.int64)
                elif attr.name == "value_float":
                    found[node.output[0]] = np.asarray(attr.f, dtype=np.float32)
    return found


def gradients(model: onnx.ModelProto, scalar: str, wrt: list[str]) -> Gradients:
    """The gradient of tensor ``scalar`` (one element) with respect to each of ``wrt``.

    ``model`` must carry inferred shapes (``value_info``). Raises ``GradientError`` where an
    operator on a path from ``wrt`` to ``scalar`` has no rule, or a rule cannot hold."""
    shapes, dtypes = graph_types(model)
    if scalar not in dtypes or not is_float(dtypes[scalar]):
        raise GradientError(f"the loss '{scalar}' is not a float tensor of the graph")
    nodes = list(model.graph.node)
    producer = {out: n for n in nodes for out in n.output if out}
    tape = _Tape(shapes, dtypes, known_constants(model))

    # forward: what depends on the tensors asked for, through float tensors only
    active = {name for name in wrt if is_float(dtypes.get(name, np.int64))}
    for node in nodes:
        if any(i in active for i in node.input):
            active.update(o for o in node.output if o and is_float(dtypes.get(o, np.int64)))
    if scalar not in active:
        return Gradients([], [], {name: None for name in wrt})
    # backward: what the scalar depends on
    useful, stack = {scalar}, [scalar]
    while stack:
        node = producer.get(stack.pop())
        if node is None:
            continue
        for name in node.input:
            if name and name in active and name not in useful:
                useful.add(name)
                stack.append(name)

    seed = tape.constant(np.ones(_static(shapes.get(scalar, ())), dtype=dtypes[scalar]))
    parts: dict[str, list[str]] = {scalar: [seed]}
    for node in reversed(nodes):
        if not any(o in parts for o in node.output):
            continue
        needs = [bool(i) and i in useful for i in node.input]
        if not any(needs):
            continue
        output_grads = [_summed(tape, parts.pop(o, None), o, node) for o in node.output]
        rule = registry.grad_of(node.op_type, node.domain)
        if rule is None:
            reason = f"an input ({next(i for i, n in zip(node.input, needs) if n)}) on the path to the loss"
            raise GradientError(f"no gradient rule for {node.op_type} node '{node.name}': {reason}",
                                hint="freeze the weights before it (--frozen), or report the operator")
        tape.where = node.name or node.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        try:
            found = rule(GradNode(node, attrs, output_grads, needs, tape))
        except GradientError:
            raise
        except Exception as exc:  # a rule that cannot hold on this node: say where
            raise GradientError(f"gradient of {node.op_type} node '{node.name}' failed: {exc}") from exc
        for name, grad, need in zip(node.input, list(found) + [None] * len(node.input), needs):
            if need and grad is not None:
                parts.setdefault(name, []).append(grad)
    tape.where = "sum"
    result = {name: _summed(tape, parts.get(name), name, None) for name in wrt}
    return Gradients(tape.nodes, tape.constants, result)


def _summed(tape: _Tape, parts: list[str] | None, name: str, node) -> str | None:
    """The sum of a tensor's gradient contributions (recorded with the tensor's shape)."""
    if not parts:
        return None
    total = parts[0] if len(parts) == 1 else tape.emit("Sum", parts, 1, {}, "")[0]
    if name in tape.shapes:
        tape.shapes[total] = tape.shapes[name]
    if name in tape.dtypes:
        tape.dtypes.setdefault(total, tape.dtypes[name])
    return total


def _static(shape) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else 1 for d in shape)
