"""Reverse mode over an ONNX graph: the gradient of a scalar with respect to chosen tensors,
as standard ONNX nodes appended to the graph.

Each operator's rule lives in the op registry beside its sharding rule (``ops.registry.
gradient``; the words rules are written in: ``ops/grad_words.py``). Only float tensors
carry gradients: integer, boolean and shape paths carry none. A tensor read by several
operators (a tied embedding, a weight behind a Transpose or Cast, a broadcast bias) gets
the sum of its gradients. An operator on a gradient path with no rule is a
``GradientError`` naming the op and the node: never a silently wrong gradient. Tensors
whose type the model does not give (shape inference not run, or the outputs of com.microsoft
operators, which onnx's inference does not know) are typed here (``_complete_types``); one
still untyped is taken to carry a gradient, so an operator without a rule behind it is an
error rather than a path dropped. The forward graph is read, never changed (a training-mode
Dropout needs its mask output: ``training/step_model.py`` names it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.ops import registry
from meshplan.ops.grad_words import Dim, GradientError, GradNode

PREFIX = "grad"
WEIGHT = "weight:"     # Gradients.origin of the nodes that sum an asked-for tensor's addends


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
    owner: str = ""                         # what the nodes written now belong to (``origin``)
    origin: dict = field(default_factory=dict)
    count: int = 0
    opset: int = 18                         # the model's default-domain opset

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{PREFIX}/{self.where}/{hint}_{self.count}"

    def emit(self, op_type, inputs, outputs, attrs, domain) -> list[str]:
        names = [self.fresh(op_type) for _ in range(outputs)]
        dtype = self._result_dtype(op_type, inputs, attrs)
        attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.fresh(op_type + "_node"),
                                           domain=domain or None, **attrs))
        self.origin[self.nodes[-1].name] = self.owner
        for index, name in enumerate(names):
            found = _OUTPUT_DTYPES.get((op_type, index), dtype)
            if found is not None:
                self.dtypes[name] = np.dtype(found)
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


# outputs other than the first whose element type is not their operator's data type
_OUTPUT_DTYPES = {("MaxPool", 1): np.int64, ("TopK", 1): np.int64, ("Dropout", 1): np.bool_,
                  ("Unique", 1): np.int64, ("Unique", 2): np.int64, ("Unique", 3): np.int64}


@dataclass
class Gradients:
    """The backward pass: its nodes and constants, and the gradient of each asked-for tensor
    (None where the scalar does not depend on it)."""

    nodes: list
    constants: list
    of: dict[str, str | None]
    # each backward node's forward node (by name), or WEIGHT + the name of the asked-for
    # tensor whose gradient addends it sums: where a pipeline stage puts it
    origin: dict[str, str] = field(default_factory=dict)


def graph_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    """Shapes (ints, symbols or None per dim) and dtypes of every tensor the model names,
    from its inputs, outputs, initializers and ``value_info`` (run shape inference first)."""
    shapes, dtypes = {}, {}
    graph = model.graph
    _read_values(list(graph.input) + list(graph.output) + list(graph.value_info), shapes, dtypes)
    for tensor in graph.initializer:
        dtypes[tensor.name] = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        shapes[tensor.name] = tuple(tensor.dims)
    return shapes, dtypes


def tensor_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    """``graph_types`` of ``model`` after onnx's shape inference, completed where it leaves
    tensors untyped (``_complete_types``)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:   # noqa: BLE001 (best effort: the model's own value_info then)
        inferred = model
    shapes, dtypes = graph_types(inferred)
    if any(o and o not in dtypes for n in model.graph.node for o in n.output):
        _complete_types(model, shapes, dtypes)
    return shapes, dtypes


