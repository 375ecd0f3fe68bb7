"""Provider-neutral constant folding: the canonical model is the user's computation.

Only what produces small tensors is folded: Constant nodes become initializers; Shape
and Size of tensors whose shape is static become constants; a node whose inputs are all
constants (small initializers or values folded before) and whose outputs have at most
``SMALL_ELEMENTS`` elements is evaluated by onnxruntime's CPU provider (onnx's reference
evaluator for what onnxruntime cannot run) and replaced by initializers. Shape inference
with data propagation runs between passes until nothing changes; dead nodes and unused
initializers go last. Nothing else is rewritten: no casts, fusions or layouts one
execution provider needs (each provider adds its own when a rank loads its program).

Large initializers (weights) are never read: they take part as dims and dtypes only.
Initializers that are also graph inputs can be overridden at run time (IR < 4), so they
are not constants.
"""

from __future__ import annotations

from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.errors import ModelError
from meshplan.model.contrib_shapes import infer_with_contrib
from meshplan.model.opsets import set_ir_version

SMALL_ELEMENTS = 64 * 1024
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli"}
# Quantization boundaries are the user's computation, as in onnxruntime's own folding: a
# dequantized weight stays its quantized initializer and a DequantizeLinear node (folding
# it would store the weight in float, several times its size).
QUANTIZATION = {"DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear"}
_SUBGRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def first_line(exc: BaseException) -> str:
    """An exception's message as one line: its first line, or where that ends in a colon
    (onnx's checker puts the node on the next lines) its lines joined; at most 300 characters."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line = " ".join(lines)
    return line[:300]


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference, strict, with data propagation for shape tensors.

    Where strict inference rejects a node that onnxruntime runs (onnx's own function
    body of an operator in an older IR, e.g. MeanVarianceNormalization-13 in IR 7), lenient inference
    is taken instead if it still gives every node output a static shape."""
    def onnx_infer(strict: bool):
        return lambda m: onnx.shape_inference.infer_shapes(m, strict_mode=strict, data_prop=True)

    def infer(strict: bool) -> onnx.ModelProto:
        return infer_with_contrib(model, onnx_infer(strict), onnx_infer(False))

    try:
        return infer(True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        error = ModelError(f"shape inference failed: {first_line(exc)}")
    try:
        lenient = infer(False)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        raise error from None
    types = _tensor_types(lenient)
    if any(name and types.get(name, (0, None))[1] is None for node in lenient.graph.node for name in node.output):
        raise error
    return lenient


def is_loaded(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location != onnx.TensorProto.EXTERNAL


def fold_constants(model: onnx.ModelProto, limit: int = SMALL_ELEMENTS,
                   seen: dict[str, tuple[int, ...]] | None = None) -> onnx.ModelProto:
    """Fold ``model`` in place (see the module's description) and return it. ``seen``, when
    given, receives the static shape of every tensor any pass knew, folded ones included
    (the shapes of a model whose nodes folding removes)."""
    overridable = {value.name for value in model.graph.input}
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                 if t.name not in overridable and is_loaded(t) and prod(t.dims) <= limit}
    while True:
        types = _tensor_types(infer_shapes(model))
        if seen is not None:
            seen.update((name, shape) for name, (_, shape) in types.items() if shape is not None)
        if not _fold_pass(model, constants, types, limit):
            break
    if seen is not None:
        seen.update((name, tuple(np.shape(value))) for name, value in constants.items())
    drop_dead_code(model)
    del model.graph.value_info[:]
    return model


def _tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    """Name → (element type, static shape or None) of every typed tensor."""
    found = {t.name: (t.data_type, tuple(t.dims)) for t in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        kind = value.type.tensor_type
        if not value.type.HasField("tensor_type") or value.name in found:
            continue
        dims = kind.shape.dim
        static = kind.HasField("shape") and all(d.HasField("dim_value") for d in dims)
        found[value.name] = (kind.elem_type, tuple(d.dim_value for d in dims) if static else None)
    return found


def _fold_pass(model: onnx.ModelProto, constants: dict[str, np.ndarray],
               types: dict[str, tuple[int, tuple[int, ...] | None]], limit: int) -> bool:
    """One pass over the nodes; True when something was folded."""
    graph_outputs = {value.name for value in model.graph.output}
    direct: dict[str, onnx.TensorProto] = {}   # Constant, Shape and Size outputs
    pending: list[onnx.NodeProto] = []          # nodes to evaluate
    available = set(constants)
    for node in model.graph.node:
        if any(name in graph_outputs for name in node.output):
            continue
        tensor = _direct_value(node, types)
        if tensor is not None:
            direct[node.output[0]] = tensor
            if is_loaded(tensor) and prod(tensor.dims) <= limit:
                constants[node.output[0]] = numpy_helper.to_array(tensor)
                available.add(node.output[0])
        elif _evaluable(node, available, types, limit):
            pending.append(node)
            available.update(name for name in node.output if name)
    results = evaluate(pending, constants, types, model.opset_import) if pending else {}
    constants.update(results)
    folded = set(direct) | set(results)
    if not folded:
        return False
    kept = [node for node in model.graph.node if not (any(node.output) and all(n in folded for n in node.output if n))]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.graph.initializer.extend(direct.values())
    model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in results.items())
    return True


def _direct_value(node: onnx.NodeProto, types) -> onnx.TensorProto | None:
    """The value of a Constant node, or of Shape / Size of a static shape; else None."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    name = node.output[0]
    if node.op_type == "Constant":
        return _constant_tensor(node, name)
    if node.op_type not in ("Shape", "Size") or not node.input:
        return None
    shape = types.get(node.input[0], (0, None))[1]
    if shape is None:
        return None
    if node.op_type == "Size":
        return numpy_helper.from_array(np.array(prod(shape), dtype=np.int64), name)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return numpy_helper.from_array(np.array(shape[start:end], dtype=np.int64), name)


def _constant_tensor(node: onnx.NodeProto, name: str) -> onnx.TensorProto | None:
    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
        tensor.name = name
        return tensor
    lists = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64, "value_string": np.object_, "value_strings": np.object_}
    if attr.name not in lists:
        return None   # sparse_value: left as a node
    value = helper.get_attribute_value(attr)
    if attr.name.startswith("value_string"):
        value = [v.decode() for v in value] if isinstance(value, list) else value.decode()
    return numpy_helper.from_array(np.array(value, dtype=lists[attr.name]), name)


def _evaluable(node: onnx.NodeProto, available: set[str], types, limit: int) -> bool:
    if node.op_type in NONDETERMINISTIC or node.op_type in QUANTIZATION or not any(node.output):
        return False
    if any(attr.type in _SUBGRAPH_TYPES for attr in node.attribute):
        return False
    if not all(name in available for name in node.input if name):
        return False
    for name in node.output:
        shape = types.get(name, (0, None))[1] if name else ()
        if shape is None or prod(shape) > limit:
            return False
    return True


def evaluate(nodes: list[onnx.NodeProto], values: dict[str, np.ndarray], types,
             opsets) -> dict[str, np.ndarray]:
    """Outputs of ``nodes`` (in topological order) computed from ``values``.

    All nodes in one onnxruntime model first; if that fails, node by node, each with
    onnxruntime or else onnx's reference evaluator; a node neither can run is left out."""
    try:
        return _run(nodes, values, types, opsets)
    except Exception:  # onnxruntime raises several unrelated exception types
        pass
    results: dict[str, np.ndarray] = {}
    for node in nodes:
        known = {**values, **results}
        if not all(name in known for name in node.input if name):
            continue
        for reference in (False, True):
            try:
                results.update(_run([node], known, types, opsets, reference))
                break
            except Exception:  # an op neither evaluator runs stays a node
                continue
    return results


def _run(nodes, values, types, opsets, reference: bool = False) -> dict[str, np.ndarray]:
    produced = {name for node in nodes for name in node.output if name}
    needed = dict.fromkeys(name for node in nodes for name in node.input if name and name not in produced)
    outputs = [helper.make_tensor_value_info(name, types[name][0], None)
               for node in nodes for name in node.output if name]
    graph = helper.make_graph(list(nodes), "fold", [], outputs,
                              initializer=[numpy_helper.from_array(values[name], name) for name in needed])
    model = set_ir_version(helper.make_model(graph, opset_imports=list(opsets)))
    names = [value.name for value in outputs]
    if reference:
        from onnx.reference import ReferenceEvaluator

        found = ReferenceEvaluator(model).run(None, {})
    else:
        import onnxruntime as ort

        from meshplan.providers import session_options

        options = session_options(threads=1)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4   # a failure falls back: no log of it
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        found = session.run(names, {})
    return {name: np.asarray(value) for name, value in zip(names, found)}


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names the node's subgraphs read (outer-scope values among them)."""
    found: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for graph in graphs:
            for inner in graph.node:
                found.update(inner.input)
                found |= _subgraph_inputs(inner)
    return found


def _drop_unread_outputs(node: onnx.NodeProto, needed: set[str], opsets: dict[str, int]) -> None:
    """Blank the optional outputs of ``node`` that nothing reads (a Dropout's mask)."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    names = list(node.output)
    for index, name in enumerate(names):
        if name and name not in needed and index < len(schema.outputs) and schema.outputs[index].option == optional:
            names[index] = ""
    while names and not names[-1]:
        names.pop()
    del node.output[:]
    node.output.extend(names)


def drop_dead_code(model: onnx.ModelProto) -> None:
    """Remove nodes no graph output depends on and optional outputs nothing reads, then
    unused initializers (and the graph inputs that only declared them)."""
    graph = model.graph
    opsets = {(op.domain or ""): op.version for op in model.opset_import}
    needed = {value.name for value in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output if name):
            _drop_unread_outputs(node, needed, opsets)
            kept.append(node)
            needed.update(node.input)
            needed |= _subgraph_inputs(node)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    unused = {t.name for t in graph.initializer if t.name not in needed}
    initializers = [t for t in graph.initializer if t.name not in unused]
    inputs = [value for value in graph.input if value.name not in unused]
    del graph.initializer[:], graph.input[:]
    graph.initializer.extend(initializers)
    graph.input.extend(inputs)