def _read_values(values, shapes: dict, dtypes: dict) -> None:
    for value in values:
        kind = value.type.tensor_type
        if not value.type.HasField("tensor_type") or kind.elem_type == 0:
            continue
        dtypes[value.name] = np.dtype(helper.tensor_dtype_to_np_dtype(kind.elem_type))
        if kind.HasField("shape"):
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else
                                       (d.dim_param or None) for d in kind.shape.dim)


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
    nodes = list(model.graph.node)
    if any(o and o not in dtypes for n in nodes for o in n.output):
        _complete_types(model, shapes, dtypes)
    if scalar in dtypes and not is_float(dtypes[scalar]):
        raise GradientError(f"the loss '{scalar}' is not a float tensor of the graph")
    producer = {out: n for n in nodes for out in n.output if out}
    if scalar not in dtypes and scalar not in producer:
        raise GradientError(f"the loss '{scalar}' is not a tensor of the graph")
    tape = _Tape(shapes, dtypes, known_constants(model), opset=_default_opset(model))
    reads = {id(n): list(n.input) + sorted(_outer_names(n)) for n in nodes}   # with what subgraphs read

    # forward: what depends on the tensors asked for, through float tensors only (and
    # tensors of unknown type: taken to carry a gradient, so none is dropped unseen)
    active = {name for name in wrt if _may_be_float(dtypes, name)}
    for node in nodes:
        if any(i in active for i in reads[id(node)]):
            active.update(o for o in node.output if o and _may_be_float(dtypes, o))
    if scalar not in active:
        return Gradients([], [], {name: None for name in wrt})
    # backward: what the scalar depends on
    useful, stack = {scalar}, [scalar]
    while stack:
        node = producer.get(stack.pop())
        if node is None:
            continue
        for name in reads[id(node)]:
            if name and name in active and name not in useful:
                useful.add(name)
                stack.append(name)

    seed = tape.constant(np.ones(_static(shapes.get(scalar, ())), dtype=dtypes.get(scalar, np.float32)))
    parts: dict[str, list[str]] = {scalar: [seed]}
    for node in reversed(nodes):
        if not any(o in parts for o in node.output):
            continue
        needs = [bool(i) and i in useful for i in node.input]
        hidden = [name for name in reads[id(node)][len(node.input):] if name in useful]
        if hidden:   # a subgraph reads a tensor on the path: no rule differentiates through one
            raise GradientError(f"no gradient rule for {node.op_type} node '{node.name}': its subgraph "
                                f"reads {hidden[0]}, on the path to the loss",
                                hint="freeze the weights before it (--frozen), or report the operator")
        if not any(needs):
            continue
        tape.owner = node.name
        output_grads = [_take(tape, parts, o) for o in node.output]
        rule = registry.grad_of(node.op_type, node.domain)
        if rule is None:
            raise _no_rule(node, needs)
        tape.where = node.name or node.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        try:
            found = rule(GradNode(node, attrs, output_grads, needs, tape))
        except Exception as exc:  # a rule that cannot hold on this node: say where
            # (an operator without a rule further up, whose outputs no inference typed, is
            # the likelier cause of a shape missing here: name it instead)
            upstream = _ruleless_upstream(nodes[:nodes.index(node)], useful)
            if upstream is not None:
                raise upstream from exc
            if isinstance(exc, GradientError):
                raise
            raise GradientError(f"gradient of {node.op_type} node '{node.name}' failed: {exc}") from exc
        for name, grad, need in zip(node.input, list(found) + [None] * len(node.input), needs):
            if need and grad is not None:
                parts.setdefault(name, []).append(grad)
    tape.where = "sum"
    result = {}
    for name in wrt:
        tape.owner = WEIGHT + name
        result[name] = _take(tape, parts, name)
    return Gradients(tape.nodes, tape.constants, result, tape.origin)


def _take(tape: _Tape, parts: dict[str, list[str]], name: str) -> str | None:
    """Tensor ``name``'s gradient, its addends summed once (a tensor asked for that is also
    the output of a node on the path keeps its gradient for the answer)."""
    if not name or name not in parts:
        return None
    total = _summed(tape, parts[name], name, None)
    parts[name] = [total]
    return total


def _no_rule(node, needs: list[bool]) -> GradientError:
    reason = f"an input ({next(i for i, n in zip(node.input, needs) if n)}) on the path to the loss"
    domain = f" ({node.domain})" if node.domain not in ("", "ai.onnx") else ""
    return GradientError(f"no gradient rule for {node.op_type}{domain} node '{node.name}': {reason}",
                         hint="freeze the weights before it (--frozen), or report the operator")


def _ruleless_upstream(before: list, useful: set) -> GradientError | None:
    """The error for the last node of ``before`` on the path (an output and an input the loss
    depends on) that has no rule, if any."""
    for node in reversed(before):
        if any(o in useful for o in node.output) and registry.grad_of(node.op_type, node.domain) is None:
            needs = [bool(i) and i in useful for i in node.input]
            if any(needs):
                return _no_rule(node, needs)
    return None


def _may_be_float(dtypes: dict, name: str) -> bool:
    return name not in dtypes or is_float(dtypes[name])


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)


def _outer_names(node) -> set[str]:
    """The tensors of enclosing graphs that ``node``'s subgraphs (If, Loop, Scan) read."""
    found: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
        for graph in graphs:
            inner = {i.name for i in graph.input} | {t.name for t in graph.initializer}
            for sub in graph.node:
                found.update(i for i in list(sub.input) + sorted(_outer_names(sub)) if i and i not in inner)
                inner.update(sub.output)
    return found


# Operators with gradient rules that onnx's inference does not type (com.microsoft ones, and
# onnxruntime's default-domain normalisations where onnx has no schema), typed here:
# (domain, op) → {output: "like" (input 0's shape and type) or "stats" (input 0's shape with
# the normalised dims, from ``axis``, 1; float32: mean, inv_std_var)}
_CONTRIB_TYPES = {
    ("com.microsoft", "SkipLayerNormalization"): {0: "like", 1: "stats", 2: "stats", 3: "like"},
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): {0: "like", 1: "stats", 2: "stats", 3: "like"},
    ("", "SimplifiedLayerNormalization"): {0: "like", 1: "stats"},
    ("", "LayerNormalization"): {0: "like", 1: "stats", 2: "stats"},
    ("", "GroupNormalization"): {0: "like"},
    **{("com.microsoft", op): {0: "like"} for op in ("FastGelu", "BiasGelu", "Gelu", "QuickGelu")},
}


def _complete_types(model: onnx.ModelProto, shapes: dict, dtypes: dict) -> None:
    """The shapes and types onnx's inference left out (com.microsoft operators and what
    follows them): those ``_CONTRIB_TYPES`` gives, then onnx's inference from there (on a
    light copy: large initializers become typed inputs); where some are still missing,
    onnxruntime's symbolic shape inference (sympy: slow to import), and onnx's again. A
    known type is never replaced; a tensor still untyped stays so."""
    def untyped() -> int:
        return sum(1 for n in model.graph.node for o in n.output if o and o not in dtypes)

    def onnx_pass() -> None:
        _table_types(model, shapes, dtypes)
        try:
            _merge(onnx.shape_inference.infer_shapes(_seeded(model, shapes, dtypes), data_prop=True), shapes, dtypes)
        except Exception:   # noqa: BLE001 (best effort)
            pass

    onnx_pass()
    if not untyped():
        return
    found_shapes, found_dtypes = {}, {}
    _read_values(_symbolic_values(_seeded(model, shapes, dtypes)), found_shapes, found_dtypes)
    if not found_dtypes:
        return
    for name, dtype in found_dtypes.items():
        dtypes.setdefault(name, dtype)
    for name, shape in found_shapes.items():
        shapes.setdefault(name, shape)
    onnx_pass()


def _symbolic_values(model: onnx.ModelProto) -> list:
    """The value infos onnxruntime's symbolic shape inference finds, as far as it gets (its
    ``infer_shapes`` would write a file into the working directory where it stops short)."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inference = SymbolicShapeInference(2**31 - 1, True, False, 0)
    except Exception:   # noqa: BLE001 (not installed)
        return []
    try:
        inference._preprocess(model)
        while inference.run_:
            inference._infer_impl()
    except Exception:   # noqa: BLE001 (it cannot follow the model further: what it found so far)
        pass
    return list(getattr(inference, "known_vi_", {}).values())


def _table_types(model: onnx.ModelProto, shapes: dict, dtypes: dict) -> None:
    """The types ``_CONTRIB_TYPES`` gives, where input 0's is known."""
    for node in model.graph.node:
        kinds = _CONTRIB_TYPES.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        if not kinds or node.input[0] not in shapes or node.input[0] not in dtypes:
            continue
        shape = shapes[node.input[0]]
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
        normed = int(axis) % len(shape) if shape else 0
        for index, kind in kinds.items():
            out = node.output[index] if index < len(node.output) else ""
            if out and out not in dtypes:
                shapes[out] = shape if kind == "like" else shape[:normed] + (1,) * (len(shape) - normed)
                dtypes[out] = dtypes[node.input[0]] if kind == "like" else np.dtype(np.float32)


def _seeded(model: onnx.ModelProto, shapes: dict, dtypes: dict, limit: int = 64) -> onnx.ModelProto:
    """A copy of ``model`` for shape inference: its nodes, the small initializers (shape
    constants), the large ones as typed inputs, every known type as ``value_info``."""
    graph = model.graph
    small = [t for t in graph.initializer if int(np.prod(t.dims)) <= limit and
             t.data_location != onnx.TensorProto.EXTERNAL]
    large = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer
             if int(np.prod(t.dims)) > limit or t.data_location == onnx.TensorProto.EXTERNAL]
    given = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype),
                                           list(shapes[name]) if name in shapes else None)
             for name, dtype in dtypes.items() if name not in given]
    copy = helper.make_graph(list(graph.node), graph.name, list(graph.input) + large, list(graph.output),
                             small, value_info=known)
    seeded = helper.make_model(copy, opset_imports=list(model.opset_import), functions=list(model.functions))
    seeded.ir_version = model.ir_version
    return seeded


def _merge(inferred, shapes: dict, dtypes: dict) -> None:
    if inferred is None:
        return
    more_shapes, more_dtypes = graph_types(inferred)
    for name, dtype in more_dtypes.items():
        dtypes.setdefault(name, dtype)
    for name, shape in more_shapes.items():
        if name not in shapes:
            shapes[name] = shape
        elif len(shapes[name]) == len(shape):
            shapes[name] = tuple(d if d is not None else e for d, e in zip(shapes[name], shape))


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
